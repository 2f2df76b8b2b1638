"""The sparse-attend kernel's QK and PV on `vdpbf16ps` (CPUs with AVX-512 BF16).

Why this is exact where it matters: every factor is already a bf16 value, so the products are
the fp32 products the FMA path forms; only the fp32 summation order (pairs, then the running
sum) and the flushing of denormals differ.

* q is bf16.
* A window entry is an E4M3 code (3 mantissa bits) times an E8M0 scale (a power of two): at most
  4 significant bits, so bf16 (8) holds it exactly wherever the product is a normal fp32 number
  (|x| >= 2^-126). Below that (a block scale under 2^-117) the product is an fp32 denormal, which
  vdpbf16ps flushes to zero: such an entry contributes 0 instead of under 2^-126 * |q|.
  Overflow (a scale above 2^118 times 448) is +-inf in both paths; NaN codes stay NaN.
* A global FP4 entry is an E2M1 value (0, 0.5 .. 6: 2 significant bits) times an E4M3 scale
  (4): at most 5 significant bits, between 2^-10 and 6 * 448 in magnitude, so always a normal
  bf16 value (or 0), exact. A bf16 global entry is itself.
* p is rounded to bf16 before PV (the oracle does so); a p under 2^-126 (a logit 87 below the
  block max) is flushed to 0, as `_exp` already returns 0 below -87.3.
* q and bf16 global entries under 2^-126 in magnitude are flushed to zero (bf16 denormals).

Layouts (no horizontal sums): QK has 16 heads in the 16 fp32 lanes; q is staged once per task
as [d/2, heads] uint32 pairs (q[h, 2i] low, q[h, 2i+1] high) and each entry's (2i, 2i+1) pair is
broadcast to all lanes. PV has 16 output dims in the lanes; the block's entries are staged again
as [entry pairs, d, 2] (entries 2j and 2j+1 of each dim side by side) and each head's p pair
(p[2j], p[2j+1]) is broadcast. The entries are staged as bf16 bits ([rows, d] uint16), half the
bytes of the fp32 staging.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm.script import tirx as T

from dsv41.schedules.common import bf16_to_f32, dpbf16ps, with_bf16_dot
from dsv41.schedules.rope import rotated_bits

LANES = 16  # fp32 lanes of one vdpbf16ps (zmm)
TILE = 16  # accumulators of a register tile (of 32 zmm)


@dataclass(frozen=True)
class Bf16DotTiles:
    qk_heads: int  # head vectors (16 heads each) of a QK register tile
    qk_rows: int  # entries of a QK register tile (qk_heads x qk_rows accumulators)
    pv_heads: int  # heads of a PV register tile
    pv_dims: int  # dim vectors (16 dims each) of a PV register tile


def bf16_dot_tiles(*, hg: int, d: int) -> Bf16DotTiles:
    """QK: 2 head vectors x 8 entries (2 q loads and 8 broadcasts per 16 dot products; 1 x 16
    for an odd number of head vectors); PV: 4 heads x 4 dim vectors (4 loads, 4 broadcasts)."""
    heads = 2 if (hg // LANES) % 2 == 0 else 1
    dims = 4 if (d // LANES) % 4 == 0 else (2 if (d // LANES) % 2 == 0 else 1)
    return Bf16DotTiles(qk_heads=heads, qk_rows=TILE // heads, pv_heads=4, pv_dims=dims)


def check_bf16_dot_dims(*, hg: int, d: int, stage_rows: int, blk: int, vector_decode: bool) -> None:
    """Raise ValueError unless the bf16-dot layout fits the kernel's structure."""
    if not vector_decode or stage_rows != blk:
        raise ValueError(
            f"bf16_dot needs vector_decode and stage_rows={blk} (whole blocks "
            f"staged once); got vector_decode={vector_decode}, "
            f"stage_rows={stage_rows}."
        )
    if hg % LANES or d % (2 * LANES):
        raise ValueError(
            f"bf16_dot needs heads_per_group a multiple of {LANES} and d a multiple "
            f"of {2 * LANES}; got heads_per_group={hg}, d={d}."
        )


def p_pair(lo, hi):
    """Two float32x16 of bf16 values (p of entries 2j and 2j + 1 for 16 heads) -> the uint32x16
    of their bf16 pairs PV broadcasts (lo in the low half)."""
    return (T.reinterpret("uint32x16", lo) >> T.broadcast(T.uint32(16), LANES)) | (
        T.reinterpret("uint32x16", hi) & T.broadcast(T.uint32(0xFFFF0000), LANES)
    )


def _pair_bcast(pair_u32):
    """One uint32 (two bf16) in all 16 lanes, as the uint16x32 operand of dpbf16ps."""
    return T.reinterpret("uint16x32", T.broadcast(pair_u32, LANES))


def _vec(i):
    """Lanes i * 16 .. i * 16 + 15: the i-th 16-lane slice (fp32 or uint32 elements)."""
    return T.ramp(i * LANES, 1, LANES)


def _pairs(i):
    """The i-th slice of 16 bf16 pairs (32 uint16 elements)."""
    return T.ramp(i * (2 * LANES), 1, 2 * LANES)


def _bits(x):
    """The bf16 bits of `x` (a bfloat16 element) as a uint32."""
    return T.Cast("uint32", T.reinterpret("uint16", x))


@dataclass(frozen=True)
class QRope:
    """The RoPE the attention applies to q as it stages it (and inverts on its output): the
    tables (b or 1, s, rd/2) and the unrotated dims before the rd rotated ones."""

    cos: object  # a TIR buffer
    sin: object
    nope: object  # T.int64: d - rd

    def table_row(self, vb):
        return T.Select(self.cos.shape[0] == T.int64(1), T.int64(0), vb)


def q_pair_bits(q, vb, vs, head, i, rope: QRope | None):
    """Pair i of q's head as bf16 bits (q[2i] low, q[2i + 1] high); rotated (`rope.rotated_bits`,
    the rope kernel's arithmetic) where 2i >= rope.nope."""
    lo, hi = q[vb, vs, head, i * 2], q[vb, vs, head, i * 2 + 1]
    plain = _bits(lo) | (_bits(hi) << T.uint32(16))
    if rope is None:
        return plain
    p = T.max(i * T.int64(2) - rope.nope, T.int64(0)) // T.int64(2)
    tb = rope.table_row(vb)
    re_b, im_b = rotated_bits(bf16_to_f32(lo), bf16_to_f32(hi), rope.cos[tb, vs, p],
                              rope.sin[tb, vs, p], inverse=False)
    return T.Select(i * T.int64(2) < rope.nope, plain, re_b | (im_b << T.uint32(16)))


def make_bf16_dot_stages(*, hg: int, d: int, blk: int):
    """The macros of the bf16-dot path for a group of hg heads, head dim d, blocks of blk
    entries: (q_pairs, kv_pairs, qk, pv). Each is one opaque block (the schedule leaves
    it as written)."""
    tiles = bf16_dot_tiles(hg=hg, d=d)
    HG, D, BLK = T.int64(hg), T.int64(d), T.int64(blk)
    QH, QR = tiles.qk_heads, tiles.qk_rows
    PH, PD = tiles.pv_heads, tiles.pv_dims
    interleave = [i // 2 + LANES * (i % 2) for i in range(2 * LANES)]

    @T.macro
    def q_pairs(q, qp, vb, vs, vg, rope):
        """qp[i, h] = q[h, 2i] | q[h, 2i + 1] << 16 (the bf16 bits), once per task; `rope` (a
        `QRope`, or None): the pairs from rope.nope / 2 on rotated first, as the rope kernel
        rotates them (its bits)."""
        with T.sblock("q_pairs"):
            for i, hh in T.grid(D // T.int64(2), HG):
                qp[i, hh] = q_pair_bits(q, vb, vs, vg * HG + hh, i, rope)

    @T.macro
    def kv_pairs(kst, k0, kvp, p0):
        """kvp[p0 + j, c, 0 / 1] = kst[k0 + 2j / k0 + 2j + 1, c]: the block staged at row k0 with
        entry pairs side by side for PV (k0 = 2 p0)."""
        with T.sblock("kv_pairs"):
            for j, c in T.grid(BLK // T.int64(2), D // T.int64(LANES)):
                kvp[p0 + j, _pairs(c)] = T.Shuffle(
                    [kst[k0 + j * 2, _vec(c)], kst[k0 + j * 2 + 1, _vec(c)]], interleave
                )

    @T.macro
    def qk(kst, k0, qp, dots):
        """dots[j, h] = sum over c of kst[k0 + j, c] * q[h, c]; a tile of QR entries x QH head
        vectors accumulates over the d/2 pairs in registers (acc[e * QH + v])."""
        with T.sblock("qk_vec"):
            acc = T.sblock_alloc_buffer((TILE * LANES,), "float32", scope="local")
            with T.attr(T.int32(0), *with_bf16_dot()):
                for j0, h0 in T.grid(BLK // T.int64(QR), HG // T.int64(LANES * QH)):
                    for a in T.unroll(QR * QH):
                        acc[_vec(a)] = T.broadcast(T.float32(0), LANES)
                    for i in range(D // T.int64(2)):
                        for e in T.unroll(QR):
                            for v in T.unroll(QH):
                                acc[_vec(e * QH + v)] = dpbf16ps(
                                    acc[_vec(e * QH + v)],
                                    T.reinterpret("uint16x32", qp[i, _vec(h0 * QH + v)]),
                                    _pair_bcast(
                                        T.reinterpret(
                                            "uint32",
                                            kst.vload([k0 + j0 * QR + e, i * 2], "uint16x2"),
                                        )
                                    ),
                                )
                    for e in T.unroll(QR):
                        for v in T.unroll(QH):
                            dots[j0 * QR + e, _vec(h0 * QH + v)] = acc[_vec(e * QH + v)]

    @T.macro
    def pv(kvp, p0, pp, out, rescale):
        """out[h, c] = out[h, c] * rescale[h] + pv[h, c] (the online softmax's update), with
        pv[h, c] = sum over j of p[j, h] * kvp[p0 + j / 2, c, j % 2] formed in registers: a tile
        of PH heads x PD dim vectors accumulates over the blk/2 entry pairs (acc[hh * PD + v]);
        the dim strip is the outer loop, so its staged pairs stay in L1 across the head tiles."""
        with T.sblock("pv_vec"):
            acc = T.sblock_alloc_buffer((TILE * LANES,), "float32", scope="local")
            with T.attr(T.int32(0), *with_bf16_dot()):
                for c0, h0 in T.grid(D // T.int64(LANES * PD), HG // T.int64(PH)):
                    for a in T.unroll(PH * PD):
                        acc[_vec(a)] = T.broadcast(T.float32(0), LANES)
                    for j in range(BLK // T.int64(2)):
                        for v in T.unroll(PD):
                            for hh in T.unroll(PH):
                                acc[_vec(hh * PD + v)] = dpbf16ps(
                                    acc[_vec(hh * PD + v)],
                                    kvp[p0 + j, _pairs(c0 * PD + v)],
                                    _pair_bcast(pp[j, h0 * PH + hh]),
                                )
                    for hh in T.unroll(PH):
                        for v in T.unroll(PD):
                            out[h0 * PH + hh, _vec(c0 * PD + v)] = (
                                out[h0 * PH + hh, _vec(c0 * PD + v)]
                                * T.broadcast(rescale[h0 * PH + hh], LANES)
                                + acc[_vec(hh * PD + v)]
                            )

    return q_pairs, kv_pairs, qk, pv
