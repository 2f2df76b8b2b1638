"""The compressor kernel (schedules/compressor.py) against the graph: `compress` (its grouped
softmax pool and norm, run for real over chunks with a carried tail), `apply_rope` and
`ops.quant_fp4_kv` as `publish_main_kv` composes them.

Tolerances:
* pooled fp32 values (before the bf16 rounding): bit-exact on x86, where torch's softmax is
  Sleef's expf_u10 (test_pooled_values_bit_exact_on_x86); within 2 fp32 ulps of the terms
  without the FMA fences.
* latent: within one bf16 ulp of the oracle, >= 99.9% bit-identical (measured > 99.99%): the
  norm's sum of squares is added in another order (as in test_kernel_norm.py).
* roped entry, FP4 codes and E4M3 scales: none, as functions of the kernel's latent -- they
  must equal apply_rope / quant_fp4_kv applied to the kernel's own latent bit for bit, and
  therefore equal the end-to-end oracle on every entry whose latent is bit-identical (checked).
  An entry whose latent differs in one bf16 ulp may get other codes / a scale one step off.
* slots with ok = False: every output exactly 0.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

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
from tvm.script import tirx as T

from dsv41.graph import ops
from dsv41.graph.cache import GlobalStore
from dsv41.graph.layers import apply_rope, fp32_linear, softmax_pool
from dsv41.graph.model import Chunk, compress
from dsv41.graph.targets import get_target
from dsv41.schedules import compressor as C

CPU = get_target("cpu")
EPS = 1e-20
HD, RD = 512, 64  # the released head_dim / rope_head_dim (also the bench preset's)


@functools.cache
def _kernel(m: int, hd: int, rd: int, kv_format: str = "fp4"):
    func = C.build_compress("cpu", m=m, hd=hd, rd=rd, eps=EPS, kv_format=kv_format)
    return tvm.compile(func, target=CPU.tvm_target())


def run(ins: list[torch.Tensor], m: int, hd: int = HD, rd: int = RD, kv_format: str = "fp4"):
    b, g = ins[-1].shape[:2]  # sin (b, G, rd/2)
    outs = [torch.empty(b, g, hd, dtype=torch.bfloat16)]
    if kv_format == "fp4":
        outs += [torch.empty(b, g, hd // 2, dtype=torch.uint8),
                 torch.empty(b, g, hd // 16, dtype=torch.uint8)]
    else:
        outs += [torch.empty(b, g, hd, dtype=torch.bfloat16)]
    _kernel(m, hd, rd, kv_format)(*[tv(t) for t in (*ins, *outs)])
    return outs


def oracle(ins, m: int, rd: int = RD, kv_format: str = "fp4"):
    args = ins if m > 1 else [ins[0], None, None, *ins[1:]]
    return C.compress_oracle(*args, m, rd, EPS, kv_format)


def check(ins, m: int, rd: int = RD, kv_format: str = "fp4", min_exact: float = 0.999):
    """The module docstring's checks; returns the kernel's outputs."""
    got, ref = run(ins, m, ins[-3].shape[-1], rd, kv_format), oracle(ins, m, rd, kv_format)
    b, g = got[0].shape[:2]
    ok = ins[2] if m > 1 else torch.ones(b, g, dtype=torch.bool)
    assert_within_one_bf16_ulp(got[0][ok], ref[0][ok], min_exact)
    cos, sin = ins[-2], ins[-1]
    roped = apply_rope(got[0], cos, sin, rd)
    own = (roped,) if kv_format == "bf16" else ops.quant_fp4_kv(roped.float())
    same = (bits(got[0]) == bits(ref[0])).all(-1) & ok  # entries whose latent matches
    for name, g_out, o_out, r_out in zip(("entry", "scales"), got[1:], own, ref[1:],
                                         strict=False):
        assert torch.equal(bits(g_out)[ok], bits(o_out)[ok]), f"{name} != f(kernel latent)"
        assert torch.equal(bits(g_out)[same], bits(r_out)[same]), f"{name} != oracle"
    for out in got:
        assert not bits(out)[~ok].any(), "an incomplete slot was not zeroed"
    return got


# ---- m = 2 (the pooled compressor) -----------------------------------------------------------


@pytest.mark.parametrize("b,g,invalid", [(1, 1, 0), (2, 37, 2), (1, 64, 1)])
def test_pool_fp4(b, g, invalid):
    """One group (a 2-token chunk), a batch with two trailing incomplete slots (the partial
    last group and the spare slot `compress` allocates), a full chunk."""
    check(C.example_inputs_compress(b=b, g=g, m=2, hd=HD, rd=RD, invalid=invalid, seed=g), 2)


def test_pool_bf16_entries():
    check(C.example_inputs_compress(b=2, g=9, m=2, hd=HD, rd=RD, invalid=1, seed=3), 2,
          kv_format="bf16")


def test_pool_small_preset_dims_and_ratio_4():
    """The small preset's head (64, rope 16) and a ratio of 4 (the general softmax path)."""
    check(C.example_inputs_compress(b=2, g=5, m=2, hd=64, rd=16, invalid=1, seed=4), 2, rd=16)
    check(C.example_inputs_compress(b=1, g=7, m=4, hd=64, rd=16, invalid=1, seed=5), 4, rd=16)


def test_pool_ties_and_extreme_scores():
    """Equal scores (softmax 1/2 each), one -inf member (weight 0), scores far apart."""
    ins = C.example_inputs_compress(b=1, g=4, m=2, hd=HD, rd=RD, seed=6)
    score = ins[1]
    score[0, 0, 1] = score[0, 0, 0]
    score[0, 1, 1] = float("-inf")
    score[0, 2, 0] += 200.0
    check(ins, 2)


def test_pool_bench_size():
    check(C.example_inputs_compress(b=1, g=1024, m=2, hd=HD, rd=RD, dim=1024, seed=7), 2)


# ---- m = 1 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,g", [(1, 1), (2, 37), (1, 1024)])
def test_single_fp4(b, g):
    check(C.example_inputs_compress(b=b, g=g, m=1, hd=HD, rd=RD, seed=g), 1)


def test_single_bf16_entries():
    check(C.example_inputs_compress(b=2, g=5, m=1, hd=HD, rd=RD, seed=8), 1, kv_format="bf16")


# ---- the pooled value on its own -----------------------------------------------------------


def _pool_kernel(m: int, g: int, hd: int, fence: str):
    M, G, D = T.int64(m), T.int64(g), T.int64(hd)

    @T.prim_func(s_tir=True)
    def pool(kv: T.Buffer((1, G, M, D), "float32"), score: T.Buffer((1, G, M, D), "float32"),
             out: T.Buffer((1, G, D), "float32")):
        for gg, c in T.grid(G, D):
            with T.sblock("pool"):
                vg, vc = T.axis.remap("SS", [gg, c])
                out[0, vg, vc] = C.pool_value(kv, score, 0, vg, vc, m, fence)

    sch = tvm.s_tir.Schedule(pool)
    _, c = sch.get_loops(sch.get_sblock("pool"))
    sch.vectorize(sch.split(c, [None, 16])[1])
    return tvm.compile(sch.mod, target=CPU.tvm_target())


@pytest.mark.parametrize("m", [2, 4])
def test_pooled_values_bit_exact_on_x86(m):
    """The fenced Sleef-exp pool against `softmax_pool`'s fp32 values, bit for bit, where torch
    runs its vectorised x86 softmax (Sleef expf_u10 with FMAs); wide score spreads included."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch's softmax is not the AVX2 / AVX-512 Sleef one on this CPU")
    g = torch.Generator().manual_seed(m)
    kv = torch.randn(1, 256, m, 512, generator=g)
    score = torch.randn(1, 256, m, 512, generator=g) * torch.logspace(-2, 2, 256)[:, None, None]
    out = torch.empty(1, 256, 512)
    _pool_kernel(m, 256, 512, "llvm")(tv(kv), tv(score), tv(out))
    assert torch.equal(out, softmax_pool(kv.flatten(1, 2), score.flatten(1, 2), m))


def test_unfenced_pool_stays_close():
    """fence="none" (the factory's default: plain products, which LLVM may fuse): within 2 fp32
    ulps of the oracle."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 64, 2, 512, generator=g)
    score = torch.randn(1, 64, 2, 512, generator=g) * 3
    out = torch.empty(1, 64, 512)
    _pool_kernel(2, 64, 512, "none")(tv(kv), tv(score), tv(out))
    ref = softmax_pool(kv.flatten(1, 2), score.flatten(1, 2), 2)
    scale = kv.abs().amax(2)  # the terms' magnitude
    assert bool(((out - ref).abs() <= 2 * 2.0**-23 * scale).all())


# ---- against graph.model.compress over chunks --------------------------------------------------


def _run_compress(x, wkv, wgate, norm_w, chunks):
    """`compress` of a ratio-2 source over consecutive chunks of x (b, n, dim), carrying the
    store's tail as the model does; returns {entry j: latent} of every completed entry."""
    args = SimpleNamespace(norm_eps=EPS)
    weights = {"attn.compressor.wkv.weight": wkv, "attn.compressor.wgate.weight": wgate,
               "attn.compressor.norm.weight": norm_w}
    model = SimpleNamespace(args=args, p=lambda layer, name: weights[name])
    b, hd = x.size(0), wkv.size(0)
    store = GlobalStore(ratio=2, kv_codes=torch.empty(0), kv_scales=torch.empty(0), k_codes=None,
                        k_scales=None, tail_kv=torch.zeros(b, 2, hd),
                        tail_score=torch.full((b, 2, hd), float("-inf")))
    done, start = {}, 0
    for s in chunks:
        chunk = Chunk(start=torch.full((b,), start), length=s, rope={}, hash_ids=None)
        c = compress(model, 2, store, x[:, start:start + s], chunk)
        for gi in range(c.latent.size(1)):
            if bool(c.ok[0, gi]):
                done[int(c.first[0]) + gi] = c.latent[:, gi]
        start += s
    return done


def test_matches_graph_compress_over_chunks():
    """Chunks of 5, 4, 1, 6 tokens: partial groups at the ends wait in the tail and are
    completed from it by the next chunk (the second and the fourth chunk start mid-group).
    The kernel gets each completed group's two tokens (the semantic gather) and must give the
    graph's latents."""
    g = torch.Generator().manual_seed(13)
    dim, n = 256, 16
    x = torch.randn(1, n, dim, generator=g).to(torch.bfloat16)
    wkv = torch.randn(HD, dim, generator=g) * dim**-0.5
    wgate = torch.randn(HD, dim, generator=g) * 2 * dim**-0.5
    norm_w = (1 + 0.1 * torch.randn(HD, generator=g)).to(torch.bfloat16)
    done = _run_compress(x, wkv, wgate, norm_w, (5, 4, 1, 6))
    assert sorted(done) == list(range(n // 2))  # every group completed exactly once
    kv = fp32_linear(x, wkv).unflatten(1, (n // 2, 2))  # (1, G, 2, hd)
    score = fp32_linear(x, wgate).unflatten(1, (n // 2, 2))
    cos = torch.rand(1, n // 2, RD // 2, generator=g)
    ins = [kv, score, torch.ones(1, n // 2, dtype=torch.bool), norm_w, cos, cos.flip(-1)]
    got = run(ins, 2)[0]
    ref = torch.stack([done[j] for j in range(n // 2)], dim=1)
    assert_within_one_bf16_ulp(got, ref, 0.99)


# ---- factories, configs, schedules ------------------------------------------------------------


def test_factories_reject_bad_dims():
    with pytest.raises(ValueError, match="ratio"):
        C.make_compress(m=0, hd=512, rd=64, eps=EPS)
    with pytest.raises(ValueError, match="multiple of 16"):
        C.make_compress(m=2, hd=520, rd=64, eps=EPS)
    with pytest.raises(ValueError, match="even rd"):
        C.make_compress(m=2, hd=512, rd=63, eps=EPS)
    with pytest.raises(ValueError, match="kv_format"):
        C.make_compress(m=2, hd=512, rd=64, eps=EPS, kv_format="fp8")
    with pytest.raises(ValueError, match="fence"):
        C.make_compress(m=2, hd=512, rd=64, eps=EPS, fence="nvptx")
    with pytest.raises(ValueError, match="fence='llvm'"):
        C.schedule_compress(C.make_compress(m=2, hd=512, rd=64, eps=EPS, fence="llvm"),
                            C.compress_config(get_target("cuda-sm90"), hd=512),
                            get_target("cuda-sm90"))
    with pytest.raises(ValueError, match="norm_lanes=16"):
        C.schedule_compress(C.make_compress(m=2, hd=512, rd=64, eps=EPS, norm_lanes=16),
                            C.compress_config(CPU, hd=512), CPU)


def test_signatures():
    f = C.make_compress(m=2, hd=512, rd=64, eps=EPS)
    assert [(p.name, p.dtype) for p in f.params] == [
        ("kv", "float32"), ("score", "float32"), ("ok", "bool"), ("weight", "bfloat16"),
        ("cos", "float32"), ("sin", "float32"), ("latent", "bfloat16"), ("codes", "uint8"),
        ("scales", "uint8")]
    g = C.make_compress(m=1, hd=512, rd=64, eps=EPS, kv_format="bf16")
    assert [(p.name, p.dtype) for p in g.params] == [
        ("kv", "bfloat16"), ("weight", "bfloat16"), ("cos", "float32"), ("sin", "float32"),
        ("latent", "bfloat16"), ("kv_out", "bfloat16")]
    assert all(str(dim.ty) == "int64" for fn in (f, g) for p in fn.params for dim in p.shape)


def test_cpu_schedule_is_parallel_and_vectorised():
    func = C.build_compress("cpu", m=2, hd=512, rd=64, eps=EPS)
    assert func.attrs["tirx.is_scheduled"]
    text = func.script()
    assert "T.parallel(" in text and "T.vectorized(" in text


def test_bench_cases_run():
    cases = C.bench_cases(tokens=(4,))
    assert [c.name for c in cases] == ["compress-m2-s4", "compress-m1-s4"]
    for c in cases:
        ex = tvm.compile(c.build("cpu"), target=CPU.tvm_target())
        data = c.prepare()
        ex(*[tv(t) for t in (*data.inputs, *data.outputs)])
        assert_within_one_bf16_ulp(data.outputs[0], data.pick(data.oracle(*data.oracle_args)),
                                   0.99)


# ---- CUDA -------------------------------------------------------------------------------------

BUILDERS = {
    "pool_fp4": dict(m=2, hd=512, rd=64, eps=EPS),
    "single_fp4": dict(m=1, hd=512, rd=64, eps=EPS),
    "pool_bf16": dict(m=2, hd=512, rd=64, eps=EPS, kv_format="bf16"),
}
# A child-process build takes 6-15 s here: one per module by default (sm_90 here; the norm and
# mHC modules build for sm_80 and sm_100, so the default run covers every arch), the rest `slow`.
CUDA_DEFAULT = [("pool_fp4", "cuda-sm90")]
CUDA_SLOW = [(k, a) for k in BUILDERS for a in ("cuda-sm80", "cuda-sm90", "cuda-sm100")
             if (k, a) not in CUDA_DEFAULT]


@pytest.mark.parametrize("kernel,target", CUDA_DEFAULT)
def test_cuda_builds_have_device_code(tmp_path, kernel, target):
    cuda_build(tmp_path, "compressor", "build_compress", BUILDERS[kernel], target)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,target", CUDA_SLOW)
def test_cuda_builds_other_archs(tmp_path, kernel, target):
    cuda_build(tmp_path, "compressor", "build_compress", BUILDERS[kernel], target)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 1])
def test_gpu_numerics(m):
    """On the GPU (nvcc fast math: __expf, approximate division and rsqrtf) the latent stays
    within one bf16 ulp (>= 99% exact) and the entry is still an exact function of it."""
    name = gpu_target()
    target, dev = get_target(name), tvm.cuda()
    ins = C.example_inputs_compress(b=2, g=300, m=m, hd=HD, rd=RD, invalid=2 if m > 1 else 0,
                                    seed=21)
    with target.tvm_target():
        ex = tvm.compile(C.build_compress(name, m=m, hd=HD, rd=RD, eps=EPS),
                         target=target.tvm_target())
    outs = [torch.empty(2, 300, HD, dtype=torch.bfloat16),
            torch.empty(2, 300, HD // 2, dtype=torch.uint8),
            torch.empty(2, 300, HD // 16, dtype=torch.uint8)]
    douts = [to_device(t, dev) for t in outs]
    ex(*[to_device(t, dev) for t in ins], *douts)
    latent, codes, scales = (from_device(o) for o in douts)
    ref = oracle(ins, m)
    ok = ins[2] if m > 1 else torch.ones(2, 300, dtype=torch.bool)
    assert_within_one_bf16_ulp(latent[ok], ref[0][ok], 0.99)
    own = ops.quant_fp4_kv(apply_rope(latent, ins[-2], ins[-1], RD).float())
    assert torch.equal(codes[ok], own[0][ok]) and torch.equal(scales[ok], own[1][ok])
    assert not latent.view(torch.int16)[~ok].any() and not codes[~ok].any()
