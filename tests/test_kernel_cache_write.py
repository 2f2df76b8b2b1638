"""The cache-write kernel of schedules/cache_write.py against `ops.scatter_rows`, and its
in-place call: run through Relax `call_tir_inplace`, it writes the destination the caller gave
and returns that same buffer.

Tolerance: none (a write is a copy of bytes).
"""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from tvm import relax

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.schedules import cache_write

CPU = "cpu"


@functools.cache
def _kernel(width: int, dtype: str):
    target = get_target(CPU)
    func = cache_write.build_scatter_rows(CPU, width=width, dtype=dtype)
    with target.tvm_target():
        return tvm.compile(func, target=target.tvm_target())


def _case(dtype: torch.dtype, b=3, n=40, g=5, d=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        dst = torch.randint(0, 256, (b, n, d), generator=gen, dtype=torch.uint8)
        rows = torch.randint(0, 256, (b, g, d), generator=gen, dtype=torch.uint8)
    else:
        dst = torch.randn(b, n, d, generator=gen).to(dtype)
        rows = torch.randn(b, g, d, generator=gen).to(dtype)
    # row 0: a contiguous run; row 1: scattered with skips; row 2: out of range and -1 only
    idx = torch.tensor([[7, 8, 9, 10, 11], [n - 1, -1, 0, 20, -1], [-1, n, n + 3, -1, -1]])
    return dst, idx[:b], rows


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_scatter_rows_matches_oracle(dtype):
    dst, idx, rows = _case(dtype)
    want = ops.scatter_rows(dst, idx, rows)
    got = dst.clone()
    name = str(dtype).replace("torch.", "")
    _kernel(dst.size(-1), name)(to_tvm(got), to_tvm(idx),
                                to_tvm(rows))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # the oracle wrote exactly the in-range rows and left every other row as it was
    changed = (want != dst).any(dim=-1)
    assert not changed[2].any()
    assert set(changed[0].nonzero().flatten().tolist()) <= {7, 8, 9, 10, 11}


def test_scatter_rows_rejects_bad_shapes():
    with pytest.raises(ValueError, match="takes dst"):
        ops.scatter_rows(torch.zeros(2, 3), torch.zeros(2, 1, dtype=torch.int64),
                         torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match="dtype must be one of"):
        cache_write.make_scatter_rows(width=4, dtype="int16")


def test_inplace_call_writes_the_callers_buffer():
    """Through Relax: the result is the caller's tensor (same memory), only the new rows
    changed, and no buffer the size of the destination is allocated."""
    b, n, g = (tvm.tirx.Var(v, "int64") for v in "bng")
    d = 16
    bb = relax.BlockBuilder()
    dst = relax.Var("dst", relax.TensorType([b, n, d], "uint8"))
    idx = relax.Var("idx", relax.TensorType([b, g], "int64"))
    rows = relax.Var("rows", relax.TensorType([b, g, d], "uint8"))
    with bb.function("main", [dst, idx, rows]):
        with bb.dataflow():
            gv = bb.add_func(cache_write.build_scatter_rows(CPU, width=d, dtype="uint8"),
                             "scatter_rows")
            out = bb.emit_output(relax.call_tir_inplace(gv, [dst, idx, rows], [0],
                                                        out_ty=dst.ty))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target=get_target(CPU).tvm_target()),
                              tvm.cpu())
    allocated = []

    def count(func, name, before, ret, *args):
        if not before and name == "vm.builtin.alloc_storage":
            allocated.append(name)
        return 0

    vm.set_instrument(count)
    store = torch.zeros(1, 1000, d, dtype=torch.uint8)
    new = torch.full((1, 2, d), 7, dtype=torch.uint8)
    res = vm["main"](to_tvm(store),
                     to_tvm(torch.tensor([[500, 501]])),
                     to_tvm(new))
    assert to_torch(res).data_ptr() == store.data_ptr()
    assert store[0, 500:502].eq(7).all() and int(store.sum()) == 7 * 2 * d
    assert allocated == []
