"""Tile configs and schedules of the sweeps and the select, one config function per target."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir

from dsv41.graph.targets import TargetSpec
from dsv41.schedules.common import (
    has_avx512,
    has_features,
)
from dsv41.schedules.indexer.amx_sweep import AMX_HEADS
from dsv41.schedules.indexer.sweep import SCORE_PAD
from dsv41.schedules.indexer.x86_sweep import avx512_sweep_supported


@dataclass(frozen=True)
class SweepConfig:
    tile: int  # score entries per parallel task (CPU) or per thread block (CUDA); divides 128
    head_block: int  # CPU: heads accumulated together in registers (tile/16 * head_block zmm)
    kdec_vector_d: bool  # CPU, scheduled sweep: vectorise the key decode over d (else the tile)
    avx512: bool = False  # CPU full sweep: the hand-vectorised make_index_scores_avx512
    max_tasks: int = 1  # avx512: parallel tasks per batch row (contiguous runs of tiles)
    vnni: bool = False  # avx512: the int8 dot (AVX-512 VNNI + BW; exact q only, see factory)
    lanes: int = 16  # avx512: 32-bit lanes per vector (8: the AVX2 form of the kernel)
    amx: bool = False  # vnni: the dot on AMX-INT8 tiles where the keys allow (see factory)
    vbmi: bool = False  # vnni, no AMX: one vpdpbusd dot over all of D (scales as int8 shifts)


def sweep_config(target: TargetSpec, *, heads: int, dim: int, pool: bool = False) -> SweepConfig:
    """CUDA: 128 threads, one score entry each. CPU with AVX-512, full sweep: the hand-vectorised
    kernel, 16 tasks per core (even halves of T; tasks, not tiles, so the per-task buffers are
    set up rarely). With VNNI (and dim a multiple of 128) the int8 dot on 32-entry tiles x 8
    heads (16 int32 accumulators; at T=256K, H=32, D=128, 2 cores: 8.5 ms, against 11.0 for
    64 x 4, 13.5 for 64 x 8, 9.3 for 32 x 4, 11.1 for 16 x 16; the fp32 dot 17.6 ms); with
    AMX-INT8 (dim 128, heads a multiple of 32) its dot on AMX tiles (T=1M, one core of a Xeon
    with AMX: 11.9 ms against 31.0 for the VNNI dot; 2 cores 5.8 against 16.7); with VBMI but
    no AMX (Zen 4, Ice Lake) the same folded operands on one vpdpbusd dot per head over all of
    D (T=1M, one Zen 4 core: 29.6 ms against 36.7 for the block-scaled VNNI dot). Without
    VNNI the fp32 dot on 64-entry tiles x 4 heads = 16 zmm accumulators (64 x 4 beat 32 x 8,
    32 x 4 and 128 x 2 at T=32K: 4 tile loads and 4 broadcasts per 16 FMAs, and the decoded
    tile, 32 KiB, stays in L1). On AVX2 (no AVX-512; dim a multiple of 128) the same kernel on
    256-bit vectors with the int8 dot (vpmaddubsw), 16-entry tiles x 8 heads: at T=256K, H=32,
    D=128 on one Zen 3 core 21-40 ms (a shared, noisy machine) against 147 ms for the scheduled
    fp32 sweep; 16 x 4 28 ms, 32 x 2 28, 32 x 4 37, 32 x 8 45, 16 x 16 60. Otherwise (pool
    sweep, other CPUs): the scheduled sweep with a 32-entry tile x 8 heads (the best of
    16/32/64 x 4/8/16 measured at T=128K)."""
    if target.is_cuda:
        return SweepConfig(tile=128, head_block=1, kdec_vector_d=False)
    cores = max(int(target.target.get("num-cores", 1)), 1)
    vnni = dim % 128 == 0 and has_features(target, "avx512f", "avx512bw", "avx512vnni")
    hb = math.gcd(heads, 8 if vnni else 4)
    if not pool and has_avx512(target) and avx512_sweep_supported(heads=heads, dim=dim,
                                                                   head_block=hb):
        amx = (vnni and dim == 128 and heads % AMX_HEADS == 0
               and has_features(target, "amx-tile", "amx-int8", "avx512vbmi"))
        vbmi = vnni and dim == 128 and not amx and has_features(target, "avx512vbmi")
        return SweepConfig(tile=32 if vnni else 64, head_block=hb, kdec_vector_d=False,
                           avx512=True, max_tasks=16 * cores, vnni=vnni, amx=amx, vbmi=vbmi)
    hb = math.gcd(heads, 8)
    if not pool and has_features(target, "avx2") and avx512_sweep_supported(
            heads=heads, dim=dim, head_block=hb, lanes=8):
        return SweepConfig(tile=16, head_block=hb, kdec_vector_d=False, avx512=True,
                           max_tasks=16 * cores, vnni=True, lanes=8)
    return SweepConfig(tile=32, head_block=hb, kdec_vector_d=True)


def schedule_index_scores(func: tvm.tirx.PrimFunc, config: SweepConfig,
                          target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Schedules either sweep (full or pool; they share block names). CPU: parallel over
    (b, T-tile) [full] or (b, s, tile) [pool]; keys decoded once per tile into a [D, tile] buffer
    and reused by every head and (full sweep) every query (the shared sweep's per tile and
    query: each query token reads the store its own pick names); dot vectorised over the tile with
    head_block register accumulators. CUDA: one thread per score entry, q in shared memory,
    each key element decoded once into a register and used by all heads."""
    assert SCORE_PAD % config.tile == 0, "the tile must divide SCORE_PAD"
    pool = func.attrs["global_symbol"] == "pool_scores"
    sch = s_tir.Schedule(func)
    if target.is_cuda:
        _schedule_sweep_cuda(sch, config)
    else:
        _schedule_sweep_cpu(sch, config, pool,
                            func.attrs["global_symbol"] == "index_scores_shared")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_sweep_cpu(sch: s_tir.Schedule, config: SweepConfig, pool: bool,
                        shared: bool) -> None:
    out = sch.get_sblock("score")
    b, s, t = sch.get_loops(out)
    to, ti = sch.split(t, [None, config.tile])
    if pool:
        task = sch.fuse(b, s, to)
        q_at = task
    else:
        sch.reorder(b, to, s, ti)
        task = sch.fuse(b, to)
        q_at = sch.get_loops(out)[1]  # s
    sch.parallel(task)
    kdec = sch.get_sblock("k_dec")
    per_token = pool or shared  # keys decoded per query token (the pool's, a token's pick)
    if per_token:
        sch.transform_layout(kdec, ("write", 0), lambda b, s, j, d: (b, s, d, j))
    else:
        sch.transform_layout(kdec, ("write", 0), lambda b, t, d: (b, d, t))
    for name in ("chunk", "dot", "q_f32"):
        sch.compute_at(sch.get_sblock(name), q_at, preserve_unit_loops=True)
    sch.compute_at(kdec, q_at if shared else task, preserve_unit_loops=True)
    kt, kd = sch.get_loops(kdec)[-2:]
    if config.kdec_vector_d:
        sch.vectorize(kd)
    else:
        sch.reorder(kd, kt)
        sch.vectorize(kt)
    sch.vectorize(sch.get_loops(sch.get_sblock("q_f32"))[-1])
    dot = sch.get_sblock("dot")
    h, tt, d = sch.get_loops(dot)[-3:]
    ho, hi = sch.split(h, [None, config.head_block])
    sch.reorder(ho, d, hi, tt)
    acc = sch.cache_write(dot, 0, "local")  # per head-group accumulators -> registers
    sch.reverse_compute_at(acc, ho, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.unroll(hi)
    sch.vectorize(tt)
    sch.decompose_reduction(dot, d)  # after the loop annotations (TVM.md §5)
    chunk = sch.get_sblock("chunk")
    tt, j = sch.get_loops(chunk)[-2:]
    sch.reorder(j, tt)
    sch.vectorize(tt)
    sch.decompose_reduction(chunk, j)
    sch.vectorize(sch.get_loops(out)[-1])


def _schedule_sweep_cuda(sch: s_tir.Schedule, config: SweepConfig) -> None:
    out = sch.get_sblock("score")
    b, s, t = sch.get_loops(out)
    to, ti = sch.split(t, [None, config.tile])
    cta = sch.fuse(b, s, to)
    sch.bind(cta, "blockIdx.x")
    sch.bind(ti, "threadIdx.x")
    for name in ("chunk", "dot"):
        sch.compute_at(sch.get_sblock(name), ti, preserve_unit_loops=True)
    # q for this (b, s) in shared memory, loaded cooperatively
    qf = sch.get_sblock("q_f32")
    sch.compute_at(qf, cta, preserve_unit_loops=True)
    sch.set_scope(qf, 0, "shared")
    hq, dq = sch.get_loops(qf)[-2:]
    _, qtx = sch.split(sch.fuse(hq, dq), [None, config.tile])
    sch.bind(qtx, "threadIdx.x")
    # per-thread accumulators over heads; d outermost so each key element is decoded once
    dot = sch.get_sblock("dot")
    sch.set_scope(dot, 0, "local")
    h, d = sch.get_loops(dot)[-3:][0::2]
    sch.decompose_reduction(dot, h)
    h, _, d = sch.get_loops(dot)[-3:]
    sch.reorder(d, h)
    sch.unroll(h)
    kdec = sch.get_sblock("k_dec")
    sch.compute_at(kdec, d, preserve_unit_loops=True)
    sch.set_scope(kdec, 0, "local")
    chunk = sch.get_sblock("chunk")
    sch.set_scope(chunk, 0, "local")
    j = sch.get_loops(chunk)[-1]
    sch.unroll(j)
    sch.decompose_reduction(chunk, j)


@dataclass(frozen=True)
class SelectConfig:
    lanes: int  # workers per row: 1 on CPU (rows run in parallel), a thread block on CUDA
    group: int = 32  # CPU: items per group of the group-maximum prefilter
    chunks: int = 32  # CPU: parallel runs of groups per row in the group-maximum pass


def select_config(target: TargetSpec) -> SelectConfig:
    """CUDA: 256 threads per row (histogram atomics in shared memory, contiguous segments for the
    ordered emit). CPU: maxima of groups of 32 items (16 runs of groups per core in parallel),
    then one row per task. With k = 512, single core: 0.06 / 0.10 / 0.18 / 0.67 ms at 8K / 64K /
    256K / 1M entries; groups of 16 rank too many maxima at 1M (0.9 ms), groups of 64 or 128
    leave every group a candidate at 64K (0.19 / 0.31 ms)."""
    if target.is_cuda:
        return SelectConfig(lanes=256)
    cores = int(target.target.get("num-cores", 1))
    return SelectConfig(lanes=1, group=32, chunks=16 * max(cores, 1))
