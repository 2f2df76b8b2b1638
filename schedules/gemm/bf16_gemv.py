"""The FP8 decode GEMV on AVX-512 BF16 (`make_fp8_gemv_bf16`): E4M3 weights looked up as bf16
(vpermi2b) and summed by vdpbf16ps, 32 products per instruction; its verify form shares each
weight decode across the rows."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    bf16_bits_of_exact,
    bf16_pair_halves,
    bf16_to_f32,
    dpbf16ps,
    dpbf16ps_by_fma,
    e8m0_to_f32,
    i64,
    round_bf16_bound,
    silu_times,
    u32,
    with_bf16_dot,
)
from dsv41.schedules.common import prefetch as prefetch_line
from dsv41.schedules.common.e4m3_words import e4m3_bf16_table, e4m3_bf16_words, table_vectors
from dsv41.schedules.common.stages import rms_norm_row
from dsv41.schedules.gemm.fp8 import BLOCK, check_out_dtype, fp8_qdq, pow2_scale_byte

MAX_ROWS = 8  # rows per group of the verify form (as `make_fp8_gemv_avx2`)
CL = 64  # E4M3 codes per chunk (one 512-bit load)
# A group of 3..PAIR_ROWS rows whose activations (rows x k bf16) pass PAIR_XS_BYTES takes its
# columns in pairs (`group_pairs`: each activation chunk, read from L2 once the group's
# activations outgrow L1, loaded once per two columns). wo_b (n 1024, k 4096), weights from
# memory, 2 cores shared with 3 other jobs, min of 150+ calls interleaved: 3 rows 0.60 ->
# 0.54 ms, 4 rows 0.45 -> 0.40, 5 rows 0.55 -> 0.46 and 0.69 -> 0.57; 1 and 2 rows slower in
# pairs (0.20 -> 0.26, 0.34 -> 0.54), and wq_b (k 512, 5 rows: 5 KB of activations) too (1.49
# -> 1.80): the register pressure of 20 accumulators without the L2 reads to save.
PAIR_ROWS = 5
PAIR_XS_BYTES = 16 << 10
MAX_TILES = 8  # 32-column tiles per parallel task (a task's workspace is allocated once)
MIN_TASKS = 16  # parallel tasks kept for balance where there are few tiles (wo_b: 32)


def chunk_slot_source(j):
    """Slot j (0..63) of a chunk in the bf16 GEMV's activation layout -> the code offset in the
    chunk it pairs with. The decoded weights of a chunk are two vectors of 32 bf16: vpunpcklbw /
    vpunpckhbw of the looked-up low and high bytes, i.e. per 128-bit lane L the codes 16 L .. 16
    L + 7, then 16 L + 8 .. 16 L + 15; slots 0-31 follow the first, 32-63 the second."""
    t = j % 32
    return 16 * (t // 8) + 8 * (j // 32) + t % 8


def _bf16_words(codes, lo_tbl, hi_tbl, half: int):
    """The bf16 bits (uint16 x 32) of codes 16 L + 8 half + i (L 0..3, i 0..7) of a chunk of 64
    E4M3 codes (`e4m3_bf16_words`): the order of the byte interleaves vpunpcklbw / vpunpckhbw."""
    return e4m3_bf16_words(codes, lo_tbl, hi_tbl,
                           [16 * (t // 8) + 8 * half + t % 8 for t in range(32)])


@dataclass(frozen=True)
class Fp8GemvStages:
    """`make_fp8_gemv_bf16`'s macros for one configuration, for kernels built of them:
    `body(x, xn, weight, scale, y, m, second)` (quantise x, or the staged rows xn, and run the
    tiles; second: the pair's (weight2, scale2, y2) or None) and `normed(x, nw, xn, m)` (the
    norm form's staging); n, k, kb, nb: the weight's shape as int64 immediates (n rows, k
    columns, kb and nb their 32-blocks); n2, nb2: the pair's second matrix's rows and row
    blocks (None without a pair)."""

    body: object
    normed: object
    n: object
    k: object
    kb: object
    nb: object
    n2: object = None
    nb2: object = None


def fp8_gemv_bf16_stages(*, n: int, k: int, out_dtype: str = "bfloat16", prefetch: int = 0,
                         rows: int = 1, fma_rows: bool = False, norm_eps: float | None = None,
                         norm_lanes: int = 32, pair_n: int | None = None,
                         swiglu_limit: float | None = None) -> Fp8GemvStages:
    """The macros of `make_fp8_gemv_bf16` with these arguments (see there), checked."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"The fp8 GEMV takes 1..{MAX_ROWS} rows per group; got rows={rows}.")
    if pair_n is not None and (pair_n <= 0 or norm_eps is not None):
        raise ValueError(f"The paired fp8 GEMV needs pair_n > 0 and no norm; got {pair_n}.")
    if swiglu_limit is not None and (norm_eps is not None or pair_n is not None):
        raise ValueError("The SwiGLU fp8 GEMV takes no norm and no second matrix.")
    if norm_eps is not None and (norm_lanes <= 0 or k % norm_lanes):
        raise ValueError(f"The fp8 GEMV's norm needs lanes dividing k={k}; got {norm_lanes}.")
    if k % CL:
        raise ValueError(f"The bf16 fp8 GEMV needs k a multiple of {CL}, got {k}.")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0 columns; got {prefetch}.")
    check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))
    NCH = i64(k // CL)  # chunks per column
    R = i64(rows)
    AW = 2 * 16  # accumulator floats per row: two vectors of 16 lanes
    NB2 = i64(0 if pair_n is None else math.ceil(pair_n / BLOCK))  # the second matrix's tiles
    NT = NB + NB2  # tiles the tasks share
    TILES = max(1, min(MAX_TILES, (math.ceil(n / BLOCK) + int(NB2)) // MIN_TASKS))

    def pairs(nr: int) -> bool:  # a group of nr rows takes its columns in pairs
        return 2 < nr <= PAIR_ROWS and nr * k * 2 > PAIR_XS_BYTES

    def by_fma(nr: int) -> bool:  # a group of nr rows sums by FMA pairs
        return fma_rows and nr > 1

    FMA = by_fma(rows)  # some group (every one of 2+ rows) stages `xf`; one-row groups `xs`

    def stages_xs(live):  # whether a group of `live` rows reads xs (True: every group does)
        return live == 1 if FMA else True

    SLOTS = max([rows] + [2 * PAIR_ROWS for nr in range(1, rows + 1) if pairs(nr)])  # acc slots

    def f32v(buf, off):
        return buf[T.ramp(off, 1, 16)]

    # accumulator slot a: row r of the column (group_columns), or of the pair's column s
    # (group_pairs: a = s * PAIR_ROWS + r), at a * AW
    @T.macro
    def row_zero(acc, a, here):
        if here:  # static: the slot's row is one of the group's
            for t in T.unroll(AW):
                acc[a * AW + t] = T.float32(0)

    @T.macro
    def row_dot(acc, xs, here, a, r, ch, w0, w1):  # row r's two dot products of chunk ch
        if here:  # static
            acc[T.ramp(a * AW, 1, 16)] = dpbf16ps(
                f32v(acc, a * AW), xs[T.ramp(r * K + ch * CL, 1, 32)], w0)
            acc[T.ramp(a * AW + 16, 1, 16)] = dpbf16ps(
                f32v(acc, a * AW + 16), xs[T.ramp(r * K + ch * CL + 32, 1, 32)], w1)

    @T.macro
    def row_dot_fma(acc, xf, here, a, r, ch, w0, w1):  # `row_dot` by FMA pairs (`by_fma`)
        if here:  # static
            h0 = T.meta_var(bf16_pair_halves(w0))
            h1 = T.meta_var(bf16_pair_halves(w1))
            acc[T.ramp(a * AW, 1, 16)] = dpbf16ps_by_fma(
                f32v(acc, a * AW), xf[T.ramp(r * K + ch * CL, 1, 16)],
                xf[T.ramp(r * K + ch * CL + 16, 1, 16)], h0[0], h0[1])
            acc[T.ramp(a * AW + 16, 1, 16)] = dpbf16ps_by_fma(
                f32v(acc, a * AW + 16), xf[T.ramp(r * K + ch * CL + 32, 1, 16)],
                xf[T.ramp(r * K + ch * CL + 48, 1, 16)], h1[0], h1[1])

    @T.macro
    def dot_row(acc, xs, xf, fm, here, a, r, ch, w0, w1):  # `row_dot`, by FMA pairs where fm
        row_dot(acc, xs, here and not fm, a, r, ch, w0, w1)
        row_dot_fma(acc, xf, here and fm, a, r, ch, w0, w1)

    @T.macro
    def row_stash(red, acc, a, here, r, cc):
        """Slot a's two accumulators added, kept as row r's column cc (of 16) for `row_flush`."""
        if here:  # static: the slot's row is one of the group's
            red[T.ramp((r * 16 + cc) * 16, 1, 16)] = f32v(acc, a * AW) + f32v(acc, a * AW + 16)

    def column_totals(red, r):
        """Row r's 16 stashed columns summed over their lanes, lane c the total of column c:
        the halves, quarters, .. of `pairwise_lane_sum` taken for two, four, .. columns per
        shuffle, each column's additions the same ones in the same order."""
        v = [red[T.ramp((r * 16 + c) * 16, 1, 16)] for c in range(16)]
        width = 16
        while width > 1:
            half = width // 2
            lo = [i for blk in range(0, 16, width) for i in range(blk, blk + half)]
            hi = [i + half for i in lo]
            v = [T.Shuffle([v[2 * j], v[2 * j + 1]], lo + [16 + i for i in lo])
                 + T.Shuffle([v[2 * j], v[2 * j + 1]], hi + [16 + i for i in hi])
                 for j in range(len(v) // 2)]
            width = half
        return v[0]

    def stored(total):
        """16 fp32 totals as out_dtype lanes, a NaN as the canonical NaN (tested on the bits:
        LLVM may assume a float compare never sees a NaN)."""
        def u16(v):
            return T.broadcast(u32(v), 16)

        nan = (T.reinterpret("uint32x16", total) & u16(0x7FFFFFFF)) > u16(0x7F800000)
        return T.Cast(f"{out_dtype}x16",
                      T.Select(nan, T.reinterpret("float32x16", u16(0x7FC00000)), total))

    @T.macro
    def row_flush(y, red, tot, r, here, row, col0):
        """Row r's 16 stashed columns from col0 stored (those below N)."""
        if here:  # static
            if col0 + 16 <= y.shape[1]:
                y[row, T.ramp(col0, 1, 16)] = stored(column_totals(red, r))
            else:  # the last tile's columns past N: none stored
                tot[T.ramp(0, 1, 16)] = stored(column_totals(red, r))
                for j in range(16):
                    if col0 + j < y.shape[1]:
                        y[row, col0 + j] = tot[j]

    @T.macro
    def rows_flush(y, red, tot, nr, row0, col0):
        row_flush(y, red, tot, 0, nr > 0, row0, col0)
        row_flush(y, red, tot, 1, nr > 1, row0 + 1, col0)
        row_flush(y, red, tot, 2, nr > 2, row0 + 2, col0)
        row_flush(y, red, tot, 3, nr > 3, row0 + 3, col0)
        row_flush(y, red, tot, 4, nr > 4, row0 + 4, col0)
        row_flush(y, red, tot, 5, nr > 5, row0 + 5, col0)
        row_flush(y, red, tot, 6, nr > 6, row0 + 6, col0)
        row_flush(y, red, tot, 7, nr > 7, row0 + 7, col0)

    @T.macro
    def group_columns(weight, xs, xf, y, p, row0, nr, acc, lo_tbl, hi_tbl, red, tot):
        """The 32 columns of tile p for the nr rows from row0 (nr static: every update
        unconditional, so the accumulators stay in registers), 16 at a time."""
        for h, cc in T.grid(2, 16):
            c = T.meta_var(h * 16 + cc)
            row_zero(acc, 0, nr > 0)
            row_zero(acc, 1, nr > 1)
            row_zero(acc, 2, nr > 2)
            row_zero(acc, 3, nr > 3)
            row_zero(acc, 4, nr > 4)
            row_zero(acc, 5, nr > 5)
            row_zero(acc, 6, nr > 6)
            row_zero(acc, 7, nr > 7)
            for ch in range(NCH):
                if prefetch > 0:  # static: chunk ch of the column `prefetch` ahead
                    prefetch_line(T.address_of(weight[T.min(p * BLOCK + c + prefetch,
                                                            weight.shape[0] - i64(1)),
                                                      ch * CL]))
                col = T.meta_var(T.min(p * BLOCK + c, weight.shape[0] - i64(1)))
                codes = T.meta_var(weight.vload([col, ch * CL], f"uint8x{CL}"))
                w0 = T.meta_var(_bf16_words(codes, lo_tbl, hi_tbl, 0))
                w1 = T.meta_var(_bf16_words(codes, lo_tbl, hi_tbl, 1))
                fm = T.meta_var(by_fma(nr))
                dot_row(acc, xs, xf, fm, nr > 0, 0, 0, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 1, 1, 1, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 2, 2, 2, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 3, 3, 3, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 4, 4, 4, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 5, 5, 5, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 6, 6, 6, ch, w0, w1)
                dot_row(acc, xs, xf, fm, nr > 7, 7, 7, ch, w0, w1)
            row_stash(red, acc, 0, nr > 0, 0, cc)
            row_stash(red, acc, 1, nr > 1, 1, cc)
            row_stash(red, acc, 2, nr > 2, 2, cc)
            row_stash(red, acc, 3, nr > 3, 3, cc)
            row_stash(red, acc, 4, nr > 4, 4, cc)
            row_stash(red, acc, 5, nr > 5, 5, cc)
            row_stash(red, acc, 6, nr > 6, 6, cc)
            row_stash(red, acc, 7, nr > 7, 7, cc)
            if cc == 15:
                rows_flush(y, red, tot, nr, row0, p * BLOCK + h * 16)

    @T.macro
    def group_pairs(weight, xs, xf, y, p, row0, nr, acc, lo_tbl, hi_tbl, red, tot):
        """`group_columns` two columns at a time (nr <= PAIR_ROWS, static): each activation
        chunk loaded once for the pair (the group's activations outgrow L1 where pairs are
        taken: `pairs`), each column summed exactly as alone."""
        for h, c8 in T.grid(2, 8):
            c2 = T.meta_var(h * 8 + c8)
            row_zero(acc, 0, nr > 0)
            row_zero(acc, 1, nr > 1)
            row_zero(acc, 2, nr > 2)
            row_zero(acc, 3, nr > 3)
            row_zero(acc, 4, nr > 4)
            row_zero(acc, 5, nr > 0)
            row_zero(acc, 6, nr > 1)
            row_zero(acc, 7, nr > 2)
            row_zero(acc, 8, nr > 3)
            row_zero(acc, 9, nr > 4)
            for ch in range(NCH):
                if prefetch > 0:  # static: chunk ch of the pair `prefetch` columns ahead
                    for e in range(2):
                        prefetch_line(T.address_of(weight[T.min(
                            p * BLOCK + 2 * c2 + e + prefetch, weight.shape[0] - i64(1)),
                            ch * CL]))
                col0 = T.meta_var(T.min(p * BLOCK + 2 * c2 + 0, weight.shape[0] - i64(1)))
                codes0 = T.meta_var(weight.vload([col0, ch * CL], f"uint8x{CL}"))
                w00 = T.meta_var(_bf16_words(codes0, lo_tbl, hi_tbl, 0))
                w10 = T.meta_var(_bf16_words(codes0, lo_tbl, hi_tbl, 1))
                col1 = T.meta_var(T.min(p * BLOCK + 2 * c2 + 1, weight.shape[0] - i64(1)))
                codes1 = T.meta_var(weight.vload([col1, ch * CL], f"uint8x{CL}"))
                w01 = T.meta_var(_bf16_words(codes1, lo_tbl, hi_tbl, 0))
                w11 = T.meta_var(_bf16_words(codes1, lo_tbl, hi_tbl, 1))
                dot_row(acc, xs, xf, by_fma(nr), nr > 0, 0, 0, ch, w00, w10)
                dot_row(acc, xs, xf, by_fma(nr), nr > 0, 5, 0, ch, w01, w11)
                dot_row(acc, xs, xf, by_fma(nr), nr > 1, 1, 1, ch, w00, w10)
                dot_row(acc, xs, xf, by_fma(nr), nr > 1, 6, 1, ch, w01, w11)
                dot_row(acc, xs, xf, by_fma(nr), nr > 2, 2, 2, ch, w00, w10)
                dot_row(acc, xs, xf, by_fma(nr), nr > 2, 7, 2, ch, w01, w11)
                dot_row(acc, xs, xf, by_fma(nr), nr > 3, 3, 3, ch, w00, w10)
                dot_row(acc, xs, xf, by_fma(nr), nr > 3, 8, 3, ch, w01, w11)
                dot_row(acc, xs, xf, by_fma(nr), nr > 4, 4, 4, ch, w00, w10)
                dot_row(acc, xs, xf, by_fma(nr), nr > 4, 9, 4, ch, w01, w11)
            row_stash(red, acc, 0, nr > 0, 0, 2 * c8)
            row_stash(red, acc, 1, nr > 1, 1, 2 * c8)
            row_stash(red, acc, 2, nr > 2, 2, 2 * c8)
            row_stash(red, acc, 3, nr > 3, 3, 2 * c8)
            row_stash(red, acc, 4, nr > 4, 4, 2 * c8)
            row_stash(red, acc, 5, nr > 0, 0, 2 * c8 + 1)
            row_stash(red, acc, 6, nr > 1, 1, 2 * c8 + 1)
            row_stash(red, acc, 7, nr > 2, 2, 2 * c8 + 1)
            row_stash(red, acc, 8, nr > 3, 3, 2 * c8 + 1)
            row_stash(red, acc, 9, nr > 4, 4, 2 * c8 + 1)
            if c8 == 7:
                rows_flush(y, red, tot, nr, row0, p * BLOCK + h * 16)

    @T.macro
    def group_if(weight, xs, xf, sv, xqs, scale, y, p, row0, live, nr, acc, lo_tbl, hi_tbl,
                 red, tot):
        if nr <= rows:  # static: a group of nr rows exists
            if live == nr:
                if by_fma(nr):  # static: xf = xqs times the tile's scales (`xs` is not staged)
                    for ch, i in T.grid(NCH, 16):  # lane i's scale: 32-block 2 ch + i // 8
                        sv[ch * 16 + i] = e8m0_to_f32(T.Cast("uint32", scale[p, ch * 2 + i // 8]))
                    for r, ch, h, par in T.grid(nr, NCH, 2, 2):
                        for i in T.vectorized(16):
                            xf[r * K + ch * CL + h * 32 + par * 16 + i] = (
                                xqs[row0 + r, ch * CL + h * 32 + par * 16 + i] * sv[ch * 16 + i])
                if pairs(nr):  # static
                    group_pairs(weight, xs, xf, y, p, row0, nr, acc, lo_tbl, hi_tbl, red, tot)
                else:
                    group_columns(weight, xs, xf, y, p, row0, nr, acc, lo_tbl, hi_tbl, red,
                                  tot)

    @T.macro
    def tile(x, weight, scale, y, m, p, xq, xs, xf, sv, xqs, acc, lo_tbl, hi_tbl, red, tot):
        """Tile p (32 columns) of one matrix for every row group."""
        for g in range((m + R - i64(1)) // R):
            live = T.min(m - g * R, R)  # rows in this group (the last: fewer)
            if stages_xs(live):  # the group reads xs (by_fma: xf, in group_if)
                # slots 16 g2 .. 16 g2 + 15 of each half: 32-block 2 ch + g2
                for r, ch, h, g2 in T.grid(live, NCH, 2, 2):
                    for j in T.vectorized(16):
                        xs[r * K + ch * CL + h * 32 + g2 * 16 + j] = (
                            bf16_bits_of_exact(
                                xq[g * R + r, ch * CL + h * 32 + g2 * 16 + j]
                                * e8m0_to_f32(T.Cast("uint32",
                                                     scale[p, ch * 2 + g2]))))
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 1,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 2,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 3,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 4,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 5,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 6,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 7,
                     acc, lo_tbl, hi_tbl, red, tot)
            group_if(weight, xs, xf, sv, xqs, scale, y, p, g * R, live, 8,
                     acc, lo_tbl, hi_tbl, red, tot)

    NL = i64(norm_lanes)

    staged = norm_eps is not None or swiglu_limit is not None  # rows formed first, into xn

    def xval(x, xn, i, c):  # the activation the quantiser reads, as fp32
        return xn[i, c] if staged else bf16_to_f32(x[i, c])

    norm_row = rms_norm_row(vec=1)  # a fresh macro (see common.stages)

    @T.macro
    def normed(x, nw, xn, m):
        """xn[i] = bf16(w * (x[i] * rstd_i)) as fp32, norm.make_rms_norm's arithmetic."""
        part = T.alloc_buffer((NL,), "float32")
        ssq = T.alloc_buffer((1,), "float32")
        for i in range(m):
            norm_row(xn, lambda c, i=i: (i, c), part, ssq,
                     lambda c, i=i: bf16_to_f32(x[i, c]), nw, k, norm_eps, norm_lanes)

    @T.macro
    def body(x, xn, weight, scale, y, m, second):
        with T.attr(T.int32(0), *with_bf16_dot()):
            amax = T.alloc_buffer((m, KB), "float32")
            xq = T.alloc_buffer((m, K), "float32")  # per chunk in chunk_slot_source order
            tbl = T.alloc_buffer((256,), "uint8")  # low bytes of |code|'s bf16, then high
            e4m3_bf16_table(tbl)
            for i, b in T.grid(m, KB):
                amax[i, b] = T.min_value("float32")
                for j in range(i64(BLOCK)):
                    amax[i, b] = T.max(amax[i, b], T.fabs(xval(x, xn, i, b * BLOCK + j)))
            for i, ch in T.grid(m, NCH):
                for j in T.vectorized(i64(CL)):
                    xq[i, ch * CL + j] = fp8_qdq(
                        xval(x, xn, i, ch * CL + chunk_slot_source(j)),
                        pow2_scale_byte(amax[i, (ch * CL + chunk_slot_source(j)) // BLOCK]))
            if FMA:  # static: per 32 slots, the odd ones, then the even (`dpbf16ps_by_fma`)
                xqs = T.alloc_buffer((m, K), "float32")  # xq's fp32 halves
                for i, ch, h, par in T.grid(m, NCH, 2, 2):
                    for j in T.vectorized(16):
                        xqs[i, ch * CL + h * 32 + par * 16 + j] = xq[i, ch * CL + h * 32
                                                                     + 2 * j + 1 - par]
            else:
                xqs = T.meta_var(None)  # no group sums by FMA pairs: nothing staged
            for po in T.parallel((NT + i64(TILES - 1)) // i64(TILES)):
                xs = T.alloc_buffer((R * K,), "uint16")  # bf16 bits, row r at r * K
                if FMA:  # static
                    xf = T.alloc_buffer((R * K,), "float32")  # by_fma: xs' halves
                    sv = T.alloc_buffer((NCH * 16,), "float32")  # by_fma: the tile's scales
                else:
                    xf = T.meta_var(None)
                    sv = T.meta_var(None)
                acc = T.alloc_buffer((SLOTS * AW,), "float32")  # slot a at a * AW
                red = T.alloc_buffer((R * 256,), "float32")  # row r's column c at (16 r + c) 16
                tot = T.alloc_buffer((16,), out_dtype)  # a partial tile's stored totals
                tables = T.meta_var(table_vectors(tbl))
                lo_tbl = T.meta_var(tables[0])
                hi_tbl = T.meta_var(tables[1])
                for pi in range(i64(TILES)):
                    if po * TILES + pi < NT:
                        if second is None:  # static
                            tile(x, weight, scale, y, m, po * TILES + pi, xq, xs, xf, sv, xqs,
                                 acc, lo_tbl, hi_tbl, red, tot)
                        elif po * TILES + pi < NB:
                            tile(x, weight, scale, y, m, po * TILES + pi, xq, xs, xf, sv, xqs,
                                 acc, lo_tbl, hi_tbl, red, tot)
                        else:  # the second matrix's tile
                            tile(x, second[0], second[1], second[2], m, po * TILES + pi - NB, xq,
                                 xs, xf, sv, xqs, acc, lo_tbl, hi_tbl, red, tot)


    return Fp8GemvStages(body=body, normed=normed, n=N, k=K, kb=KB, nb=NB,
                         n2=None if pair_n is None else i64(pair_n),
                         nb2=None if pair_n is None else NB2)


def make_fp8_gemv_bf16(*, n: int, k: int, out_dtype: str = "bfloat16", prefetch: int = 0,
                       rows: int = 1, fma_rows: bool = False, norm_eps: float | None = None,
                       norm_lanes: int = 32, pair_n: int | None = None,
                       swiglu_limit: float | None = None) -> tvm.tirx.PrimFunc:
    """The CPU decode form of `fp8_linear` on x86 with AVX-512 BF16 and VBMI (same signature as
    `make_fp8_gemv`), hand-vectorised; k a multiple of 64. `prefetch`: columns ahead whose
    weights are prefetched (0: none), one line beside each chunk's load: the same chunk of the
    column `prefetch` ahead. Issued as a burst of the whole column at its start instead, a
    long row's prefetches (wo_b: 64 lines) waited on the core's fill buffers: Xeon model 207,
    2 threads, weights cycled through 600 MB, median of 300 interleaved calls, n 1024 k 4096
    0.262 -> 0.207 ms (16.0 -> 20.3 GB/s), n 5120 k 1536 0.427 -> 0.389; k 512 and 1024 the
    same; 5 rows (`rows` 6) the same or faster. The outputs are the same bits.

    Every product is exact, as in `make_fp8_gemv`: the activation is quantised per row (`xq`,
    an E4M3 value times a power of two, stored per chunk in `chunk_slot_source` order); per
    32-column tile, `xs` = xq * 2^(s - 127) with the tile's weight scales, as bf16 bits (4
    significant bits: exact while |xs| is a normal number, 2^-126 <= |xs| < 2^128); the weight
    is the E4M3 value itself, exact in bf16 (looked up, `_bf16_words`). vdpbf16ps adds each
    pair of products into fp32 lanes (a product of two bf16 is exact in fp32), rounding to
    nearest even and flushing denormal sums to zero: with |xq| >= 2^-31 (E4M3's 2^-9 times the
    smallest scale of the 1e-4 amax floor) and weights >= 2^-9, every nonzero product and
    partial sum stays normal while the weight-scale exponent s - 127 >= -86. Per column: two
    accumulators (the chunk's two word vectors) over K, then added and summed pairwise in
    lanes (halves, quarters, ..); only the order of the fp32 additions differs from the
    oracle. The lane sums are taken 16 columns at a time (`column_totals`): each column's
    16 lanes are kept, then each shuffle-and-add level pairs two vectors, halving the lanes
    of every column in both, so 16 columns cost 15 adds and 30 shuffles instead of 16 x 4
    of each, and the 16 totals are stored as one vector (the same additions in the same
    order per column: the outputs are bit for bit those of per-column sums). Measured on a
    Xeon model 207 (AMX, 2 threads, weights cycled through 8 copies, min of 60 calls): n
    32768 k 512 one row 1.08 -> 1.03 ms, 5 rows 1.72 -> 1.59; n 1024 k 4096 5 rows 0.64 ->
    0.59. A NaN weight (0x7f / 0xff, a NaN in the table) makes the column's sum NaN, stored
    as the canonical NaN.

    `fma_rows`: a group of 2 or more rows forms each vdpbf16ps as two FMAs
    (`dpbf16ps_by_fma`, bit for bit the same sums here: every product and partial sum stays
    normal, above), the chunk's decoded words split into their fp32 halves once for the
    group, each row's `xs` staged per tile as fp32 halves (`xf`: xq's halves, `xqs`, made once
    per call, times the tile's scales), column pairs where the group's activations outgrow L1
    as without: for CPUs whose vdpbf16ps issues at a quarter of their FMA rate
    (`fp8_linear_config`). Measured there (Xeon model 207, 2 threads, weights cycled through 8
    copies, min of 120 interleaved calls): n 32768 k 512, 5 rows 1.72 -> 1.38 ms (one row
    0.72); n 512 k 1024 0.080 -> 0.075; n 1024 k 4096 (column pairs) 0.435 -> 0.388 and 0.54
    -> 0.52 in a slower phase (FMA columns one at a time: 0.69, the 80 KB of fp32 activations
    out of L1); n 1024 k 2048 0.324 -> 0.250. One-row groups (decode) keep vdpbf16ps.

    `rows` > 1: the verify form, rows in groups of `rows` (the verify entry's 1 + k): per
    column each chunk is loaded and decoded once for the whole group, then dotted into each
    row's own two accumulators in the order above, so every row's output is bit-identical to
    this kernel's with rows = 1 (which is the same code with a group of one). A group whose
    activations outgrow L1 (wo_b's k 4096 at 3 to 5 rows) takes its columns two at a time
    (`PAIR_XS_BYTES`), each column's chains and sums unchanged.

    Per 64 codes and row: one load, two vpermi2b and a sign merge, two byte interleaves (shared
    by the group), two vdpbf16ps, against two vpmaddubsw, four masks, four vcvtph2ps and four
    FMAs in `make_fp8_gemv_avx2`. Measured on a 2-core Zen 4 shared with other jobs (load 8-11),
    weights cycled through 64 MB, min of 400-1000 calls, `make_fp8_gemv_avx2` lanes 16 /
    the scheduled `make_fp8_gemv` (k 4096) before this kernel in brackets: n 32768 k 512 one
    row 0.73-0.82 ms (1.71-1.76), 5 rows in one group 1.48 (3.61-3.71); n 1024 k 4096 one row
    0.27-0.33 (0.42-0.48), 5 rows 0.85-0.90 (1.59-1.67); n 512 k 1024 one row 0.039-0.041
    (0.057-0.064).

    `norm_eps` (`norm_fp8_linear`: signature (x, norm_weight, weight, scale, y)): each row of x
    is RMS-normed first, as `norm.make_rms_norm` norms it (`norm_lanes` strided partial sums of
    the squares added in lane order, rstd, bf16(w * (x * rstd))), and that bf16 row is what the
    activation quantiser reads: the rms_norm kernel and this kernel in turn, bit for bit, with
    no kernel between them.

    `pair_n` (`fp8_linear_pair`: signature (x, weight, scale, weight2, scale2, y, y2), weight2
    [pair_n, k]): two projections of one activation, quantised once; the tasks take the first
    matrix's 32-column tiles, then the second's, each tile summed exactly as alone, so y and y2
    are the two kernels' outputs bit for bit.

    `swiglu_limit` (`swiglu_fp8_linear`: signature (gate, up, weight, scale, y), gate and up
    bf16 [m, k]): the activation quantiser reads bf16(swiglu(gate, up, limit)) (`silu_times`,
    the MoE epilogue's formula), formed once per element as the rows are staged: the SwiGLU's
    elementwise kernel and this kernel in turn, with no kernel between them."""
    st = fp8_gemv_bf16_stages(n=n, k=k, out_dtype=out_dtype, prefetch=prefetch, rows=rows,
                              fma_rows=fma_rows, norm_eps=norm_eps, norm_lanes=norm_lanes,
                              pair_n=pair_n, swiglu_limit=swiglu_limit)
    N, K, KB, NB = st.n, st.k, st.kb, st.nb
    body, normed = st.body, st.normed

    if norm_eps is not None:
        @T.prim_func
        def norm_fp8_gemv_bf16(x_h: T.handle, nw: T.Buffer((K,), "bfloat16"),
                               weight: T.Buffer((N, K), "uint8"),
                               scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "norm_fp8_linear", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            xn = T.alloc_buffer((m, K), "float32")  # the normed rows (bf16 values)
            normed(x, nw, xn, m)
            body(x, xn, weight, scale, y, m, None)

        return norm_fp8_gemv_bf16

    if swiglu_limit is not None:
        @T.prim_func
        def swiglu_fp8_gemv_bf16(gate_h: T.handle, up_h: T.handle,
                                 weight: T.Buffer((N, K), "uint8"),
                                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "swiglu_fp8_linear", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            gate = T.match_buffer(gate_h, (m, K), "bfloat16")
            up = T.match_buffer(up_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            xn = T.alloc_buffer((m, K), "float32")  # the SwiGLU rows (bf16 values)
            for i, c0 in T.grid(m, K // i64(16)):
                for c1 in T.vectorized(16):
                    xn[i, c0 * 16 + c1] = round_bf16_bound(silu_times(
                        bf16_to_f32(gate[i, c0 * 16 + c1]), bf16_to_f32(up[i, c0 * 16 + c1]),
                        swiglu_limit))
            body(gate, xn, weight, scale, y, m, None)

        return swiglu_fp8_gemv_bf16

    if pair_n is not None:
        N2, NB2S = st.n2, st.nb2

        @T.prim_func
        def fp8_gemv_bf16_pair(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                               scale: T.Buffer((NB, KB), "uint8"),
                               weight2: T.Buffer((N2, K), "uint8"),
                               scale2: T.Buffer((NB2S, KB), "uint8"), y_h: T.handle,
                               y2_h: T.handle):
            T.func_attr({"global_symbol": "fp8_linear_pair", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            y2 = T.match_buffer(y2_h, (m, N2), out_dtype)
            body(x, None, weight, scale, y, m, (weight2, scale2, y2))

        return fp8_gemv_bf16_pair

    @T.prim_func
    def fp8_gemv_bf16(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                      scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        body(x, None, weight, scale, y, m, None)

    return fp8_gemv_bf16


def make_fp8_gemv_bf16_q_kv(*, n_q: int, n_kv: int, k: int, n_b: int, norm_eps: float,
                            norm_lanes: int = 32, rows: int = 1, prefetch: int = 0,
                            fma_rows: bool = False, b_prefetch: int = 0,
                            b_fma_rows: bool = False) -> tvm.tirx.PrimFunc:
    """`fp8_q_kv`'s kernel: the attention's query and KV projections in one call, (x bf16
    [m, k], wq_a [n_q, k], its scales, wkv [n_kv, k], its scales, q_norm [n_q] bf16, wq_b
    [n_b, n_q], its scales) -> (q_lora [m, n_q], kv [m, n_kv], q [m, n_b]): the paired GEMV
    (wq_a and wkv, x quantised once; `prefetch`, `fma_rows`), then q_lora RMS-normed and the
    wq_b GEMV of it (`b_prefetch`, `b_fma_rows`): the `fp8_linear_pair` and `norm_fp8_linear`
    kernels' macros in turn (`fp8_gemv_bf16_stages`), so every output is theirs bit for bit,
    one VM call instead of two (q_lora stays an output: the caller allocates it, 2 bytes per
    element of the narrow query latent). `rows`: the verify form's groups, both GEMVs."""
    pair = fp8_gemv_bf16_stages(n=n_q, k=k, prefetch=prefetch, rows=rows, fma_rows=fma_rows,
                                pair_n=n_kv)
    qb = fp8_gemv_bf16_stages(n=n_b, k=n_q, prefetch=b_prefetch, rows=rows,
                              fma_rows=b_fma_rows, norm_eps=norm_eps, norm_lanes=norm_lanes)
    NQ, NKV, K, NB_ = pair.n, pair.n2, pair.k, qb.n  # wq_a, wkv, x's width, wq_b

    @T.prim_func
    def fp8_q_kv(x_h: T.handle, wa: T.Buffer((NQ, K), "uint8"),
                 sa: T.Buffer((pair.nb, pair.kb), "uint8"), wkv: T.Buffer((NKV, K), "uint8"),
                 skv: T.Buffer((pair.nb2, pair.kb), "uint8"),
                 nw: T.Buffer((NQ,), "bfloat16"), wb: T.Buffer((NB_, NQ), "uint8"),
                 sb: T.Buffer((qb.nb, qb.kb), "uint8"), q_lora_h: T.handle, kv_h: T.handle,
                 q_h: T.handle):
        T.func_attr({"global_symbol": "fp8_q_kv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        q_lora = T.match_buffer(q_lora_h, (m, NQ), "bfloat16")
        kv = T.match_buffer(kv_h, (m, NKV), "bfloat16")
        q = T.match_buffer(q_h, (m, NB_), "bfloat16")
        pair.body(x, None, wa, sa, q_lora, m, (wkv, skv, kv))
        xn = T.alloc_buffer((m, NQ), "float32")  # the normed q_lora (bf16 values)
        qb.normed(q_lora, nw, xn, m)
        qb.body(q_lora, xn, wb, sb, q, m, None)

    return fp8_q_kv
