"""The routed experts' GEMMs on sorted rows: gate/up + SwiGLU and down as tile GEMMs
(prefill) and as GEMVs (decode), block definitions only."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    e8m0_byte,
    f16_bits_to_f32,
    fp4_element,
    fp4_pair_f16_bits,
    i64,
    idx,
    let,
    round_bf16,
    silu_times,
)
from dsv41.schedules.gemm import BLOCK
from dsv41.schedules.moe.route import check_dims, tile_count, to_bf16

# ---- 3. gate/up GEMM + SwiGLU ----------------------------------------------------------------


def gate_up_tiles_stage(*, dim: int, inter: int, n_experts: int, topk: int,
                        swiglu_limit: float, row_tile: int):
    """A fresh macro `(xq, weights, row_pair, tiles, w1, s1, w3, s3, h, n)`:
    `make_moe_gate_up`'s blocks (that kernel's body, and the fused prefill call's last stage)."""
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    DB, B = i64(dim // BLOCK), i64(BLOCK)

    @T.macro
    def gate_up_tiles(xq, weights, row_pair, tiles, w1, s1, w3, s3, h, n):
        xg = T.sblock_alloc_buffer((tile_count(n * KT, RT, E), RT, D), "float32")
        wdec = T.sblock_alloc_buffer((tile_count(n * KT, RT, E), 2, D, I), "float32")
        part = T.sblock_alloc_buffer((tile_count(n * KT, RT, E), RT, 2, I, DB), "float32")
        acc = T.sblock_alloc_buffer((tile_count(n * KT, RT, E), RT, 2, I), "float32")
        for t, r, k in T.grid(tile_count(n * KT, RT, E), RT, D):
            with T.sblock("xg"):
                vt, vr, vk = T.axis.remap("SSS", [t, r, k])
                xg[vt, vr, vk] = T.if_then_else(
                    T.Cast("int32", vr) < tiles[vt, 2],
                    xq[idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT) // KT, vk],
                    T.float32(0))
        for t, c, k, a in T.grid(tile_count(n * KT, RT, E), 2, D, I):
            with T.sblock("wdec"):
                vt, vc, vk, va = T.axis.remap("SSSS", [t, c, k, a])
                if tiles[vt, 2] > 0:
                    wdec[vt, vc, vk, va] = T.if_then_else(
                        vc == 0, fp4_element(w1[idx(tiles[vt, 0], E), va, vk // 2], vk),
                        fp4_element(w3[idx(tiles[vt, 0], E), va, vk // 2], vk))
        for t, r, c, a, b, j in T.grid(tile_count(n * KT, RT, E), RT, 2, I, DB, B):
            with T.sblock("part"):
                vt, vr, vc, va, vb, vj = T.axis.remap("SSSSSR", [t, r, c, a, b, j])
                with T.init():
                    part[vt, vr, vc, va, vb] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    part[vt, vr, vc, va, vb] = part[vt, vr, vc, va, vb] + xg[
                        vt, vr, vb * B + vj] * wdec[vt, vc, vb * B + vj, va]
        for t, r, c, a, b in T.grid(tile_count(n * KT, RT, E), RT, 2, I, DB):
            with T.sblock("acc"):
                vt, vr, vc, va, vb = T.axis.remap("SSSSR", [t, r, c, a, b])
                with T.init():
                    acc[vt, vr, vc, va] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    acc[vt, vr, vc, va] = acc[vt, vr, vc, va] + part[
                        vt, vr, vc, va, vb] * e8m0_byte(T.if_then_else(
                            vc == 0, s1[idx(tiles[vt, 0], E), va, vb],
                            s3[idx(tiles[vt, 0], E), va, vb]))
        for t, r, a in T.grid(tile_count(n * KT, RT, E), RT, I):
            with T.sblock("h"):
                vt, vr, va = T.axis.remap("SSS", [t, r, a])
                T.reads(acc[vt, vr, 0:2, va], tiles[vt, 1:3], row_pair[0:n * KT],
                        weights[0:n, 0:KT])
                T.writes(h[0:n * KT, va])
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    h[idx(tiles[vt, 1], n * KT - vr) + vr, va] = to_bf16(
                        weights[idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT)
                                // KT,
                                idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT)
                                % KT]
                        * silu_times(round_bf16(acc[vt, vr, 0, va]),
                                      round_bf16(acc[vt, vr, 1, va]), swiglu_limit))

    return gate_up_tiles


def make_moe_gate_up(*, dim: int, inter: int, n_experts: int, topk: int, swiglu_limit: float,
                     row_tile: int) -> tvm.tirx.PrimFunc:
    """(xq fp32 [n, dim], weights fp32 [n, topk], row_pair [P], tiles [NT, 3], w1, s1, w3, s3)
    -> h bf16 [P, inter] at sorted rows. Blocks: `xg` gathers a tile's activation rows (rows
    past the tile read 0), `wdec` decodes the tile's w1 (c=0) / w3 (c=1) transposed, `part` is
    the dot product inside one 32-block, `acc` adds blocks in K order times the E8M0 scale,
    `h` is the SwiGLU epilogue."""
    check_dims(dim, inter)
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    DB = i64(dim // BLOCK)
    gate_up_tiles = gate_up_tiles_stage(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                                        swiglu_limit=swiglu_limit, row_tile=row_tile)

    @T.prim_func(s_tir=True)
    def moe_gate_up(xq_h: T.handle, weights_h: T.handle, row_pair_h: T.handle,
                    tiles_h: T.handle,
                    w1: T.Buffer((E, I, D // 2), "uint8"), s1: T.Buffer((E, I, DB), "uint8"),
                    w3: T.Buffer((E, I, D // 2), "uint8"), s3: T.Buffer((E, I, DB), "uint8"),
                    h_h: T.handle):
        T.func_attr({"global_symbol": "moe_gate_up", "tirx.noalias": True})
        n = T.int64()
        xq = T.match_buffer(xq_h, (n, D), "float32")
        weights = T.match_buffer(weights_h, (n, KT), "float32")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        gate_up_tiles(xq, weights, row_pair, tiles, w1, s1, w3, s3, h, n)

    return moe_gate_up


# ---- 5. down GEMM ----------------------------------------------------------------------------


def down_tiles_stage(*, dim: int, inter: int, n_experts: int, row_tile: int):
    """A fresh macro `(hq, tiles, w2, s2, o, p, store)`: `make_moe_down`'s blocks over p rows
    (that kernel's body, and a stage of the fused prefill call); `store(v)` is what the `o`
    block writes of the bf16 v (v itself there; its bits where o is a uint16 buffer)."""
    D, I, E, RT = i64(dim), i64(inter), i64(n_experts), i64(row_tile)
    IB, B = i64(inter // BLOCK), i64(BLOCK)

    @T.macro
    def down_tiles(hq, tiles, w2, s2, o, p, store):
        xg = T.sblock_alloc_buffer((tile_count(p, RT, E), RT, I), "float32")
        wdec = T.sblock_alloc_buffer((tile_count(p, RT, E), I, D), "float32")
        part = T.sblock_alloc_buffer((tile_count(p, RT, E), RT, D, IB), "float32")
        acc = T.sblock_alloc_buffer((tile_count(p, RT, E), RT, D), "float32")
        for t, r, k in T.grid(tile_count(p, RT, E), RT, I):
            with T.sblock("xg"):
                vt, vr, vk = T.axis.remap("SSS", [t, r, k])
                xg[vt, vr, vk] = T.if_then_else(T.Cast("int32", vr) < tiles[vt, 2],
                                                hq[idx(tiles[vt, 1], p - vr) + vr, vk],
                                                T.float32(0))
        for t, k, d in T.grid(tile_count(p, RT, E), I, D):
            with T.sblock("wdec"):
                vt, vk, vd = T.axis.remap("SSS", [t, k, d])
                if tiles[vt, 2] > 0:
                    wdec[vt, vk, vd] = fp4_element(w2[idx(tiles[vt, 0], E), vd, vk // 2], vk)
        for t, r, d, b, j in T.grid(tile_count(p, RT, E), RT, D, IB, B):
            with T.sblock("part"):
                vt, vr, vd, vb, vj = T.axis.remap("SSSSR", [t, r, d, b, j])
                with T.init():
                    part[vt, vr, vd, vb] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    part[vt, vr, vd, vb] = part[vt, vr, vd, vb] + xg[vt, vr, vb * B + vj] * wdec[
                        vt, vb * B + vj, vd]
        for t, r, d, b in T.grid(tile_count(p, RT, E), RT, D, IB):
            with T.sblock("acc"):
                vt, vr, vd, vb = T.axis.remap("SSSR", [t, r, d, b])
                with T.init():
                    acc[vt, vr, vd] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    acc[vt, vr, vd] = acc[vt, vr, vd] + part[vt, vr, vd, vb] * e8m0_byte(
                        s2[idx(tiles[vt, 0], E), vd, vb])
        for t, r, d in T.grid(tile_count(p, RT, E), RT, D):
            with T.sblock("o"):
                vt, vr, vd = T.axis.remap("SSS", [t, r, d])
                T.reads(acc[vt, vr, vd], tiles[vt, 1:3])
                T.writes(o[0:p, vd])
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    o[idx(tiles[vt, 1], p - vr) + vr, vd] = store(to_bf16(acc[vt, vr, vd]))

    return down_tiles


def make_moe_down(*, dim: int, inter: int, n_experts: int, row_tile: int) -> tvm.tirx.PrimFunc:
    """(hq fp32 [P, inter], tiles [NT, 3], w2, s2) -> o bf16 [P, dim] at sorted rows. Same
    blocks as `make_moe_gate_up` with one matrix; `o` rounds to bf16 (the oracle's fp4_linear
    output)."""
    check_dims(dim, inter)
    D, I, E, RT = i64(dim), i64(inter), i64(n_experts), i64(row_tile)
    IB = i64(inter // BLOCK)
    down_tiles = down_tiles_stage(dim=dim, inter=inter, n_experts=n_experts, row_tile=row_tile)

    @T.prim_func(s_tir=True)
    def moe_down(hq_h: T.handle, tiles_h: T.handle, w2: T.Buffer((E, D, I // 2), "uint8"),
                 s2: T.Buffer((E, D, IB), "uint8"), o_h: T.handle):
        T.func_attr({"global_symbol": "moe_down", "tirx.noalias": True})
        p = T.int64()
        hq = T.match_buffer(hq_h, (p, I), "float32")
        tiles = T.match_buffer(tiles_h, (tile_count(p, RT, E), i64(3)), "int32")
        o = T.match_buffer(o_h, (p, D), "bfloat16")
        down_tiles(hq, tiles, w2, s2, o, p, lambda v: v)

    return moe_down


# ---- 3./5. the decode form: one dot product per (pair, output) ------------------------------
#
# At decode each expert sees one or two rows, so the tile kernels above decode a whole weight
# tile for a single row, reading it across output columns (a strided gather of packed bytes).
# The GEMV form walks each routed pair's weight rows along K instead: per sorted row rho (pair
# q = row_pair[rho], expert ids[q]) and output column, a 16-lane partial sum over the packed
# bytes, each byte's two elements against the activation split by parity (xg[rho, parity, j] =
# xq[., 2j + parity] * 2^14), the weight scale applied per 32-block, the lanes added pairwise
# at the end. Every product is exact (E4M3 activation x E2M1 weight x powers of two), as in
# the tile kernels; only the order of the fp32 additions differs from the oracle (all of K at
# once rather than per-block partials), the same kind of difference as gemm.make_fp8_gemv.
# The outputs land at the same sorted rows, so route, qdq_h and combine are unchanged.


def _gemv_term(xg, w, s, vr, va, vj, expert):
    """Byte j of weight row va of `expert` against sorted row vr: (x_even * w_lo + x_odd *
    w_hi) * scale (both products exact; the 2^14 of the fp16 decode is in xg)."""
    def pair(byte):
        lo, hi = fp4_pair_f16_bits(byte)
        return xg[vr, 0, vj] * f16_bits_to_f32(lo) + xg[vr, 1, vj] * f16_bits_to_f32(hi)

    return let(w[expert, va, vj], pair, "wb") * e8m0_byte(s[expert, va, vj // i64(BLOCK // 2)])


def expert_of(ids, row_pair, vr, p, kt, e):
    """The expert of sorted row vr: ids at its pair q = row_pair[vr] (indices clamped)."""
    q = idx(row_pair[vr], p)
    return idx(ids[q // kt, q % kt], e)


def make_moe_gate_up_gemv(*, dim: int, inter: int, n_experts: int, topk: int,
                          swiglu_limit: float) -> tvm.tirx.PrimFunc:
    """(xq fp32 [n, dim], weights fp32 [n, topk], ids int64 [n, topk], row_pair [P], w1, s1,
    w3, s3) -> h bf16 [P, inter] at sorted rows, as `make_moe_gate_up` computes it. Blocks:
    `xg` (the row's activation split by parity, times 2^14), `g` / `u` (the w1 / w3 dot
    products), `h` (the SwiGLU epilogue)."""
    check_dims(dim, inter)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    DH, DB = i64(dim // 2), i64(dim // BLOCK)

    @T.prim_func(s_tir=True)
    def moe_gate_up(xq_h: T.handle, weights_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                    w1: T.Buffer((E, I, D // 2), "uint8"), s1: T.Buffer((E, I, DB), "uint8"),
                    w3: T.Buffer((E, I, D // 2), "uint8"), s3: T.Buffer((E, I, DB), "uint8"),
                    h_h: T.handle):
        T.func_attr({"global_symbol": "moe_gate_up", "tirx.noalias": True})
        n = T.int64()
        xq = T.match_buffer(xq_h, (n, D), "float32")
        weights = T.match_buffer(weights_h, (n, KT), "float32")
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        xg = T.sblock_alloc_buffer((n * KT, 2, DH), "float32")
        g = T.sblock_alloc_buffer((n * KT, I), "float32")
        u = T.sblock_alloc_buffer((n * KT, I), "float32")
        for r, par, j in T.grid(n * KT, 2, DH):
            with T.sblock("xg"):
                vr, vp, vj = T.axis.remap("SSS", [r, par, j])
                xg[vr, vp, vj] = xq[idx(row_pair[vr], n * KT) // KT, vj * 2 + vp] * T.float32(
                    16384.0)
        for r, a, j in T.grid(n * KT, I, DH):
            with T.sblock("g"):
                vr, va, vj = T.axis.remap("SSR", [r, a, j])
                with T.init():
                    g[vr, va] = T.float32(0)
                g[vr, va] = g[vr, va] + _gemv_term(
                    xg, w1, s1, vr, va, vj, expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, a, j in T.grid(n * KT, I, DH):
            with T.sblock("u"):
                vr, va, vj = T.axis.remap("SSR", [r, a, j])
                with T.init():
                    u[vr, va] = T.float32(0)
                u[vr, va] = u[vr, va] + _gemv_term(
                    xg, w3, s3, vr, va, vj, expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, a in T.grid(n * KT, I):
            with T.sblock("h"):
                vr, va = T.axis.remap("SS", [r, a])
                h[vr, va] = to_bf16(
                    weights[idx(row_pair[vr], n * KT) // KT, idx(row_pair[vr], n * KT) % KT]
                    * silu_times(round_bf16(g[vr, va]), round_bf16(u[vr, va]), swiglu_limit))

    return moe_gate_up


def make_moe_down_gemv(*, dim: int, inter: int, n_experts: int, topk: int
                       ) -> tvm.tirx.PrimFunc:
    """(hq fp32 [P, inter], ids int64 [n, topk], row_pair [P], w2, s2) -> o bf16 [P, dim] at
    sorted rows, as `make_moe_down` computes it, in the GEMV form of `make_moe_gate_up_gemv`."""
    check_dims(dim, inter)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    IH, IB = i64(inter // 2), i64(inter // BLOCK)

    @T.prim_func(s_tir=True)
    def moe_down(hq_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                 w2: T.Buffer((E, D, I // 2), "uint8"), s2: T.Buffer((E, D, IB), "uint8"),
                 o_h: T.handle):
        T.func_attr({"global_symbol": "moe_down", "tirx.noalias": True})
        n = T.int64()
        hq = T.match_buffer(hq_h, (n * KT, I), "float32")
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        o = T.match_buffer(o_h, (n * KT, D), "bfloat16")
        xg = T.sblock_alloc_buffer((n * KT, 2, IH), "float32")
        acc = T.sblock_alloc_buffer((n * KT, D), "float32")
        for r, par, j in T.grid(n * KT, 2, IH):
            with T.sblock("xg"):
                vr, vp, vj = T.axis.remap("SSS", [r, par, j])
                xg[vr, vp, vj] = hq[vr, vj * 2 + vp] * T.float32(16384.0)
        for r, d, j in T.grid(n * KT, D, IH):
            with T.sblock("acc"):
                vr, vd, vj = T.axis.remap("SSR", [r, d, j])
                with T.init():
                    acc[vr, vd] = T.float32(0)
                acc[vr, vd] = acc[vr, vd] + _gemv_term(
                    xg, w2, s2, vr, vd, vj, expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, d in T.grid(n * KT, D):
            with T.sblock("o"):
                vr, vd = T.axis.remap("SS", [r, d])
                o[vr, vd] = to_bf16(acc[vr, vd])

    return moe_down
