"""The sparse-attend kernel's schedules (CPU and CUDA) over `make_sparse_attend`'s blocks;
the bf16-dot form is written scheduled and returned as is."""

from __future__ import annotations

import math

import tvm
from tvm import s_tir

from dsv41.graph.targets import TargetSpec
from dsv41.schedules.attention.configs import ATTN_BLOCK, SparseAttendConfig


def _blocks(sch: s_tir.Schedule, name: str) -> list:
    """The blocks called `name` or `name_<n>` (a second staging pass), in program order; all
    blocks of the function when `name` is empty."""
    found = []
    pending = sch.get_child_blocks(sch.get_sblock("root"))
    while pending:
        blk, pending = pending[0], pending[1:]
        hint = sch.get(blk).name_hint
        if not name or hint == name or (hint.startswith(name + "_")
                                         and hint[len(name) + 1:].isdigit()):
            found.append(blk)
        pending = sch.get_child_blocks(blk) + pending
    return found


def _split_vector(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Vectorise `loop` by `lanes` (the whole loop when it is not longer)."""
    extent = int(sch.get(loop).extent)
    if extent <= lanes:
        sch.vectorize(loop)
        return
    if extent % lanes == 0:
        sch.vectorize(sch.split(loop, [None, lanes])[1])


def _schedule_cpu(sch: s_tir.Schedule, cfg: SparseAttendConfig, hg: int, d: int) -> None:
    v = cfg.vector
    if cfg.bf16_dot:  # per chunk of rows: its blocks' staging, then its tasks, over the cores
        for name in ("prestage", "task"):
            sch.parallel(sch.fuse(*sch.get_loops(sch.get_sblock(name))[1:]))
    else:
        sch.parallel(sch.fuse(*sch.get_loops(sch.get_sblock("task"))))
    for name in ("stage_win", "stage_tail", "acc_update", "acc_init", "out", "q_stage", "logit",
                 "prob", "p_bf16"):  # vectorised over d or over the heads (the innermost loop)
        for blk in _blocks(sch, name):
            _split_vector(sch, sch.get_loops(blk)[-1], v)
    for name in ("block_max", "denom"):  # j outside, heads in lanes: each head's max/sum
        if not _blocks(sch, name):  # bf16_dot: softmax_vec, written vectorised
            continue
        blk = sch.get_sblock(name)  # still runs over j in order, 16 heads at a time
        hh, j = sch.get_loops(blk)[-2:]
        sch.reorder(j, hh)
        init = sch.decompose_reduction(blk, j)
        _split_vector(sch, hh, v)
        _split_vector(sch, sch.get_loops(init)[-1], v)
    if cfg.bf16_dot:  # QK and PV are written as vdpbf16ps register tiles (bf16_dot.py)
        return
    for blk in _blocks(sch, "stage_glob"):
        if len(sch.get_loops(blk)) == 8:  # FP4 (.., byte, nibble): LLVM vectorises the bytes
            sch.unroll(sch.get_loops(blk)[-1])
        else:
            _split_vector(sch, sch.get_loops(blk)[-1], v)
    # QK as an outer product: for each d, a broadcast entry value times a vector of heads, with a
    # register tile of unroll_rows entries x hg heads accumulated over d.
    qk = sch.get_sblock("qk")
    j, hh, c = sch.get_loops(qk)[-3:]
    rows = math.gcd(cfg.unroll_rows, int(sch.get(j).extent))
    jo, ji = sch.split(j, [None, rows])
    sch.reorder(jo, c, ji, hh)
    init = sch.decompose_reduction(qk, c)
    sch.unroll(ji)
    _split_vector(sch, hh, v)
    _split_vector(sch, sch.get_loops(init)[-1], v)
    # PV as an outer product: p[j, h] broadcast times a vector of the entry, a register tile of
    # pv_heads heads x pv_cols values of d
    pv = sch.get_sblock("pv")
    hh, c, j = sch.get_loops(pv)[-3:]
    hb = math.gcd(cfg.pv_heads, hg)
    cb = math.gcd(cfg.pv_cols, d)
    ho, hi = sch.split(hh, [None, hb])
    co, ci = sch.split(c, [None, cb])
    ci1, ci2 = sch.split(ci, [None, min(v, cb)])
    sch.reorder(ho, co, j, hi, ci1, ci2)
    init = sch.decompose_reduction(pv, j)
    sch.unroll(hi)
    sch.unroll(ci1)
    sch.vectorize(ci2)
    _split_vector(sch, sch.get_loops(init)[-1], v)


def schedule_sparse_attend(func: tvm.tirx.PrimFunc, config: SparseAttendConfig,
                           target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Schedule either sparse-attend kernel built with `config`'s heads_per_group/stage_rows."""
    # The online-softmax state (acc, max, denominator) is updated in place across the serial
    # block loop, so those blocks are not "compact dataflow" and the primitives' prerequisite
    # checks would refuse every loop above them. The loops transformed here are independent by
    # construction (tasks, heads, d) and the tests compare against the oracle.
    sch = s_tir.Schedule(func, enable_check=False)
    qt, kst = sch.get(sch.get_sblock("task")).alloc_buffers[:2]  # (d or d/2, hg), (rows, d)
    amx_dot = bool(_blocks(sch, "qk_amx"))
    bf16_dot = amx_dot or bool(_blocks(sch, "qk_vec"))
    hg = int(qt.shape[1])
    # the bf16-dot path stages whole blocks before the tasks (prestage): no tile in the task
    d, rows = (2 * int(qt.shape[0]), ATTN_BLOCK) if bf16_dot else (int(kst.shape[1]),
                                                                   int(kst.shape[0]))
    if (hg, rows) != (config.heads_per_group, config.stage_rows):
        raise ValueError(
            f"The kernel was built with heads_per_group={hg}, stage_rows={rows} "
            f"but the config asks for {config.heads_per_group}, {config.stage_rows}; build it "
            "with make_sparse_attend(..., heads_per_group=config.heads_per_group, "
            "stage_rows=config.stage_rows).")
    vector = bool(_blocks(sch, "stage_vec"))
    if vector != config.vector_decode:
        raise ValueError(f"The kernel was built with vector_decode={vector} but the config asks "
                         f"for {config.vector_decode}; build it with make_sparse_attend(..., "
                         "vector_decode=config.vector_decode).")
    if bf16_dot != config.bf16_dot:
        raise ValueError(f"The kernel was built with bf16_dot={bf16_dot} but the config asks for "
                         f"{config.bf16_dot}; build it with make_sparse_attend(..., "
                         "bf16_dot=config.bf16_dot).")
    if amx_dot != config.amx_dot:
        raise ValueError(f"The kernel was built with amx_dot={amx_dot} but the config asks for "
                         f"{config.amx_dot}; build it with make_sparse_attend(..., "
                         "amx_dot=config.amx_dot).")
    if vector and target.is_cuda:
        raise ValueError("vector_decode is the AVX-512 CPU staging; CUDA kernels stage with "
                         "sblocks (build with vector_decode=False).")
    if target.is_cuda:
        _schedule_cuda(sch, config)
    else:
        _schedule_cpu(sch, config, hg, d)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_cuda(sch: s_tir.Schedule, cfg: SparseAttendConfig) -> None:
    """One thread block per (b, s, head group): blockIdx.x = b * s, blockIdx.y = group. All
    per-task state (staged rows, logits, accumulator, max, denominator) lives in shared
    memory; every step is spread over the block's threads (TVM inserts the barriers)."""
    task = sch.get_sblock("task")
    bb, ss, g = sch.get_loops(task)
    sch.bind(sch.fuse(bb, ss), "blockIdx.x")
    sch.bind(g, "blockIdx.y")
    sch.compute_inline(sch.get_sblock("q_stage"))  # q is read from global (L1) in QK
    writers = {"stage_win": None, "stage_glob": None, "stage_tail": None, "qk": 0,
               "logit": 0, "acc_update": 0, "state_init": None, "block_max": 0, "denom": 0}
    for name, index in writers.items():
        for blk in _blocks(sch, name):
            for i in ([index] if index is not None else range(len(sch.get(blk).writes))):
                sch.set_scope(blk, i, "shared")
    # pv and acc_update share their (head, d) loops: p @ entries stays in a register of the
    # thread that then updates acc
    for pv in _blocks(sch, "pv"):
        upd = _next(sch, pv, "acc_update")
        hh_p, c_p = [lp for lp in sch.get_loops(pv) if _is_inner(sch, lp)][:2]
        hh_u, c_u = [lp for lp in sch.get_loops(upd) if _is_inner(sch, lp)]
        sch.merge(hh_p, hh_u)
        hh_p, c_p = [lp for lp in sch.get_loops(pv) if _is_inner(sch, lp)][:2]
        c_u = [lp for lp in sch.get_loops(upd) if _is_inner(sch, lp)][1]
        sch.merge(c_p, c_u)
        sch.set_scope(pv, 0, "local")
    for name in ("state_init", "stage_win", "stage_glob", "stage_tail", "qk", "logit",
                 "block_max", "prob", "rescale", "denom", "denom_update", "p_bf16", "pv",
                 "max_update", "sink", "out"):
        for blk in _blocks(sch, name):
            loops = [lp for lp in sch.get_loops(blk) if _is_inner(sch, lp)]
            reduce = name in ("qk", "block_max", "denom", "pv")
            # a reduction keeps its reduced loop (innermost) serial in each thread and
            # accumulates in a register (no barrier inside its loop)
            spatial = loops[:-1] if reduce else loops
            _, tx = sch.split(sch.fuse(*spatial), [None, cfg.threads])
            sch.bind(tx, "threadIdx.x")
            if reduce and name != "pv":
                # Note: when the reduction has fewer outputs than threads (QK: rows x heads =
                # 64), TVM bounds the write-back by the buffer, not by the thread predicate, so
                # spare threads also store their (unused) register into rows of later staging
                # passes; those rows are rewritten by their own pass after a barrier, so the
                # result is unaffected (the restaged structure is tested on the CPU).
                sch.reverse_compute_at(sch.cache_write(blk, 0, "local"), tx)


def _next(sch: s_tir.Schedule, blk, name: str):
    """The first block called `name` (or `name_<n>`) after `blk` in program order."""
    order = _blocks(sch, "")
    here = [sch.get(b).name_hint for b in order].index(sch.get(blk).name_hint)
    for b in order[here + 1:]:
        hint = sch.get(b).name_hint
        if hint == name or hint.startswith(name + "_"):
            return b
    raise AssertionError(f"no block {name} after {sch.get(blk).name_hint}")


def _is_inner(sch: s_tir.Schedule, loop) -> bool:
    """Loops inside the task block (not its own b/s/group loops, not the t/r block loops)."""
    return sch.get(loop).loop_var.name not in ("t", "r") and not sch.get(loop).thread_binding
