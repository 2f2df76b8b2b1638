"""TIR passes our CPU builds add to TVM's lowering (`CPU_TIR_PIPELINE`).

`inline_single_task_parallel`: a parallel loop of one iteration runs on the calling thread. A
`T.parallel` loop becomes a call of `TVMBackendParallelLaunch`, which wakes every worker and
waits for all of them whatever the loop's extent: a decode step calls ~670 kernels whose
parallel loop runs over the step's rows (one at decode: RMSNorm, the mHC mixes, the cache
writes, the activation quantisers, the expert chain's small stages), and with the pool's workers
asleep between kernels (spin count 0, `runtime.backends.threads`) each launch costs a wake-up
and a join (~8 us measured on a 2-vCPU Xeon against ~4 us for a whole 32K-element kernel run
inline). So:

* extent 1 (a constant): the loop is made serial;
* a symbolic extent: `if extent > 1: <the parallel loop> else: <the same loop, serial>`,
  for a loop body of at most `MAX_COPIED_NODES` (the code is there twice); a bigger one stays
  parallel;
* a constant extent of 2 or more: unchanged;
* and wherever its work (`work`: the statements the loop executes, each store or call one, a
  loop's body times its extent) is under `MIN_PARALLEL_WORK`, serial too: a constant work
  decides at build time, a symbolic one joins the branch's condition
  (`extent > 1 and work >= MIN_PARALLEL_WORK`). The decode step's RoPE of 64 heads, its
  expert-chain quantisers and small cache writes stopped waking the pool (bench artifact at 64K,
  AMD EPYC Zen 4, 2 threads, alternated in one process: decode 111.1 -> 107.8 ms, 112.1 ->
  109.9; verify of 1 + 4 232.8 -> 224.4, 234.6 -> 229.5).

The iterations of a parallel loop are independent (that is what allows it), so running them
in order on one thread computes exactly the same values: outputs are bit for bit the same.
The two copies of a loop body define the same variables and buffers; `ConvertSSA` renames
the second copy's.

`stack_small_buffers`: TVM 0.27's host lowering leaves an `AllocBuffer` on the stack only when
it is under 1 KB and not of scope "local"; every other one (a "local" buffer of any size, any
buffer of 1 KB or more) becomes a `TVMBackendAllocWorkspace` / `TVMBackendFreeWorkspace` pair,
a call into the runtime's workspace pool (a search of its free list): inside a parallel loop
that is once per task. A bench decode step made ~75,000 such calls (uprobe counts on a
Xeon model 207 at 64K: wq_b's 128 tasks 2 each, the RoPE 3 a row, the expert GEMVs' 16-lane
accumulators, the index sweeps'), and the pool was ~4% of the step's CPU samples. A buffer of
a constant size up to `STACK_BUFFER_BYTES` is annotated `disable_lower_builtin` (TVM's own
escape), so LLVM places it in the function's stack frame instead. Nothing else changes: the
same loads and stores on the same values."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm_ffi.structural import structural_map, structural_walk

CPU_TIR_PIPELINE = "dsv41-cpu"  # the registered name of TVM's default pipeline plus this pass
# The largest loop body (IR nodes after TVM's lowering) kept twice for a symbolic extent. The
# per-row kernels that decode runs with one row are small (RMSNorm 366, the FP8 quantiser 445,
# hc_post 1092, hc_pre_mix's loops 2380 and 2802); copying every parallel body (the expert
# chain's, the sweeps', the attention's, mostly launched with several tasks anyway) made the
# bench artifact's LLVM build 17% longer (184 -> 214 s). A bigger body keeps one parallel loop.
MAX_COPIED_NODES = 3000
# The least work (`work`: statements executed, a store or call each) a parallel loop runs in
# parallel. Below it the loop runs on the calling thread: waking the pool's sleeping worker
# costs more than its half of the work. Measured on an AMD EPYC (Zen 4, 2 vCPUs, spin count 0):
# a parallel launch of an empty loop 11.5-16 us against 2.4 us inline; the decode step's RoPE
# of 64 heads (1.5K statements) 29.5 us parallel (6.8 us with the worker spinning), its
# expert-chain quantiser of 2 rows (2K statements) 26 us (6 us spinning).
MIN_PARALLEL_WORK = 8192
# The largest buffer kept on the stack (`stack_small_buffers`): the FP8 GEMV's activation
# staging of a 4096-wide row (8 KB) and the sweeps' tiles fit; the attention's staged blocks
# (~110 KB) stay in the workspace pool. Each thread has a stack of 8 MB (Linux's default).
STACK_BUFFER_BYTES = 16 << 10
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"  # TVM's kDisableLowerTVMBuiltin


def _rewrite(stmt):
    """`stmt` with every parallel loop below it rewritten (see the module docstring)."""
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_rewrite(s) for s in stmt.seq])
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _rewrite(stmt.body))
    if isinstance(stmt, tirx.IfThenElse):
        return tirx.IfThenElse(stmt.condition, _rewrite(stmt.then_case),
                               None if stmt.else_case is None else _rewrite(stmt.else_case))
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, _rewrite(stmt.body))
    if not isinstance(stmt, tirx.For):
        return stmt
    body = _rewrite(stmt.body)

    def loop(kind):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, kind, body, stmt.thread_binding,
                        stmt.annotations, stmt.step)

    if stmt.kind != tirx.ForKind.PARALLEL:
        return loop(stmt.kind)
    total = work(stmt)
    if isinstance(stmt.extent, tirx.IntImm) and (total is None or isinstance(total, int)):
        worth = int(stmt.extent.value) > 1 and (total is None or total >= MIN_PARALLEL_WORK)
        return loop(tirx.ForKind.PARALLEL if worth else tirx.ForKind.SERIAL)
    if _size(body) > MAX_COPIED_NODES:
        return loop(tirx.ForKind.PARALLEL)
    worth = tirx.GT(stmt.extent, tirx.IntImm(str(stmt.extent.ty), 1))
    if total is not None:
        big = tirx.GE(_int64(total), tirx.IntImm("int64", MIN_PARALLEL_WORK))
        worth = tirx.And(worth, big)
    return tirx.IfThenElse(worth, loop(tirx.ForKind.PARALLEL), loop(tirx.ForKind.SERIAL))


def work(stmt, inner: frozenset = frozenset()):
    """The statements `stmt` executes (each store or call 1, a loop's body times its extent), a
    PrimExpr where a loop's extent is symbolic; None where it cannot be bounded from outside
    `stmt` (a While, an extent of a variable bound inside it or of a buffer's value). `inner`:
    the variables bound inside `stmt`'s enclosing loops of the count (loop variables, lets)."""
    if isinstance(stmt, tirx.SeqStmt):
        total = 0
        for part in stmt.seq:
            count = work(part, inner)
            if count is None:
                return None
            total = total + count
            if isinstance(part, tirx.Bind):  # bound for the statements after it
                inner = inner | {part.var}
        return total
    if isinstance(stmt, tirx.For):
        if _uses(stmt.extent, inner):
            return None
        body = work(stmt.body, inner | {stmt.loop_var})
        if body is None:
            return None
        if isinstance(stmt.extent, tirx.IntImm) and isinstance(body, int):
            return int(stmt.extent.value) * body
        return _int64(stmt.extent) * body
    if isinstance(stmt, tirx.IfThenElse):
        then = work(stmt.then_case, inner)
        other = 0 if stmt.else_case is None else work(stmt.else_case, inner)
        if then is None or other is None:
            return None
        if isinstance(then, int) and isinstance(other, int):
            return max(then, other)
        return tirx.Max(_int64(then), _int64(other))
    if isinstance(stmt, tirx.While):
        return None
    if isinstance(stmt, tirx.BufferStore | tirx.Evaluate):
        return 1
    body = getattr(stmt, "body", None)
    if body is None:
        return 0
    var = getattr(stmt, "var", None)  # a let: its variable is bound inside
    return work(body, inner if var is None else inner | {var})


def _uses(expr, names: frozenset) -> bool:
    """Whether `expr` reads any of the variables `names`, or any buffer (a buffer read in an
    extent may be one allocated inside the loop: not readable before it)."""
    found = [False]

    def visit(node):
        if isinstance(node, TensorLoad) or (isinstance(node, tirx.Var) and node in names):
            found[0] = True

    structural_walk(expr, visit)
    return found[0]


def _int64(value):
    """`value` (a Python int or an integer PrimExpr) as an int64 PrimExpr."""
    if isinstance(value, int):
        return tirx.IntImm("int64", value)
    return value if str(value.ty) == "int64" else tirx.Cast("int64", value)


def _size(stmt) -> int:
    """IR nodes below `stmt`."""
    count = [0]
    structural_walk(stmt, lambda _node: count.__setitem__(0, count[0] + 1))
    return count[0]


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="InlineSingleTaskParallel")
def inline_single_task_parallel(func, _mod, _ctx):
    """The pass (see the module docstring), with `ConvertSSA` after it."""
    return func.with_body(_rewrite(func.body))


def _constant_bytes(buf) -> int | None:
    """A buffer's size in bytes when every dim is a constant (None otherwise)."""
    dtype = tvm.DataType(str(buf.dtype))
    n = (dtype.bits * dtype.lanes + 7) // 8
    for dim in buf.shape:
        if not isinstance(dim, tirx.IntImm):
            return None
        n *= int(dim.value)
    return n


def _on_stack(node):
    """`node` (an AllocBuffer) annotated to stay a stack allocation where it is small."""
    size = _constant_bytes(node.buffer)
    if size is None or size > STACK_BUFFER_BYTES or DISABLE_LOWER_BUILTIN in node.annotations:
        return node
    return tirx.AllocBuffer(node.buffer, {**node.annotations,
                                          DISABLE_LOWER_BUILTIN: tirx.IntImm("bool", 1)},
                            node.span)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="StackSmallBuffers")
def stack_small_buffers(func, _mod, _ctx):
    """The pass (see the module docstring)."""
    return func.with_body(structural_map(func.body, [(tirx.AllocBuffer, _on_stack)]))


def _pipeline_factory():
    """TVM's default TIR pipeline (its lowering, host and device finalisation), then the
    parallel-loop pass, ConvertSSA and the stack-buffer pass before the host finalisation."""
    lower, host, device = tvm.tirx.get_tir_pipeline("default")

    @tvm.transform.module_pass(opt_level=0, name="Dsv41CpuLowering")
    def _lower(mod, _ctx):
        mod = lower(mod)
        mod = tvm.tirx.transform.ConvertSSA()(inline_single_task_parallel(mod))
        return stack_small_buffers(mod)

    return _lower, host, device


def register_cpu_tir_pipeline() -> str:
    """Register `CPU_TIR_PIPELINE` with TVM (idempotent) and return its name, for
    `tvm.compile(..., tir_pipeline=...)`."""
    tvm.tirx.register_tir_pipeline(CPU_TIR_PIPELINE, _pipeline_factory)
    return CPU_TIR_PIPELINE
