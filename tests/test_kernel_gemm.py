"""TIR kernels of schedules/gemm/ against the torch oracles in graph/ops.py and graph/formats.py.

Tolerances:
* activation quantisation (the stage fp8_linear fuses, as a kernel of its own here),
  fp8_dequant: bit-exact (integer bit routes only);
* fp8_linear: every product and scale multiply is exact in fp32, but the 32
  additions inside one K-block follow torch's matmul order in the oracle and a fixed order in
  the kernel, so a partial sum can differ by 1 fp32 ulp; after bf16 rounding that shows up as
  at most 1 bf16 ulp on a small fraction of outputs. The tests require >= 99% of outputs
  bit-equal and the rest within 1 bf16 ulp. (The routed experts' chain: tests/test_kernel_moe.py.)
"""

from __future__ import annotations

import functools
import re

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from dsv41.graph import formats as fmt
from dsv41.graph import ops
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.schedules import gemm
from dsv41.schedules.common import (
    bf16_to_f32,
    has_amx_bf16,
    has_avx512,
    has_avx512_bf16,
    has_features,
    i64,
)
from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

CPU = "cpu"


@functools.cache
def _compiled(builder: str, **kwargs):
    """Compile one kernel once per session."""
    func = getattr(gemm, builder)(CPU, **kwargs) if builder.startswith("build_") else \
        getattr(gemm, builder)(**kwargs)
    return tvm.compile(func, target=get_target(CPU).tvm_target())


def _run(ex, inputs: list[torch.Tensor], out_shape, out_dtype) -> torch.Tensor:
    np_dtype = ml_dtypes.bfloat16 if out_dtype == torch.bfloat16 else \
        torch.empty(0, dtype=out_dtype).numpy().dtype
    out = tvm.runtime.tensor(np.zeros(out_shape, dtype=np_dtype))
    ex(*[to_tvm(t) for t in inputs], out)
    return to_torch(out)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two tensors of bf16-representable values."""
    def ordered(t):
        bits = t.to(torch.bfloat16).view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def _assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1) -> None:
    ulps = _bf16_ulps(out.float(), ref.float())
    assert int(ulps.max()) <= max_ulps, f"max {int(ulps.max())} bf16 ulps"
    assert float((ulps == 0).float().mean()) >= 0.99, f"{int((ulps > 0).sum())} outputs differ"


# ---- activation quantisation ----------------------------------------------------------------


def make_fp8_act_quant(*, k: int) -> tvm.tirx.PrimFunc:
    """x bf16 [m, k] -> (E4M3 codes uint8 [m, k], E8M0 scale bytes uint8 [m, k/32]) from the
    expressions the GEMMs' fused quantisation stage is built of (gemm.pow2_scale_byte,
    gemm.fp8_code): that stage checked on its own, bit for bit."""
    from tvm.script import tirx as T

    if k % gemm.BLOCK:
        raise ValueError(f"FP8 activation quantisation needs k a multiple of {gemm.BLOCK}, "
                         f"got {k}.")
    K, KB, B = i64(k), i64(k // gemm.BLOCK), gemm.BLOCK

    @T.prim_func(s_tir=True)
    def fp8_act_quant(x_h: T.handle, codes_h: T.handle, scales_h: T.handle):
        T.func_attr({"global_symbol": "fp8_act_quant", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        codes = T.match_buffer(codes_h, (m, K), "uint8")
        scales = T.match_buffer(scales_h, (m, KB), "uint8")
        amax = T.sblock_alloc_buffer((m, KB), "float32")
        for i, b, j in T.grid(m, KB, i64(B)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb], T.fabs(bf16_to_f32(x[vi, vb * B + vj])))
        for i, b in T.grid(m, KB):
            with T.sblock("scale"):
                vi, vb = T.axis.remap("SS", [i, b])
                scales[vi, vb] = T.Cast("uint8", gemm.pow2_scale_byte(amax[vi, vb]))
        for i, j in T.grid(m, K):
            with T.sblock("code"):
                vi, vj = T.axis.remap("SS", [i, j])
                codes[vi, vj] = gemm.fp8_code(bf16_to_f32(x[vi, vj]),
                                              T.Cast("uint32", scales[vi, vj // B]))

    return fp8_act_quant



def _quant_cases() -> torch.Tensor:
    """Every finite bf16 value (shuffled into groups of 32), all-zero and tiny groups (the amax
    floor), huge groups, and groups whose ratios sit at the E4M3 rounding/saturation edges."""
    g = torch.Generator().manual_seed(1)
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())]
    every = every[torch.randperm(every.numel(), generator=g)]
    every = every[: every.numel() // 64 * 64].reshape(-1, 64)
    zeros = torch.zeros(2, 64)
    tiny = torch.randn(2, 64, generator=g) * 1e-30
    huge = (torch.randn(2, 64, generator=g) * 1e38).clamp(-3e38, 3e38)
    # amax 448 * 2^k: ratios hit +-448 exactly; midpoints between E4M3 codes test ties to even
    edge = torch.tensor([448.0, -448.0, 464.0, 0.5 * (416 + 448), 2.0**-7, 3 * 2.0**-10,
                         2.0**-6 - 2.0**-12, 1.0625, 1.1875] * 7 + [0.0])[:64].repeat(2, 1)
    edge[1] *= 2.0**-20
    scaled = torch.randn(2, 64, generator=g) * torch.logspace(-30, 30, 64)
    rows = [every, zeros, tiny, huge, edge, scaled]
    return torch.cat([r.to(torch.bfloat16) for r in rows])


def test_act_quant_bit_exact():
    x = _quant_cases()
    ex = tvm.compile(make_fp8_act_quant(k=64), target=get_target(CPU).tvm_target())
    codes = tvm.runtime.tensor(np.zeros(x.shape, np.uint8))
    scales = tvm.runtime.tensor(np.zeros((x.shape[0], 2), np.uint8))
    ex(to_tvm(x), codes, scales)
    ref_codes, ref_scales = fmt.torch_quant_fp8(x.float())
    assert torch.equal(to_torch(scales), ref_scales)
    assert torch.equal(to_torch(codes), ref_codes)


def test_act_quant_rejects_partial_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        make_fp8_act_quant(k=48)


# ---- fp8_linear -----------------------------------------------------------------------------

CONFIG_HINTS = {"gemv": 1, "small": 4, "gemm": None}


@pytest.mark.parametrize("hint", sorted(CONFIG_HINTS))
@pytest.mark.parametrize("n", [96, 100])
def test_fp8_linear_matches_oracle(hint, n):
    k = 128
    ex = _compiled("build_fp8_linear", n=n, k=k, m=CONFIG_HINTS[hint])
    for m in (1, 3, 17, 64):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        out = _run(ex, [x, weight, scale], (m, n), torch.bfloat16)
        _assert_gemm_close(out, ops.fp8_linear(x, weight, scale))


def test_fp8_linear_config_kinds():
    cpu, cuda = get_target(CPU), get_target("cuda-sm90")
    amx = has_amx_bf16(cpu)
    avx2 = has_features(cpu, "avx2", "fma", "f16c") and not has_avx512(cpu)
    avx512 = has_features(cpu, "avx512bw", "fma", "f16c")
    assert gemm.fp8_linear_config(cpu, n=64, k=64, m=1).kind == (
        "gemv_avx2" if avx2 else "gemv_avx512" if avx512 else "gemv")
    skx = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
    cfg = gemm.fp8_linear_config(skx, n=64, k=512, m=1)
    assert cfg.kind == "gemv_avx512" and cfg.prefetch == 16 and cfg.prescheduled
    assert gemm.fp8_linear_config(skx, n=64, k=4096, m=1).kind == "gemv"  # 4 columns at once
    assert gemm.fp8_linear_config(skx, n=64, k=96, m=1).kind == "gemv"  # k % 64
    assert gemm.fp8_linear_config(get_target("cpu-x86-64"), n=64, k=64, m=1).kind == "gemv"
    # the portable AVX2 target (x86-64-v3) gets the AVX2 GEMV, whatever this host has
    assert gemm.fp8_linear_config(get_target("cpu-avx2"), n=64, k=512, m=1).kind == "gemv_avx2"
    assert gemm.fp8_linear_config(cpu, n=64, k=64, m=4).kind == "gemm"
    prefill = "amx" if amx else "gemm_bf16" if has_avx512_bf16(cpu) else "gemm"
    assert gemm.fp8_linear_config(cpu, n=64, k=64).kind == prefill
    assert gemm.fp8_linear_config(cpu, n=64, k=64, m=160).kind == prefill
    # n not whole 32-panels: no AMX form
    assert gemm.fp8_linear_config(cpu, n=100, k=64).kind == (
        "gemm_bf16" if has_avx512_bf16(cpu) else "gemm")
    assert gemm.fp8_linear_config(get_target("cpu-x86-64"), n=64, k=64).kind == "gemm"
    assert not has_amx_bf16(cuda)
    assert gemm.fp8_linear_config(cuda, n=64, k=64, m=2).kind == "gemv"
    assert gemm.fp8_linear_config(cuda, n=64, k=64).row_pad == 64


needs_amx = pytest.mark.skipif(not has_amx_bf16(get_target(CPU)),
                               reason="this CPU (or OS) offers no AMX-BF16")


@needs_amx
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_fp8_linear_amx_matches_oracle(out_dtype):
    """The AMX kernel over row counts that fill, cross and fall short of its 32-row tiles and
    blocks of 64 rows (three blocks at m 130), with several 32-column panels and K-blocks."""
    n, k = 96, 128
    ex = _compiled("make_fp8_linear_amx", n=n, k=k, block_rows=64, out_dtype=out_dtype)
    for m in (1, 5, 31, 32, 33, 64, 100, 130):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        if out_dtype == "float32":
            out = _run(ex, [x, weight, scale], (m, n), torch.float32)
            ref = ops.fp8_linear_f32(x, weight, scale)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            out = _run(ex, [x, weight, scale], (m, n), torch.bfloat16)
            _assert_gemm_close(out, ops.fp8_linear(x, weight, scale))


@needs_amx
def test_fp8_linear_amx_extreme_activations_and_nan_weights():
    k, n = 64, 32
    x = _quant_cases()[-12:]
    _, weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=3)
    weight[5, 7] = 0x7F  # an E4M3 NaN code: its column is NaN wherever the oracle's is
    ex = _compiled("make_fp8_linear_amx", n=n, k=k, block_rows=32)
    out = _run(ex, [x, weight, scale], (x.shape[0], n), torch.bfloat16)
    ref = ops.fp8_linear(x, weight, scale)
    out, ref = out.float(), ref.float()
    assert bool(torch.isnan(out[:, 5]).all()) and bool(torch.isnan(ref[:, 5]).all())
    # The oracle sums the unscaled weights and overflows (to +-inf, or NaN from inf - inf) on
    # the huge rows where the AMX kernel, which folds the weight scale in first, still holds the
    # finite sum: there the result is beyond any activation a model produces
    over = ~torch.isfinite(ref)
    over[:, 5] = False
    assert over.any()
    assert bool((~torch.isfinite(out[over]) | (out[over].abs() > 1e30)).all())
    finite = torch.isfinite(ref)
    assert bool(torch.isfinite(out[finite]).all())
    rows = finite[:, torch.arange(n) != 5].all(1)
    assert rows.sum() >= 6
    _assert_gemm_close(out[rows][:, torch.arange(n) != 5], ref[rows][:, torch.arange(n) != 5])


def test_fp8_linear_amx_refuses_partial_panels():
    with pytest.raises(ValueError, match="multiples of 32"):
        gemm.make_fp8_linear_amx(n=100, k=64, block_rows=32)
    with pytest.raises(ValueError, match="multiples of 32"):
        gemm.make_fp8_linear_amx(n=64, k=64, block_rows=48)


def test_fp8_linear_row_padded_definition():
    """The CUDA gemm's definition (activation rows padded to 64, padded rows read as zero),
    unscheduled on CPU: the padding must not change any output."""
    ex = _compiled("make_fp8_linear", n=64, k=64, row_pad=64)
    for m in (3, 70):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=64, k=64, seed=m)
        out = _run(ex, [x, weight, scale], (m, 64), torch.bfloat16)
        _assert_gemm_close(out, ops.fp8_linear(x, weight, scale))


def test_fp8_linear_extreme_activations():
    """Rows mixing zeros, tiny and huge magnitudes exercise the floor and saturation inside the
    fused quantisation stage."""
    k, n = 64, 32
    x = _quant_cases()[-12:]
    _, weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=3)
    tile = gemm.schedule_fp8_linear(gemm.make_fp8_linear(n=n, k=k),
                                    gemm.Fp8LinearConfig("gemm", tn=32, tm=256, rb=4),
                                    get_target(CPU))  # the tile kernel (AMX: the test below)
    ex = tvm.compile(tile, target=get_target(CPU).tvm_target())
    out = _run(ex, [x, weight, scale], (x.shape[0], n), torch.bfloat16)
    ref = ops.fp8_linear(x, weight, scale)
    finite = torch.isfinite(ref.float())
    assert torch.equal(torch.isfinite(out.float()), finite)
    _assert_gemm_close(out[finite.all(1)], ref[finite.all(1)])


def _assert_elementwise_exact(expr, x: torch.Tensor, ref: torch.Tensor) -> None:
    """b[i] = expr(a[i]) over 256 inputs, scalar and vectorised by 32, bit-equal to `ref` (NaN
    where ref is NaN), and the vectorised loop vector code: no more branches in its machine
    code than a plain conversion's (a scalarised if_then_else adds two or more per lane)."""
    from tvm import s_tir, te
    from tvm.script import tirx as T

    dtype = str(x.dtype).removeprefix("torch.")

    def build(fn, lanes: int):
        a = te.placeholder((256,), dtype, name="a")
        sch = s_tir.Schedule(te.create_prim_func([a, te.compute((256,), lambda i: fn(a[i]),
                                                              name="d")]))
        if lanes > 1:
            sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("d"))[0], [None, lanes])[1])
        return tvm.compile(sch.mod["main"], target=get_target(CPU).tvm_target())

    def branches(ex) -> int:
        return len(re.findall(r"\n\s+j[a-z]+\s", ex.mod.inspect_source("asm")))

    plain = branches(build(lambda v: T.Cast("float32", v), 32))
    for lanes in (1, 32):
        ex = build(expr, lanes)
        if lanes > 1:
            assert branches(ex) <= plain + 8, (branches(ex), plain)
        out = _run(ex, [x], (256,), torch.float32)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num().view(torch.int32), ref.nan_to_num().view(torch.int32))


def test_e8m0_decode_every_code_exactly_and_vectorised():
    """`e8m0_to_f32` (every block scale of the FP8 and FP4 kernels) equals the format module on
    all 256 codes (0: 2^-127, a subnormal; 0xff: NaN), and a vectorised loop of it is vector
    code, no branch per byte (as if_then_else gave, which cost the expert GEMVs more than their
    own work per block)."""
    from dsv41.schedules.common import e8m0_byte

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = torch.from_numpy(fmt.np_e8m0_decode(codes.numpy()).astype(np.float32))
    assert int(ref.isnan().sum()) == 1
    _assert_elementwise_exact(e8m0_byte, codes, ref)


def test_round_bf16_exact_and_vectorised():
    """`round_bf16` (every kernel epilogue's bf16 rounding) equals torch's fp32 -> bf16 -> fp32
    on ties, signed zeros, subnormals, infinities and NaNs (kept NaNs: tested with isnan, as
    TVM folds a float `x != x` to false and the rounding alone turns some NaN payloads into an
    infinity or a zero), and a vectorised loop of it is vector code (if_then_else gave a
    branch per lane, which made the AMX sweep's epilogue its largest cost)."""
    from dsv41.schedules.common import round_bf16

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (256,), generator=g, dtype=torch.int64)
    # ties to even (down, up), -0, a subnormal, inf, NaNs (two whose payload the rounding
    # alone would carry into an infinity and a zero)
    bits[:8] = torch.tensor([0x3F808000, 0x3F818000, 0x80000000, 0x00000001, 0x7F800000,
                             0x7FC00001, 0x7F800001, 0x7FFFFFFF])
    x = bits.to(torch.int32).view(torch.float32)
    _assert_elementwise_exact(round_bf16, x, x.to(torch.bfloat16).float())


def test_e4m3_f16_bits_decode_every_code_exactly():
    """The decode GEMV's 16-bit route (`e4m3_to_f16_bits`, converted by the hardware and times
    2^8) equals the format module on all 256 codes, NaN codes giving NaN, scalar and in 32
    vector lanes (the lane count the GEMV uses)."""
    from tvm import s_tir
    from tvm.script import tirx as T

    from dsv41.schedules.common import e4m3_to_f16_bits, f16_bits_to_f32

    @T.prim_func(s_tir=True)
    def decode(a: T.Buffer((256,), "uint8"), b: T.Buffer((256,), "float32")):
        for i in range(256):
            with T.sblock("d"):
                vi = T.axis.remap("S", [i])
                b[vi] = f16_bits_to_f32(e4m3_to_f16_bits(a[vi])) * T.float32(256.0)

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = torch.from_numpy(fmt.np_e4m3_decode(codes.numpy()).astype(np.float32))
    assert int(ref.isnan().sum()) == 2
    for lanes in (1, 32):
        sch = s_tir.Schedule(decode)
        if lanes > 1:
            sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("d"))[0], [None, lanes])[1])
        ex = tvm.compile(sch.mod["main"], target=get_target(CPU).tvm_target())
        out = _run(ex, [codes], (256,), torch.float32)
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num().view(torch.int32), ref.nan_to_num().view(torch.int32))


@pytest.mark.parametrize("k", [512, 2048])
def test_fp8_gemv_column_groups(k):
    """The scheduled decode GEMV sums one column at a time up to K 1024 and 4 together above
    (`fp8_linear_config`); both match the oracle, and their sum orders are the same bits."""
    base = get_target("cpu-x86-64")
    assert gemm.fp8_linear_config(base, n=64, k=k, m=1).cb == (1 if k <= 1024 else 4)
    n = 64
    x, weight, scale = gemm.example_inputs_fp8_linear(m=1, n=n, k=k, seed=k)
    outs = []
    for cb in (1, 4):
        func = gemm.schedule_fp8_linear(gemm.make_fp8_gemv(n=n, k=k),
                                        gemm.Fp8LinearConfig("gemv", cb=cb, vec=32),
                                        get_target(CPU))
        ex = tvm.compile(func, target=get_target(CPU).tvm_target())
        outs.append(_run(ex, [x, weight, scale], (1, n), torch.bfloat16))
        _assert_gemm_close(outs[-1], ops.fp8_linear(x, weight, scale))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_fp8_gemv_nan_and_subnormal_weights():
    """Every E4M3 code as a weight (row c holds code c): NaN codes give NaN rows, the rest
    (subnormals included) match the oracle."""
    n, k = 256, 64
    weight = torch.arange(n, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, k)
    scale = torch.full((n // 32, k // 32), 120, dtype=torch.uint8)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = _run(_compiled("build_fp8_linear", n=n, k=k, m=1), [x, weight, scale], (2, n),
               torch.bfloat16)
    ref = ops.fp8_linear(x, weight, scale)
    assert torch.equal(out.isnan(), ref.isnan()) and int(out.isnan().sum()) == 4
    _assert_gemm_close(out.nan_to_num(), ref.nan_to_num())


needs_avx2 = pytest.mark.skipif(not has_features(get_target(CPU), "avx2", "fma", "f16c"),
                                reason="this CPU has no AVX2 + FMA + F16C")


needs_avx512bw = pytest.mark.skipif(not has_features(get_target(CPU), "avx512bw", "fma", "f16c"),
                                    reason="this CPU has no AVX-512 BW + FMA + F16C")


@pytest.mark.parametrize("out_dtype,lanes,prefetch", [
    pytest.param("bfloat16", 8, 0, marks=needs_avx2),
    pytest.param("float32", 8, 0, marks=needs_avx2),
    pytest.param("bfloat16", 16, 16, marks=needs_avx512bw),
    pytest.param("float32", 16, 3, marks=needs_avx512bw)])
def test_fp8_gemv_avx2_edge_codes_and_lone_nans(out_dtype, lanes, prefetch):
    """The hand-vectorised decode GEMV (`make_fp8_gemv_avx2`, 256- and 512-bit, prefetching
    past the last column or not): random weights, except whole columns of
    the codes at the fp16 subnormal edge of its decode (0x01..0x07, 0x81..0x87, with zeros),
    of the largest and smallest normal codes (0x7e, 0xfe, 0x08, 0x88), and one NaN code (0x7f
    or 0xff) in single columns among many (first, middle and last 32-block of K, first and last
    column of a tile, the partial last tile); n not a multiple of 32, several rows."""
    n, k = 100, 256

    def codes(*c):  # the codes repeated over K
        return torch.tensor(c, dtype=torch.int32).to(torch.uint8).repeat(k // len(c) + 1)[:k]

    ex = _compiled("make_fp8_gemv_avx2", n=n, k=k, out_dtype=out_dtype, lanes=lanes,
                   prefetch=prefetch)
    for m in (1, 3):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        weight[2] = codes(*range(1, 8), 0, *range(0x81, 0x88), 0x80)
        weight[33] = codes(0x7E, 0x08, 0xFE, 0x88, 0x7E, 0x7E, 0x88)
        weight[65] = codes(*range(0x81, 0x88), 1, 2)
        nans = {0: (0x7F, 0), 31: (0xFF, k - 1), 32: (0x7F, 130), 57: (0xFF, 31), 99: (0x7F, 64)}
        for c, (code, j) in nans.items():
            weight[c, j] = code
        if out_dtype == "float32":
            out = _run(ex, [x, weight, scale], (m, n), torch.float32)
            ref = ops.fp8_linear_f32(x, weight, scale)
        else:
            out = _run(ex, [x, weight, scale], (m, n), torch.bfloat16)
            ref = ops.fp8_linear(x, weight, scale)
        out, ref = out.float(), ref.float()
        nan_cols = torch.zeros(n, dtype=torch.bool)
        nan_cols[list(nans)] = True
        assert torch.equal(ref.isnan(), nan_cols.expand(m, n))
        assert torch.equal(out.isnan(), ref.isnan())
        if out_dtype == "float32":
            torch.testing.assert_close(out[:, ~nan_cols], ref[:, ~nan_cols], rtol=1e-5, atol=1e-5)
        else:
            _assert_gemm_close(out[:, ~nan_cols], ref[:, ~nan_cols])


@pytest.mark.parametrize("lanes,rows,out_dtype", [
    pytest.param(8, 3, "bfloat16", marks=needs_avx2),
    pytest.param(8, 6, "float32", marks=[needs_avx2, pytest.mark.slow]),
    pytest.param(16, 3, "float32", marks=[needs_avx512bw, pytest.mark.slow]),
    # the verify entry's (block 5) on AVX-512 without BF16 (BF16 CPUs run bf16_gemv, tested in
    # test_kernel_fp8_rows.py); 25 s, so with the slow tests
    pytest.param(16, 6, "bfloat16", marks=[needs_avx512bw, pytest.mark.slow])])
def test_fp8_gemv_rows_bit_identical_to_single_row(lanes, rows, out_dtype):
    """The verify form of the hand GEMV (`make_fp8_gemv_avx2(rows=)`: rows in groups that share
    each weight load) gives every row the exact bits the decode kernel gives that row alone, at
    m = 1..6 (one group, full or partial) and m = 7, 13 (several groups, a partial last one);
    n not a multiple of 32 (a partial last tile), a NaN weight, all-zero and extreme rows."""
    n, k = 100, 256
    dtype = torch.bfloat16 if out_dtype == "bfloat16" else torch.float32
    one = _compiled("make_fp8_gemv_avx2", n=n, k=k, out_dtype=out_dtype, lanes=lanes,
                    prefetch=3 if lanes == 16 else 0)
    multi = _compiled("make_fp8_gemv_avx2", n=n, k=k, out_dtype=out_dtype, lanes=lanes,
                      prefetch=3 if lanes == 16 else 0, rows=rows)
    for m in (1, 2, 3, 4, 5, 6, 7, 13):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        weight[40, 77] = 0x7F  # a NaN column
        x[m // 2] = 0  # an all-zero row (the amax floor)
        x[-1, :32] = torch.tensor(3.0e38).to(torch.bfloat16)  # near the bf16 top
        out = _run(multi, [x, weight, scale], (m, n), dtype)
        for i in range(m):
            ref = _run(one, [x[i:i + 1].clone(), weight, scale], (1, n), dtype)
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(out[i:i + 1].view(bits), ref.view(bits)), (m, i)
        assert int(out.isnan().sum()) == m  # column 40 of every row, nothing else


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gemv_avx2_scale_extremes_run_as_stored(rows):
    """The 256-bit GEMV's fast path scales x by 2^(s - 7) (its bf16-bits decode reads the
    weights times 2^-120): tiles whose scale would overflow that factor (s 140, 250) or
    shrink x below exactness (s 0, 3), and rows of huge or tiny x, run as stored; every
    output stays the oracle's (fp32, the order of additions aside) and each row of the verify
    form the decode form's bit for bit."""
    n, k = 160, 256
    x, weight, scale = gemm.example_inputs_fp8_linear(m=4, n=n, k=k, seed=31)
    scale[1] = 140  # columns 32..63: 2^13 weight scales (the fast factor would be 2^133)
    scale[2, 3] = 150
    scale[3] = 3  # columns 96..127: 2^-124 scales
    scale[4, :2] = 0
    x[1] *= 2.0**90  # a huge row: x 2^(s - 7) leaves fp32 for every tile
    x[2] *= 2.0**-90  # a tiny one
    one = _compiled("make_fp8_gemv_avx2", n=n, k=k, out_dtype="float32")
    out = _run(one, [x, weight, scale], (4, n), torch.float32)
    ref = ops.fp8_linear_f32(x, weight, scale)
    assert bool(torch.isfinite(ref).all()) and bool(torch.isfinite(out).all())
    w = fmt.torch_e4m3_decode(weight).double() * fmt.torch_e8m0_decode(scale).double()[
        torch.arange(n) // 32][:, torch.arange(k) // 32]
    bound = (x.double().abs() @ w.abs().T) * 2.0**-19  # x's quantised magnitude within 2x
    assert bool(((out.double() - ref.double()).abs() <= bound).all())
    if rows > 1:
        multi = _compiled("make_fp8_gemv_avx2", n=n, k=k, out_dtype="float32", rows=rows)
        got = _run(multi, [x, weight, scale], (4, n), torch.float32)
        assert torch.equal(got.view(torch.int32), out.view(torch.int32))


def test_fp8_gemv_rows_refuses_bad_group():
    for rows in (0, 9):
        with pytest.raises(ValueError, match=f"The fp8 GEMV takes 1..8 rows per group; got "
                                             f"rows={rows}."):
            gemm.make_fp8_gemv_avx2(n=64, k=256, rows=rows)


def test_fp8_linear_config_verify_rows():
    """The verify entry's FP8 linears (rows > 1): the hand GEMV kinds take groups of up to
    `VERIFY_GROUP_ROWS` (all the rows, at most 8); the scheduled GEMV, the tile GEMM and CUDA
    keep decode's kernel."""
    skx = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
    hsw = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "haswell"})
    assert gemm.VERIFY_GROUP_ROWS == gemm.MAX_ROWS == 8
    cfg = gemm.fp8_linear_config(skx, n=64, k=512, m=1, rows=6)
    assert (cfg.kind, cfg.rows, cfg.prefetch) == ("gemv_avx512", 6, 16)
    assert gemm.fp8_linear_config(skx, n=64, k=512, m=1, rows=9).rows == 8
    assert gemm.fp8_linear_config(skx, n=64, k=512, m=1, rows=2).rows == 2
    assert gemm.fp8_linear_config(skx, n=64, k=512, m=1).rows == 1  # decode
    assert gemm.fp8_linear_config(hsw, n=64, k=4096, m=1, rows=6) == gemm.Fp8LinearConfig(
        "gemv_avx2", rows=6)
    assert gemm.fp8_linear_config(skx, n=64, k=4096, m=1, rows=6).rows == 1  # scheduled gemv
    assert gemm.fp8_linear_config(get_target("cuda-sm90"), n=64, k=512, m=1, rows=6).rows == 1
    # AVX-512 BF16 + VBMI: the verify's groups by FMA pairs where the CPU has AMX (Intel, whose
    # vdpbf16ps is slow), decode on vdpbf16ps everywhere
    spr = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "sapphirerapids"})
    zen4 = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "znver4"})
    for target, fma in ((spr, True), (zen4, False)):
        cfg = gemm.fp8_linear_config(target, n=64, k=512, m=1, rows=6)
        assert (cfg.dot, cfg.fma_rows) == ("bf16", fma)
        assert not gemm.fp8_linear_config(target, n=64, k=512, m=1).fma_rows


# ---- dequantisation -------------------------------------------------------------------------


def test_fp8_dequant_bit_exact():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3, 2)  # [3, 512]
    scales = torch.tensor([[0, 1, 100, 127, 128, 200, 254, 255] * 2] * 3, dtype=torch.uint8)
    out = _run(_compiled("build_fp8_dequant", d=512), [codes, scales], (3, 512), torch.float32)
    ref = ops.fp8_dequant(codes, scales)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())


# ---- CUDA -----------------------------------------------------------------------------------

ALL_ARCHS = ("cuda-sm80", "cuda-sm90", "cuda-sm100")
# Each build is a child process (~6 s here): the gemm on every arch and the rest on sm_90 by
# default, everything on every arch under the slow marker.
CUDA_BUILDS = [
    ("build_fp8_linear", {"n": 100, "k": 128}, ("cuda-sm90",)),
    ("build_fp8_linear", {"n": 100, "k": 128, "m": 1}, ("cuda-sm90",)),
    ("build_fp8_dequant", {"d": 512}, ("cuda-sm90",)),
]
SLOW_CUDA_BUILDS = [
    ("build_fp8_linear", {"n": 100, "k": 128}, ("cuda-sm80", "cuda-sm100")),
    ("build_fp8_linear", {"n": 100, "k": 128, "m": 1}, ("cuda-sm80", "cuda-sm100")),
    ("build_fp8_dequant", {"d": 512}, ("cuda-sm80", "cuda-sm100")),
]


def _check_cuda_builds(tmp_path, builder, kwargs, targets):
    problem = toolchain_problem()
    if problem:
        pytest.skip(problem)
    for target in targets:
        out = tmp_path / f"{builder}_{target}.so"
        build_cuda(f"dsv41.schedules.gemm:{builder}", {"target_name": target, **kwargs}, target,
                   out)
        arch = "sm_" + target.removeprefix("cuda-sm")
        assert has_device_code(out, arch), f"{builder} for {target} holds no {arch} code"


@pytest.mark.parametrize("builder,kwargs,targets", CUDA_BUILDS)
def test_cuda_builds_have_device_code(tmp_path, builder, kwargs, targets):
    _check_cuda_builds(tmp_path, builder, kwargs, targets)


@pytest.mark.slow
@pytest.mark.parametrize("builder,kwargs,targets", SLOW_CUDA_BUILDS)
def test_cuda_builds_other_archs(tmp_path, builder, kwargs, targets):
    _check_cuda_builds(tmp_path, builder, kwargs, targets)


def _gpu_or_skip():
    if not tvm.cuda().exist:
        pytest.skip("no CUDA GPU on this machine")


@pytest.mark.gpu
@pytest.mark.parametrize("m_hint", [1, None])
def test_fp8_linear_gpu_matches_oracle(m_hint):
    _gpu_or_skip()
    target = get_target("cuda-sm90" if tvm.cuda().compute_version >= "9.0" else "cuda-sm80")
    n, k = 100, 128
    with target.tvm_target():
        ex = tvm.compile(gemm.build_fp8_linear(target.name, n=n, k=k, m=m_hint),
                         target=target.tvm_target())
    dev = tvm.cuda()
    for m in (1, 3, 17, 64, 130):
        x, weight, scale = gemm.example_inputs_fp8_linear(m=m, n=n, k=k, seed=m)
        out = tvm.runtime.tensor(np.zeros((m, n), ml_dtypes.bfloat16), dev)
        ex(*[to_tvm(t, dev) for t in (x, weight, scale)], out)
        _assert_gemm_close(to_torch(out.copyto(tvm.cpu())), ops.fp8_linear(x, weight, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("builder,ref,shape", [
    ("build_fp8_dequant", ops.fp8_dequant, ((4, 512), (4, 16))),
])
def test_dequant_gpu_bit_exact(builder, ref, shape):
    _gpu_or_skip()
    target = get_target("cuda-sm80")
    with target.tvm_target():
        ex = tvm.compile(getattr(gemm, builder)(target.name, d=512), target=target.tvm_target())
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, shape[0], generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(1, 120, shape[1], generator=g, dtype=torch.int32).to(torch.uint8)
    dev = tvm.cuda()
    out = tvm.runtime.tensor(np.zeros((4, 512), np.float32), dev)
    ex(tvm.runtime.tensor(codes.numpy(), dev), tvm.runtime.tensor(scales.numpy(), dev), out)
    expect = ref(codes, scales)
    got = torch.from_numpy(out.numpy())
    assert torch.equal(got.isnan(), expect.isnan())
    assert torch.equal(got.nan_to_num(), expect.nan_to_num())


# ---- dense_gemv -----------------------------------------------------------------------------


@pytest.mark.parametrize("groups,n,k,x_dtype,w_dtype", [
    (8, 64, 256, torch.bfloat16, torch.bfloat16),  # the grouped o-projection's form
    (1, 100, 96, torch.float32, torch.float32),  # the head's form; a partial column tile
    (1, 40, 8, torch.bfloat16, torch.float32),  # K below the lane count
    (3, 7, 48, torch.float32, torch.bfloat16),
])
def test_dense_gemv_matches_fp32_matmul(groups, n, k, x_dtype, w_dtype):
    """fp32 products of the stored values summed in fp32: equal to torch's fp32 einsum up to
    the order of the additions (relative 1e-6 of the row's magnitude)."""
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    ex = tvm.compile(gemm.build_dense_gemv(CPU, groups=groups, n=n, k=k, x_dtype=name[x_dtype],
                                           w_dtype=name[w_dtype]),
                     target=get_target(CPU).tvm_target())
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(groups, n, k, generator=gen).to(w_dtype)
    for m in (1, 3):
        x = torch.randn(m, groups, k, generator=gen).to(x_dtype)
        out = _run(ex, [x, w.reshape(groups * n, k)], (m, groups, n), torch.float32)
        ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
        scale = torch.einsum("mgk,gnk->mgn", x.float().abs(), w.float().abs())
        assert bool(((out - ref).abs() <= 1e-6 * scale + 1e-30).all())


@pytest.mark.parametrize("groups,n,k,x_dtype,w_dtype", [
    (8, 64, 256, torch.bfloat16, torch.bfloat16),  # the grouped o-projection's form
    (1, 100, 96, torch.float32, torch.float32),  # the head's form; a partial column tile
    (1, 40, 8, torch.bfloat16, torch.float32),  # K below the lane count
    (3, 7, 48, torch.float32, torch.bfloat16),
    (1, 1, 64, torch.bfloat16, torch.float32),  # one column: cb 1
    (2, 3, 32, torch.bfloat16, torch.bfloat16),  # three columns (bf16_dot on AVX-512 BF16)
    (2, 40, 64, torch.bfloat16, torch.bfloat16),  # a partial column tile (bf16_dot)
    (2, 5, 48, torch.bfloat16, torch.bfloat16),  # k % 32: the fp32 lanes form for bf16
])
def test_dense_gemv_rows_bit_identical_to_the_single_row_kernel(groups, n, k, x_dtype, w_dtype):
    """The verify / draft form (`make_dense_gemv_rows`, or on AVX-512 BF16 with bf16 x and w
    `make_dense_gemv_bf16_dot(rows=)`: a group's rows share each weight load) gives every row
    the single-row kernel's bits, at any row count (whole groups, a partial last group, fewer
    rows than a group)."""
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    dims = dict(groups=groups, n=n, k=k, x_dtype=name[x_dtype], w_dtype=name[w_dtype])
    one = _compiled("build_dense_gemv", **dims)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(groups * n, k, generator=gen).to(w_dtype)
    for rows in (2, 6, 13):  # 13: one column per register group (bf16_dot)
        ex = _compiled("build_dense_gemv", **dims, rows=rows)
        # bf16_dot: m % rows rows run as a group of exactly them (m 11 of 13: a padded group)
        for m in (1, 5, 6, 11, 13):
            x = torch.randn(m, groups, k, generator=gen).to(x_dtype)
            want = _run(one, [x, w], (m, groups, n), torch.float32)
            assert torch.equal(_run(ex, [x, w], (m, groups, n), torch.float32), want)
    with pytest.raises(ValueError, match="rows >= 2"):
        gemm.make_dense_gemv_rows(**dims, rows=1)


needs_avx512bf16 = pytest.mark.skipif(not has_avx512_bf16(get_target(CPU)),
                                      reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")


def _dot_order_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`make_dense_gemv_bf16_dot`'s stated arithmetic in torch: per column 16 fp32 lanes from
    0, per chunk of 32 along K lane l += product 2l + 1, then product 2l (each product exact),
    then the lanes added pairwise (halves first)."""
    m, g, k = x.shape
    prod = (x.float()[:, :, None, :] * w.float().view(g, -1, k)[None]).view(m, g, -1, k // 32,
                                                                             16, 2)
    acc = torch.zeros(prod.shape[:3] + (16,))
    for ch in range(k // 32):
        acc = acc + prod[..., ch, :, 1]
        acc = acc + prod[..., ch, :, 0]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


@needs_avx512bf16
@pytest.mark.parametrize("groups,n,k", [(8, 64, 256), (2, 40, 64), (1, 3, 32)])
def test_dense_gemv_bf16_dot_sums_in_its_stated_order_bit_for_bit(groups, n, k):
    """bf16 x and w on AVX-512 BF16: the decode kernel and its verify form (rows 6) equal the
    torch emulation of their order bit for bit (every product is exact; denormal-free values),
    NaN and inf weights included; against torch's fp32 einsum they stay within the 1e-6 of
    `test_dense_gemv_matches_fp32_matmul` (measured at the o-projection's g 8, n 512, k 4096:
    1.7e-8 of the row's magnitude from the exact sum, torch's own einsum 2.1e-8)."""
    dims = dict(groups=groups, n=n, k=k, x_dtype="bfloat16", w_dtype="bfloat16")
    assert gemm.dense_gemv_config(get_target(CPU), n=n, k=k, x_dtype="bfloat16",
                                  w_dtype="bfloat16").kind == "bf16_dot"
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(groups * n, k, generator=gen).to(torch.bfloat16)
    w[n - 1, 5], w[0, k - 1] = float("nan"), float("inf")
    for rows in (1, 6):
        ex = _compiled("build_dense_gemv", **dims, rows=rows)
        for m in (1, 5, 7):
            x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16)
            out = _run(ex, [x, w], (m, groups, n), torch.float32)
            want = _dot_order_reference(x, w)
            assert torch.equal(out.isnan(), want.isnan()), (rows, m)
            assert torch.equal(out.nan_to_num(), want.nan_to_num()), (rows, m)
            assert bool(out[:, 0, n - 1].isnan().all()) and bool(out[:, 0, 0].isinf().all())


@needs_avx512bf16
def test_dense_gemv_bf16_dot_fma_rows_equal_vdpbf16ps_bit_for_bit():
    """`fma_rows` (each vdpbf16ps of a group of 2+ rows as two FMAs, `dpbf16ps_by_fma`) gives
    the vdpbf16ps kernel's bits at every row count (groups of 6 and 2..5 left over, one row
    alone on vdpbf16ps), with NaN, inf and zero weights, a zero row and activations from
    2^-60 to 2^60 (normal products and sums: where vdpbf16ps and an FMA agree)."""
    groups, n, k = 3, 40, 128
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(groups * n, k, generator=gen).to(torch.bfloat16)
    w[n - 1, 5], w[0, k - 1], w[7] = float("nan"), float("inf"), 0.0
    kernels = {fma: tvm.compile(gemm.make_dense_gemv_bf16_dot(
        groups=groups, n=n, k=k, rows=6, tn=32, cb=4, fma_rows=fma),
        target=get_target(CPU).tvm_target()) for fma in (False, True)}
    for m in (1, 2, 5, 6, 7, 13):
        x = torch.randn(m, groups, k, generator=gen)
        x = x * torch.exp2(torch.randint(-60, 61, (m, groups, k), generator=gen).float())
        x[m // 2] = 0.0
        x = x.to(torch.bfloat16)
        outs = [_run(kernels[fma], [x, w], (m, groups, n), torch.float32) for fma in (0, 1)]
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), m


@needs_avx512bf16
def test_dense_gemv_bf16_dot_bf16_stores_are_the_fp32_kernel_rounded():
    """out_dtype bfloat16 (the grouped o-projection's output, rounded in the kernel instead of
    by a cast kernel after it): every output is the fp32 kernel's rounded to bf16 as torch
    rounds (NaN stays NaN), at one row and in a verify group, with partial column tiles, NaN /
    inf weights and sums that round up at a tie's neighbourhood (random bits)."""
    groups, n, k = 3, 40, 96
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(groups * n, k, generator=gen).to(torch.bfloat16)
    w[n - 1, 5], w[0, k - 1] = float("nan"), float("inf")
    target = get_target(CPU).tvm_target()
    for rows, cb in ((1, 8), (6, 4)):
        fp32, bf16 = (tvm.compile(gemm.make_dense_gemv_bf16_dot(
            groups=groups, n=n, k=k, rows=rows, tn=32, cb=cb, out_dtype=dt), target=target)
            for dt in ("float32", "bfloat16"))
        for m in (1, 5, 6, 7):
            x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16)
            want = _run(fp32, [x, w], (m, groups, n), torch.float32).to(torch.bfloat16)
            got = _run(bf16, [x, w], (m, groups, n), torch.bfloat16)
            nan = want.isnan()
            assert bool(nan.any()) and torch.equal(got.isnan(), nan)
            assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_dense_gemv_stores_bf16_only_in_its_hand_forms():
    """Where the target's GEMV is the scheduled lanes form (neither AVX-512 BF16 nor AVX2), a
    bf16 store is refused and `dense_gemv_rounds` says so (the lowering then rounds the fp32
    result)."""
    dims = dict(groups=8, n=64, k=256, x_dtype="bfloat16", w_dtype="bfloat16")
    assert not gemm.dense_gemv_rounds(get_target("cpu-x86-64"), n=64, k=256,
                                      x_dtype="bfloat16", w_dtype="bfloat16")
    with pytest.raises(ValueError, match="only in its bf16_dot and fma forms"):
        gemm.build_dense_gemv("cpu-x86-64", **dims, out_dtype="bfloat16")
    assert not gemm.dense_gemv_rounds(get_target(CPU), n=64, k=256, x_dtype="float32",
                                      w_dtype="bfloat16")
    with pytest.raises(ValueError, match="stores float32 or bfloat16"):
        gemm.make_dense_gemv_bf16_dot(**{k: v for k, v in dims.items() if "dtype" not in k},
                                      out_dtype="float16")


@needs_avx512bf16
def test_dense_gemv_bf16_dot_prefetch_changes_no_bit():
    """The weight prefetch (`prefetch` column groups ahead, the config's 1) reads nothing the
    sums see: every output equals the kernel without it bit for bit, at one row and in a
    verify group, with partial column tiles, the last groups' reach clamped to the weight's
    last row, and NaN / inf weights."""
    groups, n, k = 3, 40, 96  # 40 columns: a tile of 32 and a partial one of 8
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(groups * n, k, generator=gen).to(torch.bfloat16)
    w[n - 1, 5], w[0, k - 1] = float("nan"), float("inf")
    target = get_target(CPU).tvm_target()
    for rows, cb in ((1, 8), (6, 4)):
        kernels = [tvm.compile(gemm.make_dense_gemv_bf16_dot(
            groups=groups, n=n, k=k, rows=rows, tn=32, cb=cb, prefetch=p), target=target)
            for p in (0, 1, 3)]
        for m in (1, 5, 7):
            x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16)
            outs = [_run(ex, [x, w], (m, groups, n), torch.float32) for ex in kernels]
            for out in outs[1:]:
                assert torch.equal(outs[0].view(torch.int32), out.view(torch.int32)), (rows, m)
    if has_avx512_bf16(get_target(CPU)):
        assert gemm.dense_gemv_config(get_target(CPU), n=512, k=4096, x_dtype="bfloat16",
                                      w_dtype="bfloat16").prefetch == 1


def test_dense_gemv_config_kinds():
    """bf16_dot wherever the target has AVX-512 BF16 and x, w are bf16 with k % 32 == 0; the
    fp32 lanes form elsewhere (fp32 weights as the head's: bf16 products would not be exact);
    rows x cb accumulators stay within 24 registers; one row takes 8 columns at once."""
    bf = {"x_dtype": "bfloat16", "w_dtype": "bfloat16"}
    cpu, x86 = get_target(CPU), get_target("cpu-x86-64")
    dot = "bf16_dot" if has_avx512_bf16(cpu) else "lanes"
    assert gemm.dense_gemv_config(cpu, n=512, k=4096, **bf).kind == dot
    assert gemm.dense_gemv_config(cpu, n=512, k=4096, x_dtype="bfloat16",
                                  w_dtype="float32").kind == "lanes"
    assert gemm.dense_gemv_config(cpu, n=512, k=48, **bf).kind == "lanes"
    assert gemm.dense_gemv_config(x86, n=512, k=4096, **bf).kind == "lanes"
    assert gemm.dense_gemv_config(cpu, n=512, k=4096).kind == "lanes"  # dtypes unknown
    if has_avx512_bf16(cpu):
        cbs = [gemm.dense_gemv_config(cpu, n=n, k=64, rows=r, **bf).cb
               for n, r in ((512, 1), (512, 6), (512, 8), (512, 12), (512, 13), (3, 1), (7, 6))]
        assert cbs == [8, 4, 2, 2, 1, 3, 1]
        # verify groups by FMA pairs where vdpbf16ps is slow (Intel with AMX), never decode's
        for rows in (1, 6):
            cfg = gemm.dense_gemv_config(cpu, n=512, k=4096, rows=rows, **bf)
            assert cfg.fma_rows == (rows > 1 and has_amx_bf16(cpu))
    # targets without it keep the fp32 lanes form: it builds and runs, each row as one row's
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    w = torch.randn(2 * 8, 64, generator=gen).to(torch.bfloat16)
    outs = [_run(tvm.compile(gemm.build_dense_gemv("cpu-x86-64", groups=2, n=8, k=64, **bf,
                                                   rows=rows), target=x86.tvm_target()),
                 [x, w], (5, 2, 8), torch.float32) for rows in (1, 6)]
    assert torch.equal(outs[0], outs[1])
    ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(2, 8, 64))
    assert float((outs[0] - ref).abs().max()) <= 1e-5


def test_dense_gemv_bf16_dot_refuses_bad_dims():
    with pytest.raises(ValueError, match="k a multiple of 32, got 48"):
        gemm.make_dense_gemv_bf16_dot(groups=1, n=8, k=48)
    with pytest.raises(ValueError, match="cb >= 1 dividing tn; got rows=1, cb=3, tn=32"):
        gemm.make_dense_gemv_bf16_dot(groups=1, n=64, k=64, cb=3)
    with pytest.raises(ValueError, match="rows >= 1"):
        gemm.make_dense_gemv_bf16_dot(groups=1, n=64, k=64, rows=0)


@pytest.mark.parametrize("groups,n,k,x_dtype,w_dtype", [
    (8, 64, 256, torch.bfloat16, torch.bfloat16),  # the grouped o-projection's form
    (2, 96, 40, torch.bfloat16, torch.bfloat16),  # a column tile of gcd(96, 64) = 32
    (1, 100, 96, torch.float32, torch.float32),  # the head's form; tn = gcd(100, 64) = 4
    (3, 7, 48, torch.float32, torch.bfloat16),
])
def test_dense_gemm_matches_fp32_matmul(groups, n, k, x_dtype, w_dtype):
    """The prefill form: fp32 products of the stored values summed in order over K, equal to
    torch's fp32 einsum up to the order of the additions (relative 1e-6 of the row's magnitude),
    at row counts that fill the 4-row tiles, leave a partial last tile, or are below a tile."""
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    ex = tvm.compile(gemm.build_dense_gemm(CPU, groups=groups, n=n, k=k, x_dtype=name[x_dtype],
                                           w_dtype=name[w_dtype]),
                     target=get_target(CPU).tvm_target())
    gen = torch.Generator().manual_seed(n + 1)
    w = torch.randn(groups, n, k, generator=gen).to(w_dtype)
    for m in (1, 3, 8, 13):
        x = torch.randn(m, groups, k, generator=gen).to(x_dtype)
        out = _run(ex, [x, w.reshape(groups * n, k)], (m, groups, n), torch.float32)
        ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
        scale = torch.einsum("mgk,gnk->mgn", x.float().abs(), w.float().abs())
        assert bool(((out - ref).abs() <= 1e-6 * scale + 1e-30).all()), m


@needs_amx
def test_dense_gemm_amx_matches_fp32_matmul():
    """The AMX form (bf16 x and w): exact products summed in fp32 in the tiles' order, at row
    counts below, at and across its 32-row tiles and blocks of 64 rows, 3 groups x 2 panels."""
    groups, n, k = 3, 64, 96
    ex = _compiled("make_dense_gemm_amx", groups=groups, n=n, k=k, block_rows=64)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(groups, n, k, generator=gen).to(torch.bfloat16)
    for m in (1, 31, 32, 33, 70, 130):
        x = torch.randn(m, groups, k, generator=gen).to(torch.bfloat16)
        out = _run(ex, [x, w.reshape(groups * n, k)], (m, groups, n), torch.float32)
        ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float())
        scale = torch.einsum("mgk,gnk->mgn", x.float().abs(), w.float().abs())
        assert bool(((out - ref).abs() <= 1e-6 * scale + 1e-30).all()), m


def test_dense_gemm_config_kinds():
    cpu = get_target(CPU)
    dot = "bf16_dot" if has_avx512_bf16(cpu) else "tile"
    amx = "amx" if has_amx_bf16(cpu) else dot
    bf = {"x_dtype": "bfloat16", "w_dtype": "bfloat16"}
    assert gemm.dense_gemm_config(cpu, n=512, k=4096, **bf).kind == amx
    assert gemm.dense_gemm_config(cpu, n=512, k=4096, **bf).block_rows in (128, 32, 256)
    assert gemm.dense_gemm_config(cpu, n=512, k=4096, x_dtype="float32",
                                  w_dtype="bfloat16").kind == "tile"  # fp32 products: not exact
    assert gemm.dense_gemm_config(cpu, n=96, k=40, **bf).kind == dot  # no AMX form
    zen4 = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "znver4"})
    skx = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
    assert gemm.dense_gemm_config(zen4, n=512, k=4096, **bf).kind == "bf16_dot"
    assert gemm.dense_gemm_config(zen4, n=512, k=41, **bf).kind == "tile"  # odd k
    assert gemm.dense_gemm_config(skx, n=512, k=4096, **bf).kind == "tile"
    with pytest.raises(ValueError, match="multiples of 32"):
        gemm.make_dense_gemm_amx(groups=1, n=64, k=40, block_rows=32)


def test_dense_gemm_refuses_bad_tiles_dtypes_and_cuda():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gemm.make_dense_gemm(groups=1, n=8, k=8, x_dtype="float16", w_dtype="float32")
    with pytest.raises(ValueError, match="rb >= 1"):
        gemm.make_dense_gemm(groups=1, n=8, k=8, x_dtype="float32", w_dtype="float32", rb=0)
    with pytest.raises(ValueError, match="no CUDA schedule"):
        gemm.dense_gemm_config(get_target("cuda-sm90"), n=8, k=8)
    func = gemm.make_dense_gemm(groups=1, n=8, k=8, x_dtype="float32", w_dtype="float32", rb=2)
    with pytest.raises(ValueError, match="make_dense_gemm"):
        gemm.schedule_dense_gemm(func, gemm.DenseGemmConfig(tn=8, rb=4), get_target(CPU))


def test_dense_gemv_refuses_other_dtypes_and_cuda():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        gemm.make_dense_gemv(groups=1, n=8, k=8, x_dtype="float16", w_dtype="float32")
    with pytest.raises(ValueError, match="no CUDA schedule"):
        gemm.dense_gemv_config(get_target("cuda-sm90"), n=8, k=8)


def test_grouped_einsum_pattern():
    from dsv41.compiler.lower import _grouped_einsum

    assert _grouped_einsum("bsgd,grd->bsgr")
    assert _grouped_einsum("sgd, grd -> sgr")
    assert not _grouped_einsum("bsgd,gdr->bsgr")  # weight not (g, r, d)
    assert not _grouped_einsum("bsgd,grd->bsrg")  # output order
    assert not _grouped_einsum("bsgd,gsd->bsgs")  # repeated letter
    assert not _grouped_einsum("bsgd,grd,grd->bsgr")
