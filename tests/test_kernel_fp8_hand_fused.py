"""The hand-vectorised decode GEMV's fused forms (`gemm.make_fp8_gemv_avx2` with norm_eps,
swiglu_limit or pair_n; `schedules/gemm/avx2_wrappers.py`): each the kernels it replaces in
turn, bit for bit, one row and the verify's groups, in 256-bit vectors (the `cpu-avx2`
target's) and 512-bit ones (AVX-512 without BF16)."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import run_fp8_linear, swiglu_relax

from dsv41.compiler.build import tir_pipeline
from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.schedules import gemm, norm
from dsv41.schedules.common import has_features

CPU = get_target("cpu")
AVX2 = get_target("cpu-avx2")
LANES = [pytest.param(8, marks=pytest.mark.skipif(not has_features(CPU, "avx2", "fma", "f16c"),
                                                  reason="this CPU cannot run AVX2 code")),
         pytest.param(16, marks=pytest.mark.skipif(not has_features(CPU, "avx512bw", "fma"),
                                                   reason="this CPU has no AVX-512 BW"))]


def _target(lanes: int):
    return AVX2 if lanes == 8 else CPU


@functools.cache
def _compiled(lanes: int, **kwargs):
    target = _target(lanes)
    return tvm.compile(gemm.make_fp8_gemv_avx2(lanes=lanes, **kwargs),
                       target=target.tvm_target(), tir_pipeline=tir_pipeline(target.name))


def _run(f, *ts):
    f(*[tvm.runtime.from_dlpack(t) for t in ts])


def _same(got: torch.Tensor, want: torch.Tensor, m: int) -> None:
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), m


def test_the_hand_gemvs_fuse():
    assert gemm.fp8_linear_norms(AVX2, n=32768, k=512, m=1)
    assert gemm.fp8_linear_norms(AVX2, n=512, k=1024, m=1, rows=6)
    assert not gemm.fp8_linear_norms(AVX2, n=512, k=1024, m=None)  # prefill: the scheduled GEMM
    assert not gemm.fp8_linear_norms(get_target("cpu-x86-64"), n=512, k=1024, m=1)
    assert gemm.fp8_q_kv_fuses(AVX2, n_q=512, n_kv=576, k=1024, n_b=32768, m=1, rows=6)
    assert not gemm.fp8_q_kv_fuses(AVX2, n_q=512, n_kv=576, k=1024, n_b=32768, m=None)
    with pytest.raises(ValueError, match="one of them"):
        gemm.make_fp8_gemv_avx2(n=64, k=256, norm_eps=1e-6, pair_n=64)
    with pytest.raises(ValueError, match="lanes dividing"):
        gemm.make_fp8_gemv_avx2(n=64, k=256, norm_eps=1e-6, norm_lanes=24)
    with pytest.raises(ValueError, match="pair_n > 0"):
        gemm.make_fp8_gemv_avx2(n=64, k=256, pair_n=0)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("rows", [1, 6])
def test_normed_gemv_is_the_rms_norm_kernel_then_the_gemv(lanes, rows):
    """Every output the target's rms_norm kernel's rows fed to the plain GEMV, bit for bit (m
    1, 5, 7), a row of large values and a zero row (the norm's eps alone)."""
    n, k, eps = 96, 512, 1e-6
    target = _target(lanes)
    nl = norm.norm_config(target, d=k).lanes
    fused = _compiled(lanes, n=n, k=k, rows=rows, norm_eps=eps, norm_lanes=nl)
    plain = _compiled(lanes, n=n, k=k, rows=rows)
    rms = tvm.compile(norm.build_rms_norm(target.name, d=k, eps=eps), target=target.tvm_target())
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=5)[1:]
    g = torch.Generator().manual_seed(rows + lanes)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16)
    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[0, ::11] *= 1e15
        x[-1] = 0.0
        xn = torch.empty_like(x)
        _run(rms, x, w, xn)
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        _run(fused, x, w, weight, scale, got)
        _same(got, run_fp8_linear(plain, xn, weight, scale), m)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_gemv_is_the_swiglu_then_the_gemv(lanes, rows, limit):
    """Every output the plain GEMV's on the lowering's own SwiGLU, bit for bit, with clamped
    values, large negative gates (silu -> -0) and a zero row; the oracle within 1 bf16 ulp."""
    n, k = 96, 512
    fused = _compiled(lanes, n=n, k=k, rows=rows, swiglu_limit=limit)
    plain = _compiled(lanes, n=n, k=k, rows=rows)
    weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=8)[1:]
    g = torch.Generator().manual_seed(rows + int(limit) + lanes)
    swiglu = swiglu_relax(limit, k)
    for m in (1, 5, 7):
        gate = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        up = (torch.randn(m, k, generator=g) * 6).to(torch.bfloat16)
        gate[0, ::13] = -200.0
        up[-1] = 0.0
        h = torch.from_dlpack(swiglu["main"](tvm.runtime.from_dlpack(gate),
                                             tvm.runtime.from_dlpack(up)))
        got = torch.zeros(m, n, dtype=torch.bfloat16)
        _run(fused, gate, up, weight, scale, got)
        _same(got, run_fp8_linear(plain, h, weight, scale), m)
        ref = ops.swiglu_fp8_linear(gate, up, limit, weight, scale)
        assert float((got.float() - ref.float()).abs().max()) <= float(
            ref.float().abs().max()) * 2.0**-7


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("rows,n,n2", [(1, 512, 576), (6, 96, 200)])
def test_paired_gemv_is_the_two_gemvs(lanes, rows, n, n2):
    """Both outputs the plain GEMV's on each matrix, bit for bit, matrices of different heights
    with partial tiles."""
    k = 256
    pair = _compiled(lanes, n=n, k=k, rows=rows, pair_n=n2)
    one, two = _compiled(lanes, n=n, k=k, rows=rows), _compiled(lanes, n=n2, k=k, rows=rows)
    w, s = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=6)[1:]
    w2, s2 = gemm.example_inputs_fp8_linear(m=1, n=n2, k=k, seed=9)[1:]
    s2[::3] += 3  # other tile scales than the first matrix's
    g = torch.Generator().manual_seed(rows + n2 + lanes)
    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        y, y2 = torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, n2, dtype=torch.bfloat16)
        _run(pair, x, w, s, w2, s2, y, y2)
        _same(y, run_fp8_linear(one, x, w, s), m)
        _same(y2, run_fp8_linear(two, x, w2, s2), m)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("rows", [1, 6])
def test_q_kv_kernel_is_the_pair_then_the_normed_gemv(lanes, rows):
    """fp8_q_kv's hand kernel (`make_fp8_q_kv_avx2`): q_lora, kv and q the paired and normed
    kernels', bit for bit, m 1..7, partial 32-column tiles in every matrix."""
    n_q, n_kv, k, n_b, eps = 64, 40, 256, 72, 1e-6
    target = _target(lanes)
    nl = norm.norm_config(target, d=n_q).lanes
    fused = tvm.compile(gemm.make_fp8_q_kv_avx2(n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=eps,
                                                norm_lanes=nl, lanes=lanes, rows=rows),
                        target=target.tvm_target(), tir_pipeline=tir_pipeline(target.name))
    pair = _compiled(lanes, n=n_q, k=k, rows=rows, pair_n=n_kv)
    normed = _compiled(lanes, n=n_b, k=n_q, rows=rows, norm_eps=eps, norm_lanes=nl)
    wa, sa = gemm.example_inputs_fp8_linear(m=1, n=n_q, k=k, seed=11)[1:]
    wkv, skv = gemm.example_inputs_fp8_linear(m=1, n=n_kv, k=k, seed=12)[1:]
    wb, sb = gemm.example_inputs_fp8_linear(m=1, n=n_b, k=n_q, seed=13)[1:]
    g = torch.Generator().manual_seed(rows + lanes)
    nw = (1 + 0.1 * torch.randn(n_q, generator=g)).to(torch.bfloat16)
    for m in (1, 5, 7):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[-1] = 0.0
        q_lora, kv, q = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        _run(fused, x, wa, sa, wkv, skv, nw, wb, sb, q_lora, kv, q)
        ql2, kv2, q2 = (torch.zeros(m, c, dtype=torch.bfloat16) for c in (n_q, n_kv, n_b))
        _run(pair, x, wa, sa, wkv, skv, ql2, kv2)
        _run(normed, ql2, nw, wb, sb, q2)
        for got, want in ((q_lora, ql2), (kv, kv2), (q, q2)):
            _same(got, want, m)
