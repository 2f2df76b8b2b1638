"""The CPU prefill chain (the tile kernels) in two calls: `moe_gate_up_route` (route, x's QDQ,
gate/up) and `moe_down_combine(_plus)` (h's QDQ, down, combine).

Each call is one PrimFunc holding the blocks of the kernels it replaces, expanded from the same
stage macros (`route.route_tiles_stage`, `route.qdq_stage`, `experts.gate_up_tiles_stage`, ...)
and scheduled by the same steps on the same block names (`configs.schedule_moe_gate_up_route`),
so every stage runs the loops, and every row the additions, of its kernel: bit for bit the
six-call chain. What only lives inside a call (xq, hq, o) is allocated by the call (a CPU
kernel may allocate token-sized buffers; a CUDA one may not, so CUDA keeps the six calls); what
crosses from the first call to the second (row_pair, token_rows, tiles, h) stays the caller's.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec
from dsv41.schedules.common import i64
from dsv41.schedules.gemm import BLOCK
from dsv41.schedules.moe.configs import (
    MoeSplitConfig,
    schedule_moe_down_combine,
    schedule_moe_gate_up_route,
)
from dsv41.schedules.moe.experts import down_tiles_stage, gate_up_tiles_stage
from dsv41.schedules.moe.route import (
    check_dims,
    combine_stage,
    qdq_stage,
    route_tiles_stage,
    tile_count,
)


def make_moe_gate_up_route_tiles(*, dim: int, inter: int, n_experts: int, topk: int,
                                 swiglu_limit: float, row_tile: int,
                                 null_expert: bool = False) -> tvm.tirx.PrimFunc:
    """`moe_gate_up_route`: (x bf16 [n, dim], weights, ids, w1, s1, w3, s3) -> (row_pair,
    token_rows, tiles, h): `make_moe_route`'s tables (`null_expert` as there), `moe_qdq_x`'s
    activation into a buffer of its own (xq fp32 [n, dim]) and `make_moe_gate_up`'s h, in that
    order (unscheduled: `configs.schedule_moe_gate_up_route`)."""
    check_dims(dim, inter)
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    DB = i64(dim // BLOCK)
    route = route_tiles_stage(n_experts=n_experts, topk=topk, row_tile=row_tile,
                              null_expert=null_expert)
    qdq = qdq_stage(k=dim)
    gate_up = gate_up_tiles_stage(dim=dim, inter=inter, n_experts=n_experts, topk=topk,
                                  swiglu_limit=swiglu_limit, row_tile=row_tile)

    @T.prim_func(s_tir=True)
    def moe_gate_up_route(x_h: T.handle, weights_h: T.handle, ids_h: T.handle,
                          w1: T.Buffer((E, I, D // 2), "uint8"),
                          s1: T.Buffer((E, I, DB), "uint8"),
                          w3: T.Buffer((E, I, D // 2), "uint8"),
                          s3: T.Buffer((E, I, DB), "uint8"), row_pair_h: T.handle,
                          token_rows_h: T.handle, tiles_h: T.handle, h_h: T.handle):
        T.func_attr({"global_symbol": "moe_gate_up_route", "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, D), "bfloat16")
        weights = T.match_buffer(weights_h, (n, KT), "float32")
        ids = T.match_buffer(ids_h, (n, KT), "int64")
        row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        xq = T.sblock_alloc_buffer((n, D), "float32")
        route(ids, row_pair, token_rows, tiles, n)
        qdq(x, xq, n)
        gate_up(xq, weights, row_pair, tiles, w1, s1, w3, s3, h, n)

    return moe_gate_up_route


def o_bits(v):
    """What the fused down stage stores of its bf16 output: the bits (an allocated bf16 buffer
    would be held as fp32 by TVM's BF16 legalisation); the combine reads either alike."""
    return T.reinterpret("uint16", v)


def make_moe_down_combine_tiles(*, dim: int, inter: int, n_experts: int, topk: int,
                                row_tile: int, plus: bool = False) -> tvm.tirx.PrimFunc:
    """`moe_down_combine` (plus: `moe_down_combine_plus`): (h bf16 [P, inter], tiles,
    token_rows, w2, s2[, shared bf16 [n, dim]]) -> y (fp32 [n, dim]; bf16 with plus):
    `moe_qdq_h`'s hq and `make_moe_down`'s o (bf16 bits) into buffers of their own, then
    `make_moe_combine(plus=plus)`'s sums (unscheduled: `configs.schedule_moe_down_combine`)."""
    check_dims(dim, inter)
    D, I, E, KT, RT = i64(dim), i64(inter), i64(n_experts), i64(topk), i64(row_tile)
    IB = i64(inter // BLOCK)
    qdq = qdq_stage(k=inter)
    down = down_tiles_stage(dim=dim, inter=inter, n_experts=n_experts, row_tile=row_tile)
    sums = combine_stage(dim=dim, topk=topk, plus=plus)

    @T.macro
    def down_combine(h, tiles, token_rows, w2, s2, shared, y, n):
        hq = T.sblock_alloc_buffer((n * KT, I), "float32")
        o = T.sblock_alloc_buffer((n * KT, D), "uint16")
        qdq(h, hq, n * KT)
        down(hq, tiles, w2, s2, o, n * KT, o_bits)
        sums(token_rows, o, shared, y, n)

    if plus:
        @T.prim_func(s_tir=True)
        def moe_down_combine_plus(h_h: T.handle, tiles_h: T.handle, token_rows_h: T.handle,
                                  w2: T.Buffer((E, D, I // 2), "uint8"),
                                  s2: T.Buffer((E, D, IB), "uint8"), shared_h: T.handle,
                                  y_h: T.handle):
            T.func_attr({"global_symbol": "moe_down_combine_plus", "tirx.noalias": True})
            n = T.int64()
            h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
            tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            shared = T.match_buffer(shared_h, (n, D), "bfloat16")
            y = T.match_buffer(y_h, (n, D), "bfloat16")
            down_combine(h, tiles, token_rows, w2, s2, shared, y, n)

        return moe_down_combine_plus

    @T.prim_func(s_tir=True)
    def moe_down_combine(h_h: T.handle, tiles_h: T.handle, token_rows_h: T.handle,
                         w2: T.Buffer((E, D, I // 2), "uint8"),
                         s2: T.Buffer((E, D, IB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "moe_down_combine", "tirx.noalias": True})
        n = T.int64()
        h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
        tiles = T.match_buffer(tiles_h, (tile_count(n * KT, RT, E), i64(3)), "int32")
        token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
        y = T.match_buffer(y_h, (n, D), "float32")
        down_combine(h, tiles, token_rows, w2, s2, None, y, n)

    return moe_down_combine


def fused_tiles_funcs(config: MoeSplitConfig, target: TargetSpec, *, dim: int, inter: int,
                      n_experts: int, topk: int, swiglu_limit: float,
                      null_expert: bool = False) -> dict[str, tvm.tirx.PrimFunc]:
    """The two calls scheduled for `target` (CPU, `config.kind` "tiles"), by global symbol:
    `moe_gate_up_route`, `moe_down_combine` and `moe_down_combine_plus`."""
    dims = dict(dim=dim, inter=inter, n_experts=n_experts, topk=topk, row_tile=config.row_tile)
    funcs = {"moe_gate_up_route": schedule_moe_gate_up_route(make_moe_gate_up_route_tiles(
        **dims, swiglu_limit=swiglu_limit, null_expert=null_expert), config, target)}
    for plus in (False, True):
        funcs["moe_down_combine_plus" if plus else "moe_down_combine"] = \
            schedule_moe_down_combine(make_moe_down_combine_tiles(**dims, plus=plus), config,
                                      target)
    return funcs
