"""Lower: a captured phase (torch.export) -> Relax, with `dsv41::` ops calling our TIR kernels.

`from_exported_program` translates the plain aten ops. The converters:

- every `dsv41::` custom op maps to its kernel in `schedules/` through `call_tir`: the kernel
  registry's converters (`compiler.kernels`: each kind's key, factory and converter);
- here, the few aten translations whose numerics differ from torch's are overridden: bf16
  `linear`, `einsum` and `mean` accumulate in fp32 and round once to bf16, as torch does (TVM
  would accumulate in bf16 or return fp32); CPU decode linears and the grouped o-projection
  call the registry's dense GEMV / GEMM kernels (`kernels.dense_call`);
- and ops the importer lacks are supplied (`amax`, `copysign`, stable `sort`).

Kernels are built once per key (`kernel_keys`) and shared by every call site.
"""

from __future__ import annotations

import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from dsv41.compiler.kernels import converters, dense_call
from dsv41.compiler.relax_ops import (
    BF16,
    Lowering,
    cast_to,
    in_fp32,
    map_relax_functions,
    rows,
    shape,
    static,
    unrows,
    widened_source,
)
from dsv41.graph.collectives import CclBackend
from dsv41.graph.targets import TargetSpec

# ---- aten overrides and additions ------------------------------------------------------------


def _to_dtype(node, importer):
    """aten.to(dtype) / _to_copy / type_as, with the exact fp32 -> bf16 rounding."""

    x = importer.env[node.args[0]]
    target = node.kwargs.get("dtype")
    if target is None and len(node.args) > 1:
        other = node.args[1]
        target = other.meta["val"].dtype if isinstance(other, torch.fx.Node) else other
    if target is None:
        return x
    dtype = str(target).replace("torch.", "")
    return cast_to(importer, x, dtype)


def _weight_2d(arg, w: relax.Expr, importer) -> relax.Expr:
    """w as a 2-D [rows, k] tensor: for a `view` of a 2-D tensor (the grouped o-projection's
    `wo_a.view(g, r, -1)`), the tensor before the view. A Relax reshape of a function parameter
    is legalised into a full copy on every call; the kernel indexes the stored layout instead."""

    if len(shape(w)) == 2:
        return w
    rows = 1
    for v in shape(w)[:-1]:
        rows *= static(v)
    if isinstance(arg, torch.fx.Node) and str(arg.target) in (
            "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"):
        src = importer.env.get(arg.args[0])
        if src is not None and len(shape(src)) == 2 and src.ty.dtype == w.ty.dtype and \
                [static(v) for v in shape(src)] == [rows, static(shape(w)[-1])]:
            return src
    return importer.block_builder.emit(relax.op.reshape(w, [rows, shape(w)[-1]]))


def _gemv_operands_ok(*xs: relax.Expr) -> bool:
    return all(x.ty.dtype in (BF16, "float32") for x in xs)


def _linear(ctx: Lowering):
    def convert(node, importer):
        x, w = importer.env[node.args[0]], importer.env[node.args[1]]
        bias = (importer.env[node.args[2]]
                if len(node.args) > 2 and node.args[2] is not None else None)
        dtype = x.ty.dtype
        bb = importer.block_builder
        # CPU: dense_gemv (decode, drafts) or dense_gemm (prefill), reading the stored weight
        # in place; the generic linear is an unscheduled matmul over an fp32 transposed copy
        # of the weight (the head alone: 217 ms of a 160-token replay on the bench model)
        if not ctx.target.is_cuda and bias is None and len(shape(w)) == 2:
            xs = widened_source(node.args[0], importer)
            ws = widened_source(node.args[1], importer)
            if _gemv_operands_ok(xs, ws):
                n, k = (static(v) for v in shape(ws))
                x2, lead = rows(importer, xs, 1)
                x3 = bb.emit(relax.op.reshape(x2, [shape(x2)[0], 1, k]))
                y = dense_call(ctx, importer, x3, ws, out_dtype=dtype)
                y = bb.emit(relax.op.reshape(y, [*lead, n]))
                return cast_to(importer, y, dtype)  # no-op where the GEMV stored bf16
        if bias is not None:  # added in fp32 before the one rounding (the vision tower's)
            bias = in_fp32(importer, bias)
        y = bb.emit(relax.op.linear(in_fp32(importer, x), in_fp32(importer, w), bias,
                                    "float32"))
        return cast_to(importer, y, dtype)

    return convert


def _grouped_einsum(eq: str) -> bool:
    """eq is `P g d, g r d -> P g r` (a grouped linear: per group g, d -> r) for some lead
    letters P and distinct g, r, d."""
    lhs, _, out = eq.replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2 or len(ops[1]) != 3 or len(ops[0]) < 2:
        return False
    (a, (g, r, d)) = ops[0], ops[1]
    lead = a[:-2]
    letters = a + r
    return a[-2:] == g + d and out == lead + g + r and len(set(letters)) == len(letters)


def _einsum(ctx: Lowering):
    def convert(node, importer):
        eq = node.args[0]
        ops = [importer.env[a] for a in node.args[1]]
        dtype = ops[0].ty.dtype
        # The grouped o-projection on the CPU, at any row count: the generic einsum is an
        # unscheduled loop nest over an fp32 copy of the weight (1.6 s a layer at 128 prefill
        # rows); dense_gemv (decode) / dense_gemm (prefill) read the stored weight in place.
        if not ctx.target.is_cuda and _grouped_einsum(eq):
            xs, ws = (widened_source(a, importer) for a in node.args[1])
            if _gemv_operands_ok(xs, ws):
                x3, lead = rows(importer, xs, 2)
                w2 = _weight_2d(node.args[1][1], ws, importer)
                y = unrows(importer, dense_call(ctx, importer, x3, w2, out_dtype=dtype), lead)
                return cast_to(importer, y, dtype)  # no-op where the GEMV stored bf16
        y = importer.block_builder.emit(relax.op.einsum([in_fp32(importer, o) for o in ops],
                                                        eq))
        return cast_to(importer, y, dtype)

    return convert


def _mean(node, importer):
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dtype = x.ty.dtype
    y = importer.block_builder.emit(relax.op.mean(in_fp32(importer, x), dim, keepdims=keep))
    return cast_to(importer, y, dtype)


def _amax(node, importer):
    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return importer.block_builder.emit(relax.op.max(x, dim, keepdims=keep))


def _copysign(node, importer):
    """|a| with b's sign (b < 0; a -0.0 b counts as positive, the only difference from torch)."""
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    bb = importer.block_builder
    mag = bb.emit(relax.op.abs(a))
    neg = bb.emit(relax.op.less(b, relax.const(0.0, b.ty.dtype)))
    return bb.emit(relax.op.where(neg, bb.emit(relax.op.negative(mag)), mag))


def _sort_stable(node, importer):
    x = importer.env[node.args[0]]
    dim = node.kwargs.get("dim", -1)
    desc = node.kwargs.get("descending", False)
    bb = importer.block_builder
    idx = bb.emit(relax.op.argsort(x, dim, desc, dtype="int64"))
    vals = bb.emit(relax.op.gather_elements(x, idx, axis=dim))
    return bb.emit(relax.Tuple([vals, idx]))


def _where_scalar(scalar_pos: int):
    """where(cond, tensor, scalar) / where(cond, scalar, tensor) with the tensor's dtype."""

    def convert(node, importer):
        cond = importer.env[node.args[0]]
        t = importer.env[node.args[2 if scalar_pos == 1 else 1]]
        c = relax.const(node.args[scalar_pos], t.ty.dtype)
        a, b = (c, t) if scalar_pos == 1 else (t, c)
        return importer.block_builder.emit(relax.op.where(cond, a, b))

    return convert


def _scalar_tensor(importer, v, dtype: str) -> relax.Expr:
    """A 0-d tensor from a Python number or a symbolic PrimValue (via a 1-long arange)."""
    if isinstance(v, int | float):
        return relax.const(v, dtype)
    bb = importer.block_builder
    p = v.value if hasattr(v, "value") else v  # a PrimValue wraps the symbolic expression
    one = bb.emit(relax.op.arange(p, p + 1, 1, dtype=dtype))
    return bb.emit(relax.op.reshape(one, []))


def _clamp(node, importer):
    """clamp with bounds that may be symbolic (e.g. tokens - 1)."""
    args = importer.retrieve_args(node)
    x = args[0]
    lo = args[1] if len(args) > 1 else node.kwargs.get("min")
    hi = args[2] if len(args) > 2 else node.kwargs.get("max")
    dtype = x.ty.dtype
    bb = importer.block_builder
    if lo is not None:
        x = bb.emit(relax.op.maximum(x, _scalar_tensor(importer, lo, dtype)))
    if hi is not None:
        x = bb.emit(relax.op.minimum(x, _scalar_tensor(importer, hi, dtype)))
    return x


def convert_map(ctx: Lowering) -> dict:
    """The custom ops' converters (the kernel registry's) and the aten overrides."""
    return {
        **converters(ctx),
        "linear.default": _linear(ctx),
        "einsum.default": _einsum(ctx),
        "mean.dim": _mean,
        "amax.default": _amax,
        "copysign.Tensor": _copysign,
        "sort.stable": _sort_stable,
        "where.ScalarOther": _where_scalar(2),
        "where.ScalarSelf": _where_scalar(1),
        "clamp.default": _clamp,
        "to.dtype": _to_dtype,
        "_to_copy.default": _to_dtype,
        "type_as.default": _to_dtype,
    }


def lower(ep, target: TargetSpec, *, rows_hint: int | None = None,
          kernels: dict | None = None, bounds: dict[str, int] | None = None,
          ccl: CclBackend = CclBackend.DISCO, null_expert: bool = False,
          bounded_rows: bool = False, host_engram: bool = True,
          verify_rows: int = 1) -> tvm.IRModule:
    """ExportedProgram -> Relax IRModule with one function `main`; weights stay parameters
    (`keep_params_as_input`), in the program's parameter order. `kernels`, when given, receives
    each kernel's key -> GlobalVar (what `dsv41 tune` maps back to the kernels' factories).
    `ccl`: the functions a sharded worker's collectives call; `null_expert`: a sharded worker's
    graph, whose expert stacks end with the null expert (its pairs skip the GEMMs);
    `bounded_rows`: the entry's calls have few rows (`build.BOUNDED_ROWS`), so the pool sweep
    may gather per query (`indexer.build_pool_topk`); `host_engram`: the Engram tables are
    host-resident and their rows a call of the host runtime (`kernels._engram_rows`);
    `verify_rows`: the verify entry's rows per sequence (its FP8 GEMVs share weight loads
    across them, `gemm.fp8_linear_config`)."""

    ctx = Lowering(target, rows_hint, {} if kernels is None else kernels, ccl, null_expert,
                   bounded_rows, host_engram, verify_rows)
    convert = ExportedProgramImporter._convert_pytorch_tensor_to_tvm

    def no_weight_copies(t):
        """Weights are captured as storage-less placeholders (`Model.placeholder`): keep them
        out of the module (the importer would copy every parameter into an attribute)."""
        if t.numel() > 1 and all(st == 0 for st in t.stride()):
            return tvm.runtime.empty((0,), str(t.dtype).replace("torch.", ""))
        return convert(t)

    ExportedProgramImporter._convert_pytorch_tensor_to_tvm = staticmethod(no_weight_copies)
    try:
        mod = from_exported_program(ep, keep_params_as_input=True, run_ep_decomposition=False,
                                    unwrap_unit_return_tuple=False,
                                    custom_convert_map=convert_map(ctx))
    finally:
        ExportedProgramImporter._convert_pytorch_tensor_to_tvm = staticmethod(convert)
    # The export's dim ranges (up to 1M tokens, 2M context, batch 64) would make Relax plan
    # every buffer statically at its upper bound; without them buffers are sized per call.
    # `bounds` (TIR var name -> upper bound; single-token entries, see capture.static_bounds)
    # instead plans every intermediate once, at those bounds: nothing sized by the context is
    # allocated per call.
    main = mod["main"]
    for attr in ("tir_var_upper_bound", "tir_var_lower_bound"):
        if main.attrs and attr in main.attrs:
            main = main.without_attr(attr)
    if bounds:
        main = main.with_attr("tir_var_upper_bound", bounds)
    mod["main"] = main
    return clip_takes(mod)


def clip_takes(mod: tvm.IRModule) -> tvm.IRModule:
    """Every `relax.take` in mode "fast" (the importer's default: an index out of range reads
    past the buffer, and TVM warns once per call site while building) becomes mode "clip". The
    runtime validates the ids and positions it feeds the entries, so in range nothing changes;
    an index the checks missed would read the nearest row, never outside the tensor."""
    take = tvm.ir.Op.get("relax.take")

    @relax.expr_functor.mutator
    class ClipTakes(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op.same_as(take) and call.attrs.mode == "fast":
                return relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
            return call

    return map_relax_functions(mod, ClipTakes(mod).visit_expr)
