"""The dense GEMV over an FP8 weight (E4M3 codes, E8M0 scale per 32 x 32 tile: the hub's `wo_a`):
every form equals the same form over the bf16 weight `dequantize_fp8_tiles` makes, bit for bit
(the hand-vectorised AVX-512 BF16 form, decode and verify groups, FMA pairs; the scheduled fp32
lanes form and its row groups on a baseline x86-64 target), at half the weight's bytes."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from dsv41.graph.checkpoint.fp8_tiles import EXACT_SCALE_BYTES, dequantize_fp8_tiles
from dsv41.graph.targets import cpu_flags, get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.schedules import gemm
from dsv41.schedules.common import has_avx512_bf16, has_features
from dsv41.schedules.gemm.avx2_gemv import make_fp8_gemv_avx2
from dsv41.schedules.gemm.bf16_gemm import make_dense_gemm_bf16

CPU = "cpu"
BASE = "cpu-x86-64"  # no AVX-512: the scheduled fp32 lanes forms
needs_dot = pytest.mark.skipif(
    not (has_avx512_bf16(get_target(CPU)) and has_features(get_target(CPU), "avx512vbmi")),
    reason="the bf16_dot form needs AVX-512 BF16 and VBMI")


def _weights(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes over every finite E4M3 code (zeros, -0, subnormals, the largest) and tile scales
    over the exact range, its two ends included."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes
    codes[0, :8] = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE])
    grid = (-(-rows // 32), k // 32)
    lo, hi = EXACT_SCALE_BYTES.start, EXACT_SCALE_BYTES.stop - 1
    scales = torch.randint(118, 124, grid, generator=g, dtype=torch.int32)
    scales[0, 0], scales[-1, -1] = lo, hi
    return codes.to(torch.uint8), scales.to(torch.uint8)


@functools.cache
def _built(target: str, **dims):
    return tvm.compile(gemm.build_dense_gemv(target, **dims),
                       target=get_target(target).tvm_target())


def _call(ex, inputs, shape, dtype) -> torch.Tensor:
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    out = tvm.runtime.tensor(np.zeros(shape, dtype=np_dtype))
    ex(*[to_tvm(t) for t in inputs], out)
    return to_torch(out)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    itype = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    diff = (a.view(itype) != b.view(itype)).sum()
    assert int(diff) == 0, f"{int(diff)} of {a.numel()} outputs differ in their bits"


def _check(target: str, groups: int, n: int, k: int, rows: int, m: int, out_dtype: str,
           seed: int = 0) -> None:
    codes, scales = _weights(groups * n, k, seed)
    w = dequantize_fp8_tiles(codes, scales, 32)
    x = (torch.randn(m, groups, k, generator=torch.Generator().manual_seed(seed + 1)) * 3
         ).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -3e4])
    # beside the largest scale (the last tile): scaled, these leave bf16's range, so that task
    # scales the weights instead of x (`make_dense_gemv_bf16_dot`'s one-row groups)
    x[0, -1, -3:] = torch.tensor([1e30, -2e29, 1e-38])
    dims = dict(groups=groups, n=n, k=k, x_dtype="bfloat16", rows=rows, out_dtype=out_dtype)
    ref = _call(_built(target, w_dtype="bfloat16", **dims), [x, w], (m, groups, n), out_dtype)
    got = _call(_built(target, w_dtype="fp8", **dims), [x, codes, scales], (m, groups, n),
                out_dtype)
    _same_bits(got, ref)
    assert (torch.isfinite(ref.float()) & (ref.float() != 0)).float().mean() > 0.5  # not vacuous


@needs_dot
@pytest.mark.parametrize("n", [64, 48])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_bf16_dot_decode_equals_the_dequantised_weight_bit_for_bit(n, out_dtype):
    assert gemm.dense_gemv_config(get_target(CPU), n=n, k=128, x_dtype="bfloat16",
                                  w_dtype="fp8").kind == "bf16_dot"
    _check(CPU, 2, n, 128, 1, 1, out_dtype)
    _check(CPU, 2, n, 128, 1, 3, out_dtype, seed=5)  # rows of one at a time


@needs_dot
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7])
def test_bf16_dot_verify_groups_equal_the_dequantised_weight_bit_for_bit(m):
    _check(CPU, 2, 64, 256, 6, m, "bfloat16", seed=m)


@needs_dot
def test_bf16_dot_fma_pairs_equal_the_dequantised_weight_bit_for_bit():
    codes, scales = _weights(64, 128, 3)
    w = dequantize_fp8_tiles(codes, scales, 32)
    x = torch.randn(5, 2, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    dims = dict(groups=2, n=32, k=128, rows=6, tn=32, cb=4, fma_rows=True)
    ex = {fp8: tvm.compile(gemm.make_dense_gemv_bf16_dot(**dims, fp8=fp8),
                           target=get_target(CPU).tvm_target()) for fp8 in (False, True)}
    ref = _call(ex[False], [x, w], (5, 2, 32), "float32")
    _same_bits(_call(ex[True], [x, codes, scales], (5, 2, 32), "float32"), ref)


@pytest.mark.parametrize("rows,m", [(1, 2), (4, 3)])
def test_lanes_forms_equal_the_dequantised_weight_bit_for_bit(rows, m):
    """Without AVX-512 (and at a k no 64-code load covers) the scheduled fp32 forms decode each
    code to its exact fp32 value times the tile's scale."""
    assert gemm.dense_gemv_config(get_target(BASE), n=64, k=96, x_dtype="bfloat16",
                                  w_dtype="fp8").kind == "lanes"
    _check(BASE, 2, 64, 96, rows, m, "float32")


def test_fp8_forms_refuse_a_k_off_their_blocks():
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm.make_dense_gemv_bf16_dot(groups=1, n=32, k=96, fp8=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.make_dense_gemv(groups=1, n=32, k=48, x_dtype="bfloat16", w_dtype="fp8")


@needs_dot
@pytest.mark.parametrize("special", ["denormals", "inf"])
def test_bf16_dot_denormal_and_infinite_rows_stay_bit_identical(special):
    """Zeros and denormal activations (read as zero by vdpbf16ps), and an inf among them, at
    ordinary tile scales: the same bits as the BF16 weight's kernel."""
    codes, scales = _weights(128, 256, 7)
    scales = torch.randint(116, 124, scales.shape, generator=torch.Generator().manual_seed(8),
                           dtype=torch.int32).to(torch.uint8)
    w = dequantize_fp8_tiles(codes, scales, 32)
    x = torch.randn(5, 2, 256, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    bits = x.view(torch.int16)
    bits[:, :, ::7] = torch.tensor([1, -32767, 0, -32768, 0x7F], dtype=torch.int16).repeat(
        37)[: bits[:, :, ::7].shape[-1]]  # denormals of both signs, +-0
    if special == "inf":
        x[2, 1, 100] = float("inf")
    for rows, m in ((1, 1), (6, 5)):
        dims = dict(groups=2, n=64, k=256, x_dtype="bfloat16", rows=rows, out_dtype="float32")
        ref = _call(_built(CPU, w_dtype="bfloat16", **dims), [x[:m], w], (m, 2, 64), "float32")
        got = _call(_built(CPU, w_dtype="fp8", **dims), [x[:m], codes, scales], (m, 2, 64),
                    "float32")
        _same_bits(got, ref)


@needs_dot
@pytest.mark.parametrize("n,m", [(64, 40), (48, 300)])
def test_prefill_gemm_decodes_each_tile_bit_identically(n, m):
    """The prefill GEMM's FP8 form (`make_dense_gemm_bf16(fp8=True)`: each task decodes its tile
    once) against its bf16 form over the dequantized weight: a partial column tile, two row
    blocks."""
    if has_features(get_target(CPU), "amx-bf16"):
        pytest.skip("AMX hosts dequantize the weight for the AMX GEMM")
    assert gemm.dense_gemm_reads_fp8(get_target(CPU), n=n, k=128)  # VBMI: the lookup
    codes, scales = _weights(2 * n, 128, 11)
    w = dequantize_fp8_tiles(codes, scales, 32)
    x = (torch.randn(m, 2, 128, generator=torch.Generator().manual_seed(12)) * 2).to(
        torch.bfloat16)
    ex = {wd: tvm.compile(gemm.build_dense_gemm(CPU, groups=2, n=n, k=128, x_dtype="bfloat16",
                                                w_dtype=wd), target=get_target(CPU).tvm_target())
          for wd in ("bfloat16", "fp8")}
    ref = _call(ex["bfloat16"], [x, w], (m, 2, n), "float32")
    _same_bits(_call(ex["fp8"], [x, codes, scales], (m, 2, n), "float32"), ref)
    assert (torch.isfinite(ref) & (ref != 0)).float().mean() > 0.5


@needs_dot
@pytest.mark.parametrize("w_dtype", ["bfloat16", "fp8"])
def test_prefill_gemm_stores_bf16_as_the_caller_rounds(w_dtype):
    """The prefill GEMM storing bf16 itself (`out_dtype`, `dense_gemm_rounds`: the rounding
    kernel after it folded in): every output the fp32 GEMM's sum rounded to nearest even, bit
    for bit (torch's fp32 -> bf16 cast, which `round_to_bf16` equals on finite values; NaN and
    infinite sums stay NaN and infinite)."""
    if has_features(get_target(CPU), "amx-bf16"):
        pytest.skip("AMX hosts run the AMX GEMM, which stores fp32")
    n, m = 48, 300
    assert gemm.dense_gemm_rounds(get_target(CPU), n=n, k=128, x_dtype="bfloat16",
                                  w_dtype=w_dtype)
    codes, scales = _weights(2 * n, 128, 13)
    weight = [codes, scales] if w_dtype == "fp8" else [dequantize_fp8_tiles(codes, scales, 32)]
    x = (torch.randn(m, 2, 128, generator=torch.Generator().manual_seed(14)) * 2).to(
        torch.bfloat16)
    ex = {out: tvm.compile(gemm.build_dense_gemm(CPU, groups=2, n=n, k=128, x_dtype="bfloat16",
                                                 w_dtype=w_dtype, out_dtype=out),
                           target=get_target(CPU).tvm_target())
          for out in ("float32", "bfloat16")}
    ref = _call(ex["float32"], [x, *weight], (m, 2, n), "float32")
    got = _call(ex["bfloat16"], [x, *weight], (m, 2, n), "bfloat16")
    finite = torch.isfinite(ref)  # the weights hold every code, NaN and the largest too
    assert float(finite.float().mean()) > 0.5
    _same_bits(got[finite], ref[finite].to(torch.bfloat16))
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    assert torch.equal(got[torch.isinf(ref)].float(), ref[torch.isinf(ref)])
    with pytest.raises(ValueError, match="stores float32 or bfloat16"):
        make_dense_gemm_bf16(groups=1, n=64, k=64, out_dtype="float16")


AVX2 = "cpu-avx2"  # x86-64-v3: the hand-vectorised fp32 FMA forms ("fma")
needs_avx2 = pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                                reason="this CPU cannot run AVX2 code")


@needs_avx2
@pytest.mark.parametrize("rows", [1, 6])
def test_fma_forms_equal_the_dequantised_weight_bit_for_bit(rows):
    """On AVX2 (no AVX-512 BF16) the dense GEMV over the FP8 weight is the hand-vectorised
    fp32 FMA form (`make_fp8_gemv_avx2`'s dense form), and over the dequantized bf16 weight its
    bf16 twin: the same bits, one row and the verify's groups (m 1, 5 and 7 against 6)."""
    for w_dtype in ("fp8", "bfloat16"):
        assert gemm.dense_gemv_config(get_target(AVX2), n=64, k=256, x_dtype="bfloat16",
                                      w_dtype=w_dtype, rows=rows).kind == "fma"
    for m in (1, 5, 7):
        _check(AVX2, 2, 64, 256, rows, m, "float32", seed=m + rows)


@pytest.mark.skipif(not has_features(get_target(CPU), "avx512bw", "fma", "f16c"),
                    reason="this CPU has no AVX-512 BW")
@pytest.mark.parametrize("rows", [1, 6])
def test_fma_form_in_512_bit_vectors_equals_its_bf16_twin(rows):
    """The fma form on AVX-512 without BF16 (lanes 16: the fp16 decode, x on the tile's
    2^(s - 119) where exact): over the FP8 weight and over its dequantized bf16 copy, the same
    bits, one row and the verify's groups, with activations that leave the fast path."""
    target = get_target(CPU).tvm_target()

    def built(w_dtype):
        return tvm.compile(make_fp8_gemv_avx2(n=64, k=256, groups=2, rows=rows, lanes=16,
                                              out_dtype="float32", w_dtype=w_dtype),
                           target=target)

    codes, scales = _weights(128, 256, 50 + rows)
    w = dequantize_fp8_tiles(codes, scales, 32)
    fp8, bf16 = built("fp8"), built("bfloat16")
    for m in (1, 5, 7):
        x = (torch.randn(m, 2, 256, generator=torch.Generator().manual_seed(m)) * 3).to(
            torch.bfloat16)
        x[0, -1, -3:] = torch.tensor([1e30, -2e29, 1e-38])
        got = _call(fp8, [x, codes, scales], (m, 2, 64), "float32")
        _same_bits(got, _call(bf16, [x, w], (m, 2, 64), "float32"))


@needs_avx2
@pytest.mark.parametrize("rows", [1, 6])
def test_fma_form_stores_bf16_as_the_graph_rounds(rows):
    """The fma form stores bf16 itself (`out_dtype`, `dense_gemv_rounds`): its fp32 outputs
    rounded as the graph rounds them (torch's ties-to-even), bit for bit, NaN where they are
    NaN, FP8 and bf16 weights alike (the twin check of the test above, in bf16)."""
    assert gemm.dense_gemv_rounds(get_target(AVX2), n=64, k=256, x_dtype="bfloat16",
                                  w_dtype="fp8", rows=rows)
    codes, scales = _weights(128, 256, 31)
    x = (torch.randn(7, 2, 256, generator=torch.Generator().manual_seed(32)) * 3).to(
        torch.bfloat16)
    dims = dict(groups=2, n=64, k=256, x_dtype="bfloat16", w_dtype="fp8", rows=rows)
    f32 = _call(_built(AVX2, **dims), [x, codes, scales], (7, 2, 64), "float32")
    bf16 = _call(_built(AVX2, **dims, out_dtype="bfloat16"), [x, codes, scales], (7, 2, 64),
                 "bfloat16")
    want = f32.to(torch.bfloat16)
    nan = torch.isnan(f32)
    assert torch.equal(torch.isnan(bf16), nan)  # (torch writes NaN's sign its own way)
    _same_bits(bf16[~nan], want[~nan])
    assert 0 < int((~torch.isfinite(f32)).sum()) < f32.numel() // 4  # the largest scales
    for m in (1, 5):
        _check(AVX2, 2, 64, 256, rows, m, "bfloat16", seed=m + 40)


@needs_avx2
def test_fma_form_rows_match_one_row_and_the_oracle():
    """Each row of the verify's groups equals the decode kernel's on that row alone, bit for
    bit; against the fp32 product of x and the dequantized weight every output is within fp32
    rounding of the row's largest term (only the order of the additions differs); a NaN code
    makes its column NaN."""
    codes, scales = _weights(128, 512, 21)
    scales = torch.randint(116, 124, scales.shape, generator=torch.Generator().manual_seed(23),
                           dtype=torch.int32).to(torch.uint8)  # no sum near fp32's top
    codes[5, 7] = 0x7F  # a NaN code: column 5 of group 0
    w = dequantize_fp8_tiles(codes, scales, 32)
    x = (torch.randn(7, 2, 512, generator=torch.Generator().manual_seed(22)) * 3).to(
        torch.bfloat16)
    dims = dict(groups=2, n=64, k=512, x_dtype="bfloat16", w_dtype="fp8")
    one = _call(_built(AVX2, **dims), [x, codes, scales], (7, 2, 64), "float32")
    grouped = _call(_built(AVX2, **dims, rows=6), [x, codes, scales], (7, 2, 64), "float32")
    _same_bits(grouped, one)
    assert bool(torch.isnan(one[:, 0, 5]).all()) and int(torch.isnan(one).sum()) == 7
    ref = torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(2, 64, 512))
    live = ~torch.isnan(ref)
    bound = (x.float().abs().unsqueeze(2) * w.float().view(2, 64, 512).abs()).sum(-1) * 2.0**-20
    assert bool(((one - ref).abs()[live] <= bound[live]).all())
    with pytest.raises(ValueError, match="bfloat16 in its dense form"):
        make_fp8_gemv_avx2(n=64, k=512, w_dtype="bfloat16")


def _scaled_x_kernel():
    from tvm.script import tirx as T

    from dsv41.schedules.common import e4m3_words

    @T.prim_func
    def f(x: T.Buffer((32,), "uint16"), sb: T.Buffer((1,), "uint8"),
          y: T.Buffer((32,), "uint16"), fl: T.Buffer((32,), "uint16")):
        r = T.meta_var(e4m3_words.scaled_x_words(x[T.ramp(0, 1, 32)], sb[0]))
        y[T.ramp(0, 1, 32)] = r[0]
        fl[T.ramp(0, 1, 32)] = r[1]

    return tvm.compile(f, target=get_target(CPU).tvm_target())


@pytest.mark.parametrize("byte", [10, 120, 127, 140, 246])
def test_scaled_x_words_moves_normal_exponents_and_flags_what_leaves_the_range(byte):
    """Each normal activation times 2^(byte - 127) exactly where that is a normal bf16, flagged
    where it is not; zeros and denormals as the zero of their sign; inf and NaN as they are."""
    vals = torch.tensor([1.0, -3.0, 1e-30, -1e30, 3e38, 1e-38, 0.0, -0.0, float("inf"),
                         float("-inf"), float("nan"), 0.15625, -448.0, 2.0 ** -126, 1e10,
                         -7e-20], dtype=torch.float32)
    x = torch.cat([vals, -vals]).to(torch.bfloat16)
    x[6] = 0.0
    bits = x.view(torch.int16).clone()
    bits[20], bits[21] = 1, -32767  # denormals of both signs
    x = bits.view(torch.bfloat16)
    ex = _scaled_x_kernel()
    y = tvm.runtime.tensor(np.zeros(32, np.uint16))
    fl = tvm.runtime.tensor(np.zeros(32, np.uint16))
    ex(to_tvm(bits.view(torch.uint16)), to_tvm(torch.tensor([byte], dtype=torch.uint8)), y, fl)
    got, flags = to_torch(y).view(torch.bfloat16), to_torch(fl)
    e = byte - 127
    for i in range(32):
        v, u = float(x[i]), int(bits[i]) & 0xFFFF
        exp = (u >> 7) & 0xFF
        if exp == 0:  # zero or denormal: the zero of its sign
            assert int(flags[i]) == 0 and int(got[i].view(torch.int16)) & 0xFFFF == u & 0x8000
        elif exp == 0xFF:  # inf or NaN: unchanged
            assert int(flags[i]) == 0
            assert int(got[i].view(torch.int16)) & 0xFFFF == u
        elif 1 <= exp + e <= 254:
            assert int(flags[i]) == 0 and float(got[i]) == v * 2.0 ** e
        else:
            assert int(flags[i]) == 1
