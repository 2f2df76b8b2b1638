"""Schedule helpers for GEMVs that sum in vector lanes: split a reduction into lanes, keep the
lane partials in registers, add them pairwise at the end."""

from __future__ import annotations

from tvm import s_tir


def lane_split(sch: s_tir.Schedule, j, lanes: int) -> list:
    """Split reduction loop j into (jo, h_1, ..., h_b), b = log2(lanes), each h two-way: lane
    l = sum_i h_i 2^(b-i) of a `lanes`-wide partial sum (see `vector_sum`)."""
    return sch.split(j, [None] + [2] * (lanes.bit_length() - 1))


def vector_sum(sch: s_tir.Schedule, block: s_tir.SBlockRV, lanes: int,
               cols: int = 1) -> tuple[s_tir.SBlockRV, list[s_tir.SBlockRV]]:
    """Factor `block`'s reduction, whose innermost loops are `lane_split`'s (.., jo, [columns,]
    h_1..h_b), into a `lanes`-wide vector sum over jo and a pairwise tree over the lanes: the
    lanes l and l + lanes/2 are added as vectors, then l and l + lanes/4, ..., down to one
    (log2(lanes) vector adds per output instead of `lanes` dependent scalar adds).

    One rfactor per h, innermost first, always on the block that keeps the main loop nest (an
    rfactor needs its block first in the nest; each write-back lands in a nest of its own).
    Returns (the main block, the write-backs in dataflow order): the main block is vectorised
    over its fused h loops; `place_lane_sums` moves the write-backs next to it.
    `block`'s write buffer gets the lane dims appended."""
    bits = lanes.bit_length() - 1
    axis = len(sch.get(block).writes[0].region)
    chain = [block]
    for level in range(bits):
        chain.append(sch.rfactor(sch.get_loops(chain[-1])[-1 - level], axis))
    main = chain.pop()
    if bits:
        sch.vectorize(sch.fuse(*sch.get_loops(main)[-bits:]))
    if cols > 1:
        sch.unroll(sch.get_loops(main)[-2 if bits else -1])
    return main, chain[::-1]


def arrange_lane_sum(sch: s_tir.Schedule, wb: s_tir.SBlockRV, depth: int, rest: int,
                     cols: int = 1) -> None:
    """Loops of a `vector_sum` write-back that compute_at / reverse_compute_at put below loop
    `depth`: they come in iter-var order, (half, `rest` lane bits, [columns]); make them
    (columns unrolled, the two halves unrolled, the lanes as one vector)."""
    below = sch.get_loops(wb)[depth + 1:]
    half, lane_loops = below[0], below[1:1 + rest]
    if cols > 1:
        sch.reorder(below[-1], half, *lane_loops)
        sch.unroll(below[-1])
    sch.unroll(half)
    if rest:
        sch.vectorize(sch.fuse(*lane_loops))


def place_lane_sums(sch: s_tir.Schedule, main: s_tir.SBlockRV, wbs: list[s_tir.SBlockRV],
                    depth: int, lanes: int, cols: int = 1) -> None:
    """Move `vector_sum`'s write-backs, in order, right after the main block's loop nest under
    its loop `depth` (the column group), arranged by `arrange_lane_sum`."""
    bits = lanes.bit_length() - 1
    for w, wb in enumerate(wbs):
        sch.reverse_compute_at(wb, sch.get_loops(main)[depth])
        arrange_lane_sum(sch, wb, depth, bits - 1 - w, cols)
