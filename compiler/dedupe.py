"""Work every layer repeats on the entry's own inputs, done once (`dedupe_entry_invariants`).

Each layer of a decode step recomputes things that depend only on the entry's inputs: the RoPE
cos / sin rows of the new token (gathered from `cos_c` / `sin_c` at `start`), the window slot it
writes and the window's attend mask (from `start` and `floor`). Captured layer by layer they are
the same ops on the same inputs and constants of the same values, five kernels per layer. Relax's
own common-subexpression pass would merge them too, but it would also merge two reads of a cache
that an in-place scatter writes between them; this pass merges only calls whose every input is
an entry input that nothing writes in place, a constant, or an earlier such call's result, so
each value it merges is the same whenever it is computed.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm_ffi import structural_equal, structural_hash

from dsv41.compiler.relax_ops import map_relax_functions

# ops that write an input or may (a packed call of unknown effect): never merged, and their
# inputs never count as unchanging; so is every call of something that is not an Op (an extern
# function, another Relax function)
_WRITERS = ("relax.call_tir_inplace", "relax.call_inplace_packed", "relax.call_dps_packed")


def _vars_in(expr) -> list:
    """The vars an argument expression reads (through tuples). TVM 0.27 has one Python class
    for Relax and TIR vars: a symbolic dimension passed as an argument (`R.arange(0, s)`) is
    one of these too, and `_dedupe` counts it as unchanging when nothing in the function binds
    it (it is defined by the entry's input shapes)."""
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in _vars_in(f)]
    return []


def _written(func: relax.Function, writers: list) -> set:
    """Every var passed to a writing call (one of `writers`, or a call of a non-Op) in `func`
    (a set: relax Vars hash and compare by identity, as `same_as`)."""
    found: set = set()

    @relax.expr_functor.visitor
    class Collect(relax.PyExprVisitor):
        def visit_call_(self, call):
            if not isinstance(call.op, tvm.ir.Op) or any(call.op.same_as(w) for w in writers):
                for a in call.args:
                    found.update(_vars_in(a))
            super().visit_call_(call)

    Collect().visit_expr(func)
    return found


def _symbolic_dims(func: relax.Function) -> set:
    """The vars the call arguments of `func` read that neither its parameters nor its bindings
    define: the symbolic dimensions of its input shapes (a TIR var passed straight to an op such
    as `arange`), fixed for the whole call."""
    bound = set(func.params)
    used: set = set()

    @relax.expr_functor.visitor
    class Collect(relax.PyExprVisitor):
        def visit_var_binding_(self, binding):
            bound.add(binding.var)
            super().visit_var_binding_(binding)

        def visit_match_cast_(self, binding):
            bound.add(binding.var)
            super().visit_match_cast_(binding)

        def visit_call_(self, call):
            for a in call.args:
                used.update(_vars_in(a))
            super().visit_call_(call)

    Collect().visit_expr(func)
    return {v for v in used if v not in bound and isinstance(v.ty, tvm.ir.PrimType)}


def dedupe_entry_invariants(mod: tvm.IRModule) -> tvm.IRModule:
    """Each call whose inputs are all unchanging (see the module docstring) and equal to an
    earlier call's (same op, attributes, inputs and constant values) is replaced by that call's
    result."""
    return map_relax_functions(mod, lambda func: _dedupe(mod, func))


def _dedupe(mod: tvm.IRModule, func: relax.Function) -> relax.Function:
    writers = [tvm.ir.Op.get(name) for name in _WRITERS]
    written = _written(func, writers)
    steady = {p for p in func.params if p not in written}  # a set, as `written`
    steady |= _symbolic_dims(func)
    host = tvm.ir.Op.get("relax.call_pure_packed")  # a host function may count its calls

    seen: dict[int, list] = {}  # structural hash -> [(call, the var holding its value)]

    @relax.expr_functor.mutator
    class Dedupe(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            value = self.visit_expr(binding.value)
            merge = (isinstance(binding.var, relax.DataflowVar) and isinstance(value, relax.Call)
                     and isinstance(value.op, tvm.ir.Op)
                     and not any(value.op.same_as(w) for w in [*writers, host])
                     and all(v in steady for a in value.args for v in _vars_in(a)))
            if not merge:
                super().visit_var_binding_(binding)
                return
            key = structural_hash(value)
            for call, holder in seen.get(key, []):
                if structural_equal(call, value):
                    self.set_var_remap(binding.var, holder)
                    return
            holder = self.builder_.emit(value)
            self.set_var_remap(binding.var, holder)
            seen.setdefault(key, []).append((value, holder))
            steady.add(holder)

    return Dedupe(mod).visit_expr(func)
