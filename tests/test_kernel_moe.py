"""The split `moe_experts` chain of schedules/moe/ against the torch oracle (graph/ops.py).

Tolerance: the chain keeps the activations as exact dequantised fp32, adds 32-blocks in K
order times the weight scale and rounds to bf16 where the oracle rounds; the order of the 32
additions inside a block and torch's vectorised exp may differ by 1 fp32 ulp, so >= 99% of
outputs must be bit-equal to the oracle and the rest within 2 bf16 ulps (the bound of
tests/test_kernel_gemm.py's GEMMs, doubled for the two chained GEMMs). At these sizes it has in
fact matched the oracle exactly.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.schedules import moe
from dsv41.schedules.common import has_features
from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

CPU = "cpu"
LIMIT = 10.0
DIMS = {"dim": 64, "inter": 96, "n_experts": 6}
SMALL = {"dim": 256, "inter": 128, "n_experts": 4, "topk": 2}  # the `small` preset
BENCH = {"dim": 1024, "inter": 512, "n_experts": 16, "topk": 2}
FULL = {"dim": 5120, "inter": 2304, "n_experts": 384, "topk": 6}


@functools.cache
def _split(topk: int, hint: int | None, target: str = CPU, null_expert: bool = False,
           dims: tuple = tuple(DIMS.items())):
    mod = moe.build_moe_experts_split(target, topk=topk, swiglu_limit=LIMIT, n=hint,
                                      null_expert=null_expert, **dict(dims))
    return tvm.compile(mod, target=get_target(target).tvm_target())


def _zeros(buf: moe.MoeBuffer, dev=None, fill: float = 0.0) -> tvm.runtime.Tensor:
    dtype = ml_dtypes.bfloat16 if buf.dtype == "bfloat16" else buf.dtype
    value = fill if buf.dtype in ("bfloat16", "float32") else 0
    return tvm.runtime.tensor(np.full([int(s) for s in buf.shape], value, dtype),
                              dev or tvm.cpu())


def _run_chain(ex, args: list[torch.Tensor], topk: int, hint: int | None, target: str = CPU,
               dev=None, fill: float = 0.0, rows: int = 1, dims: dict = DIMS,
               plus: bool = False, fuse: bool = True) -> dict[str, tvm.runtime.Tensor]:
    """Run the plan's calls in order with caller-allocated intermediates, as Relax would (`fill`:
    their float contents before the chain; Relax leaves them uninitialised; `rows`: the verify
    entry's chain; `plus`: moe_experts_plus's, args ending with the shared output; `fuse`
    False: the six calls even where the plan has the two-call form)."""
    n = args[0].shape[0]
    plan = moe.moe_experts_plan(target, n=n, n_hint=hint, topk=topk, rows=rows, plus=plus,
                                fuse=fuse, **dims)
    env = {b.name: to_tvm(t, dev) for b, t in zip(plan.inputs, args, strict=True)}
    for b in (*plan.intermediates, plan.output):
        env[b.name] = _zeros(b, dev, fill)
    for call in plan.calls:
        ex[call.func](*[env[a] for a in call.args], *[env[o] for o in call.outs])
    return env


def _case(n: int, topk: int, ids: torch.Tensor | None = None, seed: int = 0,
          dims: dict = DIMS):
    args = moe.example_inputs_moe_experts(n=n, topk=topk, seed=seed, **dims)
    if ids is not None:
        args[2] = ids
    moe.check_expert_ids(args[2], dims["n_experts"])
    return args


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(t):
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _assert_close_to_oracle(out: torch.Tensor, ref: torch.Tensor) -> None:
    ulps = _bf16_ulps(out, ref)
    assert int(ulps.max()) <= 2, f"max {int(ulps.max())} bf16 ulps"
    assert float((ulps == 0).float().mean()) >= 0.99, f"{int((ulps > 0).sum())} outputs differ"


def _y(env) -> torch.Tensor:
    return torch.from_numpy(env["y"].numpy())


# ---- CPU numerics ----------------------------------------------------------------------------

# n=7: experts 0 and 5 shared by several tokens, 2 and 4 unused; n=40 spans several decode
# tiles, n=200 several prefill tiles (64 rows: ~67 rows per expert)
IDS7 = torch.tensor([[0, 5], [5, 0], [1, 5], [0, 3], [3, 1], [5, 3], [0, 1]])


@pytest.mark.parametrize("hint", [1, None])
def test_chain_matches_oracle(hint):
    ex = _split(2, hint)
    for n, ids in ((1, None), (2, None), (7, IDS7), (40, None), (200, None)):
        args = _case(n, 2, ids, seed=n)
        out = _y(_run_chain(ex, args, 2, hint))
        _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))


@functools.cache
@pytest.mark.parametrize("hint", [1, None])
def test_plus_chain_is_the_chain_plus_shared_rounded(hint):
    """moe_experts_plus' chain (moe_combine_plus adds the shared expert's bf16 output and
    stores bf16): every output is the plain chain's fp32 y plus the shared output, rounded to
    bf16 as torch rounds, bit for bit; and the op's oracle is `moe_experts` + shared, rounded."""
    ex = _split(2, hint)
    for n, ids in ((1, None), (7, IDS7), (40, None)):
        args = _case(n, 2, ids, seed=n)
        shared = (torch.randn(n, DIMS["dim"], generator=torch.Generator().manual_seed(n))
                  * 4).to(torch.bfloat16)
        y = _y(_run_chain(ex, args, 2, hint))
        got = to_torch(_run_chain(ex, [*args, shared], 2, hint, plus=True)["y"])
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), (y + shared).to(torch.bfloat16).view(torch.int16))
    ref = ops.moe_experts_plus(*args, LIMIT, shared)
    assert torch.equal(ref, (ops.moe_experts(*args, LIMIT) + shared).to(torch.bfloat16))


def _gemv_pair(form: str, dims: tuple):
    """moe_gate_up and moe_down of the decode GEMV form: "scheduled" (`schedule_moe_gemv`),
    "avx512" (hand-vectorised) or "avx512-bf16" (its sums on vdpbf16ps), compiled for the
    host, or "avx2" (the fp32 form in 256-bit vectors) compiled for `cpu-avx2`."""
    d = dict(dims)
    target = get_target(CPU)
    if form == "avx2":
        target = get_target("cpu-avx2")
        funcs = {"moe_gate_up": moe.make_moe_gate_up_gemv_avx512(topk=2, swiglu_limit=LIMIT,
                                                                 lanes=8, **d),
                 "moe_down": moe.make_moe_down_gemv_avx512(topk=2, lanes=8, **d)}
    elif form.startswith("avx512"):
        dot = "bf16" if form == "avx512-bf16" else "fp32"
        funcs = {"moe_gate_up": moe.make_moe_gate_up_gemv_avx512(topk=2, swiglu_limit=LIMIT,
                                                                 dot=dot, **d),
                 "moe_down": moe.make_moe_down_gemv_avx512(topk=2, dot=dot, **d)}
    else:
        cfg = moe.MoeSplitConfig(row_tile=4, tn=32, cb=4, kind="gemv")
        funcs = {"moe_gate_up": moe.schedule_moe_gemv(moe.make_moe_gate_up_gemv(
                     topk=2, swiglu_limit=LIMIT, **d), cfg, target, "h"),
                 "moe_down": moe.schedule_moe_gemv(moe.make_moe_down_gemv(topk=2, **d), cfg,
                                                   target, "o")}
    return {name: tvm.compile(f, target=target.tvm_target())[name] for name, f in funcs.items()}


def _has_bf16_dot() -> bool:
    return has_features(get_target(CPU), "avx512f", "fma", "avx512bf16", "avx512vbmi")


ODD = {"dim": 96, "inter": 64, "n_experts": 6}  # an odd number of 32-blocks along dim (3)


@pytest.mark.skipif(not has_features(get_target(CPU), "avx2", "fma"),
                    reason="this CPU has no AVX2")
@pytest.mark.parametrize("dims", [DIMS, ODD], ids=["dims", "odd-blocks"])
@pytest.mark.parametrize("form", ["scheduled", "avx2", "avx512", "avx512-bf16"])
def test_decode_gemv_forms_match_oracle(form, dims):
    """Every decode GEMV form in the chain (the host's other kernels around them): the scheduled
    one, which CPUs without AVX-512 take, the hand-vectorised one and its vdpbf16ps sums
    (partial 32-column tiles: inter 96 and dim 64 against 32-column tasks, and an odd number of
    32-blocks along K for each of the two GEMVs; one and several tokens, shared experts)."""
    if form == "avx512-bf16" and not _has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16 / VBMI")
    if form.startswith("avx512") and not has_features(get_target(CPU), "avx512f", "fma"):
        pytest.skip("this CPU has no AVX-512")
    chain = _split(2, 1, dims=tuple(dims.items()))
    pair = _gemv_pair(form, tuple(dims.items()))
    ex = {name: pair[name] if name in pair else chain[name] for name in
          ("moe_route", "moe_qdq_x", "moe_gate_up", "moe_qdq_h", "moe_down", "moe_combine")}
    for n, ids in ((1, None), (2, None), (7, IDS7)):
        args = _case(n, 2, ids, seed=n + 3, dims=dims)
        out = _y(_run_chain(ex, args, 2, 1, dims=dims, fuse=False))
        _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))


needs_avx512 = pytest.mark.skipif(not has_features(get_target(CPU), "avx512f", "fma"),
                                  reason="this CPU has no AVX-512")


@needs_avx512
@pytest.mark.parametrize("dims", [DIMS, ODD], ids=["dims", "odd-blocks"])
def test_avx2_gemvs_are_the_avx512_fp32_gemvs_bit_for_bit(dims):
    """The fp32 form in 256-bit vectors (`lanes=8`, compiled for `cpu-avx2`) sums every lane's
    products in the 512-bit form's order: h and y bit for bit, over 1..7 tokens, with negative
    zeros and the largest and smallest E8M0 scales in the weights."""
    key = tuple(dims.items())
    chain = _split(2, 1, dims=key)
    forms = {form: {name: pair[name] if name in pair else chain[name] for name in
                    ("moe_route", "moe_qdq_x", "moe_gate_up", "moe_qdq_h", "moe_down",
                     "moe_combine")}
             for form in ("avx2", "avx512") for pair in [_gemv_pair(form, key)]}
    for n, ids in ((1, None), (3, None), (7, IDS7 if dims["n_experts"] == 6 else None)):
        args = _case(n, 2, ids, seed=n + 41, dims=dims)
        args[3][0, :3] = 0x88  # -0 in both nibbles
        args[4][1, :2] = 100  # 2^-27 block scales
        args[6][2, 1] = 150  # 2^23
        out = {form: _run_chain(ex, args, 2, 1, dims=dims, fuse=False)
               for form, ex in forms.items()}
        for name in ("h", "y"):
            a, b = (out[f][name].numpy() for f in ("avx2", "avx512"))
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (n, name)


@functools.cache
def _verify_chain(dims: tuple = tuple(DIMS.items())):
    mod = moe.build_moe_experts_split(CPU, topk=2, swiglu_limit=LIMIT, n=1, rows=6, **dict(dims))
    return tvm.compile(mod, target=get_target(CPU).tvm_target())


@functools.cache
def _gemv_rows_pair(dot: str, dims: tuple):
    """The verify form's moe_gate_up and moe_down with `dot`, compiled for the host."""
    d = dict(dims)
    funcs = {"moe_gate_up": moe.make_moe_gate_up_rows_avx512(
                 topk=2, swiglu_limit=LIMIT, row_tile=4, dot=dot, **d),
             "moe_down": moe.make_moe_down_rows_avx512(topk=2, row_tile=4, dot=dot, **d)}
    target = get_target(CPU)
    return {name: tvm.compile(f, target=target.tvm_target())[name] for name, f in funcs.items()}


# six tokens on experts 0 and 5 (tiles of 4 + 2 rows each); then mixed runs of 1..3 rows
IDS6 = torch.tensor([[0, 5], [5, 0], [0, 5], [5, 0], [0, 5], [5, 0]])
IDS6_MIXED = torch.tensor([[0, 5], [5, 1], [1, 5], [2, 3], [3, 0], [4, 0]])


@needs_avx512
@pytest.mark.parametrize("dims", [DIMS, ODD], ids=["dims", "odd-blocks"])
@pytest.mark.parametrize("dot", ["fp32", "bf16"])
def test_verify_chain_rows_bit_identical_to_decode(dot, dims):
    """The verify entry's chain (`rows` > 1: each route tile's rows share every weight load,
    `make_moe_gate_up_rows_avx512` / `make_moe_down_rows_avx512`) gives every token the exact
    fp32 y the decode chain gives that token alone, with either sums (`dot`): 1..6 tokens,
    tiles of 1..4 rows of one expert, an expert with more rows than a tile, unused experts,
    partial 32-column tasks, odd numbers of 32-blocks."""
    if dot == "bf16" and not _has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16 / VBMI")
    assert moe.moe_split_config(get_target(CPU), n=1, topk=2, rows=6, **dims).rows
    key = tuple(dims.items())
    decode_pair, rows_pair = _gemv_pair(f"avx512{'-bf16' if dot == 'bf16' else ''}", key), \
        _gemv_rows_pair(dot, key)
    decode_chain, verify_chain = _split(2, 1, dims=key), _verify_chain(key)
    decode = {**{f: decode_chain[f] for f in ("moe_route", "moe_qdq_x", "moe_qdq_h",
                                              "moe_combine")}, **decode_pair}
    verify = {**{f: verify_chain[f] for f in ("moe_route", "moe_qdq_x", "moe_qdq_h",
                                              "moe_combine")}, **rows_pair}
    cases = [(1, None), (2, None), (5, None), (6, IDS6), (6, IDS6_MIXED)]
    for n, ids in cases:
        args = _case(n, 2, ids, seed=n + 11, dims=dims)
        y = _y(_run_chain(verify, args, 2, 1, rows=6, dims=dims))
        for i in range(n):
            one = [t[i:i + 1].clone() if j < 3 else t for j, t in enumerate(args)]
            ref = _y(_run_chain(decode, one, 2, 1, dims=dims, fuse=False))
            assert torch.equal(y[i:i + 1].view(torch.int32), ref.view(torch.int32)), (n, i)


@functools.cache
def _fused_decode(dot: str, null_expert: bool, dims: tuple):
    """The two-call decode chain (`moe_gate_up_route`, `moe_down_combine(_plus)`) with `dot`
    ("avx2": the fp32 sums in 256-bit vectors, compiled for `cpu-avx2`), and the six-call
    chain it replaces (route / QDQ / combine kernels of the split module, the GEMVs of the
    same form), compiled for the host."""
    d = dict(dims)
    lanes = 8 if dot == "avx2" else 16
    target = get_target("cpu-avx2" if dot == "avx2" else CPU).tvm_target()
    form = dict(dot="fp32" if dot == "avx2" else dot, lanes=lanes)
    fused = {
        "moe_gate_up_route": moe.make_moe_gate_up_gemv_avx512(
            topk=2, swiglu_limit=LIMIT, route=True, null_expert=null_expert, **form, **d),
        "moe_down_combine": moe.make_moe_down_gemv_avx512(topk=2, combine=True, **form, **d),
        "moe_down_combine_plus": moe.make_moe_down_gemv_avx512(topk=2, combine=True,
                                                               plus=True, **form, **d),
    }
    split = _split(2, 1, null_expert=null_expert, dims=dims)
    six = {f: split[f] for f in ("moe_route", "moe_qdq_x", "moe_qdq_h", "moe_combine",
                                 "moe_combine_plus")}
    six.update(_gemv_pair("avx2" if dot == "avx2" else
                          f"avx512{'-bf16' if dot == 'bf16' else ''}", dims))
    return {f: tvm.compile(fn, target=target)[f] for f, fn in fused.items()}, six


@pytest.mark.parametrize("dims", [DIMS, ODD], ids=["dims", "odd-blocks"])
@pytest.mark.parametrize("dot", ["fp32", "bf16", "avx2"])
@pytest.mark.parametrize("null_expert", [False, True], ids=["experts", "null-expert"])
def test_fused_decode_chain_bit_identical_to_six_calls(dot, dims, null_expert):
    """The decode plan's two calls (`moe.fused_decode`): route + QDQ + gate/up in one, QDQ +
    down + combine in the other, give the six kernels' row_pair, token_rows, h and y bit for
    bit, with and without the shared expert's output (`plus`), with either sums, for 1..9
    tokens, experts shared by several tokens, unused experts, a sharded worker's null expert
    (its pairs' rows of h NaN-free and y exactly the six calls')."""
    if dot == "bf16" and not _has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16 / VBMI")
    if not has_features(get_target(CPU), *(("avx2", "fma") if dot == "avx2"
                                           else ("avx512f", "fma"))):
        pytest.skip(f"this CPU cannot run the {dot} form")
    key = tuple(dims.items())
    fused, six = _fused_decode(dot, null_expert, key)
    plan = moe.moe_experts_plan(CPU, n=3, n_hint=1, topk=2, **dims)
    assert [c.func for c in plan.calls] == ["moe_gate_up_route", "moe_down_combine"]
    assert moe.fused_decode(moe.moe_split_config(get_target(CPU), n=1, topk=2, **dims))
    null = dims["n_experts"] - 1
    cases = [(1, None), (2, None), (5, None), (9, None)]
    cases += [(7, IDS7)] if dims["n_experts"] == 6 else []
    if null_expert:
        cases.append((6, torch.tensor([[0, null], [null, null], [1, null], [null, 2], [3, 4],
                                       [null, 0]])))
    for n, ids in cases:
        args = _case(n, 2, None, seed=n + 31, dims=dims)
        if ids is not None:
            args[2] = ids
            args[1] = torch.where(ids == null, 0.0, args[1]) if null_expert else args[1]
        shared = (torch.randn(n, dims["dim"], generator=torch.Generator().manual_seed(n))
                  * 4).to(torch.bfloat16)
        for plus in (False, True):
            a = [*args, shared] if plus else args
            ref = _run_chain(six, a, 2, 1, dims=dims, plus=plus, fuse=False)
            got = _run_chain(fused, a, 2, 1, dims=dims, plus=plus)
            for name in ("row_pair", "token_rows", "y"):
                assert np.array_equal(got[name].numpy().view(np.uint8),
                                      ref[name].numpy().view(np.uint8)), (n, plus, name)
            assert np.array_equal(got["h"].numpy().view(np.uint16),
                                  ref["h"].numpy().view(np.uint16)), (n, plus)


@needs_avx512
@pytest.mark.parametrize("bias_rows", [False, True], ids=["bias", "bias-rows"])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_chain_is_the_top_k_then_the_two_calls(bias_rows, normalize):
    """The decode chain that routes the gate's logits itself (`moe_gate_up_route_topk`, what
    the lowering emits when a `route_topk_logits` feeds only the MoE op): the route_topk
    kernel's weights and ids and the two-call chain's row_pair, token_rows, h and y on them,
    bit for bit; a bias per row (image spans) and one for all, normalised or not, 1..9 tokens,
    logits with ties."""
    from dsv41.schedules import router

    routing = router.TopkRouting(e=DIMS["n_experts"], k=2, normalize=normalize,
                                 route_scale=1.5, bias_rows=bias_rows, gate_temp=0.7)
    mod = moe.build_moe_experts_split(CPU, topk=2, swiglu_limit=LIMIT, n=1, routing=routing,
                                      **DIMS)
    target = get_target(CPU).tvm_target()
    ex = tvm.compile(mod, target=target)
    topk = tvm.compile(router.build_route_topk(
        CPU, e=routing.e, k=2, normalize=normalize, route_scale=1.5, bias_rows=bias_rows,
        gate_temp=0.7), target=target)
    for n in (1, 3, 9):
        args = _case(n, 2, seed=n + 41)
        g = torch.Generator().manual_seed(n)
        logits = torch.randn(n, routing.e, generator=g) * 3
        logits[0, 1] = logits[0, 4]  # a tie: the lower expert first
        bias = torch.randn(*((n, routing.e) if bias_rows else (routing.e,)), generator=g)
        shared = (torch.randn(n, DIMS["dim"], generator=g) * 4).to(torch.bfloat16)
        weights, ids = torch.zeros(n, 2), torch.zeros(n, 2, dtype=torch.int64)
        topk(*[to_tvm(t) for t in (logits, bias, weights, ids)])
        ref = _run_chain(ex, [args[0], weights, ids, *args[3:], shared], 2, 1, plus=True)
        plan = moe.moe_experts_plan(CPU, n=n, n_hint=1, topk=2, plus=True, routing=routing,
                                    **DIMS)
        assert [c.func for c in plan.calls] == ["moe_gate_up_route_topk",
                                                "moe_down_combine_plus"]
        env = {b.name: to_tvm(t) for b, t in zip(
            plan.inputs, [args[0], logits, bias, *args[3:], shared], strict=True)}
        env.update({b.name: _zeros(b) for b in (*plan.intermediates, plan.output)})
        for call in plan.calls:
            ex[call.func](*[env[a] for a in call.args], *[env[o] for o in call.outs])
        assert torch.equal(to_torch(env["weights"]), weights)
        assert torch.equal(to_torch(env["ids"]), ids)
        for name in ("row_pair", "token_rows", "h", "y"):
            assert np.array_equal(env[name].numpy().view(np.uint8),
                                  ref[name].numpy().view(np.uint8)), (n, name)
    with pytest.raises(ValueError, match="only in its two-call"):
        moe.moe_experts_plan(CPU, n=3, n_hint=None, topk=2, routing=routing, **DIMS)


@needs_avx512
@pytest.mark.parametrize("bias_rows", [False, True], ids=["bias", "bias-rows"])
def test_gate_chain_is_the_dense_gemv_then_the_routing_chain(bias_rows):
    """`moe_gate_up_route_gate` (the gate's logits formed in the kernel, `gemm.bf16_dot_rows`):
    the decode dense GEMV's logits (its own kernel, one row at a time as decode and verify
    run it) fed to the routing chain give the same weights, ids, h and y, bit for bit, for
    1..9 tokens, activations with denormal and zero elements."""
    if not _has_bf16_dot():
        pytest.skip("this CPU has no AVX-512 BF16 / VBMI")
    from dsv41.schedules import gemm, router

    e, dim = DIMS["n_experts"], DIMS["dim"]
    assert gemm.dense_gemv_is_bf16_dot(get_target(CPU), n=e, k=dim)
    routing = router.TopkRouting(e=e, k=2, normalize=True, route_scale=2.5,
                                 bias_rows=bias_rows, gate_temp=1.0)
    target = get_target(CPU).tvm_target()
    ex = tvm.compile(moe.build_moe_experts_split(CPU, topk=2, swiglu_limit=LIMIT, n=1,
                                                 routing=routing, gate=True, **DIMS),
                     target=target)
    dense = tvm.compile(gemm.build_dense_gemv(CPU, groups=1, n=e, k=dim, x_dtype="bfloat16",
                                              w_dtype="bfloat16"), target=target)
    g = torch.Generator().manual_seed(3)
    gate_w = (torch.randn(e, dim, generator=g) * dim**-0.5).to(torch.bfloat16)
    for n in (1, 4, 9):
        args = _case(n, 2, seed=n + 51)
        args[0][0, :3] = torch.tensor([1e-39, 0.0, -0.0]).to(torch.bfloat16)
        bias = torch.randn(*((n, e) if bias_rows else (e,)), generator=g) * 0.1
        logits = torch.zeros(n, 1, e)
        for i in range(n):  # the decode GEMV's one row
            dense(to_tvm(args[0][i:i + 1].clone().view(1, 1, dim)), to_tvm(gate_w),
                  to_tvm(row := torch.zeros(1, 1, e)))
            logits[i] = row[0]
        outs = {}
        for scores, gate in ((logits.view(n, e), False), (gate_w, True)):
            plan = moe.moe_experts_plan(CPU, n=n, n_hint=1, topk=2, routing=routing,
                                        gate=gate, **DIMS)
            env = {b.name: to_tvm(t) for b, t in zip(plan.inputs, [args[0], scores, bias,
                                                                   *args[3:]], strict=True)}
            env.update({b.name: _zeros(b) for b in (*plan.intermediates, plan.output)})
            for call in plan.calls:
                ex[call.func](*[env[a] for a in call.args], *[env[o] for o in call.outs])
            outs[gate] = env
        assert [c.func for c in plan.calls][0] == "moe_gate_up_route_gate"
        for name in ("weights", "ids", "row_pair", "token_rows", "h", "y"):
            assert np.array_equal(outs[True][name].numpy().view(np.uint8),
                                  outs[False][name].numpy().view(np.uint8)), (n, name)
    with pytest.raises(ValueError, match="only when it routes"):
        moe.moe_experts_plan(CPU, n=3, n_hint=1, topk=2, gate=True, **DIMS)


def test_verify_config_and_refusals():
    """Only the hand-vectorised decode GEMVs have the verify form; a tile of more rows than it
    unrolls is refused."""
    skx = get_target("cpu-x86-64").__class__(
        "cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
    assert moe.moe_split_config(skx, n=1, topk=2, rows=6, **DIMS).rows
    assert not moe.moe_split_config(skx, n=1, topk=2, **DIMS).rows  # decode
    assert not moe.moe_split_config(skx, n=None, topk=2, rows=6, **DIMS).rows  # prefill tiles
    assert not moe.moe_split_config(get_target("cpu-x86-64"), n=1, topk=2, rows=6, **DIMS).rows
    assert not moe.moe_split_config(get_target("cuda-sm90"), n=1, topk=2, rows=6, **DIMS).rows
    plan = moe.moe_experts_plan(CPU, n=3, n_hint=1, topk=2, rows=6, **DIMS)
    if has_features(get_target(CPU), "avx512f", "fma"):
        assert plan.calls[2].args[2:4] == ("row_pair", "tiles")
        assert plan.calls[4].args[:2] == ("hq", "tiles")
    with pytest.raises(ValueError, match=r"The verify expert GEMVs take tiles of 1\.\.4 rows; "
                                         r"got row_tile=5\."):
        moe.make_moe_down_rows_avx512(row_tile=5, topk=2, **DIMS)


def test_check_expert_ids():
    moe.check_expert_ids(torch.tensor([[0, 3], [2, 1]]), 4)
    moe.check_expert_ids(torch.zeros(0, 2, dtype=torch.int64), 4)
    bad = [
        (r"in \[0, 4\)", torch.tensor([[0, 4]])),
        (r"in \[0, 4\)", torch.tensor([[-1, 2]])),
        ("distinct", torch.tensor([[1, 1]])),
        ("integers", torch.tensor([[0.0, 1.0]])),
        ("2-D", torch.tensor([0, 1])),
    ]
    for message, ids in bad:
        with pytest.raises(ValueError, match=message):
            moe.check_expert_ids(ids, 4)


def test_chain_adds_in_expert_order():
    """topk 3 with ids listed in descending order: the fp32 sum must follow the expert ids."""
    ids = torch.tensor([[5, 2, 0], [4, 3, 1], [5, 4, 3], [2, 1, 0], [3, 0, 5]])
    args = _case(5, 3, ids, seed=11)
    out = _y(_run_chain(_split(3, None), args, 3, None))
    _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))


def test_chain_one_expert_for_all_tokens():
    """Every token on expert 4 (topk 1): one expert's run spans several full tiles plus a
    partial one, all other experts empty."""
    n = 37
    args = _case(n, 1, torch.full((n, 1), 4), seed=5)
    out = _y(_run_chain(_split(1, None), args, 1, None))
    _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))


def test_chain_no_tokens():
    """n = 0 (an empty batch): zero-sized tables and grids, an empty result."""
    args = _case(0, 2, torch.zeros(0, 2, dtype=torch.int64))
    assert _y(_run_chain(_split(2, None), args, 2, None)).shape == (0, DIMS["dim"])


def test_route_tables():
    """row_pair sorts the pairs by expert (stable); token_rows lists each token's rows in
    expert-id order; tiles cut each expert's run into <= row_tile rows, unused tiles zero."""
    ids = IDS7
    env = _run_chain(_split(2, None), _case(7, 2, ids, seed=7), 2, None)
    row_pair = env["row_pair"].numpy()
    token_rows, tiles = env["token_rows"].numpy(), env["tiles"].numpy()
    flat = ids.flatten().numpy()
    expect = np.argsort(flat, kind="stable")
    assert np.array_equal(row_pair, expect)
    pos = np.empty_like(expect)
    pos[expect] = np.arange(expect.size)
    for i in range(ids.shape[0]):
        order = np.argsort(ids[i].numpy())
        assert np.array_equal(token_rows[i], pos[i * 2 + order])
    row_tile = moe.moe_split_config(get_target(CPU), topk=2, **DIMS).row_tile
    used = tiles[tiles[:, 2] > 0]
    assert not tiles[len(used):].any()
    covered = np.concatenate([np.arange(r0, r0 + rows) for _, r0, rows in used])
    assert np.array_equal(covered, np.arange(flat.size))
    assert (used[:, 2] <= row_tile).all()
    assert all((flat[expect[r0:r0 + rows]] == e).all() for e, r0, rows in used)


def test_route_ranks_a_repeated_id_in_slot_order():
    """A sharded worker sends the pairs of other workers' experts to its null expert with
    weight 0 (graph/model.py `moe`), so an id may repeat in a row: each pair keeps its own row
    (every row listed once in token_rows) and the chain still matches the oracle."""
    null = DIMS["n_experts"] - 1
    ids = torch.tensor([[0, null], [null, null], [1, null], [null, 2], [3, 4]])
    args = moe.example_inputs_moe_experts(n=5, topk=2, seed=5, **DIMS)
    args[2] = ids
    args[1] = torch.where(ids == null, 0.0, args[1])
    env = _run_chain(_split(2, None), args, 2, None)
    assert sorted(env["token_rows"].numpy().flatten().tolist()) == list(range(10))
    out = _y(env)
    _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))
    assert not out[1].any()  # both pairs on the null expert: exactly zero


@pytest.mark.parametrize("hint", [1, None])
def test_a_sharded_workers_null_expert_costs_no_gemm_and_changes_no_bit(hint):
    """`null_expert` (a sharded worker's chain: the last expert is its null expert, taking the
    pairs routed to other workers with weight 0): those pairs get no tiles, so neither GEMM
    touches them (their rows of h and o, NaN here, are never written or read), and y is bit for
    bit the chain that computes them, itself within the oracle's bound."""
    null = DIMS["n_experts"] - 1
    ids = torch.tensor([[0, null], [null, null], [1, null], [null, 2], [3, 4], [null, 0]])
    args = moe.example_inputs_moe_experts(n=6, topk=2, seed=6, **DIMS)
    args[2] = ids
    args[1] = torch.where(ids == null, 0.0, args[1])
    every = _run_chain(_split(2, hint), args, 2, hint, fuse=False)
    skip = _run_chain(_split(2, hint, null_expert=True), args, 2, hint, fill=float("nan"),
                      fuse=False)
    tiles = skip["tiles"].numpy()
    used = tiles[tiles[:, 2] > 0]
    assert null not in used[:, 0].tolist()
    assert int(used[:, 2].sum()) == int((ids != null).sum())  # the GEMMs' rows: 7 of 12
    token_rows = skip["token_rows"].numpy()
    # the null expert's pairs rank last in expert-id order: -1 in the last slots
    assert (token_rows == -1).sum(axis=1).tolist() == (ids == null).sum(dim=1).tolist()
    assert (token_rows[1] == -1).all() and (token_rows[4] >= 0).all()
    y = _y(skip)
    assert torch.equal(y.view(torch.int32), _y(every).view(torch.int32))  # every bit
    _assert_close_to_oracle(y, ops.moe_experts(*args, LIMIT))
    assert not y[1].any()


def test_num_tiles_bound():
    """The bound holds for the worst case (every expert with a partial tile) and stays small for
    decode (P = topk), not n_experts."""
    assert moe.num_tiles(6, 16, 384) == 1 + 6
    for pairs, row_tile, experts in ((12, 4, 6), (40, 16, 6), (7, 16, 384)):
        counts = [pairs // experts + (e < pairs % experts) for e in range(experts)]
        need = sum(-(-c // row_tile) for c in counts)
        assert need <= moe.num_tiles(pairs, row_tile, experts)


@pytest.mark.parametrize("hint", [None, 1])
def test_plan_matches_module(hint):
    """Every call names a PrimFunc of the module with as many parameters as args + outs, and
    every intermediate is written before it is read (tile and GEMV builds)."""
    mod = moe.build_moe_experts_split(CPU, topk=2, swiglu_limit=LIMIT, n=hint, **DIMS)
    n = tirx.Var("n", "int64")
    plan = moe.moe_experts_plan(CPU, n=n, topk=2, n_hint=hint, **DIMS)
    ready = {b.name for b in plan.inputs}
    for call in plan.calls:
        assert len(mod[call.func].params) == len(call.args) + len(call.outs), call.func
        assert set(call.args) <= ready, call.func
        ready |= set(call.outs)
    assert plan.output.name in ready
    assert {b.name for b in plan.intermediates} <= ready


@pytest.mark.parametrize("hint", [None, 1])
def test_relax_chain_symbolic_n(hint):
    """The plan emitted as a Relax call_tir chain with a symbolic token count: Relax allocates
    the intermediates (shapes with min() included) and the result matches the oracle; hint 1
    is the decode build (the GEMV form of gate/up and down on CPU)."""
    mod = moe.build_moe_experts_split(CPU, topk=2, swiglu_limit=LIMIT, n=hint, **DIMS)
    plan = moe.moe_experts_plan(CPU, n=tirx.Var("n", "int64"), topk=2, n_hint=hint, **DIMS)
    bb = relax.BlockBuilder()
    params = [relax.Var(b.name, relax.TensorType(b.shape, b.dtype)) for b in plan.inputs]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(moe.emit_moe_experts(
                bb, plan, params, lambda f: bb.add_func(mod[f], f)))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=get_target(CPU).tvm_target()),
                              tvm.cpu())
    for n in (1, 9):
        args = _case(n, 2, seed=20 + n)
        y = torch.from_numpy(vm["main"](*[to_tvm(t) for t in args]).numpy())
        _assert_close_to_oracle(y, ops.moe_experts(*args, LIMIT))


def test_rejects_partial_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        moe.build_moe_experts_split(CPU, dim=48, inter=64, n_experts=2, topk=1,
                                    swiglu_limit=0.0)


# ---- CUDA builds -----------------------------------------------------------------------------

# One child build takes ~10-15 s here: the small preset on every arch and the full preset on
# sm_90 by default; the bench preset and decode configs under the slow marker.
CUDA_BUILDS = [
    (SMALL, None, ("cuda-sm90",)),
    (FULL, None, ("cuda-sm90",)),
]
SLOW_CUDA_BUILDS = [
    (SMALL, None, ("cuda-sm80", "cuda-sm100")),
    (BENCH, None, ("cuda-sm80", "cuda-sm90", "cuda-sm100")),
    (BENCH, 1, ("cuda-sm90",)),
    (FULL, 1, ("cuda-sm90",)),
]


def _check_cuda_builds(tmp_path, dims, hint, targets):
    problem = toolchain_problem()
    if problem:
        pytest.skip(problem)
    for target in targets:
        out = tmp_path / f"moe_{target}.so"
        build_cuda("dsv41.schedules.moe:build_moe_experts_split",
                   {"target_name": target, "swiglu_limit": LIMIT, "n": hint, **dims}, target,
                   out)
        arch = "sm_" + target.removeprefix("cuda-sm")
        assert has_device_code(out, arch), f"moe chain for {target} holds no {arch} code"


@pytest.mark.parametrize("dims,hint,targets", CUDA_BUILDS)
def test_cuda_builds_have_device_code(tmp_path, dims, hint, targets):
    _check_cuda_builds(tmp_path, dims, hint, targets)


@pytest.mark.slow
@pytest.mark.parametrize("dims,hint,targets", SLOW_CUDA_BUILDS)
def test_cuda_builds_other_configs(tmp_path, dims, hint, targets):
    _check_cuda_builds(tmp_path, dims, hint, targets)


def test_cuda_module_is_thread_bound():
    """Every PrimFunc of the CUDA module binds blockIdx/threadIdx (an unbound one would
    silently become host code)."""
    mod = moe.build_moe_experts_split("cuda-sm90", topk=2, swiglu_limit=LIMIT, **DIMS)
    for gv, func in mod.functions.items():
        assert func.attrs["tirx.is_scheduled"], gv.name_hint
        text = func.script()
        assert "blockIdx.x" in text and "threadIdx.x" in text, gv.name_hint


@pytest.mark.gpu
@pytest.mark.parametrize("hint", [1, None])
def test_chain_gpu_matches_oracle(hint):
    if not tvm.cuda().exist:
        pytest.skip("no CUDA GPU on this machine")
    target = get_target("cuda-sm90" if tvm.cuda().compute_version >= "9.0" else "cuda-sm80")
    with target.tvm_target():
        ex = _split(2, hint, target.name)
    for n, ids in ((1, None), (7, IDS7), (40, None), (300, None)):
        args = _case(n, 2, ids, seed=n)
        env = _run_chain(ex, args, 2, hint, target.name, tvm.cuda())
        out = torch.from_numpy(env["y"].numpy())
        _assert_close_to_oracle(out, ops.moe_experts(*args, LIMIT))


def test_config_kinds():
    """CPU decode takes the GEMV form, CPU prefill and every CUDA build the tile kernels; an
    unknown kind is refused."""
    def kind(target, n):
        return moe.moe_split_config(get_target(target), n=n, topk=2, **DIMS).kind

    assert kind(CPU, 1) == "gemv" and kind(CPU, None) == "tiles"
    host = moe.moe_split_config(get_target(CPU), n=1, topk=2, **DIMS)
    assert host.hand == has_features(get_target(CPU), "avx2", "fma")
    avx2 = moe.moe_split_config(get_target("cpu-avx2"), n=1, topk=2, **DIMS)
    assert (avx2.kind, avx2.hand, avx2.lanes, avx2.dot, avx2.rows) == ("gemv", True, 8, "fp32",
                                                                       False)
    assert moe.fused_decode(avx2)

    def dot(mcpu):
        x86 = get_target("cpu-x86-64")
        target = x86.__class__("cpu", {**x86.target, "mcpu": mcpu})
        return moe.moe_split_config(target, n=1, topk=2, rows=6, **DIMS).dot

    # vdpbf16ps sums on AVX-512 BF16 + VBMI without AMX (Zen 4), not on AMX hosts nor below
    assert (dot("znver4"), dot("sapphirerapids"), dot("skylake-avx512")) == ("bf16", "fp32",
                                                                           "fp32")
    with pytest.raises(ValueError, match="sum by 'fp32' or 'bf16', got dot='int8'"):
        moe.make_moe_down_gemv_avx512(topk=2, dot="int8", **DIMS)
    assert not moe.moe_split_config(get_target("cpu-x86-64"), n=1, topk=2, **DIMS).hand
    with pytest.raises(ValueError, match="8 \\(AVX2\\) with fp32 sums"):
        moe.make_moe_down_gemv_avx512(topk=2, dot="bf16", lanes=8, **DIMS)
    assert kind("cuda-sm90", 1) == "tiles" and kind("cuda-sm90", None) == "tiles"
    with pytest.raises(ValueError, match="'tiles' or 'gemv'"):
        moe.MoeSplitConfig(kind="dense")
    with pytest.raises(ValueError, match="CPU schedule"):
        moe.schedule_moe_gemv(moe.make_moe_down_gemv(topk=2, **DIMS),
                              moe.MoeSplitConfig(kind="gemv"), get_target("cuda-sm90"), "o")
