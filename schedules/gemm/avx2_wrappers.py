"""The hand-vectorised decode GEMV's kernels (`avx2_gemv.make_fp8_gemv_avx2`): its macros
(`Avx2GemvStages`) inside `fp8_linear`'s and `dense_gemv`'s signatures, and the fused forms
`make_fp8_gemv_bf16` also has: the input RMS-normed or formed as a SwiGLU first, or two
matrices over one quantised activation. Each fused form is the kernels it replaces in turn, bit
for bit: the same arithmetic on the same values (`common.stages.rms_norm_row`, the norm
kernel's; `common.silu_times`, the MoE epilogue's and the lowering's SwiGLU)."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import bf16_to_f32, i64, round_bf16_bound, silu_times
from dsv41.schedules.common.stages import rms_norm_row
from dsv41.schedules.gemm.dense_dot import dense_gemv_func


@dataclass(frozen=True)
class Avx2GemvStages:
    """`avx2_gemv.fp8_gemv_avx2_stages`' macros for one configuration: `body(xq, weight, scale,
    y, m)` (the tiles of one matrix over the prepared rows), `quantise(x, xn, amax, xq, m)`
    (fp8_linear: each row of x bf16, or of the staged fp32 rows xn, quantised), `widen(x, xq,
    m)` (dense_gemv: x as it is); n, k, kb, nb the weight's shape and 32-blocks, nw its rows
    (groups x n), g the groups (1 but in the dense form), as int64 immediates."""

    body: object
    quantise: object
    widen: object
    n: object
    k: object
    kb: object
    nb: object
    nw: object
    g: object
    out_dtype: str


def fp8_linear_func(st: Avx2GemvStages) -> tvm.tirx.PrimFunc:
    """fp8_linear's signature: x quantised, then the tiles."""
    N, K, KB, NB = st.n, st.k, st.kb, st.nb

    @T.prim_func
    def fp8_gemv(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), st.out_dtype)
        amax = T.alloc_buffer((m, KB), "float32")
        xq = T.alloc_buffer((m, K), "float32")  # per chunk in the slot order
        st.quantise(x, None, amax, xq, m)
        st.body(xq, weight, scale, y, m)

    return fp8_gemv


def normed_quantise(st: Avx2GemvStages, eps: float, lanes: int):
    """A macro (x, nw, xq, m): each row of x (bf16 [m, k]) RMS-normed by nw as the rms_norm
    kernel of `lanes` partial sums forms it (bf16 values), then quantised into xq."""
    norm_row = rms_norm_row(vec=1)
    K, KB = st.k, st.kb

    @T.macro
    def normed_quantise_(x, nw, xq, m):
        xn = T.alloc_buffer((m, K), "float32")  # the normed rows (bf16 values)
        part = T.alloc_buffer((i64(lanes),), "float32")
        ssq = T.alloc_buffer((1,), "float32")
        for i in range(m):
            norm_row(xn, lambda c, i=i: (i, c), part, ssq, lambda c, i=i: bf16_to_f32(x[i, c]),
                     nw, int(K), eps, lanes)
        amax = T.alloc_buffer((m, KB), "float32")
        st.quantise(x, xn, amax, xq, m)

    return normed_quantise_


def norm_func(st: Avx2GemvStages, eps: float, lanes: int) -> tvm.tirx.PrimFunc:
    """norm_fp8_linear's signature (x, norm weight [k] bf16, weight, scale, y): each row
    bf16(w * (x * rstd)) as the rms_norm kernel of `lanes` partial sums forms it, then
    fp8_linear's kernel on it."""
    N, K, KB, NB = st.n, st.k, st.kb, st.nb
    prepare = normed_quantise(st, eps, lanes)

    @T.prim_func
    def norm_fp8_gemv(x_h: T.handle, nw: T.Buffer((K,), "bfloat16"),
                      weight: T.Buffer((N, K), "uint8"), scale: T.Buffer((NB, KB), "uint8"),
                      y_h: T.handle):
        T.func_attr({"global_symbol": "norm_fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), st.out_dtype)
        xq = T.alloc_buffer((m, K), "float32")
        prepare(x, nw, xq, m)
        st.body(xq, weight, scale, y, m)

    return norm_fp8_gemv


def swiglu_func(st: Avx2GemvStages, limit: float) -> tvm.tirx.PrimFunc:
    """swiglu_fp8_linear's signature (gate, up, weight, scale, y): each element
    bf16(swiglu(gate, up, limit)) (`silu_times`), then fp8_linear's kernel on it."""
    N, K, KB, NB = st.n, st.k, st.kb, st.nb

    @T.prim_func
    def swiglu_fp8_gemv(gate_h: T.handle, up_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                        scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "swiglu_fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        gate = T.match_buffer(gate_h, (m, K), "bfloat16")
        up = T.match_buffer(up_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), st.out_dtype)
        xn = T.alloc_buffer((m, K), "float32")  # the SwiGLU rows (bf16 values)
        for i, c0 in T.grid(m, K // i64(8)):
            for c1 in T.vectorized(8):
                xn[i, c0 * 8 + c1] = round_bf16_bound(silu_times(
                    bf16_to_f32(gate[i, c0 * 8 + c1]), bf16_to_f32(up[i, c0 * 8 + c1]), limit))
        amax = T.alloc_buffer((m, KB), "float32")
        xq = T.alloc_buffer((m, K), "float32")
        st.quantise(gate, xn, amax, xq, m)
        st.body(xq, weight, scale, y, m)

    return swiglu_fp8_gemv


def pair_func(st: Avx2GemvStages, st2: Avx2GemvStages) -> tvm.tirx.PrimFunc:
    """fp8_linear_pair's signature (x, weight, scale, weight2, scale2, y, y2): x quantised
    once, then each matrix's tiles (`st2`: the second's stages, over the same k)."""
    N, K, KB, NB = st.n, st.k, st.kb, st.nb
    N2, NB2 = st2.n, st2.nb

    @T.prim_func
    def fp8_gemv_pair(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                      scale: T.Buffer((NB, KB), "uint8"), weight2: T.Buffer((N2, K), "uint8"),
                      scale2: T.Buffer((NB2, KB), "uint8"), y_h: T.handle, y2_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear_pair", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), st.out_dtype)
        y2 = T.match_buffer(y2_h, (m, N2), st.out_dtype)
        amax = T.alloc_buffer((m, KB), "float32")
        xq = T.alloc_buffer((m, K), "float32")
        st.quantise(x, None, amax, xq, m)
        st.body(xq, weight, scale, y, m)
        st2.body(xq, weight2, scale2, y2, m)

    return fp8_gemv_pair


def dense_func(st: Avx2GemvStages, *, bf16w: bool) -> tvm.tirx.PrimFunc:
    """dense_gemv's signature (`dense_dot.dense_gemv_func`: an FP8 weight and its scales, or a
    bf16 one; fp32 y, or bf16 rounded as the graph rounds it): x widened as it is, then the
    tiles."""
    G, K = st.g, st.k

    @T.macro
    def body(x, w, sc, y, m):
        xq = T.alloc_buffer((m * G, K), "float32")  # per chunk in the slot order
        st.widen(x, xq, m)
        st.body(xq, w, sc, y, m)

    return dense_gemv_func(body, groups=int(st.g), n=int(st.n), k=int(st.k),
                           out_dtype=st.out_dtype, fp8=not bf16w)


def q_kv_func(pair: tuple[Avx2GemvStages, Avx2GemvStages], qb: Avx2GemvStages, eps: float,
              lanes: int) -> tvm.tirx.PrimFunc:
    """fp8_q_kv's signature (x, wq_a, its scales, wkv, its scales, q_norm [n_q] bf16, wq_b, its
    scales, q_lora, kv, q): `pair_func`'s body (wq_a and wkv over x quantised once), then
    `norm_func`'s over q_lora (wq_b, `qb`, k = n_q): both kernels in turn, one call."""
    sa, skv = pair
    NQ, NKV, K, KB, NBQ, NBKV = sa.n, skv.n, sa.k, sa.kb, sa.nb, skv.nb
    NB_, KBB, NBB = qb.n, qb.kb, qb.nb
    prepare = normed_quantise(qb, eps, lanes)

    @T.prim_func
    def fp8_q_kv(x_h: T.handle, wa: T.Buffer((NQ, K), "uint8"), sa_: T.Buffer((NBQ, KB), "uint8"),
                 wkv: T.Buffer((NKV, K), "uint8"), skv_: T.Buffer((NBKV, KB), "uint8"),
                 nw: T.Buffer((NQ,), "bfloat16"), wb: T.Buffer((NB_, NQ), "uint8"),
                 sb: T.Buffer((NBB, KBB), "uint8"), q_lora_h: T.handle, kv_h: T.handle,
                 q_h: T.handle):
        T.func_attr({"global_symbol": "fp8_q_kv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        q_lora = T.match_buffer(q_lora_h, (m, NQ), "bfloat16")
        kv = T.match_buffer(kv_h, (m, NKV), "bfloat16")
        q = T.match_buffer(q_h, (m, NB_), "bfloat16")
        amax = T.alloc_buffer((m, KB), "float32")
        xq = T.alloc_buffer((m, K), "float32")
        sa.quantise(x, None, amax, xq, m)
        sa.body(xq, wa, sa_, q_lora, m)
        skv.body(xq, wkv, skv_, kv, m)
        bq = T.alloc_buffer((m, NQ), "float32")
        prepare(q_lora, nw, bq, m)
        qb.body(bq, wb, sb, q, m)

    return fp8_q_kv
