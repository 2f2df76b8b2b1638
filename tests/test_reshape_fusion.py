"""The fusion passes of `compiler.reshape_fusion`, as `build.fuse` runs them: a reshape between
fusable ops joins their kernel, one between opaque kernels stays a view, a take of a constant
index becomes a fusable slice; values unchanged bit for bit."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import tirx as T

from dsv41.compiler.build import fuse
from dsv41.graph.targets import get_target


@T.prim_func(s_tir=True)
def _opaque_double(x: T.Buffer((2, 32), "float32"), y: T.Buffer((2, 32), "float32")):
    """A kernel of ours, as FuseOps sees one: op pattern 8 (opaque), never fused."""
    T.func_attr({"op_pattern": 8, "tirx.noalias": True})
    for i, j in T.grid(2, 32):
        with T.sblock("y"):
            vi, vj = T.axis.remap("SS", [i, j])
            y[vi, vj] = x[vi, vj] * T.float32(2)


def _module(opaque: bool) -> tvm.IRModule:
    """x (2, 4, 8) -> x * x -> reshape (2, 32) -> [opaque kernel] -> + -> reshape (2, 4, 8) ->
    the imaginary half of each (re, im) pair as `take(., 1, axis=3)` after a pair reshape."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.multiply(x, x))
            b = bb.emit(relax.op.reshape(a, (2, 32)))
            if opaque:
                gv = bb.add_func(_opaque_double, "opaque_double")
                b = bb.emit(relax.call_tir(gv, (b,), relax.TensorType((2, 32), "float32")))
                b = bb.emit(relax.op.reshape(b, (2, 32)))
                b = bb.emit(relax.call_tir(gv, (b,), relax.TensorType((2, 32), "float32")))
            c = bb.emit(relax.op.add(b, b))
            d = bb.emit(relax.op.reshape(c, (2, 4, 4, 2)))
            e = bb.emit(relax.op.take(d, relax.const(1, "int64"), axis=3))
            out = bb.emit_output(e)
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod: tvm.IRModule) -> list[str]:
    """The Relax ops and called PrimFuncs of main, in order."""
    names = []

    @relax.expr_functor.visitor
    class Calls(relax.PyExprVisitor):
        def visit_call_(self, call):
            if call.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                names.append(call.args[0].name_hint)
            elif isinstance(call.op, tvm.ir.Op):
                names.append(call.op.name)
            super().visit_call_(call)

    Calls().visit_expr(mod["main"])
    return names


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    ex = tvm.compile(mod, target=get_target("cpu").tvm_target())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x, tvm.cpu())).numpy()


def test_a_reshape_between_fusable_ops_and_a_constant_take_fuse_into_one_kernel():
    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    want = ((x * x) * 2).reshape(2, 4, 4, 2)[..., 1]
    mod = _module(opaque=False)
    fused, ok = fuse(mod, "cpu")
    assert ok
    ops = _ops(fused)
    assert ops.count("relax.reshape") == 0 and len(ops) == 1, ops  # one kernel, no view
    got = _run(fused, x)
    assert got.tobytes() == want.tobytes()


def test_a_reshape_between_opaque_kernels_stays_a_view():
    x = np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)
    want = ((x * x) * 2 * 2 * 2).reshape(2, 4, 4, 2)[..., 1]
    fused, ok = fuse(_module(opaque=True), "cpu")
    assert ok
    ops = _ops(fused)
    # x * x with its reshape; the two opaque kernels with the view between them; the add, the
    # pair reshape and the take in one kernel
    assert ops.count("_opaque_double") == 2 and ops.count("relax.reshape") == 1, ops
    assert ops.index("_opaque_double") < ops.index("relax.reshape") \
        < len(ops) - 1 - ops[::-1].index("_opaque_double"), ops
    assert len(ops) == 5, ops
    got = _run(fused, x)
    assert got.tobytes() == want.tobytes()
