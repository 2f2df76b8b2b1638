"""The schedule of a kernel that is one block per row (its loops the rows' dims): CPU, the rows
in parallel; CUDA, one thread per row, `threads` rows per thread block. `rope` and `route_topk`
use it."""

from __future__ import annotations

import tvm
from tvm import s_tir

from dsv41.graph.targets import TargetSpec


def schedule_block_rows(func: tvm.tirx.PrimFunc, block: str, target: TargetSpec, *,
                        threads: int) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    rows = sch.fuse(*sch.get_loops(sch.get_sblock(block)))
    if target.is_cuda:
        bx, tx = sch.split(rows, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(rows)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)
