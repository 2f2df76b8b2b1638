"""The generic index-key sweep (block definition + schedule) and the TIR helpers every
sweep shares: key decode, the oracle's per-head term, torch's head-sum chunk order, score-row
padding."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.schedules.common import (
    fp4_to_f32_select,
    round_bf16,
)

SCORE_PAD = 128  # score rows are padded to a multiple of this (every CPU/GPU tile divides it)
HEAD_CHUNK = 16  # torch's CPU sum reduces rows in sequential chunks of 16 (ATen multi_row_sum)
MAX_ALT = 3  # alternate index-K stores the shared sweep takes (`index_scores_shared`)


# ---- TIR expression helpers ------------------------------------------------------------------


def e8m0(b):
    """E8M0 byte (uint32) -> 2^(b-127); code 0 is 2^-127, 0xff NaN (as formats.py)."""
    val = T.reinterpret("float32", b << T.uint32(23))
    val = T.Select(b == T.uint32(0), T.reinterpret("float32", T.uint32(0x00400000)), val)
    return T.Select(b == T.uint32(0xFF), T.reinterpret("float32", T.uint32(0x7FC00000)), val)


def decode_key(KP, KS, vb, pos, vd):
    """Index-key element (b, pos, d) -> fp32 (exact)."""
    byte = T.Cast("uint32", KP[vb, pos, vd // 2])
    nib = (byte >> T.Cast("uint32", (vd % 2) * 4)) & T.uint32(15)
    return fp4_to_f32_select(nib) * e8m0(T.Cast("uint32", KS[vb, pos, vd // 32]))


def decode_key_shared(KPs, KSs, pk, vb, pos, vd):
    """`decode_key` from the store the pick `pk` (a query token's) names: KPs[0] (own) or an
    alternate; a pick outside 1..len(KPs) - 1 reads the own store. Conditional loads
    (if_then_else): only the named store is read."""
    byte = KPs[0][vb, pos, vd // 2]
    scale = KSs[0][vb, pos, vd // 32]
    for i in range(1, len(KPs)):
        use = pk == T.int64(i)
        byte = T.if_then_else(use, KPs[i][vb, pos, vd // 2], byte)
        scale = T.if_then_else(use, KSs[i][vb, pos, vd // 32], scale)
    nib = (T.Cast("uint32", byte) >> T.Cast("uint32", (vd % 2) * 4)) & T.uint32(15)
    return fp4_to_f32_select(nib) * e8m0(T.Cast("uint32", scale))


def check_alt(n_alt: int) -> None:
    if not 0 <= n_alt <= MAX_ALT:
        raise ValueError(f"n_alt must lie in 0..{MAX_ALT} (alternate index-K stores a sweep can "
                         f"read); got {n_alt}.")


def neg_inf_bf16():
    """bf16 -inf from its bits (the CUDA codegen prints a float -inf literal as `-inff`)."""
    return T.reinterpret("bfloat16", T.uint16(0xFF80))


def pad_expr(n):
    """Row length of a score buffer: n rounded up to SCORE_PAD."""
    return (n + T.int64(SCORE_PAD - 1)) // T.int64(SCORE_PAD) * T.int64(SCORE_PAD)


def head_term(dot, W, vb, vs, h, vt):
    """bf16(relu(bf16(dot)) * w): the oracle's per-head term, as an exact fp32 value."""
    return round_bf16(T.max(round_bf16(dot[vb, vs, h, vt]), T.float32(0))
                      * T.Cast("float32", W[vb, vs, h]))


def chunk_sum(part, vb, vs, vt, n_chunks):
    """Chunk partial sums added in order from +0, as ATen's multi_row_sum does."""
    acc = T.float32(0)
    for c in range(n_chunks):
        acc = acc + part[vb, vs, c, vt]
    return acc


def head_chunks(heads: int) -> tuple[int, int]:
    """(chunk size, chunk count) for the head sum; torch's order is expressible with equal chunks
    only when heads < 16 or heads is a multiple of 16 (below 256, where ATen adds a level)."""
    if heads < HEAD_CHUNK:
        return heads, 1
    if heads % HEAD_CHUNK or heads >= HEAD_CHUNK**2:
        raise ValueError(f"heads must be below {HEAD_CHUNK} or a multiple of {HEAD_CHUNK} "
                         f"below {HEAD_CHUNK**2} to reproduce torch's head-sum order; got {heads}.")
    return HEAD_CHUNK, heads // HEAD_CHUNK


def check_dim(dim: int) -> None:
    if dim <= 0 or dim % fmt.MXFP4_BLOCK:
        raise ValueError(f"dim must be a positive multiple of {fmt.MXFP4_BLOCK}; got {dim}.")


# ---- sweeps ----------------------------------------------------------------------------------


def make_index_scores(*, heads: int, dim: int, n_alt: int = 0) -> tvm.tirx.PrimFunc:
    """Full sweep: (q, k_packed, k_scales, weights, lens) -> scores bf16 [b, s, pad(T)], equal
    to `ops.index_scores` on [..., :T] and -inf past T. Symbolic b, s, T.

    `n_alt` > 0 (1..MAX_ALT): `index_scores_shared`, (q, k_packed, k_scales, alt_packed_1,
    alt_scales_1, ..., alt_packed_MAX_ALT, alt_scales_MAX_ALT, pick, weights, lens) -> scores,
    equal to `ops.indexer_topk_shared`'s sweep: query (b, s) reads row b's own keys where
    pick[b, s] = 0 and the first T rows of alternate pick[b, s] otherwise (the released shared
    index-K pointer, per token: a verify pass's tokens may differ), without copying any of them.
    A pick outside 1..n_alt reads the own store (the host validates picks: `ops.check_pick`).
    Slots past n_alt are never read (the lowering passes the own store). Here the keys are
    decoded per query token (the CPU schedule decodes a tile per token, not per row)."""
    check_dim(dim)
    check_alt(n_alt)
    che, nc = head_chunks(heads)
    H, D, C, NC = T.int64(heads), T.int64(dim), T.int64(che), T.int64(nc)

    @T.prim_func(s_tir=True)
    def index_scores(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                     lens_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "index_scores", "tirx.noalias": True})
        b, s, t = T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, pad_expr(t)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, pad_expr(t), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, pad_expr(t)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, pad_expr(t)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2 in T.grid(b, pad_expr(t), D):
            with T.sblock("k_dec"):  # padded rows decode entry T-1 again (never selected)
                vb, vt, vd = T.axis.remap("SSS", [i0, i1, i2])
                kd[vb, vt, vd] = decode_key(KP, KS, vb, T.min(vt, t - T.int64(1)), vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, pad_expr(t), D):
            with T.sblock("dot"):
                vb, vs, vh, vt, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vt] = T.float32(0)
                dot[vb, vs, vh, vt] = dot[vb, vs, vh, vt] + qf[vb, vs, vh, vd] * kd[vb, vt, vd]
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, pad_expr(t), C):
            with T.sblock("chunk"):
                vb, vs, vc, vt, vj = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vt] = T.float32(0)
                part[vb, vs, vc, vt] = part[vb, vs, vc, vt] + head_term(dot, W, vb, vs, vc * C + vj,
                                                                    vt)
        for i0, i1, i2 in T.grid(b, s, pad_expr(t)):
            with T.sblock("score"):
                vb, vs, vt = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vt] = T.Select(vt < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", chunk_sum(part, vb, vs, vt, nc)),
                                         neg_inf_bf16())

    @T.prim_func(s_tir=True)
    def index_scores_shared(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, a1_h: T.handle,
                            s1_h: T.handle, a2_h: T.handle, s2_h: T.handle, a3_h: T.handle,
                            s3_h: T.handle, pick_h: T.handle, w_h: T.handle, lens_h: T.handle,
                            out_h: T.handle):
        T.func_attr({"global_symbol": "index_scores_shared", "tirx.noalias": True})
        b, s, t = T.int64(), T.int64(), T.int64()
        t1, t2, t3 = T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        A1 = T.match_buffer(a1_h, (b, t1, D // 2), "uint8")
        S1 = T.match_buffer(s1_h, (b, t1, D // 32), "uint8")
        A2 = T.match_buffer(a2_h, (b, t2, D // 2), "uint8")
        S2 = T.match_buffer(s2_h, (b, t2, D // 32), "uint8")
        A3 = T.match_buffer(a3_h, (b, t3, D // 2), "uint8")
        S3 = T.match_buffer(s3_h, (b, t3, D // 32), "uint8")
        PK = T.match_buffer(pick_h, (b, s), "int64")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, pad_expr(t)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, s, pad_expr(t), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, pad_expr(t)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, pad_expr(t)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2, i3 in T.grid(b, s, pad_expr(t), D):
            with T.sblock("k_dec"):  # padded rows decode entry T-1 again (never selected)
                vb, vs, vt, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                kd[vb, vs, vt, vd] = decode_key_shared(
                    (KP, A1, A2, A3)[: n_alt + 1], (KS, S1, S2, S3)[: n_alt + 1], PK[vb, vs],
                    vb, T.min(vt, t - T.int64(1)), vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, pad_expr(t), D):
            with T.sblock("dot"):
                vb, vs, vh, vt, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vt] = T.float32(0)
                dot[vb, vs, vh, vt] = dot[vb, vs, vh, vt] + qf[vb, vs, vh, vd] * kd[vb, vs, vt,
                                                                                     vd]
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, pad_expr(t), C):
            with T.sblock("chunk"):
                vb, vs, vc, vt, vj = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vt] = T.float32(0)
                part[vb, vs, vc, vt] = part[vb, vs, vc, vt] + head_term(dot, W, vb, vs, vc * C + vj,
                                                                    vt)
        for i0, i1, i2 in T.grid(b, s, pad_expr(t)):
            with T.sblock("score"):
                vb, vs, vt = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vt] = T.Select(vt < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", chunk_sum(part, vb, vs, vt, nc)),
                                         neg_inf_bf16())


    if n_alt:
        return index_scores_shared
    return index_scores


def part_sum(part, e, n_chunks):
    """`chunk_sum` over a [chunk, entry] buffer."""
    acc = T.float32(0)
    for c in range(n_chunks):
        acc = acc + part[c, e]
    return acc


def padded(n: int) -> int:
    """Length of a score row for n entries (n rounded up to SCORE_PAD)."""
    return -(-n // SCORE_PAD) * SCORE_PAD
