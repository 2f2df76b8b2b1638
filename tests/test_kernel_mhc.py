"""Fused mHC kernels (schedules/mhc.py) against the graph's ops `dsv41::hc_pre_mix` (with the
norm: what the compiled entries run) and `dsv41::hc_post` (graph/ops.py), and against
graph/layers.py `hc_mixes` + `hc_pre` for the kernel's variant without the norm.

Tolerances:
* x = hc_pre(h, pre_in) and hc_post: none (bit-exact; the oracle's sum order, products rounded
  before the adds).
* x with the fused norm: within one bf16 ulp of rms_norm(hc_pre(...)), >= 99.9% bit-identical
  (the norm's sum of squares is added in another order; see test_kernel_norm.py).
* pre, post, comb: |kernel - oracle| <= 2e-6 (values lie in [0, 2]). The 24 logits are fp32 dot
  products over hc * d = 1024 .. 4096 terms summed in another order than torch's GEMM, and exp
  / sigmoid are libm's; measured max 6e-7 (the Sinkhorn rounds do not amplify it).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import tvm
from kernel_numerics import (
    assert_within_one_bf16_ulp,
    bits,
    cuda_build,
    from_device,
    gpu_target,
    to_device,
    tv,
)

from dsv41.graph import ops
from dsv41.graph.layers import hc_mixes, hc_post, hc_pre, identity_pre
from dsv41.graph.targets import get_target
from dsv41.schedules import mhc as M

CPU = get_target("cpu")
HC, ITERS, NORM_EPS, HC_EPS = 4, 20, 1e-20, 1e-6
MIX_ATOL = 2e-6


@functools.cache
def _pre_mix(d: int, iters: int, with_norm: bool):
    func = M.build_hc_pre_mix("cpu", hc=HC, d=d, iters=iters, norm_eps=NORM_EPS,
                              hc_eps=HC_EPS, with_norm=with_norm)
    return tvm.compile(func, target=CPU.tvm_target())


@functools.cache
def _post(d: int):
    return tvm.compile(M.build_hc_post("cpu", hc=HC, d=d), target=CPU.tvm_target())


def run_pre_mix(ins: list[torch.Tensor], iters: int = ITERS, with_norm: bool = False):
    h = ins[0]
    b, s, _, d = h.shape
    outs = [torch.empty(b, s, d, dtype=torch.bfloat16), torch.empty(b, s, HC),
            torch.empty(b, s, HC), torch.empty(b, s, HC, HC)]
    _pre_mix(d, iters, with_norm)(*[tv(t) for t in (*ins, *outs)])
    return outs


def oracle_pre_mix(ins, iters: int = ITERS):
    if len(ins) > 5:  # with the norm: the graph's op
        return ops.hc_pre_mix(*ins[:6], HC, iters, NORM_EPS, HC_EPS)
    return M.hc_pre_mix_oracle(*ins[:5], None, HC, iters, NORM_EPS, HC_EPS)


def check_pre_mix(got, ref, with_norm: bool) -> None:
    if with_norm:
        assert_within_one_bf16_ulp(got[0], ref[0], 0.999)
    else:
        assert torch.equal(bits(got[0]), bits(ref[0]))
    for name, g, r in zip(("pre", "post", "comb"), got[1:], ref[1:], strict=True):
        err = (g - r).abs().max().item() if g.numel() else 0.0
        assert err <= MIX_ATOL, f"{name} differs by {err:.3g}"


# ---- hc_pre_mix -------------------------------------------------------------------------------


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("b,s,d", [(1, 1, 256), (2, 37, 256), (1, 4, 1024)])
def test_pre_mix_matches(b, s, d, with_norm):
    """Decode (one token), batch 2 with a token count that is not a multiple of anything, and
    the bench preset's width (hc * d = 4096)."""
    ins = M.example_inputs_hc_pre_mix(b=b, s=s, hc=HC, d=d, with_norm=with_norm, seed=b + s)
    check_pre_mix(run_pre_mix(ins, with_norm=with_norm), oracle_pre_mix(ins), with_norm)


@pytest.mark.parametrize("token_tile,mix_tile", [(1, 24), (3, 8)])
def test_pre_mix_other_tilings(token_tile, mix_tile):
    """The untiled dot stage (the CUDA kernel's structure) and a 3-token tile, on the CPU: 7
    tokens leave a padded last tile."""
    cfg = dataclasses.replace(M.mhc_config(CPU, hc=HC, d=256), token_tile=token_tile,
                              mix_tile=mix_tile)
    func = M.make_hc_pre_mix(hc=HC, d=256, iters=ITERS, norm_eps=NORM_EPS, hc_eps=HC_EPS,
                             lanes=cfg.lanes, norm_lanes=cfg.norm_lanes, token_tile=token_tile)
    ex = tvm.compile(M.schedule_hc_pre_mix(func, cfg, CPU), target=CPU.tvm_target())
    ins = M.example_inputs_hc_pre_mix(b=2, s=7, hc=HC, d=256, seed=token_tile)
    outs = [torch.empty(2, 7, 256, dtype=torch.bfloat16), torch.empty(2, 7, HC),
            torch.empty(2, 7, HC), torch.empty(2, 7, HC, HC)]
    ex(*[tv(t) for t in (*ins, *outs)])
    check_pre_mix(outs, oracle_pre_mix(ins), False)


@pytest.mark.parametrize("iters", [1, 2])
def test_pre_mix_few_sinkhorn_rounds(iters):
    """iters = 1: softmax + one column normalisation only (no round loop); 2: one round."""
    ins = M.example_inputs_hc_pre_mix(b=1, s=5, hc=HC, d=256, seed=iters)
    check_pre_mix(run_pre_mix(ins, iters=iters), oracle_pre_mix(ins, iters), False)


def test_pre_mix_identity_pre_and_large_stream():
    """Block 0 collapses with the one-hot identity_pre: x is copy 0 of h exactly. The stream's
    scale (1e4) must not matter to the mixes (they are normalised by the stream's RMS)."""
    ins = M.example_inputs_hc_pre_mix(b=2, s=3, hc=HC, d=256, seed=9)
    ins[0] = (ins[0].float() * 1e4).to(torch.bfloat16)
    ins[4] = identity_pre(ins[0])
    got = run_pre_mix(ins)
    assert torch.equal(bits(got[0]), bits(ins[0][:, :, 0]))
    check_pre_mix(got, oracle_pre_mix(ins), False)


def test_pre_mix_outputs_are_doubly_stochastic_like_the_oracle():
    ins = M.example_inputs_hc_pre_mix(b=1, s=8, hc=HC, d=256, seed=4)
    _, pre, post, comb = run_pre_mix(ins)
    assert bool((pre > 0).all() and (pre <= 1 + 2 * HC_EPS).all())
    assert bool((post > 0).all() and (post < 2).all())
    assert torch.allclose(comb.sum(-2), torch.ones(1, 8, HC), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(1, 8, HC), atol=1e-3)


# ---- hc_post ----------------------------------------------------------------------------------


@pytest.mark.parametrize("b,s,d", [(1, 1, 256), (2, 37, 256), (1, 8, 1024)])
def test_post_bit_exact(b, s, d):
    f, h, post, comb = M.example_inputs_hc_post(b=b, s=s, hc=HC, d=d, seed=s)
    out = torch.empty_like(h)
    _post(d)(*[tv(t) for t in (f, h, post, comb, out)])
    assert torch.equal(bits(out), bits(ops.hc_post(f, h, post, comb)))


def test_post_random_weights_many_values():
    """Random fp32 post/comb (full significands) over ~300K outputs: every product must be
    rounded before its add, as torch does."""
    g = torch.Generator().manual_seed(12)
    h = (torch.randn(3, 25, HC, 1024, generator=g) * 4).to(torch.bfloat16)
    f = torch.randn(3, 25, 1024, generator=g).to(torch.bfloat16)
    post = torch.rand(3, 25, HC, generator=g) * 2
    comb = torch.rand(3, 25, HC, HC, generator=g)
    out = torch.empty_like(h)
    _post(1024)(*[tv(t) for t in (f, h, post, comb, out)])
    assert torch.equal(bits(out), bits(hc_post(f, h, post, comb)))


def test_pre_mix_then_post_like_a_block():
    """One sublayer as `block` runs it: mixes + collapse, a stand-in sublayer f(x) = x, post."""
    ins = M.example_inputs_hc_pre_mix(b=1, s=6, hc=HC, d=256, seed=21)
    x, _, post, comb = run_pre_mix(ins)
    out = torch.empty_like(ins[0])
    _post(256)(*[tv(t) for t in (x, ins[0], post, comb, out)])
    _, post_r, comb_r = hc_mixes(*ins[:4], HC, ITERS, NORM_EPS, HC_EPS)
    ref = hc_post(hc_pre(ins[0], ins[4]), ins[0], post_r, comb_r)
    # post and comb differ by <= MIX_ATOL, so an output may move by that times its terms'
    # magnitudes, plus its own bf16 rounding (one ulp)
    terms = x.float().abs().unsqueeze(2) + ins[0].float().abs().sum(2, keepdim=True)
    _, exp = torch.frexp(ref.float())
    bound = torch.ldexp(torch.ones_like(ref.float()), exp - 8) + 2 * MIX_ATOL * terms
    assert bool(((out.float() - ref.float()).abs() <= bound).all())
    assert (bits(out) == bits(ref)).float().mean().item() >= 0.99


@functools.cache
def _post_pre_mix(d: int):
    func = M.build_hc_pre_mix("cpu", hc=HC, d=d, iters=ITERS, norm_eps=NORM_EPS, hc_eps=HC_EPS,
                              with_norm=True, with_post=True)
    return tvm.compile(func, target=CPU.tvm_target())


@pytest.mark.parametrize("b,s,d", [(1, 1, 256), (2, 37, 256), (1, 3, 1024)])
def test_post_pre_mix_is_the_two_kernels_bit_for_bit(b, s, d):
    """hc_post_pre_mix (the block's attention exit + FFN entry) against hc_post's kernel and then
    hc_pre_mix's on its output: every output the same bits (h' too); and the op's oracle is the
    two ops in turn."""
    ins = M.example_inputs_hc_pre_mix(b=b, s=s, hc=HC, d=d, with_norm=True, seed=d + s)
    f, h, post, comb = M.example_inputs_hc_post(b=b, s=s, hc=HC, d=d, seed=s)
    hn = torch.empty_like(h)
    _post(d)(*[tv(t) for t in (f, h, post, comb, hn)])
    want = [hn, *run_pre_mix([hn, *ins[1:]], with_norm=True)]
    got = [torch.empty_like(t) for t in want]
    _post_pre_mix(d)(*[tv(t) for t in (f, h, post, comb, *ins[1:], *got)])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(bits(g), bits(w))
    ref = ops.hc_post_pre_mix(f, h, post, comb, *ins[1:], HC, ITERS, NORM_EPS, HC_EPS)
    chain = ops.hc_post(f, h, post, comb)
    chain = (chain, *ops.hc_pre_mix(chain, *ins[1:], HC, ITERS, NORM_EPS, HC_EPS))
    assert all(torch.equal(bits(a), bits(c)) for a, c in zip(ref, chain, strict=True))
    check_pre_mix(got[1:], oracle_pre_mix([got[0], *ins[1:]]), with_norm=True)


# ---- factories, configs, schedules ------------------------------------------------------------


def test_factories_reject_bad_dims():
    with pytest.raises(ValueError, match="iteration"):
        M.make_hc_pre_mix(hc=4, d=64, iters=0, norm_eps=1e-6, hc_eps=1e-6)
    with pytest.raises(ValueError, match="lanes"):
        M.make_hc_pre_mix(hc=4, d=60, iters=2, norm_eps=1e-6, hc_eps=1e-6, lanes=16,
                          norm_lanes=32)
    with pytest.raises(ValueError, match="hc > 0"):
        M.make_hc_post(hc=0, d=64)
    with pytest.raises(ValueError, match="token_tile"):
        M.make_hc_pre_mix(hc=4, d=64, iters=2, norm_eps=1e-6, hc_eps=1e-6, token_tile=0)
    with pytest.raises(ValueError, match="with_post needs with_norm"):
        M.make_hc_pre_mix(hc=4, d=64, iters=2, norm_eps=1e-6, hc_eps=1e-6, with_post=True)
    func = M.make_hc_pre_mix(hc=4, d=64, iters=2, norm_eps=1e-6, hc_eps=1e-6, lanes=8)
    with pytest.raises(ValueError, match=r"\(8, 1\)"):
        M.schedule_hc_pre_mix(func, M.mhc_config(CPU, hc=4, d=64), CPU)


def test_signatures():
    f = M.make_hc_pre_mix(hc=4, d=64, iters=2, norm_eps=1e-6, hc_eps=1e-6, with_norm=True)
    assert [p.name for p in f.params] == ["h", "fn", "scale", "base", "pre_in", "weight", "x",
                                          "pre", "post", "comb"]
    g = M.make_hc_post(hc=4, d=64)
    assert [p.name for p in g.params] == ["f", "h", "post", "comb", "out"]
    assert all(str(dim.ty) == "int64" for fn in (f, g) for p in fn.params for dim in p.shape)


def test_cpu_schedules_are_parallel_and_vectorised():
    for func in (M.build_hc_pre_mix("cpu", hc=4, d=256, iters=3, norm_eps=1e-6, hc_eps=1e-6,
                                    with_norm=True), M.build_hc_post("cpu", hc=4, d=256)):
        assert func.attrs["tirx.is_scheduled"]
        text = func.script()
        assert "T.parallel(" in text and "T.vectorized(" in text


def test_bench_cases_run():
    cases = M.bench_cases(tokens=(2,))
    assert [c.family for c in cases] == ["mhc", "mhc"]
    for c in cases:
        ex = tvm.compile(c.build("cpu"), target=CPU.tvm_target())
        data = c.prepare()
        ex(*[tv(t) for t in (*data.inputs, *data.outputs)])
        assert_within_one_bf16_ulp(data.outputs[0], data.pick(data.oracle(*data.oracle_args)),
                                   0.99)


# ---- CUDA -------------------------------------------------------------------------------------

DIMS = dict(hc=4, d=1024, iters=20, norm_eps=1e-20, hc_eps=1e-6)
BUILDERS = {
    "pre_mix_norm": ("build_hc_pre_mix", dict(**DIMS, with_norm=True)),
    "pre_mix": ("build_hc_pre_mix", DIMS),
    "post": ("build_hc_post", dict(hc=4, d=1024)),
    "post_pre_mix": ("build_hc_pre_mix", dict(**DIMS, with_norm=True, with_post=True)),
}
# A child-process build takes 6-15 s here: two per module by default (the main kernel on
# sm_90, another on sm_80 or sm_100; the three modules cover every arch), the rest `slow`.
CUDA_DEFAULT = [("pre_mix_norm", "cuda-sm90"), ("post", "cuda-sm100"),
                ("post_pre_mix", "cuda-sm90")]
CUDA_SLOW = [(k, a) for k in BUILDERS for a in ("cuda-sm80", "cuda-sm90", "cuda-sm100")
             if (k, a) not in CUDA_DEFAULT]


def _cuda_build(tmp_path, kernel, target):
    name, dims = BUILDERS[kernel]
    cuda_build(tmp_path, "mhc", name, dims, target)


@pytest.mark.parametrize("kernel,target", CUDA_DEFAULT)
def test_cuda_builds_have_device_code(tmp_path, kernel, target):
    _cuda_build(tmp_path, kernel, target)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,target", CUDA_SLOW)
def test_cuda_builds_other_archs(tmp_path, kernel, target):
    _cuda_build(tmp_path, kernel, target)


@pytest.mark.gpu
def test_gpu_numerics():
    """On the GPU: hc_post and the plain collapse bit-exact, the mixes within 1e-5 (nvcc's fast
    math: __expf and approximate division in sigmoid / softmax / Sinkhorn)."""
    name = gpu_target()
    target, dev = get_target(name), tvm.cuda()

    def run(func, ins, outs):
        with target.tvm_target():
            ex = tvm.compile(func, target=target.tvm_target())
        douts = [to_device(t, dev) for t in outs]
        ex(*[to_device(t, dev) for t in ins], *douts)
        return [from_device(o) for o in douts]

    for with_norm in (False, True):
        ins = M.example_inputs_hc_pre_mix(b=2, s=33, hc=4, d=1024, with_norm=with_norm, seed=3)
        outs = [torch.empty(2, 33, 1024, dtype=torch.bfloat16), torch.empty(2, 33, 4),
                torch.empty(2, 33, 4), torch.empty(2, 33, 4, 4)]
        got = run(M.build_hc_pre_mix(name, **DIMS, with_norm=with_norm), ins, outs)
        ref = oracle_pre_mix(ins)
        if with_norm:
            assert_within_one_bf16_ulp(got[0], ref[0], 0.99)
        else:
            assert torch.equal(bits(got[0]), bits(ref[0]))
        for g, r in zip(got[1:], ref[1:], strict=True):
            assert (g - r).abs().max().item() <= 1e-5
    f, h, post, comb = M.example_inputs_hc_post(b=2, s=33, hc=4, d=1024, seed=4)
    (out,) = run(M.build_hc_post(name, hc=4, d=1024), [f, h, post, comb], [torch.empty_like(h)])
    assert torch.equal(bits(out), bits(hc_post(f, h, post, comb)))
