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
from kernel_numerics import SKX, SPR, ZEN4, bf16_ulps, run_fp8_linear

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
