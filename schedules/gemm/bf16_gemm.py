"""The FP8 prefill GEMM on AVX-512 BF16 (`make_fp8_gemm_bf16`): E4M3 weights times their tile
scale as exact bf16, activations as exact bf16 pairs, summed by vdpbf16ps (32 products per
instruction), 16 rows in the fp32 lanes, so no lane is summed across at the end."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    bf16_bits_of_exact,
    bf16_of,
    bf16_to_f32,
    dpbf16ps,
    e4m3_to_f32_select,
    e4m3_words,
    e8m0_to_f32,
    i64,
    round_bf16_bound,
    silu_times,
    u32,
    with_bf16_dot,
)
from dsv41.schedules.common.stages import rms_norm_row
from dsv41.schedules.gemm.dense_dot import dense_gemv_func
from dsv41.schedules.gemm.fp8 import BLOCK, check_out_dtype, fp8_qdq, pow2_scale_byte

LANES = 16  # fp32 lanes of one vdpbf16ps: 16 rows
ROW_VECS = 2  # row vectors (16 rows each) of a register tile
TILE_COLS = 8  # columns of a register tile: ROW_VECS x TILE_COLS = 16 accumulators


def nan_canonical(v):
    """float32x16 with every NaN lane the canonical NaN (tested on the bits: LLVM may assume a
    float compare never sees a NaN)."""
    return T.Select(T.reinterpret("uint32x16", v) & T.broadcast(u32(0x7FFFFFFF), LANES)
                    > T.broadcast(u32(0x7F800000), LANES),
                    T.broadcast(T.reinterpret("float32", u32(0x7FC00000)), LANES), v)


@dataclass(frozen=True)
class Fp8GemmStages:
    """`make_fp8_gemm_bf16`'s stages as macros, for kernels that run several GEMMs or form
    their input first (`make_fp8_gemm_bf16`'s fused forms, `make_fp8_gemm_bf16_q_kv`):

    - `gemms(value, src, m, first, second)`: the activation rows value(src, i, j) (fp32, a bf16
      value) quantised per 32 and staged once as bf16 pairs (parallel over rows, then over row
      blocks), then the GEMM of `first` over them and of `second` (None: none), each a
      (stages, weight, scale, y) of a weight of width k (`tasks`).
    - `tasks(xt, weight, scale, y, m)`: the GEMM of one weight over the staged rows, parallel
      over (row block, 32-column tile).
    - `normed(x, nw, xn, m)`: xn [m, k] fp32 = the rows of x RMS-normed by nw, bit for bit
      `norm.make_rms_norm`'s (`rms_norm_row`), parallel over rows (the norm form's input).
    - `swiglu(gate, up, xn, m)`: xn = bf16(swiglu(gate, up, limit)) as fp32, the formula of
      `silu_times` (the MoE epilogue's and the SwiGLU fallback's), parallel over rows.
    n, k, kb, nb: the weight's shape as int64 immediates."""

    gemms: object
    tasks: object
    normed: object
    swiglu: object
    n: object
    k: object
    kb: object
    nb: object
    row_block: int


def bf16_source(x, i, j):
    """Element (i, j) of a bf16 matrix as fp32: the plain GEMM's activation."""
    return bf16_to_f32(x[i, j])


def f32_source(xn, i, j):
    """Element (i, j) of an fp32 matrix of bf16 values (a formed input: normed, SwiGLU)."""
    return xn[i, j]


def fp8_gemm_bf16_stages(*, n: int, k: int, out_dtype: str = "bfloat16",
                         row_block: int = 256, norm_eps: float | None = None,
                         norm_lanes: int = 32, swiglu_limit: float | None = None
                         ) -> Fp8GemmStages:
    """The stages of `make_fp8_gemm_bf16` (see its docstring) for a weight [n, k]; norm_eps /
    norm_lanes: the `normed` stage's (the rms_norm kernel's eps and lanes), swiglu_limit the
    `swiglu` stage's."""
    if k % (2 * BLOCK):
        raise ValueError(f"The bf16 fp8 GEMM needs k a multiple of {2 * BLOCK}, got {k}.")
    if row_block < 32 or row_block % (ROW_VECS * LANES):
        raise ValueError(f"row_block must be a positive multiple of {ROW_VECS * LANES}; got "
                         f"{row_block}.")
    if norm_eps is not None and (norm_lanes <= 0 or k % norm_lanes):
        raise ValueError(f"The fp8 GEMM's norm needs lanes dividing k={k}; got {norm_lanes}.")
    check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))
    KP, MB, TN = i64(k // 2), i64(row_block), i64(BLOCK)
    GROUP = ROW_VECS * LANES  # rows of a register tile
    ACCS = ROW_VECS * TILE_COLS

    def xq(value, src, amax, row, j):  # the quantised activation (fp32, exact)
        return fp8_qdq(value(src, row, j), pow2_scale_byte(amax[row, j // BLOCK]))

    def bits(v):  # bf16 bits of an exact fp32 value, as uint32
        return T.reinterpret("uint32", v) >> u32(16)

    @T.macro
    def stage(value, src, amax, xt, m):
        for i in T.parallel(m):
            for b in range(KB):
                amax[i, b] = T.min_value("float32")
                for j in range(TN):
                    amax[i, b] = T.max(amax[i, b], T.fabs(value(src, i, b * TN + j)))
        for rb in T.parallel((m + MB - i64(1)) // MB):
            for gr, kp, r in T.grid(MB // i64(GROUP), KP, i64(GROUP)):
                row = T.meta_var(T.min(rb * MB + gr * GROUP + r, m - i64(1)))
                xt[((rb * MB // i64(GROUP) + gr) * KP + kp) * i64(GROUP) + r] = T.Select(
                    rb * MB + gr * GROUP + r < m,
                    bits(xq(value, src, amax, row, kp * 2))
                    | (bits(xq(value, src, amax, row, kp * 2 + 1)) << u32(16)),
                    u32(0))

    @T.macro
    def gemms(value, src, m, first, second):
        amax = T.alloc_buffer((m, KB), "float32")
        xt = T.alloc_buffer((((m + MB - i64(1)) // MB) * KP * MB,), "uint32")
        stage(value, src, amax, xt, m)
        first[0].tasks(xt, first[1], first[2], first[3], m)
        if second is not None:  # static
            second[0].tasks(xt, second[1], second[2], second[3], m)

    @T.macro
    def tasks(xt, weight, scale, y, m):
        for task in T.parallel(((m + MB - i64(1)) // MB) * NB):
            wn = T.alloc_buffer((TN * K,), "uint16")  # the tile's weights, bf16, K order
            acc = T.alloc_buffer((ACCS * LANES,), "float32")  # registers
            out = T.alloc_buffer((ACCS * LANES,), out_dtype)
            rb = T.meta_var(task // NB)
            p = T.meta_var(task % NB)
            for c, kv in T.grid(TN, K // i64(LANES)):
                wn[T.ramp(c * K + kv * LANES, 1, LANES)] = bf16_bits_of_exact(
                    e4m3_to_f32_select(T.Cast(f"uint32x{LANES}", weight.vload(
                        [T.min(p * TN + c, N - i64(1)), kv * LANES], f"uint8x{LANES}")))
                    * T.broadcast(e8m0_to_f32(T.Cast("uint32", scale[p, kv * LANES // TN])),
                                  LANES))
            for g in range(MB // i64(GROUP)):
                if rb * MB + g * GROUP < m:
                    for cq in range(TN // i64(TILE_COLS)):
                        for a in T.unroll(ACCS):
                            acc[T.ramp(a * LANES, 1, LANES)] = T.broadcast(T.float32(0), LANES)
                        for kp in range(KP):
                            for v in T.unroll(ROW_VECS):
                                for c in T.unroll(TILE_COLS):
                                    acc[T.ramp((v * TILE_COLS + c) * LANES, 1, LANES)] = \
                                        dpbf16ps(
                                            acc[T.ramp((v * TILE_COLS + c) * LANES, 1, LANES)],
                                            T.reinterpret("uint16x32", xt[T.ramp(
                                                ((rb * MB // i64(GROUP) + g) * KP + kp)
                                                * i64(GROUP) + v * LANES, 1, LANES)]),
                                            T.reinterpret("uint16x32", T.broadcast(
                                                T.reinterpret("uint32", wn.vload(
                                                    [(cq * TILE_COLS + c) * K + kp * 2],
                                                    "uint16x2")), LANES)))
                        for a in T.unroll(ACCS):  # rounded per vector, NaN canonical
                            out[T.ramp(a * LANES, 1, LANES)] = T.Cast(
                                f"{out_dtype}x{LANES}", nan_canonical(
                                    acc[T.ramp(a * LANES, 1, LANES)]))
                        for v, c, r in T.grid(ROW_VECS, TILE_COLS, LANES):
                            row = T.meta_var(rb * MB + g * GROUP + v * LANES + r)
                            col = T.meta_var(p * TN + cq * TILE_COLS + c)
                            if row < m and col < N:
                                y[row, col] = out[(v * TILE_COLS + c) * LANES + r]

    NL = i64(norm_lanes)
    vec = 16 if norm_lanes % 16 == 0 else 1
    norm_row = rms_norm_row(vec=vec)  # a fresh macro (see common.stages)

    @T.macro
    def normed(x, nw, xn, m):
        for i in T.parallel(m):
            part = T.alloc_buffer((NL,), "float32")
            ssq = T.alloc_buffer((1,), "float32")
            norm_row(xn, lambda c, i=i: (i, c), part, ssq,
                     lambda c, i=i: bf16_to_f32(x[i, c]), nw, k, norm_eps, norm_lanes)

    @T.macro
    def swiglu(gate, up, xn, m):
        for i in T.parallel(m):
            for c0 in range(K // i64(LANES)):
                for c1 in T.vectorized(LANES):
                    xn[i, c0 * LANES + c1] = round_bf16_bound(silu_times(
                        bf16_to_f32(gate[i, c0 * LANES + c1]),
                        bf16_to_f32(up[i, c0 * LANES + c1]), swiglu_limit))

    return Fp8GemmStages(gemms=gemms, tasks=tasks, normed=normed, swiglu=swiglu, n=N, k=K,
                         kb=KB, nb=NB, row_block=row_block)


def make_fp8_gemm_bf16(*, n: int, k: int, out_dtype: str = "bfloat16", row_block: int = 256,
                       norm_eps: float | None = None, norm_lanes: int = 32,
                       pair_n: int | None = None,
                       swiglu_limit: float | None = None) -> tvm.tirx.PrimFunc:
    """The CPU prefill form of `fp8_linear` (same signature as `make_fp8_linear`) on x86 with
    AVX-512 BF16, hand-vectorised (its loops are the schedule).

    Exact products, as every fp8_linear kernel: the activation is quantised per 32 along K (the
    oracle's `xq`, an E4M3 value times a power of two: 4 significant bits, exact in bf16); the
    weight is its E4M3 value times its 32 x 32 tile's E8M0 scale, also 4 significant bits, exact
    in bf16 while it is a normal number (scale exponent s - 127 >= -117; an fp32 denormal is
    kept as a bf16 denormal, which vdpbf16ps reads as zero). vdpbf16ps adds each pair of products
    (exact in fp32) into fp32 lanes, round to nearest even, denormal sums flushed: with |xq| >=
    2^-31 and weights >= 2^-9 * 2^(s - 127) every nonzero product is normal while s - 127 >= -86,
    as in `make_fp8_gemv_bf16`. Per output: one running sum over K in pair order, no per-32
    partial sums: against the oracle only the order of the fp32 additions differs. A NaN weight
    code (0x7f / 0xff) makes its column NaN, stored as the canonical NaN.

    Layout: 16 rows in the lanes. The quantised activation is staged once per call as bf16
    pairs per 32-row group ([group, k / 2, 32 rows] uint32: a row's K pair (2j, 2j + 1) in one
    word; a group's K walk is contiguous). A task (row block, 32-column tile) decodes its
    tile's weights once into bf16 in K order ([32, k] uint16, the tile scale folded in) and
    runs register tiles of 32 rows x 8 columns: per K pair, 2 activation loads, 8 weight-pair
    broadcasts, 16 vdpbf16ps. A tile's decode is shared by `row_block` rows (about 1
    instruction per code against row_block / 32 dot products per code).

    The fused forms, each the kernels it stands for in turn, bit for bit (the same stages,
    `fp8_gemm_bf16_stages`), one call: `norm_eps` (`norm_fp8_linear`: (x, norm_weight, weight,
    scale, y); x RMS-normed first as the rms_norm kernel norms it, `norm_lanes` its lanes),
    `pair_n` (`fp8_linear_pair`: (x, weight, scale, weight2, scale2, y, y2); x staged once for
    both weights), `swiglu_limit` (`swiglu_fp8_linear`: (gate, up, weight, scale, y); the
    activation bf16(swiglu(gate, up)), the SwiGLU fallback's formula)."""
    if sum(v is not None for v in (norm_eps, pair_n, swiglu_limit)) > 1:
        raise ValueError("The fp8 GEMM takes one of a norm, a second matrix or a SwiGLU.")
    if pair_n is not None and pair_n <= 0:
        raise ValueError(f"The paired fp8 GEMM needs pair_n > 0; got {pair_n}.")
    st = fp8_gemm_bf16_stages(n=n, k=k, out_dtype=out_dtype, row_block=row_block,
                              norm_eps=norm_eps, norm_lanes=norm_lanes,
                              swiglu_limit=swiglu_limit)
    N, K, KB, NB = st.n, st.k, st.kb, st.nb

    if norm_eps is not None:
        @T.prim_func
        def norm_fp8_gemm_bf16(x_h: T.handle, nw: T.Buffer((K,), "bfloat16"),
                               weight: T.Buffer((N, K), "uint8"),
                               scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "norm_fp8_linear", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            with T.attr(T.int32(0), *with_bf16_dot()):
                xn = T.alloc_buffer((m, K), "float32")  # the normed rows (bf16 values)
                st.normed(x, nw, xn, m)
                st.gemms(f32_source, xn, m, (st, weight, scale, y), None)

        return norm_fp8_gemm_bf16

    if swiglu_limit is not None:
        @T.prim_func
        def swiglu_fp8_gemm_bf16(gate_h: T.handle, up_h: T.handle,
                                 weight: T.Buffer((N, K), "uint8"),
                                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "swiglu_fp8_linear", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            gate = T.match_buffer(gate_h, (m, K), "bfloat16")
            up = T.match_buffer(up_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            with T.attr(T.int32(0), *with_bf16_dot()):
                xn = T.alloc_buffer((m, K), "float32")  # the SwiGLU rows (bf16 values)
                st.swiglu(gate, up, xn, m)
                st.gemms(f32_source, xn, m, (st, weight, scale, y), None)

        return swiglu_fp8_gemm_bf16

    if pair_n is not None:
        st2 = fp8_gemm_bf16_stages(n=pair_n, k=k, out_dtype=out_dtype, row_block=row_block)
        N2, NB2 = st2.n, st2.nb

        @T.prim_func
        def fp8_gemm_bf16_pair(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                               scale: T.Buffer((NB, KB), "uint8"),
                               weight2: T.Buffer((N2, K), "uint8"),
                               scale2: T.Buffer((NB2, KB), "uint8"), y_h: T.handle,
                               y2_h: T.handle):
            T.func_attr({"global_symbol": "fp8_linear_pair", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, K), "bfloat16")
            y = T.match_buffer(y_h, (m, N), out_dtype)
            y2 = T.match_buffer(y2_h, (m, N2), out_dtype)
            with T.attr(T.int32(0), *with_bf16_dot()):
                st.gemms(bf16_source, x, m, (st, weight, scale, y), (st2, weight2, scale2, y2))

        return fp8_gemm_bf16_pair

    @T.prim_func
    def fp8_gemm_bf16(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                      scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        with T.attr(T.int32(0), *with_bf16_dot()):
            st.gemms(bf16_source, x, m, (st, weight, scale, y), None)

    return fp8_gemm_bf16


def make_fp8_gemm_bf16_q_kv(*, n_q: int, n_kv: int, k: int, n_b: int, norm_eps: float,
                            norm_lanes: int = 32, row_block: int = 256,
                            b_row_block: int = 256) -> tvm.tirx.PrimFunc:
    """`fp8_q_kv`'s prefill kernel on AVX-512 BF16, the signature of the decode one
    (`make_fp8_gemv_bf16_q_kv`): x staged once for the pair wq_a / wkv (q_lora and kv), then
    q_lora RMS-normed, staged and the wq_b GEMM of it: the `fp8_linear_pair` and
    `norm_fp8_linear` forms of `make_fp8_gemm_bf16` in turn (their stages), so every output is
    theirs bit for bit, one call instead of two (four unfused). row_block / b_row_block: the
    row blocks each GEMM's own kernel would use."""
    a = fp8_gemm_bf16_stages(n=n_q, k=k, row_block=row_block)
    kv_st = fp8_gemm_bf16_stages(n=n_kv, k=k, row_block=row_block)
    b = fp8_gemm_bf16_stages(n=n_b, k=n_q, row_block=b_row_block, norm_eps=norm_eps,
                             norm_lanes=norm_lanes)
    NQ, NKV, K, NB_ = a.n, kv_st.n, a.k, b.n  # wq_a, wkv, x's width, wq_b

    @T.prim_func
    def fp8_q_kv(x_h: T.handle, wa: T.Buffer((NQ, K), "uint8"),
                 sa: T.Buffer((a.nb, a.kb), "uint8"), wkv: T.Buffer((NKV, K), "uint8"),
                 skv: T.Buffer((kv_st.nb, kv_st.kb), "uint8"),
                 nw: T.Buffer((NQ,), "bfloat16"), wb: T.Buffer((NB_, NQ), "uint8"),
                 sb: T.Buffer((b.nb, b.kb), "uint8"), q_lora_h: T.handle, kv_h: T.handle,
                 q_h: T.handle):
        T.func_attr({"global_symbol": "fp8_q_kv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        q_lora = T.match_buffer(q_lora_h, (m, NQ), "bfloat16")
        kv = T.match_buffer(kv_h, (m, NKV), "bfloat16")
        q = T.match_buffer(q_h, (m, NB_), "bfloat16")
        with T.attr(T.int32(0), *with_bf16_dot()):
            a.gemms(bf16_source, x, m, (a, wa, sa, q_lora), (kv_st, wkv, skv, kv))
            xn = T.alloc_buffer((m, NQ), "float32")  # the normed q_lora (bf16 values)
            b.normed(q_lora, nw, xn, m)
            b.gemms(f32_source, xn, m, (b, wb, sb, q), None)

    return fp8_q_kv


def make_dense_gemm_bf16(*, groups: int, n: int, k: int, row_block: int = 512,
                         fp8: bool = False, out_dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """The prefill form of the grouped bf16 `dense_gemv` (same signature as `make_dense_gemm`:
    x bf16 [m, g, k], w bf16 [g * n, k], y fp32 [m, g, n]) on x86 with AVX-512 BF16,
    hand-vectorised: every product of two bf16 values is exact in fp32, summed by vdpbf16ps in
    K pairs into one running fp32 sum per output (round to nearest even; bf16 denormal inputs
    and fp32 denormal sums flushed to zero), so against the fp32 oracle only the order of the
    additions differs (a sum of k / 2 pair terms).

    Layout as `make_fp8_gemm_bf16`: 16 rows in the lanes, the activation staged once per call as
    a row's K pair per uint32 ([row block, group, 32-row group, k / 2, 32 rows]); a task (row block,
    group, 32-column tile) runs register tiles of 32 rows x 8 columns, each weight pair
    broadcast straight from w (no decode: the weights are bf16 already).

    `fp8` (signature (x, w, scale, y): w E4M3 codes [g * n, k], scale the E8M0 bytes of its 32 x
    32 tiles; k a multiple of 64; AVX-512 VBMI): a task first decodes its tile's weights into
    bf16 in K order ([32, k] uint16: looked up, `e4m3_words`, the tile's scale added to the
    exponents, exact: the BF16 `checkpoint.fp8_tiles.dequantize_fp8_tiles` makes while the scale
    byte is in `EXACT_SCALE_BYTES`), then broadcasts the pairs from it: the bf16 kernel's sums
    over that weight, bit for bit, without a dequantized copy of it.

    `out_dtype` "bfloat16": each sum stored rounded (`common.bf16_of`, the bits of the
    caller's `round_to_bf16` on the fp32 result: the rounding kernel after it, folded in)."""
    if out_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"The bf16 dense GEMM stores float32 or bfloat16, got {out_dtype}.")
    if k % 2:
        raise ValueError(f"The bf16 dense GEMM needs an even k, got {k}.")
    if fp8 and k % e4m3_words.CODES:
        raise ValueError(f"The bf16 dense GEMM over an FP8 weight needs k a multiple of "
                         f"{e4m3_words.CODES}, got {k}.")
    if row_block < 32 or row_block % (ROW_VECS * LANES):
        raise ValueError(f"row_block must be a positive multiple of {ROW_VECS * LANES}; got "
                         f"{row_block}.")
    G, N, K, KP, MB, TN = i64(groups), i64(n), i64(k), i64(k // 2), i64(row_block), i64(BLOCK)
    NT = i64(math.ceil(n / BLOCK))
    GROUP = ROW_VECS * LANES
    ACCS = ROW_VECS * TILE_COLS

    def bits(v):  # a bf16 value's bits as uint32
        return T.Cast("uint32", T.reinterpret("uint16", v))

    def wpair(w, wn, g, p, cq, c, kp):  # the weight pair (kp) of column c of quad cq, as uint32
        if wn is not None:  # the task's decoded tile
            return T.reinterpret("uint32", wn.vload([(cq * TILE_COLS + c) * K + kp * 2],
                                                    "uint16x2"))
        return T.reinterpret("uint32", w.vload(
            [g * N + T.min(p * TN + cq * TILE_COLS + c, N - i64(1)), kp * 2], "bfloat16x2"))

    CODES = e4m3_words.CODES

    def stored(v):  # an fp32 sum as y holds it
        return bf16_of(v) if out_dtype == "bfloat16" else v

    @T.macro
    def decode_tile(w, sc, tables, wn, g, p):
        """wn = the bf16 bits of the task's 32 columns of the FP8 weight, in K order (a partial
        tile reads its last column again): 64 codes at a time looked up (`e4m3_words`), each
        32-code half's tile scale added to its words' exponents."""
        for c, cp in T.grid(TN, K // i64(CODES)):
            row = T.meta_var(g * N + T.min(p * TN + c, N - i64(1)))
            codes = T.meta_var(w.vload([row, cp * i64(CODES)], f"uint8x{CODES}"))
            words = T.meta_var(e4m3_words.k_order_words(
                codes, tables[0], tables[1], sc[row // TN, cp * i64(2)],
                sc[row // TN, cp * i64(2) + i64(1)]))
            wn[T.ramp(c * K + cp * i64(CODES), 1, CODES // 2)] = words[0]
            wn[T.ramp(c * K + cp * i64(CODES) + i64(CODES // 2), 1, CODES // 2)] = words[1]

    @T.macro
    def body(x, w, sc, y, m):
        with T.attr(T.int32(0), *with_bf16_dot()):
            if sc is not None:  # static: the E4M3 -> bf16 lookup table
                tbl = T.alloc_buffer((256,), "uint8")
                e4m3_words.e4m3_bf16_table(tbl)
            xt = T.alloc_buffer((((m + MB - i64(1)) // MB) * G * KP * MB,), "uint32")
            for rb in T.parallel((m + MB - i64(1)) // MB):
                for g, gr, kp, r in T.grid(G, MB // i64(GROUP), KP, i64(GROUP)):
                    row = T.meta_var(T.min(rb * MB + gr * GROUP + r, m - i64(1)))
                    xt[(((rb * G + g) * (MB // i64(GROUP)) + gr) * KP + kp) * i64(GROUP) + r] = \
                        T.Select(rb * MB + gr * GROUP + r < m,
                                 bits(x[row, g, kp * 2]) | (bits(x[row, g, kp * 2 + 1])
                                                            << u32(16)),
                                 u32(0))
            for task in T.parallel(((m + MB - i64(1)) // MB) * G * NT):
                acc = T.alloc_buffer((ACCS * LANES,), "float32")  # registers
                out = T.alloc_buffer((ACCS * LANES,), "float32")
                rb = T.meta_var(task // (G * NT))
                g = T.meta_var(task // NT % G)
                p = T.meta_var(task % NT)
                if sc is not None:  # static: the FP8 tile decoded once for the task's rows
                    wn = T.alloc_buffer((TN * K,), "uint16")
                    decode_tile(w, sc, e4m3_words.table_vectors(tbl), wn, g, p)
                else:
                    wn = T.meta_var(None)
                for gr in range(MB // i64(GROUP)):
                    if rb * MB + gr * GROUP < m:
                        for cq in range(TN // i64(TILE_COLS)):
                            for a in T.unroll(ACCS):
                                acc[T.ramp(a * LANES, 1, LANES)] = T.broadcast(T.float32(0),
                                                                               LANES)
                            for kp in range(KP):
                                for v in T.unroll(ROW_VECS):
                                    for c in T.unroll(TILE_COLS):
                                        acc[T.ramp((v * TILE_COLS + c) * LANES, 1, LANES)] = \
                                            dpbf16ps(
                                                acc[T.ramp((v * TILE_COLS + c) * LANES, 1,
                                                           LANES)],
                                                T.reinterpret("uint16x32", xt[T.ramp(
                                                    (((rb * G + g) * (MB // i64(GROUP)) + gr)
                                                     * KP + kp) * i64(GROUP) + v * LANES, 1,
                                                    LANES)]),
                                                T.reinterpret("uint16x32", T.broadcast(
                                                    wpair(w, wn, g, p, cq, c, kp), LANES)))
                            for a in T.unroll(ACCS):
                                out[T.ramp(a * LANES, 1, LANES)] = acc[T.ramp(a * LANES, 1,
                                                                              LANES)]
                            for v, c, r in T.grid(ROW_VECS, TILE_COLS, LANES):
                                row = T.meta_var(rb * MB + gr * GROUP + v * LANES + r)
                                col = T.meta_var(p * TN + cq * TILE_COLS + c)
                                if row < m and col < N:
                                    y[row, g, col] = stored(out[(v * TILE_COLS + c) * LANES + r])

    return dense_gemv_func(body, groups=groups, n=n, k=k, out_dtype=out_dtype, fp8=fp8)
