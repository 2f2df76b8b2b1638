"""What every lowering converter shares: the per-module `Lowering` state (target, row hint, the
kernels already added) and the few Relax helpers a converter builds its calls with.

Kept apart from `lower` (the importer and the aten overrides) and `kernels` (the registry and
the custom ops' converters), which both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import tvm
from tvm import relax, te

from dsv41.compiler.kernel_keys import KernelKey
from dsv41.graph.collectives import CclBackend
from dsv41.graph.targets import TargetSpec
from dsv41.schedules.common import bf16_of

BF16 = "bfloat16"


@dataclass
class Lowering:
    """Per-module state: the target, a row-count hint for GEMM schedules, and the kernels already
    added (so each static shape is built and added once)."""

    target: TargetSpec
    rows_hint: int | None = None  # decode: 1; drafts: a few; prefill: None (large)
    kernels: dict[KernelKey, relax.GlobalVar] = field(default_factory=dict)
    ccl: CclBackend = CclBackend.DISCO  # a sharded entry's collectives
    null_expert: bool = False  # a sharded worker's expert stacks end with the null expert
    bounded_rows: bool = False  # rows per call bounded (decode, verify, draft, the CED decoder)
    host_engram: bool = True  # Engram rows from the host runtime (False: gathered in the entry)
    verify_rows: int = 1  # rows per sequence in weight-sharing groups: verify 1 + k, draft a block

    def kernel(self, importer, key: KernelKey, make) -> relax.GlobalVar:
        """The GlobalVar of the kernel `key` names, `make()` added to the module the first time
        (named `key.function_name`)."""
        if key not in self.kernels:
            func = make().without_attr("global_symbol")  # named by the module, not the kernel
            func = func.with_attr("op_pattern", 8)  # kOpaque: a whole kernel, never fused
            self.kernels[key] = importer.block_builder.add_func(func, key.function_name)
        return self.kernels[key]


def shape(x: relax.Expr) -> list:
    return list(x.ty.shape.values)


def static(v) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, tvm.tirx.IntImm):
        return int(v.value)
    raise ValueError(f"Expected a static dimension, got {v}.")


def rows(importer, x: relax.Expr, keep: int) -> tuple[relax.Expr, list]:
    """Flatten all but the last `keep` dims into one row dim. Returns (x2, leading dims)."""
    dims = shape(x)
    lead, tail = dims[: len(dims) - keep], dims[len(dims) - keep :]
    n = tvm.tirx.IntImm("int64", 1)
    for v in lead:
        n = n * v
    return importer.block_builder.emit(relax.op.reshape(x, [n, *tail])), lead


def tensor(dims, dtype) -> relax.TensorType:
    return relax.TensorType(dims, dtype)


def call(importer, gv, args, out):
    return importer.block_builder.emit(relax.call_tir(gv, args, out_ty=out))


def unrows(importer, y: relax.Expr, lead: list) -> relax.Expr:
    dims = shape(y)
    return importer.block_builder.emit(relax.op.reshape(y, [*lead, *dims[1:]]))


def map_relax_functions(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """`mod` with `rewrite(func)` in place of each of its Relax functions (PrimFuncs kept)."""
    out = mod
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[gv] = rewrite(func)
    return out


def in_fp32(importer, x: relax.Expr) -> relax.Expr:
    """x as fp32 (itself when it is)."""
    if x.ty.dtype == "float32":
        return x
    return importer.block_builder.emit(relax.op.astype(x, "float32"))


def round_to_bf16(importer, x: relax.Expr) -> relax.Expr:
    """fp32 -> bf16, round to nearest even, on the bits (`schedules.common.bf16_of`, which a
    kernel storing bf16 uses too). A plain cast is folded away by TVM's simplifier when a fused
    kernel immediately casts back to fp32 (Cast(f32, Cast(bf16, v)) -> v), which silently drops
    torch's bf16 rounding; bit arithmetic cannot be folded."""

    def compute(a):
        return te.compute(a.shape, lambda *i: bf16_of(a(*i)), name="round_bf16")

    return importer.block_builder.emit_te(compute, x, primfunc_name_hint="round_bf16")


def cast_to(importer, x: relax.Expr, dtype: str) -> relax.Expr:
    """x as `dtype`: nothing where it is, fp32 -> bf16 by `round_to_bf16`, else a cast."""
    if x.ty.dtype == dtype:
        return x
    if dtype == BF16 and x.ty.dtype == "float32":
        return round_to_bf16(importer, x)
    return importer.block_builder.emit(relax.op.astype(x, dtype))


def widened_source(arg, importer) -> relax.Expr:
    """The operand before a bf16 -> fp32 cast (`x.float()`), else the operand itself: the GEMV
    widens in registers, so the cast copy is never made (for a weight, a full fp32 copy per
    call)."""

    src = importer.env[arg]
    if not isinstance(arg, torch.fx.Node) or str(arg.target) not in (
            "aten._to_copy.default", "aten.to.dtype"):
        return src
    inner = arg.args[0]
    if not isinstance(inner, torch.fx.Node) or inner not in importer.env:
        return src
    before = importer.env[inner]
    if before.ty.dtype == BF16 and src.ty.dtype == "float32":
        return before
    return src
