"""CPU schedules for the generic (legalised and fused) PrimFuncs of a compiled entry.

After `compiler.build.fuse`, every Relax op that is not one of our custom kernels is a PrimFunc of
naive loop nests: one block per nest, directly under the root block (elementwise chains, RMSNorm
means, softmax, Sinkhorn sums, the fp32 matmuls of the hc mixes / compressor / head, gathers,
concats). LLVM turns them into single-threaded scalar loops. This module schedules each block of
each such function on its own:

* injective blocks: the trailing contiguous loops are fused and split into SIMD lanes, the rest is
  fused into one parallel loop;
* reduction blocks (spatial loops, then reduction loops): the spatial loops are made parallel; when
  the innermost spatial axis is the contiguous axis of the output and of every input that uses it
  (a matmul `y[i, j] += x[i, k] * w[k, j]`), a lane-sized piece of it is moved below the reduction
  loops and vectorised.

Why results stay bit-identical to the unscheduled module: every output element is still computed by
the same scalar expression, and its reduction loops run in the same order from the same init value
(no rfactor, no split or reorder of reduction loops, no inlining, which could let the simplifier
fold a `Cast(f32, Cast(bf16, x))` pair). Parallel loops only change which thread computes which
element; vector lanes are elementwise IEEE operations (LLVM is not given fast-math, so it never
reassociates). Blocks whose stores are data-dependent (scatters) or that read what they write are
left serial, since parallel execution could reorder conflicting writes.

Functions marked `tirx.is_scheduled` (our custom kernels) are left alone; a block where any
primitive fails keeps its original loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.target.codegen import llvm_get_vector_width
from tvm_ffi import structural_equal
from tvm_ffi.structural import structural_walk

from dsv41.graph.targets import TargetSpec


@dataclass(frozen=True)
class CpuRulesConfig:
    vector_bits: int  # SIMD register width of the target
    cores: int  # threads TVM's pool runs a parallel loop on
    min_parallel_work: int = 32768  # loop iterations (incl. reduction) worth a parallel launch
    symbolic_extent_guess: int = 1  # a symbolic dim (batch, tokens, context) counts as this


def cpu_rules_config(target: TargetSpec) -> CpuRulesConfig:
    """Vector width from LLVM's view of the target CPU (512 on AVX-512), cores from the target.

    Symbolic dims are guessed at 1 (decode batch 1): a tiny per-token op is not worth waking the
    thread pool, and large ops are large because of their static dims."""

    t = target.tvm_target()
    bits = llvm_get_vector_width(t)
    cores = int(target.target.get("num-cores", 1))
    return CpuRulesConfig(vector_bits=bits if bits > 0 else 128, cores=max(cores, 1))


# ---- block analysis ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _BlockInfo:
    kinds: str  # per iter var: S spatial, R reduction
    extents: tuple  # per loop: int or None (symbolic)
    stores: tuple  # (buffer, indices) of each BufferStore in the body and init
    loads: tuple  # (buffer, indices) of each load in the body and init
    iter_vars: tuple  # the block's iter vars, in loop order
    lane_bits: int  # widest dtype the block touches
    vectorizable: bool  # no bool buffers (stored as int8: TVM's vectorizer mis-types them)


def _const(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def _walk(node, fn) -> None:
    """Call fn on every node below `node` (TVM 0.27 has no tirx post_order_visit)."""
    def visit(n):
        fn(n)

    structural_walk(node, visit)


def _has_load(expr) -> bool:
    found = []
    _walk(expr, lambda n: found.append(1) if isinstance(n, TensorLoad) else None)
    return bool(found)


def _uses(expr, var) -> bool:
    found = []
    _walk(expr, lambda n: found.append(1) if isinstance(n, tirx.Var) and n.same_as(var) else None)
    return bool(found)


def _analyse(sch: s_tir.Schedule, block) -> _BlockInfo | None:
    """The block's iteration space, or None when it is not a plain loop nest we can reason on:
    one loop per iter var, bound one to one in order, loops holding nothing but this block."""
    st = sch.get(block)
    loops = sch.get_loops(block)
    if not loops or len(loops) != len(st.iter_vars):
        return None
    kinds = []
    for iv in st.iter_vars:
        kind = {int(tirx.IterVar.DataPar): "S", int(tirx.IterVar.CommReduce): "R"}.get(
            int(iv.iter_type))
        if kind is None:
            return None
        kinds.append(kind)
    binding = _bindings(sch, block)
    if binding is None or len(binding) != len(loops):
        return None
    for loop, value in zip(loops, binding, strict=True):
        if not (isinstance(value, tirx.Var) and value.same_as(sch.get(loop).loop_var)):
            return None
    if any(not isinstance(sch.get(loop).body, (tirx.For, s_tir.SBlockRealize))
           for loop in loops):
        return None
    stores, loads, bits, dtypes = [], [], [8], set()

    def visit(node):
        if isinstance(node, tirx.BufferStore):
            stores.append((node.buffer, tuple(node.indices)))
            bits.append(tvm.DataType(node.buffer.dtype).bits)
            dtypes.add(str(node.buffer.dtype))
        elif isinstance(node, TensorLoad):
            loads.append((node.source, tuple(node.indices)))
            bits.append(tvm.DataType(node.source.dtype).bits)
            dtypes.add(str(node.source.dtype))

    _walk(st.body, visit)
    if st.init is not None:
        _walk(st.init, visit)
    if not stores:
        return None
    # a scatter (data-dependent store) or a read of a written buffer (other than a reduction's
    # own accumulator at the same element) could race or reorder writes in parallel
    for buf, idx in stores:
        if any(_has_load(i) for i in idx):
            return None
        for lbuf, lidx in loads:
            if lbuf.same_as(buf) and not (
                    "R" in kinds and len(lidx) == len(idx)
                    and all(structural_equal(a, b) for a, b in zip(lidx, idx, strict=True))):
                return None
    extents = tuple(_const(sch.get(loop).extent) for loop in loops)
    return _BlockInfo("".join(kinds), extents, tuple(stores),
                      tuple(loads), tuple(iv.var for iv in st.iter_vars), max(bits),
                      "bool" not in dtypes)


def _bindings(sch: s_tir.Schedule, block):
    """The iter values of the block's realize (loop var per iter var for a plain nest)."""
    parent = sch.get(sch.get_loops(block)[-1]).body
    if isinstance(parent, s_tir.SBlockRealize):
        return list(parent.iter_values)
    return None


def _work(info: _BlockInfo, cfg: CpuRulesConfig) -> int:
    n = 1
    for e in info.extents:
        n *= e if e is not None else cfg.symbolic_extent_guess
    return n


def _lanes(info: _BlockInfo, cfg: CpuRulesConfig) -> int:
    if not info.vectorizable:
        return 1
    return max(cfg.vector_bits // max(info.lane_bits, 8), 1)


def _vector_factor(extent: int, lanes: int) -> int:
    """Largest power of two <= lanes dividing extent (no tail), or the whole extent if short."""
    if lanes < 2:
        return 1
    if 2 <= extent <= lanes:
        return extent
    f = lanes
    while f >= 2:
        if extent % f == 0:
            return f
        f //= 2
    return 1


def _runs_over(buf, idx, tvars, extents) -> bool:
    """Whether the access buf[idx] has `tvars` as exactly its trailing indices, in order, over
    dims of their static `extents`, and uses them in no other index: a run over the fused
    `tvars` is one contiguous stretch of buf."""
    lead = len(idx) - len(tvars)
    if lead < 0:
        return False
    shape = list(buf.shape)
    return all(isinstance(i, tirx.Var) and i.same_as(v) and _const(shape[lead + j]) == e
               for j, (i, v, e) in enumerate(zip(idx[lead:], tvars, extents, strict=True))) \
        and not any(_uses(i, v) for i in idx[:lead] for v in tvars)


def _contiguous_tail(info: _BlockInfo, n_spatial: int) -> int:
    """How many trailing spatial loops (of the first `n_spatial`) map one to one, in order, onto
    the trailing dims of every store, with static extents equal to those dims: fusing them gives
    one contiguous run of the output."""
    t = 0
    while t < n_spatial and info.extents[n_spatial - 1 - t] is not None:
        pos = n_spatial - 1 - t
        tvars, extents = info.iter_vars[pos:n_spatial], info.extents[pos:n_spatial]
        if not all(_runs_over(buf, idx, tvars, extents) for buf, idx in info.stores):
            break
        t += 1
    return t


def _conditions(block_body) -> list:
    """The conditions of every if_then_else below `block_body` (a concat's input choice)."""
    found = []

    def visit(n):
        if isinstance(n, tvm.ir.expr.Call) and isinstance(n.op, tvm.ir.Op) \
                and n.op.name == "prim.if_then_else":
            found.append(n.args[0])

    _walk(block_body, visit)
    return found


def _vector_tail(info: _BlockInfo, conditions: list, tail: int) -> int:
    """How many of the `tail` contiguous trailing loops (`_contiguous_tail`) to fuse into the
    SIMD run: all of them only where the fused run is contiguous in every load too and no
    if_then_else condition depends on an outer one of them; else fewer (at least the innermost).
    A load such as a strided slice's x[..., j] of a wider x, or a concat's x[i - c, j], is not
    contiguous over (i, j): vectorised over the fused index it becomes a lane-by-lane gather,
    and a condition on i inside the run makes the vectoriser scalarise the whole select; over j
    alone both are plain vector loads with a condition fixed for the run."""
    n = len(info.iter_vars)
    while tail > 1:
        tvars, extents = info.iter_vars[n - tail:], info.extents[n - tail:]
        ok = not any(_uses(c, v) for c in conditions for v in tvars[:-1]) and all(
            _runs_over(buf, idx, tvars, extents) for buf, idx in info.loads
            if any(_uses(i, v) for i in idx for v in tvars))  # others: a broadcast over the run
        if ok:
            break
        tail -= 1
    return tail


def _split_points(conditions: list, var, extent: int | None) -> list[int] | None:
    """Where a concat along `var` changes input: the constants p (0 < p < extent) of the
    conditions on `var`, each a comparison of `var` itself with a constant, such that every
    condition is fixed over each piece [p_i, p_i+1). None when a condition on `var` has any other
    form (then no piece is free of it)."""
    points = set()
    for cond in conditions:
        if not _uses(cond, var):
            continue
        if extent is None or not isinstance(cond, (tirx.LE, tirx.LT, tirx.GE, tirx.GT)):
            return None
        a, b = cond.a, cond.b
        if isinstance(b, tirx.Var) and b.same_as(var) and _const(a) is not None:
            # c <= v, c < v (v >= c, v >= c + 1); c >= v, c > v (v < c + 1, v < c)
            p = _const(a) + (1 if isinstance(cond, (tirx.LT, tirx.GE)) else 0)
        elif isinstance(a, tirx.Var) and a.same_as(var) and _const(b) is not None:
            # v <= c, v < c, v >= c, v > c
            p = _const(b) + (1 if isinstance(cond, (tirx.LE, tirx.GT)) else 0)
        else:
            return None
        if 0 < p < extent:
            points.add(p)
    return sorted(points)


def _loads_contiguous_in(info: _BlockInfo, var) -> bool:
    """Every load either ignores `var` or has it as exactly its last index."""
    for _, idx in info.loads:
        for j, i in enumerate(idx):
            if not _uses(i, var):
                continue
            if j != len(idx) - 1 or not (isinstance(i, tirx.Var) and i.same_as(var)):
                return False
    return True


# ---- per-block schedules -----------------------------------------------------------------------


def _maybe_parallel(sch: s_tir.Schedule, loops: list, info: _BlockInfo,
                    cfg: CpuRulesConfig) -> None:
    """Fuse the outer spatial loops into one parallel loop when the block is worth it."""
    if not loops or cfg.cores < 2 or _work(info, cfg) < cfg.min_parallel_work:
        return
    outer = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    ext = _const(sch.get(outer).extent)
    if ext is not None and ext < 2:
        return
    sch.parallel(outer)


def _schedule_pieces(sch: s_tir.Schedule, block, info: _BlockInfo, points: list[int],
                     cfg: CpuRulesConfig) -> bool:
    """A concat along its innermost axis: that loop split into SIMD runs that never straddle an
    input boundary, and the loop of runs partitioned at the boundaries, so that in each piece
    the choice is fixed (the simplifier drops it: the piece's bounds decide it) and the piece
    is a plain vectorised copy; the outer loops parallel. False (nothing changed) when no run
    of 2 or more lanes divides every boundary."""
    extent = info.extents[-1]
    g = extent
    for p in points:
        g = math.gcd(g, p)
    f = _vector_factor(g, _lanes(info, cfg))
    if f < 2:
        return False
    loops = list(sch.get_loops(block))
    runs = sch.split(loops[-1], factors=[None, f])[0]
    bounds = [0, *(p // f for p in points), extent // f]
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
    for piece in sch.loop_partition(runs, factors=[*sizes[:-1], None]):
        for child in sch.get_child_blocks(piece):
            sch.vectorize(sch.get_loops(child)[-1])
    _maybe_parallel(sch, loops[:-1], info, cfg)
    return True


def _schedule_injective(sch: s_tir.Schedule, block, info: _BlockInfo,
                        cfg: CpuRulesConfig) -> None:
    loops = list(sch.get_loops(block))
    n = len(loops)
    conditions = _conditions(sch.get(block).body)
    if any(_uses(c, info.iter_vars[-1]) for c in conditions) and _lanes(info, cfg) > 1:
        points = _split_points(conditions, info.iter_vars[-1], info.extents[-1])
        if points and _schedule_pieces(sch, block, info, points, cfg):
            return
    tail = _vector_tail(info, conditions, _contiguous_tail(info, n))
    vec = None
    if tail:
        inner = sch.fuse(*loops[n - tail:]) if tail > 1 else loops[-1]
        ext = 1
        for e in info.extents[n - tail:]:
            ext *= e
        f = _vector_factor(ext, _lanes(info, cfg))
        if f > 1:
            if f == ext:
                outer_loops, vec = loops[:n - tail], inner
            else:
                rest, vec = sch.split(inner, factors=[None, f])
                outer_loops = [*loops[:n - tail], rest]
        else:
            outer_loops = [*loops[:n - tail], inner]
    else:
        outer_loops = loops
    _maybe_parallel(sch, outer_loops, info, cfg)
    if vec is not None:
        sch.vectorize(vec)


def _schedule_reduction(sch: s_tir.Schedule, block, info: _BlockInfo,
                        cfg: CpuRulesConfig) -> None:
    """Spatial loops parallel; reduction loops untouched in order and extent. Optionally a lane
    piece of the innermost spatial axis goes below them (each output element still accumulates
    its terms in the original order, starting from the original init)."""
    n_s = info.kinds.index("R")
    if "S" in info.kinds[n_s:] or n_s == 0:
        raise ValueError("reduction loops are not all innermost")
    loops = list(sch.get_loops(block))
    spatial, reduce = loops[:n_s], loops[n_s:]
    last, ext = info.iter_vars[n_s - 1], info.extents[n_s - 1]
    f = 1
    if ext is not None and _contiguous_tail(info, n_s) \
            and _loads_contiguous_in(info, last):
        f = _vector_factor(ext, _lanes(info, cfg))
    if f > 1:
        if f == ext:
            outer, vec = spatial[:-1], spatial[-1]
        else:
            rest, vec = sch.split(spatial[-1], factors=[None, f])
            outer = [*spatial[:-1], rest]
        sch.reorder(*reduce, vec)
        _maybe_parallel(sch, outer, info, cfg)
        sch.vectorize(vec)
        # last: parallel/vectorize refuse a loop over a decomposed (init + update) pair
        init = sch.decompose_reduction(block, reduce[0])
        sch.vectorize(sch.get_loops(init)[-1])
    else:
        _maybe_parallel(sch, spatial, info, cfg)


def _schedule_block(func: tirx.PrimFunc, name: str, cfg: CpuRulesConfig) -> tirx.PrimFunc | None:
    sch = s_tir.Schedule(func)
    block = sch.get_sblock(name)
    info = _analyse(sch, block)
    if info is None:
        return None
    if "R" in info.kinds:
        _schedule_reduction(sch, block, info, cfg)
    else:
        _schedule_injective(sch, block, info, cfg)
    return sch.mod["main"]


def schedule_prim_func(func: tirx.PrimFunc, cfg: CpuRulesConfig) -> tirx.PrimFunc | None:
    """Schedule each top-level block of one PrimFunc; None when no block could be scheduled."""
    try:
        sch = s_tir.Schedule(func)
        names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - opaque functions (extern calls, no root block)
        return None
    if len(set(names)) != len(names):
        return None
    changed = False
    for name in names:
        try:
            new = _schedule_block(func, name, cfg)
        except Exception:  # noqa: BLE001 - a primitive refused: keep this block's loops
            new = None
        if new is not None:
            func, changed = new, True
    return func.with_attr("tirx.is_scheduled", True) if changed else None


def apply_cpu_schedules(mod: tvm.IRModule, target: TargetSpec,
                        config: CpuRulesConfig | None = None) -> tvm.IRModule:
    """Parallel + SIMD schedules for every PrimFunc not marked `tirx.is_scheduled`."""
    if target.is_cuda:
        raise ValueError(f"apply_cpu_schedules needs a CPU target, got {target.name}.")
    cfg = config or cpu_rules_config(target)
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False)):
            continue
        new = schedule_prim_func(func, cfg)
        if new is not None:
            updates[gv] = new
    if not updates:
        return mod
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions,
                                                                                mod.attrs)
    for gv, func in updates.items():
        mod[gv] = func
    return mod
