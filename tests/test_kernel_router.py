"""The router's top-k kernel (schedules/router.py) against the graph's op `dsv41::route_topk`
(graph/ops.py: `stable_topk` of the biased scores, the unbiased weights, normalised, scaled).

Tolerance: ids exactly the oracle's (ties to the lower expert, NaN above everything, -0 equal
to +0); weights bit-identical to the oracle's arithmetic with the k weights summed in pick
order (the kernel's and TVM's generic sum's order), and within 4 fp32 ulps of torch's own sum
(its reduction order differs: measured at most 2 ulps on these cases); rows whose oracle
weights are NaN are NaN."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import cuda_build, tv

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.schedules import router as R

CPU = get_target("cpu")


@functools.cache
def _kernel(e: int, k: int, normalize: bool, route_scale: float, bias_rows: bool):
    func = R.build_route_topk("cpu", e=e, k=k, normalize=normalize, route_scale=route_scale,
                              bias_rows=bias_rows)
    return tvm.compile(func, target=CPU.tvm_target())


def _scores(n: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, e, generator=g).sigmoid()
    s[0] = 0.5  # every expert tied
    s[1, 3] = float("nan")
    s[2, : e // 2], s[2, e // 2 :] = -0.0, 0.0  # signed zeros tie
    s[3, -2:] = float("inf")
    s[4, : e // 4] = s[4, e // 4]  # a run of equal values
    return s


def _pick_order_weights(scores, ids, normalize, route_scale):
    w = scores.gather(1, ids)
    if not (normalize and ids.size(1) > 1):
        return w * route_scale
    total = torch.zeros(w.size(0))
    for j in range(w.size(1)):
        total = total + w[:, j]
    return w / (total + 1e-20).unsqueeze(1) * route_scale


@pytest.mark.parametrize("e,k,normalize,route_scale,bias_rows", [
    (256, 6, True, 2.5, False),  # bench's router
    (16, 2, True, 1.5, True),  # an image span's rows: a bias per row
    (64, 8, False, 0.7, False),
    (8, 1, True, 1.0, False),  # k = 1: no normalisation
])
def test_matches_the_oracle(e, k, normalize, route_scale, bias_rows):
    n = 41
    scores = _scores(n, e, seed=e + k)
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(*((n, e) if bias_rows else (e,)), generator=g) * 0.01
    if not bias_rows:
        bias[e // 2] = 0.0
    w, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    _kernel(e, k, normalize, route_scale, bias_rows)(tv(scores), tv(bias), tv(w), tv(ids))
    ref_w, ref_ids = ops.route_topk(scores, bias, k, normalize, route_scale)
    assert torch.equal(ids, ref_ids)
    nan = ref_w.isnan()
    assert torch.equal(w.isnan(), nan)
    exact = _pick_order_weights(scores, ids, normalize, route_scale)
    assert torch.equal(w[~nan], exact[~nan])
    ulps = (w[~nan].view(torch.int32) - ref_w[~nan].view(torch.int32)).abs()
    assert int(ulps.max()) <= 4


def test_refusals():
    with pytest.raises(ValueError, match="0 < k <= e"):
        R.make_route_topk(e=8, k=9, normalize=True, route_scale=1.0)
    s = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="route_topk takes fp32 scores"):
        ops.route_topk(s, torch.zeros(7), 2, True, 1.0)
    with pytest.raises(ValueError, match="route_topk takes fp32 scores"):
        ops.route_topk(s.double(), torch.zeros(8), 2, True, 1.0)
    with pytest.raises(ValueError, match="route_topk takes fp32 scores"):
        ops.route_topk(s, torch.zeros(8), 0, True, 1.0)


@pytest.mark.parametrize("bias_select", [False, True])
def test_cuda_build_has_device_code(tmp_path, bias_select):
    cuda_build(tmp_path, "router", "build_route_topk",
               dict(e=256, k=6, normalize=True, route_scale=2.5, bias_select=bias_select),
               "cuda-sm90")


@functools.cache
def _scored_kernel(e: int, k: int, bias_rows: bool, gate_temp: float):
    func = R.build_route_topk("cpu", e=e, k=k, normalize=True, route_scale=2.5,
                              bias_rows=bias_rows, gate_temp=gate_temp)
    return tvm.compile(func, target=CPU.tvm_target())


def _legalised_scores(logits: torch.Tensor, gate_temp: float) -> torch.Tensor:
    """sqrt(softplus(logits / gate_temp)) as the compiled graph computed it before the router
    kernel took it over: Relax's ops, legalised by TVM."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(tuple(logits.shape), "float32"))
    with bb.function("main", [x]):
        z = bb.emit(relax.op.divide(x, relax.const(gate_temp, "float32")))
        y = bb.emit(relax.op.sqrt(relax.op.nn.softplus(z, 1.0, 20.0)))
        bb.emit_func_output(y)
    ex = tvm.compile(relax.transform.LegalizeOps()(bb.get()), target=CPU.tvm_target())
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tv(logits.contiguous()))
    return torch.from_numpy(out.numpy())


@pytest.mark.parametrize("gate_temp", [1.0, 1.5])
@pytest.mark.parametrize("bias_rows", [False, True])
def test_logits_form_is_the_scores_kernel_then_route_topk(gate_temp, bias_rows):
    """route_topk_logits' kernel (the sqrt-softplus score computed in the row's block) picks the
    ids and weights the graph's legalised score kernel followed by route_topk's kernel gave, bit
    for bit (logits from -60 to 60: both sides of softplus' threshold, a row where 1 + exp(z)
    rounds to 1 everywhere), and
    agrees with the op's oracle (torch's softplus: log1p) within the top-k's tolerance."""
    e, k, n = 16, 2, 300
    g = torch.Generator().manual_seed(int(gate_temp * 10) + bias_rows)
    logits = (torch.rand(n, e, generator=g) - 0.5) * 120
    logits[0] = torch.linspace(-30, 30, e)
    logits[1] = torch.linspace(-40, -18, e) * gate_temp  # 1 + exp(z) rounds to 1: scores 0
    bias = torch.randn((n, e) if bias_rows else (e,), generator=g) * 0.1
    got_w, got_i = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    _scored_kernel(e, k, bias_rows, gate_temp)(tv(logits), tv(bias), tv(got_w), tv(got_i))
    scores = _legalised_scores(logits, gate_temp)
    want_w, want_i = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    _kernel(e, k, True, 2.5, bias_rows)(tv(scores), tv(bias), tv(want_w), tv(want_i))
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    # against torch's softplus (log1p): rows with a logit above -15 (below, the legalised
    # log(1 + exp(z)) is 0 where log1p is not: a row of such logits is all ties at 0 compiled,
    # as it was before this kernel; the model's gate never gives one)
    live = (logits / gate_temp).amax(1) > -15
    ref_w, ref_i = ops.route_topk_logits(logits, bias, k, True, 2.5, gate_temp)
    assert not bool(live[1]) and bool(live.float().mean() > 0.9)
    same = (got_i == ref_i).all(1) & live
    assert same.float().sum() >= 0.99 * live.float().sum()
    assert torch.allclose(got_w[same], ref_w[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gate_temp", [None, 1.5])
def test_selected_bias_is_the_where_then_the_row_bias_kernel(gate_temp):
    """The router picking each row's bias by its mask (`bias_select`: the image-span rows'
    `torch.where(vl_mask, bias_vl, bias)` folded in): ids and weights the per-row-bias kernel's
    on the where'd bias, bit for bit, with ties between the two biases' picks and masks of
    every kind (none, all, alternating)."""
    e, k, n = 16, 2, 300
    g = torch.Generator().manual_seed(3)
    scores = (torch.rand(n, e, generator=g) - 0.5) * 40 if gate_temp else _scores(n, e, 4)
    bias, bias_vl = torch.randn(e, generator=g) * 0.1, torch.randn(e, generator=g) * 0.1
    bias_vl[:4] = bias[:4]
    mask = torch.zeros(n, 1, dtype=torch.bool)
    mask[::3] = True
    mask[100:200] = True
    kw = dict(e=e, k=k, normalize=True, route_scale=2.5, gate_temp=gate_temp)
    sel = tvm.compile(R.build_route_topk("cpu", **kw, bias_select=True), target=CPU.tvm_target())
    rows = tvm.compile(R.build_route_topk("cpu", **kw, bias_rows=True), target=CPU.tvm_target())
    got_w, got_i = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    sel(tv(scores), tv(mask), tv(bias_vl), tv(bias), tv(got_w), tv(got_i))
    want_w, want_i = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    rows(tv(scores), tv(torch.where(mask, bias_vl, bias)), tv(want_w), tv(want_i))
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
    with pytest.raises(ValueError, match="not both"):
        R.make_route_topk(e=e, k=k, normalize=True, route_scale=1.0, bias_rows=True,
                          bias_select=True)
