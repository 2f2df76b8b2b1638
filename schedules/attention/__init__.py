"""Sparse gather-attend: `torch.ops.dsv41.sparse_attend` and `sparse_attend_bf16` as TIR kernels.

Each query row (b, s) attends over its window entries (FP8 E4M3 codes, one E8M0 scale per 32)
followed by its selected global entries (FP4 E2M1 packed low nibble first, one E4M3 scale per
16; or plain bf16 for `sparse_attend_bf16`). K = V = the dequantised entry, shared by all heads.

Why the kernel is shaped the way it is:

* The oracle (`graph.ops.attend_blocks`) walks the concatenated list in blocks of 64 with an
  online softmax and rounds the probabilities to bf16 before PV. The kernel keeps that block
  structure (same running max, same rescale points, same bf16 rounding of p) so it agrees with
  the oracle to bf16 rounding; only fp32 summation orders differ.
* One task is (b, s, head group). A task dequantises each entry of a block ONCE into a staging
  tile and every head of the group dots with it: at the real size 64 heads share one 512-wide
  entry, so the decode cost is amortised over the heads. No dequantised cache is materialised
  (the bf16-dot path's prestage, below, holds only a chunk of rows' selected entries).
* The head-group size and the number of staged rows change the loop structure, so they are
  chosen at construction (`heads_per_group`, `stage_rows`, from the config chooser); the
  schedule then only parallelises/binds and vectorises named blocks.
* Index -1 is skipped (the row is zero and its logit -inf). Nothing else is validated inside:
  `check_sparse_attend_indices` is the host-side check the caller runs before the kernel.
* Entries are decoded behind a lazy branch on `idx >= 0`, so a -1 never reads memory and an
  empty global store (N = 0) is fine.
* CPU with AVX-512 or AVX2 (`vector_decode`): the staging is one hand-vectorised block instead
  of the per-element decode blocks: 16 values per step, FP4 through a 16-entry table lookup
  (vpermps) of both nibbles of 8 bytes (AVX2: two 8-lane lookups of the magnitude with the
  sign flipped in, `decode_lanes` 8, bit for bit), the row's E4M3 scales decoded as a vector
  once. The rest keeps its blocks and schedule.
* p is rounded to bf16 once per block (its own block, after the fp32 sum), not per use in PV;
  exp is a vectorisable polynomial (`_exp`, <= 1 ulp) rather than a libm call per lane.
* CPU with AVX-512 BF16 (`bf16_dot`, a multiple of 16 heads per task): QK and PV run on
  vdpbf16ps (`bf16_dot.py`: why the products stay exact, the layouts): 32 bf16 products per
  instruction against 16 fp32 FMAs, the entries staged as bf16 bits. Only the fp32 summation
  order and denormal flushing change; the block structure, the bf16 p and the tolerance stay.
  Measured on Zen 4 (h 64, d 512, w 128, k 512, one thread): a decode row 0.85 -> 0.53 ms,
  of which QK + PV ~0.72 -> 0.41 (the rest, 0.12, taken as unchanged); QK runs at ~95% and PV
  at ~85% of one vdpbf16ps per cycle.
* The bf16-dot path stages outside the tasks (`prestage`): every block of a chunk of rows is
  decoded once, in parallel over (row, block), into bf16 entries for QK and entry pairs for PV,
  and then the chunk's tasks (row, head group) read them. Staged per task, each head group
  decoded every entry again (at h 64 on 2 cores: twice; on one Zen 4 thread the staging was
  0.11 of a 0.53 ms decode row). A chunk is as many rows as PRESTAGE_BYTES of staged blocks
  hold (2 at the bench size: the chunk stays in the cores' L2), so the workspace is static
  and a long prefill does not grow it. The softmax of a block is one vectorised block of two
  passes (`softmax_vec`: logits and their running max, then p, its sum and the bf16 pairs), and
  PV adds its register tile into acc (acc * rescale + pv, as acc_update): the same operations
  in the same order, the results bit for bit those of the per-task staging. Measured (Zen 4,
  min of interleaved runs): one thread (CPU time), a decode row 0.53 -> 0.46 ms against 0.36 ms
  of vdpbf16ps at one per cycle (QK ~0.18 + PV ~0.19; the staging 0.045), 5 rows 2.65 ->
  2.35; two threads (wall, quiet windows) 0.268 -> 0.262 ms and 1.31 -> 1.19 ms. At one row
  half the staged blocks cross to the other core (tasks staging for themselves measured no
  better); the rows of a chunk stay mostly on the core that staged them.
* The vector staging prefetches the lines of the global entry GLOB_PREFETCH places ahead
  (its FP4 codes and scales) before decoding each one: the selection is scattered over the
  store, which a decode step reads from memory. Measured on a Xeon model 207 (2 threads, the
  store of 16K entries cycled through 128 copies, medians of interleaved calls): one row
  335 -> 303 us, 5 rows 1018 -> 863 us; 4, 8 and 16 ahead alike. The outputs are the same.
* Each (b, s) row is its own task, so the verify entry's 1 + k rows equal, bit for bit, the
  decode calls of those rows (greedy with speculation = greedy without).
"""

from __future__ import annotations

import math

import torch
import tvm
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import get_target
from dsv41.schedules.attention.amx_dot import make_amx_stages
from dsv41.schedules.attention.bf16_dot import (
    QRope,
    check_bf16_dot_dims,
    make_bf16_dot_stages,
    p_pair,
    q_pair_bits,
)
from dsv41.schedules.attention.configs import (
    ATTN_BLOCK,
    sparse_attend_config,
)
from dsv41.schedules.attention.schedule import schedule_sparse_attend
from dsv41.schedules.common import (
    amx,
    amx_configure,
    bf16_bits_of_exact,
    e4m3_to_f32,
    e4m3_to_f32_select,
    e8m0_to_f32,
    fp4_to_f32,
    round_bf16,
    signed_fp4_8,
)
from dsv41.schedules.common import prefetch as prefetch_line
from dsv41.schedules.rope import rotated_bits

FP8_BLOCK = 32  # window entries: one E8M0 scale per 32 values
FP4_BLOCK = 16  # global entries: one E4M3 scale per 16 values
NEG_BIG = -1e30  # the oracle's initial running max
# bf16_dot: the staged blocks of the rows prestaged at a time (both layouts); 2 rows at the
# bench size (h 64, d 512, w 128, k 512: 1.25 MiB a row). Measured in the bench preset's 64K
# verify of 1 + 4 rows on a 2-vCPU Xeon with AMX (2 MiB of L2 a core): the 38 attention calls
# took 45.5-46.2 ms in chunks of 2 rows against 54.2-54.8 ms in one chunk of 6 (8 MiB), whose
# staged blocks went through L3 while the step streamed its weights.
PRESTAGE_BYTES = (5 << 20) // 2
CACHE_LINE = 64
GLOB_PREFETCH = 8  # vector staging: global entries ahead whose lines are prefetched


# ---- host-side validation ------------------------------------------------------------------------


def check_sparse_attend_indices(win_idx: torch.Tensor, window_rows: int, kv_idx: torch.Tensor,
                                global_rows: int) -> None:
    """Raise ValueError unless every index is -1 or a row of its buffer.

    The kernel reads row `idx` of the window buffer (`window_rows` = W) or of the global cache
    (`global_rows` = N) without a bound check, so the caller runs this before it."""
    for name, idx, rows in (("win_idx", win_idx, window_rows), ("kv_idx", kv_idx, global_rows)):
        if idx.numel() == 0:
            continue
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1:
            raise ValueError(f"{name} holds {lo}; indices must be -1 (skipped) or >= 0.")
        if hi >= rows:
            raise ValueError(f"{name} holds {hi}, but its buffer has only {rows} rows.")


# ---- vector decoders (the vector_decode staging) -----------------------------------------------


def _exp(x, lanes: int = 1):
    """exp(x) in fp32 arithmetic that vectorises (T.exp becomes one libm call per lane): Cody-Waite
    reduction x = n ln2 + r and Cephes' expf polynomial; at most 1 ulp from the exact value
    (90% exact; libm's expf and torch's differ from it and from each other by an ulp as well),
    exp(0) = 1 exactly, 0 below -87.3 (libm gives a denormal there, which no sum of
    probabilities normalised to a maximum of 1 can see), +inf above 88.7, NaN kept. `lanes`:
    x is a float32 vector of that many lanes (the same operations, lane by lane)."""

    def const(v):  # a float32 constant as x's type
        return T.float32(v) if lanes == 1 else T.broadcast(T.float32(v), lanes)

    sfx = "" if lanes == 1 else f"x{lanes}"
    n = T.floor(T.max(T.min(x, T.float32(88.7)), T.float32(-87.3)) * T.float32(1.4426950408889634)
                + T.float32(0.5))
    r = (x - n * T.float32(0.693359375)) - n * T.float32(-2.12194440e-4)
    p = T.float32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        p = p * r + T.float32(c)
    y = (p * (r * r) + r) + T.float32(1)
    two_n = T.reinterpret("float32" + sfx, (T.Cast("int32" + sfx, n) + T.int32(127))
                          << T.int32(23))
    y = T.Select(x < const(-87.3), const(0), y * two_n)
    return T.Select(x > const(88.7), const(math.inf), T.Select(T.isnan(x), x, y))


def _nibbles(a):
    """8 packed bytes (uint32x8) -> their 16 nibbles, low nibble first (uint32x16; the lanes
    keep the bits above the nibble, which the table lookup ignores)."""
    return T.Shuffle([a, a >> T.uint32(4)], [i // 2 + 8 * (i % 2) for i in range(16)])


# ---- kernel factories ----------------------------------------------------------------------------


def _check_dims(h: int, d: int, w: int, k: int, hg: int, rows: int) -> None:
    if d % FP8_BLOCK or d % FP4_BLOCK:
        raise ValueError(f"head dim d={d} must be a multiple of {FP8_BLOCK}.")
    if h % hg:
        raise ValueError(f"heads_per_group={hg} must divide h={h}.")
    if ATTN_BLOCK % rows:
        raise ValueError(f"stage_rows={rows} must divide {ATTN_BLOCK}.")
    if w < 0 or k < 0 or w + k == 0:
        raise ValueError(f"window width w={w} and topk k={k} must be >= 0 with w + k > 0.")


def prestage_rows(*, d: int, w: int, k: int) -> int:
    """bf16_dot: the (b, s) rows staged at a time: as many as PRESTAGE_BYTES holds (at least
    1), so a verify's 1 + k rows are one chunk and a long prefill stays within the budget."""
    per_row = -(-(w + k) // ATTN_BLOCK) * ATTN_BLOCK * d * 2 * 2  # bf16, two layouts
    return max(1, PRESTAGE_BYTES // per_row)


def _make(kind: str, *, h: int, d: int, w: int, k: int, softmax_scale: float,
          heads_per_group: int | None, stage_rows: int, vector_decode: bool,
          bf16_dot: bool, chunk_rows: int | None, amx_dot: bool = False, decode_lanes: int = 16,
          rope_rd: int = 0) -> tvm.tirx.PrimFunc:
    """The shared body of both ops; `kind` is "fp4" or "bf16" (the global cache's format).
    amx_dot (with bf16_dot): QK and PV on AMX tiles (amx_dot.py), the rest as bf16_dot.
    rope_rd > 0 (fp4): `sparse_attend_rope`, q rotated on its last rope_rd dims as it is staged
    and the output rotated back as it is stored (`QRope`)."""
    if rope_rd and (kind != "fp4" or rope_rd % 2 or not 0 < rope_rd <= d):
        raise ValueError(f"The attention's RoPE needs the fp4 kind and an even rope_rd in "
                         f"1..d={d}; got {kind!r}, rope_rd={rope_rd}.")
    hg = heads_per_group or h
    _check_dims(h, d, w, k, hg, stage_rows)
    if vector_decode and d % 16:
        raise ValueError(f"vector_decode needs d to be a multiple of 16; got {d}.")
    if decode_lanes not in (8, 16) or (decode_lanes == 8 and (bf16_dot or amx_dot)):
        raise ValueError(f"The vector staging looks its FP4 values up in 16 lanes, or 8 (AVX2, "
                         f"fp32 dots); got decode_lanes={decode_lanes}.")
    if bf16_dot:
        check_bf16_dot_dims(hg=hg, d=d, stage_rows=stage_rows, blk=ATTN_BLOCK,
                            vector_decode=vector_decode)
        q_pairs, kv_pairs, qk_bf16, pv_bf16 = make_bf16_dot_stages(
            hg=hg, d=d, blk=ATTN_BLOCK)
    if amx_dot:
        if not bf16_dot:
            raise ValueError("amx_dot runs on the bf16_dot path's staging: build with "
                             "bf16_dot=True.")
        qk_amx, p_rows, pv_amx = make_amx_stages(hg=hg, d=d, blk=ATTN_BLOCK)
    H, D, HG, R = T.int64(h), T.int64(d), T.int64(hg), T.int64(stage_rows)
    NG = T.int64(h // hg)
    nl = w + k  # entries per query
    NB_INT = -(-nl // ATTN_BLOCK)
    NB = T.int64(NB_INT)  # online-softmax blocks
    NR = T.int64(ATTN_BLOCK // stage_rows)  # staging passes per block
    BLK = T.int64(ATTN_BLOCK)
    Wd, Kd, L = T.int64(w), T.int64(k), T.int64(nl)
    restage = stage_rows < ATTN_BLOCK  # PV needs the tile again when it was staged in parts
    chunk_rows = prestage_rows(d=d, w=w, k=k) if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1; got {chunk_rows}.")
    C = T.int64(chunk_rows)  # bf16_dot: rows prestaged at a time
    # bf16_dot: q as [d/2, heads] bf16 pairs, the tile as bf16 bits, the PV copy and p pairs
    q_shape, q_dtype = ((D // T.int64(2), HG), "uint32") if bf16_dot else ((D, HG), "float32")
    # bf16_dot: the entries are staged before the tasks (prestage), so the task has no tile
    kst_shape = (T.int64(1), T.int64(1)) if bf16_dot else (R, D)
    pvb_shape = (T.int64(1), T.int64(1)) if bf16_dot else (HG, D)  # bf16_dot: PV adds into acc
    pp_shape = (BLK // T.int64(2), HG) if bf16_dot else (T.int64(1),)
    pa_shape = (HG, BLK // T.int64(2)) if amx_dot else (T.int64(1), T.int64(1))
    yt_shape = (T.int64(32), T.int64(32)) if amx_dot else (T.int64(1), T.int64(1))
    cfg_shape = (T.int64(64),) if amx_dot else (T.int64(1),)  # amx_dot: the tile config
    scale = T.float32(softmax_scale)

    def u32(x):
        return T.Cast("uint32", x)

    def enc(v):  # a float32x16 of entry values as the staging tile holds them
        return bf16_bits_of_exact(v) if bf16_dot else v

    def win_value(win_codes, win_scales, vb, row, c):
        return (e4m3_to_f32(u32(win_codes[vb, row, c]))
                * e8m0_to_f32(u32(win_scales[vb, row, c // T.int64(FP8_BLOCK)])))

    def glob_value(gbufs, vb, row, c):
        if kind == "bf16":
            return T.Cast("float32", gbufs[0][vb, row, c])
        codes, scales = gbufs
        nib = (u32(codes[vb, row, c // T.int64(2)]) >> u32((c % T.int64(2)) * T.int64(4))) \
            & T.uint32(15)
        return fp4_to_f32(nib) * e4m3_to_f32(u32(scales[vb, row, c // T.int64(FP4_BLOCK)]))

    def win_row(win_idx, vb, vs, pos):  # int64 row of entry `pos` (< w), -1 if skipped
        return T.Cast("int64", win_idx[vb, vs, T.min(pos, Wd - T.int64(1))])

    def glob_row(kv_idx, vb, vs, pos):  # entry `pos` (>= w) of the global selection
        return T.Cast("int64", kv_idx[vb, vs, T.max(pos - Wd, T.int64(0))])

    def win_entry(bufs, vb, vs, pos, c):  # value c of window entry `pos` (< w); 0 if skipped
        win_codes, win_scales, win_idx, _, _ = bufs
        row = win_row(win_idx, vb, vs, pos)
        return T.if_then_else(row >= T.int64(0), win_value(win_codes, win_scales, vb, row, c),
                              T.float32(0))

    def glob_entry(bufs, vb, vs, pos, c):  # value c of entry `pos` (>= w); 0 if skipped/absent
        _, _, _, gbufs, kv_idx = bufs
        row = glob_row(kv_idx, vb, vs, pos)
        return T.if_then_else((pos < L) & (row >= T.int64(0)), glob_value(gbufs, vb, row, c),
                              T.float32(0))

    def valid(bufs, vb, vs, pos):
        _, _, win_idx, _, kv_idx = bufs
        ok = T.bool(False)
        if k > 0:
            ok = (pos < L) & (glob_row(kv_idx, vb, vs, pos) >= T.int64(0))
        if w > 0:
            ok = T.if_then_else(pos < Wd, win_row(win_idx, vb, vs, pos) >= T.int64(0), ok)
        return ok

    @T.macro
    def stage(bufs, kst, vb, vs, t, r):
        """Decode entries t * 64 + r * R + j (j < R) into kst; skipped or absent ones are 0.
        Window and global rows are separate blocks so each decodes only its own format; the
        FP4 block walks packed bytes and writes both nibbles (contiguous byte loads)."""
        if w > 0:
            for j, grp, e in T.grid(R, D // T.int64(FP8_BLOCK), T.int64(FP8_BLOCK)):
                with T.sblock("stage_win"):
                    vt = T.axis.spatial(NB, t)
                    vr = T.axis.spatial(NR, r)
                    vj, vgrp, ve = T.axis.remap("SSS", [j, grp, e])
                    T.where(t * BLK + r * R + j < Wd)
                    kst[vj, vgrp * T.int64(FP8_BLOCK) + ve] = win_entry(
                        bufs, vb, vs, vt * BLK + vr * R + vj, vgrp * T.int64(FP8_BLOCK) + ve)
        if k > 0 and kind == "bf16":
            for j, c in T.grid(R, D):
                with T.sblock("stage_glob"):
                    vt = T.axis.spatial(NB, t)
                    vr = T.axis.spatial(NR, r)
                    vj, vc = T.axis.remap("SS", [j, c])
                    T.where(t * BLK + r * R + j >= Wd)
                    kst[vj, vc] = glob_entry(bufs, vb, vs, vt * BLK + vr * R + vj, vc)
        if k > 0 and kind == "fp4":  # (row, scale group, byte, nibble)
            for j, grp, cb, nib in T.grid(R, D // T.int64(FP4_BLOCK), T.int64(FP4_BLOCK // 2),
                                          T.int64(2)):
                with T.sblock("stage_glob"):
                    vt = T.axis.spatial(NB, t)
                    vr = T.axis.spatial(NR, r)
                    vj, vgrp, vcb, vn = T.axis.remap("SSSS", [j, grp, cb, nib])
                    T.where(t * BLK + r * R + j >= Wd)
                    kst[vj, vgrp * T.int64(FP4_BLOCK) + vcb * T.int64(2) + vn] = glob_entry(
                        bufs, vb, vs, vt * BLK + vr * R + vj,
                        vgrp * T.int64(FP4_BLOCK) + vcb * T.int64(2) + vn)
        if k == 0 and w < ATTN_BLOCK * NB_INT:  # the last block's tail past w (with k > 0
            # the global block zeroes it)
            for j, c in T.grid(R, D):
                with T.sblock("stage_tail"):
                    vt = T.axis.spatial(NB, t)
                    vr = T.axis.spatial(NR, r)
                    vj, vc = T.axis.remap("SS", [j, c])
                    T.where(t * BLK + r * R + j >= L)
                    kst[vj, vc] = T.float32(0)

    def fp4_values(tbl, nib):
        """The E2M1 values of 16 nibbles (uint32x16, bits above each nibble ignored): one
        512-bit vpermps (AVX-512), or on AVX2 two halves of 8 (`signed_fp4_8`), bit for bit."""
        if decode_lanes == 16:
            return T.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.permvar.sf.512",
                                           tbl.vload([0], "float32x16"),
                                           T.reinterpret("int32x16", nib))
        halves = [signed_fp4_8(tbl.vload([0], "float32x8"),
                               T.Shuffle([nib], list(range(8 * h, 8 * h + 8)))) for h in (0, 1)]
        return T.Shuffle(halves, list(range(16)))

    @T.macro
    def row_fp8(bufs, kst, vb, j, row):  # 16 values at a time
        for c in range(D // T.int64(16)):
            kst[j, T.ramp(c * T.int64(16), 1, 16)] = enc(e4m3_to_f32_select(T.Cast(
                "uint32x16", bufs[0].vload([vb, row, c * T.int64(16)], "uint8x16")))
                * T.broadcast(e8m0_to_f32(u32(bufs[1][vb, row, c // T.int64(2)])), 16))

    @T.macro
    def row_glob(bufs, kst, sc, tbl, vb, j, row):
        if kind == "bf16":
            for c in range(D // T.int64(16)):
                kst[j, T.ramp(c * T.int64(16), 1, 16)] = enc(T.Cast(
                    "float32x16", bufs[3][0].vload([vb, row, c * T.int64(16)], "bfloat16x16")))
        else:  # FP4: both nibbles of 8 bytes interleaved, looked up in the E2M1 table
            for g in T.vectorized(D // T.int64(FP4_BLOCK)):
                sc[g] = e4m3_to_f32_select(u32(bufs[3][1][vb, row, g]))
            for g in range(D // T.int64(FP4_BLOCK)):
                kst[j, T.ramp(g * T.int64(16), 1, 16)] = enc(fp4_values(tbl, _nibbles(T.Cast(
                    "uint32x8", bufs[3][0].vload([vb, row, g * T.int64(8)], "uint8x8"))))
                    * T.broadcast(sc[g], 16))

    @T.macro
    def glob_prefetch(bufs, vb, vs, pos):
        """The lines of global entry `pos` (FP4 codes and scales; a skipped entry's -1 reads
        row 0): the selection is scattered over the store, so no hardware prefetcher sees
        the next entry coming."""
        row = T.meta_var(T.max(glob_row(bufs[4], vb, vs, pos), T.int64(0)))
        for c in range(D // T.int64(2 * CACHE_LINE)):
            prefetch_line(T.address_of(bufs[3][0][vb, row, c * T.int64(CACHE_LINE)]))
        prefetch_line(T.address_of(bufs[3][1][vb, row, T.int64(0)]))

    @T.macro
    def zero_row(kst, j):
        for c in range(D // T.int64(16)):
            kst[j, T.ramp(c * T.int64(16), 1, 16)] = enc(T.broadcast(T.float32(0), 16))

    @T.macro
    def stage_vec(bufs, kst, sc, tbl, vb, vs, t, r, k0):
        """stage() hand-vectorised for AVX-512 (one opaque block; the schedule leaves it), into
        rows k0 .. k0 + R - 1 of kst."""
        with T.sblock("stage_vec"):
            for i in T.unroll(16):  # the E2M1 values in code order (constants once unrolled)
                tbl[i] = fp4_to_f32(u32(i))
            for j in range(R):
                if t * BLK + r * R + j < Wd:
                    if win_row(bufs[2], vb, vs, t * BLK + r * R + j) >= T.int64(0):
                        row_fp8(bufs, kst, vb, k0 + j,
                                win_row(bufs[2], vb, vs, t * BLK + r * R + j))
                    else:
                        zero_row(kst, k0 + j)
                elif t * BLK + r * R + j < L:
                    if GLOB_PREFETCH > 0 and kind == "fp4":  # static
                        glob_prefetch(bufs, vb, vs, T.min(t * BLK + r * R + j + GLOB_PREFETCH,
                                                          L - T.int64(1)))
                    if glob_row(bufs[4], vb, vs, t * BLK + r * R + j) >= T.int64(0):
                        row_glob(bufs, kst, sc, tbl, vb, k0 + j,
                                 glob_row(bufs[4], vb, vs, t * BLK + r * R + j))
                    else:
                        zero_row(kst, k0 + j)
                else:
                    zero_row(kst, k0 + j)

    def vec(h0):  # heads h0 * 16 .. h0 * 16 + 15
        return T.ramp(h0 * T.int64(16), 1, 16)

    def round_bf16_vec(x):  # round_bf16 of a float32x16, lane by lane
        u = T.reinterpret("uint32x16", x)
        return T.Select(T.isnan(x), x, T.reinterpret("float32x16", (
            u + ((u >> T.broadcast(T.uint32(16), 16)) & T.broadcast(T.uint32(1), 16))
            + T.broadcast(T.uint32(0x7FFF), 16)) & T.broadcast(T.uint32(0xFFFF0000), 16)))

    @T.macro
    def softmax_vec(bufs, dots, lg, mx, mn, psum, pp, vb, vs, t):
        """bf16_dot: the logit, block_max, prob, denom, p_bf16 and p_pairs blocks in two passes
        over the block, 16 heads a vector, each the same operations in the same order (j
        ascending): the logits and their running max, then p, its fp32 sum and the bf16 pairs
        PV takes (bf16_dot.p_pair; lg keeps the unrounded p)."""
        with T.sblock("softmax_vec"):
            for h0 in range(HG // T.int64(16)):
                mn[vec(h0)] = mx[vec(h0)]
                for j in range(BLK):
                    if valid(bufs, vb, vs, t * BLK + j):
                        lg[j, vec(h0)] = dots[j, vec(h0)] * T.broadcast(scale, 16)
                    else:
                        lg[j, vec(h0)] = T.broadcast(T.float32(-math.inf), 16) \
                            * T.broadcast(scale, 16)
                    mn[vec(h0)] = T.max(mn[vec(h0)], lg[j, vec(h0)])
                psum[vec(h0)] = T.broadcast(T.float32(0), 16)
                for j in range(BLK // T.int64(2)):
                    for e in T.unroll(2):
                        lg[j * 2 + e, vec(h0)] = _exp(lg[j * 2 + e, vec(h0)] - mn[vec(h0)], 16)
                        psum[vec(h0)] = psum[vec(h0)] + lg[j * 2 + e, vec(h0)]
                    pp[j, vec(h0)] = p_pair(round_bf16_vec(lg[j * 2, vec(h0)]),
                                            round_bf16_vec(lg[j * 2 + 1, vec(h0)]))

    @T.macro
    def prestage(bufs, kall, kvall, vb, vs, t, k0):
        """bf16_dot: block t of row (vb, vs) staged into rows k0 .. k0 + 63 of kall (bf16 bits
        [row, d], for QK) and as entry pairs into kvall (for PV), once for all head groups
        (inside the "prestage" sblock)."""
        gsc = T.sblock_alloc_buffer((D // T.int64(FP4_BLOCK),), "float32")
        tbl = T.sblock_alloc_buffer((16,), "float32")
        stage_vec(bufs, kall, gsc, tbl, vb, vs, t, T.int64(0), k0)
        kv_pairs(kall, k0, kvall, k0 // T.int64(2))

    def q_value(q, vb, vs, head, c, rope):
        """q[head, c] as fp32, rotated (element c of its pair) where c >= rope.nope."""
        plain = T.Cast("float32", q[vb, vs, head, c])
        if rope is None:
            return plain
        bits = q_pair_bits(q, vb, vs, head, c // T.int64(2), rope)
        half = T.Select(c % T.int64(2) == T.int64(0), bits & T.uint32(0xFFFF),
                        bits >> T.uint32(16))
        return T.Select(c < rope.nope, plain, T.reinterpret("float32", half << T.uint32(16)))

    def out_value(acc, den, vb, vs, vh, c, rope):
        """The output element as bf16: acc / den rounded, and where c >= rope.nope its pair
        (both rounded first, as the rope kernel reads them) rotated back."""
        plain = T.Cast("bfloat16", acc[vh, c] / den[vh])
        if rope is None:
            return plain
        c0 = rope.nope + T.max(c - rope.nope, T.int64(0)) // T.int64(2) * T.int64(2)
        p = (c0 - rope.nope) // T.int64(2)
        tb = rope.table_row(vb)
        re_b, im_b = rotated_bits(round_bf16(acc[vh, c0] / den[vh]),
                                  round_bf16(acc[vh, c0 + T.int64(1)] / den[vh]),
                                  rope.cos[tb, vs, p], rope.sin[tb, vs, p], inverse=True)
        bits = T.Select(c % T.int64(2) == T.int64(0), re_b, im_b)
        return T.Select(c < rope.nope, plain,
                        T.reinterpret("bfloat16", T.Cast("uint16", bits)))

    @T.macro
    def task_body(q, bufs, sink, out, kall, kvall, vb, vs, vg, k0, rope):
        """One task: row (vb, vs) of the output for head group vg, inside its sblock; bf16_dot:
        the row's staged blocks start at row k0 of kall (None otherwise)."""
        qt = T.sblock_alloc_buffer(q_shape, q_dtype)  # q of the group, transposed
        kst = T.sblock_alloc_buffer(kst_shape, "float32")  # staged entries
        pp = T.sblock_alloc_buffer(pp_shape, "uint32")  # bf16_dot: p pairs
        gsc = T.sblock_alloc_buffer((D // T.int64(FP4_BLOCK),), "float32")  # row scales
        tbl = T.sblock_alloc_buffer((16,), "float32")  # E2M1 values (vector_decode)
        dots = T.sblock_alloc_buffer((BLK, HG), "float32")  # q . entry
        lg = T.sblock_alloc_buffer((BLK, HG), "float32")  # logits, then p
        acc = T.sblock_alloc_buffer((HG, D), "float32")
        mx = T.sblock_alloc_buffer((HG,), "float32")  # running max
        mn = T.sblock_alloc_buffer((HG,), "float32")  # the block's new max
        den = T.sblock_alloc_buffer((HG,), "float32")
        psum = T.sblock_alloc_buffer((HG,), "float32")  # the block's sum of p
        pvb = T.sblock_alloc_buffer(pvb_shape, "float32")  # the block's p @ entries
        pa = T.sblock_alloc_buffer(pa_shape, "uint32")  # amx_dot: p pairs, heads as rows
        yt = T.sblock_alloc_buffer(yt_shape, "float32")  # amx_dot: a 32 x 32 tile of PV
        cfg = T.sblock_alloc_buffer(cfg_shape, "uint8", scope="local")  # amx_dot: tile config
        if amx_dot:
            amx_configure(cfg)
        if bf16_dot:
            q_pairs(q, qt, vb, vs, vg, rope)
        else:
            for c, hh in T.grid(D, HG):
                with T.sblock("q_stage"):
                    vc, vh = T.axis.remap("SS", [c, hh])
                    qt[vc, vh] = q_value(q, vb, vs, vg * HG + vh, vc, rope)
        for hh in range(HG):
            with T.sblock("state_init"):
                vh = T.axis.remap("S", [hh])
                mx[vh] = T.float32(NEG_BIG)
                den[vh] = T.float32(0)
        if bf16_dot:  # PV adds into acc itself (acc * rescale + pv, as acc_update)
            for hh, c in T.grid(HG, D):
                with T.sblock("acc_init"):
                    vh, vc = T.axis.remap("SS", [hh, c])
                    acc[vh, vc] = T.float32(0)
        for t in range(NB):
            for r in range(NR):
                if amx_dot:
                    qk_amx(kall, k0 + t * BLK, qt, dots)
                elif bf16_dot:
                    qk_bf16(kall, k0 + t * BLK, qt, dots)
                elif vector_decode:
                    stage_vec(bufs, kst, gsc, tbl, vb, vs, t, r, T.int64(0))
                else:
                    stage(bufs, kst, vb, vs, t, r)
                if not bf16_dot:
                    for j, hh, c in T.grid(R, HG, D):
                        with T.sblock("qk"):
                            vr = T.axis.spatial(NR, r)
                            vj, vh, vc = T.axis.remap("SSR", [j, hh, c])
                            with T.init():
                                dots[vr * R + vj, vh] = T.float32(0)
                            dots[vr * R + vj, vh] = dots[vr * R + vj, vh] \
                                + kst[vj, vc] * qt[vc, vh]
            if bf16_dot:
                softmax_vec(bufs, dots, lg, mx, mn, psum, pp, vb, vs, t)
            if amx_dot:
                p_rows(pp, pa)
            else:
                for j, hh in T.grid(BLK, HG):
                    with T.sblock("logit"):
                        vt = T.axis.spatial(NB, t)
                        vj, vh = T.axis.remap("SS", [j, hh])
                        lg[vj, vh] = T.if_then_else(
                            valid(bufs, vb, vs, vt * BLK + vj), dots[vj, vh],
                            T.float32(-math.inf)) * scale
                for hh, j in T.grid(HG, BLK):
                    with T.sblock("block_max"):
                        vh, vj = T.axis.remap("SR", [hh, j])
                        with T.init():
                            mn[vh] = mx[vh]
                        mn[vh] = T.max(mn[vh], lg[vj, vh])
                for j, hh in T.grid(BLK, HG):
                    with T.sblock("prob"):
                        vj, vh = T.axis.remap("SS", [j, hh])
                        lg[vj, vh] = _exp(lg[vj, vh] - mn[vh])
            for hh in range(HG):
                with T.sblock("rescale"):
                    vh = T.axis.remap("S", [hh])
                    mx[vh] = T.exp(mx[vh] - mn[vh])  # mx holds the rescale factor now
            if not bf16_dot:
                for hh, j in T.grid(HG, BLK):
                    with T.sblock("denom"):
                        vh, vj = T.axis.remap("SR", [hh, j])
                        with T.init():
                            psum[vh] = T.float32(0)
                        psum[vh] = psum[vh] + lg[vj, vh]
            for hh in range(HG):
                with T.sblock("denom_update"):
                    vh = T.axis.remap("S", [hh])
                    den[vh] = den[vh] * mx[vh] + psum[vh]
            if not bf16_dot:
                for j, hh in T.grid(BLK, HG):
                    with T.sblock("p_bf16"):  # p as PV uses it (the sum above took fp32 p)
                        vj, vh = T.axis.remap("SS", [j, hh])
                        lg[vj, vh] = round_bf16(lg[vj, vh])
            for r in range(NR):
                if restage:
                    if vector_decode:
                        stage_vec(bufs, kst, gsc, tbl, vb, vs, t, r, T.int64(0))
                    else:
                        stage(bufs, kst, vb, vs, t, r)
                if amx_dot:
                    pv_amx(kvall, (k0 + t * BLK) // T.int64(2), pa, acc, mx, yt)
                elif bf16_dot:
                    pv_bf16(kvall, (k0 + t * BLK) // T.int64(2), pp, acc, mx)
                else:
                    for hh, c, j in T.grid(HG, D, R):
                        with T.sblock("pv"):
                            vr = T.axis.spatial(NR, r)
                            vh, vc, vj = T.axis.remap("SSR", [hh, c, j])
                            with T.init():
                                pvb[vh, vc] = T.float32(0)
                            pvb[vh, vc] = pvb[vh, vc] \
                                + lg[vr * R + vj, vh] * kst[vj, vc]
                    for hh, c in T.grid(HG, D):
                        with T.sblock("acc_update"):
                            # a reduction over (t, r) in form: acc starts at 0 and is its
                            # only writer, so it can be computed at pv's loops on CUDA
                            vt = T.axis.reduce(NB, t)
                            vr = T.axis.reduce(NR, r)
                            vh, vc = T.axis.remap("SS", [hh, c])
                            with T.init():
                                acc[vh, vc] = T.float32(0)
                            # acc * rescale + pv as the oracle; later passes only add
                            acc[vh, vc] = acc[vh, vc] * T.if_then_else(
                                vr == T.int64(0), mx[vh], T.float32(1)) + pvb[vh, vc]
            for hh in range(HG):
                with T.sblock("max_update"):
                    vh = T.axis.remap("S", [hh])
                    mx[vh] = mn[vh]
        for hh in range(HG):
            with T.sblock("sink"):
                vh = T.axis.remap("S", [hh])
                den[vh] = den[vh] + T.exp(sink[vg * HG + vh] - mx[vh])
        for hh, c in T.grid(HG, D):
            with T.sblock("out"):
                vh, vc = T.axis.remap("SS", [hh, c])
                out[vb, vs, vg * HG + vh, vc] = out_value(acc, den, vb, vs, vh, vc, rope)
        if amx_dot:
            amx("tilerelease")

    @T.macro
    def body(q, bufs, sink, out, rope):
        b = q.shape[0]
        s = q.shape[1]
        if bf16_dot:  # (a Python if: no scope) chunks of up to C rows: prestage, then tasks
            kall = T.alloc_buffer((C * NB * BLK, D), "uint16")  # staged entries
            kvall = T.alloc_buffer((C * NB * BLK // T.int64(2), D * T.int64(2)), "uint16")
            for ck in range((b * s + C - T.int64(1)) // C):
                for i, t in T.grid(T.min(C, b * s - ck * C), NB):
                    with T.sblock("prestage"):
                        vck = T.axis.spatial((b * s + C - T.int64(1)) // C, ck)
                        vi, vt = T.axis.remap("SS", [i, t])
                        prestage(bufs, kall, kvall, (vck * C + vi) // s, (vck * C + vi) % s, vt,
                                 (vi * NB + vt) * BLK)
                for i, g in T.grid(T.min(C, b * s - ck * C), NG):
                    with T.sblock("task"):
                        vck = T.axis.spatial((b * s + C - T.int64(1)) // C, ck)
                        vi, vg = T.axis.remap("SS", [i, g])
                        task_body(q, bufs, sink, out, kall, kvall, (vck * C + vi) // s,
                                  (vck * C + vi) % s, vg, vi * NB * BLK, rope)
        else:
            for bb, ss, g in T.grid(b, s, NG):
                with T.sblock("task"):
                    vb, vs, vg = T.axis.remap("SSS", [bb, ss, g])
                    task_body(q, bufs, sink, out, None, None, vb, vs, vg, T.int64(0), rope)

    if rope_rd:
        R2, NOPE = T.int64(rope_rd // 2), T.int64(d - rope_rd)

        @T.prim_func(s_tir=True)
        def sparse_attend_rope(q_h: T.handle, cos_h: T.handle, sin_h: T.handle,
                               wc_h: T.handle, ws_h: T.handle, wi_h: T.handle,
                               kc_h: T.handle, ks_h: T.handle, ki_h: T.handle,
                               sink: T.Buffer((H,), "float32"), o_h: T.handle):
            T.func_attr({"global_symbol": "sparse_attend_rope", "tirx.noalias": True})
            b, s, nw, ng, cb = T.int64(), T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
            cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
            sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
            win_codes = T.match_buffer(wc_h, (b, nw, D), "uint8")
            win_scales = T.match_buffer(ws_h, (b, nw, D // T.int64(FP8_BLOCK)), "uint8")
            win_idx = T.match_buffer(wi_h, (b, s, Wd), "int32")
            kv_codes = T.match_buffer(kc_h, (b, ng, D // T.int64(2)), "uint8")
            kv_scales = T.match_buffer(ks_h, (b, ng, D // T.int64(FP4_BLOCK)), "uint8")
            kv_idx = T.match_buffer(ki_h, (b, s, Kd), "int32")
            out = T.match_buffer(o_h, (b, s, H, D), "bfloat16")
            body(q, (win_codes, win_scales, win_idx, (kv_codes, kv_scales), kv_idx), sink, out,
                 QRope(cos, sin, NOPE))

        return sparse_attend_rope

    if kind == "fp4":

        @T.prim_func(s_tir=True)
        def sparse_attend(q_h: T.handle, wc_h: T.handle, ws_h: T.handle, wi_h: T.handle,
                          kc_h: T.handle, ks_h: T.handle, ki_h: T.handle,
                          sink: T.Buffer((H,), "float32"), o_h: T.handle):
            T.func_attr({"global_symbol": "sparse_attend", "tirx.noalias": True})
            b, s, nw, ng = T.int64(), T.int64(), T.int64(), T.int64()
            q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
            win_codes = T.match_buffer(wc_h, (b, nw, D), "uint8")
            win_scales = T.match_buffer(ws_h, (b, nw, D // T.int64(FP8_BLOCK)), "uint8")
            win_idx = T.match_buffer(wi_h, (b, s, Wd), "int32")
            kv_codes = T.match_buffer(kc_h, (b, ng, D // T.int64(2)), "uint8")
            kv_scales = T.match_buffer(ks_h, (b, ng, D // T.int64(FP4_BLOCK)), "uint8")
            kv_idx = T.match_buffer(ki_h, (b, s, Kd), "int32")
            out = T.match_buffer(o_h, (b, s, H, D), "bfloat16")
            body(q, (win_codes, win_scales, win_idx, (kv_codes, kv_scales), kv_idx), sink, out,
                 None)

        return sparse_attend

    @T.prim_func(s_tir=True)
    def sparse_attend_bf16(q_h: T.handle, wc_h: T.handle, ws_h: T.handle, wi_h: T.handle,
                           kv_h: T.handle, ki_h: T.handle, sink: T.Buffer((H,), "float32"),
                           o_h: T.handle):
        T.func_attr({"global_symbol": "sparse_attend_bf16", "tirx.noalias": True})
        b, s, nw, ng = T.int64(), T.int64(), T.int64(), T.int64()
        q = T.match_buffer(q_h, (b, s, H, D), "bfloat16")
        win_codes = T.match_buffer(wc_h, (b, nw, D), "uint8")
        win_scales = T.match_buffer(ws_h, (b, nw, D // T.int64(FP8_BLOCK)), "uint8")
        win_idx = T.match_buffer(wi_h, (b, s, Wd), "int32")
        kv = T.match_buffer(kv_h, (b, ng, D), "bfloat16")
        kv_idx = T.match_buffer(ki_h, (b, s, Kd), "int32")
        out = T.match_buffer(o_h, (b, s, H, D), "bfloat16")
        body(q, (win_codes, win_scales, win_idx, (kv,), kv_idx), sink, out, None)

    return sparse_attend_bf16


def make_sparse_attend(*, h: int, d: int, w: int, k: int, softmax_scale: float,
                       heads_per_group: int | None = None,
                       stage_rows: int = ATTN_BLOCK,
                       vector_decode: bool = False,
                       bf16_dot: bool = False,
                       chunk_rows: int | None = None,
                       amx_dot: bool = False, rope_rd: int = 0,
                       decode_lanes: int = 16) -> tvm.tirx.PrimFunc:
    """`dsv41.sparse_attend` with w window and k global entries per query (both static).
    Buffers: q, win_codes, win_scales, win_idx, kv_codes, kv_scales, kv_idx, sink, out.
    chunk_rows (bf16_dot): rows prestaged at a time (default `prestage_rows`); amx_dot (with
    bf16_dot): QK and PV on AMX tiles. rope_rd > 0: `dsv41.sparse_attend_rope` (cos and sin
    after q: q's last rope_rd dims rotated as the tasks stage it, the output's rotated back as
    they store it, each as the rope kernel rotates, so the kernel is the rope, sparse_attend and
    inverse rope kernels in turn, bit for bit). decode_lanes (vector_decode): the FP4 lookup's
    vectors, 16 (AVX-512) or 8 (AVX2)."""
    return _make("fp4", h=h, d=d, w=w, k=k, softmax_scale=softmax_scale,
                 heads_per_group=heads_per_group, stage_rows=stage_rows,
                 vector_decode=vector_decode, bf16_dot=bf16_dot, chunk_rows=chunk_rows,
                 amx_dot=amx_dot, rope_rd=rope_rd, decode_lanes=decode_lanes)


def make_sparse_attend_bf16(*, h: int, d: int, w: int, k: int, softmax_scale: float,
                            heads_per_group: int | None = None,
                            stage_rows: int = ATTN_BLOCK,
                            vector_decode: bool = False,
                            bf16_dot: bool = False,
                            chunk_rows: int | None = None,
                            amx_dot: bool = False) -> tvm.tirx.PrimFunc:
    """`dsv41.sparse_attend_bf16`: the global cache is bf16 [b, N, d].
    Buffers: q, win_codes, win_scales, win_idx, kv, kv_idx, sink, out.
    chunk_rows (bf16_dot): rows prestaged at a time (default `prestage_rows`); amx_dot (with
    bf16_dot): QK and PV on AMX tiles."""
    return _make("bf16", h=h, d=d, w=w, k=k, softmax_scale=softmax_scale,
                 heads_per_group=heads_per_group, stage_rows=stage_rows,
                 vector_decode=vector_decode, bf16_dot=bf16_dot, chunk_rows=chunk_rows,
                 amx_dot=amx_dot)


# ---- realistic inputs ----------------------------------------------------------------------------


def example_inputs_sparse_attend(*, b: int = 1, s: int = 1, h: int = 64, d: int = 512,
                                 w: int = 128, k: int = 512, n: int | None = None,
                                 context: int | None = None, seed: int = 0,
                                 global_format: str = "fp4") -> list[torch.Tensor]:
    """[q, win_codes, win_scales, win_idx, kv_codes, kv_scales, kv_idx, sink] (global_format
    "fp4") or [q, win_codes, win_scales, win_idx, kv, kv_idx, sink] ("bf16"), as the model
    builds them: RMS-scale entries quantised with `graph.formats`, a window buffer of w + s rows
    where query i sees the up-to-w newest of `context` + i + 1 positions (ascending, -1 padded),
    and k distinct ascending global rows out of n (-1 padded when n < k). softmax_scale is
    d ** -0.5 by convention (it is not a tensor)."""

    gen = torch.Generator().manual_seed(seed)
    n = 4 * k if n is None else n
    context = w if context is None else context
    q = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16)
    rows = w + s
    win_codes, win_scales = fmt.torch_quant_fp8(torch.randn(b, rows, d, generator=gen), FP8_BLOCK)
    pos = context + torch.arange(s).view(s, 1) - w + 1 + torch.arange(w)  # (s, w) positions
    win_idx = torch.where(pos >= 0, pos % rows, -1).to(torch.int32).expand(b, s, w).contiguous()
    glob = torch.randn(b, n, d, generator=gen)
    kv_idx = torch.full((b, s, k), -1, dtype=torch.int32)
    for bi in range(b):
        for si in range(s):
            pick = torch.randperm(n, generator=gen)[: min(k, n)].sort().values
            kv_idx[bi, si, : pick.numel()] = pick.to(torch.int32)
    sink = torch.randn(h, generator=gen)
    if global_format == "bf16":
        return [q, win_codes, win_scales, win_idx, glob.to(torch.bfloat16), kv_idx, sink]
    kv_codes, kv_scales = fmt.torch_quant_fp4_kv(glob)
    return [q, win_codes, win_scales, win_idx, kv_codes, kv_scales, kv_idx, sink]
def build_sparse_attend(target_name: str, *, rope_rd: int = 0, **dims) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder); rope_rd: the
    `sparse_attend_rope` form."""
    target = get_target(target_name)
    cfg = sparse_attend_config(target, **dims)
    func = make_sparse_attend(**dims, heads_per_group=cfg.heads_per_group,
                              stage_rows=cfg.stage_rows, vector_decode=cfg.vector_decode,
                              bf16_dot=cfg.bf16_dot, amx_dot=cfg.amx_dot, rope_rd=rope_rd,
                              decode_lanes=cfg.decode_lanes)
    return schedule_sparse_attend(func, cfg, target)


def build_sparse_attend_bf16(target_name: str, **dims) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = sparse_attend_config(target, **dims)
    func = make_sparse_attend_bf16(**dims, heads_per_group=cfg.heads_per_group,
                                   stage_rows=cfg.stage_rows, vector_decode=cfg.vector_decode,
                                   bf16_dot=cfg.bf16_dot, amx_dot=cfg.amx_dot)
    return schedule_sparse_attend(func, cfg, target)
