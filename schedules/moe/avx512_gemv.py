"""The hand-vectorised expert GEMVs (decode), AVX-512 and (fp32 sums in 256-bit vectors)
AVX2: FP4 weight blocks decoded by table lookup in registers, columns prefetched ahead."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    bf16_bits_of_exact,
    e8m0_byte,
    fma8,
    fma16,
    fp4_to_f32_select,
    i64,
    idx,
    pairwise_lane_sum,
    permps,
    prefetch,
    round_bf16,
    signed_fp4_8,
    silu_times,
    with_bf16_dot,
)
from dsv41.schedules.gemm import BLOCK, bf16_dot_rows, fp8_qdq_rows
from dsv41.schedules.moe.experts import expert_of
from dsv41.schedules.moe.fp4_dot import (
    LUT_BYTES,
    block_sum,
    block_words,
    each_block,
    lut_byte,
)
from dsv41.schedules.moe.route import check_dims, combine_rows, route_pairs, to_bf16
from dsv41.schedules.router import TopkRouting, route_topk_row

# ---- the GEMV form hand-vectorised (AVX-512; AVX2: `_fp4_block8`) -------------------------------
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


@T.macro
def _fp4_block(acc, c, w, sc, e, a, xe, xo, r, blk, tbl):
    """acc[c, 0] (even elements) and acc[c, 1] (odd) += block blk of packed row w[e, a] (its
    E8M0 scale already fp32 in sc[c, blk]) times the activation row r split by parity (xe,
    xo). The scaled table and the widened bytes are written twice; LLVM computes them once."""
    acc[c, 0, T.ramp(0, 1, 16)] = fma16(
        xe[r, T.ramp(blk * 16, 1, 16)],
        permps(tbl[T.ramp(0, 1, 16)] * T.broadcast(sc[c, blk], 16),
                T.Cast("uint32x16", w.vload([e, a, blk * 16], "uint8x16"))),
        acc[c, 0, T.ramp(0, 1, 16)])
    acc[c, 1, T.ramp(0, 1, 16)] = fma16(
        xo[r, T.ramp(blk * 16, 1, 16)],
        permps(tbl[T.ramp(0, 1, 16)] * T.broadcast(sc[c, blk], 16),
                T.Cast("uint32x16", w.vload([e, a, blk * 16], "uint8x16"))
                >> T.broadcast(T.uint32(4), 16)),
        acc[c, 1, T.ramp(0, 1, 16)])


@T.macro
def _fp4_block8(acc, c, w, sc, e, a, xe, xo, r, blk, tbl):
    """`_fp4_block` in 256-bit vectors (AVX2): each half of the block's 16 bytes (8 bytes:
    elements 16 h .. of each parity) into lanes 8 h .. of the same accumulators, so every lane
    sums the same products in the same order as the 512-bit form: the same bits."""
    for h in T.unroll(2):
        acc[c, 0, T.ramp(h * 8, 1, 8)] = fma8(
            xe[r, T.ramp(blk * 16 + h * 8, 1, 8)],
            signed_fp4_8(tbl[T.ramp(0, 1, 8)] * T.broadcast(sc[c, blk], 8),
                        T.Cast("uint32x8", w.vload([e, a, blk * 16 + h * 8], "uint8x8"))),
            acc[c, 0, T.ramp(h * 8, 1, 8)])
        acc[c, 1, T.ramp(h * 8, 1, 8)] = fma8(
            xo[r, T.ramp(blk * 16 + h * 8, 1, 8)],
            signed_fp4_8(tbl[T.ramp(0, 1, 8)] * T.broadcast(sc[c, blk], 8),
                        T.Cast("uint32x8", w.vload([e, a, blk * 16 + h * 8], "uint8x8"))
                        >> T.broadcast(T.uint32(4), 8)),
            acc[c, 1, T.ramp(h * 8, 1, 8)])


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


DOTS = ("fp32", "bf16")  # the sums: fp32 FMAs of table-decoded weights, or vdpbf16ps (fp4_dot)


def check_dot(dot: str, lanes: int = 16) -> None:
    if dot not in DOTS:
        raise ValueError(f"The expert GEMVs sum by 'fp32' or 'bf16', got dot={dot!r}.")
    if lanes not in (8, 16) or (lanes == 8 and dot != "fp32"):
        raise ValueError(f"The expert GEMVs take 16 lanes (AVX-512), or 8 (AVX2) with fp32 "
                         f"sums; got lanes={lanes}, dot={dot!r}.")


def fp4_block(lanes: int):
    """The fp32 form's block step for `lanes`: `_fp4_block` (AVX-512) or `_fp4_block8`
    (AVX2), the same bits."""
    return _fp4_block if lanes == 16 else _fp4_block8


@T.macro
def init_tables(tbl, lut, bf16):
    """The fp32 form's 16 E2M1 values, or the bf16 form's vpermb table."""
    if bf16:  # static
        for i in T.unroll(LUT_BYTES):
            lut[i] = lut_byte(i)
    else:
        for i in T.unroll(16):
            tbl[i] = fp4_to_f32_select(T.Cast("uint32", i))


@T.macro
def stage_rows(xe, xo, xb, src, nrows, half, bf16):
    """Each row's activation (`src(r, j)`, fp32) split by parity (fp32 form) or as bf16 bits
    (bf16 form: exact, the activation is a dequantised E4M3 value)."""
    if bf16:  # static
        for r, j in T.grid(nrows, half * 2):
            xb[r, j] = bf16_bits_of_exact(src(r, j))
    else:
        for r, j in T.grid(nrows, half):
            xe[r, j] = src(r, j * 2)
            xo[r, j] = src(r, j * 2 + 1)


@T.macro
def _bf16_block(acc, c, w, sc, e, a, xb, r, lut, blk, par):
    """acc[c, par] += block blk of packed row w[e, a] times row r of xb (fp4_dot.block_sum)."""
    acc[c, par, T.ramp(0, 1, 16)] = block_sum(
        acc[c, par, T.ramp(0, 1, 16)], xb[r, T.ramp(blk * 32, 1, 32)],
        block_words(w.vload([e, a, blk * 16], "uint8x16"), lut), sc[c, blk])


@T.macro
def prefetch_row_ahead(w, e, a, rows, nblk):
    """The lines of row a + GEMV_PREFETCH (nblk 32-blocks), before a column's sums (inside them,
    LLVM keeps the accumulators and tables in memory: a prefetch may read any memory)."""
    for line in range(i64((nblk + 3) // 4)):
        prefetch(T.address_of(w[e, T.min(a + i64(GEMV_PREFETCH), rows - i64(1)), line * 64]))


def make_moe_gate_up_gemv_avx512(*, dim: int, inter: int, n_experts: int, topk: int,
                                 swiglu_limit: float, dot: str = "fp32", route: bool = False,
                                 null_expert: bool = False, routing: TopkRouting | None = None,
                                 gate: bool = False, lanes: int = 16) -> tvm.tirx.PrimFunc:
    """`make_moe_gate_up_gemv`'s signature and result, hand-vectorised for AVX-512 (see the
    section comment; written scheduled): parallel over (sorted row, 32 output columns); per
    column the w1 and w3 rows walked together (four independent accumulators), then the SwiGLU
    epilogue. dim a multiple of 32. dot "bf16": the sums on vdpbf16ps (`fp4_dot`; AVX-512 BF16
    and VBMI).

    route: `moe_gate_up_route`, the decode chain's first call: (x bf16 [n, dim], weights, ids,
    w1, s1, w3, s3) -> (row_pair, token_rows, h): `moe_route`'s pairs (`route.route_pairs`,
    `null_expert` as there; on the calling thread) and `moe_qdq_x`'s activation
    (`gemm.fp8_qdq_rows`, rows in parallel), then the same tasks: three kernels' results, bit
    for bit, in one call.

    routing (with route; `moe_gate_up_route_topk`): (x, logits fp32 [n, E], bias, w1, s1, w3,
    s3) -> (weights, ids, row_pair, token_rows, h): each token's experts and weights from the
    gate's logits first (`router.route_topk_row`, the route_topk kernel's arithmetic): four
    kernels' results in one call.

    gate (with routing; `moe_gate_up_route_gate`): the gate's weight bf16 [E, dim] in place of
    the logits, which the kernel forms first as the decode dense GEMV does
    (`gemm.bf16_dot_rows`; dim a multiple of 32; AVX-512 BF16): five kernels in one call.

    lanes 8: the fp32 form in 256-bit vectors for AVX2 CPUs (`_fp4_block8`: vpermps reads 8
    table entries, the sign flipped in), bit for bit the 512-bit form's."""
    if routing is not None and (not route or routing.e != n_experts or routing.k != topk):
        raise ValueError(f"The routing gate/up kernel routes its own pairs (route=True) over "
                         f"its experts; got route={route}, {routing}.")
    if gate and routing is None:
        raise ValueError("The gate/up kernel forms the gate's logits only when it routes them "
                         "(routing=...).")
    check_dims(dim, inter)
    check_dot(dot, lanes)
    if gate and lanes != 16:
        raise ValueError("The gate/up kernel forms the gate's logits with AVX-512 BF16 only.")
    bf16 = dot == "bf16"
    block = fp4_block(lanes)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    DH, DB, IT = i64(dim // 2), i64(dim // BLOCK), i64((inter + BLOCK - 1) // BLOCK)
    NULL = i64(n_experts - 1) if null_expert else i64(-1)

    @T.macro
    def gate_up(xq, weights, ids, row_pair, w1, s1, w3, s3, h, n):
        # the row's activation: even and odd elements (fp32 form), or bf16 bits (bf16)
        xe = T.alloc_buffer((n * KT, DH if not bf16 else 1), "float32")
        xo = T.alloc_buffer((n * KT, DH if not bf16 else 1), "float32")
        xb = T.alloc_buffer((n * KT, D if bf16 else 1), "uint16")
        stage_rows(xe, xo, xb, lambda r, j: xq[idx(row_pair[r], n * KT) // KT, j],
                   n * KT, DH, bf16)
        for task in T.parallel(n * KT * IT):
            tbl = T.alloc_buffer((16,), "float32", scope="local")
            lut = T.alloc_buffer((LUT_BYTES,), "uint8", scope="local")
            acc = T.alloc_buffer((2, 2, 16), "float32", scope="local")  # gate, up x parity
            sc = T.alloc_buffer((2, DB), "float32", scope="local")  # the row's scales
            init_tables(tbl, lut, bf16)
            r = task // IT
            e = expert_of(ids, row_pair, r, n * KT, KT, E)
            q = idx(row_pair[r], n * KT)
            for c in range(i64(BLOCK)):
                if (task % IT) * BLOCK + c < I:
                    a = T.meta_var((task % IT) * BLOCK + c)
                    _zero_acc(acc, 2)
                    for blk in T.vectorized(DB):
                        sc[0, blk] = e8m0_byte(s1[e, a, blk])
                        sc[1, blk] = e8m0_byte(s3[e, a, blk])
                    if bf16:  # static
                        prefetch_row_ahead(w1, e, a, I, dim // BLOCK)
                        prefetch_row_ahead(w3, e, a, I, dim // BLOCK)
                        each_block(dim // BLOCK, _bf16_block,
                                   (acc, 0, w1, sc, e, a, xb, r, lut))
                        each_block(dim // BLOCK, _bf16_block,
                                   (acc, 1, w3, sc, e, a, xb, r, lut))
                    else:
                        for blk in range(DB):
                            if blk % 4 == 0:
                                _prefetch_row(w1, e, a, I, blk)
                                _prefetch_row(w3, e, a, I, blk)
                            block(acc, 0, w1, sc, e, a, xe, xo, r, blk, tbl)
                            block(acc, 1, w3, sc, e, a, xe, xo, r, blk, tbl)
                    h[r, a] = to_bf16(weights[q // KT, q % KT] * silu_times(
                        round_bf16(_lane_total(acc, 0)), round_bf16(_lane_total(acc, 1)),
                        swiglu_limit))

    @T.macro
    def route_gate_up(x, weights, ids, row_pair, token_rows, w1, s1, w3, s3, h, n):
        """The route, x's QDQ and the gate/up tasks (`moe_gate_up_route`'s body)."""
        counts = T.alloc_buffer((E,), "int32")
        cursor = T.alloc_buffer((E,), "int32")
        run = T.alloc_buffer((2,), "int32")
        route_pairs(ids, row_pair, token_rows, counts, cursor, run, n * KT, KT, E, NULL)
        xq = T.alloc_buffer((n, D), "float32")
        fp8_qdq_rows(xq, x, n, DB)
        gate_up(xq, weights, ids, row_pair, w1, s1, w3, s3, h, n)

    if routing is not None:
        topk_row = route_topk_row(routing)
        bias_rows = routing.bias_rows

        @T.macro
        def routed(x, logits, bias, w1, s1, w3, s3, weights, ids, row_pair, token_rows, h, n):
            sc = T.alloc_buffer((1, E), "float32")
            prev_key = T.alloc_buffer((1,), "uint32")
            prev_id = T.alloc_buffer((1,), "int64")
            best_key = T.alloc_buffer((1,), "uint32")
            best_id = T.alloc_buffer((1,), "int64")
            total = T.alloc_buffer((1,), "float32")
            for t in range(n):
                topk_row(logits, bias, weights, ids, t, sc, prev_key, prev_id, best_key,
                         best_id, total)
            route_gate_up(x, weights, ids, row_pair, token_rows, w1, s1, w3, s3, h, n)

        # the first input: the gate's weight (gate) or the logits
        SCORES, SCORES_DTYPE = ((E, D), "bfloat16") if gate else (None, "float32")

        @T.prim_func
        def moe_gate_up_route_topk(x_h: T.handle, scores_h: T.handle, bias_h: T.handle,
                                   w1: T.Buffer((E, I, D // 2), "uint8"),
                                   s1: T.Buffer((E, I, DB), "uint8"),
                                   w3: T.Buffer((E, I, D // 2), "uint8"),
                                   s3: T.Buffer((E, I, DB), "uint8"), weights_h: T.handle,
                                   ids_h: T.handle, row_pair_h: T.handle,
                                   token_rows_h: T.handle, h_h: T.handle):
            T.func_attr({"global_symbol": "moe_gate_up_route_topk", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            n = T.int64()
            x = T.match_buffer(x_h, (n, D), "bfloat16")
            scores = T.match_buffer(scores_h, SCORES if gate else (n, E), SCORES_DTYPE)
            bias = T.match_buffer(bias_h, (n, E) if bias_rows else (E,), "float32")
            weights = T.match_buffer(weights_h, (n, KT), "float32")
            ids = T.match_buffer(ids_h, (n, KT), "int64")
            row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
            with T.attr(T.int32(0), *with_bf16_dot()):
                if gate:  # static: the logits formed here, as the decode dense GEMV sums them
                    logits = T.alloc_buffer((n, E), "float32")
                    bf16_dot_rows(logits, x, scores, n, E, dim)
                else:
                    logits = T.meta_var(scores)
                routed(x, logits, bias, w1, s1, w3, s3, weights, ids, row_pair, token_rows,
                       h, n)

        name = "moe_gate_up_route_gate" if gate else "moe_gate_up_route_topk"
        return moe_gate_up_route_topk.with_attr("global_symbol", name)

    if route:
        @T.prim_func
        def moe_gate_up_route(x_h: T.handle, weights_h: T.handle, ids_h: T.handle,
                              w1: T.Buffer((E, I, D // 2), "uint8"),
                              s1: T.Buffer((E, I, DB), "uint8"),
                              w3: T.Buffer((E, I, D // 2), "uint8"),
                              s3: T.Buffer((E, I, DB), "uint8"),
                              row_pair_h: T.handle, token_rows_h: T.handle, h_h: T.handle):
            T.func_attr({"global_symbol": "moe_gate_up_route", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            n = T.int64()
            x = T.match_buffer(x_h, (n, D), "bfloat16")
            weights = T.match_buffer(weights_h, (n, KT), "float32")
            ids = T.match_buffer(ids_h, (n, KT), "int64")
            row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
            with T.attr(T.int32(0), *with_bf16_dot()):
                route_gate_up(x, weights, ids, row_pair, token_rows, w1, s1, w3, s3, h, n)

        return moe_gate_up_route

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
        with T.attr(T.int32(0), *with_bf16_dot()):
            gate_up(xq, weights, ids, row_pair, w1, s1, w3, s3, h, n)

    return moe_gate_up


def make_moe_down_gemv_avx512(*, dim: int, inter: int, n_experts: int, topk: int,
                              dot: str = "fp32", combine: bool = False,
                              plus: bool = False, lanes: int = 16) -> tvm.tirx.PrimFunc:
    """`make_moe_down_gemv`'s signature and result, hand-vectorised as
    `make_moe_gate_up_gemv_avx512`.

    combine: `moe_down_combine` (plus: `moe_down_combine_plus`), the decode chain's second call:
    (h bf16 [P, inter], ids, row_pair, token_rows, w2, s2[, shared bf16 [n, dim]]) -> y (fp32
    [n, dim], bf16 with plus): `moe_qdq_h`'s activation (`gemm.fp8_qdq_rows`), the same tasks
    into an o of its own, then `moe_combine(_plus)`'s sums (`route.combine_rows`, tokens in
    parallel): three kernels' results, bit for bit, in one call. lanes 8: AVX2's (as there)."""
    check_dims(dim, inter)
    check_dot(dot, lanes)
    bf16 = dot == "bf16"
    block = fp4_block(lanes)
    D, I, E, KT = i64(dim), i64(inter), i64(n_experts), i64(topk)
    IH, IB, DT = i64(inter // 2), i64(inter // BLOCK), i64((dim + BLOCK - 1) // BLOCK)

    @T.macro
    def down(hq, ids, row_pair, w2, s2, o, n, store):
        xe = T.alloc_buffer((n * KT, IH if not bf16 else 1), "float32")
        xo = T.alloc_buffer((n * KT, IH if not bf16 else 1), "float32")
        xb = T.alloc_buffer((n * KT, I if bf16 else 1), "uint16")
        stage_rows(xe, xo, xb, lambda r, j: hq[r, j], n * KT, IH, bf16)
        for task in T.parallel(n * KT * DT):
            tbl = T.alloc_buffer((16,), "float32", scope="local")
            lut = T.alloc_buffer((LUT_BYTES,), "uint8", scope="local")
            acc = T.alloc_buffer((1, 2, 16), "float32", scope="local")
            sc = T.alloc_buffer((1, IB), "float32", scope="local")
            init_tables(tbl, lut, bf16)
            r = task // DT
            e = expert_of(ids, row_pair, r, n * KT, KT, E)
            for c in range(i64(BLOCK)):
                if (task % DT) * BLOCK + c < D:
                    a = T.meta_var((task % DT) * BLOCK + c)
                    _zero_acc(acc, 1)
                    for blk in T.vectorized(IB):
                        sc[0, blk] = e8m0_byte(s2[e, a, blk])
                    if bf16:  # static
                        prefetch_row_ahead(w2, e, a, D, inter // BLOCK)
                        each_block(inter // BLOCK, _bf16_block,
                                   (acc, 0, w2, sc, e, a, xb, r, lut))
                    else:
                        for blk in range(IB):
                            if blk % 4 == 0:
                                _prefetch_row(w2, e, a, D, blk)
                            block(acc, 0, w2, sc, e, a, xe, xo, r, blk, tbl)
                    o[r, a] = store(to_bf16(_lane_total(acc, 0)))

    @T.macro
    def down_combine(h, ids, row_pair, token_rows, w2, s2, shared, y, n):
        hq = T.alloc_buffer((n * KT, I), "float32")
        fp8_qdq_rows(hq, h, n * KT, IB)
        # o's bf16 as bits: TVM's BF16 legalisation would hold an allocated bf16 buffer as fp32
        o = T.alloc_buffer((n * KT, D), "uint16")
        down(hq, ids, row_pair, w2, s2, o, n, lambda v: T.reinterpret("uint16", v))
        combine_rows(y, token_rows, o, shared, n, D, KT, plus)

    if combine and plus:
        @T.prim_func
        def moe_down_combine_plus(h_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                                  token_rows_h: T.handle, w2: T.Buffer((E, D, I // 2), "uint8"),
                                  s2: T.Buffer((E, D, IB), "uint8"), shared_h: T.handle,
                                  y_h: T.handle):
            T.func_attr({"global_symbol": "moe_down_combine_plus", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            n = T.int64()
            h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
            ids = T.match_buffer(ids_h, (n, KT), "int64")
            row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            shared = T.match_buffer(shared_h, (n, D), "bfloat16")
            y = T.match_buffer(y_h, (n, D), "bfloat16")
            with T.attr(T.int32(0), *with_bf16_dot()):
                down_combine(h, ids, row_pair, token_rows, w2, s2, shared, y, n)

        return moe_down_combine_plus

    if combine:
        @T.prim_func
        def moe_down_combine(h_h: T.handle, ids_h: T.handle, row_pair_h: T.handle,
                             token_rows_h: T.handle, w2: T.Buffer((E, D, I // 2), "uint8"),
                             s2: T.Buffer((E, D, IB), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "moe_down_combine", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            n = T.int64()
            h = T.match_buffer(h_h, (n * KT, I), "bfloat16")
            ids = T.match_buffer(ids_h, (n, KT), "int64")
            row_pair = T.match_buffer(row_pair_h, (n * KT,), "int32")
            token_rows = T.match_buffer(token_rows_h, (n, KT), "int32")
            y = T.match_buffer(y_h, (n, D), "float32")
            with T.attr(T.int32(0), *with_bf16_dot()):
                down_combine(h, ids, row_pair, token_rows, w2, s2, None, y, n)

        return moe_down_combine

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
        with T.attr(T.int32(0), *with_bf16_dot()):
            down(hq, ids, row_pair, w2, s2, o, n, lambda v: v)

    return moe_down
