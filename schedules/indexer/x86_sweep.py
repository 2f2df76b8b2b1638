"""The hand-vectorised full sweep for x86 CPUs (`make_index_scores_avx512`): AVX-512 fp32,
AVX-512 VNNI int8, AVX2 int8 (lanes 8) and AMX-INT8 dots over in-register-transposed FP4 keys."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.schedules.common import amx as amx_instr
from dsv41.schedules.common import (
    amx_configure,
    fp4_to_f32_select,
    permps,
    round_bf16,
    round_bf16_finite,
)
from dsv41.schedules.indexer.amx_sweep import (
    AMX_EXP_HI,
    AMX_EXP_LO,
    AMX_HEADS,
    AMX_TILE,
    code_max,
    code_min,
    code_of,
    code_word,
    permb,
    shift_bytes,
)
from dsv41.schedules.indexer.sweep import (
    MAX_ALT,
    SCORE_PAD,
    check_alt,
    check_dim,
    e8m0,
    head_chunks,
    neg_inf_bf16,
    pad_expr,
    part_sum,
)


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
    che, _ = head_chunks(heads)
    dims = dim % 128 == 0 if lanes == 8 else dim in (32, 64) or dim % 128 == 0
    return dims and heads % head_block == 0 and che % head_block == 0


def make_index_scores_avx512(*, heads: int, dim: int, tile: int = 64, head_block: int = 4,
                             max_tasks: int = 32, vnni: bool = False, lanes: int = 16,
                             amx: bool = False, vbmi: bool = False,
                             n_alt: int = 0) -> tvm.tirx.PrimFunc:
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
    - epilogue: the oracle's roundings (`head_term`) and the head sum in torch's chunk order, then
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

    `vbmi` (AVX-512 VBMI without AMX; vnni, lanes 16, dim 128): the same folding of the block
    scales into int8 shifts (the keys decoded by vpermb, the tiles and the q that allow it as
    for AMX), with the dot on vpdpbusd over all of D: per (head, entry) one int32 accumulator
    and one scaling, instead of 4 block accumulators each converted, scaled and added in fp32.
    vpdpbusd multiplies unsigned by signed bytes, so the key bytes carry +128 (32..224) and the
    accumulator starts at -128 * the head's shifted q ints; |sum| <= 128 * 96 * 120 < 2^24, so
    it is exact and (times its power of two) the same dot, the same bits. Per 32-entry tile and
    query this leaves, per 8-head group, 512 vpdpbusd (32 quads x 8 heads x 2 vectors, the q
    quad a broadcast memory operand) and 64 key loads, then 16 converts, 32 multiplies and the
    epilogue's per-head rounding, against 512 vpdpbusd plus 4 x (16 starts, 16 converts, 32
    multiplies / FMAs) for the block-scaled dot.

    Floor (H = 32, D = 128, one query): the 2048 vpdpbusd of a 32-entry tile (H * D * 32 MACs,
    64 per instruction), 64 per entry, at the measured rate of one zmm vpdpbusd per cycle and
    core (Zen 4: 3.6-3.7 G/s per core, two 256-bit halves; the dot loop with its q broadcasts and
    key loads runs at that rate in isolation): 64 cycles per entry, 18.3 ms per 1M entries on
    one core, 9.1 ms on two. Measured on one Zen 4 core (2 vCPUs shared with other work, min
    of 6-10): 104-106 cycles per entry with the VBMI dot, 128-134 with the block-scaled VNNI
    dot, 196 for the AVX2 form (lanes 8) on the same core. The rest above the floor: the
    epilogue (two bf16 roundings, relu, weight, chunk sum: ~16 vector ops per 16 (head, entry)
    terms, ~12 cycles per entry) and the key decode (transpose, vpermb, check_tile: ~15 vector
    ops per entry). A decode step at 1M context on the bench preset sweeps ~2.6M entries (three
    ratio-2 index sources of 512K, one ratio-1 of 1M, four pools of 16K): 23 ms at the floor on
    2 cores.

    `n_alt` > 0: `index_scores_shared`, the sweep behind the released shared index-K pointer
    (see `make_index_scores`), one pick per query token: each batch row's tasks sweep their tiles
    of each store some query of the row names, once, and score on it only those queries (a
    decode step: one store per row, as before; a verify pass's 1 + k tokens: usually two stores,
    each tile decoded once per store, not once per store and token)."""
    check_dim(dim)
    che, nc = head_chunks(heads)
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
    if vbmi and (amx or not (vnni and lanes == 16 and dim == 128)):
        raise ValueError(f"The VBMI sweep needs vnni, lanes 16 and dim 128, and not amx; got "
                         f"vnni={vnni}, lanes={lanes}, dim={dim}, amx={amx}.")
    check_alt(n_alt)
    shifted = amx or vbmi  # the block scales folded into int8 shifts where q and keys allow
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
        return pad_expr(t) // TT

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
    def prep_amx(qw, qex, qa, qs, qcs, qlim, flag, lo, hi, b, s):
        """flag 1 -> 2 if every head's q block exponents span at most 3: qa = the quads of qw
        with each block's ints shifted left by its exponent over the head's smallest (signed
        bytes), qs = 2^(that exponent - 4) (1 for a zero head), qlim = the smallest and the
        largest of those exponents over the call's heads; VBMI: qcs = -128 * the sum of a
        head's qa bytes (the start of its biased vpdpbusd dot)."""
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
                    qa[r // s, r % s, h, j] = shift_bytes(
                        qw[r // s, r % s, h, j],
                        T.max(qex[r // s, r % s, h, j // T.int64(8)] - lo[0], 0) % 4)
                if vbmi:
                    qcs[r // s, r % s, h] = 0
                    for j, i in T.grid(NQ, 4):
                        hi[0] = (qa[r // s, r % s, h, j] >> T.int32(8 * i)) & T.int32(255)
                        qcs[r // s, r % s, h] = qcs[r // s, r % s, h] + hi[0] - (
                            (hi[0] >> T.int32(7)) << T.int32(8))
                    qcs[r // s, r % s, h] = qcs[r // s, r % s, h] * T.int32(-128)

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
                    ksw[e] = code_word(KSx, vb, T.min(t0 + e, t - T.int64(1)))
            for blk in T.unroll(4):
                for e in T.vectorized(TT):
                    sc[blk, e] = e8m0((ksw[e] >> T.uint32(8 * blk)) & T.uint32(255))
        else:
            for blk in range(NBLK):
                for e in T.vectorized(TT):
                    sc[blk, e] = e8m0(T.Cast("uint32", KSx[
                        vb, T.min(t0 + e, t - T.int64(1)), blk]))

    @T.macro
    def check_tile(ksw, kmn, ksm, kslot, shv, bad, ok, qlim, flag):
        """ok[0] = 1 if this tile's keys take the AMX dot (flag 2 and, per entry: block codes
        span at most 3, no NaN code, product exponents off fp32's ends), with kmn its entries'
        least codes, ksm[kslot] their scales and shv each block's shift (x 16, in every byte)."""
        ok[0] = 0
        if flag[0] == 2:
            for e in T.vectorized(TT):
                kmn[e] = code_min(ksw[e])
                ksm[kslot, e] = e8m0(T.Cast("uint32", kmn[e]))
                bad[e] = T.Select((code_max(ksw[e]) - kmn[e] > 3) | (code_max(ksw[e]) == 255)
                                  | (kmn[e] + qlim[0] < AMX_EXP_LO)
                                  | (kmn[e] + qlim[1] > AMX_EXP_HI), 1, 0)
            for blk in T.unroll(4):
                for e in T.vectorized(TT):
                    shv[blk, e] = T.Cast("uint32", code_of(ksw[e], blk) - kmn[e]) * T.uint32(
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
                T.Cast("bfloat16", part_sum(part, e, nc)), neg_inf_bf16())
        pend[0] = T.int64(0)

    @T.macro
    def dec_amx(kq, rows, lut64, shv, m0, g):  # as dec_int: signed, shifted bytes (vpermb)
        for w in range(nwb):
            kq[(m0 * nwb + w) * 2, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, permb(lut64, (rows.vload([w, 0], U32V)
                                     & T.broadcast(T.uint32(0x0F0F0F0F), LN))
                             | shv.vload([(m0 * nwb + w) // 4, g * T.int64(LN)], U32V)))
            kq[(m0 * nwb + w) * 2 + 1, T.ramp(g * T.int64(LN), 1, LN)] = T.reinterpret(
                I32V, permb(lut64, ((rows.vload([w, 0], U32V) >> T.broadcast(T.uint32(4), LN))
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
    def vbmi_item(iacc, kq, qa, qs, qcs, wf, ksm, part, O, L, vb, vs, t0, t):
        """One tile's query on the VBMI dot: per head group, the int32 dot over all of D in
        registers (key bytes biased +128, started at qcs), then per head the AMX epilogue's
        terms (`amx_finish`: the scaled dot is finite), the chunk sums and the score row."""
        for c in range(nc):
            for e in T.vectorized(TT):
                part[c, e] = T.float32(0)
        for hg in range(heads // HB):
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    iacc[h, e] = qcs[vb, vs, hg * HB + h]
            for j in range(NQ):
                for h in T.unroll(HB):
                    for ev in T.unroll(TT // T.int64(16)):
                        iacc[h, T.ramp(ev * 16, 1, 16)] = T.call_llvm_pure_intrin(
                            I32V, "llvm.x86.avx512.vpdpbusd.512",
                            iacc.vload([h, ev * 16], I32V),
                            u8x64(kq.vload([j, ev * 16], I32V)),
                            u8x64(T.broadcast(qa[vb, vs, hg * HB + h, j], 16)))
            for h in T.unroll(HB):
                for e in T.vectorized(TT):
                    part[(hg * HB + h) // che, e] = part[(hg * HB + h) // che, e] + round_bf16(
                        T.max(round_bf16_finite(T.Cast("float32", iacc[h, e]) * (
                            ksm[0, e] * qs[vb, vs, hg * HB + h])), T.float32(0))
                        * wf[vb, vs, hg * HB + h])
        for e in T.vectorized(TT):
            O[vb, vs, t0 + e] = T.Select(t0 + e < T.min(L[vb, vs], t),
                                         T.Cast("bfloat16", part_sum(part, e, nc)),
                                         neg_inf_bf16())

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
                                         T.Cast("bfloat16", part_sum(part, e, nc)),
                                         neg_inf_bf16())

    @T.macro
    def query_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, O, L, vb, vs,
                   t0, t, ok, cb, ksm, pend, tog, qa, qs, qcs):
        """One tile's query vs: on AMX (its epilogue deferred, see `sweep_tiles`) or the VBMI
        dot where the tile takes it, else on the vector units."""
        if vbmi:
            if ok[0] == 1:
                vbmi_item(iacc, kq, qa, qs, qcs, wf, ksm, part, O, L, vb, vs, t0, t)
            else:
                vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, O,
                            L, vb, vs, t0, t)
        elif amx:
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
                vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, O,
                            L, vb, vs, t0, t)
        else:
            vector_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag, part, O, L,
                        vb, vs, t0, t)

    @T.macro
    def sweep_tiles(KPx, KSx, ST, sel, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, kd, kq,
                    sc, rows, tbl, lut8, acc, iacc, i16, part, ksw, kmn, ksm, shv, bad, ok, qlim,
                    lut64, qa, qs, qcs, cb, pend, tog):
        """The task's tiles of the sweep over the key store KPx / KSx (its first t rows), for
        every query (the shared sweep: the queries vs with ST[vb, vs] = sel, the store number).

        AMX (kmn .. tog; unused without it): an item (a tile's query) on AMX writes its dots
        to cb slot tog[0] and is finished (`amx_finish`) only after the next item's dot is
        issued, so that the AMX unit's work, which waits on the decode's stores, overlaps the
        vector epilogue of the item before (cb and ksm are double-buffered; tog[1] is the ksm
        slot of the tile being decoded). Any other item first finishes the pending one."""
        if shifted:
            pend[0] = T.int64(0)
            tog[0] = T.int64(0)
            tog[1] = T.int64(0)
        for tl in range(per_task(t)):
            if task % tasks(t) * per_task(t) + tl < tiles(t):
                t0 = (task % tasks(t) * per_task(t) + tl) * TT  # padded entries: entry T-1
                load_scales(KSx, vb, t0, t, ksw, sc)
                if shifted:
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
                    if shifted:
                        if ok[0] == 1:
                            dec_amx(kq, rows, lut64, shv, m0, g)
                        else:
                            dec_vector(kd, kq, rows, tbl, lut8, sc, flag, m0, g)
                    else:
                        dec_vector(kd, kq, rows, tbl, lut8, sc, flag, m0, g)
                for vs in range(s):
                    if n_alt > 0:  # the shared sweep: the queries whose pick names this store
                        if ST[vb, vs] == sel:
                            query_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag,
                                       part, O, L, vb, vs, t0, t, ok, cb, ksm, pend, tog, qa, qs,
                                       qcs)
                    else:
                        query_item(acc, iacc, i16, kd, kq, qf, wf, qw, qsc, corr, sc, flag,
                                   part, O, L, vb, vs, t0, t, ok, cb, ksm, pend, tog, qa, qs, qcs)
                if amx:
                    if ok[0] == 1:
                        tog[1] = T.int64(1) - tog[1]
        if amx:
            if pend[0] == T.int64(1):
                amx_finish(cb, ksm, pend, part, wf, qs, O, L, vb, t)

    @T.macro
    def prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qcs, qlim, b,
                    s):
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
            if shifted:
                prep_amx(qw, qex, qa, qs, qcs, qlim, flag, cs, wd, b, s)

    @T.macro
    def sweep_task(KPx, KSx, ST, sel, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                   qa, qs, qcs):
        """One parallel task of the sweep over the key store KPx / KSx (the shared sweep: for
        the queries whose store ST is sel): its buffers (allocated once per task, not per tile),
        tables and AMX tile configuration, its tiles (`sweep_tiles`), the tiles released."""
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
        if shifted:
            for i in range(64):  # code n, shift j at 16 j + n (vpermb reads 6 index bits)
                kv = T.Cast("int32", fp4_to_f32_select(T.Cast("uint32", i % 16))
                            * T.Cast("float32", T.int32(2) << (i // 16)))
                if vbmi:  # the byte kv + 128 (unsigned for vpdpbusd) as an int8
                    lut64[i] = T.Cast("int8", T.Select(kv >= 0, kv - 128, kv + 128))
                else:
                    lut64[i] = T.Cast("int8", kv)
        if amx:
            if flag[0] == 2:
                amx_configure(cfg)
        sweep_tiles(KPx, KSx, ST, sel, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, kd, kq,
                    sc, rows, tbl, lut8, acc, iacc, i16, part, ksw, kmn, ksm, shv, bad, ok, qlim,
                    lut64, qa, qs, qcs, cb, pend, tog)
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
        O = T.match_buffer(out_h, (b, s, pad_expr(t)), "bfloat16")
        qf = T.alloc_buffer((b, s, H, D), "float32")
        wf = T.alloc_buffer((b, s, H), "float32")
        qw = T.alloc_buffer((b, s, H, NQ), "int32")  # VNNI: q int8 quads
        qsc = T.alloc_buffer((b, s, H, NBLK), "float32")  # VNNI: 2^(e - 1) per q block
        corr = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: -12 * sum of a block's ints
        flag = T.alloc_buffer((1,), "int32")  # VNNI: 1 if every q block is int8 x 2^e (AMX: 2)
        qex = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: a q block's exponent (0: zero)
        qa = T.alloc_buffer((b, s, H, NQ), "int32")  # AMX: q quads, blocks shifted
        qs = T.alloc_buffer((b, s, H), "float32")  # AMX: a head's q scale
        qcs = T.alloc_buffer((b, s, H), "int32")  # VBMI: the start of a head's dot
        qlim = T.alloc_buffer((2,), "int32")  # AMX: the least and largest head exponents
        mx = T.alloc_buffer((1,), "float32")
        cs = T.alloc_buffer((1,), "int32")
        wd = T.alloc_buffer((1,), "int32")
        prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qcs, qlim, b,
                    s)
        for task in T.parallel(b * tasks(t)):
            vb = task // tasks(t)
            sweep_task(KP, KS, L, 0, vb, task, t, s, O, L, qf, wf, qw, qsc, corr, flag, qlim,
                       qa, qs, qcs)  # (L, 0): no store selection (n_alt = 0)

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
        PK = T.match_buffer(pick_h, (b, s), "int64")
        W = T.match_buffer(w_h, (b, s, H), "bfloat16")
        L = T.match_buffer(lens_h, (b, s), "int64")
        O = T.match_buffer(out_h, (b, s, pad_expr(t)), "bfloat16")
        qf = T.alloc_buffer((b, s, H, D), "float32")
        wf = T.alloc_buffer((b, s, H), "float32")
        qw = T.alloc_buffer((b, s, H, NQ), "int32")  # VNNI: q int8 quads
        qsc = T.alloc_buffer((b, s, H, NBLK), "float32")  # VNNI: 2^(e - 1) per q block
        corr = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: -12 * sum of a block's ints
        flag = T.alloc_buffer((1,), "int32")  # VNNI: 1 if every q block is int8 x 2^e (AMX: 2)
        qex = T.alloc_buffer((b, s, H, NBLK), "int32")  # VNNI: a q block's exponent (0: zero)
        qa = T.alloc_buffer((b, s, H, NQ), "int32")  # AMX: q quads, blocks shifted
        qs = T.alloc_buffer((b, s, H), "float32")  # AMX: a head's q scale
        qcs = T.alloc_buffer((b, s, H), "int32")  # VBMI: the start of a head's dot
        qlim = T.alloc_buffer((2,), "int32")  # AMX: the least and largest head exponents
        mx = T.alloc_buffer((1,), "float32")
        cs = T.alloc_buffer((1,), "int32")
        wd = T.alloc_buffer((1,), "int32")
        ST = T.alloc_buffer((b, s), "int64")  # the store query (b, s) reads
        used = T.alloc_buffer((b, MAX_ALT + 1), "int32")  # 1 if some query of row b reads it
        prep_inputs(Q, W, qf, wf, qw, qsc, corr, qex, flag, mx, cs, wd, qa, qs, qcs, qlim, b,
                    s)
        # the shared index-K pointer, per query token: its keys are the first t rows of the
        # store its pick names (an alternate's own row count is at least t); a pick outside
        # 1..n_alt reads the own store (the host validates picks: `ops.check_pick`)
        for r, i in T.grid(b, MAX_ALT + 1):
            used[r, i] = 0
        for r in range(b * s):
            ST[r // s, r % s] = T.Select((PK[r // s, r % s] >= T.int64(1))
                                         & (PK[r // s, r % s] <= T.int64(n_alt)),
                                         PK[r // s, r % s], T.int64(0))
            used[r // s, ST[r // s, r % s]] = 1
        for task in T.parallel(b * tasks(t)):
            vb = task // tasks(t)
            # one pass over each store some query of the row reads (a decode step: one store)
            if used[vb, 0] == 1:
                sweep_task(KP, KS, ST, T.int64(0), vb, task, t, s, O, L, qf, wf, qw, qsc, corr,
                           flag, qlim, qa, qs, qcs)
            if used[vb, 1] == 1:
                sweep_task(A1, S1, ST, T.int64(1), vb, task, t, s, O, L, qf, wf, qw, qsc, corr,
                           flag, qlim, qa, qs, qcs)
            if n_alt >= 2:
                if used[vb, 2] == 1:
                    sweep_task(A2, S2, ST, T.int64(2), vb, task, t, s, O, L, qf, wf, qw, qsc,
                               corr, flag, qlim, qa, qs, qcs)
            if n_alt >= 3:
                if used[vb, 3] == 1:
                    sweep_task(A3, S3, ST, T.int64(3), vb, task, t, s, O, L, qf, wf, qw, qsc,
                               corr, flag, qlim, qa, qs, qcs)

    if n_alt:
        return index_scores_shared
    return index_scores
