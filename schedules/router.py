"""The MoE router's top-k as one kernel (oracle: `dsv41::route_topk`, graph/ops.py).

`route_topk(scores, bias) -> (weights, ids)`: scores fp32 [n, E] (the gate's activated scores),
bias fp32 [E] (or [n, E]: per-row, the image-span rows' bias); per row, ids int64 [n, k] are the
k largest of scores + bias in `stable_topk`'s order (value descending, NaN above everything,
-0 equal to +0, ties to the lower expert), weights fp32 [n, k] the unbiased scores at those ids,
divided by their sum + 1e-20 when `normalize` and k > 1, then times `route_scale`.

In place of the six generic kernels TVM made of the oracle (the bias add, a stable argsort of
all E experts, the slice, the gather, the sum, the normalisation): k passes over the row, each
picking the largest item after the previous pick in that order (no sort, no scratch). The
weight arithmetic is the oracle's, operation for operation, with the k weights summed in order
from the first pick (TVM's sum did the same; torch's own reduction order may differ by an
ulp of the sum: the tests' tolerance).

Layout: one block per row; CPU: rows in parallel; CUDA: one thread per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common.rows import schedule_block_rows


def _check(*, e: int, k: int) -> None:
    if e <= 0 or not 0 < k <= e:
        raise ValueError(f"route_topk needs 0 < k <= e; got e={e}, k={k}.")


def order_key(v):
    """fp32 -> uint32 whose unsigned order is `stable_topk`'s value order: NaN (any sign) above
    +inf, -0 equal to +0, the rest by value."""
    u = T.reinterpret("uint32", v)
    u = T.Select(u == T.uint32(0x80000000), T.uint32(0), u)
    nan = (u & T.uint32(0x7FFFFFFF)) > T.uint32(0x7F800000)
    ordered = T.Select(u >= T.uint32(0x80000000), ~u, u | T.uint32(0x80000000))
    return T.Select(nan, T.uint32(0xFFFFFFFF), ordered)


def sqrt_softplus(z):
    """sqrt(softplus(z)) as the compiled graph computed the router's scores before this kernel
    took them over (TVM's softplus legalisation: z above 20 as is, else log(1 + exp(z)))."""
    return T.sqrt(T.Select(T.float32(20.0) < z, z, T.log(T.float32(1.0) + T.exp(z))))


@dataclass(frozen=True)
class TopkRouting:
    """What `route_topk` computes (`make_route_topk`'s arguments): e experts, k picks,
    `normalize`, `route_scale`, bias per row (`bias_rows`), and gate_temp for the logits form
    (`route_topk_logits`). `bias_select`: the bias is the triple (mask [n, 1] bool, bias_vl
    [E], bias [E]) and row r's is bias_vl where mask[r] else bias: the image-span rows' bias
    (`torch.where(vl_mask, bias_vl, bias)`, the elementwise kernel before the router) picked
    as the row is routed."""

    e: int
    k: int
    normalize: bool
    route_scale: float
    bias_rows: bool = False
    gate_temp: float | None = None
    bias_select: bool = False

    def __post_init__(self) -> None:
        if self.bias_rows and self.bias_select:
            raise ValueError("The router takes a bias per row or a selected one, not both.")


def route_topk_row(r: TopkRouting):
    """A macro: row vr's ids and weights (`make_route_topk`'s per-row arithmetic), for that
    kernel's row block and for a kernel that routes its own tokens (`moe_gate_up_route`).
    Scratch given: sc [1, E] fp32 (the scores of the logits form, else None), prev_key /
    best_key uint32 [1], prev_id / best_id int64 [1], total fp32 [1]."""
    _check(e=r.e, k=r.k)
    E, K = T.int64(r.e), T.int64(r.k)
    norm = r.normalize and r.k > 1
    scored = r.gate_temp is not None

    def score_of(scores, sc, vr, i):  # row vr's score of expert i
        return sc[0, i] if scored else scores[vr, i]

    def bias_of(bias, vr, i):  # row vr's bias of expert i
        if r.bias_select:
            return T.Select(bias[0][vr, T.int64(0)], bias[1][i], bias[2][i])
        return bias[vr, i] if r.bias_rows else bias[i]

    def scores_at(scores, sc, bias, vr, i):  # the biased score the top-k orders
        return score_of(scores, sc, vr, i) + bias_of(bias, vr, i)

    @T.macro
    def topk_row(scores, bias, weights, ids, vr, sc, prev_key, prev_id, best_key, best_id,
                 total):
        if scored:  # static: the row's scores, from its logits
            for i in range(E):
                sc[0, i] = sqrt_softplus(scores[vr, i] / T.float32(r.gate_temp))
        prev_key[0] = T.uint32(0xFFFFFFFF)  # "before" every item
        prev_id[0] = T.int64(-1)
        for j in range(K):
            best_id[0] = E  # none yet
            best_key[0] = T.uint32(0)
            for i in range(E):
                key = order_key(scores_at(scores, sc, bias, vr, i))
                after = (key < prev_key[0]) or (key == prev_key[0] and i > prev_id[0])
                if after and (best_id[0] == E or key > best_key[0]):
                    best_key[0] = key
                    best_id[0] = i
            ids[vr, j] = best_id[0]
            prev_key[0] = best_key[0]
            prev_id[0] = best_id[0]
        total[0] = T.float32(0)
        for j in range(K):
            weights[vr, j] = score_of(scores, sc, vr, ids[vr, j])
            total[0] = total[0] + weights[vr, j]
        for j in range(K):
            if norm:
                weights[vr, j] = weights[vr, j] / (total[0] + T.float32(1e-20))
            weights[vr, j] = weights[vr, j] * T.float32(r.route_scale)

    return topk_row


def make_route_topk(*, e: int, k: int, normalize: bool, route_scale: float,
                    bias_rows: bool = False, gate_temp: float | None = None,
                    bias_select: bool = False) -> tvm.tirx.PrimFunc:
    """`route_topk(scores, bias) -> (weights, ids)` (module docstring), n symbolic; bias [E], or
    [n, E] with `bias_rows`. gate_temp (`route_topk_logits`): the input is the gate's logits,
    each row's scores `sqrt_softplus(logits / gate_temp)` computed first (the elementwise
    kernel the graph ran before, in the row's block). `bias_select`: (scores, mask [n, 1]
    bool, bias_vl [E], bias [E]) -> (weights, ids), each row's bias picked by its mask
    (`TopkRouting`): the `bias_rows` kernel on `where(mask, bias_vl, bias)`, bit for bit."""
    routing = TopkRouting(e=e, k=k, normalize=normalize, route_scale=route_scale,
                          bias_rows=bias_rows, gate_temp=gate_temp, bias_select=bias_select)
    topk_row = route_topk_row(routing)
    E, K = T.int64(e), T.int64(k)
    scored = gate_temp is not None

    @T.macro
    def routed_row(scores, bias, weights, ids, vr):
        """Row vr's picks, in its block: the scratch `topk_row` takes, then the row."""
        prev_key = T.sblock_alloc_buffer((1,), "uint32", scope="local")
        prev_id = T.sblock_alloc_buffer((1,), "int64", scope="local")
        best_key = T.sblock_alloc_buffer((1,), "uint32", scope="local")
        best_id = T.sblock_alloc_buffer((1,), "int64", scope="local")
        total = T.sblock_alloc_buffer((1,), "float32", scope="local")
        if scored:  # static
            sc = T.sblock_alloc_buffer((T.int64(1), E), "float32", scope="local")
        else:
            sc = T.meta_var(None)
        topk_row(scores, bias, weights, ids, vr, sc, prev_key, prev_id, best_key, best_id,
                 total)

    if bias_select:
        @T.prim_func(s_tir=True)
        def route_topk_select(s_h: T.handle, m_h: T.handle, bias_vl: T.Buffer((E,), "float32"),
                              bias: T.Buffer((E,), "float32"), w_h: T.handle, id_h: T.handle):
            T.func_attr({"global_symbol": "route_topk", "tirx.noalias": True})
            n = T.int64()
            scores = T.match_buffer(s_h, (n, E), "float32")
            mask = T.match_buffer(m_h, (n, T.int64(1)), "bool")
            weights = T.match_buffer(w_h, (n, K), "float32")
            ids = T.match_buffer(id_h, (n, K), "int64")
            for r in range(n):
                with T.sblock("route"):
                    vr = T.axis.spatial(n, r)
                    T.reads(scores[vr, 0:E], mask[vr, 0], bias_vl[0:E], bias[0:E])
                    T.writes(weights[vr, 0:K], ids[vr, 0:K])
                    routed_row(scores, (mask, bias_vl, bias), weights, ids, vr)

        return route_topk_select

    @T.prim_func(s_tir=True)
    def route_topk(s_h: T.handle, b_h: T.handle, w_h: T.handle, id_h: T.handle):
        T.func_attr({"global_symbol": "route_topk", "tirx.noalias": True})
        n = T.int64()
        scores = T.match_buffer(s_h, (n, E), "float32")
        bias = T.match_buffer(b_h, (n, E) if bias_rows else (E,), "float32")
        weights = T.match_buffer(w_h, (n, K), "float32")
        ids = T.match_buffer(id_h, (n, K), "int64")
        for r in range(n):
            with T.sblock("route"):
                vr = T.axis.spatial(n, r)
                T.reads(scores[vr, 0:E], bias[vr, 0:E] if bias_rows else bias[0:E])
                T.writes(weights[vr, 0:K], ids[vr, 0:K])
                routed_row(scores, bias, weights, ids, vr)

    return route_topk


@dataclass(frozen=True)
class RouterConfig:
    """CUDA: `threads` rows (one a thread) per thread block; CPU: rows in parallel."""

    threads: int = 64


def router_config(target: TargetSpec) -> RouterConfig:
    del target
    return RouterConfig()


def schedule_route_topk(func: tvm.tirx.PrimFunc, config: RouterConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    return schedule_block_rows(func, "route", target, threads=config.threads)


def build_route_topk(target_name: str, *, e: int, k: int, normalize: bool, route_scale: float,
                     bias_rows: bool = False, gate_temp: float | None = None,
                     bias_select: bool = False) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    return schedule_route_topk(
        make_route_topk(e=e, k=k, normalize=normalize, route_scale=route_scale,
                        bias_rows=bias_rows, gate_temp=gate_temp, bias_select=bias_select),
        router_config(target), target)
