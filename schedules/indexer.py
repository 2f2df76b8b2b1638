"""The indexer kernels: the MXFP4 index-key sweep and the exact top-k selections behind
`indexer_topk`, `hier_topk` and `pool_topk` (graph/ops.py).

Each op is two or three PrimFuncs, which Relax calls in sequence:

- a SWEEP writes bf16 scores, bit-identical to `ops.index_scores` (the pool sweep scores only the
  pool's B * block_size positions per query);
- a SELECT turns scores into positions (or candidate blocks): top-k, ties to the lower position,
  -inf dropped, ascending, -1 padded.

Numerics of the sweep (why the scores are bit-exact): q and the decoded keys are E2M1 x 2^e, so
every product is exact in fp32 and a D-long dot product is exact as long as the product exponents
span fewer than ~9 binades (true for the model's data; then summation order cannot matter); it is
rounded once to bf16 like the oracle's bf16 einsum (fp32 accumulate). relu, times the bf16 weight
(exact fp32 product) rounded to bf16, then the head sum in fp32 in torch's CPU reduction order:
sequential sums over chunks of 16 heads, chunk sums added in order (ATen's `multi_row_sum`), and one
final rounding to bf16. Outside that exponent span the oracle's own GEMM order decides ties at a
bf16 rounding boundary, which a kernel cannot reproduce.

The selection is exact: bf16 scores map to order-preserving 16-bit keys, so a two-pass radix
histogram (high byte, then low byte) finds the k-th key exactly; a final in-order scan emits every
entry above it plus the lowest-position entries equal to it, which yields the positions already
ascending and the tie rule for free. No sort is needed. On CPU a parallel, vectorised pass first
takes the maximum of every group of 32 entries; the k-th largest group maximum bounds the k-th
largest entry from below, so the radix passes and the emit visit only the groups that reach it
(about k groups: 0.7 ms instead of 20 ms for one 1M-entry row).

The CPU full sweep on AVX-512 is hand-vectorised (`make_index_scores_avx512`): a GEMM per key
tile with the FP4 keys decoded once per tile by an in-register transpose and a 16-entry table
lookup; with VNNI the GEMM is on int8 (q is E2M1 x 2^e per block after its QDQ, so it is int8 x
2^e exactly; per-block integer dots are exact, hence the same bits), falling back to fp32 for a q
that is not. Everywhere else (pool sweep, CUDA, CPUs without AVX-512) the sweep is the block
definition below plus a schedule.

Scores are written over T rounded up to SCORE_PAD (entries past T are -inf), so every tile of the
sweep is whole: no predicates in the vector loops and compact per-tile buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import amx as amx_instr
from dsv41.schedules.common import (
    amx_configure,
    fp4_to_f32_select,
    has_avx512,
    has_features,
    permps,
    round_bf16,
    round_bf16_finite,
)

SCORE_PAD = 128  # score rows are padded to a multiple of this (every CPU/GPU tile divides it)
HEAD_CHUNK = 16  # torch's CPU sum reduces rows in sequential chunks of 16 (ATen multi_row_sum)
NEG_KEY = 0x007F  # order key of bf16 -inf
POS_INF_KEY = 0xFF80  # order key of bf16 +inf (the pinned newest block)
MAX_ALT = 3  # alternate index-K stores the shared sweep takes (`index_scores_shared`)
AMX_TILE = 32  # AMX sweep: entries per tile (2 tiles of 16 columns)
AMX_HEADS = 32  # AMX sweep: heads per pass (2 tiles of 16 rows; 4 accumulator tiles)


# ---- TIR expression helpers ------------------------------------------------------------------


def _e8m0(b):
    """E8M0 byte (uint32) -> 2^(b-127); code 0 is 2^-127, 0xff NaN (as formats.py)."""
    val = T.reinterpret("float32", b << T.uint32(23))
    val = T.Select(b == T.uint32(0), T.reinterpret("float32", T.uint32(0x00400000)), val)
    return T.Select(b == T.uint32(0xFF), T.reinterpret("float32", T.uint32(0x7FC00000)), val)


def _decode(KP, KS, vb, pos, vd):
    """Index-key element (b, pos, d) -> fp32 (exact)."""
    byte = T.Cast("uint32", KP[vb, pos, vd // 2])
    nib = (byte >> T.Cast("uint32", (vd % 2) * 4)) & T.uint32(15)
    return fp4_to_f32_select(nib) * _e8m0(T.Cast("uint32", KS[vb, pos, vd // 32]))


def _decode_shared(KPs, KSs, PK, vb, pos, vd):
    """`_decode` from the store pick[vb] names: KPs[0] (own) or an alternate. Conditional loads
    (if_then_else): only the named store is read."""
    byte = KPs[0][vb, pos, vd // 2]
    scale = KSs[0][vb, pos, vd // 32]
    for i in range(1, len(KPs)):
        use = PK[vb] == T.int64(i)
        byte = T.if_then_else(use, KPs[i][vb, pos, vd // 2], byte)
        scale = T.if_then_else(use, KSs[i][vb, pos, vd // 32], scale)
    nib = (T.Cast("uint32", byte) >> T.Cast("uint32", (vd % 2) * 4)) & T.uint32(15)
    return fp4_to_f32_select(nib) * _e8m0(T.Cast("uint32", scale))


def _check_alt(n_alt: int) -> None:
    if not 0 <= n_alt <= MAX_ALT:
        raise ValueError(f"n_alt must lie in 0..{MAX_ALT} (alternate index-K stores a sweep can "
                         f"read); got {n_alt}.")


def _neg_inf_bf16():
    """bf16 -inf from its bits (the CUDA codegen prints a float -inf literal as `-inff`)."""
    return T.reinterpret("bfloat16", T.uint16(0xFF80))


def _pad(n):
    """Row length of a score buffer: n rounded up to SCORE_PAD."""
    return (n + T.int64(SCORE_PAD - 1)) // T.int64(SCORE_PAD) * T.int64(SCORE_PAD)


def _term(dot, W, vb, vs, h, vt):
    """bf16(relu(bf16(dot)) * w): the oracle's per-head term, as an exact fp32 value."""
    return round_bf16(T.max(round_bf16(dot[vb, vs, h, vt]), T.float32(0))
                      * T.Cast("float32", W[vb, vs, h]))


def _chunk_sum(part, vb, vs, vt, n_chunks):
    """Chunk partial sums added in order from +0, as ATen's multi_row_sum does."""
    acc = T.float32(0)
    for c in range(n_chunks):
        acc = acc + part[vb, vs, c, vt]
    return acc


def _key(v):
    """bf16 value -> uint32 order key (larger key = larger value; -0 and +0 equal)."""
    u = T.Cast("uint32", T.reinterpret("uint16", v))
    return T.Select(u == T.uint32(0x8000), T.uint32(0x8000),
                    T.Select(u >= T.uint32(0x8000), T.uint32(0xFFFF) - u, u + T.uint32(0x8000)))


def _head_chunks(heads: int) -> tuple[int, int]:
    """(chunk size, chunk count) for the head sum; torch's order is expressible with equal chunks
    only when heads < 16 or heads is a multiple of 16 (below 256, where ATen adds a level)."""
    if heads < HEAD_CHUNK:
        return heads, 1
    if heads % HEAD_CHUNK or heads >= HEAD_CHUNK**2:
        raise ValueError(f"heads must be below {HEAD_CHUNK} or a multiple of {HEAD_CHUNK} "
                         f"below {HEAD_CHUNK**2} to reproduce torch's head-sum order; got {heads}.")
    return HEAD_CHUNK, heads // HEAD_CHUNK


def _check_dim(dim: int) -> None:
    if dim <= 0 or dim % fmt.MXFP4_BLOCK:
        raise ValueError(f"dim must be a positive multiple of {fmt.MXFP4_BLOCK}; got {dim}.")


# ---- sweeps ----------------------------------------------------------------------------------


def make_index_scores(*, heads: int, dim: int, n_alt: int = 0) -> tvm.tirx.PrimFunc:
    """Full sweep: (q, k_packed, k_scales, weights, lens) -> scores bf16 [b, s, pad(T)], equal
    to `ops.index_scores` on [..., :T] and -inf past T. Symbolic b, s, T.

    `n_alt` > 0 (1..MAX_ALT): `index_scores_shared`, (q, k_packed, k_scales, alt_packed_1,
    alt_scales_1, ..., alt_packed_MAX_ALT, alt_scales_MAX_ALT, pick, weights, lens) -> scores,
    equal to `ops.indexer_topk_shared`'s sweep: row b reads its own keys where pick[b] = 0 and the
    first T rows of alternate pick[b] otherwise (the released shared index-K pointer), without
    copying any of them. Slots past n_alt are never read (the lowering passes the own store)."""
    _check_dim(dim)
    _check_alt(n_alt)
    che, nc = _head_chunks(heads)
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
        O = T.match_buffer(out_h, (b, s, _pad(t)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, _pad(t), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, _pad(t)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, _pad(t)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2 in T.grid(b, _pad(t), D):
            with T.sblock("k_dec"):  # padded rows decode entry T-1 again (never selected)
                vb, vt, vd = T.axis.remap("SSS", [i0, i1, i2])
                kd[vb, vt, vd] = _decode(KP, KS, vb, T.min(vt, t - T.int64(1)), vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, _pad(t), D):
            with T.sblock("dot"):
                vb, vs, vh, vt, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vt] = T.float32(0)
                dot[vb, vs, vh, vt] = dot[vb, vs, vh, vt] + qf[vb, vs, vh, vd] * kd[vb, vt, vd]
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, _pad(t), C):
            with T.sblock("chunk"):
                vb, vs, vc, vt, vj = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vt] = T.float32(0)
                part[vb, vs, vc, vt] = part[vb, vs, vc, vt] + _term(dot, W, vb, vs, vc * C + vj,
                                                                    vt)
        for i0, i1, i2 in T.grid(b, s, _pad(t)):
            with T.sblock("score"):
                vb, vs, vt = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vt] = T.Select(vt < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", _chunk_sum(part, vb, vs, vt, nc)),
                                         _neg_inf_bf16())

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
        PK = T.match_buffer(pick_h, (b,), "int64")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, _pad(t)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, _pad(t), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, _pad(t)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, _pad(t)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2 in T.grid(b, _pad(t), D):
            with T.sblock("k_dec"):  # padded rows decode entry T-1 again (never selected)
                vb, vt, vd = T.axis.remap("SSS", [i0, i1, i2])
                kd[vb, vt, vd] = _decode_shared(
                    (KP, A1, A2, A3)[: n_alt + 1], (KS, S1, S2, S3)[: n_alt + 1], PK, vb,
                    T.min(vt, t - T.int64(1)), vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, _pad(t), D):
            with T.sblock("dot"):
                vb, vs, vh, vt, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vt] = T.float32(0)
                dot[vb, vs, vh, vt] = dot[vb, vs, vh, vt] + qf[vb, vs, vh, vd] * kd[vb, vt, vd]
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, _pad(t), C):
            with T.sblock("chunk"):
                vb, vs, vc, vt, vj = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vt] = T.float32(0)
                part[vb, vs, vc, vt] = part[vb, vs, vc, vt] + _term(dot, W, vb, vs, vc * C + vj,
                                                                    vt)
        for i0, i1, i2 in T.grid(b, s, _pad(t)):
            with T.sblock("score"):
                vb, vs, vt = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vt] = T.Select(vt < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", _chunk_sum(part, vb, vs, vt, nc)),
                                         _neg_inf_bf16())


    if n_alt:
        return index_scores_shared
    return index_scores


def _pool_block(BL, vb, vs, vj, nb, bs):
    """Block id of pool entry j of query (vb, vs) (-1 past the pool's nb blocks)."""
    return T.Select(vj < nb * bs, BL[vb, vs, T.min(vj // bs, nb - T.int64(1))], -1)


def _pool_position(BL, vb, vs, vj, nb, bs):
    """Key position of pool entry j: its block times bs plus j's offset in the block."""
    return T.Cast("int64", _pool_block(BL, vb, vs, vj, nb, bs)) * bs + vj % bs


def _pool_row(BL, vb, vs, vj, nb, bs, t):
    """The key row entry j reads: its position clamped into the store of t rows (an invalid
    entry reads a valid row and is masked by `_pool_visible`)."""
    return T.max(T.min(_pool_position(BL, vb, vs, vj, nb, bs), t - T.int64(1)), T.int64(0))


def _pool_visible(BL, L, vb, vs, vj, nb, bs, t):
    """Entry j is scored: its block is not -1 and its position is visible (below lens and t)."""
    return (_pool_block(BL, vb, vs, vj, nb, bs) >= 0) \
        & (_pool_position(BL, vb, vs, vj, nb, bs) < T.min(L[vb, vs], t))


def make_pool_scores(*, heads: int, dim: int, block_size: int) -> tvm.tirx.PrimFunc:
    """Pool sweep: (q, k_packed, k_scales, weights, lens, blocks) -> scores bf16
    [b, s, pad(B * block_size)]; entry j is position blocks[j // bs] * bs + j % bs, -inf where
    the block is -1 or the position is not visible. Only the pool is decoded and scored."""
    _check_dim(dim)
    che, nc = _head_chunks(heads)
    H, D, C, NC = T.int64(heads), T.int64(dim), T.int64(che), T.int64(nc)
    BS = T.int64(block_size)

    @T.prim_func(s_tir=True)
    def pool_scores(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                    lens_h: T.handle, blocks_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "pool_scores", "tirx.noalias": True})
        b, s, t, nb = T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
        O = T.match_buffer(out_h, (b, s, _pad(nb * BS)), "bfloat16")
        qf = T.sblock_alloc_buffer((b, s, H, D), "float32")
        kd = T.sblock_alloc_buffer((b, s, _pad(nb * BS), D), "float32")
        dot = T.sblock_alloc_buffer((b, s, H, _pad(nb * BS)), "float32")
        part = T.sblock_alloc_buffer((b, s, NC, _pad(nb * BS)), "float32")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("q_f32"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                qf[vb, vs, vh, vd] = T.Cast("float32", Q[vb, vs, vh, vd])
        for i0, i1, i2, i3 in T.grid(b, s, _pad(nb * BS), D):
            with T.sblock("k_dec"):  # invalid entries decode a clamped position (masked later)
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                kd[vb, vs, vj, vd] = _decode(
                    KP, KS, vb, _pool_row(BL, vb, vs, vj, nb, BS, t),
                    vd)
        for i0, i1, i2, i3, i4 in T.grid(b, s, H, _pad(nb * BS), D):
            with T.sblock("dot"):
                vb, vs, vh, vj, vd = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    dot[vb, vs, vh, vj] = T.float32(0)
                dot[vb, vs, vh, vj] = (dot[vb, vs, vh, vj]
                                       + qf[vb, vs, vh, vd] * kd[vb, vs, vj, vd])
        for i0, i1, i2, i3, i4 in T.grid(b, s, NC, _pad(nb * BS), C):
            with T.sblock("chunk"):
                vb, vs, vc, vj, vk = T.axis.remap("SSSSR", [i0, i1, i2, i3, i4])
                with T.init():
                    part[vb, vs, vc, vj] = T.float32(0)
                part[vb, vs, vc, vj] = part[vb, vs, vc, vj] + _term(dot, W, vb, vs, vc * C + vk,
                                                                    vj)
        for i0, i1, i2 in T.grid(b, s, _pad(nb * BS)):
            with T.sblock("score"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vj] = T.Select(
                    _pool_visible(BL, L, vb, vs, vj, nb, BS, t),
                    T.Cast("bfloat16", _chunk_sum(part, vb, vs, vj, nc)),
                    _neg_inf_bf16())

    return pool_scores


# ---- the pool sweep as a gather + the AVX-512 full sweep + a mask (CPU with AVX-512) -----------
#
# The pool's B * block_size positions are gathered into a contiguous key store per query (1.1 MB
# at the released pool of 2048 x 8 and dim 128), the hand-vectorised full sweep scores it
# (each (b, s) query a batch row of its own, every gathered entry visible), and a mask puts -inf
# where the block is -1 or the position is not visible. Each score depends only on q, the key
# and the weights, and both sweeps are bit-identical to `ops.index_scores`, so the result is the
# bits of `make_pool_scores`; the scheduled pool sweep decoded keys into fp32 per tile and ran
# the dot in fp32 (11.5 ms per call on the bench preset, 2 cores) where the full sweep's int8
# dot runs at ~1M entries per 30 ms.


def pool_gathers(target: TargetSpec, *, heads: int, dim: int) -> bool:
    """Whether pool_scores lowers to the gather chain on `target` (`emit_pool_scores`)."""
    return sweep_config(target, heads=heads, dim=dim).avx512


def make_pool_gather(*, heads: int, dim: int, block_size: int) -> tvm.tirx.PrimFunc:
    """(q, k_packed, k_scales, weights, lens, blocks) -> qg [b*s, 1, H, D], kg [b*s, P, D/2],
    sg [b*s, P, D/32], wg [b*s, 1, H], lg [b*s, 1] (= P: every entry visible to the sweep),
    valid int8 [b, s, P]; P = pad128(B * block_size). Entry j of query (b, s) is key row
    blocks[b, s, j // bs] * bs + j % bs (clamped into the store; invalid entries are masked by
    `valid`: block -1, past the pool, or not visible)."""
    _check_dim(dim)
    H, D, BS = T.int64(heads), T.int64(dim), T.int64(block_size)

    @T.prim_func(s_tir=True)
    def pool_gather(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                    lens_h: T.handle, blocks_h: T.handle, qg_h: T.handle, kg_h: T.handle,
                    sg_h: T.handle, wg_h: T.handle, lg_h: T.handle, valid_h: T.handle):
        T.func_attr({"global_symbol": "pool_gather", "tirx.noalias": True})
        b, s, t, nb = T.int64(), T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
        QG = T.match_buffer(qg_h, (b * s, T.int64(1), H, D), "bfloat16")
        KG = T.match_buffer(kg_h, (b * s, _pad(nb * BS), D // 2), "uint8")
        SG = T.match_buffer(sg_h, (b * s, _pad(nb * BS), D // 32), "uint8")
        WG = T.match_buffer(wg_h, (b * s, T.int64(1), H), "bfloat16")
        LG = T.match_buffer(lg_h, (b * s, T.int64(1)), "int64")
        V = T.match_buffer(valid_h, (b, s, _pad(nb * BS)), "int8")
        for i0, i1, i2, i3 in T.grid(b, s, H, D):
            with T.sblock("qg"):
                vb, vs, vh, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                QG[vb * s + vs, T.int64(0), vh, vd] = Q[vb, vs, vh, vd]
        for i0, i1, i2 in T.grid(b, s, H):
            with T.sblock("wg"):
                vb, vs, vh = T.axis.remap("SSS", [i0, i1, i2])
                WG[vb * s + vs, T.int64(0), vh] = W[vb, vs, vh]
        for i0, i1 in T.grid(b, s):
            with T.sblock("lg"):
                vb, vs = T.axis.remap("SS", [i0, i1])
                LG[vb * s + vs, T.int64(0)] = _pad(nb * BS)
        for i0, i1, i2, i3 in T.grid(b, s, _pad(nb * BS), D // 2):
            with T.sblock("kg"):
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                KG[vb * s + vs, vj, vd] = KP[
                    vb, _pool_row(BL, vb, vs, vj, nb, BS, t), vd]
        for i0, i1, i2, i3 in T.grid(b, s, _pad(nb * BS), D // 32):
            with T.sblock("sg"):
                vb, vs, vj, vd = T.axis.remap("SSSS", [i0, i1, i2, i3])
                SG[vb * s + vs, vj, vd] = KS[
                    vb, _pool_row(BL, vb, vs, vj, nb, BS, t), vd]
        for i0, i1, i2 in T.grid(b, s, _pad(nb * BS)):
            with T.sblock("valid"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                V[vb, vs, vj] = T.Cast("int8", _pool_visible(BL, L, vb, vs, vj, nb, BS, t))

    return pool_gather


def make_pool_mask() -> tvm.tirx.PrimFunc:
    """(raw bf16 [b*s, 1, P] from the full sweep over the gathered store, valid int8 [b, s, P])
    -> scores bf16 [b, s, P]: raw where valid, -inf elsewhere (`make_pool_scores`'s result)."""

    @T.prim_func(s_tir=True)
    def pool_mask(raw_h: T.handle, valid_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "pool_mask", "tirx.noalias": True})
        b, s, p = T.int64(), T.int64(), T.int64()
        R = T.match_buffer(raw_h, (b * s, T.int64(1), p), "bfloat16")
        V = T.match_buffer(valid_h, (b, s, p), "int8")
        O = T.match_buffer(out_h, (b, s, p), "bfloat16")
        for i0, i1, i2 in T.grid(b, s, p):
            with T.sblock("mask"):
                vb, vs, vj = T.axis.remap("SSS", [i0, i1, i2])
                O[vb, vs, vj] = T.Select(V[vb, vs, vj] != T.int8(0),
                                         R[vb * s + vs, T.int64(0), vj], _neg_inf_bf16())

    return pool_mask


def schedule_pool_gather(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """CPU: the key rows copied in parallel over (query, entry), bytes vectorised; the rest is
    tiny (q, weights, one length per query) or one vector pass (valid)."""
    sch = s_tir.Schedule(func, enable_check=False)
    for name in ("kg", "valid"):
        loops = sch.get_loops(sch.get_sblock(name))
        sch.parallel(sch.fuse(*loops[:2]))
    sch.vectorize(sch.get_loops(sch.get_sblock("kg"))[-1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_pool_mask(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    i0, i1, i2 = sch.get_loops(sch.get_sblock("mask"))
    sch.parallel(sch.fuse(i0, i1))
    sch.vectorize(sch.split(i2, [None, 64])[1])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def emit_pool_scores(bb, mod: tvm.IRModule, kernel, args: list, *, block_size: int):
    """Emit pool_scores(q, k_packed, k_scales, weights, lens, blocks) into a Relax BlockBuilder:
    one call of the scheduled sweep `pool_scores`, or (on the targets `pool_gathers` names) the
    chain `pool_gather` -> `index_scores` -> `pool_mask`, as `mod` (`build_pool_topk`) holds
    them; `kernel(name)` returns the GlobalVar of its PrimFunc `name`. Returns the bf16 scores
    [b, s, pad128(B * block_size)] expression. The lowering of `dsv41::pool_topk`'s sweep is
    this function, and the kernel tests run it."""
    from tvm import relax

    q, kp, ks, w, lens, blocks = args
    b, s, heads, dim = q.ty.shape.values
    nb = blocks.ty.shape.values[-1]
    p = (nb * block_size + SCORE_PAD - 1) // SCORE_PAD * SCORE_PAD

    def ty(shape, dtype):
        return relax.TensorType(shape, dtype)

    if not any(gv.name_hint == "pool_gather" for gv in mod.get_global_vars()):
        return bb.emit(relax.call_tir(kernel("pool_scores"), args, ty([b, s, p], "bfloat16")))
    outs = bb.emit(relax.call_tir(kernel("pool_gather"), args, [
        ty([b * s, 1, heads, dim], "bfloat16"), ty([b * s, p, dim // 2], "uint8"),
        ty([b * s, p, dim // 32], "uint8"), ty([b * s, 1, heads], "bfloat16"),
        ty([b * s, 1], "int64"), ty([b, s, p], "int8")]))
    qg, kg, sg, wg, lg, valid = (bb.emit(relax.TupleGetItem(outs, i)) for i in range(6))
    raw = bb.emit(relax.call_tir(kernel("index_scores"), [qg, kg, sg, wg, lg],
                                 ty([b * s, 1, p], "bfloat16")))
    return bb.emit(relax.call_tir(kernel("pool_mask"), [raw, valid], ty([b, s, p], "bfloat16")))


# ---- the hand-vectorised full sweep (AVX-512, or AVX2 with lanes=8) --------------------------


AMX_EXP_LO = 109  # AMX sweep: q + key exponent codes at least this (scale >= 2^-149)
AMX_EXP_HI = 364  # ... and at most this (|dot| < 2^21 x 2^106: finite)


def _shift_bytes(word, sh):
    """Each signed byte of an int32 word shifted left by sh (|result| must fit a byte)."""
    out = T.int32(0)
    for i in range(4):
        byte = (word >> T.int32(8 * i)) & T.int32(255)
        signed = byte - ((byte >> T.int32(7)) << T.int32(8))
        out = out | (((signed << sh) & T.int32(255)) << T.int32(8 * i))
    return out


def _code_word(KS, vb, pos):
    """Key row pos's 4 E8M0 codes (dim 128) as one little-endian uint32."""
    w = T.Cast("uint32", KS[vb, pos, 0])
    for blk in range(1, 4):
        w = w | (T.Cast("uint32", KS[vb, pos, blk]) << T.uint32(8 * blk))
    return w


def _code(w, blk):
    return T.Cast("int32", (w >> T.uint32(8 * blk)) & T.uint32(255))


def _code_min(w):
    """The least of the 4 codes in a `_code_word` (int32)."""
    return T.min(T.min(_code(w, 0), _code(w, 1)), T.min(_code(w, 2), _code(w, 3)))


def _code_max(w):
    return T.max(T.max(_code(w, 0), _code(w, 1)), T.max(_code(w, 2), _code(w, 3)))


def _permb(lut, idx):
    """vpermb: byte i of the result is lut[idx byte i & 63] (a uint32x16 index vector)."""
    return T.call_llvm_pure_intrin("int8x64", "llvm.x86.avx512.permvar.qi.512",
                                   lut.vload([0], "int8x64"), T.reinterpret("int8x64", idx))


def _transpose_pairs(bit: int, lanes: int = 16) -> tuple[list[int], list[int]]:
    """Shuffle patterns of one transpose stage: rows i and i + 2^bit exchange the lanes whose
    bit `bit` differs from their row's, i.e. bit `bit` of the row and of the lane index swap."""
    lo = [j if not (j >> bit) & 1 else lanes + (j ^ (1 << bit)) for j in range(lanes)]
    hi = [(j ^ (1 << bit)) if not (j >> bit) & 1 else lanes + j for j in range(lanes)]
    return lo, hi


def avx512_sweep_supported(*, heads: int, dim: int, head_block: int, lanes: int = 16) -> bool:
    """Whether make_index_scores_avx512 takes these dims: the key rows must transpose in whole
    16 x 16 word blocks (dim a multiple of 128) or pack 2 or 4 to a block (dim 64 or 32), and a
    head block must not straddle a head-sum chunk. AVX2 (lanes 8): the int8 dot only, 8 x 8
    word blocks, dim a multiple of 128."""
    che, _ = _head_chunks(heads)
    dims = dim % 128 == 0 if lanes == 8 else dim in (32, 64) or dim % 128 == 0
    return dims and heads % head_block == 0 and che % head_block == 0


def make_index_scores_avx512(*, heads: int, dim: int, tile: int = 64, head_block: int = 4,
                             max_tasks: int = 32, vnni: bool = False, lanes: int = 16,
                             amx: bool = False, n_alt: int = 0) -> tvm.tirx.PrimFunc:
    """The full sweep (same signature and bits as `make_index_scores`) hand-vectorised for
    AVX-512; the loop structure is the schedule, so it is fixed at construction (config
    `sweep_config`). Parallel tasks: up to max_tasks per batch row, each a contiguous run of
    tiles of `tile` entries (its buffers are allocated once, not per tile). Per tile:

    - decode: the packed keys of 16 entries are loaded as 16 rows of 16 uint32 words, transposed
      in registers (4 shuffle stages) so that word w of all 16 entries is one vector; each of
      its 8 nibbles is looked up in the E2M1 table (vpermps) and scaled, giving kd[d, entries].
      Contiguous loads only (gathers are microcoded and ~10x slower on current Xeons).
    - dot: a GEMM [heads, dim] x [dim, tile] per query, head_block heads x tile entries of
      accumulators in registers (4 x 64 = 16 zmm), each q value broadcast once per d.
    - epilogue: the oracle's roundings (`_term`) and the head sum in torch's chunk order, then
      the bf16 score row, -inf past lens.

    Each key tile is decoded once and reused by every head and every query (prefill).

    `vnni` (AVX-512 VNNI + BW, dim a multiple of 128): the dot runs on int8 instead, 4 d per
    lane per instruction (vpdpbusd), wherever q allows it exactly. A query block of 32 that is
    MXFP4-QDQ'd (as the model's always is) is exactly int8 x 2^e with |int8| < 16, e from the
    block's largest |q|; a key nibble is looked up (vpshufb) as 2 * E2M1 + 12, an unsigned byte.
    Per key block the integer dot is exact; -12 * sum(q ints) (folded into the accumulator's
    start) removes the +12, and the block sums are scaled by 2^e * 2^-1 * the key's E8M0 scale
    (exact) and added in fp32. That is the exact dot wherever the fp32 sweep's is (the same
    exponent-span condition; see the module docstring), so the bits are the same. If any q block
    is not int8 x 2^e exactly (a q that was not QDQ'd, inf/NaN, exponents near fp32's ends) the
    whole call takes the fp32 sweep instead.

    `lanes` 8 (AVX2, vnni required: the int8 dot without VNNI): the same kernel on 256-bit
    vectors, 8 entries per vector and 8 x 8 word transposes; the E2M1 table of the fp32 path is
    a select chain (vpermps has 8 entries), and per key block the dot is vpmaddubsw (key bytes
    unsigned x q signed, pairs summed in int16: |sum| <= 16 x 24 x 15, no saturation) added in
    int16 over the block's 8 quads, then vpmaddwd by ones to int32: the same integer per block
    as vpdpbusd's, so the same bits.

    `amx` (AMX-INT8 + AVX-512 VBMI; vnni, 32-entry tiles, heads a multiple of 32): the dot of a
    tile whose keys allow it runs on AMX tiles (tdpbssd, signed x signed, no +12 offset) over all
    of D at once, in place of one integer dot per 32-d block. The block scales are folded into
    the int8 operands as shifts: per head, each q block's ints are shifted left by its exponent
    over the head's smallest (span at most 3: |int| <= 15 * 8); per entry, each key byte 2 * E2M1
    by its block's E8M0 code over the entry's smallest (span at most 3: |byte| <= 96; the shift
    indexes a 64-byte table, vpermb). The int32 result is exact (|sum| < 128 * 120 * 96 < 2^24),
    so times 2^(q exponent + key exponent) (a power of two kept off fp32's ends) it is the exact
    dot, the value the block sums give: the same bits. A tile with a wider key span, a NaN scale
    or extreme exponents, and a call whose q has a wider span, take the VNNI dot.

    `n_alt` > 0: `index_scores_shared`, the sweep behind the released shared index-K pointer
    (see `make_index_scores`); each batch row's tasks branch once to the store it reads."""
    _check_dim(dim)
    che, nc = _head_chunks(heads)
    if tile % 16 or SCORE_PAD % tile:
        raise ValueError(f"tile must be a multiple of 16 dividing {SCORE_PAD}; got {tile}.")
    if lanes not in (8, 16) or (lanes == 8 and not vnni):
        raise ValueError(f"lanes must be 16 (AVX-512) or 8 (AVX2, with the int8 dot: vnni); got "
                         f"lanes={lanes}, vnni={vnni}.")
    if tile % lanes:
        raise ValueError(f"tile must be a multiple of lanes ({lanes}); got {tile}.")
    if not avx512_sweep_supported(heads=heads, dim=dim, head_block=head_block, lanes=lanes):
        dims = "a multiple of 128" if lanes == 8 else "32, 64 or a multiple of 128"
        raise ValueError(f"The {'AVX2' if lanes == 8 else 'AVX-512'} sweep needs dim {dims} and "
                         f"a head block dividing {che}; got dim={dim}, head_block={head_block}.")
    if max_tasks <= 0:
        raise ValueError(f"max_tasks must be positive; got {max_tasks}.")
    if vnni and dim % 128:
        raise ValueError(f"The VNNI sweep needs dim to be a multiple of 128; got {dim}.")
    if amx and not (vnni and lanes == 16 and tile == AMX_TILE and heads % AMX_HEADS == 0
                    and dim == 128):
        raise ValueError(f"The AMX sweep needs vnni, lanes 16, tile {AMX_TILE}, dim 128 and "
                         f"heads a multiple of {AMX_HEADS}; got vnni={vnni}, lanes={lanes}, "
                         f"tile={tile}, dim={dim}, heads={heads}.")
    _check_alt(n_alt)
    H, D, TT, HB = T.int64(heads), T.int64(dim), T.int64(tile), head_block
    MT = T.int64(max_tasks)
    LN = lanes  # 32-bit lanes per vector
    nwb = min(dim // 8, LN)  # words per transpose row (and rows per transpose)
    epr = LN // nwb  # entries packed per row (1 at dim >= 8 * lanes)
    n_chunks = max(1, dim // (8 * LN))  # LN-word chunks per entry
    stages = nwb.bit_length() - 1
    row_bytes = 4 * nwb
    NBLK = T.int64(dim // fmt.MXFP4_BLOCK)

    def tiles(t):
        return _pad(t) // TT

    def per_task(t):  # tiles per task (at least 1: no division by zero when T = 0)
        return T.max((tiles(t) + MT - T.int64(1)) // MT, T.int64(1))

    def tasks(t):
        return (tiles(t) + per_task(t) - T.int64(1)) // per_task(t)

    U32V, I32V, F32V, I8V = (f"uint32x{LN}", f"int32x{LN}", f"float32x{LN}",
                             f"int8x{4 * LN}")  # one vector register

    def lut(tbl, words, n):  # E2M1 value of nibble n of every lane
        if LN == 8:  # vpermps holds 8 entries: a select chain instead
            return fp4_to_f32_select((words >> T.broadcast(T.uint32(4 * n), LN))
                                     & T.broadcast(T.uint32(15), LN))
        return permps(tbl.vload([0], F32V), words >> T.broadcast(T.uint32(4 * n), 16))

    @T.macro
    def stage(rows, bit):
        for p in T.unroll(nwb // 2):
            i = p // (1 << bit) * (2 << bit) + p % (1 << bit)
            a = rows.vload([i, 0], U32V)
            c = rows.vload([i + (1 << bit), 0], U32V)
            rows[i, T.ramp(0, 1, LN)] = T.Shuffle([a, c], _transpose_pairs(bit, LN)[0])
            rows[i + (1 << bit), T.ramp(0, 1, LN)] = T.Shuffle([a, c],
                                                               _transpose_pairs(bit, LN)[1])

    NQ = T.int64(dim // 4)  # int8 quads of d (VNNI)

    def u8x64(v):
        return T.reinterpret(I8V, v)

    def kbytes(lut8, words):  # a nibble per byte -> 2 * E2M1 + 12 (vpshufb; bit 7 is clear)
        name = "llvm.x86.avx2.pshuf.b" if LN == 8 else "llvm.x86.avx512.pshuf.b.512"
        return T.call_llvm_pure_intrin(I8V, name, lut8.vload([0], I8V), u8x64(words))

    @T.macro
    def prep_q(qf, qw, qsc, corr, qex, flag, mx, cs, wd, b, s):
        """q as int8 quads: qw[.., quad] holds d = 8w + 2i + p in byte i (quad = 2w + p), the
        order the key decode produces; flag[0] = 0 if some block is not int8 x 2^e exactly."""
        flag[0] = 1
        for r, h, blk in T.grid(b * s, H, NBLK):
            mx[0] = T.float32(0)
            for d in range(32):
                mx[0] = T.max(mx[0], T.fabs(qf[r // s, r % s, h, blk * T.int64(32) + d]))
            ex = T.Cast("int32", (T.reinterpret("uint32", mx[0]) >> T.uint32(23))
                        & T.uint32(255))  # biased exponent of the block's max |q|
            cs[0] = 0
            qex[r // s, r % s, h, blk] = 0
            if mx[0] == T.float32(0):
                qsc[r // s, r % s, h, blk] = T.float32(1)
                for j in range(8):
                    qw[r // s, r % s, h, blk * T.int64(8) + j] = 0
            elif (ex < 5) or (ex > 254):
                flag[0] = 0
            else:  # ints = q * 2^-e, e = exponent(max) - 3: |int| < 16
                qex[r // s, r % s, h, blk] = ex
                qsc[r // s, r % s, h, blk] = T.reinterpret("float32", (ex - 4) << 23)
                for j in range(8):
                    wd[0] = 0
                    for i in range(4):
                        v = qf[r // s, r % s, h, blk * T.int64(32) + j // 2 * 8 + i * 2 + j % 2]
                        iv = T.Cast("int32", v * T.reinterpret("float32", (257 - ex) << 23))
                        if T.Cast("float32", iv) * T.reinterpret("float32", (ex - 3) << 23) != v:
                            flag[0] = 0
                        cs[0] = cs[0] + iv
                        wd[0] = wd[0] | ((iv & 255) << T.Cast("int32", i) * 8)
                    qw[r // s, r % s, h, blk * T.int64(8) + j] = wd[0]
            corr[r // s, r % s, h, blk] = cs[0] * -12

    @T.macro
    def dec_fp32(kd, rows, tbl, sc, m0, g):  # kd[d, entries] = E2M1 x E8M0 in fp32
        for w in range(nwb):
            for n in T.unroll(8):
                kd[(m0 * nwb + w) * 8 + n, T.ramp(g * T.int64(LN), 1, LN)] = lut(
                    tbl, rows.vload([w, 0], U32V), n) * sc.vload(
                        [(m0 * nwb + w) // 4, g * T.int64(LN)], F32V)

    @T.macro
    def dec_int(kq, rows, lut8, m0, g):  # word w: its even d, then its odd d, as byte quads
        for w in range(nwb):
            kq[(m0 * nwb + w) * 2, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, kbytes(lut8, rows.vload([w, 0], U32V)
                             & T.broadcast(T.uint32(0x0F0F0F0F), LN)))
            kq[(m0 * nwb + w) * 2 + 1, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, kbytes(lut8, (rows.vload([w, 0], U32V) >> T.broadcast(T.uint32(4), LN))
                             & T.broadcast(T.uint32(0x0F0F0F0F), LN)))

    @T.macro
    def dot_fp32(acc, kd, qf, vb, vs, hg):
        for d in range(D):
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    acc[h, e] = acc[h, e] + qf[vb, vs, hg * HB + h, d] * kd[d, e]

    @T.macro
    def dot_int(acc, iacc, i16, kq, qw, qsc, corr, sc, vb, vs, hg):
        for blk in range(NBLK):
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    iacc[h, e] = corr[vb, vs, hg * HB + h, blk]
            if LN == 8:  # AVX2: int16 pair sums over the block, then to int32 (see docstring)
                for h in T.unroll(HB):
                    for e in T.vectorized(TT * 2):
                        i16[h, e] = T.int16(0)
                for j in T.unroll(8):
                    for h in T.unroll(HB):
                        for ev in T.unroll(TT // T.int64(8)):
                            i16[h, T.ramp(ev * 16, 1, 16)] = i16.vload(
                                [h, ev * 16], "int16x16") + T.call_llvm_pure_intrin(
                                "int16x16", "llvm.x86.avx2.pmadd.ub.sw",
                                u8x64(kq.vload([blk * T.int64(8) + j, ev * 8], I32V)),
                                u8x64(T.broadcast(qw[vb, vs, hg * HB + h, blk * T.int64(8) + j],
                                                  8)))
                for h in T.unroll(HB):
                    for ev in T.unroll(TT // T.int64(8)):
                        iacc[h, T.ramp(ev * 8, 1, 8)] = iacc.vload(
                            [h, ev * 8], I32V) + T.call_llvm_pure_intrin(
                            I32V, "llvm.x86.avx2.pmadd.wd", i16.vload([h, ev * 16], "int16x16"),
                            T.broadcast(T.int16(1), 16))
            else:
                for j in T.unroll(8):
                    for h in T.unroll(HB):
                        for ev in T.unroll(TT // T.int64(16)):
                            iacc[h, T.ramp(ev * 16, 1, 16)] = T.call_llvm_pure_intrin(
                                I32V, "llvm.x86.avx512.vpdpbusd.512",
                                iacc.vload([h, ev * 16], I32V),
                                u8x64(kq.vload([blk * T.int64(8) + j, ev * 16], I32V)),
                                u8x64(T.broadcast(qw[vb, vs, hg * HB + h, blk * T.int64(8) + j],
                                                  16)))
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    acc[h, e] = acc[h, e] + T.Cast("float32", iacc[h, e]) * (
                        sc[blk, e] * qsc[vb, vs, hg * HB + h, blk])

    @T.macro
    def prep_amx(qw, qex, qa, qs, qlim, flag, lo, hi, b, s):
        """flag 1 -> 2 if every head's q block exponents span at most 3: qa = the quads of qw
        with each block's ints shifted left by its exponent over the head's smallest (signed
        bytes), qs = 2^(that exponent - 4) (1 for a zero head), qlim = the smallest and the
        largest of those exponents over the call's heads."""
        if flag[0] == 1:
            flag[0] = 2
            qlim[0] = 1000
            qlim[1] = -1000
            for r, h in T.grid(b * s, H):
                lo[0] = 1000
                hi[0] = 0
                for blk in range(NBLK):
                    if qex[r // s, r % s, h, blk] > 0:
                        lo[0] = T.min(lo[0], qex[r // s, r % s, h, blk])
                        hi[0] = T.max(hi[0], qex[r // s, r % s, h, blk])
                if hi[0] == 0:  # all-zero q: any scale
                    qs[r // s, r % s, h] = T.float32(1)
                else:
                    if hi[0] - lo[0] > 3:
                        flag[0] = 1
                    qs[r // s, r % s, h] = T.reinterpret("float32", (lo[0] - 4) << 23)
                    qlim[0] = T.min(qlim[0], lo[0])
                    qlim[1] = T.max(qlim[1], lo[0])
                for j in range(NQ):
                    qa[r // s, r % s, h, j] = _shift_bytes(
                        qw[r // s, r % s, h, j],
                        T.max(qex[r // s, r % s, h, j // T.int64(8)] - lo[0], 0) % 4)

    @T.macro
    def load_scales(KSx, vb, t0, t, ksw, sc):
        """sc[blk, e] = the tile's E8M0 scales; with 4 blocks (dim 128) via ksw[e], an entry's 4
        codes as one word, loaded contiguously for a whole tile (entry T-1 past the store)."""
        if NBLK == 4:
            if t0 + TT <= t:
                for g in T.unroll(TT // T.int64(LN)):
                    ksw[T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                        U32V, KSx.vload([vb, t0 + g * T.int64(LN), 0], f"uint8x{4 * LN}"))
            else:
                for e in range(TT):
                    ksw[e] = _code_word(KSx, vb, T.min(t0 + e, t - T.int64(1)))
            for blk in T.unroll(4):
                for e in T.vectorized(TT):
                    sc[blk, e] = _e8m0((ksw[e] >> T.uint32(8 * blk)) & T.uint32(255))
        else:
            for blk in range(NBLK):
                for e in T.vectorized(TT):
                    sc[blk, e] = _e8m0(T.Cast("uint32", KSx[
                        vb, T.min(t0 + e, t - T.int64(1)), blk]))

    @T.macro
    def check_tile(ksw, kmn, ksm, kslot, shv, bad, ok, qlim, flag):
        """ok[0] = 1 if this tile's keys take the AMX dot (flag 2 and, per entry: block codes
        span at most 3, no NaN code, product exponents off fp32's ends), with kmn its entries'
        least codes, ksm[kslot] their scales and shv each block's shift (x 16, in every byte)."""
        ok[0] = 0
        if flag[0] == 2:
            for e in T.vectorized(TT):
                kmn[e] = _code_min(ksw[e])
                ksm[kslot, e] = _e8m0(T.Cast("uint32", kmn[e]))
                bad[e] = T.Select((_code_max(ksw[e]) - kmn[e] > 3) | (_code_max(ksw[e]) == 255)
                                  | (kmn[e] + qlim[0] < AMX_EXP_LO)
                                  | (kmn[e] + qlim[1] > AMX_EXP_HI), 1, 0)
            for blk in T.unroll(4):
                for e in T.vectorized(TT):
                    shv[blk, e] = T.Cast("uint32", _code(ksw[e], blk) - kmn[e]) * T.uint32(
                        0x10101010)
            ok[0] = 1
            for e in range(TT):
                ok[0] = ok[0] & (1 - bad[e])

    @T.macro
    def amx_finish(cb, ksm, pend, part, wf, qs, O, L, vb, t):
        """The epilogue of the pending AMX item pend = (1, t0, vs, cb slot, ksm slot): the terms
        in head order (as head_terms; the first rounding needs no NaN case: the dot and its
        scale are finite), the chunk sums, the bf16 score row."""
        for c in range(nc):
            for e in T.vectorized(TT):
                part[c, e] = T.float32(0)
        for h in range(H):
            for e in T.vectorized(TT):
                part[h // che, e] = part[h // che, e] + round_bf16(T.max(round_bf16_finite(
                    T.Cast("float32", cb[pend[3], h, e]) * (ksm[pend[4], e]
                                                            * qs[vb, pend[2], h])),
                    T.float32(0)) * wf[vb, pend[2], h])
        for e in T.vectorized(TT):
            O[vb, pend[2], pend[1] + e] = T.Select(
                pend[1] + e < T.min(L[vb, pend[2]], t),
                T.Cast("bfloat16", _part_sum(part, e, nc)), _neg_inf_bf16())
        pend[0] = T.int64(0)

    @T.macro
    def dec_amx(kq, rows, lut64, shv, m0, g):  # as dec_int: signed, shifted bytes (vpermb)
        for w in range(nwb):
            kq[(m0 * nwb + w) * 2, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, _permb(lut64, (rows.vload([w, 0], U32V)
                                     & T.broadcast(T.uint32(0x0F0F0F0F), LN))
                             | shv.vload([(m0 * nwb + w) // 4, g * T.int64(LN)], U32V)))
            kq[(m0 * nwb + w) * 2 + 1, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, _permb(lut64, ((rows.vload([w, 0], U32V) >> T.broadcast(T.uint32(4), LN))
                                     & T.broadcast(T.uint32(0x0F0F0F0F), LN))
                             | shv.vload([(m0 * nwb + w) // 4, g * T.int64(LN)], U32V)))

    @T.macro
    def dot_amx(cb, slot, kq, qa, vb, vs):
        """cb[slot, h, e] = the int32 dot of q row h (qa) and key e (kq) over all of D: per pass
        of 32 heads, tiles 4..7 accumulate 2 x 2 (16 heads x 16 entries) in 64-byte K steps
        (tile numbers are immediates, hence written out)."""
        qrow, krow = NQ * T.int64(4), TT * T.int64(4)  # bytes between tile rows
        for mp in range(heads // AMX_HEADS):
            amx_instr("tilezero", T.int8(4))
            amx_instr("tilezero", T.int8(5))
            amx_instr("tilezero", T.int8(6))
            amx_instr("tilezero", T.int8(7))
            for kh in range(dim // 64):
                amx_instr("tileloadd64", T.int8(0), T.address_of(qa[vb, vs, mp * 32, kh * 16]),
                          qrow)
                amx_instr("tileloadd64", T.int8(1),
                          T.address_of(qa[vb, vs, mp * 32 + 16, kh * 16]), qrow)
                amx_instr("tileloadd64", T.int8(2), T.address_of(kq[kh * 16, 0]), krow)
                amx_instr("tileloadd64", T.int8(3), T.address_of(kq[kh * 16, 16]), krow)
                amx_instr("tdpbssd", T.int8(4), T.int8(0), T.int8(2))
                amx_instr("tdpbssd", T.int8(5), T.int8(0), T.int8(3))
                amx_instr("tdpbssd", T.int8(6), T.int8(1), T.int8(2))
                amx_instr("tdpbssd", T.int8(7), T.int8(1), T.int8(3))
            amx_instr("tilestored64", T.int8(4), T.address_of(cb[slot, mp * 32, 0]), krow)
            amx_instr("tilestored64", T.int8(5), T.address_of(cb[slot, mp * 32, 16]), krow)
            amx_instr("tilestored64", T.int8(6), T.address_of(cb[slot, mp * 32 + 16, 0]), krow)
            amx_instr("tilestored64", T.int8(7), T.address_of(cb[slot, mp * 32 + 16, 16]), krow)

    @T.macro
    def dec_vector(kd, kq, rows, tbl, lut8, sc, flag, m0, g):
        """The key decode for the vector dots: int8 quads while flag is 1 or 2, else fp32."""
        if vnni:
            if flag[0] >= 1:
                dec_int(kq, rows, lut8, m0, g)
            else:
                dec_fp32(kd, rows, tbl, sc, m0, g)
        else:
            dec_fp32(kd, rows, tbl, sc, m0, g)

    @T.macro
    def head_terms(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, vb, vs):
        """part[chunk, e] += the heads' terms of query vs, head_block heads at a time in
        registers (the int8 dot while flag is 1 or 2, else the fp32 one)."""
        for hg in range(heads // HB):
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    acc[h, e] = T.float32(0)
            if vnni:
                if flag[0] >= 1:
                    dot_int(acc, iacc, i16, kq, qw, qsc, corr, sc, vb, vs, hg)
                else:
                    dot_fp32(acc, kd, qf, vb, vs, hg)
            else:
                dot_fp32(acc, kd, qf, vb, vs, hg)
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    part[(hg * HB + h) // che, e] = part[(hg * HB + h) // che, e] + round_bf16(
                        T.max(round_bf16(acc[h, e]), T.float32(0)) * wf[vb, vs, hg * HB + h])

    @T.macro
    def vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, O, L, vb, vs,
                    t0, t):
        """One tile's query on the vector units: the head terms, the chunk sums, the row."""
        for c in range(nc):
            for e in T.vectorized(TT):
                part[c, e] = T.float32(0)
        head_terms(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, vb, vs)
        for e in T.vectorized(TT):
            O[vb, vs, t0 + e] = T.Select(t0 + e < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", _part_sum(part, e, nc)),
                                         _neg_inf_bf16())

    @T.macro
    def sweep_tiles(KPx, KSx, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, kd, kq, sc,
                    rows, tbl, lut8, acc, iacc, i16, part, ksw, kmn, ksm, shv, bad, ok, qlim,
                    lut64, qa, qs, cb, pend, tog):
        """The task's tiles of the sweep over the key store KPx / KSx (its first t rows).

        AMX (kmn .. tog; unused without it): an item (a tile's query) on AMX writes its dots
        to cb slot tog[0] and is finished (`amx_finish`) only after the next item's dot is
        issued, so that the AMX unit's work, which waits on the decode's stores, overlaps the
        vector epilogue of the item before (cb and ksm are double-buffered; tog[1] is the ksm
        slot of the tile being decoded). Any other item first finishes the pending one."""
        if amx:
            pend[0] = T.int64(0)
            tog[0] = T.int64(0)
            tog[1] = T.int64(0)
        for tl in range(per_task(t)):
            if task % tasks(t) * per_task(t) + tl < tiles(t):
                t0 = (task % tasks(t) * per_task(t) + tl) * TT  # padded entries: entry T-1
                load_scales(KSx, vb, t0, t, ksw, sc)
                if amx:
                    check_tile(ksw, kmn, ksm, tog[1], shv, bad, ok, qlim, flag)
                for g, m0 in T.grid(TT // T.int64(LN), n_chunks):
                    for r in T.unroll(nwb):
                        for p in T.unroll(epr):
                            rows[r, T.ramp(p * nwb, 1, nwb)] = T.reinterpret(
                                f"uint32x{nwb}", KPx.vload([vb, T.min(
                                    t0 + g * T.int64(LN) + p * nwb + r, t - T.int64(1)),
                                    m0 * row_bytes], f"uint8x{row_bytes}"))
                    if stages > 0:
                        stage(rows, 0)
                    if stages > 1:
                        stage(rows, 1)
                    if stages > 2:
                        stage(rows, 2)
                    if stages > 3:
                        stage(rows, 3)
                    if amx:
                        if ok[0] == 1:
                            dec_amx(kq, rows, lut64, shv, m0, g)
                        else:
                            dec_vector(kd, kq, rows, tbl, lut8, sc, flag, m0, g)
                    else:
                        dec_vector(kd, kq, rows, tbl, lut8, sc, flag, m0, g)
                for vs in range(s):
                    if amx:
                        if ok[0] == 1:
                            dot_amx(cb, tog[0], kq, qa, vb, vs)
                            if pend[0] == T.int64(1):
                                amx_finish(cb, ksm, pend, part, wf, qs, O, L, vb, t)
                            pend[0] = T.int64(1)
                            pend[1] = t0
                            pend[2] = vs
                            pend[3] = tog[0]
                            pend[4] = tog[1]
                            tog[0] = T.int64(1) - tog[0]
                        else:
                            if pend[0] == T.int64(1):
                                amx_finish(cb, ksm, pend, part, wf, qs, O, L, vb, t)
                            vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag,
                                        part, O, L, vb, vs, t0, t)
                    else:
                        vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag,
                                    part, O, L, vb, vs, t0, t)
                if amx:
                    if ok[0] == 1:
                        tog[1] = T.int64(1) - tog[1]
        if amx:
            if pend[0] == T.int64(1):
                amx_finish(cb, ksm, pend, part, wf, qs, O, L, vb, t)

    @T.macro
    def prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qlim, b, s):
        """q and w to fp32 once (serial: tiny next to the sweep), then the int8 (and AMX)
        forms of q and the flag that picks the dot."""
        for r in range(b * s):
            for h in range(H):
                wf[r // s, r % s, h] = T.Cast("float32", W[r // s, r % s, h])
                for d in T.vectorized(D):
                    qf[r // s, r % s, h, d] = T.Cast("float32", Q[r // s, r % s, h, d])
        flag[0] = 0
        if vnni:
            prep_q(qf, qw, qsc, corr, qex, flag, mx, cs, wd, b, s)
            if amx:
                prep_amx(qw, qex, qa, qs, qlim, flag, cs, wd, b, s)

    @T.macro
    def sweep_task(KPx, KSx, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim, qa, qs):
        """One parallel task of the sweep over the key store KPx / KSx: its buffers (allocated
        once per task, not per tile), tables and AMX tile configuration, its tiles
        (`sweep_tiles`), the tiles released."""
        kd = T.alloc_buffer((D, TT), "float32", scope="local")  # decoded keys, [d, entry]
        kq = T.alloc_buffer((NQ, TT), "int32", scope="local")  # VNNI: key byte quads
        sc = T.alloc_buffer((NBLK, TT), "float32", scope="local")  # E8M0 scales
        rows = T.alloc_buffer((nwb, LN), "uint32", scope="local")  # the transpose
        # the 16 E2M1 values in code order; vpermps reads only the low 4 bits of each
        # index lane, so a nibble needs a shift but no mask
        tbl = T.alloc_buffer((16,), "float32", scope="local")
        lut8 = T.alloc_buffer((4 * LN,), "int8", scope="local")  # VNNI: 2 * E2M1 + 12
        acc = T.alloc_buffer((HB, TT), "float32", scope="local")
        iacc = T.alloc_buffer((HB, TT), "int32", scope="local")  # VNNI: one key block
        i16 = T.alloc_buffer((HB, TT * 2), "int16", scope="local")  # AVX2: pair sums
        part = T.alloc_buffer((nc, TT), "float32", scope="local")  # head-chunk sums
        kmn = T.alloc_buffer((TT,), "int32", scope="local")  # AMX: least key code
        ksm = T.alloc_buffer((2, TT), "float32", scope="local")  # AMX: its scale (2 slots)
        ksw = T.alloc_buffer((TT,), "uint32", scope="local")  # an entry's 4 E8M0 codes
        pend = T.alloc_buffer((5,), "int64", scope="local")  # AMX: the pending item
        tog = T.alloc_buffer((2,), "int64", scope="local")  # AMX: cb, ksm slots
        shv = T.alloc_buffer((NBLK, TT), "uint32", scope="local")  # AMX: key shifts x 16
        bad = T.alloc_buffer((TT,), "int32", scope="local")  # AMX: 1 if the key cannot
        ok = T.alloc_buffer((1,), "int32", scope="local")  # AMX: 1 if the tile takes it
        lut64 = T.alloc_buffer((64,), "int8", scope="local")  # AMX: (2 * E2M1) << shift
        cb = T.alloc_buffer((2, H, TT), "int32", scope="local")  # AMX: the int32 dots
        cfg = T.alloc_buffer((64,), "uint8", scope="local")  # AMX: tile configuration
        for i in T.unroll(16):
            tbl[i] = fp4_to_f32_select(T.Cast("uint32", i))
        for i in range(4 * LN):  # the table repeats in each 128-bit lane (vpshufb)
            lut8[i] = T.Cast("int8", fp4_to_f32_select(T.Cast("uint32", i % 16)) * T.float32(2)
                             + T.float32(12))
        if amx:
            for i in range(64):  # code n, shift j at 16 j + n (vpermb reads 6 index bits)
                lut64[i] = T.Cast("int8", fp4_to_f32_select(T.Cast("uint32", i % 16))
                                  * T.Cast("float32", T.int32(2) << (i // 16)))
            if flag[0] == 2:
                amx_configure(cfg)
        sweep_tiles(KPx, KSx, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, kd, kq, sc,
                    rows, tbl, lut8, acc, iacc, i16, part, ksw, kmn, ksm, shv, bad, ok, qlim,
                    lut64, qa, qs, cb, pend, tog)
        if amx:
            if flag[0] == 2:
                amx_instr("tilerelease")

    @T.prim_func
    def index_scores(q_h: T.handle, kp_h: T.handle, ks_h: T.handle, w_h: T.handle,
                     lens_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": "index_scores", "tirx.noalias": True})
        b, s, t = T.int64(), T.int64(), T.int64()
        Q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        KP = T.match_buffer(kp_h, (b, t, D // 2), "uint8")
        KS = T.match_buffer(ks_h, (b, t, D // 32), "uint8")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, _pad(t)), "bfloat16")
        qf = T.alloc_buffer((b, s, H, D), "float32")
        wf = T.alloc_buffer((b, s, H), "float32")
        qw = T.alloc_buffer((b, s, H, NQ), "int32")  # VNNI: q int8 quads
        qsc = T.alloc_buffer((b, s, H, NBLK), "float32")  # VNNI: 2^(e - 1) per q block
        corr = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: -12 * sum of a block's ints
        flag = T.alloc_buffer((1,), "int32")  # VNNI: 1 if every q block is int8 x 2^e (AMX: 2)
        qex = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: a q block's exponent (0: zero)
        qa = T.alloc_buffer((b, s, H, NQ), "int32")  # AMX: q quads, blocks shifted
        qs = T.alloc_buffer((b, s, H), "float32")  # AMX: a head's q scale
        qlim = T.alloc_buffer((2,), "int32")  # AMX: the least and largest head exponents
        mx = T.alloc_buffer((1,), "float32")
        cs = T.alloc_buffer((1,), "int32")
        wd = T.alloc_buffer((1,), "int32")
        prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qlim, b, s)
        for task in T.parallel(b * tasks(t)):
            vb = task // tasks(t)
            sweep_task(KP, KS, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                       qa, qs)

    @T.prim_func
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
        PK = T.match_buffer(pick_h, (b,), "int64")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, _pad(t)), "bfloat16")
        qf = T.alloc_buffer((b, s, H, D), "float32")
        wf = T.alloc_buffer((b, s, H), "float32")
        qw = T.alloc_buffer((b, s, H, NQ), "int32")  # VNNI: q int8 quads
        qsc = T.alloc_buffer((b, s, H, NBLK), "float32")  # VNNI: 2^(e - 1) per q block
        corr = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: -12 * sum of a block's ints
        flag = T.alloc_buffer((1,), "int32")  # VNNI: 1 if every q block is int8 x 2^e (AMX: 2)
        qex = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: a q block's exponent (0: zero)
        qa = T.alloc_buffer((b, s, H, NQ), "int32")  # AMX: q quads, blocks shifted
        qs = T.alloc_buffer((b, s, H), "float32")  # AMX: a head's q scale
        qlim = T.alloc_buffer((2,), "int32")  # AMX: the least and largest head exponents
        mx = T.alloc_buffer((1,), "float32")
        cs = T.alloc_buffer((1,), "int32")
        wd = T.alloc_buffer((1,), "int32")
        prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qlim, b, s)
        for task in T.parallel(b * tasks(t)):
            vb = task // tasks(t)
            # the shared index-K pointer: this row's keys are the first t rows of the store
            # the pointer names (an alternate's own row count is at least t)
            if n_alt == 1:
                if PK[vb] == T.int64(1):
                    sweep_task(A1, S1, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                else:
                    sweep_task(KP, KS, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
            elif n_alt == 2:
                if PK[vb] == T.int64(1):
                    sweep_task(A1, S1, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                elif PK[vb] == T.int64(2):
                    sweep_task(A2, S2, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                else:
                    sweep_task(KP, KS, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
            else:
                if PK[vb] == T.int64(1):
                    sweep_task(A1, S1, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                elif PK[vb] == T.int64(2):
                    sweep_task(A2, S2, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                elif PK[vb] == T.int64(3):
                    sweep_task(A3, S3, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)
                else:
                    sweep_task(KP, KS, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                               qa, qs)

    if n_alt:
        return index_scores_shared
    return index_scores


def _part_sum(part, e, n_chunks):
    """`_chunk_sum` over a [chunk, entry] buffer."""
    acc = T.float32(0)
    for c in range(n_chunks):
        acc = acc + part[c, e]
    return acc


@dataclass(frozen=True)
class SweepConfig:
    tile: int  # score entries per parallel task (CPU) or per thread block (CUDA); divides 128
    head_block: int  # CPU: heads accumulated together in registers (tile/16 * head_block zmm)
    kdec_vector_d: bool  # CPU, scheduled sweep: vectorise the key decode over d (else the tile)
    avx512: bool = False  # CPU full sweep: the hand-vectorised make_index_scores_avx512
    max_tasks: int = 1  # avx512: parallel tasks per batch row (contiguous runs of tiles)
    vnni: bool = False  # avx512: the int8 dot (AVX-512 VNNI + BW; exact q only, see factory)
    lanes: int = 16  # avx512: 32-bit lanes per vector (8: the AVX2 form of the kernel)
    amx: bool = False  # vnni: the dot on AMX-INT8 tiles where the keys allow (see factory)


def sweep_config(target: TargetSpec, *, heads: int, dim: int, pool: bool = False) -> SweepConfig:
    """CUDA: 128 threads, one score entry each. CPU with AVX-512, full sweep: the hand-vectorised
    kernel, 16 tasks per core (even halves of T; tasks, not tiles, so the per-task buffers are
    set up rarely). With VNNI (and dim a multiple of 128) the int8 dot on 32-entry tiles x 8
    heads (16 int32 accumulators; at T=256K, H=32, D=128, 2 cores: 8.5 ms, against 11.0 for
    64 x 4, 13.5 for 64 x 8, 9.3 for 32 x 4, 11.1 for 16 x 16; the fp32 dot 17.6 ms); with
    AMX-INT8 (dim 128, heads a multiple of 32) its dot on AMX tiles (T=1M, one core of a Xeon
    with AMX: 11.9 ms against 31.0 for the VNNI dot; 2 cores 5.8 against 16.7). Without
    VNNI the fp32 dot on 64-entry tiles x 4 heads = 16 zmm accumulators (64 x 4 beat 32 x 8,
    32 x 4 and 128 x 2 at T=32K: 4 tile loads and 4 broadcasts per 16 FMAs, and the decoded
    tile, 32 KiB, stays in L1). On AVX2 (no AVX-512; dim a multiple of 128) the same kernel on
    256-bit vectors with the int8 dot (vpmaddubsw), 16-entry tiles x 8 heads: at T=256K, H=32,
    D=128 on one Zen 3 core 21-40 ms (a shared, noisy machine) against 147 ms for the scheduled
    fp32 sweep; 16 x 4 28 ms, 32 x 2 28, 32 x 4 37, 32 x 8 45, 16 x 16 60. Otherwise (pool
    sweep, other CPUs): the scheduled sweep with a 32-entry tile x 8 heads (the best of
    16/32/64 x 4/8/16 measured at T=128K)."""
    if target.is_cuda:
        return SweepConfig(tile=128, head_block=1, kdec_vector_d=False)
    cores = max(int(target.target.get("num-cores", 1)), 1)
    vnni = dim % 128 == 0 and has_features(target, "avx512f", "avx512bw", "avx512vnni")
    hb = math.gcd(heads, 8 if vnni else 4)
    if not pool and has_avx512(target) and avx512_sweep_supported(heads=heads, dim=dim,
                                                                   head_block=hb):
        amx = (vnni and dim == 128 and heads % AMX_HEADS == 0
               and has_features(target, "amx-tile", "amx-int8", "avx512vbmi"))
        return SweepConfig(tile=32 if vnni else 64, head_block=hb, kdec_vector_d=False,
                           avx512=True, max_tasks=16 * cores, vnni=vnni, amx=amx)
    hb = math.gcd(heads, 8)
    if not pool and has_features(target, "avx2") and avx512_sweep_supported(
            heads=heads, dim=dim, head_block=hb, lanes=8):
        return SweepConfig(tile=16, head_block=hb, kdec_vector_d=False, avx512=True,
                           max_tasks=16 * cores, vnni=True, lanes=8)
    return SweepConfig(tile=32, head_block=hb, kdec_vector_d=True)


def schedule_index_scores(func: tvm.tirx.PrimFunc, config: SweepConfig,
                          target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Schedules either sweep (full or pool; they share block names). CPU: parallel over
    (b, T-tile) [full] or (b, s, tile) [pool]; keys decoded once per tile into a [D, tile] buffer
    and reused by every head and (full sweep) every query; dot vectorised over the tile with
    head_block register accumulators. CUDA: one thread per score entry, q in shared memory,
    each key element decoded once into a register and used by all heads."""
    assert SCORE_PAD % config.tile == 0, "the tile must divide SCORE_PAD"
    pool = func.attrs["global_symbol"] == "pool_scores"
    sch = s_tir.Schedule(func)
    if target.is_cuda:
        _schedule_sweep_cuda(sch, config)
    else:
        _schedule_sweep_cpu(sch, config, pool)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_sweep_cpu(sch: s_tir.Schedule, config: SweepConfig, pool: bool) -> None:
    out = sch.get_sblock("score")
    b, s, t = sch.get_loops(out)
    to, ti = sch.split(t, [None, config.tile])
    if pool:
        task = sch.fuse(b, s, to)
        q_at = task
    else:
        sch.reorder(b, to, s, ti)
        task = sch.fuse(b, to)
        q_at = sch.get_loops(out)[1]  # s
    sch.parallel(task)
    kdec = sch.get_sblock("k_dec")
    if pool:
        sch.transform_layout(kdec, ("write", 0), lambda b, s, j, d: (b, s, d, j))
    else:
        sch.transform_layout(kdec, ("write", 0), lambda b, t, d: (b, d, t))
    for name in ("chunk", "dot", "q_f32"):
        sch.compute_at(sch.get_sblock(name), q_at, preserve_unit_loops=True)
    sch.compute_at(kdec, task, preserve_unit_loops=True)
    kt, kd = sch.get_loops(kdec)[-2:]
    if config.kdec_vector_d:
        sch.vectorize(kd)
    else:
        sch.reorder(kd, kt)
        sch.vectorize(kt)
    sch.vectorize(sch.get_loops(sch.get_sblock("q_f32"))[-1])
    dot = sch.get_sblock("dot")
    h, tt, d = sch.get_loops(dot)[-3:]
    ho, hi = sch.split(h, [None, config.head_block])
    sch.reorder(ho, d, hi, tt)
    acc = sch.cache_write(dot, 0, "local")  # per head-group accumulators -> registers
    sch.reverse_compute_at(acc, ho, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.unroll(hi)
    sch.vectorize(tt)
    sch.decompose_reduction(dot, d)  # after the loop annotations (TVM.md §5)
    chunk = sch.get_sblock("chunk")
    tt, j = sch.get_loops(chunk)[-2:]
    sch.reorder(j, tt)
    sch.vectorize(tt)
    sch.decompose_reduction(chunk, j)
    sch.vectorize(sch.get_loops(out)[-1])


def _schedule_sweep_cuda(sch: s_tir.Schedule, config: SweepConfig) -> None:
    out = sch.get_sblock("score")
    b, s, t = sch.get_loops(out)
    to, ti = sch.split(t, [None, config.tile])
    cta = sch.fuse(b, s, to)
    sch.bind(cta, "blockIdx.x")
    sch.bind(ti, "threadIdx.x")
    for name in ("chunk", "dot"):
        sch.compute_at(sch.get_sblock(name), ti, preserve_unit_loops=True)
    # q for this (b, s) in shared memory, loaded cooperatively
    qf = sch.get_sblock("q_f32")
    sch.compute_at(qf, cta, preserve_unit_loops=True)
    sch.set_scope(qf, 0, "shared")
    hq, dq = sch.get_loops(qf)[-2:]
    _, qtx = sch.split(sch.fuse(hq, dq), [None, config.tile])
    sch.bind(qtx, "threadIdx.x")
    # per-thread accumulators over heads; d outermost so each key element is decoded once
    dot = sch.get_sblock("dot")
    sch.set_scope(dot, 0, "local")
    h, d = sch.get_loops(dot)[-3:][0::2]
    sch.decompose_reduction(dot, h)
    h, _, d = sch.get_loops(dot)[-3:]
    sch.reorder(d, h)
    sch.unroll(h)
    kdec = sch.get_sblock("k_dec")
    sch.compute_at(kdec, d, preserve_unit_loops=True)
    sch.set_scope(kdec, 0, "local")
    chunk = sch.get_sblock("chunk")
    sch.set_scope(chunk, 0, "local")
    j = sch.get_loops(chunk)[-1]
    sch.unroll(j)
    sch.decompose_reduction(chunk, j)


# ---- selection -------------------------------------------------------------------------------


def make_select(*, topk: int, kind: str = "positions", block_size: int = 1, lanes: int = 1,
                gpu: bool = False, group: int = 64, chunks: int = 32) -> tvm.tirx.PrimFunc:
    """Exact top-k over bf16 score rows: ties to the lower index, -inf dropped, ascending output,
    -1 padded. `kind`:

    - "positions": (scores [b, s, P]) -> positions int32 [b, s, topk]
    - "blocks":    (scores [b, s, P], lens [b, s]) -> candidate blocks int32 [b, s, topk]; block
                   score = max over its block_size entries, the block of entry lens-1 pinned to
                   +inf (needs lens <= T, as the model guarantees)
    - "pool":      (scores [b, s, P], blocks [b, s, B]) -> positions int32 [b, s, topk] where entry
                   j is position blocks[j // bs] * bs + j % bs (needs the ascending, duplicate-free,
                   -1-at-the-end block lists that "blocks" produces, so entry order = position
                   order)

    CPU (`gpu=False`, `lanes` unused): first, in parallel over (row, run of groups; `chunks`
    runs per row), each group's largest key (`group` items, vectorised); then, one task per
    row, the k-th largest group
    maximum m: every entry that can be selected lies in a group whose maximum is >= m (k groups
    hold an entry >= m, so the k-th largest entry is >= m), so the exact radix selection and the
    in-order emit only visit those groups (about k * group entries instead of the whole row).
    With `gpu=True` a thread block of `lanes` threads shares a row (shared-memory histograms
    with atomics, then an ordered emit over contiguous per-thread segments).
    """
    if kind not in ("positions", "blocks", "pool"):
        raise ValueError(f"kind must be positions, blocks or pool; got {kind!r}.")
    if topk <= 0 or block_size <= 0 or lanes <= 0:
        raise ValueError("topk, block_size and lanes must be positive.")
    if gpu and (lanes & (lanes - 1) or lanes > 1024):
        raise ValueError(f"lanes must be a power of two up to 1024 on GPU; got {lanes}.")
    if group <= 0 or group % 16:
        raise ValueError(f"group must be a positive multiple of 16; got {group}.")
    if chunks <= 0:
        raise ValueError(f"chunks must be positive; got {chunks}.")
    return _make_select(topk, kind, block_size, lanes, gpu, group, chunks)


def _make_select(topk: int, kind: str, block_size: int, lanes: int, gpu: bool, group: int,
                 chunks: int):
    K = T.int64(topk)
    G = T.int64(group)
    NCH = T.int64(chunks)
    BS = T.int64(block_size)
    NT = T.int64(lanes)
    NEG = T.uint32(NEG_KEY)

    def n_items(p):  # entries scanned per row: scores, or blocks of scores
        return (p + BS - T.int64(1)) // BS if kind == "blocks" else p

    def key(S, A, vb, vs, i, p):
        if kind != "blocks":
            return _key(S[vb, vs, i])
        best = NEG
        for e in range(block_size):  # block max over its entries (-inf past the row)
            at = i * BS + T.int64(e)
            best = T.max(best, T.Select(at < p, _key(S[vb, vs, T.min(at, p - T.int64(1))]), NEG))
        pinned = T.floordiv(A[vb, vs] - T.int64(1), BS) == i  # block of the newest entry
        return T.Select(pinned, T.uint32(POS_INF_KEY), best)

    def pos(A, vb, vs, i):
        if kind != "pool":
            return T.Cast("int32", i)
        return A[vb, vs, i // BS] * T.int32(block_size) + T.Cast("int32", i % BS)

    @T.macro
    def find_bin(hist, st):
        # st[0] <- the bin (from the top) where the running count reaches K, else -1;
        # st[1] += the count in the bins above it. st is local: the CUDA storage-sync pass
        # rejects shared-memory loads in branch conditions, hence the copy into st[7].
        st[0] = T.int64(-1)
        for j in range(256):
            st[7] = T.Cast("int64", hist[255 - j])
            if st[0] < T.int64(0):
                if st[1] + st[7] >= K:
                    st[0] = T.int64(255 - j)
                else:
                    st[1] = st[1] + st[7]

    @T.macro
    def set_threshold(st):
        # st[2] threshold key, st[3] ties to take; no bin reached K -> take every finite entry
        if st[0] < T.int64(0):
            st[2] = T.int64(NEG_KEY)
            st[3] = T.int64(0)
        else:
            st[2] = st[4] * T.int64(256) + st[0]
            st[3] = K - st[1]

    def n_groups(p):
        return (n_items(p) + G - T.int64(1)) // G

    def per_chunk(p):  # groups per parallel run of the group-maximum pass
        return (n_groups(p) + NCH - T.int64(1)) // NCH

    def item_key(S, A, vb, vs, i, p):  # key of item i, NEG past the row
        return T.Select(i < n_items(p), key(S, A, vb, vs, T.min(i, n_items(p) - T.int64(1)), p),
                        NEG)

    @T.macro
    def group_max(S, A, GM, r, vb, vs, g, p):
        lm = T.alloc_buffer((16,), "uint32", scope="local")  # per-lane maxima
        for lane in T.vectorized(16):
            lm[lane] = NEG
        if g * G + G <= n_items(p):  # a whole group: plain vector loads
            for j in range(G // T.int64(16)):
                for lane in T.vectorized(16):
                    lm[lane] = T.max(lm[lane], key(S, A, vb, vs, g * G + j * T.int64(16) + lane,
                                                   p))
        else:
            for j in range(G // T.int64(16)):
                for lane in T.vectorized(16):
                    lm[lane] = T.max(lm[lane], item_key(S, A, vb, vs,
                                                        g * G + j * T.int64(16) + lane, p))
        for lane in T.vectorized(8):  # a max tree over the lanes
            lm[lane] = T.max(lm[lane], lm[lane + 8])
        for lane in T.vectorized(4):
            lm[lane] = T.max(lm[lane], lm[lane + 4])
        for lane in T.vectorized(2):
            lm[lane] = T.max(lm[lane], lm[lane + 2])
        GM[r, g] = T.max(lm[0], lm[1])

    @T.macro
    def group_keys(S, A, kb, vb, vs, g, p):
        if g * G + G <= n_items(p):
            for j in T.vectorized(G):
                kb[j] = key(S, A, vb, vs, g * G + j, p)
        else:
            for j in T.vectorized(G):
                kb[j] = item_key(S, A, vb, vs, g * G + j, p)

    @T.macro
    def row_cpu(S, A, OUT, GM, r, vb, vs, p):
        hist = T.alloc_buffer((256,), "int32", scope="local")
        st = T.alloc_buffer((8,), "int64", scope="local")
        cut = T.alloc_buffer((1,), "uint32", scope="local")
        kb = T.alloc_buffer((G,), "uint32", scope="local")  # one group's keys
        # the k-th largest group maximum (NEG when fewer than k groups hold a finite key)
        for j in range(256):
            hist[j] = 0
        for g in range(n_groups(p)):
            if GM[r, g] > NEG:
                hist[T.Cast("int32", GM[r, g] >> T.uint32(8))] += 1
        st[1] = T.int64(0)
        find_bin(hist, st)
        st[4] = st[0]
        if st[4] >= T.int64(0):
            for j in range(256):
                hist[j] = 0
            for g in range(n_groups(p)):
                if (GM[r, g] > NEG) and (T.Cast("int64", GM[r, g] >> T.uint32(8)) == st[4]):
                    hist[T.Cast("int32", GM[r, g] & T.uint32(255))] += 1
            find_bin(hist, st)
        set_threshold(st)
        cut[0] = T.max(T.Cast("uint32", st[2]), NEG + T.uint32(1))
        # the exact threshold (two radix passes) over the items >= cut of the candidate groups
        # only: the k-th largest item is >= cut, so every bin at or above its bin is counted
        # in full; a group's keys are computed vectorised, once per pass
        for j in range(256):
            hist[j] = 0
        for g in range(n_groups(p)):
            if GM[r, g] >= cut[0]:
                group_keys(S, A, kb, vb, vs, g, p)
                for j in range(G):
                    if kb[j] >= cut[0]:
                        hist[T.Cast("int32", kb[j] >> T.uint32(8))] += 1
        st[1] = T.int64(0)
        find_bin(hist, st)
        st[4] = st[0]
        if st[4] >= T.int64(0):
            for j in range(256):
                hist[j] = 0
            for g in range(n_groups(p)):
                if GM[r, g] >= cut[0]:
                    group_keys(S, A, kb, vb, vs, g, p)
                    for j in range(G):
                        if (kb[j] >= cut[0]) and (T.Cast("int64", kb[j] >> T.uint32(8))
                                                  == st[4]):
                            hist[T.Cast("int32", kb[j] & T.uint32(255))] += 1
            find_bin(hist, st)
        set_threshold(st)
        # emit in position order: every item above the threshold, then the first ties
        st[5] = T.int64(0)  # emitted
        st[6] = T.int64(0)  # ties seen
        for g in range(n_groups(p)):
            if GM[r, g] >= cut[0]:
                group_keys(S, A, kb, vb, vs, g, p)
                for j in range(G):
                    if kb[j] >= cut[0]:
                        if T.Cast("int64", kb[j]) > st[2]:
                            OUT[vb, vs, st[5]] = pos(A, vb, vs, g * G + j)
                            st[5] = st[5] + T.int64(1)
                        elif T.Cast("int64", kb[j]) == st[2]:
                            if st[6] < st[3]:
                                OUT[vb, vs, st[5]] = pos(A, vb, vs, g * G + j)
                                st[5] = st[5] + T.int64(1)
                            st[6] = st[6] + T.int64(1)
        for j in range(K):
            if j >= st[5]:
                OUT[vb, vs, j] = -1

    @T.macro
    def row_gpu(S, A, OUT, vb, vs, p):
        hist = T.alloc_buffer((256,), "int32", scope="shared")
        # lane 0's results, broadcast; one buffer per phase so that no shared buffer is both
        # read and written inside a branch (ThreadSync cannot place a barrier there)
        sh_a = T.alloc_buffer((2,), "int64", scope="shared")
        sh_b = T.alloc_buffer((2,), "int64", scope="shared")
        sh_c = T.alloc_buffer((1,), "int64", scope="shared")
        cnt = T.alloc_buffer((lanes * 2,), "int64", scope="shared")  # [gt | eq] per lane
        pre = T.alloc_buffer((lanes * 2,), "int64", scope="shared")  # exclusive prefix of cnt
        st = T.alloc_buffer((8,), "int64", scope="local")  # as in row_cpu
        loc = T.alloc_buffer((4,), "int64", scope="local")
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for j in range((256 + lanes - 1) // lanes):
                if j * lanes + tx < 256:
                    hist[j * lanes + tx] = 0
            T.tvm_storage_sync("shared")
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if j * NT + tx < n_items(p):
                    if key(S, A, vb, vs, j * NT + tx, p) > NEG:
                        T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist[
                            T.Cast("int32", key(S, A, vb, vs, j * NT + tx, p) >> T.uint32(8))]),
                            1))
            T.tvm_storage_sync("shared")
            if tx == 0:
                st[1] = T.int64(0)
                find_bin(hist, st)
                sh_a[0] = st[0]
            T.tvm_storage_sync("shared")
            st[4] = sh_a[0]
            for j in range((256 + lanes - 1) // lanes):
                if j * lanes + tx < 256:
                    hist[j * lanes + tx] = 0
            T.tvm_storage_sync("shared")
            if st[4] >= T.int64(0):
                for j in range((n_items(p) + NT - T.int64(1)) // NT):
                    if j * NT + tx < n_items(p):
                        if (key(S, A, vb, vs, j * NT + tx, p) > NEG) and (T.Cast(
                                "int64", key(S, A, vb, vs, j * NT + tx, p) >> T.uint32(8))
                                == st[4]):
                            T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist[
                                T.Cast("int32", key(S, A, vb, vs, j * NT + tx, p)
                                       & T.uint32(255))]), 1))
            T.tvm_storage_sync("shared")
            if tx == 0:  # st[0:2] still hold lane 0's first-pass results
                if st[4] >= T.int64(0):
                    find_bin(hist, st)
                set_threshold(st)
                sh_b[0] = st[2]
                sh_b[1] = st[3]
            T.tvm_storage_sync("shared")
            st[2] = sh_b[0]
            st[3] = sh_b[1]
            # each lane owns a contiguous segment, so lane order = position order
            loc[0] = T.int64(0)
            loc[1] = T.int64(0)
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if tx * ((n_items(p) + NT - T.int64(1)) // NT) + j < n_items(p):
                    if T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) > st[2]:
                        loc[0] = loc[0] + T.int64(1)
                    elif T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) == st[2]:
                        loc[1] = loc[1] + T.int64(1)
            cnt[tx] = loc[0]
            cnt[lanes + tx] = loc[1]
            T.tvm_storage_sync("shared")
            if tx == 0:  # exclusive prefix over lanes; sh_c = entries emitted in total
                st[5] = T.int64(0)
                st[6] = T.int64(0)
                for j in range(lanes):
                    pre[j] = st[5]
                    pre[lanes + j] = st[6]
                    st[5] = st[5] + cnt[j]
                    st[6] = st[6] + cnt[lanes + j]
                sh_c[0] = st[5] + T.min(st[6], st[3])
            T.tvm_storage_sync("shared")
            st[5] = sh_c[0]
            loc[0] = pre[tx] + T.min(pre[lanes + tx], st[3])  # first output slot
            loc[1] = pre[lanes + tx]  # ties before this segment
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if tx * ((n_items(p) + NT - T.int64(1)) // NT) + j < n_items(p):
                    if T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) > st[2]:
                        OUT[vb, vs, loc[0]] = pos(
                            A, vb, vs, tx * ((n_items(p) + NT - T.int64(1)) // NT) + j)
                        loc[0] = loc[0] + T.int64(1)
                    elif T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) == st[2]:
                        if loc[1] < st[3]:
                            OUT[vb, vs, loc[0]] = pos(
                                A, vb, vs, tx * ((n_items(p) + NT - T.int64(1)) // NT) + j)
                            loc[0] = loc[0] + T.int64(1)
                        loc[1] = loc[1] + T.int64(1)
            for j in range((topk + lanes - 1) // lanes):
                if j * lanes + tx < topk:
                    if j * lanes + tx >= st[5]:
                        OUT[vb, vs, j * lanes + tx] = -1

    @T.macro
    def rows(S, A, OUT, b, s, p):
        if gpu:
            for r in T.thread_binding(b * s, thread="blockIdx.x"):
                row_gpu(S, A, OUT, r // s, r % s, p)
        else:
            GM = T.alloc_buffer((b * s, n_groups(p)), "uint32")  # group maxima
            for rc in T.parallel(b * s * NCH):  # runs of groups (no divisions per group)
                for gi in range(per_chunk(p)):
                    if rc % NCH * per_chunk(p) + gi < n_groups(p):
                        group_max(S, A, GM, rc // NCH, rc // NCH // s, rc // NCH % s,
                                  rc % NCH * per_chunk(p) + gi, p)
            for r in T.parallel(b * s):
                row_cpu(S, A, OUT, GM, r, r // s, r % s, p)

    if kind == "positions":
        @T.prim_func
        def select_positions(s_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_positions", "tirx.noalias": True})
            b, s, p = T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, S, OUT, b, s, p)

        func = select_positions
    elif kind == "blocks":
        @T.prim_func
        def select_blocks(s_h: T.handle, lens_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_blocks", "tirx.noalias": True})
            b, s, p = T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            L = T.match_buffer(lens_h, (b, s), "int64")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, L, OUT, b, s, p)

        func = select_blocks
    else:
        @T.prim_func
        def select_pool(s_h: T.handle, blocks_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_pool", "tirx.noalias": True})
            b, s, p, nb = T.int64(), T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, BL, OUT, b, s, T.min(p, nb * BS))

        func = select_pool
    return func.with_attr("tirx.is_scheduled", True)


@dataclass(frozen=True)
class SelectConfig:
    lanes: int  # workers per row: 1 on CPU (rows run in parallel), a thread block on CUDA
    group: int = 32  # CPU: items per group of the group-maximum prefilter
    chunks: int = 32  # CPU: parallel runs of groups per row in the group-maximum pass


def select_config(target: TargetSpec) -> SelectConfig:
    """CUDA: 256 threads per row (histogram atomics in shared memory, contiguous segments for the
    ordered emit). CPU: maxima of groups of 32 items (16 runs of groups per core in parallel),
    then one row per task. With k = 512, single core: 0.06 / 0.10 / 0.18 / 0.67 ms at 8K / 64K /
    256K / 1M entries; groups of 16 rank too many maxima at 1M (0.9 ms), groups of 64 or 128
    leave every group a candidate at 64K (0.19 / 0.31 ms)."""
    if target.is_cuda:
        return SelectConfig(lanes=256)
    cores = int(target.target.get("num-cores", 1))
    return SelectConfig(lanes=1, group=32, chunks=16 * max(cores, 1))


# ---- per-op builders ---------------------------------------------------------------------------


def _index_sweep(target: TargetSpec, heads: int, dim: int, n_alt: int = 0) -> tvm.tirx.PrimFunc:
    """The full sweep for `target`: hand-vectorised (AVX-512) or scheduled; with n_alt > 0 the
    shared-pointer variant (`index_scores_shared`)."""
    cfg = sweep_config(target, heads=heads, dim=dim)
    if cfg.avx512:
        return make_index_scores_avx512(
            heads=heads, dim=dim, tile=cfg.tile, head_block=cfg.head_block,
            max_tasks=cfg.max_tasks, vnni=cfg.vnni, lanes=cfg.lanes, amx=cfg.amx,
            n_alt=n_alt).with_attr("tirx.is_scheduled", True)
    return schedule_index_scores(make_index_scores(heads=heads, dim=dim, n_alt=n_alt), cfg,
                                 target)


def _pool_sweep(target: TargetSpec, heads: int, dim: int, block_size: int):
    cfg = sweep_config(target, heads=heads, dim=dim, pool=True)
    return schedule_index_scores(make_pool_scores(heads=heads, dim=dim, block_size=block_size),
                                 cfg, target)


def _select(target: TargetSpec, **kwargs) -> tvm.tirx.PrimFunc:
    cfg = select_config(target)
    return make_select(lanes=cfg.lanes, group=cfg.group, chunks=cfg.chunks, gpu=target.is_cuda,
                       **kwargs)


def build_indexer_topk(target_name: str = "cpu", *, heads: int, dim: int,
                       topk: int, n_alt: int = 0) -> tvm.IRModule:
    """indexer_topk = index_scores(q, k_packed, k_scales, weights, lens) -> scores
    [b, s, pad128(T)] bf16, then select_positions(scores) -> int32 [b, s, topk]. n_alt > 0:
    indexer_topk_shared, the sweep `index_scores_shared` (alternate stores + pick) instead."""
    target = get_target(target_name)
    name = "index_scores_shared" if n_alt else "index_scores"
    return tvm.IRModule({
        name: _index_sweep(target, heads, dim, n_alt),
        "select_positions": _select(target, topk=topk, kind="positions"),
    })


def build_hier_topk(target_name: str = "cpu", *, heads: int, dim: int, topk: int,
                    topk_blocks: int, block_size: int) -> tvm.IRModule:
    """hier_topk = index_scores -> scores, then select_positions(scores) -> positions and
    select_blocks(scores, lens) -> candidate blocks."""
    target = get_target(target_name)
    return tvm.IRModule({
        "index_scores": _index_sweep(target, heads, dim),
        "select_positions": _select(target, topk=topk, kind="positions"),
        "select_blocks": _select(target, topk=topk_blocks, kind="blocks",
                                 block_size=block_size),
    })


def build_pool_topk(target_name: str = "cpu", *, heads: int, dim: int, topk: int,
                    block_size: int, gather: bool = True) -> tvm.IRModule:
    """pool_topk = pool_scores(q, k_packed, k_scales, weights, lens, blocks) -> scores
    [b, s, pad128(B * block_size)], then select_pool(scores, blocks) -> positions. On AVX-512
    CPUs the sweep is the chain pool_gather / index_scores / pool_mask (`emit_pool_scores`)
    unless `gather` is False: the gathered store is 68 B per pool entry and query (1.1 MB per
    query at the released pool), so entries with many rows per call (an exact prefill chunk:
    2048 rows, 2.3 GB) keep the scheduled sweep, which decodes per tile."""
    target = get_target(target_name)
    select = _select(target, topk=topk, kind="pool", block_size=block_size)
    if gather and pool_gathers(target, heads=heads, dim=dim):
        return tvm.IRModule({
            "pool_gather": schedule_pool_gather(
                make_pool_gather(heads=heads, dim=dim, block_size=block_size)),
            "index_scores": _index_sweep(target, heads, dim),
            "pool_mask": schedule_pool_mask(make_pool_mask()),
            "select_pool": select,
        })
    return tvm.IRModule({
        "pool_scores": _pool_sweep(target, heads, dim, block_size),
        "select_pool": select,
    })


def padded(n: int) -> int:
    """Length of a score row for n entries (n rounded up to SCORE_PAD)."""
    return -(-n // SCORE_PAD) * SCORE_PAD


# ---- realistic inputs ---------------------------------------------------------------------------


def example_inputs_indexer_topk(*, b: int = 1, s: int = 1, heads: int = 32, dim: int = 128,
                                t: int = 8192, causal: bool = True,
                                seed: int = 0) -> list[torch.Tensor]:
    """[q, k_packed, k_scales, weights, lens] as the model makes them: q MXFP4-QDQ'd bf16, keys
    MXFP4-quantised from unit-scale activations, weights ~ N(0, 1) * D^-0.5 * H^-0.5 in bf16,
    lens = the causal visible counts of the last s positions of a T-long context."""
    g = torch.Generator().manual_seed(seed)
    q = fmt.torch_qdq_mxfp4(torch.randn(b, s, heads, dim, generator=g))
    k_packed, k_scales = fmt.torch_quant_mxfp4(torch.randn(b, t, dim, generator=g))
    weights = (torch.randn(b, s, heads, generator=g) * (dim**-0.5 * heads**-0.5)).bfloat16()
    if causal:
        lens = (torch.arange(t - s, t) + 1).clamp(min=0).expand(b, s).contiguous()
    else:
        lens = torch.full((b, s), t, dtype=torch.int64)
    return [q, k_packed, k_scales, weights, lens.to(torch.int64)]


def example_inputs_hier_topk(**kwargs) -> list[torch.Tensor]:
    """Same tensors as indexer_topk (topk, topk_blocks, block_size are kernel kwargs)."""
    return example_inputs_indexer_topk(**kwargs)


def example_inputs_pool_topk(*, topk_blocks: int = 2048, block_size: int = 8,
                             **kwargs) -> list[torch.Tensor]:
    """[q, k_packed, k_scales, weights, lens, blocks] with blocks = a hier_topk candidate pool
    (ascending, -1 padded) computed by the oracle from an independent set of scores."""
    from dsv41.graph import ops  # noqa: PLC0415 - the oracle, only for realistic pools

    q, kp, ks, w, lens = example_inputs_indexer_topk(**kwargs)
    src = example_inputs_indexer_topk(**{**kwargs, "seed": kwargs.get("seed", 0) + 1})
    score = ops.index_scores(*src[:4], lens)
    blocks = ops.candidate_blocks(score, lens, topk_blocks, block_size)
    return [q, kp, ks, w, lens, blocks]
