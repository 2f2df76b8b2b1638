"""The hand-vectorised FP8 decode GEMV for AVX2 / AVX-512 (`make_fp8_gemv_avx2`): E4M3
weights widened in integer lanes, through bf16 bits (256-bit) or fp16 bits (512-bit)."""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    bf16_of,
    bf16_to_f32,
    e8m0_to_f32,
    i64,
    pairwise_lane_sum,
    u32,
)
from dsv41.schedules.common import prefetch as prefetch_line
from dsv41.schedules.gemm.avx2_wrappers import (
    Avx2GemvStages,
    dense_func,
    fp8_linear_func,
    norm_func,
    pair_func,
    q_kv_func,
    swiglu_func,
)
from dsv41.schedules.gemm.fp8 import BLOCK, check_out_dtype, fp8_qdq, pow2_scale_byte

MAX_ROWS = 8  # rows per group of the verify form (1 + the DSpark block; the default block is 5)


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


def _bf16_bits_vectors(codes, lanes: int):
    """4 x lanes E4M3 codes (uint8) -> the four float32 vectors of their values times 2^-120,
    exactly, in `_gemv_slot_source`'s order for the bf16-bits decode (even codes, then odd;
    each the low then the high four words of every 128-bit lane). In 16-bit lanes an odd code
    is the high byte and an even one, shifted left by 8, too: an arithmetic shift right by 4
    sign-extends it, shifted left by 4, and the mask 0x87F0 leaves the bf16 bits S 0000EEEE
    MMM0000: E4M3's exponent field as the low four bits of bf16's (bias 127 against 7: the
    value times 2^-120, a subnormal code a subnormal float32 of the same ratio) and its
    mantissa as the top three bits. A zero word below each (vpunpcklwd / vpunpckhwd) makes
    it a float32. No vcvtph2ps: the fp16 decode's four a chunk set its pace on Zen 4 (the
    same 26 GB/s with its weights in the cache as from memory); shifts rather than vpmaddubsw
    keep the multiply pipes, which the FMAs share, free. The NaN codes give a finite value
    (the caller flags them); the FMAs multiply the subnormals exactly, as long as the thread
    does not treat subnormal inputs as zero (MXCSR.DAZ, which this runtime never sets; with
    it, e.g. after torch.set_flush_denormal(True), those weights, each under 2^-6 of its
    tile's largest, would read as zero)."""
    words = 2 * lanes
    zero = T.broadcast(T.uint16(0), words)
    out = []
    w16 = T.reinterpret(f"int16x{words}", codes)
    for odd in (0, 1):
        h = (w16 if odd else w16 << T.broadcast(T.int16(8), words)) >> T.broadcast(
            T.int16(4), words)
        bits = T.reinterpret(f"uint16x{words}", h) & T.broadcast(T.uint16(0x87F0), words)
        for half in (0, 1):  # word 8 L + 4 half + e of lane L into the high half of float e
            idx = []
            for t in range(lanes):
                idx += [0, words + 8 * (t // 4) + 4 * half + t % 4]
            out.append(T.reinterpret(f"float32x{lanes}", T.Shuffle([zero, bits], idx)))
    return out


def _f16_to_f32(h16, half: int, lanes: int):
    """Lanes lanes * half .. of 2 x lanes fp16 bits as float32 lanes (vcvtph2ps)."""
    idx = list(range(lanes * half, lanes * half + lanes))
    return T.Cast(f"float32x{lanes}", T.reinterpret(f"float16x{lanes}", T.Shuffle([h16], idx)))


def bf16_bits_decode(lanes: int) -> bool:
    """Whether the GEMV of `lanes` decodes through bf16 bits (`_bf16_bits_vectors`: the
    256-bit form, which the CPUs without AVX-512 run) rather than fp16 bits (the 512-bit form:
    Intel's AVX-512 cores take a microcode assist on a subnormal multiplicand)."""
    return lanes == 8


def _gemv_slot_source(j, lanes: int):
    """Slot j (0 .. 4 x lanes - 1) of a chunk in the hand-vectorised GEMV's activation layout ->
    the offset in the chunk it holds. The four decoded vectors are the even codes', then the
    odd codes'. fp16 bits (`_f16_bits_even_odd`): each parity's first then second half (lanes
    16: slots 0-15 take offsets 0, 2, .., 30, 16-31 take 32, .., 62, 32-47 take 1, .., 31 and
    48-63 take 33, .., 63); bf16 bits (`_bf16_bits_vectors`, lanes 8): each parity's low then
    high four words of each 128-bit lane (slots 0-7 take 0, 2, 4, 6, 16, 18, 20, 22, slots
    8-15 take 8, .., 14, 24, .., 30, and 16-31 the odd offsets alike)."""
    q, t = j // lanes, j % lanes  # vector q = 2 parity + half, lane t
    if bf16_bits_decode(lanes):
        return 2 * (8 * (t // 4) + 4 * (q % 2) + t % 4) + q // 2
    return (q % 2) * (2 * lanes) + 2 * t + q // 2


def fp8_gemv_avx2_stages(*, n: int, k: int, out_dtype: str = "bfloat16", lanes: int = 8,
                         prefetch: int = 0, rows: int = 1, groups: int = 0,
                         w_dtype: str = "fp8") -> Avx2GemvStages:
    """The macros of the CPU decode form of `fp8_linear` for x86 with AVX2 + FMA + F16C
    (`make_fp8_gemv_avx2`: the same signature and result as `make_fp8_gemv`), hand-vectorised:
    its loops are the schedule. `lanes` 8: 256-bit
    vectors (CPUs without AVX-512); 16: 512-bit (AVX-512 BW), k a multiple of 64. `prefetch`:
    columns ahead of the one being summed whose weights are prefetched (0: none).

    The activation is quantised once per row (`xq`, as `make_fp8_gemv`'s stages, its K offsets
    stored per chunk of 4 x lanes codes in the order `_gemv_slot_source` gives). Per 32-column
    tile (a parallel task) and row, `xs` = xq * 2^(s - 127) * 2^W with the tile's weight scales
    (the same exact products and range as `make_fp8_gemv`), then one column at a time, so the
    weights stream from memory in address order: per chunk one load of 4 x lanes codes decoded
    into four vectors of E4M3 * 2^-W and four FMAs into four accumulators of `lanes` lanes
    (added pairwise at the end: every product is exact, only the order of the fp32 additions
    differs from the oracle, as `make_fp8_gemv`). lanes 16: two vpmaddubsw + masks give the
    codes' fp16 bits (`_f16_bits_even_odd`, W = 8) and four vcvtph2ps widen them; lanes 8 (the
    AVX2 CPUs): shifts + masks give their bf16 bits and four word interleaves with zero widen
    them (`_bf16_bits_vectors`, W = 120). x * 2^(s - 127 + W) (`fast_x`) can leave fp32's
    range (large x, or s past 127 + 127 - W) or round (a scale below 2^-W on a subnormal-
    bound x): a tile and row (a verify group: all its rows) where it might, by the row's
    exponent range and the tile's scale range (`fast_ok`), runs as stored instead: x * 2^(s -
    119) (the dense form: x as it is) against the decoded weights times 2^112 (and the tile's
    factor): the same exact products, so the same bits. Zen 4 running the lanes-8 code (2
    threads, min of 60 calls interleaved with the fp16 decode's): n 32768 k 512, weights cycled
    through 7 copies 0.648 -> 0.521 ms, one copy from the cache 0.647 -> 0.450 (the fp16
    decode ran at 26 GB/s either way: its four vcvtph2ps a chunk set its pace); the dense form
    (n 512 x 8 groups, k 4096) 0.743 -> 0.634 and 0.661 -> 0.457; the bench preset's 64K
    decode step (`cpu-avx2` artifacts alternated) 122.5 -> 114.7 ms. NaN weights: the
    column's max of code & 0x7f over K (vpmaxub, two operations per chunk instead of the four
    16-bit operations per 16 codes of the NaN fix) is 0x7f exactly when one of its codes is
    0x7f / 0xff, and then its output is NaN.

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
    instead of 4 accumulators per column, within noise.

    `rows` > 1: the verify form (`fp8_gemv_rows`), same signature and result, every row's
    output bit-identical to this kernel's on that row alone: the rows go in groups of `rows`
    (the verify entry's 1 + k), and per column each chunk of weights is loaded and decoded once
    for the whole group, then added into each row's own four accumulators in the single-row
    order (same chunks, same slots, same pairwise lane sum). The weights are read and decoded
    once per group instead of once per row.

    `groups` > 0: the decode GEMV of the grouped o-projection over an FP8 weight (`dense_gemv`'s
    signature with `w_dtype` fp8: x bf16 [m, groups, k], weight E4M3 [groups * n, k], scale
    E8M0 per 32 x 32 tile, y fp32 [m, groups, n], n a multiple of 32): the same loops with x
    taken as it is (bf16 widened, not quantised) and a 32-column tile's rows of x those of
    its group, so each product is x times the weight's exact value, as the dequantized bf16
    weight's (`checkpoint.fp8_tiles`) while the tile scale keeps x * 2^(s - 119) a normal
    fp32; only the order of the fp32 additions is this kernel's own. The tile's factor goes on
    x (`fast_x`, as above) instead of on every decoded weight, where that is exact for the
    whole row (else the tile scales its weights): the same bits (Zen 4 running the lanes-8
    code with the fp16 decode, 2 threads, n 512 x 8 groups, k 4096, interleaved min / median
    of 60 calls: weights cycled through 7 copies 0.766 / 0.809 -> 0.739 / 0.788 ms, one copy
    from the cache 0.732 / 0.755 -> 0.661 / 0.672). `w_dtype` "bfloat16" (dense
    only): the same GEMV over a bf16 weight [groups * n, k] ((x, w, y), no scale): each chunk's
    32 weights widened on their bits into the same four vectors, x not scaled, so over the
    dequantized copy of an FP8 weight it gives the FP8 form's outputs bit for bit (the same
    exact products, added in the same order)."""
    dense = groups > 0
    bf16w = w_dtype == "bfloat16"
    if w_dtype not in ("fp8", "bfloat16") or (bf16w and not dense):
        raise ValueError(f"The hand-vectorised GEMV's weight is fp8, or bfloat16 in its dense "
                         f"form; got {w_dtype!r} (groups={groups}).")
    if dense and (n % BLOCK or out_dtype not in ("float32", "bfloat16")):
        raise ValueError(f"The FP8-weight dense GEMV needs n a multiple of {BLOCK} and stores "
                         f"float32 or bfloat16; got n={n}, out_dtype={out_dtype}.")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"The fp8 GEMV takes 1..{MAX_ROWS} rows per group; got rows={rows}.")
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    if lanes not in (8, 16) or k % (4 * lanes):
        raise ValueError(f"The hand-vectorised fp8 GEMV takes lanes 8 or 16 and k a multiple of "
                         f"4 x lanes; got lanes={lanes}, k={k}.")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 columns; got {prefetch}.")
    check_out_dtype(out_dtype)
    G = i64(max(groups, 1))
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(max(groups, 1) * n / BLOCK))
    NW = G * N  # the weight's rows
    LN, CL = lanes, 4 * lanes  # fp32 lanes per vector; codes per chunk (one load)
    NCH = i64(k // CL)  # chunks per column
    ACC = 4  # accumulators per column, one per decoded vector of a chunk
    BITS = bf16_bits_decode(lanes)  # the bf16-bits decode (else fp16 bits)
    W_EXP = 120 if BITS else 8  # the decoded weights are E4M3 * 2^-W_EXP
    # a fast path over x scaled by 2^(s - 127 + W_EXP), where that is exact, else x as stored:
    # the dense form (x as stored is unscaled: the weights carry the tile's factor) and the
    # bf16-bits decode (x * 2^(s - 7) overflows for large x); the fp16 decode's fp8_linear
    # scales x by 2^(s - 119) either way
    FAST = (dense or BITS) and not bf16w

    def f32v(buf, off):
        return buf[T.ramp(off, 1, LN)]

    @T.macro
    def fma(acc, xs, ch, q, w):  # accumulator q += xs slots LN q .. of chunk ch * w
        acc[T.ramp(q * LN, 1, LN)] = f32v(acc, q * LN) + f32v(xs, ch * CL + q * LN) * w

    def vectors(weight, col, ch):  # chunk ch of column col: four fp32 vectors, slot order
        if bf16w:  # the words' low halves are the even weights, the high ones the odd
            words = T.reinterpret(f"uint32x{2 * LN}",
                                  weight.vload([col, ch * CL], f"bfloat16x{CL}"))
            order = ([[8 * (t // 4) + 4 * h + t % 4 for t in range(LN)] for h in (0, 1)]
                     if BITS else [list(range(h * LN, h * LN + LN)) for h in (0, 1)])
            halves = [T.Shuffle([words], order[h]) for h in (0, 1)]
            even = [T.reinterpret(f"float32x{LN}", v << T.broadcast(u32(16), LN))
                    for v in halves]
            odd = [T.reinterpret(f"float32x{LN}", v & T.broadcast(u32(0xFFFF0000), LN))
                   for v in halves]
            return [even[0], even[1], odd[0], odd[1]]
        codes = weight.vload([col, ch * CL], f"uint8x{CL}")
        if BITS:
            return _bf16_bits_vectors(codes, LN)  # E4M3 * 2^-120
        h = _f16_bits_even_odd(codes, LN)  # [even, odd], E4M3 * 2^-8
        return [_f16_to_f32(h[0], 0, LN), _f16_to_f32(h[0], 1, LN), _f16_to_f32(h[1], 0, LN),
                _f16_to_f32(h[1], 1, LN)]

    def weights(weight, wsc, col, ch, as_stored):
        """Chunk ch of column col as `vectors` decodes it (E4M3 * 2^-W: the fast path's, over
        x * 2^(s - 127 + W)), or, as_stored, as the x as stored multiplies it: E4M3 * 2^-8
        (the bf16-bits decode's times 2^112, exact) and, in the dense form, times the tile's
        2^(s - 119) (`tile_factors`): the dequantized weight's exact value."""
        w = vectors(weight, col, ch)
        if bf16w or not as_stored:
            return w
        if BITS:
            w = [v * T.broadcast(T.float32(2.0 ** (W_EXP - 8)), LN) for v in w]
        if dense:  # vector q holds 32-block ch * CL / 32 + (q % 2 when a chunk spans two)
            w = [w[q] * T.broadcast(wsc[block_of(ch, q)], LN) for q in range(4)]
        return w

    @T.macro
    def tile_factors(scale, wsc, p):  # the dense FP8 form: tile p's 2^(s - 119) per 32-block
        if dense and not bf16w:  # static
            for b in range(KB):
                wsc[b] = e8m0_to_f32(T.Cast("uint32", scale[p, b])) * T.float32(256.0)

    def scaled(v, scale, p, ch, j, fast=False):
        """xs: v as stored (fp8_linear: times the tile's weight scale and 2^8; the dense form
        scales its weights instead), or, fast, times the tile's weight scale and 2^W_EXP."""
        if (dense and not fast) or scale is None:
            return v
        return v * e8m0_to_f32(T.Cast("uint32", scale[
            p, (ch * CL + _gemv_slot_source(j, LN)) // BLOCK])) * T.float32(
                2.0 ** (W_EXP if fast else 8))

    @T.macro
    def column_sum(weight, wsc, xs, acc, flg, col, as_stored=True):
        """acc[q * LN ..] += xs[.., slots LN q ..] * w[col, ..] over K; flg = max(code & 0x7f).
        as_stored False (x scaled by `fast_x`): the weights as decoded (`weights`)."""
        for q in T.unroll(ACC * LN):
            acc[q] = T.float32(0)
        for t in T.vectorized(i64(CL)):
            flg[t] = T.uint8(0)
        for ch in range(NCH):
            if prefetch > 0:
                prefetch_line(T.address_of(weight[T.min(col + prefetch, NW - i64(1)), ch * CL]))
            w = T.meta_var(weights(weight, wsc, col, ch, as_stored))
            fma(acc, xs, ch, 0, w[0])
            fma(acc, xs, ch, 1, w[1])
            fma(acc, xs, ch, 2, w[2])
            fma(acc, xs, ch, 3, w[3])
            if not bf16w:  # static: the NaN codes' flag
                flg[T.ramp(0, 1, CL)] = T.max(flg[T.ramp(0, 1, CL)], weight.vload(
                    [col, ch * CL], f"uint8x{CL}") & T.broadcast(T.uint8(0x7F), CL))

    def lane_total(acc):  # the 4 x LN lanes of a column added pairwise
        return pairwise_lane_sum(
            (f32v(acc, 0) + f32v(acc, LN)) + (f32v(acc, 2 * LN) + f32v(acc, 3 * LN)), LN)

    def has_nan(flg):  # some byte is 0x7f: the top bit of flg + 1 (vpmovmskb over 32 bytes)
        f32b = flg[T.ramp(0, 1, 32)]
        if CL == 64:
            f32b = T.max(f32b, flg[T.ramp(32, 1, 32)])
        top = T.reinterpret("int8x32", f32b + T.broadcast(T.uint8(1), 32))
        return T.call_llvm_pure_intrin("int32", "llvm.x86.avx2.pmovmskb", top) != 0

    def xrow(i, p):  # the row of xq that tile p of row i reads
        return i * G + p * i64(BLOCK) // N if dense else i

    @T.macro
    def store(y, i, col, v):  # column col of the weight's rows, of row i
        if col < NW:
            if dense and out_dtype == "bfloat16":  # static: as the graph's fp32 -> bf16 rounds
                y[i, col // N, col % N] = bf16_of(v)
            elif dense:
                y[i, col // N, col % N] = v
            else:
                y[i, col] = T.Cast(out_dtype, v)

    def out_value(flg, total):  # a column's output: NaN where a code is
        return T.Select(has_nan(flg), T.reinterpret("float32", u32(0x7FC00000)), total)

    @T.macro
    def widen_rows(x, xq, m):  # the dense form's x, as it is, in the chunks' slot order
        for i, g, ch in T.grid(m, G, NCH):
            for j in T.vectorized(i64(CL)):
                xq[i * G + g, ch * CL + j] = bf16_to_f32(
                    x[i, g, ch * CL + _gemv_slot_source(j, LN)])

    def xval(x, xn, i, c):  # the activation the quantiser reads: x (bf16), or the staged xn
        return bf16_to_f32(x[i, c]) if xn is None else xn[i, c]

    @T.macro
    def quantise_rows(x, xn, amax, xq, m):  # each row's activation once
        for i, b in T.grid(m, KB):
            amax[i, b] = T.min_value("float32")
            for j in range(i64(BLOCK)):
                amax[i, b] = T.max(amax[i, b], T.fabs(xval(x, xn, i, b * BLOCK + j)))
        for i, ch in T.grid(m, NCH):
            for j in T.vectorized(i64(CL)):
                xq[i, ch * CL + j] = fp8_qdq(
                    xval(x, xn, i, ch * CL + _gemv_slot_source(j, LN)),
                    pow2_scale_byte(amax[i, (ch * CL + _gemv_slot_source(j, LN)) // BLOCK]))

    def block_of(ch, q):  # the 32-block of vector q of chunk ch
        return ch * CL // BLOCK + (q % 2 if CL > BLOCK else 0)

    @T.macro
    def unscaled_x(xq, scale, xs, i, p):  # xs for tile p of row i (`scaled`)
        for ch in range(NCH):
            for j in T.vectorized(i64(CL)):
                xs[ch * CL + j] = scaled(xq[xrow(i, p), ch * CL + j], scale, p, ch, j)

    @T.macro
    def tile_columns(weight, wsc, xs, acc, flg, y, i, p, as_stored):
        for c in range(i64(BLOCK)):
            # a partial last tile reads its last column again and stores nothing
            column_sum(weight, wsc, xs, acc, flg, T.min(p * BLOCK + c, NW - i64(1)), as_stored)
            store(y, i, p * BLOCK + c, out_value(flg, lane_total(acc)))

    @T.macro
    def tile_as_stored(xq, weight, scale, wsc, xs, acc, flg, y, i, p):
        """Tile p of row i over x as stored (fp8_linear's times the tile's 2^(s - 119)) and the
        weights as stored (`weights`): the form every tile could take, and the fast path's
        fallback."""
        unscaled_x(xq, scale, xs, i, p)
        tile_columns(weight, wsc, xs, acc, flg, y, i, p, True)

    @T.macro
    def row_exponents(xq, xr, nrows):
        """xr[r] = (the least exponent field among row r's nonzero values, 255 without any
        (a subnormal's is 0); the greatest among all of them), for `fast_ok`."""
        for r in range(nrows):
            lo = T.alloc_buffer((LN,), "int32")
            hi = T.alloc_buffer((LN,), "int32")
            for t in T.vectorized(i64(LN)):
                lo[t] = 255
                hi[t] = 0
            for c in range(K // i64(LN)):
                u = T.meta_var(T.reinterpret(f"int32x{LN}", xq[r, T.ramp(c * LN, 1, LN)]))
                ex = T.meta_var((u >> T.broadcast(23, LN)) & T.broadcast(0xFF, LN))
                nz = T.meta_var((u & T.broadcast(0x7FFFFFFF, LN)) != T.broadcast(0, LN))
                lo[T.ramp(0, 1, LN)] = T.min(lo[T.ramp(0, 1, LN)],
                                             T.Select(nz, ex, T.broadcast(255, LN)))
                hi[T.ramp(0, 1, LN)] = T.max(hi[T.ramp(0, 1, LN)], ex)
            xr[r, 0] = lo[0]
            xr[r, 1] = hi[0]
            for t in range(1, LN):
                xr[r, 0] = T.min(xr[r, 0], lo[t])
                xr[r, 1] = T.max(xr[r, 1], hi[t])

    @T.macro
    def tile_scale_range(scale, sr, p):  # sr = (least, greatest) E8M0 byte of tile p
        sr[0] = T.Cast("int32", scale[p, 0])
        sr[1] = sr[0]
        for b in range(1, KB):
            sr[0] = T.min(sr[0], T.Cast("int32", scale[p, b]))
            sr[1] = T.max(sr[1], T.Cast("int32", scale[p, b]))

    def fast_ok(xr, sr, i, p):
        """Whether row i's x times tile p's 2^(s - 127 + W_EXP) (`scaled`, fast) is exact for
        every value and block: each scaled exponent field within 1..254 (a subnormal x then
        scales up exactly) and the factor itself a normal float32. Then each scaled x times
        E4M3 * 2^-W_EXP is the product as stored (x times the weight's exact value, or xq *
        2^(s - 127) times E4M3): the same bits either way. A row of huge values, or a tile of
        extreme scales, runs as stored (an inf or NaN x gives the same products either way)."""
        d = 127 - W_EXP
        return ((xr[xrow(i, p), 0] + sr[0] - d >= 1) & (xr[xrow(i, p), 1] + sr[1] - d <= 254)
                & (sr[1] - d <= 127))

    @T.macro
    def fast_x(xq, scale, xs, i, p, base):  # xs[base ..]: row i for the fast path
        for ch in range(NCH):
            for j in T.vectorized(i64(CL)):
                xs[base + ch * CL + j] = scaled(xq[xrow(i, p), ch * CL + j], scale, p, ch, j,
                                                True)

    @T.macro
    def single_rows(xq, weight, scale, y, m):
        if FAST:  # static: each row's exponent range, for `fast_ok`
            xr = T.alloc_buffer((m * G, 2), "int32")
            row_exponents(xq, xr, m * G)
        else:
            xr = T.meta_var(None)
        for p in T.parallel(NB):
            xs = T.alloc_buffer((K,), "float32")
            # acc / flg in the default scope: small constant stack arrays that LLVM keeps in
            # registers ("local" ones, and vector assignments, became heap workspaces, so each
            # chunk stored seven vectors: n 32768 k 512 1.71 -> 1.31 ms, one loaded Zen 4)
            acc = T.alloc_buffer((ACC * LN,), "float32")
            flg = T.alloc_buffer((CL,), "uint8")
            if dense and not bf16w:  # static: the tile's weight factors
                wsc = T.alloc_buffer((KB,), "float32")
            else:
                wsc = T.meta_var(None)
            if FAST:  # static
                sr = T.alloc_buffer((2,), "int32")
                tile_scale_range(scale, sr, p)
            else:
                sr = T.meta_var(None)
            tile_factors(scale, wsc, p)
            for i in range(m):
                if FAST:  # static: x scaled once, unless that is not exact
                    if fast_ok(xr, sr, i, p):
                        fast_x(xq, scale, xs, i, p, i64(0))
                        tile_columns(weight, wsc, xs, acc, flg, y, i, p, False)
                    else:
                        tile_as_stored(xq, weight, scale, wsc, xs, acc, flg, y, i, p)
                else:
                    tile_as_stored(xq, weight, scale, wsc, xs, acc, flg, y, i, p)

    stages = Avx2GemvStages(body=single_rows, quantise=quantise_rows, widen=widen_rows, n=N,
                            k=K, kb=KB, nb=NB, nw=NW, g=G, out_dtype=out_dtype)
    if rows == 1:
        return stages
    R = i64(rows)
    TILES = 8  # 32-column tiles per parallel task

    def row_total(acc, r):  # row r's 4 x LN lanes added as `lane_total` adds one row's
        a = r * ACC * LN
        return pairwise_lane_sum((f32v(acc, a) + f32v(acc, a + LN))
                                 + (f32v(acc, a + 2 * LN) + f32v(acc, a + 3 * LN)), LN)

    @T.macro
    def row_zero(acc, r, here):
        if here:  # static: row r is one of the group's
            for t in T.unroll(ACC * LN):
                acc[r * ACC * LN + t] = T.float32(0)

    @T.macro
    def fma_at(acc, xs, a, x, q, w):  # accumulator q of the row at a += its xs slots LN q ..
        acc[T.ramp(a + q * LN, 1, LN)] = f32v(acc, a + q * LN) + f32v(xs, x + q * LN) * w

    @T.macro
    def row_fma(acc, xs, here, r, ch, w0, w1, w2, w3):  # row r's 4 FMAs of chunk ch
        if here:  # static
            fma_at(acc, xs, r * ACC * LN, r * K + ch * CL, 0, w0)
            fma_at(acc, xs, r * ACC * LN, r * K + ch * CL, 1, w1)
            fma_at(acc, xs, r * ACC * LN, r * K + ch * CL, 2, w2)
            fma_at(acc, xs, r * ACC * LN, r * K + ch * CL, 3, w3)

    @T.macro
    def row_store(y, acc, flg, r, here, row, col):
        if here:  # static
            store(y, row, col, out_value(flg, row_total(acc, r)))

    @T.macro
    def group_columns(weight, wsc, xs, y, p, row0, nr, acc, flg):
        """The 32 columns of tile p for the nr rows from row0 (nr static: every update
        unconditional, so the accumulators stay in registers)."""
        for c in range(i64(BLOCK)):
            row_zero(acc, 0, nr > 0)
            row_zero(acc, 1, nr > 1)
            row_zero(acc, 2, nr > 2)
            row_zero(acc, 3, nr > 3)
            row_zero(acc, 4, nr > 4)
            row_zero(acc, 5, nr > 5)
            row_zero(acc, 6, nr > 6)
            row_zero(acc, 7, nr > 7)
            for t in T.vectorized(i64(CL)):
                flg[t] = T.uint8(0)
            if prefetch > 0:  # the whole row `prefetch` columns ahead, before the sums: a
                # prefetch inside the chunk loop keeps LLVM from holding the sums in registers
                for ch in range(NCH):
                    prefetch_line(T.address_of(weight[T.min(p * BLOCK + c + prefetch,
                                                            NW - i64(1)), ch * CL]))
            for ch in range(NCH):
                col = T.min(p * BLOCK + c, NW - i64(1))
                w = T.meta_var(weights(weight, wsc, col, ch, not FAST))
                w0 = w[0]
                w1 = w[1]
                w2 = w[2]
                w3 = w[3]
                row_fma(acc, xs, nr > 0, 0, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 1, 1, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 2, 2, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 3, 3, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 4, 4, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 5, 5, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 6, 6, ch, w0, w1, w2, w3)
                row_fma(acc, xs, nr > 7, 7, ch, w0, w1, w2, w3)
                if not bf16w:  # static: the NaN codes' flag
                    flg[T.ramp(0, 1, CL)] = T.max(flg[T.ramp(0, 1, CL)], weight.vload(
                        [col, ch * CL], f"uint8x{CL}") & T.broadcast(T.uint8(0x7F), CL))
            row_store(y, acc, flg, 0, nr > 0, row0, p * BLOCK + c)
            row_store(y, acc, flg, 1, nr > 1, row0 + 1, p * BLOCK + c)
            row_store(y, acc, flg, 2, nr > 2, row0 + 2, p * BLOCK + c)
            row_store(y, acc, flg, 3, nr > 3, row0 + 3, p * BLOCK + c)
            row_store(y, acc, flg, 4, nr > 4, row0 + 4, p * BLOCK + c)
            row_store(y, acc, flg, 5, nr > 5, row0 + 5, p * BLOCK + c)
            row_store(y, acc, flg, 6, nr > 6, row0 + 6, p * BLOCK + c)
            row_store(y, acc, flg, 7, nr > 7, row0 + 7, p * BLOCK + c)

    @T.macro
    def group_if(weight, wsc, xs, y, p, row0, live, nr, acc, flg):
        if nr <= rows:  # static: a group of nr rows exists
            if live == nr:
                group_columns(weight, wsc, xs, y, p, row0, nr, acc, flg)

    @T.macro
    def groups(weight, wsc, xs, y, p, row0, live, acc, flg):  # the group of `live` rows
        group_if(weight, wsc, xs, y, p, row0, live, 1, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 2, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 3, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 4, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 5, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 6, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 7, acc, flg)
        group_if(weight, wsc, xs, y, p, row0, live, 8, acc, flg)

    @T.macro
    def grouped_rows(xq, weight, scale, y, m):
        if FAST:  # static: each row's exponent range, for `fast_ok`
            xr = T.alloc_buffer((m * G, 2), "int32")
            row_exponents(xq, xr, m * G)
        else:
            xr = T.meta_var(None)
        for po in T.parallel((NB + i64(TILES - 1)) // i64(TILES)):
            # buffers once per TILES tiles: a workspace allocation per 32-column tile cost
            # more than the tile's sums at k 512
            xs = T.alloc_buffer((R * K,), "float32")
            acc = T.alloc_buffer((R * ACC * LN,), "float32")  # row r at r*ACC*LN
            flg = T.alloc_buffer((CL,), "uint8")
            if dense and not bf16w:  # static: the tile's weight factors
                wsc = T.alloc_buffer((KB,), "float32")
            else:
                wsc = T.meta_var(None)
            if FAST:  # static
                sr = T.alloc_buffer((2,), "int32")
                ok = T.alloc_buffer((1,), "int32")
            else:
                sr = T.meta_var(None)
                ok = T.meta_var(None)
            for pi in range(i64(TILES)):
                if po * TILES + pi < NB:
                    p = T.meta_var(po * TILES + pi)
                    tile_factors(scale, wsc, p)
                    if FAST:  # static
                        tile_scale_range(scale, sr, p)
                    for g in range((m + R - i64(1)) // R):
                        live = T.min(m - g * R, R)  # rows in this group (the last: fewer)
                        if FAST:  # static: the group's x scaled, unless some row's is not exact
                            ok[0] = 1
                            for r in range(live):
                                if not fast_ok(xr, sr, g * R + r, p):
                                    ok[0] = 0
                            if ok[0] == 1:
                                for r in range(live):
                                    fast_x(xq, scale, xs, g * R + r, p, r * K)
                                groups(weight, wsc, xs, y, p, g * R, live, acc, flg)
                            else:  # each row as stored, alone: the same bits
                                for r in range(live):
                                    tile_as_stored(xq, weight, scale, wsc, xs, acc, flg, y,
                                                   g * R + r, p)
                        else:
                            for r, ch in T.grid(live, NCH):
                                for j in T.vectorized(i64(CL)):
                                    xs[r * K + ch * CL + j] = scaled(
                                        xq[xrow(g * R + r, p), ch * CL + j], scale, p, ch, j)
                            groups(weight, wsc, xs, y, p, g * R, live, acc, flg)

    return dataclasses.replace(stages, body=grouped_rows)


def make_fp8_gemv_avx2(*, n: int, k: int, out_dtype: str = "bfloat16", lanes: int = 8,
                       prefetch: int = 0, rows: int = 1, groups: int = 0,
                       w_dtype: str = "fp8", norm_eps: float | None = None,
                       norm_lanes: int = 32, pair_n: int | None = None,
                       swiglu_limit: float | None = None) -> tvm.tirx.PrimFunc:
    """The hand-vectorised decode GEMV (`fp8_gemv_avx2_stages`: its loops, decode and
    measurements) with `fp8_linear`'s signature, or with groups > 0 `dense_gemv`'s. As
    `make_fp8_gemv_bf16` does, it may form its activation first or take two matrices
    (`avx2_wrappers`): `norm_eps` (`norm_fp8_linear`: x RMS-normed as `norm.make_rms_norm`
    norms it with `norm_lanes`), `swiglu_limit` (`swiglu_fp8_linear`: bf16(swiglu(gate, up))),
    `pair_n` (`fp8_linear_pair`: a second matrix [pair_n, k] over the same quantised x): each
    the kernels it replaces, bit for bit."""
    fused = [v is not None for v in (norm_eps, pair_n, swiglu_limit)]
    if any(fused) and (groups or sum(fused) > 1):
        raise ValueError("The hand GEMV norms its input, forms a SwiGLU or pairs two matrices "
                         "(one of them), and not in its dense form.")
    if norm_eps is not None and (norm_lanes <= 0 or k % norm_lanes):
        raise ValueError(f"The fp8 GEMV's norm needs lanes dividing k={k}; got {norm_lanes}.")
    if pair_n is not None and pair_n <= 0:
        raise ValueError(f"The paired fp8 GEMV needs pair_n > 0; got {pair_n}.")
    st = fp8_gemv_avx2_stages(n=n, k=k, out_dtype=out_dtype, lanes=lanes, prefetch=prefetch,
                              rows=rows, groups=groups, w_dtype=w_dtype)
    if groups:
        return dense_func(st, bf16w=w_dtype == "bfloat16")
    if norm_eps is not None:
        return norm_func(st, norm_eps, norm_lanes)
    if swiglu_limit is not None:
        return swiglu_func(st, swiglu_limit)
    if pair_n is not None:
        return pair_func(st, fp8_gemv_avx2_stages(n=pair_n, k=k, out_dtype=out_dtype,
                                                  lanes=lanes, prefetch=prefetch, rows=rows))
    return fp8_linear_func(st)


def make_fp8_q_kv_avx2(*, n_q: int, n_kv: int, k: int, n_b: int, norm_eps: float,
                       norm_lanes: int = 32, lanes: int = 8, rows: int = 1, prefetch: int = 0,
                       b_prefetch: int = 0) -> tvm.tirx.PrimFunc:
    """`fp8_q_kv`'s kernel from the hand GEMV (`avx2_wrappers.q_kv_func`): the paired wq_a /
    wkv GEMV, then q_lora RMS-normed into the wq_b GEMV (`make_fp8_gemv_avx2`'s pair_n and
    norm_eps kernels in turn, bit for bit, one VM call). `rows`: the verify form's groups."""
    if norm_lanes <= 0 or n_q % norm_lanes:
        raise ValueError(f"The fp8 GEMV's norm needs lanes dividing n_q={n_q}; got "
                         f"{norm_lanes}.")
    one = dict(out_dtype="bfloat16", lanes=lanes, rows=rows)
    pair = (fp8_gemv_avx2_stages(n=n_q, k=k, prefetch=prefetch, **one),
            fp8_gemv_avx2_stages(n=n_kv, k=k, prefetch=prefetch, **one))
    qb = fp8_gemv_avx2_stages(n=n_b, k=n_q, prefetch=b_prefetch, **one)
    return q_kv_func(pair, qb, norm_eps, norm_lanes)
