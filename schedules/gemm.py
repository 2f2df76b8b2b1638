"""Block-scaled GEMMs and dequantisation: `fp8_linear`, the decode `dense_gemv`, `fp8_dequant`
(oracles in graph/ops.py, number formats in graph/formats.py; the routed experts' chain, which
shares this arithmetic: schedules/moe.py).

Arithmetic shared by the GEMMs, and why it matches the oracle:

* Activations are quantised to FP8 per 32 along K exactly as `formats.torch_quant_fp8`: fp32
  amax floored at 1e-4, E8M0 byte = exponent(amax * fp32(1/448)) + (mantissa != 0), ratio
  clamped to +-448, E4M3 round-to-nearest-even. Every step is integer bit work or an exact
  power-of-two product (never an fp division or an LLVM fp8 cast), so it is bit-exact on CPU
  and with nvcc's fast math.
* The kernels keep the activation as its dequantised fp32 value `q * 2^s` (exact). Scaling all
  terms of an fp32 sum by a power of two scales every rounding with it, so
  `sum(q * 2^s * w) == sum(q * w) * 2^s` bit for bit; the oracle's `(A_k @ B_k^T) * a_s` is
  therefore reproduced without a separate activation-scale multiply.
* y = sum over K blocks, in block order from 0, of `partial_k * b_s`; every product of two
  decoded values is exact in fp32, so the only difference to the oracle is the order of the 32
  additions inside a block (torch's matmul picks its own): ~1 ulp of fp32 on a few partial
  sums, which shows up as 1 bf16 ulp on a small fraction of outputs.
* The CPU decode GEMV (`make_fp8_gemv`; on x86 at K <= 2048 `make_fp8_gemv_avx2`, the
  same arithmetic hand-vectorised on 256- or 512-bit vectors) folds the weight scales (and
  the 2^8 of its fp16 weight decode) into the activation instead (again exact products) and
  sums all of K at once, in vector lanes added pairwise at the end: a different order of fp32
  additions, with the same bound against the oracle.
* Weights are decoded per tile (registers / local or shared memory), never as a full copy.

TVM 0.27 traps met here (worked around below): a bf16 Cast inside a `Let` value is compiled as
an integer conversion (so bf16 is widened on the bits, `bf16_to_f32`); unsigned compares against a
Let-bound var crash the simplifier (signed compares instead); an intermediate buffer sized by a
symbolic dim cannot live in a CUDA kernel (the CUDA fp8_linear fuses its quantisation stage;
schedules/moe.py passes the routed experts' token-sized buffers as arguments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import (
    amx,
    amx_configure,
    amx_dot_32x32,
    bf16_bits_of_exact,
    bf16_to_f32,
    e4m3_to_f16_bits,
    e4m3_to_f32,
    e8m0_byte,
    e8m0_to_f32,
    f16_bits_to_f32,
    has_amx_bf16,
    has_avx512,
    has_features,
    i64,
    let,
    pairwise_lane_sum,
    u32,
)
from dsv41.schedules.common import prefetch as prefetch_line

BLOCK = 32  # FP8/MXFP4 quantisation group along K, and the weight tile edge

# ---- FP8 activation quantisation as TIR expressions (uint32 / fp32 lanes) -------------------


def pow2_scale_byte(amax):
    """E8M0 byte of the per-32 scale: exponent field of max(amax, 1e-4) * fp32(1/448), plus one
    if its mantissa is nonzero, saturated at 0xFF (formats.torch_round_scale_pow2). The floor is
    applied here so the amax reduction keeps max's identity (-inf; CUDA allreduce needs it)."""
    def body(bits):
        e = (bits >> u32(23)) & u32(0xFF)
        up = T.Cast("uint32", (bits & u32(0x7FFFFF)) != u32(0))
        return T.min(e + up, u32(0xFF))

    floored = T.max(amax, T.float32(fmt.FP8_AMAX_FLOOR))
    return let(T.reinterpret("uint32", floored * T.float32(fmt.FP8_MAX_INV)), body, "amax_bits")


def inv_pow2_scale(byte):
    """1 / 2^(byte-127) as fp32 bits (exact for bytes 1..253, the range of every finite bf16
    amax above the 1e-4 floor); byte 0 gives 2^127, bytes 254/255 give NaN."""
    def body(b):
        bi = T.Cast("int32", b)  # signed compares: the simplifier negates unsigned bounds
        ok = T.And(bi >= 1, bi <= 253)
        return T.reinterpret("float32",
                             T.if_then_else(ok, (u32(254) - b) << u32(23), u32(0x7FC00000)))

    return let(byte, body, "byte")


def pow2_scale(byte):
    """2^(byte-127) for bytes 1..254 (`e8m0_to_f32` without its 0/0xFF cases, which the quantiser
    never produces from a finite amax; uses no unsigned compares, see `inv_pow2_scale`)."""
    return T.reinterpret("float32", byte << u32(23))


def e4m3_round(r, *, code: bool):
    """r (fp32, already clamped to [-448, 448]) rounded to the nearest E4M3 value, ties to even:
    its fp32 value (code=False) or its E4M3 byte as uint32 (code=True); the sign of zero is kept.

    Normal range: RNE on the fp32 bits down to 3 mantissa bits (a carry into the exponent is the
    right rounding). Subnormal range (|r| < 2^-6): round |r| * 2^9 to an integer with an RNE
    shift of the 24-bit significand; code 8 there is exactly the smallest normal code."""

    def on_bits(u):  # fp32 bits of r
        sign = u & u32(0x80000000)
        bits = u & u32(0x7FFFFFFF)
        rn = (bits + u32(0x7FFFF) + ((bits >> u32(20)) & u32(1))) & u32(0xFFF00000)
        exp = bits >> u32(23)
        sig = (bits & u32(0x7FFFFF)) | u32(0x800000)
        # |r| * 2^9 = sig * 2^(exp - 141): shift right by 141 - exp >= 21 (exp <= 120 here),
        # capped at 26 where every 24-bit significand rounds to 0 (fp32 subnormals included).
        sh = T.min(u32(141) - T.min(exp, u32(120)), u32(26))

        def on_q(q):
            small = bits < u32(0x3C800000)  # |r| < 2^-6
            if code:
                mag = T.if_then_else(small, q, (rn >> u32(20)) - u32(120 << 3))
                return mag | (sign >> u32(24))
            sub = T.reinterpret("uint32", T.Cast("float32", q) * T.float32(2.0**-9))
            return T.reinterpret("float32", T.if_then_else(small, sub, rn) | sign)

        return let((sig + (u32(1) << (sh - u32(1))) - u32(1) + ((sig >> sh) & u32(1)))
                    >> sh, on_q, "q")

    return let(T.reinterpret("uint32", r), on_bits, "rbits")


def fp8_ratio(x, byte):
    """x / 2^(byte-127) clamped to [-448, 448]; the division by a power of two is a product with
    its exact reciprocal."""
    r = x * inv_pow2_scale(byte)
    return T.max(T.min(r, T.float32(fmt.E4M3_MAX)), T.float32(-fmt.E4M3_MAX))


def fp8_qdq(x, byte):
    """FP8 quantise-dequantise of one fp32 value with its group's scale byte: the exact fp32
    value e4m3(x / s) * s that the oracle's `_act_quant` feeds its GEMM (scale folded in)."""
    return let(byte, lambda b: e4m3_round(fp8_ratio(x, b), code=False) * pow2_scale(b), "byte")


def fp8_code(x, byte):
    """The E4M3 byte of x / s (formats.torch_e4m3_encode after the clamp)."""
    return T.Cast("uint8", e4m3_round(fp8_ratio(x, byte), code=True))


def _padded(m, pad: int):
    """m rounded up to a multiple of pad (m itself for pad 1)."""
    return m if pad == 1 else (m + i64(pad - 1)) // i64(pad) * i64(pad)


def _row_f32(x, m, pad: int, row, col):
    """x[row, col] as fp32; rows past m (only when padded) read as zero."""
    if pad == 1:
        return bf16_to_f32(x[row, col])
    return T.if_then_else(row < m, bf16_to_f32(x[row, col]), T.float32(0))


# ---- fp8_linear -----------------------------------------------------------------------------


def _check_out_dtype(out_dtype: str) -> None:
    if out_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"fp8_linear writes bfloat16 (fp8_linear) or float32 (fp8_linear_f32, "
                         f"a row-parallel partial sum), not {out_dtype}.")


def make_fp8_linear(*, n: int, k: int, row_pad: int = 1,
                    out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """`fp8_linear(x, weight, scale) -> y`: x bf16 [m, k] (symbolic m; the compiler flattens
    leading dims), weight E4M3 uint8 [n, k], scale E8M0 uint8 [ceil(n/32), k/32], y bf16 [m, n]
    (out_dtype "float32": `fp8_linear_f32`, the sum before its rounding).

    Stages (named sblocks): `amax` + `xq` quantise the activation per 32 (fp32 dequantised value,
    see the module docstring); `wdec` decodes E4M3 weights into a transposed [k, n] layout
    (scheduled into a per-tile buffer, never materialised whole); `part` is the fp32 dot product
    inside one 32-block; `acc` adds the blocks in K order times the weight-tile scale; `y` rounds
    to bf16.

    row_pad > 1 pads the rows of the quantised-activation stages to a multiple of row_pad (padded
    rows read as zero): CUDA tiles them into shared memory, which needs a constant tile size."""
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    _check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))

    @T.prim_func(s_tir=True)
    def fp8_linear(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                   scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        amax = T.sblock_alloc_buffer((_padded(m, row_pad), KB), "float32")
        xq = T.sblock_alloc_buffer((_padded(m, row_pad), K), "float32")
        wdec = T.sblock_alloc_buffer((K, N), "float32")
        part = T.sblock_alloc_buffer((m, N, KB), "float32")
        acc = T.sblock_alloc_buffer((m, N), "float32")
        for i, b, j in T.grid(_padded(m, row_pad), KB, i64(BLOCK)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb],
                                     T.fabs(_row_f32(x, m, row_pad, vi, vb * BLOCK + vj)))
        for i, j in T.grid(_padded(m, row_pad), K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                xq[vi, vj] = fp8_qdq(_row_f32(x, m, row_pad, vi, vj),
                                     pow2_scale_byte(amax[vi, vj // BLOCK]))
        for j, c in T.grid(K, N):
            with T.sblock("wdec"):
                vj, vc = T.axis.remap("SS", [j, c])
                wdec[vj, vc] = e4m3_to_f32(T.Cast("uint32", weight[vc, vj]))
        for i, c, b, j in T.grid(m, N, KB, i64(BLOCK)):
            with T.sblock("part"):
                vi, vc, vb, vj = T.axis.remap("SSSR", [i, c, b, j])
                with T.init():
                    part[vi, vc, vb] = T.float32(0)
                part[vi, vc, vb] = part[vi, vc, vb] + xq[vi, vb * BLOCK + vj] * wdec[
                    vb * BLOCK + vj, vc]
        for i, c, b in T.grid(m, N, KB):
            with T.sblock("acc"):
                vi, vc, vb = T.axis.remap("SSR", [i, c, b])
                with T.init():
                    acc[vi, vc] = T.float32(0)
                acc[vi, vc] = acc[vi, vc] + part[vi, vc, vb] * e8m0_to_f32(
                    T.Cast("uint32", scale[vc // BLOCK, vb]))
        for i, c in T.grid(m, N):
            with T.sblock("y"):
                vi, vc = T.axis.remap("SS", [i, c])
                y[vi, vc] = T.Cast(out_dtype, acc[vi, vc])

    return fp8_linear


def make_fp8_gemv(*, n: int, k: int, out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """The CPU decode form of `fp8_linear` (same signature and result): one dot product over the
    whole of K per output, instead of one per 32-block.

    Stages: `amax` + `xq` quantise the activation as in `make_fp8_linear`; `xs` multiplies it by
    the weight scales of one 32-column tile and by 2^8 (xs[i, cb, j] = xq[i, j] *
    2^(s[cb, j/32] - 127) * 2^8: power-of-two products of an exact value, exact while |xs| stays
    below 2^128, i.e. for every activation-times-weight-scale below 2^120); `acc` sums xs times
    the weight decoded as fp16 (`e4m3_to_f16_bits`: the E4M3 value times 2^-8, converted to fp32
    exactly) over all of K, so each product is the exact xq * 2^(s-127) * E4M3(w); `y` rounds to
    bf16. Every product is exact, as in `make_fp8_linear`; only the order of the fp32 additions
    differs from the oracle (K at once rather than block partials times scales), which leaves
    >= 99% of outputs bit-equal and the rest within 1 bf16 ulp. Scheduled (`_schedule_gemv_cpu`),
    the sum runs as `vec` lanes per column in registers, `cb` columns at a time, and the lanes
    are added pairwise at the end; the weight decode is six 16-bit integer operations per 32
    codes plus the fp16 -> fp32 conversion."""
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    _check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))

    @T.prim_func(s_tir=True)
    def fp8_gemv(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        amax = T.sblock_alloc_buffer((m, KB), "float32")
        xq = T.sblock_alloc_buffer((m, K), "float32")
        xs = T.sblock_alloc_buffer((m, NB, K), "float32")
        acc = T.sblock_alloc_buffer((m, N), "float32")
        for i, b, j in T.grid(m, KB, i64(BLOCK)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb], T.fabs(bf16_to_f32(x[vi, vb * BLOCK + vj])))
        for i, j in T.grid(m, K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                xq[vi, vj] = fp8_qdq(bf16_to_f32(x[vi, vj]), pow2_scale_byte(amax[vi, vj // BLOCK]))
        for i, cb, j in T.grid(m, NB, K):
            with T.sblock("xs"):
                vi, vcb, vj = T.axis.remap("SSS", [i, cb, j])
                xs[vi, vcb, vj] = xq[vi, vj] * e8m0_to_f32(
                    T.Cast("uint32", scale[vcb, vj // BLOCK])) * T.float32(256.0)
        for i, c, j in T.grid(m, N, K):
            with T.sblock("acc"):
                vi, vc, vj = T.axis.remap("SSR", [i, c, j])
                with T.init():
                    acc[vi, vc] = T.float32(0)
                acc[vi, vc] = acc[vi, vc] + xs[vi, vc // BLOCK, vj] * f16_bits_to_f32(
                    e4m3_to_f16_bits(weight[vc, vj]))
        for i, c in T.grid(m, N):
            with T.sblock("y"):
                vi, vc = T.axis.remap("SS", [i, c])
                y[vi, vc] = T.Cast(out_dtype, acc[vi, vc])

    return fp8_gemv


def _f16_bits_even_odd(codes, lanes: int):
    """4 x lanes E4M3 codes (uint8) -> (even, odd): the fp16 bits (2 x lanes uint16 each) of
    codes 0, 2, .. and of codes 1, 3, .., each the E4M3 value times 2^-8 as
    `common.e4m3_to_f16_bits`, except that the NaN codes give a finite value (the caller flags
    them). vpmaddubsw with the unsigned bytes (128, 0) (or (0, 128)) against the signed codes is
    the code sign-extended and shifted left by 7 in one instruction (|128 * code| <= 2^14: no
    saturation); the mask clears bit 14 (a copy of the sign), as in `e4m3_to_f16_bits`."""
    words, nb = 2 * lanes, 4 * lanes
    name = "llvm.x86.avx2.pmadd.ub.sw" if lanes == 8 else "llvm.x86.avx512.pmaddubs.w.512"
    out = []
    for pattern in (0x0080, 0x8000):  # the byte 128 at the even / the odd positions
        h = T.call_llvm_pure_intrin(f"int16x{words}", name,
                                    T.reinterpret(f"int8x{nb}",
                                                  T.broadcast(T.uint16(pattern), words)),
                                    T.reinterpret(f"int8x{nb}", codes))
        out.append(T.reinterpret(f"uint16x{words}", h) & T.broadcast(T.uint16(0xBF80), words))
    return out


def _f16_to_f32(h16, half: int, lanes: int):
    """Lanes lanes * half .. of 2 x lanes fp16 bits as float32 lanes (vcvtph2ps)."""
    idx = list(range(lanes * half, lanes * half + lanes))
    return T.Cast(f"float32x{lanes}", T.reinterpret(f"float16x{lanes}", T.Shuffle([h16], idx)))


def _gemv_slot_source(j, lanes: int):
    """Slot j (0 .. 4 x lanes - 1) of a chunk in the hand-vectorised GEMV's activation layout ->
    the offset in the chunk it holds: the four decoded vectors of `_f16_bits_even_odd` are the
    even codes' two halves, then the odd codes' (lanes 8: slots 0-7 take offsets 0, 2, .., 14,
    8-15 take 16, .., 30, 16-23 take 1, .., 15 and 24-31 take 17, .., 31)."""
    return (j // lanes % 2) * (2 * lanes) + 2 * (j % lanes) + j // (2 * lanes)


def make_fp8_gemv_avx2(*, n: int, k: int, out_dtype: str = "bfloat16", lanes: int = 8,
                       prefetch: int = 0) -> tvm.tirx.PrimFunc:
    """The CPU decode form of `fp8_linear` for x86 with AVX2 + FMA + F16C (same signature and
    result as `make_fp8_gemv`), hand-vectorised: its loops are the schedule. `lanes` 8: 256-bit
    vectors (CPUs without AVX-512); 16: 512-bit (AVX-512 BW), k a multiple of 64. `prefetch`:
    columns ahead of the one being summed whose weights are prefetched (0: none).

    The activation is quantised once per row (`xq`, as `make_fp8_gemv`'s stages, its K offsets
    stored per chunk of 4 x lanes codes in the order `_gemv_slot_source` gives). Per 32-column
    tile (a parallel task) and row, `xs` = xq * 2^(s - 127) * 2^8 with the tile's weight scales
    (the same exact products and range as `make_fp8_gemv`), then one column at a time, so the
    weights stream from memory in address order: per chunk one load of 4 x lanes codes, two
    vpmaddubsw + masks give their fp16 bits times 2^-8 (`_f16_bits_even_odd`), four vcvtph2ps
    (exact) and four FMAs into four accumulators of `lanes` lanes (added pairwise at the end:
    every product is exact, only the order of the fp32 additions differs from the oracle, as
    `make_fp8_gemv`). NaN weights: the column's max of code & 0x7f over K (vpmaxub, two
    operations per chunk instead of the four 16-bit operations per 16 codes of the NaN fix) is
    0x7f exactly when one of its codes is 0x7f / 0xff, and then its output is NaN.

    On a Xeon with AVX-512 (2 threads, weights cycled through more than the L3, so read from
    memory), n 32768 k 512: lanes 8 2.63 ms without prefetch, 1.28 ms prefetching 4 columns
    (2 KB) ahead (8: 1.32, 16: 1.35; the same 16 MB from the L3: 0.94-1.04 either way); the
    scheduled `make_fp8_gemv` 0.97-1.22 ms from memory, 0.54 from the L3.

    Measured on one Zen 3 core shared with other jobs (TVM_NUM_THREADS=1, 5th percentile of 300
    calls interleaved with `make_fp8_gemv` scheduled as "gemv" cb 4 vec 32, in brackets; ranges
    over two runs, in which a numpy sum of 64 MiB ran at 9-13 GB/s median, 11-15 best): n 32768
    k 512 (16 MB) 2.5-3.0 ms = 5.7-6.6 GB/s (5.1-5.7 ms), n 1024 k 4096 0.40-0.46 ms = 9.1-10.6
    GB/s (0.61-0.67 ms), n 512 k 1024 0.061-0.076 ms (0.090-0.097), n 1024 k 512 0.069-0.070 ms
    (0.074-0.097), n 4096 k 512 0.26 ms (0.28-0.41). n 4096 k 4096, the same 16 MB in 8x fewer
    columns, ran 10-20% faster per byte than n 32768 k 512, likely the per-column epilogue
    (lane sum, NaN test, bf16 store) at k 512 (a fully unrolled K loop did not change it).
    Interleaving 4 columns (as cb 4) ran n 32768 k 512 at 2.5 GB/s whatever the decode: each
    512-byte row is then one of four short streams, which the hardware prefetcher does not
    follow; software prefetches 1-16 KB ahead of one column made it 2-5% slower; the vpmaddubsw
    decode ran within noise of a vpunpcklbw + vpsraw one and 2-5% ahead of a vpmovsxbw one; 2
    instead of 4 accumulators per column, within noise."""
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    if lanes not in (8, 16) or k % (4 * lanes):
        raise ValueError(f"The hand-vectorised fp8 GEMV takes lanes 8 or 16 and k a multiple of "
                         f"4 x lanes; got lanes={lanes}, k={k}.")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 columns; got {prefetch}.")
    _check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))
    LN, CL = lanes, 4 * lanes  # fp32 lanes per vector; codes per chunk (one load)
    NCH = i64(k // CL)  # chunks per column
    ACC = 4  # accumulators per column, one per decoded vector of a chunk

    def f32v(buf, off):
        return buf[T.ramp(off, 1, LN)]

    @T.macro
    def fma(acc, xs, ch, q, w):  # accumulator q += xs slots LN q .. of chunk ch * w
        acc[T.ramp(q * LN, 1, LN)] = f32v(acc, q * LN) + f32v(xs, ch * CL + q * LN) * w

    @T.macro
    def column_sum(weight, xs, acc, flg, col):
        """acc[q * LN ..] += xs[.., slots LN q ..] * w[col, ..] over K; flg = max(code & 0x7f)."""
        for q in T.unroll(ACC * LN):
            acc[q] = T.float32(0)
        for t in T.vectorized(i64(CL)):
            flg[t] = T.uint8(0)
        for ch in range(NCH):
            if prefetch > 0:
                prefetch_line(T.address_of(weight[T.min(col + prefetch, N - i64(1)), ch * CL]))
            codes = weight.vload([col, ch * CL], f"uint8x{CL}")
            h = _f16_bits_even_odd(codes, LN)  # [even, odd]
            fma(acc, xs, ch, 0, _f16_to_f32(h[0], 0, LN))
            fma(acc, xs, ch, 1, _f16_to_f32(h[0], 1, LN))
            fma(acc, xs, ch, 2, _f16_to_f32(h[1], 0, LN))
            fma(acc, xs, ch, 3, _f16_to_f32(h[1], 1, LN))
            flg[T.ramp(0, 1, CL)] = T.max(flg[T.ramp(0, 1, CL)],
                                          codes & T.broadcast(T.uint8(0x7F), CL))

    def lane_total(acc):  # the 4 x LN lanes of a column added pairwise
        return pairwise_lane_sum(
            (f32v(acc, 0) + f32v(acc, LN)) + (f32v(acc, 2 * LN) + f32v(acc, 3 * LN)), LN)

    def has_nan(flg):  # some byte is 0x7f: the top bit of flg + 1 (vpmovmskb over 32 bytes)
        f32b = flg[T.ramp(0, 1, 32)]
        if CL == 64:
            f32b = T.max(f32b, flg[T.ramp(32, 1, 32)])
        top = T.reinterpret("int8x32", f32b + T.broadcast(T.uint8(1), 32))
        return T.call_llvm_pure_intrin("int32", "llvm.x86.avx2.pmovmskb", top) != 0

    @T.prim_func
    def fp8_gemv(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        amax = T.alloc_buffer((m, KB), "float32")
        xq = T.alloc_buffer((m, K), "float32")  # per chunk in _gemv_slot_source order
        for i, b in T.grid(m, KB):
            amax[i, b] = T.min_value("float32")
            for j in range(i64(BLOCK)):
                amax[i, b] = T.max(amax[i, b], T.fabs(bf16_to_f32(x[i, b * BLOCK + j])))
        for i, ch in T.grid(m, NCH):
            for j in T.vectorized(i64(CL)):
                xq[i, ch * CL + j] = fp8_qdq(
                    bf16_to_f32(x[i, ch * CL + _gemv_slot_source(j, LN)]),
                    pow2_scale_byte(amax[i, (ch * CL + _gemv_slot_source(j, LN)) // BLOCK]))
        for p in T.parallel(NB):
            xs = T.alloc_buffer((K,), "float32")
            acc = T.alloc_buffer((ACC * LN,), "float32", scope="local")
            flg = T.alloc_buffer((CL,), "uint8", scope="local")
            for i in range(m):
                for ch in range(NCH):
                    for j in T.vectorized(i64(CL)):
                        xs[ch * CL + j] = xq[i, ch * CL + j] * e8m0_to_f32(T.Cast(
                            "uint32", scale[p, (ch * CL + _gemv_slot_source(j, LN)) // BLOCK])
                            ) * T.float32(256.0)
                for c in range(i64(BLOCK)):
                    # a partial last tile reads its last column again and stores nothing
                    column_sum(weight, xs, acc, flg, T.min(p * BLOCK + c, N - i64(1)))
                    if p * BLOCK + c < N:
                        y[i, p * BLOCK + c] = T.Cast(out_dtype, T.Select(
                            has_nan(flg), T.reinterpret("float32", u32(0x7FC00000)),
                            lane_total(acc)))

    return fp8_gemv


def _row_tiles(m):
    """The 32-row tiles of m rows (the AMX kernels pad the last one with zero rows)."""
    return (m + i64(BLOCK - 1)) // i64(BLOCK)


def amx_block_rows(k: int) -> int:
    """Rows per block of the AMX GEMMs: a block's rearranged activation (block_rows x k bf16)
    stays near 512 KB of the 2 MB L2 while every weight panel passes over it. m 2048 on one
    core: fp8 n 1024 k 4096 233 GFLOP/s at 128 rows (197 at 512), n 32768 k 512 267 at 512
    rows (the tile kernel 19-39); the grouped o-projection (g 8, n 512, k 4096, m 512) 141 ms
    at 128 rows, 516-656 on the tile kernel."""
    return BLOCK * max(1, min(16, 16384 // k))


def make_fp8_linear_amx(*, n: int, k: int, block_rows: int,
                        out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """The CPU prefill form of `fp8_linear` on AMX-BF16 tiles (same signature and result; n a
    multiple of 32). Every operand is exact in bf16: the quantised activation `q * 2^s` and the
    weight `e4m3 * 2^e` with its E8M0 block scale folded in (a power of two), so each tile
    product is exact and AMX sums them in fp32; only the order of the fp32 additions differs
    from the oracle's (its block partial sums times the scale in K order: the same sum, since a
    power-of-two product commutes with every rounding), with the bound stated in the module
    docstring. Values under bf16's normal range would be flushed by AMX: the activation's are
    at least 2^-9 * 1e-4 / 448, and a weight's only for an E8M0 scale byte under 10.

    The tiles compute y^T: A = 16 weight rows x 32 K (the decoded panel, row-major as stored),
    B = 32 K x 16 activation rows in AMX's pair layout, so the activation (quantised once,
    shared by all N) is the side rearranged and the weights are only decoded.

    Stages: `xt` quantises x per 32 into bf16 pairs, blocked per 32 rows
    ([m/32, k/2, 32] uint32: a B tile's 16 rows are 128 bytes apart); then, per block of
    block_rows rows, each parallel task decodes one 32-column weight panel into bf16 and runs
    2 x 2 tiles (32 columns x 32 rows, tile registers 4..7) over K, then writes y."""
    if k % BLOCK or n % BLOCK or block_rows % BLOCK or block_rows < BLOCK:
        raise ValueError(f"fp8_linear on AMX needs n, k and block_rows multiples of {BLOCK}, got "
                         f"n={n}, k={k}, block_rows={block_rows}.")
    _check_out_dtype(out_dtype)
    N, K, KB, NB, K2 = i64(n), i64(k), i64(k // BLOCK), i64(n // BLOCK), i64(k // 2)
    TPB = i64(block_rows // BLOCK)  # 32-row tiles per block

    def pair(x, i, col, byte):  # two quantised activations as one uint32 of bf16 bits
        lo = bf16_bits_of_exact(fp8_qdq(bf16_to_f32(x[i, col]), byte))
        hi = bf16_bits_of_exact(fp8_qdq(bf16_to_f32(x[i, col + 1]), byte))
        return T.Cast("uint32", lo) | (T.Cast("uint32", hi) << u32(16))

    @T.prim_func
    def fp8_linear(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                   scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        xt = T.alloc_buffer((_row_tiles(m), K2, i64(BLOCK)), "uint32")
        for i in T.parallel(_row_tiles(m) * i64(BLOCK)):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            byte = T.alloc_buffer((1,), "uint32", scope="local")
            for b in range(KB):
                if i < m:
                    amax[0] = T.float32(0)
                    for j in range(i64(BLOCK)):
                        amax[0] = T.max(amax[0], T.fabs(bf16_to_f32(x[i, b * BLOCK + j])))
                    byte[0] = pow2_scale_byte(amax[0])
                    for j in T.vectorized(i64(BLOCK // 2)):
                        xt[i // BLOCK, b * 16 + j, i % BLOCK] = pair(x, i, b * BLOCK + j * 2,
                                                                     byte[0])
                else:  # padded rows: zero
                    for j in range(i64(BLOCK // 2)):
                        xt[i // BLOCK, b * 16 + j, i % BLOCK] = u32(0)
        for blk in range((_row_tiles(m) + TPB - i64(1)) // TPB):
            for p in T.parallel(NB):
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                wbf = T.alloc_buffer((i64(BLOCK), K), "uint16")
                yt = T.alloc_buffer((i64(BLOCK), i64(BLOCK)), "float32")
                for c, kb in T.grid(i64(BLOCK), KB):
                    for j in T.vectorized(i64(BLOCK)):
                        wbf[c, kb * BLOCK + j] = bf16_bits_of_exact(e4m3_to_f32(T.Cast(
                            "uint32", weight[p * BLOCK + c, kb * BLOCK + j])) * e8m0_to_f32(
                                T.Cast("uint32", scale[p, kb])))
                amx_configure(cfg)
                for t in range(TPB):
                    if blk * TPB + t < _row_tiles(m):
                        amx_dot_32x32(wbf, 0, K * 2, xt, blk * TPB + t, KB, yt)
                        for r in range(i64(BLOCK)):
                            if (blk * TPB + t) * BLOCK + r < m:
                                for c in T.vectorized(i64(BLOCK)):
                                    y[(blk * TPB + t) * BLOCK + r, p * BLOCK + c] = T.Cast(
                                        out_dtype, yt[c, r])
                amx("tilerelease")

    return fp8_linear


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Tiling of `fp8_linear`. kind: "gemv" (decode: one row; on CPU `make_fp8_gemv`, a dot
    product over all of K in `vec` lanes per output, weights decoded in registers), "gemv_avx2"
    (the CPU decode on x86 with AVX2 and no AVX-512: `make_fp8_gemv_avx2`, written scheduled,
    no parameters), "gemv_avx512" (its 512-bit form, `prefetch` columns ahead), "gemm"
    (weight tile decoded once into a transposed [32, tn] buffer and reused by tm rows, vectorised
    over N) or "amx" (CPUs with AMX-BF16: `make_fp8_linear_amx`, tm rows per block).
    CPU gemm: tn output columns per parallel task, tm rows per tile, rb rows held in registers.
    CUDA gemv: one warp per output column (lanes over the 32-block), `warps` per thread block.
    CUDA gemm: a (tm x tn) tile per thread block, (tm/rb) x (tn/cb) threads, each an rb x cb
    register tile; the activation and decoded weight tiles of one 32-block in shared memory."""

    kind: str
    tn: int = 32
    tm: int = 32
    rb: int = 4
    cb: int = 1  # CUDA gemm: register columns per thread; CPU gemv: columns summed together
    warps: int = 8
    vec: int = 16
    row_pad: int = 1  # make_fp8_linear(row_pad=): CUDA gemm pads the activation rows to tm
    prefetch: int = 0  # gemv_avx512: columns ahead whose weights are prefetched

    @property
    def prescheduled(self) -> bool:
        """Whether the kind's factory writes its own loops (no schedule, nothing to tune)."""
        return self.kind in ("amx", "gemv_avx2", "gemv_avx512")


def fp8_linear_config(target: TargetSpec, *, n: int, k: int, m: int | None = None
                      ) -> Fp8LinearConfig:
    """m is a hint for the row count this build will mostly see (None: prefill, large)."""
    if target.is_cuda:
        if m is not None and m <= 4:
            return Fp8LinearConfig("gemv", warps=8)
        return Fp8LinearConfig("gemm", tn=64, tm=64, rb=4, cb=4, row_pad=64)
    if m is not None and m <= 1:
        if has_features(target, "avx2", "fma", "f16c") and not has_avx512(target):
            return Fp8LinearConfig("gemv_avx2")  # measurements: make_fp8_gemv_avx2
        # From memory (weights cycled through more than the L3), 2 threads of a Xeon with
        # AVX-512: up to K 2048 the hand-vectorised kernel one column at a time, prefetching
        # ~8 KB ahead (n 32768 k 512 0.83-0.87 ms, n 1024 k 512 0.030, n 5120 k 1536 0.45,
        # against 1.00-1.24, 0.050 and 0.70 scheduled with cb 1, 1.60, 0.045 and 0.76 with
        # cb 4); above, the scheduled one with 4 columns summed together, 4 streams of a
        # 4 KB row each (n 1024 k 4096 0.196 ms against 0.237 hand-vectorised, 0.367 cb 1).
        # The scheduled kernel at K 512 is one 2 KB stretch read out of order with cb 4: cb 1.
        if k <= 2048 and k % 64 == 0 and has_features(target, "avx512bw", "fma", "f16c"):
            return Fp8LinearConfig("gemv_avx512", prefetch=max(2, 8192 // k))
        return Fp8LinearConfig("gemv", tn=BLOCK, cb=1 if k <= 1024 else 4, vec=32)
    if m is not None and m <= 4:
        return Fp8LinearConfig("gemm", tn=32, tm=4, rb=4)
    if n % BLOCK == 0 and has_amx_bf16(target):
        return Fp8LinearConfig("amx", tm=amx_block_rows(k))
    # tm 256: each decoded [32, tn] weight tile serves 256 rows (m 512, n 32768, k 512 on 2
    # loaded cores: 384-425 ms against 706-728 ms at tm 32; tm 512: 331-383 ms). The sum order
    # per output does not depend on the tiling, so results are the same bits.
    return Fp8LinearConfig("gemm", tn=32, tm=256, rb=4)


def _schedule_act_quant_stage(sch: s_tir.Schedule, target: TargetSpec, amax: str, out: str,
                              *, parallel: bool = True) -> None:
    """The per-32 amax + quantise stage: amax computed per group next to its 32 outputs;
    CPU parallel over rows (serial with parallel=False: the decode GEMV's one row is a few
    hundred vector operations, less than waking the thread pool), CUDA one thread per 32-group."""
    blk = sch.get_sblock(out)
    i, j = sch.get_loops(blk)[-2:]
    jb, jj = sch.split(j, [None, BLOCK])
    sch.compute_at(sch.get_sblock(amax), jb)
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, jb), [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return
    if parallel:
        sch.parallel(i)
    sch.vectorize(jj)


def schedule_fp8_linear(func: tvm.tirx.PrimFunc, config: Fp8LinearConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """`func` is `unscheduled_fp8_linear`'s: `make_fp8_gemv` for a CPU gemv, else
    `make_fp8_linear`, or `make_fp8_linear_amx` / `make_fp8_gemv_avx2`, which are written
    scheduled (returned as is)."""
    if config.prescheduled:
        return func
    sch = s_tir.Schedule(func)
    if not target.is_cuda:
        _schedule_act_quant_stage(sch, target, "amax", "xq", parallel=config.kind != "gemv")
    if config.kind == "gemv" and target.is_cuda:
        _schedule_gemv_cuda(sch, config)
    elif config.kind == "gemv":
        _schedule_gemv_cpu(sch, config)
    else:
        _schedule_gemm(sch, config, target)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def lane_split(sch: s_tir.Schedule, j, lanes: int) -> list:
    """Split reduction loop j into (jo, h_1, ..., h_b), b = log2(lanes), each h two-way: lane
    l = sum_i h_i 2^(b-i) of a `lanes`-wide partial sum (see `vector_sum`)."""
    return sch.split(j, [None] + [2] * (lanes.bit_length() - 1))


def vector_sum(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes: int,
               cols: int = 1) -> tuple[s_tir.SBlockRV, list[s_tir.SBlockRV]]:
    """Factor `block`'s reduction, whose innermost loops are `lane_split`'s (.., jo, [columns,]
    h_1..h_b), into a `lanes`-wide vector sum over jo and a pairwise tree over the lanes: the
    lanes l and l + lanes/2 are added as vectors, then l and l + lanes/4, ..., down to one
    (log2(lanes) vector adds per output instead of `lanes` dependent scalar adds).

    One rfactor per h, innermost first, always on the block that keeps the main loop nest (an
    rfactor needs its block first in the nest; each write-back lands in a nest of its own).
    Returns (the main block, the write-backs in dataflow order): the main block is vectorised
    over its fused h loops; `place_lane_sums` moves the write-backs next to it.
    `block`'s write buffer gets the lane dims appended."""
    bits = lanes.bit_length() - 1
    axis = len(sch.get(block).writes[0].region)
    chain = [block]
    for level in range(bits):
        chain.append(sch.rfactor(sch.get_loops(chain[-1])[-1 - level], axis))
    main = chain.pop()
    if bits:
        sch.vectorize(sch.fuse(*sch.get_loops(main)[-bits:]))
    if cols > 1:
        sch.unroll(sch.get_loops(main)[-2 if bits else -1])
    return main, chain[::-1]


def arrange_lane_sum(sch: s_tir.Schedule, wb: s_tir.SBlockRV, depth: int, rest: int,
                     cols: int = 1) -> None:
    """Loops of a `vector_sum` write-back that compute_at / reverse_compute_at put below loop
    `depth`: they come in iter-var order, (half, `rest` lane bits, [columns]); make them
    (columns unrolled, the two halves unrolled, the lanes as one vector)."""
    below = sch.get_loops(wb)[depth + 1:]
    half, lane_loops = below[0], below[1:1 + rest]
    if cols > 1:
        sch.reorder(below[-1], half, *lane_loops)
        sch.unroll(below[-1])
    sch.unroll(half)
    if rest:
        sch.vectorize(sch.fuse(*lane_loops))


def place_lane_sums(sch: s_tir.Schedule, main: s_tir.SBlockRV, wbs: list[s_tir.SBlockRV],
                    depth: int, lanes: int, cols: int = 1) -> None:
    """Move `vector_sum`'s write-backs, in order, right after the main block's loop nest under
    its loop `depth` (the column group), arranged by `arrange_lane_sum`."""
    bits = lanes.bit_length() - 1
    for w, wb in enumerate(wbs):
        sch.reverse_compute_at(wb, sch.get_loops(main)[depth])
        arrange_lane_sum(sch, wb, depth, bits - 1 - w, cols)


def _schedule_gemv_cpu(sch: s_tir.Schedule, config: Fp8LinearConfig) -> None:
    """`make_fp8_gemv`: parallel over 32-column tiles; per tile and row the scaled activation
    `xs` (K floats, in L1), then per group of `cb` columns a `vec`-lane partial sum over K per
    column held in registers (cb independent chains that share the xs loads), and the lanes
    added pairwise (`vector_sum`)."""
    acc = sch.get_sblock("acc")
    i, c, j = sch.get_loops(acc)
    cb, co, cc = sch.split(c, [None, BLOCK // config.cb, config.cb])
    jo, *hs = lane_split(sch, j, config.vec)
    sch.reorder(cb, i, co, jo, cc, *hs)
    main, wbs = vector_sum(sch, acc, config.vec, config.cb)
    place_lane_sums(sch, main, wbs, 2, config.vec, config.cb)
    sch.reverse_compute_at(sch.get_sblock("y"), sch.get_loops(main)[1])
    xs = sch.get_sblock("xs")
    sch.compute_at(xs, sch.get_loops(main)[1])
    sch.vectorize(sch.split(sch.get_loops(xs)[-1], [None, 16])[1])
    sch.parallel(sch.get_loops(main)[0])
    sch.decompose_reduction(main, sch.get_loops(main)[3])


def _schedule_gemv_cuda(sch: s_tir.Schedule, config: Fp8LinearConfig) -> None:
    """One warp per output column; the E4M3 decode inlined into the 32-block dot product."""
    sch.compute_inline(sch.get_sblock("wdec"))
    part, acc = sch.get_sblock("part"), sch.get_sblock("acc")
    i, c, b = sch.get_loops(acc)
    co, cw = sch.split(c, [None, config.warps])
    sch.reorder(co, cw, i, b)
    sch.bind(co, "blockIdx.x")
    sch.bind(cw, "threadIdx.y")
    sch.reverse_compute_at(sch.get_sblock("y"), i)
    # The activation quantisation is fused: each warp quantises its 32-group in registers
    # (amax by a warp allreduce), since a CUDA kernel cannot allocate the [m, k] buffer.
    sch.compute_inline(sch.get_sblock("xq"))
    sch.compute_at(part, b)
    amax = sch.get_sblock("amax")
    sch.compute_at(amax, b)
    for blk in (amax, part):
        sch.bind(sch.get_loops(blk)[-1], "threadIdx.x")  # warp allreduce over the block
        sch.set_scope(blk, 0, "local")
    sch.set_scope(acc, 0, "local")


def _schedule_gemm(sch: s_tir.Schedule, config: Fp8LinearConfig, target: TargetSpec) -> None:
    """Per 32-block: decode a [32, tn] weight tile once, then rows x columns register tiles."""
    part, acc, wdec = sch.get_sblock("part"), sch.get_sblock("acc"), sch.get_sblock("wdec")
    i, c, b = sch.get_loops(acc)
    if target.is_cuda:
        bx, tx, cn = sch.split(c, [None, config.tn // config.cb, config.cb])
        by, ty, mr = sch.split(i, [None, config.tm // config.rb, config.rb])
        sch.reorder(bx, by, ty, tx, b, mr, cn)
        sch.bind(bx, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.reverse_compute_at(sch.get_sblock("y"), tx)
        sch.compute_at(part, b)
        sch.set_scope(part, 0, "local")
        sch.set_scope(acc, 0, "local")
        pm, pc, pj = sch.get_loops(part)[-3:]
        sch.reorder(pj, pm, pc)
        # The activation quantisation is fused as a prologue: per 32-block, the block's rows are
        # quantised into shared memory (a CUDA kernel cannot allocate the [m, k] buffer).
        xq, amax = sch.get_sblock("xq"), sch.get_sblock("amax")
        amax_out = sch.cache_write(amax, 0, "local")  # reduce in a register, then publish
        threads = [config.tm // config.rb, config.tn // config.cb]
        for stage in (xq, wdec, amax_out):
            sch.set_scope(stage, 0, "shared")
            sch.compute_at(stage, b)
            loops = sch.get_loops(stage)[5:]  # below (bx, by, ty, tx, b)
            if stage == amax_out:  # one thread per row
                loops = loops[:1]
            _, sty, stx = sch.split(sch.fuse(*loops), [None, *threads])
            sch.bind(sty, "threadIdx.y")
            sch.bind(stx, "threadIdx.x")
        sch.compute_at(amax, sch.get_loops(amax_out)[-1])
        sch.unroll(pm)
        sch.unroll(pc)
        sch.decompose_reduction(part, pj)
        sch.decompose_reduction(acc, b)
        return
    co, ci = sch.split(c, [None, config.tn])
    io, ii = sch.split(i, [None, config.tm])
    rb = min(config.rb, config.tm)
    iio, iii = sch.split(ii, [None, rb])
    sch.reorder(co, io, b, iio, iii, ci)
    sch.reverse_compute_at(sch.get_sblock("y"), io)
    sch.compute_at(part, iio)
    sch.compute_at(wdec, b)
    pm, pc, pj = sch.get_loops(part)[-3:]
    sch.reorder(pj, pm, pc)
    sch.vectorize(pc)
    sch.unroll(pm)
    sch.unroll(pj)
    sch.vectorize(sch.get_loops(wdec)[-1])
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.parallel(co)
    sch.decompose_reduction(part, pj)
    sch.decompose_reduction(acc, b)


def unscheduled_fp8_linear(target: TargetSpec, *, n: int, k: int, m: int | None = None,
                           out_dtype: str = "bfloat16"
                           ) -> tuple[tvm.tirx.PrimFunc, Fp8LinearConfig]:
    """The factory output the config's schedule expects, and the config."""
    config = fp8_linear_config(target, n=n, k=k, m=m)
    if config.kind == "amx":
        return make_fp8_linear_amx(n=n, k=k, block_rows=config.tm, out_dtype=out_dtype), config
    if config.kind == "gemv_avx2":
        return make_fp8_gemv_avx2(n=n, k=k, out_dtype=out_dtype), config
    if config.kind == "gemv_avx512":
        return make_fp8_gemv_avx2(n=n, k=k, out_dtype=out_dtype, lanes=16,
                                  prefetch=config.prefetch), config
    if config.kind == "gemv" and not target.is_cuda:
        return make_fp8_gemv(n=n, k=k, out_dtype=out_dtype), config
    return make_fp8_linear(n=n, k=k, row_pad=config.row_pad, out_dtype=out_dtype), config


def build_fp8_linear(target_name: str, *, n: int, k: int, m: int | None = None,
                     out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """fp8_linear's kernel (out_dtype "float32": fp8_linear_f32's, the same schedule)."""
    target = get_target(target_name)
    func, config = unscheduled_fp8_linear(target, n=n, k=k, m=m, out_dtype=out_dtype)
    return schedule_fp8_linear(func, config, target)


# ---- dense GEMV (bf16 / fp32 weights, decode) ------------------------------------------------


def _load_f32(buf, *idx):
    return bf16_to_f32(buf[idx]) if buf.dtype == "bfloat16" else buf[idx]


def _check_dense_dtypes(kernel: str, *dtypes: str) -> None:
    for dt in dtypes:
        if dt not in ("bfloat16", "float32"):
            raise ValueError(f"{kernel} reads bfloat16 or float32, got {dt}.")


def make_dense_gemv(*, groups: int, n: int, k: int, x_dtype: str, w_dtype: str
                    ) -> tvm.tirx.PrimFunc:
    """y[i, g, c] = sum_j fp32(x[i, g, j]) * fp32(w[g * n + c, j]), y fp32: the decode form of the
    plain linears (groups=1: the head, the compressor, the gate) and of the grouped o-projection
    einsum `bsgd,grd->bsgr`. x and w are read in their stored dtype (bf16 or fp32) and widened in
    registers; w is the checkpoint's 2-D [groups * n, k] tensor as stored. The weight is never
    copied (transposed, cast or reshaped) as a whole, which the generic lowering did on every
    call. Symbolic rows i; the caller rounds y to bf16 where torch does.

    Products of two bf16/fp32 values are rounded once in fp32 as in torch; the sum over K runs in
    `vec` lanes and a final horizontal add (torch's order is its own), so results agree with the
    oracle to fp32 rounding, not bit for bit."""
    _check_dense_dtypes("dense_gemv", x_dtype, w_dtype)
    G, N, K = i64(groups), i64(n), i64(k)

    @T.prim_func(s_tir=True)
    def dense_gemv(x_h: T.handle, w: T.Buffer((G * N, K), w_dtype), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), x_dtype)
        y = T.match_buffer(y_h, (m, G, N), "float32")
        for i, g, c, j in T.grid(m, G, N, K):
            with T.sblock("y"):
                vi, vg, vc, vj = T.axis.remap("SSSR", [i, g, c, j])
                with T.init():
                    y[vi, vg, vc] = T.float32(0)
                y[vi, vg, vc] = y[vi, vg, vc] + _load_f32(x, vi, vg, vj) * _load_f32(
                    w, vg * N + vc, vj)

    return dense_gemv


@dataclass(frozen=True)
class DenseGemvConfig:
    """tn output columns per parallel task; cb columns summed together (independent register
    chains sharing the activation loads); vec lanes of each column's K partial sums (CPU)."""

    tn: int = 32
    cb: int = 4
    vec: int = 32


def _lanes(k: int, most: int) -> int:
    """The largest power of two <= most that divides k (a lane count that needs no tail)."""
    lanes = most
    while k % lanes:
        lanes //= 2
    return lanes


def dense_gemv_config(target: TargetSpec, *, n: int, k: int) -> DenseGemvConfig:
    if target.is_cuda:
        raise ValueError("dense_gemv has no CUDA schedule: CUDA builds keep the generic "
                         "(dlight-scheduled) lowering of the dense linears.")
    tn = min(32, n)
    return DenseGemvConfig(tn=tn, cb=min(4, tn), vec=_lanes(k, 32))


def schedule_dense_gemv(func: tvm.tirx.PrimFunc, config: DenseGemvConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Parallel over (group, column tile); per row and group of `cb` columns a `vec`-lane partial
    sum over K per column (rfactor), held in registers, the activation loaded once for the cb
    columns; then `vector_sum` adds each column's lanes pairwise."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("y")
    i, g, c, j = sch.get_loops(blk)
    co, cg, cc = sch.split(c, [None, config.tn // config.cb, config.cb])
    jo, *hs = lane_split(sch, j, config.vec)
    sch.reorder(g, co, i, cg, jo, cc, *hs)
    main, wbs = vector_sum(sch, blk, config.vec, config.cb)
    place_lane_sums(sch, main, wbs, 3, config.vec, config.cb)
    g, co = sch.get_loops(main)[:2]
    sch.parallel(sch.fuse(g, co))
    sch.decompose_reduction(main, sch.get_loops(main)[3])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_dense_gemv(target_name: str, *, groups: int, n: int, k: int, x_dtype: str,
                     w_dtype: str) -> tvm.tirx.PrimFunc:
    target = get_target(target_name)
    func = make_dense_gemv(groups=groups, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype)
    return schedule_dense_gemv(func, dense_gemv_config(target, n=n, k=k), target)


def make_dense_gemm(*, groups: int, n: int, k: int, x_dtype: str, w_dtype: str, rb: int = 4
                    ) -> tvm.tirx.PrimFunc:
    """The prefill form of `make_dense_gemv` (same signature and buffers): y[i, g, c] = sum_j
    fp32(x[i, g, j]) * fp32(w[g * n + c, j]), the sum over K in order (j = 0, 1, ...), fp32 y.

    Stages: `wdec` widens the weight into a transposed [k, n] fp32 layout (scheduled into one
    [k, tn] tile per task, never materialised whole); `acc` is the outer-product accumulation of
    a GEMM microkernel over tiles of rb rows (per k, a row's value broadcast times a vector of
    the tile's columns); the last tile reads the last row again for its missing rows, so no loop
    carries a predicate, and `y` stores the m real rows. Products are rounded once in fp32 as in
    torch; the K additions run in order (the GEMV's run in `vec` lanes, then a horizontal add),
    so the two forms agree to fp32 rounding."""
    _check_dense_dtypes("dense_gemm", x_dtype, w_dtype)
    if rb < 1:
        raise ValueError(f"dense_gemm needs rb >= 1 rows per tile, got {rb}.")
    G, N, K, RB = i64(groups), i64(n), i64(k), i64(rb)

    @T.prim_func(s_tir=True)
    def dense_gemm(x_h: T.handle, w: T.Buffer((G * N, K), w_dtype), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), x_dtype)
        y = T.match_buffer(y_h, (m, G, N), "float32")
        wdec = T.sblock_alloc_buffer((G, K, N), "float32")
        acc = T.sblock_alloc_buffer(((m + RB - i64(1)) // RB * RB, G, N), "float32")
        for g, j, c in T.grid(G, K, N):
            with T.sblock("wdec"):
                vg, vj, vc = T.axis.remap("SSS", [g, j, c])
                wdec[vg, vj, vc] = _load_f32(w, vg * N + vc, vj)
        for io, ii, g, c, j in T.grid((m + RB - i64(1)) // RB, RB, G, N, K):
            with T.sblock("acc"):
                vo, vi, vg, vc, vj = T.axis.remap("SSSSR", [io, ii, g, c, j])
                with T.init():
                    acc[vo * RB + vi, vg, vc] = T.float32(0)
                acc[vo * RB + vi, vg, vc] = acc[vo * RB + vi, vg, vc] + _load_f32(
                    x, T.min(vo * RB + vi, m - i64(1)), vg, vj) * wdec[vg, vj, vc]
        for i, g, c in T.grid(m, G, N):
            with T.sblock("y"):
                vi, vg, vc = T.axis.remap("SSS", [i, g, c])
                y[vi, vg, vc] = acc[vi, vg, vc]

    return dense_gemm


def make_dense_gemm_amx(*, groups: int, n: int, k: int, block_rows: int) -> tvm.tirx.PrimFunc:
    """`make_dense_gemm` for bf16 x and w on AMX-BF16 tiles (same signature and buffers; n and
    k multiples of 32): bf16 products are exact in fp32 and the tiles sum them in fp32, so the
    result differs from the in-order sum only by the order of the additions. The weight rows
    are A tiles read in place; x is rearranged once into AMX's B layout per group and 32 rows
    (`xt`, [g * m/32, k/2, 32] bf16 pairs), then each parallel task (group, 32-column panel)
    runs `amx_dot_32x32` over the row tiles of a block of block_rows rows."""
    if n % BLOCK or k % BLOCK or block_rows % BLOCK or block_rows < BLOCK:
        raise ValueError(f"dense_gemm on AMX needs n, k and block_rows multiples of {BLOCK}, got "
                         f"n={n}, k={k}, block_rows={block_rows}.")
    G, N, K, KB, K2 = i64(groups), i64(n), i64(k), i64(k // BLOCK), i64(k // 2)
    NP, TPB = i64(n // BLOCK), i64(block_rows // BLOCK)

    @T.prim_func
    def dense_gemm(x_h: T.handle, w: T.Buffer((G * N, K), "bfloat16"), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), "bfloat16")
        y = T.match_buffer(y_h, (m, G, N), "float32")
        xt = T.alloc_buffer((G * _row_tiles(m), K2, i64(BLOCK)), "uint32")
        for task in T.parallel(G * _row_tiles(m)):  # (group, 32-row tile)
            for r, j in T.grid(i64(BLOCK), K2):
                if task % _row_tiles(m) * BLOCK + r < m:
                    xt[task, j, r] = T.reinterpret("uint32", x.vload(
                        [task % _row_tiles(m) * BLOCK + r, task // _row_tiles(m), j * 2],
                        "bfloat16x2"))
                else:  # padded rows: zero
                    xt[task, j, r] = u32(0)
        for blk in range((_row_tiles(m) + TPB - i64(1)) // TPB):
            for task in T.parallel(G * NP):
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                yt = T.alloc_buffer((i64(BLOCK), i64(BLOCK)), "float32")
                amx_configure(cfg)
                for t in range(TPB):
                    if blk * TPB + t < _row_tiles(m):
                        amx_dot_32x32(w, task * BLOCK, K * 2, xt,
                                      task // NP * _row_tiles(m) + blk * TPB + t, KB, yt)
                        for r in range(i64(BLOCK)):
                            if (blk * TPB + t) * BLOCK + r < m:
                                for c in T.vectorized(i64(BLOCK)):
                                    y[(blk * TPB + t) * BLOCK + r, task // NP,
                                      task % NP * BLOCK + c] = yt[c, r]
                amx("tilerelease")

    return dense_gemm


@dataclass(frozen=True)
class DenseGemmConfig:
    """CPU: tn output columns per parallel task (their widened [k, tn] weight tile, k * tn * 4
    bytes, stays in L2 across every row of the call), rb rows x tn columns of fp32 accumulators
    held in registers over the whole of K (rb is part of the definition: `make_dense_gemm(rb=)`).
    64 x 4 measured best on the grouped o-projection at 512 rows (g 8, n 512, k 4096; 2 cores,
    loaded): 230 ms, against 300 for 32 x 4, 277 for 32 x 8, 234 for 64 x 3, 327 for 64 x 6,
    292 for 128 x 3, and 1400 for the row-at-a-time dense_gemv."""

    tn: int = 64
    rb: int = 4
    kind: str = "tile"  # "amx": bf16 x and w on AMX-BF16 (`make_dense_gemm_amx`)
    block_rows: int = 128  # amx: rows per block


def dense_gemm_config(target: TargetSpec, *, n: int, k: int, x_dtype: str | None = None,
                      w_dtype: str | None = None) -> DenseGemmConfig:
    if target.is_cuda:
        raise ValueError("dense_gemm has no CUDA schedule: CUDA builds keep the generic "
                         "(dlight-scheduled) lowering of the dense linears.")
    if (x_dtype == w_dtype == "bfloat16" and n % BLOCK == 0 and k % BLOCK == 0
            and has_amx_bf16(target)):
        return DenseGemmConfig(kind="amx", block_rows=amx_block_rows(k))
    return DenseGemmConfig(tn=math.gcd(n, 64), rb=4)


def schedule_dense_gemm(func: tvm.tirx.PrimFunc, config: DenseGemmConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Parallel over (group, column tile); the tile's weight widened once; per tile of rb rows an
    rb x tn register tile accumulated over K, then stored."""
    if config.kind == "amx":  # written scheduled
        return func
    sch = s_tir.Schedule(func)
    acc, wdec, out = sch.get_sblock("acc"), sch.get_sblock("wdec"), sch.get_sblock("y")
    io, ii, g, c, j = sch.get_loops(acc)
    if int(sch.get(ii).extent) != config.rb:
        raise ValueError(f"The kernel was built with rb = {int(sch.get(ii).extent)} but the "
                         f"config asks for {config.rb}; build it with make_dense_gemm(rb=...).")
    co, ci = sch.split(c, [None, config.tn])
    sch.reorder(g, co, io, j, ii, ci)
    sch.set_scope(acc, 0, "local")
    task = sch.fuse(g, co)
    sch.parallel(task)
    sch.reverse_compute_at(out, io)
    sch.compute_at(wdec, task)
    sch.vectorize(sch.get_loops(wdec)[-1])
    sch.vectorize(ci)
    sch.unroll(ii)
    sch.vectorize(sch.get_loops(out)[-1])
    sch.decompose_reduction(acc, j)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_dense_gemm(target_name: str, *, groups: int, n: int, k: int, x_dtype: str,
                     w_dtype: str) -> tvm.tirx.PrimFunc:
    target = get_target(target_name)
    func, cfg = unscheduled_dense_gemm(target, groups=groups, n=n, k=k, x_dtype=x_dtype,
                                       w_dtype=w_dtype)
    return schedule_dense_gemm(func, cfg, target)


def unscheduled_dense_gemm(target: TargetSpec, *, groups: int, n: int, k: int, x_dtype: str,
                           w_dtype: str) -> tuple[tvm.tirx.PrimFunc, DenseGemmConfig]:
    """The factory output the config's schedule expects, and the config."""
    cfg = dense_gemm_config(target, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype)
    if cfg.kind == "amx":
        return make_dense_gemm_amx(groups=groups, n=n, k=k, block_rows=cfg.block_rows), cfg
    return make_dense_gemm(groups=groups, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype,
                           rb=cfg.rb), cfg


# ---- fp8_dequant ------------------------------------------------------------------------------


def make_fp8_dequant(*, d: int) -> tvm.tirx.PrimFunc:
    """`fp8_dequant(codes, scales) -> out`: E4M3 uint8 [r, d] with E8M0 uint8 [r, d/32] ->
    fp32 [r, d] (symbolic r; the compiler flattens the op's leading dims). Bit-exact."""
    if d % BLOCK:
        raise ValueError(f"fp8_dequant needs d a multiple of {BLOCK}, got {d}.")
    D, DB = i64(d), i64(d // BLOCK)

    @T.prim_func(s_tir=True)
    def fp8_dequant(codes_h: T.handle, scales_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "fp8_dequant", "tirx.noalias": True})
        r = T.int64()
        codes = T.match_buffer(codes_h, (r, D), "uint8")
        scales = T.match_buffer(scales_h, (r, DB), "uint8")
        out = T.match_buffer(out_h, (r, D), "float32")
        for i, j in T.grid(r, D):
            with T.sblock("dequant"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = e4m3_to_f32(T.Cast("uint32", codes[vi, vj])) * e8m0_byte(
                    scales[vi, vj // BLOCK])

    return fp8_dequant


@dataclass(frozen=True)
class DequantConfig:
    """Elementwise: CPU `vec` lanes over the row, parallel over rows; CUDA `threads` per block
    over the flattened (row, column) space."""

    vec: int = 16
    threads: int = 256


def dequant_config(target: TargetSpec, *, d: int) -> DequantConfig:
    vec = 16
    while d % vec:
        vec //= 2
    return DequantConfig(vec=vec, threads=256)


def schedule_dequant(func: tvm.tirx.PrimFunc, config: DequantConfig,
                     target: TargetSpec) -> tvm.tirx.PrimFunc:
    """One `dequant` block over [r, d]."""
    sch = s_tir.Schedule(func)
    i, j = sch.get_loops(sch.get_sblock("dequant"))
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, j), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        _, jv = sch.split(j, [None, config.vec])
        sch.parallel(i)
        sch.vectorize(jv)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_fp8_dequant(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    target = get_target(target_name)
    return schedule_dequant(make_fp8_dequant(d=d), dequant_config(target, d=d), target)


# ---- example inputs for benchmarks ----------------------------------------------------------


def example_inputs_fp8_linear(*, m: int, n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    """[x bf16 [m, k], weight E4M3 [n, k], scale E8M0 [ceil(n/32), k/32]]: a weight quantised
    from a Gaussian with the checkpoint's 32x32 tile rule, activations ~N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    weight, scale = fmt.torch_quant_fp8_weight(torch.randn(n, k, generator=g) * k**-0.5)
    return [x, weight, scale]
