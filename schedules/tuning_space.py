"""What `dsv41 tune` tunes: the tasks of one compiled entry at one phase shape, the unscheduled
function behind each, realistic inputs for it, and the rules MetaSchedule searches with.

A task is one PrimFunc of an entry's fused module (`compiler.build.fuse`), as `compile` sees it:

* `kernel`: one of our custom-op kernels. The module holds the hand-scheduled function; the task
  tunes the kernel's *unscheduled* factory output (`make_*` with the config's structural choices,
  so the signature is the same) and a tuned trace replaces the hand schedule only where it wins.
  Families whose kernels are sequential selections or chained MoE stages (top-k selects, pool
  selects, the MoE route/gate/down/combine chain) are not tasks: their inputs are tables other
  kernels produce, and their hand schedules are what a search would rediscover.
* `dense`: a generic legalised op (matmul, reduction) that the CPU rules or dlight would
  schedule: the heaviest ones at the phase shape, by estimated FLOPs times call sites, that have
  a reduction and no data-dependent indexing (random inputs must be safe to run).

MetaSchedule needs static shapes: every symbolic dim (batch, tokens, context rows, the kernels'
own row vars) is bound from the phase shape through the entry's call sites, and the task's
workload is its function specialised at those values. The symbolic function stays what compile
replays the tuned trace onto (see compiler/tune.py).

Search rules: MetaSchedule's defaults for the target kind, without the ones that change an fp32
reduction's order on CPU (rfactor) or rewrite weight layouts (the weights are entry arguments in
the checkpoint's layout). Tiling a reduction loop keeps each output's summation order, so a
tuned CPU kernel can be, and is required to be, bit-identical to the hand-scheduled one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.sym import Analyzer
from tvm_ffi.structural import structural_walk

from dsv41.graph.targets import TargetSpec

KERNEL_FAMILIES = ("fp8_linear", "fp8_dequant", "sparse_attend", "index_scores", "quant_fp8",
                   "quant_fp4_kv", "quant_mxfp4", "qdq_mxfp4")
DENSE = "dense"
OPS = (*KERNEL_FAMILIES, DENSE)
MAX_DENSE = 8  # dense tasks per entry (the heaviest by FLOPs x calls)
MIN_DENSE_FLOPS = 1 << 16  # per call site; smaller ops are launch overhead, not compute


@dataclass(frozen=True)
class PhaseShape:
    """The static sizes the tasks are specialised at: decode is one token of `batch` sequences;
    entries with a token dim run `tokens` per call; the cache holds `context` tokens."""

    batch: int = 1
    tokens: int = 256
    context: int = 8192

    def describe(self, entry: str) -> str:
        toks = "1 token" if entry == "decode" else f"{self.tokens} tokens"  # (draft: its block)
        return f"batch {self.batch}, {toks}, context {self.context}"


@dataclass
class Task:
    """One tunable function of an entry (see the module docstring)."""

    name: str  # "<entry>.<function>", unique within a tuning database
    entry: str
    kind: str  # "kernel" | "dense"
    family: str  # a KERNEL_FAMILIES member, or DENSE
    function: str  # the GlobalVar name in the entry's fused module
    key: str  # structural hash of the function compile's schedule step sees (to replace)
    func: tirx.PrimFunc  # unscheduled, symbolic: the tuned trace is replayed onto it
    hand: tirx.PrimFunc  # what compile builds without tuning (dense: before the CPU rules)
    values: dict[str, int]  # the function's symbolic vars at the phase shape
    calls: int  # call sites in the entry
    flops: float  # estimated per call at the phase shape
    label: str = ""  # short human description

    def workload(self) -> tvm.IRModule:
        """The static-shape module MetaSchedule tunes (and its database is keyed by)."""
        return workload_of(self.func, self.values)


# ---- the kernels behind lowering keys (compiler/kernels.py makes their tasks) ----------------


def as_module_kernel(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The attributes `compiler.relax_ops.Lowering.kernel` gives a kernel it adds to a module."""
    return func.without_attr("global_symbol").with_attr("op_pattern", 8)


# ---- shapes: from the phase to every function's symbolic vars ------------------------------------


def _is_call_tir(value) -> bool:
    return (isinstance(value, tvm.relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_tir")


def _tensor_shapes(ty) -> list:
    """The shapes (PrimExpr lists) of a tensor type or a tuple of tensor types."""
    fields = getattr(ty, "fields", None)
    if fields is not None:
        return [s for f in fields for s in _tensor_shapes(f)]
    shape = getattr(ty, "shape", None)
    return [list(shape.values) if shape is not None else None]  # None: a scalar argument


def call_sites(main: tvm.relax.Function) -> dict[str, list[list[list]]]:
    """For each called PrimFunc: per call site, the shapes of its arguments then its outputs
    (the PrimFunc's parameters in order)."""
    sites: dict[str, list] = {}
    for block in main.body.blocks:
        for binding in block.bindings:
            v = binding.value
            if not _is_call_tir(v):
                continue
            shapes = [s for a in v.args[1].fields for s in _tensor_shapes(a.ty)]
            shapes += _tensor_shapes(binding.var.ty)
            sites.setdefault(v.args[0].name_hint, []).append(shapes)
    return sites


def bind_entry_vars(main: tvm.relax.Function, inputs: list) -> dict:
    """The entry's symbolic vars (tirx.Var -> int) from concrete user inputs (anything with a
    .shape, in the entry's parameter order); checked against every dim they determine."""
    values = {}
    ana = Analyzer()
    pairs = list(zip(main.params, inputs, strict=False))
    for param, x in pairs:
        for dim, n in zip(param.ty.shape.values, x.shape, strict=True):
            if isinstance(dim, tirx.Var):
                values[dim] = int(n)
    for var, n in values.items():
        ana.bind(var, tirx.IntImm(str(var.ty), n))
    for param, x in pairs:
        got = [_const(ana.simplify(d)) for d in param.ty.shape.values]
        assert got == [int(n) for n in x.shape], \
            f"input {param.name} is {list(x.shape)}, its dims give {got}"
    return values


def _const(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


def concrete(shapes: list[list], values: dict) -> list[list[int]] | None:
    """Shapes evaluated at the entry's var values (None if a dim stays symbolic)."""
    ana = Analyzer()
    for var, n in values.items():
        ana.bind(var, tirx.IntImm(str(var.ty), n))
    out = []
    for shape in shapes:
        if shape is None:
            return None
        dims = [_const(ana.simplify(d)) for d in shape]
        if any(d is None for d in dims):
            return None
        out.append(dims)
    return out


def bind_func_vars(func: tirx.PrimFunc, shapes: list[list[int]]) -> dict[str, int] | None:
    """The PrimFunc's own symbolic vars (by name) from its parameters' concrete shapes; None if
    the parameters do not line up or a var is left unbound."""
    if len(func.params) != len(shapes):
        return None
    values: dict[str, int] = {}
    for buf, shape in zip(func.params, shapes, strict=True):
        if not isinstance(buf, tirx.Buffer) or len(buf.shape) != len(shape):
            return None
        for dim, n in zip(buf.shape, shape, strict=True):
            if isinstance(dim, tirx.Var):
                if values.setdefault(dim.name, n) != n:
                    return None
    return values if set(values) >= {v.name for v in free_vars(func)} else None


def free_vars(func: tirx.PrimFunc) -> list[tirx.Var]:
    """Symbolic dims of the parameters (each once, in parameter order)."""
    seen: dict[str, tirx.Var] = {}
    for buf in func.params:
        if isinstance(buf, tirx.Buffer):
            for dim in buf.shape:
                for v in _vars_in(dim):
                    seen.setdefault(v.name, v)
    return list(seen.values())


def _vars_in(expr) -> list[tirx.Var]:

    found: list = []
    structural_walk(expr, lambda n: found.append(n) if isinstance(n, tirx.Var) else None)
    return found


def specialise(func: tirx.PrimFunc, values: dict[str, int]) -> tirx.PrimFunc:
    """func with every symbolic dim replaced by its value. Specialisation goes through parameter
    buffers whose dims are plain vars or constants (TVM cannot solve `(t + 127) // 128`); the
    other buffers' expressions then fold."""
    mapping, covered = {}, set()
    for buf in func.params:
        dims = list(buf.shape)
        new = {d.name for d in dims if isinstance(d, tirx.Var)} - covered
        if not new or not all(isinstance(d, tirx.Var | tirx.IntImm) for d in dims):
            continue
        shape = [d if isinstance(d, tirx.IntImm) else tirx.IntImm(str(d.ty), values[d.name])
                 for d in dims]
        mapping[buf] = tirx.decl_buffer(shape, buf.dtype, buf.name)
        covered |= new
    out = func.specialize(mapping) if mapping else func
    assert not free_vars(out), f"{free_vars(out)} left symbolic"
    return out


def workload_of(func: tirx.PrimFunc, values: dict[str, int]) -> tvm.IRModule:
    static = specialise(func, values)
    for attr in ("op_pattern", "tirx.is_scheduled"):
        static = static.without_attr(attr)
    return tvm.IRModule({"main": static.with_attr("global_symbol", "main")})


# ---- which generic functions are dense tasks -----------------------------------------------------


def _blocks(func: tirx.PrimFunc):
    sch = s_tir.Schedule(func)
    return sch, sch.get_child_blocks(sch.get_sblock("root"))


def has_reduction(func: tirx.PrimFunc) -> bool:
    try:
        sch, blocks = _blocks(func)
    except Exception:  # noqa: BLE001 - no root block (opaque / extern functions)
        return False
    return any(int(iv.iter_type) == int(tirx.IterVar.CommReduce)
               for b in blocks for iv in sch.get(b).iter_vars)


def data_dependent(func: tirx.PrimFunc) -> bool:
    """True if any access index reads a buffer (a gather/scatter: random inputs could be out of
    range) or the function calls anything external (sorts, library calls)."""

    found = []

    def visit(n):
        if isinstance(n, (tirx.BufferStore, TensorLoad)):
            for idx in n.indices:
                structural_walk(idx, lambda m: found.append(m) if isinstance(m, TensorLoad)
                                else None)
        elif isinstance(n, tvm.ir.expr.Call) and isinstance(n.op, tvm.ir.Op) and \
                n.op.name in ("tirx.call_extern", "tirx.call_packed", "tirx.tvm_call_packed"):
            found.append(n)

    structural_walk(func.body, visit)
    return bool(found)


def estimate_flops(mod: tvm.IRModule) -> float:
    from tvm.s_tir.analysis import estimate_tir_flops  # heavy: s_tir's analysis, for tuning only

    try:
        return float(estimate_tir_flops(mod))
    except Exception:  # noqa: BLE001 - the estimator has no rule for some nodes (Let)
        return math.nan


# ---- search rules --------------------------------------------------------------------------------


SPACE_FALLBACKS = ((), ("CrossThreadReduction",), ("AutoInline",),
                   ("CrossThreadReduction", "AutoInline"))
"""Rules left out, in order, when a kernel's design space cannot be generated with all of them
(TVM 0.27's CUDA rules fail on some of our kernels with an IndexError inside the generator)."""


def search_space(target: TargetSpec, drop: tuple[str, ...] = ()):
    """PostOrderApply with MetaSchedule's default rules for the target kind, minus rfactor on CPU
    (it reorders fp32 sums), the weight-layout rewrite (weights keep the checkpoint layout) and
    the rule classes named in `drop`. The rules are given explicitly, so nothing needs TVM's
    tensor-intrinsic registry."""
    from tvm.s_tir import meta_schedule as ms  # heavy: MetaSchedule (~1 s), for tuning only

    kind = "cuda" if target.is_cuda else "llvm"
    rules = [r for r in ms.schedule_rule.ScheduleRule.create(kind)
             if not (not target.is_cuda and isinstance(r, ms.schedule_rule.AddRFactor))
             and type(r).__name__ not in drop]
    posts = [p for p in ms.postproc.Postproc.create(kind)
             if not isinstance(p, ms.postproc.RewriteLayout)]
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=posts,
                                             mutator_probs=ms.mutator.Mutator.create(kind))


# ---- inputs --------------------------------------------------------------------------------------


def task_inputs(family: str, params: list[tirx.Buffer], seed: int = 0) -> list[np.ndarray]:
    """Arrays for every parameter of a static-shape function (outputs included, zeroed): floats
    ~ N(0, 1); bytes (FP8/FP4 codes, E8M0/E4M3 scales) in 0x30..0x4f, finite in every format;
    integer index inputs valid for the family (window and global rows, visible lengths), zero
    for dense ops (which never index with them)."""
    import ml_dtypes  # heavy: ~0.7 s, only for a tuning task's random inputs

    rng = np.random.default_rng(seed)
    shapes = [[int(d) for d in b.shape] for b in params]
    out = []
    for i, (buf, shape) in enumerate(zip(params, shapes, strict=True)):
        dtype = str(buf.dtype)
        if dtype in ("float32", "float64", "float16"):
            a = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bfloat16":
            a = rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)
        elif dtype == "uint8":
            a = rng.integers(0x30, 0x50, size=shape, dtype=np.uint8)
        elif dtype == "bool":
            a = rng.integers(0, 2, size=shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            a = _index_input(family, i, shapes, dtype, rng)
        else:
            raise ValueError(f"No input rule for dtype {dtype} ({buf.name}).")
        out.append(np.ascontiguousarray(a))
    return out


def _index_input(family: str, i: int, shapes: list[list[int]], dtype: str, rng) -> np.ndarray:
    shape = shapes[i]
    if family == "sparse_attend" and i in (3, 6):  # win_idx over window rows, kv_idx over N
        rows = shapes[1][1] if i == 3 else shapes[4][1]
        if rows == 0:
            return np.full(shape, -1, dtype=dtype)
        return np.sort(rng.integers(0, rows, size=shape), axis=-1).astype(dtype)
    if family == "index_scores" and i == 4:  # lens: the whole context is visible
        return np.full(shape, shapes[1][1], dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def signature(func: tirx.PrimFunc) -> list[tuple[str, int]]:
    """(dtype, rank) per parameter: what a replacement function must keep."""
    return [(str(b.dtype), len(b.shape)) for b in func.params]
