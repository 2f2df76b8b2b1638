"""The FP8 linear (`fp8_linear`): its GEMM and decode GEMV block definitions, config and
schedules, the builder and example inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import (
    bf16_to_f32,
    e4m3_to_f16_bits,
    e4m3_to_f32,
    e8m0_to_f32,
    f16_bits_to_f32,
    has_amx_bf16,
    has_avx512,
    has_avx512_bf16,
    has_features,
    i64,
)
from dsv41.schedules.common.stages import block_amax
from dsv41.schedules.gemm.amx import amx_block_rows, make_fp8_linear_amx
from dsv41.schedules.gemm.avx2_gemv import MAX_ROWS, make_fp8_gemv_avx2, make_fp8_q_kv_avx2
from dsv41.schedules.gemm.bf16_gemm import make_fp8_gemm_bf16, make_fp8_gemm_bf16_q_kv
from dsv41.schedules.gemm.bf16_gemv import make_fp8_gemv_bf16, make_fp8_gemv_bf16_q_kv
from dsv41.schedules.gemm.fp8 import (
    BLOCK,
    check_out_dtype,
    fp8_qdq,
    padded_rows,
    pow2_scale_byte,
    row_f32,
)
from dsv41.schedules.gemm.lanes import lane_split, place_lane_sums, vector_sum
from dsv41.schedules.norm import norm_config


def make_fp8_linear(*, n: int, k: int, row_pad: int = 1,
                    out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """`fp8_linear(x, weight, scale) -> y`: x bf16 [m, k] (symbolic m; the compiler flattens
    leading dims), weight E4M3 uint8 [n, k], scale E8M0 uint8 [ceil(n/32), k/32], y bf16 [m, n]
    (out_dtype "float32": `fp8_linear_f32`, the sum before its rounding).

    Stages (named sblocks): `amax` + `xq` quantise the activation per 32 (fp32 dequantised value,
    see the module docstring); `wdec` decodes E4M3 weights into a transposed [k, n] layout
    (scheduled into a per-tile buffer, never materialised whole); `part` is the fp32 dot product
    inside one 32-block; `acc` adds the blocks in K order times the weight-tile scale; `y` rounds
    to bf16.

    row_pad > 1 pads the rows of the quantised-activation stages to a multiple of row_pad (padded
    rows read as zero): CUDA tiles them into shared memory, which needs a constant tile size."""
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))

    @T.prim_func(s_tir=True)
    def fp8_linear(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                   scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        amax = T.sblock_alloc_buffer((padded_rows(m, row_pad), KB), "float32")
        xq = T.sblock_alloc_buffer((padded_rows(m, row_pad), K), "float32")
        wdec = T.sblock_alloc_buffer((K, N), "float32")
        part = T.sblock_alloc_buffer((m, N, KB), "float32")
        acc = T.sblock_alloc_buffer((m, N), "float32")
        for i, b, j in T.grid(padded_rows(m, row_pad), KB, i64(BLOCK)):
            with T.sblock("amax"):
                vi, vb, vj = T.axis.remap("SSR", [i, b, j])
                with T.init():
                    amax[vi, vb] = T.min_value("float32")
                amax[vi, vb] = T.max(amax[vi, vb],
                                     T.fabs(row_f32(x, m, row_pad, vi, vb * BLOCK + vj)))
        for i, j in T.grid(padded_rows(m, row_pad), K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                xq[vi, vj] = fp8_qdq(row_f32(x, m, row_pad, vi, vj),
                                     pow2_scale_byte(amax[vi, vj // BLOCK]))
        for j, c in T.grid(K, N):
            with T.sblock("wdec"):
                vj, vc = T.axis.remap("SS", [j, c])
                wdec[vj, vc] = e4m3_to_f32(T.Cast("uint32", weight[vc, vj]))
        for i, c, b, j in T.grid(m, N, KB, i64(BLOCK)):
            with T.sblock("part"):
                vi, vc, vb, vj = T.axis.remap("SSSR", [i, c, b, j])
                with T.init():
                    part[vi, vc, vb] = T.float32(0)
                part[vi, vc, vb] = part[vi, vc, vb] + xq[vi, vb * BLOCK + vj] * wdec[
                    vb * BLOCK + vj, vc]
        for i, c, b in T.grid(m, N, KB):
            with T.sblock("acc"):
                vi, vc, vb = T.axis.remap("SSR", [i, c, b])
                with T.init():
                    acc[vi, vc] = T.float32(0)
                acc[vi, vc] = acc[vi, vc] + part[vi, vc, vb] * e8m0_to_f32(
                    T.Cast("uint32", scale[vc // BLOCK, vb]))
        for i, c in T.grid(m, N):
            with T.sblock("y"):
                vi, vc = T.axis.remap("SS", [i, c])
                y[vi, vc] = T.Cast(out_dtype, acc[vi, vc])

    return fp8_linear


def bf16_value(x, i, j):
    """Element (i, j) of a bf16 matrix as fp32 (the value `block_amax` reads)."""
    return bf16_to_f32(x[i, j])


def make_fp8_gemv(*, n: int, k: int, out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """The CPU decode form of `fp8_linear` (same signature and result): one dot product over the
    whole of K per output, instead of one per 32-block.

    Stages: `amax` + `xq` quantise the activation as in `make_fp8_linear`; `xs` multiplies it by
    the weight scales of one 32-column tile and by 2^8 (xs[i, cb, j] = xq[i, j] *
    2^(s[cb, j/32] - 127) * 2^8: power-of-two products of an exact value, exact while |xs| stays
    below 2^128, i.e. for every activation-times-weight-scale below 2^120); `acc` sums xs times
    the weight decoded as fp16 (`e4m3_to_f16_bits`: the E4M3 value times 2^-8, converted to fp32
    exactly) over all of K, so each product is the exact xq * 2^(s-127) * E4M3(w); `y` rounds to
    bf16. Every product is exact, as in `make_fp8_linear`; only the order of the fp32 additions
    differs from the oracle (K at once rather than block partials times scales), which leaves
    >= 99% of outputs bit-equal and the rest within 1 bf16 ulp. Scheduled (`_schedule_gemv_cpu`),
    the sum runs as `vec` lanes per column in registers, `cb` columns at a time, and the lanes
    are added pairwise at the end; the weight decode is six 16-bit integer operations per 32
    codes plus the fp16 -> fp32 conversion."""
    if k % BLOCK:
        raise ValueError(f"fp8_linear needs k a multiple of {BLOCK}, got {k}.")
    check_out_dtype(out_dtype)
    N, K, KB, NB = i64(n), i64(k), i64(k // BLOCK), i64(math.ceil(n / BLOCK))
    amax_stage = block_amax()  # a fresh macro per kernel (see common.stages)

    @T.prim_func(s_tir=True)
    def fp8_gemv(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                 scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        amax = T.sblock_alloc_buffer((m, KB), "float32")
        xq = T.sblock_alloc_buffer((m, K), "float32")
        xs = T.sblock_alloc_buffer((m, NB, K), "float32")
        acc = T.sblock_alloc_buffer((m, N), "float32")
        amax_stage(amax, x, m, KB, BLOCK, bf16_value)
        for i, j in T.grid(m, K):
            with T.sblock("xq"):
                vi, vj = T.axis.remap("SS", [i, j])
                xq[vi, vj] = fp8_qdq(bf16_to_f32(x[vi, vj]), pow2_scale_byte(amax[vi, vj // BLOCK]))
        for i, cb, j in T.grid(m, NB, K):
            with T.sblock("xs"):
                vi, vcb, vj = T.axis.remap("SSS", [i, cb, j])
                xs[vi, vcb, vj] = xq[vi, vj] * e8m0_to_f32(
                    T.Cast("uint32", scale[vcb, vj // BLOCK])) * T.float32(256.0)
        for i, c, j in T.grid(m, N, K):
            with T.sblock("acc"):
                vi, vc, vj = T.axis.remap("SSR", [i, c, j])
                with T.init():
                    acc[vi, vc] = T.float32(0)
                acc[vi, vc] = acc[vi, vc] + xs[vi, vc // BLOCK, vj] * f16_bits_to_f32(
                    e4m3_to_f16_bits(weight[vc, vj]))
        for i, c in T.grid(m, N):
            with T.sblock("y"):
                vi, vc = T.axis.remap("SS", [i, c])
                y[vi, vc] = T.Cast(out_dtype, acc[vi, vc])

    return fp8_gemv


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Tiling of `fp8_linear`. kind: "gemv" (decode: one row; on CPU `make_fp8_gemv`, a dot
    product over all of K in `vec` lanes per output, weights decoded in registers), "gemv_avx2"
    (the CPU decode on x86 with AVX2 and no AVX-512: `make_fp8_gemv_avx2`, written scheduled,
    no parameters), "gemv_avx512" (its 512-bit form, `prefetch` columns ahead; dot "bf16":
    `make_fp8_gemv_bf16`, the sums on vdpbf16ps), "gemm"
    (weight tile decoded once into a transposed [32, tn] buffer and reused by tm rows, vectorised
    over N), "amx" (CPUs with AMX-BF16: `make_fp8_linear_amx`, tm rows per block) or "gemm_bf16"
    (CPUs with AVX-512 BF16 and no AMX: `make_fp8_gemm_bf16`, tm rows per block, written
    scheduled).
    CPU gemm: tn output columns per parallel task, tm rows per tile, rb rows held in registers.
    CUDA gemv: one warp per output column (lanes over the 32-block), `warps` per thread block.
    CUDA gemm: a (tm x tn) tile per thread block, (tm/rb) x (tn/cb) threads, each an rb x cb
    register tile; the activation and decoded weight tiles of one 32-block in shared memory."""

    kind: str
    tn: int = 32
    tm: int = 32
    rb: int = 4
    cb: int = 1  # CUDA gemm: register columns per thread; CPU gemv: columns summed together
    warps: int = 8
    vec: int = 16
    row_pad: int = 1  # make_fp8_linear(row_pad=): CUDA gemm pads the activation rows to tm
    prefetch: int = 0  # gemv_avx512: columns ahead whose weights are prefetched
    rows: int = 1  # gemv_avx2 / gemv_avx512: rows per group of the verify form (1: decode's)
    dot: str = "fp32"  # gemv_avx512: "bf16" for make_fp8_gemv_bf16 (AVX-512 BF16 + VBMI)
    fma_rows: bool = False  # dot "bf16": verify groups by FMA pairs (make_fp8_gemv_bf16)

    @property
    def prescheduled(self) -> bool:
        """Whether the kind's factory writes its own loops (no schedule, nothing to tune)."""
        return self.kind in ("amx", "gemm_bf16", "gemv_avx2", "gemv_avx512")


# Rows per group of the verify form of the hand GEMV: all of the verify entry's (up to the
# kernel's MAX_ROWS). Measured on one core of an AMD EPYC (Zen 4, AVX-512; 2 cores shared with
# other jobs, load 5-6), weights cycled through 64 MB (read from memory), fastest of 40 calls,
# groups of 1 (decode's kernel over the rows) / 3 / 6: n 4096 k 1024 m 5 1.85 / 1.62 / 1.36 ms,
# m 6 2.18 / 1.79 / 1.55 (one row alone 0.38); n 2048 k 2048 m 5 1.72 / 1.55 / 1.33; n 32768
# k 512 m 5 8.06 / 6.98 / 5.91, m 6 9.63 / 7.75 / 6.72 (one row 1.71).
VERIFY_GROUP_ROWS = MAX_ROWS


def fp8_linear_config(target: TargetSpec, *, n: int, k: int, m: int | None = None,
                      rows: int = 1) -> Fp8LinearConfig:
    """m is a hint for the row count this build will mostly see (None: prefill, large). rows
    > 1: the verify entry's calls (m = 1 hint, up to `rows` rows per sequence): the hand GEMV
    kinds take their rows in groups that share each weight load (bit-identical per row to
    decode's); the other kinds run decode's kernel unchanged."""
    if target.is_cuda:
        if m is not None and m <= 4:
            return Fp8LinearConfig("gemv", warps=8)
        return Fp8LinearConfig("gemm", tn=64, tm=64, rb=4, cb=4, row_pad=64)
    if m is not None and m <= 1:
        group = min(rows, VERIFY_GROUP_ROWS)
        if has_features(target, "avx2", "fma", "f16c") and not has_avx512(target):
            return Fp8LinearConfig("gemv_avx2", rows=group)  # measurements: make_fp8_gemv_avx2
        # From memory (weights cycled through more than the L3), 2 threads of a Xeon with
        # AVX-512: up to K 2048 the hand-vectorised kernel one column at a time, prefetching
        # ~8 KB ahead (n 32768 k 512 0.83-0.87 ms, n 1024 k 512 0.030, n 5120 k 1536 0.45,
        # against 1.00-1.24, 0.050 and 0.70 scheduled with cb 1, 1.60, 0.045 and 0.76 with
        # cb 4); above, the scheduled one with 4 columns summed together, 4 streams of a
        # 4 KB row each (n 1024 k 4096 0.196 ms against 0.237 hand-vectorised, 0.367 cb 1).
        # The scheduled kernel at K 512 is one 2 KB stretch read out of order with cb 4: cb 1.
        # With AVX-512 BF16 (and VBMI's byte lookups), every K: the weights looked up as bf16
        # and summed by vdpbf16ps, 32 products per instruction (`make_fp8_gemv_bf16`; one
        # 2-core Zen 4 shared with other jobs, min of 200 calls, weights cycled through 64 MB:
        # see the module docstring).
        # With AMX (Intel, whose vdpbf16ps issues at a quarter of its FMA rate) the verify's
        # groups sum by FMA pairs, bit for bit the same (`make_fp8_gemv_bf16`'s fma_rows).
        if k % 64 == 0 and has_avx512_bf16(target) and has_features(target, "avx512vbmi"):
            return Fp8LinearConfig("gemv_avx512", prefetch=max(2, 8192 // k), rows=group,
                                   dot="bf16", fma_rows=group > 1 and has_amx_bf16(target))
        if k <= 2048 and k % 64 == 0 and has_features(target, "avx512bw", "fma", "f16c"):
            return Fp8LinearConfig("gemv_avx512", prefetch=max(2, 8192 // k), rows=group)
        return Fp8LinearConfig("gemv", tn=BLOCK, cb=1 if k <= 1024 else 4, vec=32)
    if m is not None and m <= 4:
        return Fp8LinearConfig("gemm", tn=32, tm=4, rb=4)
    if n % BLOCK == 0 and has_amx_bf16(target):
        return Fp8LinearConfig("amx", tm=amx_block_rows(k))
    # AVX-512 BF16 without AMX: vdpbf16ps with 16 rows in the lanes (`make_fp8_gemm_bf16`).
    # m 2048 on a 2-core Zen 4 shared with other jobs (load 3), min of 3, against the "gemm"
    # kind below in the same run: n 32768 k 512 702-786 ms (1327-1979), n 1024 k 4096 235 (637),
    # n 512 k 1024 35 (65); m 128, n 32768 k 512: 38-73 (99-172). Row blocks of 512 were the
    # fastest of 128 / 256 / 512 at m 2048 (each tile's weight decode serves more rows).
    if k % (2 * BLOCK) == 0 and has_avx512_bf16(target):
        return Fp8LinearConfig("gemm_bf16", tm=512)
    # tm 256: each decoded [32, tn] weight tile serves 256 rows (m 512, n 32768, k 512 on 2
    # loaded cores: 384-425 ms against 706-728 ms at tm 32; tm 512: 331-383 ms). The sum order
    # per output does not depend on the tiling, so results are the same bits.
    return Fp8LinearConfig("gemm", tn=32, tm=256, rb=4)


def _schedule_act_quant_stage(sch: s_tir.Schedule, target: TargetSpec, amax: str, out: str,
                              *, parallel: bool = True) -> None:
    """The per-32 amax + quantise stage: amax computed per group next to its 32 outputs;
    CPU parallel over rows (serial with parallel=False: the decode GEMV's one row is a few
    hundred vector operations, less than waking the thread pool), CUDA one thread per 32-group."""
    blk = sch.get_sblock(out)
    i, j = sch.get_loops(blk)[-2:]
    jb, jj = sch.split(j, [None, BLOCK])
    sch.compute_at(sch.get_sblock(amax), jb)
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, jb), [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        return
    if parallel:
        sch.parallel(i)
    sch.vectorize(jj)


def schedule_fp8_linear(func: tvm.tirx.PrimFunc, config: Fp8LinearConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """`func` is `unscheduled_fp8_linear`'s: `make_fp8_gemv` for a CPU gemv, else
    `make_fp8_linear`, or `make_fp8_linear_amx` / `make_fp8_gemv_avx2`, which are written
    scheduled (returned as is)."""
    if config.prescheduled:
        return func
    sch = s_tir.Schedule(func)
    if not target.is_cuda:
        _schedule_act_quant_stage(sch, target, "amax", "xq", parallel=config.kind != "gemv")
    if config.kind == "gemv" and target.is_cuda:
        _schedule_gemv_cuda(sch, config)
    elif config.kind == "gemv":
        _schedule_gemv_cpu(sch, config)
    else:
        _schedule_gemm(sch, config, target)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_gemv_cpu(sch: s_tir.Schedule, config: Fp8LinearConfig) -> None:
    """`make_fp8_gemv`: parallel over 32-column tiles; per tile and row the scaled activation
    `xs` (K floats, in L1), then per group of `cb` columns a `vec`-lane partial sum over K per
    column held in registers (cb independent chains that share the xs loads), and the lanes
    added pairwise (`vector_sum`)."""
    acc = sch.get_sblock("acc")
    i, c, j = sch.get_loops(acc)
    cb, co, cc = sch.split(c, [None, BLOCK // config.cb, config.cb])
    jo, *hs = lane_split(sch, j, config.vec)
    sch.reorder(cb, i, co, jo, cc, *hs)
    main, wbs = vector_sum(sch, acc, config.vec, config.cb)
    place_lane_sums(sch, main, wbs, 2, config.vec, config.cb)
    sch.reverse_compute_at(sch.get_sblock("y"), sch.get_loops(main)[1])
    xs = sch.get_sblock("xs")
    sch.compute_at(xs, sch.get_loops(main)[1])
    sch.vectorize(sch.split(sch.get_loops(xs)[-1], [None, 16])[1])
    sch.parallel(sch.get_loops(main)[0])
    sch.decompose_reduction(main, sch.get_loops(main)[3])


def _schedule_gemv_cuda(sch: s_tir.Schedule, config: Fp8LinearConfig) -> None:
    """One warp per output column; the E4M3 decode inlined into the 32-block dot product."""
    sch.compute_inline(sch.get_sblock("wdec"))
    part, acc = sch.get_sblock("part"), sch.get_sblock("acc")
    i, c, b = sch.get_loops(acc)
    co, cw = sch.split(c, [None, config.warps])
    sch.reorder(co, cw, i, b)
    sch.bind(co, "blockIdx.x")
    sch.bind(cw, "threadIdx.y")
    sch.reverse_compute_at(sch.get_sblock("y"), i)
    # The activation quantisation is fused: each warp quantises its 32-group in registers
    # (amax by a warp allreduce), since a CUDA kernel cannot allocate the [m, k] buffer.
    sch.compute_inline(sch.get_sblock("xq"))
    sch.compute_at(part, b)
    amax = sch.get_sblock("amax")
    sch.compute_at(amax, b)
    for blk in (amax, part):
        sch.bind(sch.get_loops(blk)[-1], "threadIdx.x")  # warp allreduce over the block
        sch.set_scope(blk, 0, "local")
    sch.set_scope(acc, 0, "local")


def _schedule_gemm(sch: s_tir.Schedule, config: Fp8LinearConfig, target: TargetSpec) -> None:
    """Per 32-block: decode a [32, tn] weight tile once, then rows x columns register tiles."""
    part, acc, wdec = sch.get_sblock("part"), sch.get_sblock("acc"), sch.get_sblock("wdec")
    i, c, b = sch.get_loops(acc)
    if target.is_cuda:
        bx, tx, cn = sch.split(c, [None, config.tn // config.cb, config.cb])
        by, ty, mr = sch.split(i, [None, config.tm // config.rb, config.rb])
        sch.reorder(bx, by, ty, tx, b, mr, cn)
        sch.bind(bx, "blockIdx.x")
        sch.bind(by, "blockIdx.y")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.reverse_compute_at(sch.get_sblock("y"), tx)
        sch.compute_at(part, b)
        sch.set_scope(part, 0, "local")
        sch.set_scope(acc, 0, "local")
        pm, pc, pj = sch.get_loops(part)[-3:]
        sch.reorder(pj, pm, pc)
        # The activation quantisation is fused as a prologue: per 32-block, the block's rows are
        # quantised into shared memory (a CUDA kernel cannot allocate the [m, k] buffer).
        xq, amax = sch.get_sblock("xq"), sch.get_sblock("amax")
        amax_out = sch.cache_write(amax, 0, "local")  # reduce in a register, then publish
        threads = [config.tm // config.rb, config.tn // config.cb]
        for stage in (xq, wdec, amax_out):
            sch.set_scope(stage, 0, "shared")
            sch.compute_at(stage, b)
            loops = sch.get_loops(stage)[5:]  # below (bx, by, ty, tx, b)
            if stage == amax_out:  # one thread per row
                loops = loops[:1]
            _, sty, stx = sch.split(sch.fuse(*loops), [None, *threads])
            sch.bind(sty, "threadIdx.y")
            sch.bind(stx, "threadIdx.x")
        sch.compute_at(amax, sch.get_loops(amax_out)[-1])
        sch.unroll(pm)
        sch.unroll(pc)
        sch.decompose_reduction(part, pj)
        sch.decompose_reduction(acc, b)
        return
    co, ci = sch.split(c, [None, config.tn])
    io, ii = sch.split(i, [None, config.tm])
    rb = min(config.rb, config.tm)
    iio, iii = sch.split(ii, [None, rb])
    sch.reorder(co, io, b, iio, iii, ci)
    sch.reverse_compute_at(sch.get_sblock("y"), io)
    sch.compute_at(part, iio)
    sch.compute_at(wdec, b)
    pm, pc, pj = sch.get_loops(part)[-3:]
    sch.reorder(pj, pm, pc)
    sch.vectorize(pc)
    sch.unroll(pm)
    sch.unroll(pj)
    sch.vectorize(sch.get_loops(wdec)[-1])
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.parallel(co)
    sch.decompose_reduction(part, pj)
    sch.decompose_reduction(acc, b)


def fp8_linear_norms(target: TargetSpec, *, n: int, k: int, m: int | None = None,
                     rows: int = 1) -> bool:
    """Whether this target's fp8_linear kernel can RMS-norm its input first (`norm_eps`), pair
    two matrices (`pair_n`) or form a SwiGLU input (`swiglu_limit`): the decode GEMVs written
    by hand (`make_fp8_gemv_bf16`, `make_fp8_gemv_avx2`) and the AVX-512 BF16 prefill GEMM
    (`make_fp8_gemm_bf16`); elsewhere the lowering runs the rms_norm kernel (two kernels, the
    SwiGLU's elementwise ops) before it."""
    config = fp8_linear_config(target, n=n, k=k, m=m, rows=rows)
    return config.kind in ("gemv_avx2", "gemv_avx512", "gemm_bf16")


def unscheduled_fp8_linear(target: TargetSpec, *, n: int, k: int, m: int | None = None,
                           out_dtype: str = "bfloat16", rows: int = 1,
                           norm_eps: float | None = None, pair_n: int | None = None,
                           swiglu_limit: float | None = None
                           ) -> tuple[tvm.tirx.PrimFunc, Fp8LinearConfig]:
    """The factory output the config's schedule expects, and the config. norm_eps: the
    `norm_fp8_linear` form, pair_n `fp8_linear_pair`'s, swiglu_limit `swiglu_fp8_linear`'s
    (each where `fp8_linear_norms`; refused elsewhere)."""
    config = fp8_linear_config(target, n=n, k=k, m=m, rows=rows)
    fused = (norm_eps, pair_n, swiglu_limit)
    if any(v is not None for v in fused) and not fp8_linear_norms(target, n=n, k=k, m=m,
                                                                   rows=rows):
        raise ValueError(f"fp8_linear norms its input (or pairs two matrices, or forms a "
                         f"SwiGLU) only in the hand decode GEMVs and the AVX-512 BF16 prefill "
                         f"GEMM; this target's kernel is {config.kind!r} (run rms_norm before "
                         f"it, or two kernels).")
    if config.kind == "amx":
        return make_fp8_linear_amx(n=n, k=k, block_rows=config.tm, out_dtype=out_dtype), config
    if config.kind == "gemm_bf16":
        return make_fp8_gemm_bf16(n=n, k=k, out_dtype=out_dtype, row_block=config.tm,
                                  norm_eps=norm_eps, norm_lanes=norm_config(target, d=k).lanes,
                                  pair_n=pair_n, swiglu_limit=swiglu_limit), config
    hand = dict(norm_eps=norm_eps, norm_lanes=norm_config(target, d=k).lanes, pair_n=pair_n,
                swiglu_limit=swiglu_limit)
    if config.kind == "gemv_avx2":
        return make_fp8_gemv_avx2(n=n, k=k, out_dtype=out_dtype, rows=config.rows,
                                  **hand), config
    if config.kind == "gemv_avx512" and config.dot == "bf16":
        return make_fp8_gemv_bf16(n=n, k=k, out_dtype=out_dtype, prefetch=config.prefetch,
                                  rows=config.rows, fma_rows=config.fma_rows,
                                  norm_eps=norm_eps, norm_lanes=norm_config(target, d=k).lanes,
                                  pair_n=pair_n, swiglu_limit=swiglu_limit), config
    if config.kind == "gemv_avx512":
        return make_fp8_gemv_avx2(n=n, k=k, out_dtype=out_dtype, lanes=16,
                                  prefetch=config.prefetch, rows=config.rows, **hand), config
    if config.kind == "gemv" and not target.is_cuda:
        return make_fp8_gemv(n=n, k=k, out_dtype=out_dtype), config
    return make_fp8_linear(n=n, k=k, row_pad=config.row_pad, out_dtype=out_dtype), config


def build_fp8_linear(target_name: str, *, n: int, k: int, m: int | None = None,
                     out_dtype: str = "bfloat16", rows: int = 1,
                     norm_eps: float | None = None, pair_n: int | None = None,
                     swiglu_limit: float | None = None) -> tvm.tirx.PrimFunc:
    """fp8_linear's kernel (out_dtype "float32": fp8_linear_f32's, the same schedule); rows > 1:
    the verify entry's (`fp8_linear_config`); norm_eps: norm_fp8_linear's, pair_n:
    fp8_linear_pair's, swiglu_limit: swiglu_fp8_linear's (each where `fp8_linear_norms`)."""
    target = get_target(target_name)
    func, config = unscheduled_fp8_linear(target, n=n, k=k, m=m, out_dtype=out_dtype, rows=rows,
                                          norm_eps=norm_eps, pair_n=pair_n,
                                          swiglu_limit=swiglu_limit)
    return schedule_fp8_linear(func, config, target)


def fp8_q_kv_fuses(target: TargetSpec, *, n_q: int, n_kv: int, k: int, n_b: int,
                   m: int | None = None, rows: int = 1) -> bool:
    """Whether this target runs `fp8_q_kv` as one kernel (`make_fp8_gemv_bf16_q_kv` in decode,
    `make_fp8_gemm_bf16_q_kv` in prefill, `make_fp8_q_kv_avx2` in decode without AVX-512
    BF16): where its fp8_linear pairs (wq_a and wkv over k) and norms (wq_b over n_q), all
    three of one kind of kernel (the same dot)."""
    configs = [fp8_linear_config(target, n=n, k=kk, m=m, rows=rows)
               for n, kk in ((n_q, k), (n_kv, k), (n_b, n_q))]
    return (len({(c.kind, c.dot) for c in configs}) == 1
            and all(fp8_linear_norms(target, n=n, k=kk, m=m, rows=rows)
                    for n, kk in ((n_q, k), (n_kv, k), (n_b, n_q))))


def build_fp8_q_kv(target_name: str, *, n_q: int, n_kv: int, k: int, n_b: int,
                   norm_eps: float, m: int | None = None, rows: int = 1) -> tvm.tirx.PrimFunc:
    """`fp8_q_kv`'s one kernel where `fp8_q_kv_fuses`, each GEMV with the config its own kernel
    would have (the pair's of (n_q, k), wq_b's of (n_b, n_q)); refused elsewhere."""
    target = get_target(target_name)
    if not fp8_q_kv_fuses(target, n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, m=m, rows=rows):
        raise ValueError("fp8_q_kv is one kernel only where the hand decode GEMV or the "
                         "AVX-512 BF16 prefill GEMM pairs and norms (gemm.fp8_q_kv_fuses); "
                         "emit its two kernels.")
    a = fp8_linear_config(target, n=n_q, k=k, m=m, rows=rows)
    b = fp8_linear_config(target, n=n_b, k=n_q, m=m, rows=rows)
    if a.kind in ("gemv_avx2", "gemv_avx512") and a.dot != "bf16":
        return make_fp8_q_kv_avx2(n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=norm_eps,
                                  norm_lanes=norm_config(target, d=n_q).lanes,
                                  lanes=8 if a.kind == "gemv_avx2" else 16, rows=a.rows,
                                  prefetch=a.prefetch, b_prefetch=b.prefetch)
    if a.kind == "gemm_bf16":
        return make_fp8_gemm_bf16_q_kv(n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=norm_eps,
                                       norm_lanes=norm_config(target, d=n_q).lanes,
                                       row_block=a.tm, b_row_block=b.tm)
    return make_fp8_gemv_bf16_q_kv(n_q=n_q, n_kv=n_kv, k=k, n_b=n_b, norm_eps=norm_eps,
                                   norm_lanes=norm_config(target, d=n_q).lanes, rows=a.rows,
                                   prefetch=a.prefetch, fma_rows=a.fma_rows,
                                   b_prefetch=b.prefetch, b_fma_rows=b.fma_rows)


# ---- example inputs for benchmarks ----------------------------------------------------------


def example_inputs_fp8_linear(*, m: int, n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    """[x bf16 [m, k], weight E4M3 [n, k], scale E8M0 [ceil(n/32), k/32]]: a weight quantised
    from a Gaussian with the checkpoint's 32x32 tile rule, activations ~N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    weight, scale = fmt.torch_quant_fp8_weight(torch.randn(n, k, generator=g) * k**-0.5)
    return [x, weight, scale]
