"""The split chain's tiling config and the schedules of its kernels per target."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import s_tir

from dsv41.graph.targets import TargetSpec
from dsv41.schedules import gemm
from dsv41.schedules.common import (
    has_amx_bf16,
    has_avx512_bf16,
    has_features,
)
from dsv41.schedules.gemm import BLOCK

# ---- configs and schedules -------------------------------------------------------------------


@dataclass(frozen=True)
class MoeSplitConfig:
    """Tiling of the split chain. row_tile: rows of one expert per tile (the route's cut);
    tn: output columns per parallel task (CPU) / thread block (CUDA); kind "gemv" (CPU decode):
    each routed pair's weight rows walked along K, cb columns per group. CUDA GEMMs: a
    (row_tile x tn) tile per thread block, (row_tile/rb) x (tn/cb) threads, each an rb x cb
    register tile (x2 for gate/up); per 32-block the gathered activations and the decoded weight
    tile sit in shared memory. threads: per block of the elementwise/route-free CUDA kernels."""

    row_tile: int = 16
    tn: int = 32
    rb: int = 4
    cb: int = 4
    threads: int = 128
    kind: str = "tiles"  # CPU decode: "gemv" (`make_moe_gate_up_gemv` / `make_moe_down_gemv`)
    vec: int = 16  # gemv: lanes of each partial sum (packed bytes, one 32-block)
    hand: bool = False  # gemv: the hand-vectorised kernels (`make_moe_gate_up_gemv_avx512`)
    lanes: int = 16  # gemv + hand: fp32 lanes per vector, 16 (AVX-512) or 8 (AVX2)
    # gemv + hand (AVX-512), the verify entry: each route tile's rows share the weight loads
    # (`make_moe_gate_up_rows_avx512`), bit-identical per row to the decode kernels
    rows: bool = False
    # gemv + hand: "bf16" sums on vdpbf16ps (`moe.fp4_dot`; AVX-512 BF16 + VBMI), else "fp32"
    dot: str = "fp32"

    def __post_init__(self) -> None:
        if self.kind not in ("tiles", "gemv"):
            raise ValueError(f"MoeSplitConfig.kind is 'tiles' or 'gemv', got {self.kind!r}.")


def moe_split_config(target: TargetSpec, *, dim: int, inter: int, n_experts: int, topk: int,
                     n: int | None = None, rows: int = 1) -> MoeSplitConfig:
    """n is a hint for the token count (None: prefill); decode wants short tiles, since each
    expert then sees one or two rows. rows > 1: the verify entry's calls (1 + k rows per
    sequence), whose hand-vectorised GEMVs take the route's tiles (the rows of one expert)
    and read each weight once per tile."""
    decode = n is not None and n * topk <= 4 * n_experts
    if target.is_cuda:
        tn = 64 if min(dim, inter) % 64 == 0 else 32
        if decode:
            return MoeSplitConfig(row_tile=8, tn=tn, rb=1, cb=tn // 32)
        return MoeSplitConfig(row_tile=32, tn=tn, rb=4, cb=tn // 16)
    if decode:
        # one or two rows per expert: the tile kernels' [32, tn] weight decode served a single
        # row from a strided read (bench preset, one token: 2.1 ms per layer single-threaded,
        # 7.6x the chain's byte floor)
        avx512 = has_features(target, "avx512f", "fma")
        # AVX2: the fp32 form in 256-bit vectors, bit for bit the 512-bit form's (Zen 4 running
        # the cpu-avx2 code, bench preset, 2 threads: the scheduled GEMVs' 64K decode step
        # spent 7.8 ms in gate/up and 2.5 in down, 3.4x and 2.2x their bytes at 35 GB/s)
        avx2 = not avx512 and has_features(target, "avx2", "fma")
        # vdpbf16ps where the CPU has it and VBMI's byte lookups (`moe.fp4_dot`: Zen 4, bench
        # preset gate_up from cache 67 -> 52 us); not with AMX (Intel), whose vdpbf16ps issues
        # at a quarter of its FMA rate (schedules/gemm/linear.py), unmeasured for this kernel
        bf16 = (avx512 and has_avx512_bf16(target) and has_features(target, "avx512vbmi")
                and not has_amx_bf16(target))
        return MoeSplitConfig(row_tile=4, tn=32, cb=4, kind="gemv", hand=avx512 or avx2,
                              lanes=16 if avx512 else 8, rows=avx512 and rows > 1,
                              dot="bf16" if bf16 else "fp32")
    # prefill: each tile decodes its expert's whole weight once per column block, so rows per
    # tile set the decode work per row. Bench dims (dim 1024, inter 512, 16 experts, top-2), 2
    # threads, Xeon with AMX, min of 5 (gate_up / down ms): 16 rows 220 / 57 at 2048 tokens,
    # 29.4 / 8.0 at 160 (a 128-token replay + 32 new); 32 rows 172 / 48, 25.9 / 7.0; 64 rows
    # 172 / 41, 18.9 / 5.6; 128 rows 176 / 40, 24.8 / 8.4 (each expert's last tile padded).
    # The same bits at every size: each row's sums run in the same K order.
    return MoeSplitConfig(row_tile=64, tn=32)


def _schedule_expert_gemm_cuda(sch: s_tir.Schedule, config: MoeSplitConfig, out: str) -> None:
    """blockIdx.x over tiles, blockIdx.y over column blocks; per 32-block the activation rows
    [row_tile, 32] and the decoded weight tile [(2,) 32, tn] go to shared memory, loaded by all
    threads; each thread accumulates an rb x cb (x2) register tile."""
    xg, wdec = sch.get_sblock("xg"), sch.get_sblock("wdec")
    part, acc, out_b = sch.get_sblock("part"), sch.get_sblock("acc"), sch.get_sblock(out)
    # Anchored on the epilogue (its data-dependent store defeats reverse_compute_at).
    t, r, a = sch.get_loops(out_b)
    threads = [config.row_tile // config.rb, config.tn // config.cb]
    # contiguous columns per thread (interleaving them would make compute_at's bounding box
    # of the register tile span the whole column block)
    by, tx, cn = sch.split(a, [None, threads[1], config.cb])
    ty, mr = sch.split(r, [threads[0], config.rb])
    sch.reorder(t, by, ty, tx, mr, cn)
    sch.bind(t, "blockIdx.x")
    sch.bind(by, "blockIdx.y")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.compute_at(acc, tx)
    aloops = sch.get_loops(acc)[4:]  # (mr, [c,] cn, b) below (t, by, ty, tx)
    b = aloops[-1]
    sch.reorder(b, *aloops[:-1])
    sch.compute_at(part, b)
    sch.set_scope(part, 0, "local")
    sch.set_scope(acc, 0, "local")
    ploops = sch.get_loops(part)[5:]  # (mr, [c,] cn, j) below (t, by, ty, tx, b)
    sch.reorder(ploops[-1], *ploops[:-1])
    for stage in (xg, wdec):
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, b)
        loops = sch.get_loops(stage)[5:]  # xg (r, k); wdec ([c,] k, a)
        if stage == wdec:
            # threads along k read consecutive packed bytes; rows padded by one float so the
            # transposed shared stores do not all hit one bank
            sch.reorder(*loops[:-2], loops[-1], loops[-2])
            ndim = len(sch.get(stage).writes[0].region)
            sch.storage_align(stage, 0, ndim - 2, 32, 1)
            loops = [*loops[:-2], loops[-1], loops[-2]]
        _, sty, stx = sch.split(sch.fuse(*loops), [None, *threads])
        sch.bind(sty, "threadIdx.y")
        sch.bind(stx, "threadIdx.x")
    for loop in sch.get_loops(part)[6:]:
        sch.unroll(loop)
    sch.decompose_reduction(part, sch.get_loops(part)[5])
    sch.decompose_reduction(acc, b)


def _schedule_grouped_gemm_cpu(sch: s_tir.Schedule, tn: int, wdec: str, part: str, acc: str,
                               out: str) -> None:
    """One grouped GEMM: per (tile, column block of tn) task, per 32-block decode the weight tile
    once ([(2,) 32, tn] transposed) and reuse it for the tile's rows, vectorised over columns."""
    part_b, acc_b, wdec_b = sch.get_sblock(part), sch.get_sblock(acc), sch.get_sblock(wdec)
    out_b = sch.get_sblock(out)
    # Anchored on the output block: reverse_compute_at would need the routing producer inside.
    t, r, cols = sch.get_loops(out_b)
    co, ci = sch.split(cols, [None, tn])
    sch.reorder(t, co, r, ci)
    sch.compute_at(acc_b, co)
    loops = sch.get_loops(acc_b)[2:]  # (rows, [gate/up,] columns, 32-blocks)
    b, rows, mats, cl = loops[-1], loops[0], loops[1:-2], loops[-2]
    sch.reorder(b, rows, *mats, cl)
    sch.compute_at(part_b, mats[-1] if mats else rows)
    sch.compute_at(wdec_b, b)
    pc, pj = sch.get_loops(part_b)[-2:]
    sch.reorder(pj, pc)
    sch.vectorize(pc)
    sch.vectorize(sch.get_loops(wdec_b)[-1])
    sch.vectorize(cl)
    sch.vectorize(ci)
    sch.parallel(sch.fuse(t, co))
    sch.decompose_reduction(part_b, pj)
    sch.decompose_reduction(acc_b, b)


def _schedule_expert_gemm_cpu(sch: s_tir.Schedule, config: MoeSplitConfig, out: str) -> None:
    """The grouped-GEMM schedule (per (tile, column block) task, the weight tile decoded once
    per 32-block and reused by the tile's rows), with the activation rows of each 32-block
    gathered once into a [row_tile, 32] buffer next to the decoded weights (inlined, the
    row_pair/tiles lookups would run in the innermost loop)."""
    _schedule_grouped_gemm_cpu(sch, config.tn, "wdec", "part", "acc", out)
    xg, wdec = sch.get_sblock("xg"), sch.get_sblock("wdec")
    sch.compute_at(xg, sch.get_loops(wdec)[1])  # (tile x column block, 32-block, ...)
    sch.vectorize(sch.get_loops(xg)[-1])


def _schedule_expert_gemv_cpu(sch: s_tir.Schedule, config: MoeSplitConfig, out: str,
                              sums: tuple[str, ...]) -> None:
    """The GEMV form (`make_moe_gate_up_gemv` / `make_moe_down_gemv`). Each dot product in
    `sums` is its own parallel nest over (sorted row, `tn` output columns): per group of `cb`
    columns a `vec`-lane partial sum over the packed bytes (cb independent chains sharing the
    activation loads), the lanes added pairwise (`gemm.vector_sum`). The parity split of the
    activation rows (`xg`) and the epilogue `out` are small nests of their own (one more
    parallel launch each, a few microseconds, against fusing gate and up into one nest)."""
    for name in sums:
        blk = sch.get_sblock(name)
        r, a, j = sch.get_loops(blk)
        ao, ai, ac = sch.split(a, [None, config.tn // config.cb, config.cb])
        jo, *hs = gemm.lane_split(sch, j, config.vec)
        sch.reorder(r, ao, ai, jo, ac, *hs)
        sch.fuse(r, ao)
        main, wbs = gemm.vector_sum(sch, blk, config.vec, config.cb)
        gemm.place_lane_sums(sch, main, wbs, 1, config.vec, config.cb)
        sch.parallel(sch.get_loops(main)[0])
        sch.decompose_reduction(main, sch.get_loops(main)[2])
    xg = sch.get_sblock("xg")
    r, par, j = sch.get_loops(xg)
    sch.vectorize(sch.split(j, [None, 16])[1])
    out_b = sch.get_sblock(out)
    r, a = sch.get_loops(out_b)
    ao, ai = sch.split(a, [None, 16])
    sch.parallel(sch.fuse(r, ao))
    sch.vectorize(ai)


def _finish(sch: s_tir.Schedule) -> tvm.tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def schedule_moe_gemm(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec,
                      out: str) -> tvm.tirx.PrimFunc:
    """Schedules `moe_gate_up` (out="h") or `moe_down` (out="o"). The data-dependent row
    indices of the epilogue defeat s_tir's region-cover checks, so they are off; the tests
    compare with the oracle instead."""
    sch = s_tir.Schedule(func, enable_check=False)
    if target.is_cuda:
        _schedule_expert_gemm_cuda(sch, config, out)
    else:
        _schedule_expert_gemm_cpu(sch, config, out)
    return _finish(sch)


def schedule_moe_gemv(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec,
                      out: str) -> tvm.tirx.PrimFunc:
    """Schedules `moe_gate_up_gemv` (out="h") or `moe_down_gemv` (out="o"), CPU only (CUDA
    decode keeps the tile kernels: `moe_split_config` never picks "gemv" there)."""
    if target.is_cuda:
        raise ValueError("The GEMV form of the routed experts is a CPU schedule; CUDA decode "
                         "uses the tile kernels (moe_split_config).")
    sch = s_tir.Schedule(func, enable_check=False)
    _schedule_expert_gemv_cpu(sch, config, out, ("g", "u") if out == "h" else ("acc",))
    return _finish(sch)


def schedule_moe_route(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                       ) -> tvm.tirx.PrimFunc:
    """Serial everywhere: a single thread of a single CUDA block (n * topk is small)."""
    sch = s_tir.Schedule(func)
    if target.is_cuda:
        (u,) = sch.get_loops(sch.get_sblock("route"))
        bx, tx = sch.split(u, [1, 1])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return _finish(sch)


def _qdq_steps(sch: s_tir.Schedule, config: MoeSplitConfig, target: TargetSpec) -> None:
    """`schedule_moe_qdq`'s steps on the blocks `xq` and `amax` of `sch`."""
    blk, amax = sch.get_sblock("xq"), sch.get_sblock("amax")
    i, j = sch.get_loops(blk)
    jb, jj = sch.split(j, [None, BLOCK])
    sch.compute_at(amax, jb)
    if target.is_cuda:
        sch.set_scope(amax, 0, "local")
        bx, tx = sch.split(sch.fuse(i, jb), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(i)
        sch.vectorize(jj)


def schedule_moe_qdq(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                     ) -> tvm.tirx.PrimFunc:
    """amax computed next to its 32 outputs: CPU parallel rows and vector lanes, CUDA one thread
    per 32-group with the amax in a register."""
    sch = s_tir.Schedule(func)
    _qdq_steps(sch, config, target)
    return _finish(sch)


def _combine_steps(sch: s_tir.Schedule, config: MoeSplitConfig, target: TargetSpec) -> None:
    """`schedule_moe_combine`'s steps on the block `combine` (and `plus`, where the root has
    it) of `sch`."""
    blk = sch.get_sblock("combine")
    plus = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
            if sch.get(b).name_hint == "plus"]
    if plus:
        sch.compute_at(blk, sch.get_loops(plus[0])[1])
        i, d = sch.get_loops(plus[0])
        sch.set_scope(blk, 0, "local")
    else:
        i, d, _ = sch.get_loops(blk)
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, d), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    else:
        sch.parallel(i)


def schedule_moe_combine(func: tvm.tirx.PrimFunc, config: MoeSplitConfig, target: TargetSpec
                         ) -> tvm.tirx.PrimFunc:
    """moe_combine, and moe_combine_plus (its `plus` block computed per output beside the sum:
    one pass, the fp32 sum in a register)."""
    sch = s_tir.Schedule(func, enable_check=False)
    _combine_steps(sch, config, target)
    return _finish(sch)


# ---- the fused prefill calls (CPU) ---------------------------------------------------------


def _check_cpu_tiles(config: MoeSplitConfig, target: TargetSpec) -> None:
    if target.is_cuda or config.kind != "tiles":
        raise ValueError("The fused prefill MoE calls are CPU tile kernels (a CUDA kernel "
                         "cannot allocate their token-sized buffers); got "
                         f"{target.name}, kind {config.kind!r}.")


def schedule_moe_gate_up_route(func: tvm.tirx.PrimFunc, config: MoeSplitConfig,
                               target: TargetSpec) -> tvm.tirx.PrimFunc:
    """`tiles_pair.make_moe_gate_up_route_tiles`: each stage scheduled by the steps of the
    kernel it stands for (the route serial as `schedule_moe_route` leaves it on CPU, then those
    of `schedule_moe_qdq` and `schedule_moe_gemm`, on the same block names), so every stage's
    loops, and every row's additions, are the separate kernels'."""
    _check_cpu_tiles(config, target)
    sch = s_tir.Schedule(func, enable_check=False)
    _qdq_steps(sch, config, target)
    _schedule_expert_gemm_cpu(sch, config, "h")
    return _finish(sch)


def schedule_moe_down_combine(func: tvm.tirx.PrimFunc, config: MoeSplitConfig,
                              target: TargetSpec) -> tvm.tirx.PrimFunc:
    """`tiles_pair.make_moe_down_combine_tiles`: the steps of `schedule_moe_qdq`,
    `schedule_moe_gemm` (out "o") and `schedule_moe_combine` on its blocks, as
    `schedule_moe_gate_up_route` does."""
    _check_cpu_tiles(config, target)
    sch = s_tir.Schedule(func, enable_check=False)
    _qdq_steps(sch, config, target)
    _schedule_expert_gemm_cpu(sch, config, "o")
    _combine_steps(sch, config, target)
    return _finish(sch)
