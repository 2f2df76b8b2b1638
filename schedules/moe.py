"""`moe_experts` as a chain of PrimFuncs whose intermediates the caller allocates (CPU and CUDA).

A single-function kernel could not target CUDA: its routing tables and per-pair activations
would be sized by the token count, and a CUDA kernel cannot allocate them. Here every
token-sized buffer is an argument; Relax allocates them between the `call_tir`s that
`moe_experts_plan` lists. The chain (n tokens, P = n * topk (token, slot) pairs, NT row tiles):

1. `moe_route`     ids -> row_pair [P], token_rows [n, topk], tiles [NT, 3]. Serial and tiny (one
                   thread on CUDA): counts pairs per expert, places them sorted by expert (stable),
                   cuts each expert's run into tiles of `row_tile` rows (expert, first row, rows).
2. `moe_qdq_x`     x bf16 [n, dim] -> xq fp32: FP8 quantise-dequantise per 32, once per token.
3. `moe_gate_up`   per (tile, column block): gathered xq rows x decoded w1/w3 tiles, block-scaled
                   fp32 accumulation, h = bf16(weight * swiglu(bf16(gate), bf16(up))) -> [P, inter].
4. `moe_qdq_h`     h -> hq fp32 [P, inter] (the oracle's FP8 requantisation of the w2 input).
5. `moe_down`      per (tile, column block): hq rows x decoded w2 tile -> o = bf16 [P, dim].
6. `moe_combine`   y[i] = sum of token i's rows of o in expert-id order from 0, fp32 [n, dim].

Numerics are those of gemm.py's block-scaled GEMMs (see its module docstring): activations
carried as their exact dequantised fp32 value, 32-blocks added in K order times the weight
scale, bf16 rounding where the oracle rounds. NT = ceil(P / row_tile) + min(P, E) bounds the
tile count: each non-empty expert adds at most one partial tile, and at most min(P, E) experts
are non-empty, so decode (P = topk) launches a handful of tiles, not E.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules import gemm
from dsv41.schedules.common import (
    bf16_to_f32,
    e8m0_byte,
    f16_bits_to_f32,
    fp4_element,
    fp4_pair_f16_bits,
    fp4_to_f32_select,
    has_features,
    i64,
    idx,
    let,
    pairwise_lane_sum,
    permps,
    prefetch,
    round_bf16,
    round_bf16_bound,
    silu_times,
)
from dsv41.schedules.gemm import BLOCK

# ---- shapes shared by the kernels and the plan ---------------------------------------------


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tvm.tirx.min(a, b)


def num_tiles(pairs, row_tile: int, n_experts: int):
    """Upper bound on the row tiles for `pairs` routed pairs (int or int64 PrimExpr)."""
    return (pairs + (row_tile - 1)) // row_tile + _min(pairs, n_experts)


def _nt(p, RT, E):
    """num_tiles inside TVMScript (p an int64 var, RT/E int64 immediates)."""
    return (p + RT - i64(1)) // RT + T.min(p, E)


def _to_bf16(v):
    """fp32 -> bf16 (RNE) on the bits. A plain Cast is legalised by duplicating its operand,
    which breaks the vectoriser when the operand holds a `Let` (the SwiGLU epilogue does)."""
    bits = T.reinterpret("uint32", round_bf16_bound(v)) >> T.uint32(16)
    return T.reinterpret("bfloat16", T.Cast("uint16", bits))


def _check_dims(dim: int, inter: int) -> None:
    for what, v in (("dim", dim), ("inter", inter)):
        if v % BLOCK:
            raise ValueError(f"moe_experts needs {what} a multiple of {BLOCK}, got {v}.")


# ---- 1. routing ----------------------------------------------------------------------------


def check_expert_ids(ids, n_experts: int) -> None:
    """Host-side check before calling the chain: TVM gathers expert weights by id with no bounds
    check, so an id outside [0, n_experts) would read out of bounds. A token naming the same
    expert twice is rejected too: the oracle's `y[rows] += ...` then keeps one of the two
    contributions (last write wins), which the kernels do not reproduce."""
    t = torch.as_tensor(ids)
    if t.dim() != 2:
        raise ValueError("Expert ids must be a 2-D [tokens, k] tensor, "
                         f"got shape {tuple(t.shape)}.")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"Expert ids must be integers, got {t.dtype}.")
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= n_experts:
        raise ValueError(f"Expert ids must lie in [0, {n_experts}), got values in [{lo}, {hi}].")
    srt = torch.sort(t, dim=1).values
    if t.size(1) > 1 and bool((srt[:, 1:] == srt[:, :-1]).any()):
        raise ValueError("Each token must select distinct experts; found a repeated id in a row.")


def make_moe_route(*, n_experts: int, topk: int, row_tile: int,
                   null_expert: bool = False) -> tvm.tirx.PrimFunc:
    """ids int64 [n, topk] -> row_pair int32 [P] (sorted row -> pair q = token * topk + slot),
    token_rows int32 [n, topk] (token's sorted rows in expert-id order), tiles int32 [NT, 3]
    (expert, first sorted row, row count; unused tiles all zero). Ids are validated on the host
    (`check_expert_ids`): in range and distinct per token, except that a sharded worker sends
    the pairs routed to other workers to its null expert (weight 0, `model.moe`), which may
    repeat in a row: a repeated id takes the next rank in slot order, so every pair keeps its
    own row. `null_expert`: the last expert is that null expert (a sharded worker's stack): its
    pairs get no tiles, so the GEMMs skip them, and token_rows -1, so the combine adds exactly
    the +0.0 their zero weights gave (their rows of h and o are never written)."""
    E, KT, RT = i64(n_experts), i64(topk), i64(row_tile)
    NULL = i64(n_experts - 1) if null_expert else i64(-1)  # -1: no id is the null expert
    TILED = i64(n_experts - 1) if null_expert else E  # the experts that get tiles

    @T.prim_func(s_tir=True)
    def moe_route(ids_h: T.handle, row_pair_h: T.handle, token_rows_h: T.handle,
                  tiles_h: T.handle):
        T.func_attr({"global_symbol": "moe_route", "tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        tiles = T.match_buffer(tiles_h, (_nt(n * KT, RT, E), i64(3)), "int32")
        for _u in T.serial(i64(1)):
            with T.sblock("route"):
                T.reads(ids[0:n, 0:KT])
                T.writes(row_pair[0:n * KT], token_rows[0:n, 0:KT],
                         tiles[0:_nt(n * KT, RT, E), 0:3])
                counts = T.sblock_alloc_buffer((E,), "int32", scope="local")
                cursor = T.sblock_alloc_buffer((E,), "int32", scope="local")
                run = T.sblock_alloc_buffer((i64(2),), "int32", scope="local")
                for e in range(E):
                    counts[e] = 0
                for q in range(n * KT):
                    counts[ids[q // KT, q % KT]] += 1
                run[0] = 0
                for e in range(E):
                    cursor[e] = run[0]
                    run[0] += counts[e]
                for q in range(n * KT):
                    # place pair q at its expert's cursor; record it at its expert-order rank
                    # (a repeated id ranks in slot order: a sharded worker's null expert)
                    run[1] = 0
                    for j2 in range(KT):
                        if ids[q // KT, j2] < ids[q // KT, q % KT]:
                            run[1] += 1
                        if ids[q // KT, j2] == ids[q // KT, q % KT]:
                            if j2 < q % KT:
                                run[1] += 1
                    row_pair[cursor[ids[q // KT, q % KT]]] = T.Cast("int32", q)
                    token_rows[q // KT, T.Cast("int64", run[1])] = T.if_then_else(
                        ids[q // KT, q % KT] == NULL, T.int32(-1), cursor[ids[q // KT, q % KT]])
                    cursor[ids[q // KT, q % KT]] += 1
                for t, c in T.grid(_nt(n * KT, RT, E), i64(3)):
                    tiles[t, c] = 0
                run[0] = 0  # tiles written; cursor[e] is now the end of e's run
                for e in range(TILED):
                    for j in range((counts[e] + T.int32(row_tile - 1)) // T.int32(row_tile)):
                        tiles[T.Cast("int64", run[0]), 0] = T.Cast("int32", e)
                        tiles[T.Cast("int64", run[0]), 1] = cursor[e] - counts[e] + j * row_tile
                        tiles[T.Cast("int64", run[0]), 2] = T.min(T.int32(row_tile),
                                                                  counts[e] - j * row_tile)
                        run[0] += 1

    return moe_route


# ---- 2./4. activation FP8 quantise-dequantise ------------------------------------------------


def make_moe_qdq(*, k: int, name: str) -> tvm.tirx.PrimFunc:
    """a bf16 [m, k] -> fp32 [m, k]: the exact value e4m3(a / s) * s with the per-32 E8M0 scale
    s of `formats.torch_quant_fp8` (what the oracle's `_act_quant` feeds its GEMM)."""
    K, KB = i64(k), i64(k // BLOCK)

    @T.prim_func(s_tir=True)
    def qdq(a_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "qdq", "tirx.noalias": True})
        m = T.int64()
        a = T.match_buffer(a_h, (m, K), "bfloat16")
        out = T.match_buffer(out_h, (m, K), "float32")
        amax = T.sblock_alloc_buffer((m, KB), "float32")
        for i, b, j in T.grid(m, KB, i64(BLOCK)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb], T.fabs(bf16_to_f32(a[vi, vb * BLOCK + vj])))
        for i, j in T.grid(m, K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = gemm.fp8_qdq(bf16_to_f32(a[vi, vj]),
                                           gemm.pow2_scale_byte(amax[vi, vj // BLOCK]))

    return qdq.with_attr("global_symbol", name)


# ---- 3. gate/up GEMM + SwiGLU ----------------------------------------------------------------


def make_moe_gate_up(*, dim: int, inter: int, n_experts: int, topk: int, swiglu_limit: float,
                     row_tile: int) -> tvm.tirx.PrimFunc:
    """(xq fp32 [n, dim], weights fp32 [n, topk], row_pair [P], tiles [NT, 3], w1, s1, w3, s3)
    -> h bf16 [P, inter] at sorted rows. Blocks: `xg` gathers a tile's activation rows (rows
    past the tile read 0), `wdec` decodes the tile's w1 (c=0) / w3 (c=1) transposed, `part` is
    the dot product inside one 32-block, `acc` adds blocks in K order times the E8M0 scale,
    `h` is the SwiGLU epilogue."""
    _check_dims(dim, inter)
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    DB, B = i64(dim // BLOCK), i64(BLOCK)

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
        tiles = T.match_buffer(tiles_h, (_nt(n * KT, RT, E), i64(3)), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        xg = T.sblock_alloc_buffer((_nt(n * KT, RT, E), RT, D), "float32")
        wdec = T.sblock_alloc_buffer((_nt(n * KT, RT, E), 2, D, I), "float32")
        part = T.sblock_alloc_buffer((_nt(n * KT, RT, E), RT, 2, I, DB), "float32")
        acc = T.sblock_alloc_buffer((_nt(n * KT, RT, E), RT, 2, I), "float32")
        for t, r, k in T.grid(_nt(n * KT, RT, E), RT, D):
            with T.sblock("xg"):
                vt, vr, vk = T.axis.remap("SSS", [t, r, k])
                xg[vt, vr, vk] = T.if_then_else(
                    T.Cast("int32", vr) < tiles[vt, 2],
                    xq[idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT) // KT, vk],
                    T.float32(0))
        for t, c, k, a in T.grid(_nt(n * KT, RT, E), 2, D, I):
            with T.sblock("wdec"):
                vt, vc, vk, va = T.axis.remap("SSSS", [t, c, k, a])
                if tiles[vt, 2] > 0:
                    wdec[vt, vc, vk, va] = T.if_then_else(
                        vc == 0, fp4_element(w1[idx(tiles[vt, 0], E), va, vk // 2], vk),
                        fp4_element(w3[idx(tiles[vt, 0], E), va, vk // 2], vk))
        for t, r, c, a, b, j in T.grid(_nt(n * KT, RT, E), RT, 2, I, DB, B):
            with T.sblock("part"):
                vt, vr, vc, va, vb, vj = T.axis.remap("SSSSSR", [t, r, c, a, b, j])
                with T.init():
                    part[vt, vr, vc, va, vb] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    part[vt, vr, vc, va, vb] = part[vt, vr, vc, va, vb] + xg[
                        vt, vr, vb * B + vj] * wdec[vt, vc, vb * B + vj, va]
        for t, r, c, a, b in T.grid(_nt(n * KT, RT, E), RT, 2, I, DB):
            with T.sblock("acc"):
                vt, vr, vc, va, vb = T.axis.remap("SSSSR", [t, r, c, a, b])
                with T.init():
                    acc[vt, vr, vc, va] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    acc[vt, vr, vc, va] = acc[vt, vr, vc, va] + part[
                        vt, vr, vc, va, vb] * e8m0_byte(T.if_then_else(
                            vc == 0, s1[idx(tiles[vt, 0], E), va, vb],
                            s3[idx(tiles[vt, 0], E), va, vb]))
        for t, r, a in T.grid(_nt(n * KT, RT, E), RT, I):
            with T.sblock("h"):
                vt, vr, va = T.axis.remap("SSS", [t, r, a])
                T.reads(acc[vt, vr, 0:2, va], tiles[vt, 1:3], row_pair[0:n * KT],
                        weights[0:n, 0:KT])
                T.writes(h[0:n * KT, va])
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    h[idx(tiles[vt, 1], n * KT - vr) + vr, va] = _to_bf16(
                        weights[idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT)
                                // KT,
                                idx(row_pair[idx(tiles[vt, 1], n * KT - vr) + vr], n * KT)
                                % KT]
                        * silu_times(round_bf16(acc[vt, vr, 0, va]),
                                      round_bf16(acc[vt, vr, 1, va]), swiglu_limit))

    return moe_gate_up


# ---- 5. down GEMM ----------------------------------------------------------------------------


def make_moe_down(*, dim: int, inter: int, n_experts: int, row_tile: int) -> tvm.tirx.PrimFunc:
    """(hq fp32 [P, inter], tiles [NT, 3], w2, s2) -> o bf16 [P, dim] at sorted rows. Same
    blocks as `make_moe_gate_up` with one matrix; `o` rounds to bf16 (the oracle's fp4_linear
    output)."""
    _check_dims(dim, inter)
    D, I, E, RT = i64(dim), i64(inter), i64(n_experts), i64(row_tile)
    IB, B = i64(inter // BLOCK), i64(BLOCK)

    @T.prim_func(s_tir=True)
    def moe_down(hq_h: T.handle, tiles_h: T.handle, w2: T.Buffer((E, D, I // 2), "uint8"),
                 s2: T.Buffer((E, D, IB), "uint8"), o_h: T.handle):
        T.func_attr({"global_symbol": "moe_down", "tirx.noalias": True})
        p = T.int64()
        hq = T.match_buffer(hq_h, (p, I), "float32")
        tiles = T.match_buffer(tiles_h, (_nt(p, RT, E), i64(3)), "int32")
        o = T.match_buffer(o_h, (p, D), "bfloat16")
        xg = T.sblock_alloc_buffer((_nt(p, RT, E), RT, I), "float32")
        wdec = T.sblock_alloc_buffer((_nt(p, RT, E), I, D), "float32")
        part = T.sblock_alloc_buffer((_nt(p, RT, E), RT, D, IB), "float32")
        acc = T.sblock_alloc_buffer((_nt(p, RT, E), RT, D), "float32")
        for t, r, k in T.grid(_nt(p, RT, E), RT, I):
            with T.sblock("xg"):
                vt, vr, vk = T.axis.remap("SSS", [t, r, k])
                xg[vt, vr, vk] = T.if_then_else(T.Cast("int32", vr) < tiles[vt, 2],
                                                hq[idx(tiles[vt, 1], p - vr) + vr, vk],
                                                T.float32(0))
        for t, k, d in T.grid(_nt(p, RT, E), I, D):
            with T.sblock("wdec"):
                vt, vk, vd = T.axis.remap("SSS", [t, k, d])
                if tiles[vt, 2] > 0:
                    wdec[vt, vk, vd] = fp4_element(w2[idx(tiles[vt, 0], E), vd, vk // 2], vk)
        for t, r, d, b, j in T.grid(_nt(p, RT, E), RT, D, IB, B):
            with T.sblock("part"):
                vt, vr, vd, vb, vj = T.axis.remap("SSSSR", [t, r, d, b, j])
                with T.init():
                    part[vt, vr, vd, vb] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    part[vt, vr, vd, vb] = part[vt, vr, vd, vb] + xg[vt, vr, vb * B + vj] * wdec[
                        vt, vb * B + vj, vd]
        for t, r, d, b in T.grid(_nt(p, RT, E), RT, D, IB):
            with T.sblock("acc"):
                vt, vr, vd, vb = T.axis.remap("SSSR", [t, r, d, b])
                with T.init():
                    acc[vt, vr, vd] = T.float32(0)
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    acc[vt, vr, vd] = acc[vt, vr, vd] + part[vt, vr, vd, vb] * e8m0_byte(
                        s2[idx(tiles[vt, 0], E), vd, vb])
        for t, r, d in T.grid(_nt(p, RT, E), RT, D):
            with T.sblock("o"):
                vt, vr, vd = T.axis.remap("SSS", [t, r, d])
                T.reads(acc[vt, vr, vd], tiles[vt, 1:3])
                T.writes(o[0:p, vd])
                if T.Cast("int32", vr) < tiles[vt, 2]:
                    o[idx(tiles[vt, 1], p - vr) + vr, vd] = _to_bf16(acc[vt, vr, vd])

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


def _expert_of(ids, row_pair, vr, p, kt, e):
    """The expert of sorted row vr: ids at its pair q = row_pair[vr] (indices clamped)."""
    q = idx(row_pair[vr], p)
    return idx(ids[q // kt, q % kt], e)


def make_moe_gate_up_gemv(*, dim: int, inter: int, n_experts: int, topk: int,
                          swiglu_limit: float) -> tvm.tirx.PrimFunc:
    """(xq fp32 [n, dim], weights fp32 [n, topk], ids int64 [n, topk], row_pair [P], w1, s1,
    w3, s3) -> h bf16 [P, inter] at sorted rows, as `make_moe_gate_up` computes it. Blocks:
    `xg` (the row's activation split by parity, times 2^14), `g` / `u` (the w1 / w3 dot
    products), `h` (the SwiGLU epilogue)."""
    _check_dims(dim, inter)
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
                    xg, w1, s1, vr, va, vj, _expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, a, j in T.grid(n * KT, I, DH):
            with T.sblock("u"):
                vr, va, vj = T.axis.remap("SSR", [r, a, j])
                with T.init():
                    u[vr, va] = T.float32(0)
                u[vr, va] = u[vr, va] + _gemv_term(
                    xg, w3, s3, vr, va, vj, _expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, a in T.grid(n * KT, I):
            with T.sblock("h"):
                vr, va = T.axis.remap("SS", [r, a])
                h[vr, va] = _to_bf16(
                    weights[idx(row_pair[vr], n * KT) // KT, idx(row_pair[vr], n * KT) % KT]
                    * silu_times(round_bf16(g[vr, va]), round_bf16(u[vr, va]), swiglu_limit))

    return moe_gate_up


def make_moe_down_gemv(*, dim: int, inter: int, n_experts: int, topk: int
                       ) -> tvm.tirx.PrimFunc:
    """(hq fp32 [P, inter], ids int64 [n, topk], row_pair [P], w2, s2) -> o bf16 [P, dim] at
    sorted rows, as `make_moe_down` computes it, in the GEMV form of `make_moe_gate_up_gemv`."""
    _check_dims(dim, inter)
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
                    xg, w2, s2, vr, vd, vj, _expert_of(ids, row_pair, vr, n * KT, KT, E))
        for r, d in T.grid(n * KT, D):
            with T.sblock("o"):
                vr, vd = T.axis.remap("SS", [r, d])
                o[vr, vd] = _to_bf16(acc[vr, vd])

    return moe_down


# ---- the GEMV form hand-vectorised (AVX-512) ----------------------------------------------------
# Per output column one walk along its packed row (gate and up together), 16 bytes (one 32-block)
# per step, the block's E8M0 scale decoded for the whole row first (vectorised): the bytes
# widened to 32-bit lanes index (vpermps reads the low 4 bits of each lane: the low nibble as
# is, the high one after a shift) a 16-entry table of the E2M1 values times the block's E8M0
# scale, so the weights arrive decoded and scaled in two instructions; the even elements
# multiply-add into one 16-lane accumulator, the odd into another (every product exact: fma =
# multiply + add), added together and then pairwise over the lanes at the end. The scaled table
# is the oracle's dequantised weight (E2M1 x 2^(s - 127)), exact wherever it is finite. The next
# columns' rows are prefetched GEMV_PREFETCH columns ahead (weights stream from memory at
# decode). Only the order of the fp32 additions differs from the oracle.

GEMV_PREFETCH = 4  # columns ahead whose packed rows are prefetched


def _fma16(a, b, c):
    return T.call_llvm_pure_intrin("float32x16", "llvm.fma.v16f32", a, b, c)


@T.macro
def _fp4_block(acc, c, w, sc, e, a, xe, xo, r, blk, tbl):
    """acc[c, 0] (even elements) and acc[c, 1] (odd) += block blk of packed row w[e, a] (its
    E8M0 scale already fp32 in sc[c, blk]) times the activation row r split by parity (xe,
    xo). The scaled table and the widened bytes are written twice; LLVM computes them once."""
    acc[c, 0, T.ramp(0, 1, 16)] = _fma16(
        xe[r, T.ramp(blk * 16, 1, 16)],
        permps(tbl[T.ramp(0, 1, 16)] * T.broadcast(sc[c, blk], 16),
                T.Cast("uint32x16", w.vload([e, a, blk * 16], "uint8x16"))),
        acc[c, 0, T.ramp(0, 1, 16)])
    acc[c, 1, T.ramp(0, 1, 16)] = _fma16(
        xo[r, T.ramp(blk * 16, 1, 16)],
        permps(tbl[T.ramp(0, 1, 16)] * T.broadcast(sc[c, blk], 16),
                T.Cast("uint32x16", w.vload([e, a, blk * 16], "uint8x16"))
                >> T.broadcast(T.uint32(4), 16)),
        acc[c, 1, T.ramp(0, 1, 16)])


def _prefetch_row(w, e, a, rows, blk):
    """Prefetch the 64-byte line at block blk of row a + GEMV_PREFETCH (of `rows`)."""
    return prefetch(T.address_of(w[e, T.min(a + i64(GEMV_PREFETCH), rows - i64(1)), blk * 16]))


def _lane_total(acc, c):
    """acc[c]'s even and odd partial sums added, then pairwise over the 16 lanes."""
    return pairwise_lane_sum(acc[c, 0, T.ramp(0, 1, 16)] + acc[c, 1, T.ramp(0, 1, 16)], 16)


@T.macro
def _zero_acc(acc, n_acc):
    for c, p in T.grid(n_acc, 2):
        for j in T.vectorized(16):
            acc[c, p, j] = T.float32(0)


def make_moe_gate_up_gemv_avx512(*, dim: int, inter: int, n_experts: int, topk: int,
                                 swiglu_limit: float) -> tvm.tirx.PrimFunc:
    """`make_moe_gate_up_gemv`'s signature and result, hand-vectorised for AVX-512 (see the
    section comment; written scheduled): parallel over (sorted row, 32 output columns); per
    column the w1 and w3 rows walked together (four independent accumulators), then the SwiGLU
    epilogue. dim a multiple of 32."""
    _check_dims(dim, inter)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    DH, DB, IT = i64(dim // 2), i64(dim // BLOCK), i64((inter + BLOCK - 1) // BLOCK)

    @T.prim_func
    def moe_gate_up(xq_h: T.handle, weights_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                    w1: T.Buffer((E, I, D // 2), "uint8"), s1: T.Buffer((E, I, DB), "uint8"),
                    w3: T.Buffer((E, I, D // 2), "uint8"), s3: T.Buffer((E, I, DB), "uint8"),
                    h_h: T.handle):
        T.func_attr({"global_symbol": "moe_gate_up", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n = T.int64()
        xq = T.match_buffer(xq_h, (n, D), "float32")
        weights = T.match_buffer(weights_h, (n, KT), "float32")
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        xe = T.alloc_buffer((n * KT, DH), "float32")  # the row's activation, even elements
        xo = T.alloc_buffer((n * KT, DH), "float32")  # odd elements
        for r, j in T.grid(n * KT, DH):
            xe[r, j] = xq[idx(row_pair[r], n * KT) // KT, j * 2]
            xo[r, j] = xq[idx(row_pair[r], n * KT) // KT, j * 2 + 1]
        for task in T.parallel(n * KT * IT):
            tbl = T.alloc_buffer((16,), "float32", scope="local")
            acc = T.alloc_buffer((2, 2, 16), "float32", scope="local")  # gate, up x parity
            sc = T.alloc_buffer((2, DB), "float32", scope="local")  # the row's scales
            for i in T.unroll(16):
                tbl[i] = fp4_to_f32_select(T.Cast("uint32", i))
            r = task // IT
            e = _expert_of(ids, row_pair, r, n * KT, KT, E)
            q = idx(row_pair[r], n * KT)
            for c in range(i64(BLOCK)):
                if (task % IT) * BLOCK + c < I:
                    a = T.meta_var((task % IT) * BLOCK + c)
                    _zero_acc(acc, 2)
                    for blk in T.vectorized(DB):
                        sc[0, blk] = e8m0_byte(s1[e, a, blk])
                        sc[1, blk] = e8m0_byte(s3[e, a, blk])
                    for blk in range(DB):
                        if blk % 4 == 0:
                            _prefetch_row(w1, e, a, I, blk)
                            _prefetch_row(w3, e, a, I, blk)
                        _fp4_block(acc, 0, w1, sc, e, a, xe, xo, r, blk, tbl)
                        _fp4_block(acc, 1, w3, sc, e, a, xe, xo, r, blk, tbl)
                    h[r, a] = _to_bf16(weights[q // KT, q % KT] * silu_times(
                        round_bf16(_lane_total(acc, 0)), round_bf16(_lane_total(acc, 1)),
                        swiglu_limit))

    return moe_gate_up


def make_moe_down_gemv_avx512(*, dim: int, inter: int, n_experts: int, topk: int
                              ) -> tvm.tirx.PrimFunc:
    """`make_moe_down_gemv`'s signature and result, hand-vectorised as
    `make_moe_gate_up_gemv_avx512`."""
    _check_dims(dim, inter)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    IH, IB, DT = i64(inter // 2), i64(inter // BLOCK), i64((dim + BLOCK - 1) // BLOCK)

    @T.prim_func
    def moe_down(hq_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                 w2: T.Buffer((E, D, I // 2), "uint8"), s2: T.Buffer((E, D, IB), "uint8"),
                 o_h: T.handle):
        T.func_attr({"global_symbol": "moe_down", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        n = T.int64()
        hq = T.match_buffer(hq_h, (n * KT, I), "float32")
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        o = T.match_buffer(o_h, (n * KT, D), "bfloat16")
        xe = T.alloc_buffer((n * KT, IH), "float32")
        xo = T.alloc_buffer((n * KT, IH), "float32")
        for r, j in T.grid(n * KT, IH):
            xe[r, j] = hq[r, j * 2]
            xo[r, j] = hq[r, j * 2 + 1]
        for task in T.parallel(n * KT * DT):
            tbl = T.alloc_buffer((16,), "float32", scope="local")
            acc = T.alloc_buffer((1, 2, 16), "float32", scope="local")
            sc = T.alloc_buffer((1, IB), "float32", scope="local")
            for i in T.unroll(16):
                tbl[i] = fp4_to_f32_select(T.Cast("uint32", i))
            r = task // DT
            e = _expert_of(ids, row_pair, r, n * KT, KT, E)
            for c in range(i64(BLOCK)):
                if (task % DT) * BLOCK + c < D:
                    a = T.meta_var((task % DT) * BLOCK + c)
                    _zero_acc(acc, 1)
                    for blk in T.vectorized(IB):
                        sc[0, blk] = e8m0_byte(s2[e, a, blk])
                    for blk in range(IB):
                        if blk % 4 == 0:
                            _prefetch_row(w2, e, a, D, blk)
                        _fp4_block(acc, 0, w2, sc, e, a, xe, xo, r, blk, tbl)
                    o[r, a] = _to_bf16(_lane_total(acc, 0))

    return moe_down


# ---- 6. combine ------------------------------------------------------------------------------


def make_moe_combine(*, dim: int, topk: int) -> tvm.tirx.PrimFunc:
    """(token_rows [n, topk], o bf16 [P, dim]) -> y fp32 [n, dim]: each token's rows added in
    expert-id order starting from 0.0, as the oracle's `y[rows] += ...` per unique expert; a
    row -1 (a null-expert pair, `make_moe_route`) adds +0.0, what its zero weights gave."""
    D, KT = i64(dim), i64(topk)

    @T.prim_func(s_tir=True)
    def moe_combine(token_rows_h: T.handle, o_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "moe_combine", "tirx.noalias": True})
        n = T.int64()
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        o = T.match_buffer(o_h, (n * KT, D), "bfloat16")
        y = T.match_buffer(y_h, (n, D), "float32")
        for i, d, r in T.grid(n, D, KT):
            with T.sblock("combine"):
                vi, vd, vr = T.axis.remap("SSR", [i, d, r])
                with T.init():
                    y[vi, vd] = T.float32(0)
                y[vi, vd] = y[vi, vd] + T.if_then_else(
                    token_rows[vi, vr] >= 0, bf16_to_f32(o[idx(token_rows[vi, vr], n * KT), vd]),
                    T.float32(0))

    return moe_combine


# ---- configs and schedules -------------------------------------------------------------------


@dataclass(frozen=True)
class MoeSplitConfig:
    """Tiling of the split chain. row_tile: rows of one expert per tile (the route's cut);
    tn: output columns per parallel task (CPU) / thread block (CUDA); kind "gemv" (CPU decode):
    each routed pair's weight rows walked along K, cb columns per group. CUDA GEMMs: a
    (row_tile x tn) tile per thread block, (row_tile/rb) x (tn/cb) threads, each an rb x cb
    register tile (x2 for gate/up); per 32-block the gathered activations and the decoded weight
    tile sit in shared memory. threads: per block of the elementwise/route-free CUDA kernels."""

    row_tile: int = 16
    tn: int = 32
    rb: int = 4
    cb: int = 4
    threads: int = 128
    kind: str = "tiles"  # CPU decode: "gemv" (`make_moe_gate_up_gemv` / `make_moe_down_gemv`)
    vec: int = 16  # gemv: lanes of each partial sum (packed bytes, one 32-block)
    avx512: bool = False  # gemv: the hand-vectorised kernels (`make_moe_gate_up_gemv_avx512`)

    def __post_init__(self) -> None:
        if self.kind not in ("tiles", "gemv"):
            raise ValueError(f"MoeSplitConfig.kind is 'tiles' or 'gemv', got {self.kind!r}.")


def moe_split_config(target: TargetSpec, *, dim: int, inter: int, n_experts: int, topk: int,
                     n: int | None = None) -> MoeSplitConfig:
    """n is a hint for the token count (None: prefill); decode wants short tiles, since each
    expert then sees one or two rows."""
    decode = n is not None and n * topk <= 4 * n_experts
    if target.is_cuda:
        tn = 64 if min(dim, inter) % 64 == 0 else 32
        if decode:
            return MoeSplitConfig(row_tile=8, tn=tn, rb=1, cb=tn // 32)
        return MoeSplitConfig(row_tile=32, tn=tn, rb=4, cb=tn // 16)
    if decode:
        # one or two rows per expert: the tile kernels' [32, tn] weight decode served a single
        # row from a strided read (bench preset, one token: 2.1 ms per layer single-threaded,
        # 7.6x the chain's byte floor)
        return MoeSplitConfig(row_tile=4, tn=32, cb=4, kind="gemv",
                              avx512=has_features(target, "avx512f", "fma"))
    return MoeSplitConfig(row_tile=16, tn=32)


def _schedule_expert_gemm_cuda(sch: s_tir.Schedule, config: MoeSplitConfig, out: str) -> None:
    """blockIdx.x over tiles, blockIdx.y over column blocks; per 32-block the activation rows
    [row_tile, 32] and the decoded weight tile [(2,) 32, tn] go to shared memory, loaded by all
    threads; each thread accumulates an rb x cb (x2) register tile."""
    xg, wdec = sch.get_sblock("xg"), sch.get_sblock("wdec")
    part, acc, out_b = sch.get_sblock("part"), sch.get_sblock("acc"), sch.get_sblock(out)
    # Anchored on the epilogue (its data-dependent store defeats reverse_compute_at).
    t, r, a = sch.get_loops(out_b)
    threads = [config.row_tile // config.rb, config.tn // config.cb]
    # contiguous columns per thread (interleaving them would make compute_at's bounding box
    # of the register tile span the whole column block)
    by, tx, cn = sch.split(a, [None, threads[1], config.cb])
    ty, mr = sch.split(r, [threads[0], config.rb])
    sch.reorder(t, by, ty, tx, mr, cn)
    sch.bind(t, "blockIdx.x")
    sch.bind(by, "blockIdx.y")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.compute_at(acc, tx)
    aloops = sch.get_loops(acc)[4:]  # (mr, [c,] cn, b) below (t, by, ty, tx)
    b = aloops[-1]
    sch.reorder(b, *aloops[:-1])
    sch.compute_at(part, b)
    sch.set_scope(part, 0, "local")
    sch.set_scope(acc, 0, "local")
    ploops = sch.get_loops(part)[5:]  # (mr, [c,] cn, j) below (t, by, ty, tx, b)
    sch.reorder(ploops[-1], *ploops[:-1])
    for stage in (xg, wdec):
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, b)
        loops = sch.get_loops(stage)[5:]  # xg (r, k); wdec ([c,] k, a)
        if stage == wdec:
            # threads along k read consecutive packed bytes; rows padded by one float so the
            # transposed shared stores do not all hit one bank
            sch.reorder(*loops[:-2], loops[-1], loops[-2])
            ndim = len(sch.get(stage).writes[0].region)
            sch.storage_align(stage, 0, ndim - 2, 32, 1)
            loops = [*loops[:-2], loops[-1], loops[-2]]
        _, sty, stx = sch.split(sch.fuse(*loops), [None, *threads])
        sch.bind(sty, "threadIdx.y")
        sch.bind(stx, "threadIdx.x")
    for loop in sch.get_loops(part)[6:]:
        sch.unroll(loop)
    sch.decompose_reduction(part, sch.get_loops(part)[5])
    sch.decompose_reduction(acc, b)


def _schedule_grouped_gemm_cpu(sch: s_tir.Schedule, tn: int, wdec: str, part: str, acc: str,
                               out: str) -> None:
    """One grouped GEMM: per (tile, column block of tn) task, per 32-block decode the weight tile
    once ([(2,) 32, tn] transposed) and reuse it for the tile's rows, vectorised over columns."""
    part_b, acc_b, wdec_b = sch.get_sblock(part), sch.get_sblock(acc), sch.get_sblock(wdec)
    out_b = sch.get_sblock(out)
    # Anchored on the output block: reverse_compute_at would need the routing producer inside.
    t, r, cols = sch.get_loops(out_b)
    co, ci = sch.split(cols, [None, tn])
    sch.reorder(t, co, r, ci)
    sch.compute_at(acc_b, co)
    loops = sch.get_loops(acc_b)[2:]  # (rows, [gate/up,] columns, 32-blocks)
    b, rows, mats, cl = loops[-1], loops[0], loops[1:-2], loops[-2]
    sch.reorder(b, rows, *mats, cl)
    sch.compute_at(part_b, mats[-1] if mats else rows)
    sch.compute_at(wdec_b, b)
    pc, pj = sch.get_loops(part_b)[-2:]
    sch.reorder(pj, pc)
    sch.vectorize(pc)
    sch.vectorize(sch.get_loops(wdec_b)[-1])
    sch.vectorize(cl)
    sch.vectorize(ci)
    sch.parallel(sch.fuse(t, co))
    sch.decompose_reduction(part_b, pj)
    sch.decompose_reduction(acc_b, b)


def _schedule_expert_gemm_cpu(sch: s_tir.Schedule, config: MoeSplitConfig, out: str) -> None:
    """The grouped-GEMM schedule (per (tile, column block) task, the weight tile decoded once
    per 32-block and reused by the tile's rows), with the activation rows of each 32-block
    gathered once into a [row_tile, 32] buffer next to the decoded weights (inlined, the
    row_pair/tiles lookups would run in the innermost loop)."""
    _schedule_grouped_gemm_cpu(sch, config.tn, "wdec", "part", "acc", out)
    xg, wdec = sch.get_sblock("xg"), sch.get_sblock("wdec")
    sch.compute_at(xg, sch.get_loops(wdec)[1])  # (tile x column block, 32-block, ...)
    sch.vectorize(sch.get_loops(xg)[-1])


def _schedule_expert_gemv_cpu(sch: s_tir.Schedule, config: MoeSplitConfig, out: str,
                              sums: tuple[str, ...]) -> None:
    """The GEMV form (`make_moe_gate_up_gemv` / `make_moe_down_gemv`). Each dot product in
    `sums` is its own parallel nest over (sorted row, `tn` output columns): per group of `cb`
    columns a `vec`-lane partial sum over the packed bytes (cb independent chains sharing the
    activation loads), the lanes added pairwise (`gemm.vector_sum`). The parity split of the
    activation rows (`xg`) and the epilogue `out` are small nests of their own (one more
    parallel launch each, a few microseconds, against fusing gate and up into one nest)."""
    for name in sums:
        blk = sch.get_sblock(name)
        r, a, j = sch.get_loops(blk)
        ao, ai, ac = sch.split(a, [None, config.tn // config.cb, config.cb])
        jo, *hs = gemm.lane_split(sch, j, config.vec)
        sch.reorder(r, ao, ai, jo, ac, *hs)
        sch.fuse(r, ao)
        main, wbs = gemm.vector_sum(sch, blk, config.vec, config.cb)
        gemm.place_lane_sums(sch, main, wbs, 1, config.vec, config.cb)
        sch.parallel(sch.get_loops(main)[0])
        sch.decompose_reduction(main, sch.get_loops(main)[2])
    xg = sch.get_sblock("xg")
    r, par, j = sch.get_loops(xg)
    sch.vectorize(sch.split(j, [None, 16])[1])
    out_b = sch.get_sblock(out)
    r, a = sch.get_loops(out_b)
    ao, ai = sch.split(a, [None, 16])
    sch.parallel(sch.fuse(r, ao))
    sch.vectorize(ai)


def _finish(sch: s_tir.Schedule) -> tvm.tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_moe_gemm(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec,
                      out: str) -> tvm.tirx.PrimFunc:
    """Schedules `moe_gate_up` (out="h") or `moe_down` (out="o"). The data-dependent row
    indices of the epilogue defeat s_tir's region-cover checks, so they are off; the tests
    compare with the oracle instead."""
    sch = s_tir.Schedule(func, enable_check=False)
    if target.is_cuda:
        _schedule_expert_gemm_cuda(sch, config, out)
    else:
        _schedule_expert_gemm_cpu(sch, config, out)
    return _finish(sch)


def schedule_moe_gemv(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec,
                      out: str) -> tvm.tirx.PrimFunc:
    """Schedules `moe_gate_up_gemv` (out="h") or `moe_down_gemv` (out="o"), CPU only (CUDA
    decode keeps the tile kernels: `moe_split_config` never picks "gemv" there)."""
    if target.is_cuda:
        raise ValueError("The GEMV form of the routed experts is a CPU schedule; CUDA decode "
                         "uses the tile kernels (moe_split_config).")
    sch = s_tir.Schedule(func, enable_check=False)
    _schedule_expert_gemv_cpu(sch, config, out, ("g", "u") if out == "h" else ("acc",))
    return _finish(sch)


def schedule_moe_route(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                       ) -> tvm.tirx.PrimFunc:
    """Serial everywhere: a single thread of a single CUDA block (n * topk is small)."""
    sch = s_tir.Schedule(func)
    if target.is_cuda:
        (u,) = sch.get_loops(sch.get_sblock("route"))
        bx, tx = sch.split(u, [1, 1])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return _finish(sch)


def schedule_moe_qdq(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                     ) -> tvm.tirx.PrimFunc:
    """amax computed next to its 32 outputs: CPU parallel rows and vector lanes, CUDA one thread
    per 32-group with the amax in a register."""
    sch = s_tir.Schedule(func)
    blk, amax = sch.get_sblock("xq"), sch.get_sblock("amax")
    i, j = sch.get_loops(blk)
    jb, jj = sch.split(j, [None, BLOCK])
    sch.compute_at(amax, jb)
    if target.is_cuda:
        sch.set_scope(amax, 0, "local")
        bx, tx = sch.split(sch.fuse(i, jb), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(i)
        sch.vectorize(jj)
    return _finish(sch)


def schedule_moe_combine(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                         ) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func, enable_check=False)
    blk = sch.get_sblock("combine")
    i, d, _ = sch.get_loops(blk)
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, d), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(i)
    return _finish(sch)


# ---- the module and its call plan ------------------------------------------------------------


@dataclass(frozen=True)
class MoeBuffer:
    """One tensor of the chain: an op input, an intermediate the caller allocates, or y."""

    name: str
    shape: tuple  # ints or int64 PrimExprs of the token count n
    dtype: str


@dataclass(frozen=True)
class MoeCall:
    """One call_tir: `func` (a global symbol of the module) reads `args`, writes `outs`."""

    func: str
    args: tuple[str, ...]
    outs: tuple[str, ...]


@dataclass(frozen=True)
class MoePlan:
    """What the compiler needs to emit the chain: the op's inputs (the torch op's order), the
    intermediates to allocate, the final output `y`, and the calls in order."""

    inputs: tuple[MoeBuffer, ...]
    intermediates: tuple[MoeBuffer, ...]
    output: MoeBuffer
    calls: tuple[MoeCall, ...]

    def buffers(self) -> dict[str, MoeBuffer]:
        return {b.name: b for b in (*self.inputs, *self.intermediates, self.output)}


def moe_experts_plan(target_name: str, *, dim: int, inter: int, n_experts: int, topk: int, n,
                     n_hint: int | None = None) -> MoePlan:
    """The call_tir chain of `build_moe_experts_split(target_name, ..., n=n_hint)` for n tokens
    (an int, or an int64 tirx Var for a symbolic batch). Shapes use the same row tile as the
    module, so pass the same target and hint."""
    config = moe_split_config(get_target(target_name), dim=dim, inter=inter,
                              n_experts=n_experts, topk=topk, n=n_hint)
    p = n * topk
    nt = num_tiles(p, config.row_tile, n_experts)
    E = n_experts

    def buf(name, shape, dtype):
        return MoeBuffer(name, tuple(shape), dtype)

    inputs = (
        buf("x", (n, dim), "bfloat16"), buf("weights", (n, topk), "float32"),
        buf("ids", (n, topk), "int64"),
        buf("w1", (E, inter, dim // 2), "uint8"), buf("s1", (E, inter, dim // BLOCK), "uint8"),
        buf("w3", (E, inter, dim // 2), "uint8"), buf("s3", (E, inter, dim // BLOCK), "uint8"),
        buf("w2", (E, dim, inter // 2), "uint8"), buf("s2", (E, dim, inter // BLOCK), "uint8"),
    )
    intermediates = (
        buf("row_pair", (p,), "int32"), buf("token_rows", (n, topk), "int32"),
        buf("tiles", (nt, 3), "int32"), buf("xq", (n, dim), "float32"),
        buf("h", (p, inter), "bfloat16"), buf("hq", (p, inter), "float32"),
        buf("o", (p, dim), "bfloat16"),
    )
    # which rows each GEMM reads: the GEMV form its pairs' experts, the tiles their runs
    gate_rows, down_rows = ((("ids", "row_pair"),) * 2 if config.kind == "gemv"
                            else (("row_pair", "tiles"), ("tiles",)))
    calls = (
        MoeCall("moe_route", ("ids",), ("row_pair", "token_rows", "tiles")),
        MoeCall("moe_qdq_x", ("x",), ("xq",)),
        MoeCall("moe_gate_up", ("xq", "weights", *gate_rows, "w1", "s1", "w3", "s3"), ("h",)),
        MoeCall("moe_qdq_h", ("h",), ("hq",)),
        MoeCall("moe_down", ("hq", *down_rows, "w2", "s2"), ("o",)),
        MoeCall("moe_combine", ("token_rows", "o"), ("y",)),
    )
    return MoePlan(inputs, intermediates, buf("y", (n, dim), "float32"), calls)


def build_moe_experts_split(target_name: str, *, dim: int, inter: int, n_experts: int,
                            topk: int, swiglu_limit: float, n: int | None = None,
                            null_expert: bool = False) -> tvm.IRModule:
    """The six scheduled PrimFuncs of the chain (global symbols as in `moe_experts_plan`),
    thread-bound on CUDA, parallel/vectorised on CPU. n is the token-count hint; null_expert:
    the last expert is a sharded worker's null expert, whose pairs cost no GEMM work
    (`make_moe_route`)."""
    _check_dims(dim, inter)
    target = get_target(target_name)
    cfg = moe_split_config(target, dim=dim, inter=inter, n_experts=n_experts, topk=topk, n=n)
    funcs = {
        "moe_route": schedule_moe_route(
            make_moe_route(n_experts=n_experts, topk=topk, row_tile=cfg.row_tile,
                           null_expert=null_expert), cfg, target),
        "moe_qdq_x": schedule_moe_qdq(make_moe_qdq(k=dim, name="moe_qdq_x"), cfg, target),
        "moe_qdq_h": schedule_moe_qdq(make_moe_qdq(k=inter, name="moe_qdq_h"), cfg, target),
        "moe_combine": schedule_moe_combine(make_moe_combine(dim=dim, topk=topk), cfg, target),
    }
    if cfg.kind == "gemv" and cfg.avx512:
        funcs["moe_gate_up"] = make_moe_gate_up_gemv_avx512(
            dim=dim, inter=inter, n_experts=n_experts, topk=topk, swiglu_limit=swiglu_limit)
        funcs["moe_down"] = make_moe_down_gemv_avx512(dim=dim, inter=inter,
                                                      n_experts=n_experts, topk=topk)
    elif cfg.kind == "gemv":
        funcs["moe_gate_up"] = schedule_moe_gemv(
            make_moe_gate_up_gemv(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                                  swiglu_limit=swiglu_limit), cfg, target, "h")
        funcs["moe_down"] = schedule_moe_gemv(
            make_moe_down_gemv(dim=dim, inter=inter, n_experts=n_experts, topk=topk),
            cfg, target, "o")
    else:
        funcs["moe_gate_up"] = schedule_moe_gemm(
            make_moe_gate_up(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                             swiglu_limit=swiglu_limit, row_tile=cfg.row_tile), cfg, target, "h")
        funcs["moe_down"] = schedule_moe_gemm(
            make_moe_down(dim=dim, inter=inter, n_experts=n_experts, row_tile=cfg.row_tile),
            cfg, target, "o")
    return tvm.IRModule({tvm.ir.GlobalVar(name): f.with_attr("global_symbol", name)
                         for name, f in funcs.items()})


def emit_moe_experts(bb, plan: MoePlan, inputs: list, kernel) -> object:
    """Emit the chain into a Relax BlockBuilder `bb`: one `call_tir` per plan call (Relax
    allocates the intermediates); `inputs` are the op's nine tensor arguments as Relax
    expressions, `kernel(name)` returns the GlobalVar of the chain's PrimFunc `name` (added to
    the module once by the caller). Returns the y [n, dim] fp32 expression. The lowering of
    `dsv41::moe_experts` is this function."""
    from tvm import relax

    if len(inputs) != len(plan.inputs):
        raise ValueError(f"moe_experts takes {len(plan.inputs)} tensors, got {len(inputs)}.")
    env = {b.name: v for b, v in zip(plan.inputs, inputs, strict=True)}
    bufs = plan.buffers()
    for call in plan.calls:
        gv = kernel(call.func)
        out_ty = [relax.TensorType(bufs[o].shape, bufs[o].dtype) for o in call.outs]
        res = bb.emit(relax.call_tir(gv, [env[a] for a in call.args],
                                     out_ty if len(out_ty) > 1 else out_ty[0]))
        if len(call.outs) == 1:
            env[call.outs[0]] = res
        else:
            for i, o in enumerate(call.outs):
                env[o] = bb.emit(relax.TupleGetItem(res, i))
    return env[plan.output.name]


# ---- example inputs for tests and benchmarks ----------------------------------------------


def example_inputs_moe_experts(*, n: int, dim: int, inter: int, n_experts: int, topk: int,
                               seed: int = 0) -> list[torch.Tensor]:
    """[x, weights, ids, w1, s1, w3, s3, w2, s2] as the model routes: distinct ids per token
    drawn from a skewed distribution (some experts popular, some unused at small n), weights
    normalised per token, MXFP4 expert weights quantised from Gaussians."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g).to(torch.bfloat16)
    popularity = torch.rand(n_experts, generator=g) ** 2 + 0.05
    ids = torch.multinomial(popularity.expand(n, n_experts), topk, replacement=False,
                            generator=g).to(torch.int64)
    weights = torch.rand(n, topk, generator=g) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True) * 1.5

    def expert_weights(rows: int, cols: int):
        w = torch.randn(n_experts * rows, cols, generator=g) * cols**-0.5
        packed, scales = fmt.torch_quant_fp4_weight(w)
        return (packed.view(n_experts, rows, cols // 2),
                scales.view(n_experts, rows, cols // BLOCK))

    w1, s1 = expert_weights(inter, dim)
    w3, s3 = expert_weights(inter, dim)
    w2, s2 = expert_weights(dim, inter)
    return [x, weights, ids, w1, s1, w3, s3, w2, s2]
