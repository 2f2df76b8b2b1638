"""The MoE chain's non-GEMM stages: the expert-sorted route (row tiles per expert), the
activation QDQ, and the combine; plus the tile-count shapes they share with the plan."""

from __future__ import annotations

import torch
import tvm
from tvm.script import tirx as T

from dsv41.schedules import gemm
from dsv41.schedules.common import (
    bf16_of,
    bf16_to_f32,
    i64,
    idx,
    round_bf16_bound,
)
from dsv41.schedules.common.stages import block_amax
from dsv41.schedules.gemm import BLOCK

# ---- shapes shared by the kernels and the plan ---------------------------------------------


def _min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tvm.tirx.min(a, b)


def num_tiles(pairs, row_tile: int, n_experts: int):
    """Upper bound on the row tiles for `pairs` routed pairs (int or int64 PrimExpr)."""
    return (pairs + (row_tile - 1)) // row_tile + _min(pairs, n_experts)


def tile_count(p, RT, E):
    """num_tiles inside TVMScript (p an int64 var, RT/E int64 immediates)."""
    return (p + RT - i64(1)) // RT + T.min(p, E)


def to_bf16(v):
    """fp32 -> bf16 (RNE) on the bits. A plain Cast is legalised by duplicating its operand,
    which breaks the vectoriser when the operand holds a `Let` (the SwiGLU epilogue does)."""
    bits = T.reinterpret("uint32", round_bf16_bound(v)) >> T.uint32(16)
    return T.reinterpret("bfloat16", T.Cast("uint16", bits))


def check_dims(dim: int, inter: int) -> None:
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


@T.macro
def route_pairs(ids, row_pair, token_rows, counts, cursor, run, p, KT, E, NULL):
    """The pairs sorted by expert (`make_moe_route`'s row_pair and token_rows, p = n * topk
    pairs): counts[e] the pairs of expert e, cursor[e] then the end of e's run, run[0..1]
    scratch. NULL: the null expert's id (token_rows -1), or -1 for none."""
    for e in range(E):
        counts[e] = 0
    for q in range(p):
        counts[ids[q // KT, q % KT]] += 1
    run[0] = 0
    for e in range(E):
        cursor[e] = run[0]
        run[0] += counts[e]
    for q in range(p):
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


def route_tiles_stage(*, n_experts: int, topk: int, row_tile: int, null_expert: bool = False):
    """A fresh macro `(ids, row_pair, token_rows, tiles, n)`: `make_moe_route`'s one serial
    block `route` (that kernel's body, and the fused prefill call's first stage). Fresh per
    kernel: TVM suffixes the block names of a macro's later expansions (`common.stages`)."""
    E, KT, RT = i64(n_experts), i64(topk), i64(row_tile)
    NULL = i64(n_experts - 1) if null_expert else i64(-1)  # -1: no id is the null expert
    TILED = i64(n_experts - 1) if null_expert else E  # the experts that get tiles

    @T.macro
    def route_tiles(ids, row_pair, token_rows, tiles, n):
        for _u in T.serial(i64(1)):
            with T.sblock("route"):
                T.reads(ids[0:n, 0:KT])
                T.writes(row_pair[0:n * KT], token_rows[0:n, 0:KT],
                         tiles[0:tile_count(n * KT, RT, E), 0:3])
                counts = T.sblock_alloc_buffer((E,), "int32", scope="local")
                cursor = T.sblock_alloc_buffer((E,), "int32", scope="local")
                run = T.sblock_alloc_buffer((i64(2),), "int32", scope="local")
                route_pairs(ids, row_pair, token_rows, counts, cursor, run, n * KT, KT, E, NULL)
                for t, c in T.grid(tile_count(n * KT, RT, E), i64(3)):
                    tiles[t, c] = 0
                run[0] = 0  # tiles written; cursor[e] is now the end of e's run
                for e in range(TILED):
                    for j in range((counts[e] + T.int32(row_tile - 1)) // T.int32(row_tile)):
                        tiles[T.Cast("int64", run[0]), 0] = T.Cast("int32", e)
                        tiles[T.Cast("int64", run[0]), 1] = cursor[e] - counts[e] + j * row_tile
                        tiles[T.Cast("int64", run[0]), 2] = T.min(T.int32(row_tile),
                                                                  counts[e] - j * row_tile)
                        run[0] += 1

    return route_tiles


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
    route_tiles = route_tiles_stage(n_experts=n_experts, topk=topk, row_tile=row_tile,
                                    null_expert=null_expert)

    @T.prim_func(s_tir=True)
    def moe_route(ids_h: T.handle, row_pair_h: T.handle, token_rows_h: T.handle,
                  tiles_h: T.handle):
        T.func_attr({"global_symbol": "moe_route", "tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
        route_tiles(ids, row_pair, token_rows, tiles, n)

    return moe_route


# ---- 2./4. activation FP8 quantise-dequantise ------------------------------------------------


def qdq_stage(*, k: int):
    """A fresh macro `(a, out, m)`: `make_moe_qdq`'s blocks `amax` and `xq` over m rows of k
    (that kernel's body, and a stage of the fused prefill calls)."""
    K, KB = i64(k), i64(k // BLOCK)
    amax_stage = block_amax()  # a fresh macro per kernel (see common.stages)

    @T.macro
    def qdq_rows(a, out, m):
        amax = T.sblock_alloc_buffer((m, KB), "float32")
        amax_stage(amax, a, m, KB, BLOCK, gemm.bf16_value)
        for i, j in T.grid(m, K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = gemm.fp8_qdq(bf16_to_f32(a[vi, vj]),
                                           gemm.pow2_scale_byte(amax[vi, vj // BLOCK]))

    return qdq_rows


def make_moe_qdq(*, k: int, name: str) -> tvm.tirx.PrimFunc:
    """a bf16 [m, k] -> fp32 [m, k]: the exact value e4m3(a / s) * s with the per-32 E8M0 scale
    s of `formats.torch_quant_fp8` (what the oracle's `_act_quant` feeds its GEMM)."""
    K = i64(k)
    qdq_rows = qdq_stage(k=k)

    @T.prim_func(s_tir=True)
    def qdq(a_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "qdq", "tirx.noalias": True})
        m = T.int64()
        a = T.match_buffer(a_h, (m, K), "bfloat16")
        out = T.match_buffer(out_h, (m, K), "float32")
        qdq_rows(a, out, m)

    return qdq.with_attr("global_symbol", name)


# ---- 6. combine ------------------------------------------------------------------------------


def combine_term(token_rows, o, p, i, d, r):
    """Token i's r-th row of o (p rows) at column d as fp32, +0.0 for a null-expert pair."""
    return T.if_then_else(token_rows[i, r] >= 0, bf16_to_f32(o[idx(token_rows[i, r], p), d]),
                          T.float32(0))


@T.macro
def combine_rows(y, token_rows, o, shared, n, D, KT, plus):
    """`make_moe_combine(plus=plus)`'s result in plain loops (for a kernel that has o in hand):
    tokens in parallel; per token and 16 columns, its rows added in expert-id order from 0.0,
    then (plus) the shared output added and rounded to bf16 once."""
    for i in T.parallel(n):
        acc = T.alloc_buffer((16,), "float32", scope="local")
        for dc in range(D // i64(16)):
            for j in T.vectorized(16):
                acc[j] = T.float32(0)
            for r in range(KT):
                for j in T.vectorized(16):
                    acc[j] = acc[j] + combine_term(token_rows, o, n * KT, i, dc * 16 + j, r)
            for j in T.vectorized(16):
                if plus:  # static
                    y[i, dc * 16 + j] = bf16_of(acc[j] + bf16_to_f32(shared[i, dc * 16 + j]))
                else:
                    y[i, dc * 16 + j] = acc[j]


def combine_stage(*, dim: int, topk: int, plus: bool = False):
    """A fresh macro `(token_rows, o, shared, y, n)`: `make_moe_combine(plus=plus)`'s blocks
    (`combine`, and with plus its fp32 sums `acc` and the block `plus`; shared unused
    without), that kernel's body and the fused prefill call's last stage."""
    D, KT = i64(dim), i64(topk)

    @T.macro
    def combine_plus(token_rows, o, shared, y, n):
        acc = T.sblock_alloc_buffer((n, D), "float32")
        for i, d, r in T.grid(n, D, KT):
            with T.sblock("combine"):
                vi, vd, vr = T.axis.remap("SSR", [i, d, r])
                with T.init():
                    acc[vi, vd] = T.float32(0)
                acc[vi, vd] = acc[vi, vd] + combine_term(token_rows, o, n * KT, vi, vd, vr)
        for i, d in T.grid(n, D):
            with T.sblock("plus"):
                vi, vd = T.axis.remap("SS", [i, d])
                y[vi, vd] = bf16_of(acc[vi, vd] + bf16_to_f32(shared[vi, vd]))

    @T.macro
    def combine(token_rows, o, shared, y, n):
        for i, d, r in T.grid(n, D, KT):
            with T.sblock("combine"):
                vi, vd, vr = T.axis.remap("SSR", [i, d, r])
                with T.init():
                    y[vi, vd] = T.float32(0)
                y[vi, vd] = y[vi, vd] + combine_term(token_rows, o, n * KT, vi, vd, vr)

    return combine_plus if plus else combine


def make_moe_combine(*, dim: int, topk: int, plus: bool = False) -> tvm.tirx.PrimFunc:
    """(token_rows [n, topk], o bf16 [P, dim]) -> y fp32 [n, dim]: each token's rows added in
    expert-id order starting from 0.0, as the oracle's `y[rows] += ...` per unique expert; a
    row -1 (a null-expert pair, `make_moe_route`) adds +0.0, what its zero weights gave.

    `plus` (`moe_combine_plus`): (token_rows, o, shared bf16 [n, dim]) -> y bf16: the same sum,
    plus the shared expert's output, rounded to bf16 once (`common.bf16_of`): the graph's
    `(routed + shared).to(bf16)` in the kernel, instead of an fp32 y and a kernel after it."""
    D, KT = i64(dim), i64(topk)
    sums = combine_stage(dim=dim, topk=topk, plus=plus)

    if plus:
        @T.prim_func(s_tir=True)
        def moe_combine_plus(token_rows_h: T.handle, o_h: T.handle, shared_h: T.handle,
                             y_h: T.handle):
            T.func_attr({"global_symbol": "moe_combine_plus", "tirx.noalias": True})
            n = T.int64()
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            o = T.match_buffer(o_h, (n * KT, D), "bfloat16")
            shared = T.match_buffer(shared_h, (n, D), "bfloat16")
            y = T.match_buffer(y_h, (n, D), "bfloat16")
            sums(token_rows, o, shared, y, n)

        return moe_combine_plus

    @T.prim_func(s_tir=True)
    def moe_combine(token_rows_h: T.handle, o_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "moe_combine", "tirx.noalias": True})
        n = T.int64()
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        o = T.match_buffer(o_h, (n * KT, D), "bfloat16")
        y = T.match_buffer(y_h, (n, D), "float32")
        sums(token_rows, o, None, y, n)

    return moe_combine
