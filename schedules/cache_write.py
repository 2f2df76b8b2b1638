"""Cache writes: `scatter_rows` (oracle `graph.ops.scatter_rows`), the kernel every compiled
store and ring write runs.

The kernel has no output buffer of its own: it writes the g new rows into the destination it
is given, and the lowering calls it with `call_tir_inplace`, so the store or ring the runtime
allocated is updated where it lies and nothing else of it is read or written. Rows whose index
is -1 or outside the destination are skipped (the runtime refuses such positions before a call;
the kernel never writes outside its buffer either way).
"""

from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec, get_target

DTYPES = ("uint8", "bfloat16", "float32")


def make_scatter_rows(*, width: int, dtype: str) -> tvm.tirx.PrimFunc:
    """(dst (b, n, width), idx int64 (b, g), rows (b, g, width)) -> dst updated in place.
    Symbolic b, n, g."""
    if width <= 0:
        raise ValueError(f"width must be positive; got {width}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}.")
    D = T.int64(width)

    @T.prim_func(s_tir=True)
    def scatter_rows(dst_h: T.handle, idx_h: T.handle, rows_h: T.handle):
        T.func_attr({"global_symbol": "scatter_rows", "tirx.noalias": True})
        b, n, g = T.int64(), T.int64(), T.int64()
        DST = T.match_buffer(dst_h, (b, n, D), dtype)
        IDX = T.match_buffer(idx_h, (b, g), "int64")
        ROWS = T.match_buffer(rows_h, (b, g, D), dtype)
        for i0, i1, i2 in T.grid(b, g, D):
            with T.sblock("write"):
                vb, vg, vd = T.axis.remap("SSS", [i0, i1, i2])
                T.reads(IDX[vb, vg], ROWS[vb, vg, vd])
                T.writes(DST[vb, 0:n, vd])
                if IDX[vb, vg] >= T.int64(0) and IDX[vb, vg] < n:
                    DST[vb, IDX[vb, vg], vd] = ROWS[vb, vg, vd]

    return scatter_rows


def schedule_scatter_rows(func: tvm.tirx.PrimFunc, target: TargetSpec) -> tvm.tirx.PrimFunc:
    """CPU: the rows in parallel, each row one contiguous copy. CUDA: one thread per element."""
    sch = s_tir.Schedule(func)
    blk = sch.get_sblock("write")
    i0, i1, i2 = sch.get_loops(blk)
    rows = sch.fuse(i0, i1)
    if target.is_cuda:
        fused = sch.fuse(rows, i2)
        bx, tx = sch.split(fused, [None, 256])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(rows)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_scatter_rows(target_name: str = "cpu", *, width: int,
                       dtype: str) -> tvm.tirx.PrimFunc:
    """The scheduled kernel for a target."""
    return schedule_scatter_rows(make_scatter_rows(width=width, dtype=dtype),
                                 get_target(target_name))
