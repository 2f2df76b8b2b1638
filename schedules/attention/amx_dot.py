"""The sparse-attend kernel's QK and PV on AMX-BF16 tiles (CPUs with AMX), in place of the
vdpbf16ps register tiles of `bf16_dot.py` (whose staging, softmax and layouts it keeps).

Why this is exact where it matters: the factors are the bf16 values the bf16-dot path feeds
vdpbf16ps (`bf16_dot.py` says why each is exact), the tiles form the same exact fp32 products
and add them in fp32, denormal inputs and outputs flushed as there. Only the order of the fp32
additions differs (a tile adds the products of one K step in pairs, then the steps in order),
so the block structure, the bf16 p and the tolerance of the bf16-dot path stay.

Layouts (the operands the bf16-dot path already stages, read in place as tiles):

* QK, per 32 entries x 32 heads (2 x 2 tiles of 16 x 16), over d in steps of 32: A = the staged
  entries (`kall`, [rows, d] bf16 bits: an entry per tile row), B = q's pairs (`qp`, [d/2, heads]
  uint32: AMX's pair layout with the heads as columns); C lands in `dots` [entries, heads], as
  the vdpbf16ps tiles write it.
* PV, per 32 heads x 32 dims, over the block's 64 entries in two steps: B = the entry pairs
  (`kvall`, [entry pairs, d, 2]: AMX's pair layout with the dims as columns), A = p with the
  heads as rows: `p_rows` transposes the block's bf16 pairs of p (`pp`, [entry pairs, heads]
  uint32, written by the softmax) into `pa` [heads, entry pairs]; C (32 x 32 fp32, `yt`) is
  then added into acc as acc * rescale + pv, as `bf16_dot.pv` does.

A task configures the tiles once (`amx_configure`) and releases them at its end; each of its
rows is its own sequence of tile steps, so a verify's rows equal its decode calls bit for bit.
"""

from __future__ import annotations

from tvm.script import tirx as T

from dsv41.schedules.common import amx_dot_2x2

TILE = 32  # heads, entries or dims of one 2 x 2 tile step (AMX tiles are 16 x 16 fp32)
LANES = 16


def check_amx_dims(*, hg: int, d: int, blk: int) -> None:
    """Raise ValueError unless the AMX layout fits the kernel's structure."""
    if hg % TILE or d % TILE or blk % TILE:
        raise ValueError(f"The AMX attention needs heads_per_group, d and the block a multiple "
                         f"of {TILE}; got heads_per_group={hg}, d={d}, block={blk}.")


def make_amx_stages(*, hg: int, d: int, blk: int):
    """The macros of the AMX path for a group of hg heads, head dim d, blocks of blk entries:
    (qk, p_rows, pv). Each is one opaque block (the schedule leaves it as written)."""
    check_amx_dims(hg=hg, d=d, blk=blk)
    HG, D, BLK = T.int64(hg), T.int64(d), T.int64(blk)
    S = T.int64(TILE)

    @T.macro
    def qk(kst, k0, qp, dots):
        """dots[j, h] = sum over c of kst[k0 + j, c] * q[h, c] (kst: bf16 bits, qp: q's pairs)."""
        with T.sblock("qk_amx"):
            for j0, h0 in T.grid(BLK // S, HG // S):
                amx_dot_2x2(kst, k0 + j0 * S, T.int64(0), D * T.int64(2), S,
                            qp, T.int64(0), h0 * S, h0 * S + T.int64(LANES), HG * T.int64(4),
                            D // S, dots, j0 * S, h0 * S, HG * T.int64(4))

    @T.macro
    def p_rows(pp, pa):
        """pa[h, j] = pp[j, h]: the block's bf16 pairs of p with the heads as rows."""
        with T.sblock("p_rows"):
            for hh, j in T.grid(HG, BLK // T.int64(2)):
                pa[hh, j] = pp[j, hh]

    @T.macro
    def pv(kvp, p0, pa, out, rescale, yt):
        """out[h, c] = out[h, c] * rescale[h] + pv[h, c], pv[h, c] = sum over j of p[j, h] *
        entry[j, c] (kvp: the block's entry pairs from row p0; pa: `p_rows`), per 32 heads x
        32 dims through `yt` [32, 32] fp32."""
        with T.sblock("pv_amx"):
            for c0, h0 in T.grid(D // S, HG // S):
                amx_dot_2x2(pa, h0 * S, T.int64(0), BLK * T.int64(2), T.int64(LANES),
                            kvp, p0, c0 * S * T.int64(2), c0 * S * T.int64(2) + S,
                            D * T.int64(4), BLK // S, yt, T.int64(0), T.int64(0),
                            S * T.int64(4))
                for r in range(S):
                    for v in T.unroll(TILE // LANES):
                        out[h0 * S + r, T.ramp(c0 * S + v * LANES, 1, LANES)] = (
                            out[h0 * S + r, T.ramp(c0 * S + v * LANES, 1, LANES)]
                            * T.broadcast(rescale[h0 * S + r], LANES)
                            + yt[r, T.ramp(v * LANES, 1, LANES)]
                        )

    return qk, p_rows, pv
