"""`compiler.dedupe`: what every layer recomputes from the entry's inputs is computed once; a read
of an input that a call writes in place is never merged with another."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from dsv41.compiler.dedupe import dedupe_entry_invariants
from dsv41.graph.targets import get_target


@T.prim_func(s_tir=True)
def _bump(x: T.Buffer((4,), "float32")):
    """x += 1 in place (as our cache scatters write their cache)."""
    T.func_attr({"tirx.noalias": True})
    for i in range(4):
        with T.sblock("x"):
            vi = T.axis.remap("S", [i])
            x[vi] = x[vi] + T.float32(1)


def _ops(func: relax.Function) -> list[str]:
    names = []

    @relax.expr_functor.visitor
    class Calls(relax.PyExprVisitor):
        def visit_call_(self, call):
            if isinstance(call.op, tvm.ir.Op):
                names.append(call.op.name)
            super().visit_call_(call)

    Calls().visit_expr(func)
    return names


def _layers(writes: bool) -> tvm.IRModule:
    """Two "layers" each computing (x + ones) * c, from two constants of equal values; with
    `writes`, x is bumped in place between them."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    c = relax.Var("c", relax.TensorType((4,), "float32"))
    with bb.function("main", [x, c]):
        with bb.dataflow():
            a1 = bb.emit(relax.op.add(x, relax.const(np.ones(4, "float32"))))
            b1 = bb.emit(relax.op.multiply(a1, c))
            if writes:
                gv = bb.add_func(_bump, "bump")
                bb.emit(relax.call_tir_inplace(gv, (x,), [0], relax.TensorType((4,), "float32")))
            a2 = bb.emit(relax.op.add(x, relax.const(np.ones(4, "float32"))))
            b2 = bb.emit(relax.op.multiply(a2, c))
            out = bb.emit_output(relax.op.add(b1, b2))
        bb.emit_func_output(out)
    return bb.get()


def test_equal_work_on_unwritten_inputs_is_done_once():
    mod = _layers(writes=False)
    assert _ops(mod["main"]).count("relax.multiply") == 2
    new = dedupe_entry_invariants(mod)
    ops = _ops(new["main"])
    assert ops.count("relax.multiply") == 1 and ops.count("relax.add") == 2, ops  # + the sum
    x = np.arange(4, dtype=np.float32)
    c = np.full(4, 3, np.float32)
    ex = tvm.compile(new, target=get_target("cpu").tvm_target())
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x, tvm.cpu()),
                                                      tvm.runtime.tensor(c, tvm.cpu()))
    assert got.numpy().tobytes() == (2 * ((x + 1) * c)).tobytes()


def test_reads_of_an_input_written_in_place_are_not_merged():
    new = dedupe_entry_invariants(_layers(writes=True))
    ops = _ops(new["main"])
    assert ops.count("relax.multiply") == 2 and ops.count("relax.add") == 3, ops


def _positions_twice() -> tvm.IRModule:
    """Two "layers" each computing start + arange(s) (the chunk's positions, as prefill's
    capture does per layer), s the symbolic token dim of x passed straight to `arange`."""
    bb = relax.BlockBuilder()
    s = tvm.tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType((s,), "float32"))
    start = relax.Var("start", relax.TensorType((1,), "int64"))
    with bb.function("main", [x, start]):
        with bb.dataflow():
            outs = []
            for _ in range(2):
                pos = bb.emit(relax.op.arange(0, s, 1, "int64"))
                outs.append(bb.emit(relax.op.add(start, pos)))
            out = bb.emit_output(relax.op.multiply(outs[0], outs[1]))
        bb.emit_func_output(out)
    return bb.get()


def test_work_on_a_symbolic_dimension_is_done_once():
    """A symbolic dim is fixed for the whole call: the second layer's positions are the
    first's (before, TVM's one Python class for Relax and TIR vars made it look written)."""
    mod = _positions_twice()
    assert _ops(mod["main"]).count("relax.arange") == 2
    new = dedupe_entry_invariants(mod)
    ops = _ops(new["main"])
    assert ops.count("relax.arange") == 1 and ops.count("relax.add") == 1, ops
    ex = tvm.compile(new, target=get_target("cpu").tvm_target())
    x = np.zeros(5, np.float32)
    start = np.array([7], np.int64)
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x, tvm.cpu()),
                                                      tvm.runtime.tensor(start, tvm.cpu()))
    assert got.numpy().tolist() == [(7 + i) ** 2 for i in range(5)]
