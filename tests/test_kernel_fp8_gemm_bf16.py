"""The FP8 prefill GEMM on AVX-512 BF16 (`bf16_gemm.make_fp8_gemm_bf16`) against the oracle.

Tolerance (`ops.fp8_linear`): every product is exact in both, only the order of the fp32
additions differs (one running sum over K in pairs against 32-block partials times scales), so
>= 99% of outputs are bit-equal and the rest within 1 bf16 ulp (measured at m 2048: n 32768 k 512,
n 1024 k 4096 and n 512 k 1024, at least 99.995% equal, the rest 1 ulp). fp32 out: within 2^-20
of the row's largest magnitude."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import (
    SKX,
    SPR,
    ZEN4,
    bf16_ulps,
    kernel_rms_norm,
    run_fp8_linear,
    swiglu_relax,
)

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.schedules import gemm
from dsv41.schedules.common import has_avx512_bf16
from dsv41.schedules.gemm.bf16_gemm import make_dense_gemm_bf16, make_fp8_gemm_bf16

CPU = get_target("cpu")
needs_bf16 = pytest.mark.skipif(not has_avx512_bf16(CPU),
                                reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")


@functools.cache
def _compiled(**kwargs):
    return tvm.compile(make_fp8_gemm_bf16(**kwargs), target=CPU.tvm_target())


@needs_bf16
@pytest.mark.parametrize("n,k", [(100, 128), (64, 1024)])
def test_fp8_gemm_bf16_matches_oracle(n, k):
    """m 1, 31, 32, 70 and 200 with row blocks of 64: one register tile partly used, exactly
    full, several row blocks with a partial last one; n 100: a partial last 32-column tile."""
    ex = _compiled(n=n, k=k, row_block=64)
    for m in (1, 31, 32, 70, 200):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        ulps = bf16_ulps(run_fp8_linear(ex, x, weight, scale), ops.fp8_linear(x, weight, scale))
        assert int(ulps.max()) <= 1, m
        assert float((ulps == 0).float().mean()) >= 0.99, m


@needs_bf16
def test_fp8_gemm_bf16_float32_out():
    n, k, m = 96, 256, 40
    ex = _compiled(n=n, k=k, out_dtype="float32", row_block=32)
    x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=3)
    out = run_fp8_linear(ex, x, weight, scale, torch.float32)
    ref = ops.fp8_linear_f32(x, weight, scale)
    bound = ref.abs().amax(dim=1, keepdim=True) * 2.0**-20
    assert bool(((out - ref).abs() <= bound).all())


@needs_bf16
def test_fp8_gemm_bf16_every_code_nan_and_subnormal_weights():
    """Column c holds E4M3 code c at every K (all 256 codes: subnormals, -0, the two NaNs), 40
    rows: every finite output within 1 bf16 ulp of the oracle, the NaN codes' columns the
    canonical NaN (0x7fc0) in every row, and nothing else NaN."""
    n, k, m = 256, 128, 40
    x, _, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=5)
    weight = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, k)
    out = run_fp8_linear(_compiled(n=n, k=k, row_block=64), x, weight, scale)
    ref = ops.fp8_linear(x, weight, scale)
    nan = torch.zeros(m, n, dtype=torch.bool)
    nan[:, 0x7F] = nan[:, 0xFF] = True
    assert torch.equal(out.isnan(), nan)
    assert bool((out.view(torch.int16)[:, [0x7F, 0xFF]] == 0x7FC0).all())
    assert int(bf16_ulps(out[~nan], ref[~nan]).max()) <= 1


def test_fp8_gemm_bf16_refuses_bad_shapes():
    with pytest.raises(ValueError, match="The bf16 fp8 GEMM needs k a multiple of 64, got 96."):
        make_fp8_gemm_bf16(n=64, k=96)
    for rb in (0, 48):
        with pytest.raises(ValueError, match=f"row_block must be a positive multiple of 32; "
                                             f"got {rb}."):
            make_fp8_gemm_bf16(n=64, k=128, row_block=rb)


def test_config_picks_the_bf16_gemm_for_prefill_where_the_target_has_it():
    """AVX-512 BF16 without AMX (Zen 4): prefill (no hint, or many rows) on the bf16 GEMM;
    AMX keeps its tiles, AVX-512 without BF16 and few-row hints keep the scheduled GEMM."""
    for m in (None, 160):
        cfg = gemm.fp8_linear_config(ZEN4, n=32768, k=512, m=m)
        assert (cfg.kind, cfg.tm, cfg.prescheduled) == ("gemm_bf16", 512, True)
    assert gemm.fp8_linear_config(ZEN4, n=100, k=4096).kind == "gemm_bf16"
    assert gemm.fp8_linear_config(ZEN4, n=64, k=96).kind == "gemm"  # k % 64
    assert gemm.fp8_linear_config(ZEN4, n=64, k=512, m=4).kind == "gemm"
    assert gemm.fp8_linear_config(SKX, n=64, k=512).kind == "gemm"
    assert gemm.fp8_linear_config(SPR, n=64, k=512).kind == "amx"


@needs_bf16
@pytest.mark.parametrize("groups,n,k", [(2, 96, 40), (1, 100, 256)])
def test_dense_gemm_bf16_matches_fp32_matmul(groups, n, k):
    """The grouped bf16 prefill GEMM: exact products summed in pairs, against torch's fp32
    einsum within 1e-6 of the sum of magnitudes; m 1, 31, 33 and 100 with row blocks of 64
    (partial register tiles, several row blocks), n 100: a partial last 32-column tile."""
    ex = tvm.compile(make_dense_gemm_bf16(groups=groups, n=n, k=k, row_block=64),
                     target=CPU.tvm_target())
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(groups, n, k, generator=gen).to(torch.bfloat16)
    for m in (1, 31, 33, 100):
        x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16)
        out = torch.zeros(m, groups, n)
        view = to_tvm(out)
        ex(to_tvm(x), to_tvm(w.reshape(groups * n, k)), view)
        out = to_torch(view)
        ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
        scale = torch.einsum("mgk,gnk->mgn", x.float().abs(), w.float().abs())
        assert bool(((out - ref).abs() <= 1e-6 * scale + 1e-30).all()), m


def test_dense_gemm_bf16_refuses_bad_shapes():
    with pytest.raises(ValueError, match="The bf16 dense GEMM needs an even k, got 41."):
        make_dense_gemm_bf16(groups=1, n=64, k=41)
    with pytest.raises(ValueError, match="row_block must be a positive multiple of 32; got 40."):
        make_dense_gemm_bf16(groups=1, n=64, k=64, row_block=40)


# ---- the fused prefill forms: each the kernels it stands for, bit for bit ---------------------

FUSED_ROWS = (1, 31, 70, 200)  # with row blocks of 64: partial, several, a partial last block


def _run(ex, *ts):
    ex(*[tvm.runtime.from_dlpack(t) for t in ts])


def _equal_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_bf16
@pytest.mark.parametrize("n,n2", [(512, 512), (96, 200)])
def test_paired_gemm_is_the_two_gemms(n, n2):
    """fp8_linear_pair's prefill kernel (x staged once, the first matrix's tasks then the
    second's): both outputs the plain GEMM's on each matrix, bit for bit, matrices of different
    heights and tile scales with partial 32-column tiles, rows over several row blocks."""
    k = 256
    pair = _compiled(n=n, k=k, row_block=64, pair_n=n2)
    one, two = _compiled(n=n, k=k, row_block=64), _compiled(n=n2, k=k, row_block=64)
    w, s = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=6)[1:]
    w2, s2 = gemm.example_inputs_fp8_linear(m=1, n=n2, k=k, seed=9)[1:]
    g = torch.Generator().manual_seed(n2)
    for m in FUSED_ROWS:
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        y, y2 = torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n2, dtype=torch.bfloat16)
        _run(pair, x, w, s, w2, s2, y, y2)
        assert _equal_bits(y, run_fp8_linear(one, x, w, s)), m
        assert _equal_bits(y2, run_fp8_linear(two, x, w2, s2)), m


@needs_bf16
def test_normed_gemm_is_the_rms_norm_kernel_then_the_gemm():
    """norm_fp8_linear's prefill kernel: the rms_norm kernel's rows (`kernel_numerics`' CPU
    rms_norm, the kernel the lowering would run) fed to the plain GEMM, bit for bit, with a
    row of huge values and a zero row (the norm's eps alone)."""
    from dsv41.schedules import norm

    n, k, eps = 96, 512, 1e-6
    lanes = norm.norm_config(CPU, d=k).lanes
    fused = _compiled(n=n, k=k, row_block=64, norm_eps=eps, norm_lanes=lanes)
    plain = _compiled(n=n, k=k, row_block=64)
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=5)[1:]
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16)
    for m in FUSED_ROWS:
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[0, ::11] *= 1e15
        x[-1] = 0.0
        want = run_fp8_linear(plain, kernel_rms_norm(x, w, eps), weight, scale)
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        _run(fused, x, w, weight, scale, got)
        assert _equal_bits(got, want), m


@needs_bf16
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_gemm_is_the_swiglu_then_the_gemm(limit):
    """swiglu_fp8_linear's prefill kernel: the plain GEMM's outputs on the lowering's own
    SwiGLU (`swiglu_relax`), bit for bit, with clamped values, gates at -200 and a zero row."""
    n, k = 96, 512
    fused = _compiled(n=n, k=k, row_block=64, swiglu_limit=limit)
    plain = _compiled(n=n, k=k, row_block=64)
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=8)[1:]
    g = torch.Generator().manual_seed(int(limit))
    swiglu = swiglu_relax(limit, k)
    for m in FUSED_ROWS:
        gate = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        up = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        gate[0, ::13] = -200.0
        up[-1] = 0.0
        h = torch.from_dlpack(swiglu["main"](tvm.runtime.from_dlpack(gate),
                                             tvm.runtime.from_dlpack(up)))
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        _run(fused, gate, up, weight, scale, got)
        assert _equal_bits(got, run_fp8_linear(plain, h, weight, scale)), m


@needs_bf16
def test_q_kv_gemm_is_the_pair_then_the_normed_gemm():
    """fp8_q_kv's prefill kernel, built as the lowering builds it (`build_fp8_q_kv`, m None):
    q_lora, kv and q the prefill pair and normed kernels' (tests above: those are the plain
    GEMMs'), bit for bit, partial 32-column tiles in every matrix."""
    n_q, n_kv, k, n_b, eps = 64, 40, 256, 72, 1e-6
    assert gemm.fp8_q_kv_fuses(CPU, n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, m=None)
    target = CPU.tvm_target()
    fused = tvm.compile(gemm.build_fp8_q_kv("cpu", n_q=n_q, n_kv=n_kv, k=k, n_b=n_b,
                                            norm_eps=eps, m=None), target=target)
    pair = tvm.compile(gemm.build_fp8_linear("cpu", n=n_q, k=k, m=None, pair_n=n_kv),
                       target=target)
    normed = tvm.compile(gemm.build_fp8_linear("cpu", n=n_b, k=n_q, m=None, norm_eps=eps),
                         target=target)
    wa, sa = gemm.example_inputs_fp8_linear(m=1, n=n_q, k=k, seed=11)[1:]
    wkv, skv = gemm.example_inputs_fp8_linear(m=1, n=n_kv, k=k, seed=12)[1:]
    wb, sb = gemm.example_inputs_fp8_linear(m=1, n=n_b, k=n_q, seed=13)[1:]
    g = torch.Generator().manual_seed(2)
    nw = (1 + 0.1 * torch.randn(n_q, generator=g)).to(torch.bfloat16)
    for m in (1, 70, 600):  # 600: two of the config's 512-row blocks
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[-1] = 0.0
        q_lora, kv, q = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        _run(fused, x, wa, sa, wkv, skv, nw, wb, sb, q_lora, kv, q)
        ql2, kv2, q2 = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        _run(pair, x, wa, sa, wkv, skv, ql2, kv2)
        _run(normed, ql2, nw, wb, sb, q2)
        for got, want in ((q_lora, ql2), (kv, kv2), (q, q2)):
            assert _equal_bits(got, want), m


def test_prefill_fuses_only_on_the_bf16_gemm():
    """The prefill GEMM pairs / norms / forms its SwiGLU on AVX-512 BF16 without AMX (the
    `gemm_bf16` kind); AMX and AVX-512 without BF16 keep the separate kernels; one form at a
    time."""
    assert gemm.fp8_linear_norms(ZEN4, n=512, k=1024, m=None)
    assert gemm.fp8_q_kv_fuses(ZEN4, n_q=512, n_kv=512, k=1024, n_b=32768, m=None)
    for target in (SPR, SKX):
        assert not gemm.fp8_linear_norms(target, n=512, k=1024, m=None)
        assert not gemm.fp8_q_kv_fuses(target, n_q=512, n_kv=512, k=1024, n_b=32768, m=None)
    with pytest.raises(ValueError, match="one of a norm, a second matrix or a SwiGLU"):
        make_fp8_gemm_bf16(n=64, k=512, pair_n=64, swiglu_limit=10.0)
    with pytest.raises(ValueError, match="lanes dividing"):
        make_fp8_gemm_bf16(n=64, k=512, norm_eps=1e-6, norm_lanes=24)
