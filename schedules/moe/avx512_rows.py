"""The verify form of the hand-vectorised AVX-512 expert GEMVs: each routed tile's rows (the
pairs of one expert, `make_moe_route`'s cut) share every weight load and decode, and each row
keeps the decode kernel's own accumulators and order, so its h / o are bit-identical to
`make_moe_gate_up_gemv_avx512` / `make_moe_down_gemv_avx512` on that row.

Per output column of a tile, one walk along the expert's packed row (gate and up together for
w1 / w3), 16 bytes (one 32-block) per step: the block's bytes widened and looked up in the
scaled E2M1 table once (even and odd nibbles, as `avx512_gemv._fp4_block`), then for each row
of the tile the two FMAs into that row's own even / odd accumulators with its activation. A
tile has 1..row_tile rows, known only at run time: each count has its own copy of the column
loop (`rows_if`), so every accumulator update is unconditional and stays in registers. The
next columns' rows are prefetched before a column's sums, not inside them: LLVM does not keep
the accumulators in registers across a loop that holds a prefetch (it may read any memory)."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    e8m0_byte,
    fma16,
    i64,
    idx,
    pairwise_lane_sum,
    permps,
    round_bf16,
    silu_times,
    with_bf16_dot,
)
from dsv41.schedules.gemm import BLOCK
from dsv41.schedules.moe.avx512_gemv import (
    check_dot,
    init_tables,
    prefetch_row_ahead,
    stage_rows,
)
from dsv41.schedules.moe.fp4_dot import LUT_BYTES, block_sum, block_words, each_block
from dsv41.schedules.moe.route import check_dims, tile_count, to_bf16

MAX_TILE_ROWS = 4  # rows of one expert per tile the verify form takes (the decode row_tile)
# 32-column tiles per parallel task: a task's buffers are workspace allocations, which cost as
# much as one column tile's sums at the bench preset's sizes
TASK_TILES = 8


def _decoded(w, sc, c, e, a, blk, tbl, high: bool):
    """Block blk of packed row w[e, a] decoded and scaled: the low (even) or high (odd)
    nibbles through the scaled table (`avx512_gemv._fp4_block`'s operand)."""
    codes = T.Cast("uint32x16", w.vload([e, a, blk * 16], "uint8x16"))
    if high:
        codes = codes >> T.broadcast(T.uint32(4), 16)
    return permps(tbl[T.ramp(0, 1, 16)] * T.broadcast(sc[c, blk], 16), codes)


def _lane_total(acc, i, c):
    """Row i's acc[c] even and odd partial sums added, then pairwise over the 16 lanes."""
    return pairwise_lane_sum(acc[i, c, 0, T.ramp(0, 1, 16)] + acc[i, c, 1, T.ramp(0, 1, 16)],
                             16)


def _check_row_tile(row_tile: int) -> None:
    if not 1 <= row_tile <= MAX_TILE_ROWS:
        raise ValueError(f"The verify expert GEMVs take tiles of 1..{MAX_TILE_ROWS} rows; got "
                         f"row_tile={row_tile}.")


def make_moe_gate_up_rows_avx512(*, dim: int, inter: int, n_experts: int, topk: int,
                                 swiglu_limit: float, row_tile: int, dot: str = "fp32"
                                 ) -> tvm.tirx.PrimFunc:
    """`make_moe_gate_up`'s signature (xq, weights, row_pair, tiles, w1, s1, w3, s3 -> h) with
    `make_moe_gate_up_gemv_avx512`'s result per row (of the same `dot`): parallel over (tile,
    32 output columns)."""
    check_dims(dim, inter)
    _check_row_tile(row_tile)
    check_dot(dot)
    bf16 = dot == "bf16"
    nblk = dim // BLOCK
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    DH, DB, IT = i64(dim // 2), i64(dim // BLOCK), i64((inter + BLOCK - 1) // BLOCK)
    ITG = (IT + i64(TASK_TILES - 1)) // i64(TASK_TILES)  # tasks per route tile

    @T.macro
    def zero(acc, i, here):
        if here:  # static: row i is one of the tile's
            for c, p in T.grid(2, 2):
                for j in T.vectorized(16):
                    acc[i, c, p, j] = T.float32(0)

    @T.macro
    def fma_row(acc, i, here, xe, xo, row, blk, g0, g1, u0, u1):
        if here:  # static
            acc[i, 0, 0, T.ramp(0, 1, 16)] = fma16(xe[row, T.ramp(blk * 16, 1, 16)], g0,
                                                   acc[i, 0, 0, T.ramp(0, 1, 16)])
            acc[i, 0, 1, T.ramp(0, 1, 16)] = fma16(xo[row, T.ramp(blk * 16, 1, 16)], g1,
                                                   acc[i, 0, 1, T.ramp(0, 1, 16)])
            acc[i, 1, 0, T.ramp(0, 1, 16)] = fma16(xe[row, T.ramp(blk * 16, 1, 16)], u0,
                                                   acc[i, 1, 0, T.ramp(0, 1, 16)])
            acc[i, 1, 1, T.ramp(0, 1, 16)] = fma16(xo[row, T.ramp(blk * 16, 1, 16)], u1,
                                                   acc[i, 1, 1, T.ramp(0, 1, 16)])

    @T.macro
    def dot_row(acc, i, here, xb, row, blk, par, wg, wu, sc):
        if here:  # static
            acc[i, 0, par, T.ramp(0, 1, 16)] = block_sum(
                acc[i, 0, par, T.ramp(0, 1, 16)], xb[row, T.ramp(blk * 32, 1, 32)], wg,
                sc[0, blk])
            acc[i, 1, par, T.ramp(0, 1, 16)] = block_sum(
                acc[i, 1, par, T.ramp(0, 1, 16)], xb[row, T.ramp(blk * 32, 1, 32)], wu,
                sc[1, blk])

    @T.macro
    def dot_block(acc, xb, w1, w3, sc, e, a, r0, nr, lut, blk, par):
        """Block blk's gate and up words decoded once, summed into every row's par slot."""
        wg = T.meta_var(block_words(w1.vload([e, a, blk * 16], "uint8x16"), lut))
        wu = T.meta_var(block_words(w3.vload([e, a, blk * 16], "uint8x16"), lut))
        dot_row(acc, 0, nr > 0, xb, r0, blk, par, wg, wu, sc)
        dot_row(acc, 1, nr > 1, xb, r0 + 1, blk, par, wg, wu, sc)
        dot_row(acc, 2, nr > 2, xb, r0 + 2, blk, par, wg, wu, sc)
        dot_row(acc, 3, nr > 3, xb, r0 + 3, blk, par, wg, wu, sc)

    @T.macro
    def store_row(h, acc, i, here, weights, row_pair, row, a, p):
        if here:  # static
            h[row, a] = to_bf16(
                weights[idx(row_pair[row], p) // KT, idx(row_pair[row], p) % KT]
                * silu_times(round_bf16(_lane_total(acc, i, 0)),
                             round_bf16(_lane_total(acc, i, 1)), swiglu_limit))

    @T.macro
    def columns(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0, nr, col0, p, tbl,
                lut, sc, acc):
        """The tile's 32 columns from col0 for its nr (static) rows from r0."""
        for c in range(i64(BLOCK)):
            if col0 + c < I:
                a = T.meta_var(col0 + c)
                zero(acc, 0, nr > 0)
                zero(acc, 1, nr > 1)
                zero(acc, 2, nr > 2)
                zero(acc, 3, nr > 3)
                for blk in T.vectorized(DB):
                    sc[0, blk] = e8m0_byte(s1[e, a, blk])
                    sc[1, blk] = e8m0_byte(s3[e, a, blk])
                prefetch_row_ahead(w1, e, a, I, nblk)  # before the sums (module docstring)
                prefetch_row_ahead(w3, e, a, I, nblk)
                if bf16:  # static
                    each_block(nblk, dot_block, (acc, xb, w1, w3, sc, e, a, r0, nr, lut))
                else:
                    for blk in range(DB):
                        g0 = T.meta_var(_decoded(w1, sc, 0, e, a, blk, tbl, False))
                        g1 = T.meta_var(_decoded(w1, sc, 0, e, a, blk, tbl, True))
                        u0 = T.meta_var(_decoded(w3, sc, 1, e, a, blk, tbl, False))
                        u1 = T.meta_var(_decoded(w3, sc, 1, e, a, blk, tbl, True))
                        fma_row(acc, 0, nr > 0, xe, xo, r0, blk, g0, g1, u0, u1)
                        fma_row(acc, 1, nr > 1, xe, xo, r0 + 1, blk, g0, g1, u0, u1)
                        fma_row(acc, 2, nr > 2, xe, xo, r0 + 2, blk, g0, g1, u0, u1)
                        fma_row(acc, 3, nr > 3, xe, xo, r0 + 3, blk, g0, g1, u0, u1)
                store_row(h, acc, 0, nr > 0, weights, row_pair, r0, a, p)
                store_row(h, acc, 1, nr > 1, weights, row_pair, r0 + 1, a, p)
                store_row(h, acc, 2, nr > 2, weights, row_pair, r0 + 2, a, p)
                store_row(h, acc, 3, nr > 3, weights, row_pair, r0 + 3, a, p)

    @T.macro
    def rows_if(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0, live, nr, col0, p,
                tbl, lut, sc, acc):
        if nr <= row_tile:  # static: a tile of nr rows exists
            if live == nr:
                columns(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0, nr, col0, p,
                        tbl, lut, sc, acc)

    @T.prim_func
    def moe_gate_up(xq_h: T.handle, weights_h: T.handle, row_pair_h: T.handle,
                    tiles_h: T.handle, w1: T.Buffer((E, I, D // 2), "uint8"),
                    s1: T.Buffer((E, I, DB), "uint8"), w3: T.Buffer((E, I, D // 2), "uint8"),
                    s3: T.Buffer((E, I, DB), "uint8"), h_h: T.handle):
        T.func_attr({"global_symbol": "moe_gate_up", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n = T.int64()
        xq = T.match_buffer(xq_h, (n, D), "float32")
        weights = T.match_buffer(weights_h, (n, KT), "float32")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        with T.attr(T.int32(0), *with_bf16_dot()):
            # the row's activation: even and odd elements (fp32 form), or bf16 bits (bf16)
            xe = T.alloc_buffer((n * KT, DH if not bf16 else 1), "float32")
            xo = T.alloc_buffer((n * KT, DH if not bf16 else 1), "float32")
            xb = T.alloc_buffer((n * KT, D if bf16 else 1), "uint16")
            stage_rows(xe, xo, xb, lambda r, j: xq[idx(row_pair[r], n * KT) // KT, j], n * KT,
                       DH, bf16)
            for task in T.parallel(tile_count(n * KT, RT, E) * ITG):
                t = task // ITG
                live = T.Cast("int64", tiles[t, 2])  # 0: an unused tile
                if live > 0:  # buffers once per task: TASK_TILES column tiles of one route tile
                    tbl = T.alloc_buffer((16,), "float32", scope="local")
                    lut = T.alloc_buffer((LUT_BYTES,), "uint8", scope="local")
                    sc = T.alloc_buffer((2, DB), "float32", scope="local")  # the column's scales
                    acc = T.alloc_buffer((RT, 2, 2, 16), "float32", scope="local")  # row, g/u, par
                    init_tables(tbl, lut, bf16)
                    e = idx(T.Cast("int64", tiles[t, 0]), E)
                    r0 = T.Cast("int64", tiles[t, 1])
                    for ct in range(i64(TASK_TILES)):
                        if (task % ITG) * TASK_TILES + ct < IT:
                            col0 = T.meta_var(((task % ITG) * TASK_TILES + ct) * BLOCK)
                            rows_if(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0,
                                    live, 1, col0, n * KT, tbl, lut, sc, acc)
                            rows_if(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0,
                                    live, 2, col0, n * KT, tbl, lut, sc, acc)
                            rows_if(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0,
                                    live, 3, col0, n * KT, tbl, lut, sc, acc)
                            rows_if(h, xe, xo, xb, weights, row_pair, w1, s1, w3, s3, e, r0,
                                    live, 4, col0, n * KT, tbl, lut, sc, acc)

    return moe_gate_up


def make_moe_down_rows_avx512(*, dim: int, inter: int, n_experts: int, topk: int,
                              row_tile: int, dot: str = "fp32") -> tvm.tirx.PrimFunc:
    """`make_moe_down`'s signature (hq, tiles, w2, s2 -> o) with `make_moe_down_gemv_avx512`'s
    result per row, as `make_moe_gate_up_rows_avx512`."""
    check_dims(dim, inter)
    _check_row_tile(row_tile)
    check_dot(dot)
    bf16 = dot == "bf16"
    nblk = inter // BLOCK
    D, I, E, RT = i64(dim), i64(inter), i64(n_experts), i64(row_tile)
    IH, IB, DT = i64(inter // 2), i64(inter // BLOCK), i64((dim + BLOCK - 1) // BLOCK)
    DTG = (DT + i64(TASK_TILES - 1)) // i64(TASK_TILES)  # tasks per route tile

    @T.macro
    def zero(acc, i, here):
        if here:  # static
            for p in range(2):
                for j in T.vectorized(16):
                    acc[i, 0, p, j] = T.float32(0)

    @T.macro
    def fma_row(acc, i, here, xe, xo, row, blk, d0, d1):
        if here:  # static
            acc[i, 0, 0, T.ramp(0, 1, 16)] = fma16(xe[row, T.ramp(blk * 16, 1, 16)], d0,
                                                   acc[i, 0, 0, T.ramp(0, 1, 16)])
            acc[i, 0, 1, T.ramp(0, 1, 16)] = fma16(xo[row, T.ramp(blk * 16, 1, 16)], d1,
                                                   acc[i, 0, 1, T.ramp(0, 1, 16)])

    @T.macro
    def dot_row(acc, i, here, xb, row, blk, par, wd, sc):
        if here:  # static
            acc[i, 0, par, T.ramp(0, 1, 16)] = block_sum(
                acc[i, 0, par, T.ramp(0, 1, 16)], xb[row, T.ramp(blk * 32, 1, 32)], wd,
                sc[0, blk])

    @T.macro
    def dot_block(acc, xb, w2, sc, e, a, r0, nr, lut, blk, par):
        wd = T.meta_var(block_words(w2.vload([e, a, blk * 16], "uint8x16"), lut))
        dot_row(acc, 0, nr > 0, xb, r0, blk, par, wd, sc)
        dot_row(acc, 1, nr > 1, xb, r0 + 1, blk, par, wd, sc)
        dot_row(acc, 2, nr > 2, xb, r0 + 2, blk, par, wd, sc)
        dot_row(acc, 3, nr > 3, xb, r0 + 3, blk, par, wd, sc)

    @T.macro
    def store_row(o, acc, i, here, row, a):
        if here:  # static
            o[row, a] = to_bf16(_lane_total(acc, i, 0))

    @T.macro
    def columns(o, xe, xo, xb, w2, s2, e, r0, nr, col0, tbl, lut, sc, acc):
        for c in range(i64(BLOCK)):
            if col0 + c < D:
                a = T.meta_var(col0 + c)
                zero(acc, 0, nr > 0)
                zero(acc, 1, nr > 1)
                zero(acc, 2, nr > 2)
                zero(acc, 3, nr > 3)
                for blk in T.vectorized(IB):
                    sc[0, blk] = e8m0_byte(s2[e, a, blk])
                prefetch_row_ahead(w2, e, a, D, nblk)  # before the sums
                if bf16:  # static
                    each_block(nblk, dot_block, (acc, xb, w2, sc, e, a, r0, nr, lut))
                else:
                    for blk in range(IB):
                        d0 = T.meta_var(_decoded(w2, sc, 0, e, a, blk, tbl, False))
                        d1 = T.meta_var(_decoded(w2, sc, 0, e, a, blk, tbl, True))
                        fma_row(acc, 0, nr > 0, xe, xo, r0, blk, d0, d1)
                        fma_row(acc, 1, nr > 1, xe, xo, r0 + 1, blk, d0, d1)
                        fma_row(acc, 2, nr > 2, xe, xo, r0 + 2, blk, d0, d1)
                        fma_row(acc, 3, nr > 3, xe, xo, r0 + 3, blk, d0, d1)
                store_row(o, acc, 0, nr > 0, r0, a)
                store_row(o, acc, 1, nr > 1, r0 + 1, a)
                store_row(o, acc, 2, nr > 2, r0 + 2, a)
                store_row(o, acc, 3, nr > 3, r0 + 3, a)

    @T.macro
    def rows_if(o, xe, xo, xb, w2, s2, e, r0, live, nr, col0, tbl, lut, sc, acc):
        if nr <= row_tile:  # static
            if live == nr:
                columns(o, xe, xo, xb, w2, s2, e, r0, nr, col0, tbl, lut, sc, acc)

    @T.prim_func
    def moe_down(hq_h: T.handle, tiles_h: T.handle, w2: T.Buffer((E, D, I // 2), "uint8"),
                 s2: T.Buffer((E, D, IB), "uint8"), o_h: T.handle):
        T.func_attr({"global_symbol": "moe_down", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        p = T.int64()  # pairs
        hq = T.match_buffer(hq_h, (p, I), "float32")
        tiles = T.match_buffer(tiles_h, (tile_count(p, RT, E), i64(3)), "int32")
        o = T.match_buffer(o_h, (p, D), "bfloat16")
        with T.attr(T.int32(0), *with_bf16_dot()):
            xe = T.alloc_buffer((p, IH if not bf16 else 1), "float32")
            xo = T.alloc_buffer((p, IH if not bf16 else 1), "float32")
            xb = T.alloc_buffer((p, I if bf16 else 1), "uint16")
            stage_rows(xe, xo, xb, lambda r, j: hq[r, j], p, IH, bf16)
            for task in T.parallel(tile_count(p, RT, E) * DTG):
                t = task // DTG
                live = T.Cast("int64", tiles[t, 2])  # 0: an unused tile
                if live > 0:
                    tbl = T.alloc_buffer((16,), "float32", scope="local")
                    lut = T.alloc_buffer((LUT_BYTES,), "uint8", scope="local")
                    sc = T.alloc_buffer((1, IB), "float32", scope="local")
                    acc = T.alloc_buffer((RT, 1, 2, 16), "float32", scope="local")
                    init_tables(tbl, lut, bf16)
                    e = idx(T.Cast("int64", tiles[t, 0]), E)
                    r0 = T.Cast("int64", tiles[t, 1])
                    for ct in range(i64(TASK_TILES)):
                        if (task % DTG) * TASK_TILES + ct < DT:
                            col0 = T.meta_var(((task % DTG) * TASK_TILES + ct) * BLOCK)
                            rows_if(o, xe, xo, xb, w2, s2, e, r0, live, 1, col0, tbl, lut, sc,
                                    acc)
                            rows_if(o, xe, xo, xb, w2, s2, e, r0, live, 2, col0, tbl, lut, sc,
                                    acc)
                            rows_if(o, xe, xo, xb, w2, s2, e, r0, live, 3, col0, tbl, lut, sc,
                                    acc)
                            rows_if(o, xe, xo, xb, w2, s2, e, r0, live, 4, col0, tbl, lut, sc,
                                    acc)

    return moe_down
