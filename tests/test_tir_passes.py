"""compiler/tir_passes.py: a parallel loop of one iteration runs inline (no thread-pool launch),
and small buffers live on the stack (no workspace-pool call), with the same results bit for
bit."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.script import tirx as T
from tvm_ffi.structural import structural_walk

from dsv41.compiler.tir_passes import (
    STACK_BUFFER_BYTES,
    inline_single_task_parallel,
    register_cpu_tir_pipeline,
    stack_small_buffers,
)
from dsv41.graph.targets import get_target


@T.prim_func
def _rows(a_h: T.handle, o_h: T.handle):
    """Per row a scratch buffer (allocated inside the parallel loop), then a one-task loop."""
    T.func_attr({"global_symbol": "rows", "tirx.noalias": True})
    n = T.int64()
    a = T.match_buffer(a_h, (n, 64), "float32")
    o = T.match_buffer(o_h, (n, 64), "float32")
    for i in T.parallel(n):
        tmp = T.alloc_buffer((64,), "float32")
        for j in T.vectorized(64):
            tmp[j] = a[i, j] * T.float32(3) - T.float32(1)
        for j in range(64):
            o[i, j] = tmp[j] + tmp[63 - j]
    for t in T.parallel(1):
        o[0, 0] = o[0, 0] * T.float32(2) + T.float32(t)
    for t in T.parallel(4):  # a static extent of several: stays parallel
        o[0, t] = o[0, t] + T.float32(1)


def _loops(stmt, found: list) -> None:
    """(kind, extent is static, under an IfThenElse) of every For below stmt."""
    def walk(s, under_if):
        if isinstance(s, tirx.SeqStmt):
            for x in s.seq:
                walk(x, under_if)
        elif isinstance(s, tirx.AttrStmt | tirx.While):
            walk(s.body, under_if)
        elif isinstance(s, tirx.IfThenElse):
            walk(s.then_case, True)
            if s.else_case is not None:
                walk(s.else_case, True)
        elif isinstance(s, tirx.For):
            found.append((s.kind, isinstance(s.extent, tirx.IntImm), int(s.extent.value)
                          if isinstance(s.extent, tirx.IntImm) else None, under_if))
            walk(s.body, under_if)

    walk(stmt, False)


def _symbolic_loops(func) -> list:
    """The For nodes of `func` whose extent is not a constant, outermost first."""
    loops = []
    structural_walk(func.body, lambda node: loops.append(node)
                    if isinstance(node, tirx.For) and not isinstance(node.extent, tirx.IntImm)
                    else None)
    return loops


def test_rewrite_structure(monkeypatch):
    """Extents alone (every loop's work counted as enough to run in parallel)."""
    from dsv41.compiler import tir_passes

    monkeypatch.setattr(tir_passes, "MIN_PARALLEL_WORK", 1)
    mod = inline_single_task_parallel(tvm.IRModule({"rows": _rows}))
    found = []
    _loops(mod["rows"].body, found)
    par, ser = tirx.ForKind.PARALLEL, tirx.ForKind.SERIAL
    # the symbolic row loop: a parallel and a serial copy under `if n > 1`
    assert (par, False, None, True) in found and (ser, False, None, True) in found
    # the one-task loop: serial; the 4-task loop: still parallel, no branch
    assert (ser, True, 1, False) in found and (par, True, 4, False) in found
    assert (par, True, 1, False) not in found


def test_small_work_runs_on_the_calling_thread():
    """A loop whose work (statements executed) is under MIN_PARALLEL_WORK runs serially: the
    4-task loop (4 stores) at once, the row loop (128 a row) where n * 128 is under it."""
    from dsv41.compiler.tir_passes import MIN_PARALLEL_WORK, work

    mod = inline_single_task_parallel(tvm.IRModule({"rows": _rows}))
    found = []
    _loops(mod["rows"].body, found)
    par, ser = tirx.ForKind.PARALLEL, tirx.ForKind.SERIAL
    assert (ser, True, 4, False) in found and (par, True, 4, False) not in found
    assert (par, False, None, True) in found and (ser, False, None, True) in found
    row_loop = _symbolic_loops(_rows)[0]  # `T.parallel(n)`: 64 vector stores, 64 stores a row
    analyzer = tvm.sym.Analyzer()
    assert analyzer.can_prove_equal(work(row_loop), tirx.Cast("int64", row_loop.extent) * 128)
    assert MIN_PARALLEL_WORK // 128 < 80  # the test below runs n = 80 in parallel


@pytest.mark.parametrize("n", [1, 2, 5, 80])
def test_same_results_both_branches(n):
    target = get_target("cpu").tvm_target()
    plain = tvm.compile(_rows, target=target)
    inlined = tvm.compile(_rows, target=target, tir_pipeline=register_cpu_tir_pipeline())
    a = np.random.default_rng(n).standard_normal((n, 64), dtype=np.float32)
    outs = []
    for ex in (plain, inlined):
        o = tvm.runtime.empty((n, 64), "float32", tvm.cpu())
        ex(tvm.runtime.tensor(a, tvm.cpu()), o)
        outs.append(o.numpy())
    assert outs[0].tobytes() == outs[1].tobytes()
    want = (a * 3 - 1) + (a * 3 - 1)[:, ::-1]
    want[0, 0] = want[0, 0] * 2
    want[0, :4] += 1
    np.testing.assert_allclose(outs[1], want, rtol=1e-6, atol=1e-5)  # LLVM may fuse a * 3 - 1


def test_registration_is_idempotent():
    assert register_cpu_tir_pipeline() == register_cpu_tir_pipeline()


def test_large_bodies_are_not_copied(monkeypatch):
    """A symbolic-extent loop whose body is over MAX_COPIED_NODES keeps one parallel loop (no
    second copy of its code); constant extents are still decided without a copy."""
    from dsv41.compiler import tir_passes

    monkeypatch.setattr(tir_passes, "MAX_COPIED_NODES", 5)
    monkeypatch.setattr(tir_passes, "MIN_PARALLEL_WORK", 1)
    mod = inline_single_task_parallel(tvm.IRModule({"rows": _rows}))
    found = []
    _loops(mod["rows"].body, found)
    par, ser = tirx.ForKind.PARALLEL, tirx.ForKind.SERIAL
    assert (par, False, None, False) in found
    assert not any(under_if for *_, under_if in found)
    assert (ser, True, 1, False) in found and (par, True, 4, False) in found


BIG = STACK_BUFFER_BYTES // 4 + 64  # floats: past the stack's limit


def _scratch_kernel(big: int):
    """Per row a small scratch buffer (stack) and, with big > 0, one of `big` floats."""

    @T.prim_func
    def scratch(a_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": "scratch", "tirx.noalias": True})
        n = T.int64()
        a = T.match_buffer(a_h, (n, 64), "float32")
        o = T.match_buffer(o_h, (n, 64), "float32")
        for i in T.parallel(n):
            small = T.alloc_buffer((64,), "float32", scope="local")
            for j in range(64):
                small[j] = a[i, j] * T.float32(2)
            if big > 0:  # static
                wide = T.alloc_buffer((big,), "float32")
                for j in range(big):
                    wide[j] = a[i, 63 - j % 64]
                for j in range(64):
                    o[i, j] = small[j] + wide[big - 64 + j]
            else:
                for j in range(64):
                    o[i, j] = small[63 - j]

    return scratch


_scratch = _scratch_kernel(BIG)


def _allocs(func) -> list[tuple[str, bool]]:
    """(buffer name, annotated to stay on the stack) of every AllocBuffer in func."""
    found = []

    def visit(node):
        if isinstance(node, tirx.AllocBuffer):
            found.append((node.buffer.name, "disable_lower_builtin" in node.annotations))

    structural_walk(func.body, visit)
    return found


def test_small_buffers_stay_on_the_stack():
    """The small buffer is annotated (TVM's escape from the workspace pool), the big one not;
    the compiled kernel calls the pool only for the big one, and its outputs are the plain
    build's bit for bit."""
    mod = stack_small_buffers(tvm.IRModule({"scratch": _scratch}))
    assert sorted(_allocs(mod["scratch"])) == [("small", True), ("wide", False)]
    target = get_target("cpu").tvm_target()
    plain = tvm.compile(_scratch, target=target)
    ours = tvm.compile(_scratch, target=target, tir_pipeline=register_cpu_tir_pipeline())
    a = np.random.default_rng(3).standard_normal((5, 64), dtype=np.float32)
    outs = []
    for ex in (plain, ours):
        o = tvm.runtime.empty((5, 64), "float32", tvm.cpu())
        ex(tvm.runtime.tensor(a, tvm.cpu()), o)
        outs.append(o.numpy())
    assert outs[0].tobytes() == outs[1].tobytes()
    np.testing.assert_array_equal(outs[1], a * 2 + a[:, ::-1])  # BIG - 64 is a multiple of 64


def test_a_kernel_of_small_buffers_needs_no_workspace(tmp_path):
    """A library whose buffers are all small references no workspace function; with the big
    buffer it still does (nm's symbols)."""
    import subprocess

    small_only = _scratch_kernel(0)
    target = get_target("cpu").tvm_target()

    def refs(func, **kw) -> bool:
        lib = tmp_path / "k.so"
        tvm.compile(func, target=target, **kw).export_library(str(lib))
        syms = subprocess.run(["nm", str(lib)], capture_output=True, text=True, check=True)
        return "TVMBackendAllocWorkspace" in syms.stdout

    ours = register_cpu_tir_pipeline()
    assert refs(small_only) and not refs(small_only, tir_pipeline=ours)
    assert refs(_scratch, tir_pipeline=ours)


@T.prim_func
def _counted(a_h: T.handle, c: T.Buffer((4,), "int32")):
    """An inner extent read from a buffer the loop allocates: unknown before the loop runs."""
    T.func_attr({"global_symbol": "counted", "tirx.noalias": True})
    n = T.int64()
    a = T.match_buffer(a_h, (n, 64), "float32")
    for i in T.parallel(n):
        live = T.alloc_buffer((1,), "int32")
        live[0] = c[0]
        for j in range(live[0]):
            a[i, j] = T.float32(0)


def test_work_is_unknown_where_an_extent_reads_a_buffer():
    """No count (None) for a loop whose inner extent reads memory: the rewrite keeps the
    extent rule alone (`if n > 1`), never a condition that reads inside-the-loop state."""
    from dsv41.compiler.tir_passes import work

    assert work(_symbolic_loops(_counted)[0]) is None  # `T.parallel(n)`
    mod = inline_single_task_parallel(tvm.IRModule({"counted": _counted}))
    found = []
    _loops(mod["counted"].body, found)
    assert (tirx.ForKind.PARALLEL, False, None, True) in found
    ex = tvm.compile(_counted, target=get_target("cpu").tvm_target(),
                     tir_pipeline=register_cpu_tir_pipeline())
    a = tvm.runtime.tensor(np.ones((3, 64), "float32"), tvm.cpu())
    ex(a, tvm.runtime.tensor(np.array([5, 0, 0, 0], "int32"), tvm.cpu()))
    assert (a.numpy()[:, :5] == 0).all() and (a.numpy()[:, 5:] == 1).all()
