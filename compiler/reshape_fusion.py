"""Reshapes that join two fusable ops become fusable themselves (`legalize_fusable_reshapes`).

`build.fuse` keeps `relax.reshape` a Relax op: the VM runs it as a view (`vm.builtin.reshape`),
where a legalised reshape between two of our kernels would be a copy kernel of its own. But a
kept reshape is also a fusion barrier: RoPE's slice and cast, the (re, im) takes, the rotation
and the concat with the unrotated part were five kernels per rotation (three rotations per
layer), each pair split by a view. A reshape whose input comes from a fusable op (elementwise,
broadcast or injective: TVM's op patterns 0-2) or that feeds one is legalised here, so FuseOps
merges it into that op's group; one between two opaque kernels (our custom kernels, reductions)
or function inputs stays a view. Legalised, its copy is one more block inside that kernel (a
pass that inlined such copies into their readers tripled the entries' LLVM build time: not kept).

The same chains read a pair's real and imaginary parts as `take(x, 0 | 1, axis)`: a take reads
through its index tensor, so TVM types it opaque even when the index is a constant.
`takes_of_constants_as_slices` rewrites such a take (a scalar constant index within the axis)
as the strided slice and squeeze it is, both injective.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import GenericConst

from dsv41.compiler.relax_ops import map_relax_functions

FUSABLE = 2  # op_pattern kInjective: elementwise (0), broadcast (1) and injective (2) fuse


def _fusable_callee(mod: tvm.IRModule, call) -> bool:
    """Whether `call` is a call_tir of a PrimFunc FuseOps may fuse (op_pattern <= 2)."""
    if not isinstance(call, relax.Call) or not call.op.same_as(tvm.ir.Op.get("relax.call_tir")):
        return False
    gv = call.args[0]
    if not isinstance(gv, tvm.ir.GlobalVar) or gv not in mod:
        return False
    attrs = mod[gv].attrs
    return attrs is not None and "op_pattern" in attrs and int(attrs["op_pattern"]) <= FUSABLE


def _producers(func: relax.Function) -> dict:
    """var -> the value bound to it, over the function's bindings."""
    producer = {}

    @relax.expr_functor.visitor
    class Collect(relax.PyExprVisitor):
        def visit_var_binding_(self, binding):
            producer[binding.var] = binding.value
            super().visit_var_binding_(binding)

    Collect().visit_expr(func)
    return producer


def _inputs(call) -> list:
    """The tensors a call reads: a call_tir's argument tuple, else its arguments."""
    if len(call.args) > 1 and isinstance(call.args[1], relax.Tuple):
        return list(call.args[1].fields)
    return list(call.args)


def legalize_fusable_reshapes(mod: tvm.IRModule) -> tvm.IRModule:
    """Legalise each `relax.reshape` next to a fusable call_tir (see the module docstring);
    the module must already carry op patterns (`relax.transform.AnnotateTIROpPattern`)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod = _legalize_in(mod, gv, func)
    return mod


def _legalize_in(mod: tvm.IRModule, gv, func: relax.Function) -> tvm.IRModule:
    """`legalize_fusable_reshapes` on one function of `mod`."""
    reshape = tvm.ir.Op.get("relax.reshape")
    legalize = reshape.get_attr("FLegalize")
    producer = _producers(func)
    readers: dict = {}  # var -> the calls that read it
    for value in producer.values():
        if isinstance(value, relax.Call):
            for a in _inputs(value):
                if isinstance(a, relax.Var):
                    readers.setdefault(a, []).append(value)

    def fusable_neighbour(var, call) -> bool:
        # fused as the producer's epilogue (the reshape its output's only reader), or as the
        # prologue of every reader (a reader that is not fusable, another view or a kernel of
        # ours, would need the reshaped tensor materialised: a copy kernel of its own)
        src = call.args[0]
        if (isinstance(src, relax.Var) and _fusable_callee(mod, producer.get(src))
                and len(readers.get(src, [])) == 1):
            return True
        mine = readers.get(var, [])
        return bool(mine) and all(_fusable_callee(mod, r) for r in mine)

    made: list = []

    @relax.expr_functor.mutator
    class Legalize(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            value = binding.value
            if (isinstance(value, relax.Call) and value.op.same_as(reshape)
                    and fusable_neighbour(binding.var, value)):
                new = self.builder_.normalize(legalize(self.builder_, self.visit_expr(value)))
                made.append(new.args[0])
                self.set_var_remap(binding.var, self.builder_.emit(new))
                return
            super().visit_var_binding_(binding)

    mutator = Legalize(mod)
    new_func = mutator.visit_expr(func)
    out = mutator.builder_.get()
    out[gv] = new_func
    for reshaped in made:  # a reshape is injective, whatever TVM's pattern analysis makes of its
        # symbolic index arithmetic (`% batch` reads as opaque, which no group may fuse)
        out[reshaped] = out[reshaped].with_attr("op_pattern", FUSABLE)
    return out


def takes_of_constants_as_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """Every `relax.take(x, c, axis)` with c a scalar integer constant in [0, x.shape[axis])
    becomes `squeeze(strided_slice(x, [axis], [c], [c + 1]), [axis])`: the same values (the
    take's clip mode changes nothing in range), as ops FuseOps may fuse."""
    take = tvm.ir.Op.get("relax.take")

    def in_range_constant(call) -> int | None:
        index = call.args[1]
        if not isinstance(index, GenericConst):
            return None
        value = index.value.numpy()
        if value.ndim != 0 or value.dtype.kind not in "iu":
            return None
        shape = call.args[0].ty.shape
        axis = int(call.attrs.axis)
        if not isinstance(shape, relax.ShapeExpr) or not isinstance(shape.values[axis],
                                                                      tvm.tirx.IntImm):
            return None
        extent = int(shape.values[axis])
        c = int(value)
        return c if 0 <= c < extent else None

    @relax.expr_functor.mutator
    class Slices(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(take) and (c := in_range_constant(call)) is not None:
                axis = int(call.attrs.axis)
                part = relax.op.strided_slice(call.args[0], axes=[axis], begin=[c], end=[c + 1])
                return relax.op.squeeze(part, axis=[axis])
            return call

    return map_relax_functions(mod, Slices(mod).visit_expr)
