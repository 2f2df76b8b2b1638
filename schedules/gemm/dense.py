"""Dense (unquantised) grouped GEMV and GEMM: block definitions, configs, schedules, builders."""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.checkpoint.spec import FP8_TILE
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import (
    bf16_to_f32,
    e4m3_to_f32_select,
    e4m3_words,
    e8m0_byte,
    has_amx_bf16,
    has_avx512_bf16,
    has_features,
    i64,
)
from dsv41.schedules.common.stages import padded_row_groups
from dsv41.schedules.gemm.amx import amx_block_rows, make_dense_gemm_amx
from dsv41.schedules.gemm.avx2_gemv import MAX_ROWS, make_fp8_gemv_avx2
from dsv41.schedules.gemm.bf16_gemm import make_dense_gemm_bf16
from dsv41.schedules.gemm.dense_dot import (
    DOT_K,
    DOT_LANES,
    dot_columns,
    fp8_tile_grid,
    make_dense_gemv_bf16_dot,
)
from dsv41.schedules.gemm.fp8 import BLOCK
from dsv41.schedules.gemm.lanes import lane_split, place_lane_sums, vector_sum

# ---- dense GEMV (bf16 / fp32 weights, decode) ------------------------------------------------


def _load_f32(buf, *idx):
    return bf16_to_f32(buf[idx]) if buf.dtype == "bfloat16" else buf[idx]


FP8_WEIGHT = "fp8"  # a dense GEMV's w_dtype for E4M3 codes with E8M0 scales per 32 x 32 tile


def _check_fp8_k(k: int) -> None:
    if k % FP8_TILE:
        raise ValueError(f"dense_gemv over an FP8 weight needs k a multiple of {FP8_TILE}, "
                         f"got {k}.")


def fp8_tile_f32(w, sc, row, j):
    """The value of FP8 weight element (row, j) as fp32: its E4M3 code times its 32 x 32 tile's
    E8M0 scale, exact (the value `checkpoint.fp8_tiles.dequantize_fp8_tiles` rounds to a bf16
    that holds it exactly while the scale byte is in `fp8_tiles.EXACT_SCALE_BYTES`)."""
    return e4m3_to_f32_select(T.Cast("uint32", w[row, j])) * e8m0_byte(
        sc[row // i64(FP8_TILE), j // i64(FP8_TILE)])


def _transposed(wdec, g, c, j):  # dense_gemm's widened weight tile is [g, k, n]
    return wdec[g, j, c]


def _check_dense_dtypes(kernel: str, *dtypes: str) -> None:
    for dt in dtypes:
        if dt not in ("bfloat16", "float32"):
            raise ValueError(f"{kernel} reads bfloat16 or float32, got {dt}.")


def make_dense_gemv(*, groups: int, n: int, k: int, x_dtype: str, w_dtype: str
                    ) -> tvm.tirx.PrimFunc:
    """y[i, g, c] = sum_j fp32(x[i, g, j]) * fp32(w[g * n + c, j]), y fp32: the decode form of the
    plain linears (groups=1: the head, the compressor, the gate) and of the grouped o-projection
    einsum `bsgd,grd->bsgr`. x and w are read in their stored dtype (bf16 or fp32) and widened in
    registers; w is the checkpoint's 2-D [groups * n, k] tensor as stored. The weight is never
    copied (transposed, cast or reshaped) as a whole, which the generic lowering did on every
    call. Symbolic rows i; the caller rounds y to bf16 where torch does.

    Products of two bf16/fp32 values are rounded once in fp32 as in torch; the sum over K runs in
    `vec` lanes and a final horizontal add (torch's order is its own), so results agree with the
    oracle to fp32 rounding, not bit for bit."""
    G, N, K = i64(groups), i64(n), i64(k)

    @T.macro
    def sums(x, y, w, wval):
        """y[i, g, c] = sum over j of fp32 x[i, g, j] times wval(w, g * N + c, j)."""
        for i, g, c, j in T.grid(x.shape[0], G, N, K):
            with T.sblock("y"):
                vi, vg, vc, vj = T.axis.remap("SSSR", [i, g, c, j])
                with T.init():
                    y[vi, vg, vc] = T.float32(0)
                y[vi, vg, vc] = y[vi, vg, vc] + _load_f32(x, vi, vg, vj) * wval(
                    w, vg * N + vc, vj)

    if w_dtype == FP8_WEIGHT:
        _check_dense_dtypes("dense_gemv", x_dtype)
        _check_fp8_k(k)

        def fp8_value(w_sc, row, j):  # w_sc: (codes, tile scales)
            return fp8_tile_f32(w_sc[0], w_sc[1], row, j)

        @T.prim_func(s_tir=True)
        def dense_gemv_fp8(x_h: T.handle, w: T.Buffer((G * N, K), "uint8"),
                           sc: T.Buffer(fp8_tile_grid(G * N, K), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, G, K), x_dtype)
            y = T.match_buffer(y_h, (m, G, N), "float32")
            sums(x, y, (w, sc), fp8_value)

        return dense_gemv_fp8
    _check_dense_dtypes("dense_gemv", x_dtype, w_dtype)

    @T.prim_func(s_tir=True)
    def dense_gemv(x_h: T.handle, w: T.Buffer((G * N, K), w_dtype), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), x_dtype)
        y = T.match_buffer(y_h, (m, G, N), "float32")
        sums(x, y, w, _load_f32)

    return dense_gemv


def make_dense_gemv_rows(*, groups: int, n: int, k: int, x_dtype: str, w_dtype: str,
                         rows: int) -> tvm.tirx.PrimFunc:
    """`make_dense_gemv` (same signature and buffers) for calls of a few rows per sequence (the
    verify entry's 1 + k, the draft's block): the rows in groups of `rows` (static), each group
    reading every weight once for all its rows (`schedule_dense_gemv`), each row summed exactly
    as the single-row kernel sums it (the same lanes and pairwise tree: bit-identical per row).
    The last group reads the last row again for its missing rows (no loop carries a predicate);
    `acc` holds whole groups, `y` takes the m real rows."""
    if rows < 2:
        raise ValueError(f"make_dense_gemv_rows groups rows: rows >= 2, got {rows}.")
    G, N, K, R = i64(groups), i64(n), i64(k), i64(rows)
    row_groups = padded_row_groups()
    if w_dtype == FP8_WEIGHT:
        _check_dense_dtypes("dense_gemv", x_dtype)
        _check_fp8_k(k)

        def wval_fp8(w_sc, g, c, j):  # w_sc: (codes, tile scales)
            return fp8_tile_f32(w_sc[0], w_sc[1], g * N + c, j)

        @T.prim_func(s_tir=True)
        def dense_gemv_fp8(x_h: T.handle, w: T.Buffer((G * N, K), "uint8"),
                           sc: T.Buffer(fp8_tile_grid(G * N, K), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, G, K), x_dtype)
            y = T.match_buffer(y_h, (m, G, N), "float32")
            acc = T.sblock_alloc_buffer(((m + R - i64(1)) // R * R, G, N), "float32")
            row_groups(acc, y, x, (w, sc), m, G, N, K, R, _load_f32, wval_fp8)

        return dense_gemv_fp8
    _check_dense_dtypes("dense_gemv", x_dtype, w_dtype)

    def wval(w, g, c, j):
        return _load_f32(w, g * N + c, j)

    @T.prim_func(s_tir=True)
    def dense_gemv(x_h: T.handle, w: T.Buffer((G * N, K), w_dtype), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), x_dtype)
        y = T.match_buffer(y_h, (m, G, N), "float32")
        acc = T.sblock_alloc_buffer(((m + R - i64(1)) // R * R, G, N), "float32")
        row_groups(acc, y, x, w, m, G, N, K, R, _load_f32, wval)

    return dense_gemv


@dataclass(frozen=True)
class DenseGemvConfig:
    """tn output columns per parallel task; cb columns summed together (independent register
    chains sharing the activation loads); vec lanes of each column's K partial sums (CPU);
    rows > 1: `make_dense_gemv_rows`' group (its rows share each weight load). kind "lanes":
    the scheduled fp32 FMA form (`make_dense_gemv`, `make_dense_gemv_rows`); "bf16_dot": bf16
    x and w on AVX-512 BF16 (`make_dense_gemv_bf16_dot`, written scheduled, vec 16); "fma":
    bf16 x and a bf16 or FP8 w on x86 with AVX2 (+ FMA, F16C) and no bf16_dot form
    (`avx2_gemv.make_fp8_gemv_avx2`'s dense form, written scheduled: vec fp32 lanes per vector,
    8 for AVX2, 16 with AVX-512 BW; `prefetch` columns ahead; rows up to its MAX_ROWS)."""

    tn: int = 32
    cb: int = 4
    vec: int = 32
    rows: int = 1
    kind: str = "lanes"
    fma_rows: bool = False  # bf16_dot: groups of 2+ rows by FMA pairs (`dpbf16ps_by_fma`)
    prefetch: int = 0  # bf16_dot: column groups ahead whose weights are prefetched; fma: columns


def _lanes(k: int, most: int) -> int:
    """The largest power of two <= most that divides k (a lane count that needs no tail)."""
    lanes = most
    while k % lanes:
        lanes //= 2
    return lanes


# Measured at 64K on the bench preset (AMD EPYC Zen 4, AVX-512, 2 threads, quiet): the grouped
# o-projection (g 8, n 512, k 4096) of a verify of 1 + 4 rows took 88.6 ms over 40 layers as the
# single-row kernel over the rows (the weights re-read from L2 and widened again per row),
# against 37.6 ms for one row.
# bf16_dot against the fp32 lanes form, the same o-projection, weights cycled through 3 copies
# (from memory), min of 240 calls interleaved, 2 threads on 2 cores loaded by other jobs (load
# average 8): one row 1.68 ms (lanes 2.00), 5 rows in a group of 6 2.45 ms (lanes 3.63); cb 2
# or 1 for the group of 6 ran slower (2.92, 4.47), a software prefetch of the weights (the
# same column 4 to 32 chunks ahead, or the next column group) 15-40% slower, a group of 5
# instead of 6 for 5 rows the same (the padded row costs nothing measurable).
# Re-measured (same harness, 2 threads, 2 cores shared with 3 other jobs, min of 150+ calls,
# interleaved): one row cb 4 0.78-0.83 ms, cb 8 0.70-0.72, cb 16 0.68 (cb 8 taken: the same
# gain in 8 registers); 5 rows in a group of 6 cb 4 1.11-1.28 ms, 5 rows cb 4 1.18-1.29, 5
# rows cb 8 (40 accumulators, spilled) 1.15, 6 rows cb 8 1.30, 3 rows cb 8 (two groups)
# 1.43; a weight prefetch of the next column group 1.21-1.25; the group's activations
# staged interleaved (against L1 set conflicts: every x and w line of a chunk is a multiple
# of 4 KB apart) 1.18-1.22; K split in blocks of 1024 or 2048 (x in L1) 1.22-1.25.
def dense_gemv_config(target: TargetSpec, *, n: int, k: int, rows: int = 1,
                      x_dtype: str | None = None, w_dtype: str | None = None
                      ) -> DenseGemvConfig:
    if target.is_cuda:
        raise ValueError("dense_gemv has no CUDA schedule: CUDA builds keep the generic "
                         "(dlight-scheduled) lowering of the dense linears.")
    tn = min(32, n)
    fp8_dot = (w_dtype == FP8_WEIGHT and k % e4m3_words.CODES == 0
               and has_features(target, "avx512vbmi"))  # the E4M3 words' vpermi2b
    if (x_dtype == "bfloat16" and (w_dtype == "bfloat16" or fp8_dot) and k % DOT_K == 0
            and has_avx512_bf16(target)):
        # one row: 8 columns, 8 weight streams in flight (4: 0.78-0.83 ms, 8: 0.70-0.72).
        # With AMX (Intel: vdpbf16ps at a quarter of the FMA rate) a verify's groups by FMA
        # pairs: Xeon model 207, 2 threads, the o-projection's weights cycled through 4
        # copies, 5 rows, min of 60 interleaved calls: vdpbf16ps cb 4 1.87 ms, FMA pairs cb 1
        # / 2 / 4 / 8 3.18 / 1.78 / 1.30 / 2.99 (one row 1.05-1.11).
        # A prefetch of the next column group's weights beside each chunk's loads (one line
        # per column; the group's rows read as 8 or 4 streams of 8 KB, which the hardware
        # prefetcher restarts at every 4 KB page): the o-projection's weights cycled through
        # 600 MB, median of 200 interleaved calls on the Xeon above, one row 1.591 -> 1.515 ms
        # (min 1.480 -> 1.351), 5 rows 1.911 -> 1.798; 2 groups ahead the same as 1.
        # One-row groups over an FP8 weight scale x per task instead of every decoded word
        # (`XSCALE`; the same bits): the o-projection (n 512 x 8 groups, k 4096) on a Zen 4,
        # 2 threads, interleaved min / median of 80 calls, weights cycled through 7 copies:
        # 0.581 / 0.621 -> 0.517 / 0.564 ms; from the cache (2 x 256 columns) 32 -> 43-55 GB/s.
        return DenseGemvConfig(tn=tn, cb=dot_columns(tn, rows, fp8_dot and w_dtype == FP8_WEIGHT),
                               vec=DOT_LANES, rows=rows,
                               kind="bf16_dot", fma_rows=rows > 1 and has_amx_bf16(target),
                               prefetch=1)
    fma_lanes = 16 if has_features(target, "avx512bw") else 8
    if (x_dtype == "bfloat16" and w_dtype in ("bfloat16", FP8_WEIGHT) and n % BLOCK == 0
            and k % (4 * fma_lanes) == 0 and rows <= MAX_ROWS
            and has_features(target, "avx2", "fma", "f16c")):
        # the FP8 o-projection on AVX2 (bench preset, n 512 x 8 groups, k 4096, Zen 4 running
        # the cpu-avx2 target's code, 2 threads, weights cycled through 5 copies, min / median
        # of 30 interleaved calls): the scheduled lanes form 2.14 / 2.83 ms, this one 0.82 / 1.18
        return DenseGemvConfig(tn=BLOCK, cb=1, vec=fma_lanes, rows=rows, kind="fma",
                               prefetch=max(2, 8192 // k))
    return DenseGemvConfig(tn=tn, cb=min(4, tn), vec=_lanes(k, 32), rows=rows)


def dense_gemv_is_bf16_dot(target: TargetSpec, *, n: int, k: int, rows: int = 1) -> bool:
    """Whether this target's dense GEMV of bf16 x and bf16 w is `make_dense_gemv_bf16_dot`
    (whose one-row sums `bf16_dot_rows` reproduces)."""
    return dense_gemv_config(target, n=n, k=k, rows=rows, x_dtype="bfloat16",
                             w_dtype="bfloat16").kind == "bf16_dot"


def schedule_dense_gemv(func: tvm.tirx.PrimFunc, config: DenseGemvConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Parallel over (group, column tile); per row and group of `cb` columns a `vec`-lane partial
    sum over K per column (rfactor), held in registers, the activation loaded once for the cb
    columns; then `vector_sum` adds each column's lanes pairwise. kind "bf16_dot": written
    scheduled, returned as is."""
    if config.kind in ("bf16_dot", "fma"):
        return func
    sch = s_tir.Schedule(func)
    if config.rows > 1:
        _schedule_dense_gemv_rows(sch, config)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    blk = sch.get_sblock("y")
    i, g, c, j = sch.get_loops(blk)
    co, cg, cc = sch.split(c, [None, config.tn // config.cb, config.cb])
    jo, *hs = lane_split(sch, j, config.vec)
    sch.reorder(g, co, i, cg, jo, cc, *hs)
    main, wbs = vector_sum(sch, blk, config.vec, config.cb)
    place_lane_sums(sch, main, wbs, 3, config.vec, config.cb)
    g, co = sch.get_loops(main)[:2]
    sch.parallel(sch.fuse(g, co))
    sch.decompose_reduction(main, sch.get_loops(main)[3])
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _schedule_dense_gemv_rows(sch: s_tir.Schedule, config: DenseGemvConfig) -> None:
    """`make_dense_gemv_rows`: the single-row schedule with a group's rows inside the K loop
    (unrolled next to the cb columns: rows x cb register chains, each weight vector loaded and
    widened once for the group's rows); each row's lanes and pairwise tree as one row's."""
    blk = sch.get_sblock("acc")
    io, ii, g, c, j = sch.get_loops(blk)
    co, cg, cc = sch.split(c, [None, config.tn // config.cb, config.cb])
    jo, *hs = lane_split(sch, j, config.vec)
    sch.reorder(g, co, io, cg, jo, ii, cc, *hs)
    main, wbs = vector_sum(sch, blk, config.vec, config.cb)
    sch.unroll(sch.get_loops(main)[5])  # the group's rows
    bits = config.vec.bit_length() - 1
    for w, wb in enumerate(wbs):  # each lane sum after the column group, per row and column
        sch.reverse_compute_at(wb, sch.get_loops(main)[3])
        below = sch.get_loops(wb)[4:]  # (half, lanes..., row[, column]: none when cb is 1)
        rest = bits - 1 - w
        half, lanes, tail = below[0], below[1:1 + rest], below[1 + rest:]
        sch.reorder(*tail, half, *lanes)
        for loop in (*tail[1:], half):
            sch.unroll(loop)
        if rest:
            sch.vectorize(sch.fuse(*lanes))
    g, co = sch.get_loops(main)[:2]
    sch.parallel(sch.fuse(g, co))
    sch.decompose_reduction(main, sch.get_loops(main)[3])


def dense_gemv_rounds(target: TargetSpec, *, n: int, k: int, x_dtype: str, w_dtype: str,
                      rows: int = 1) -> bool:
    """Whether the GEMV this target gets can store bf16 itself (`out_dtype`): the hand-written
    bf16_dot and fma forms; the scheduled lanes form stores fp32 and its caller rounds."""
    return dense_gemv_config(target, n=n, k=k, rows=rows, x_dtype=x_dtype,
                             w_dtype=w_dtype).kind in ("bf16_dot", "fma")


def build_dense_gemv(target_name: str, *, groups: int, n: int, k: int, x_dtype: str,
                     w_dtype: str, rows: int = 1, out_dtype: str = "float32"
                     ) -> tvm.tirx.PrimFunc:
    """rows > 1: the verify / draft form (`make_dense_gemv_rows`), bit-identical per row; bf16
    x and w on AVX-512 BF16: `make_dense_gemv_bf16_dot` in both forms (`dense_gemv_config`),
    which can store bf16 (`out_dtype`, `dense_gemv_rounds`)."""
    target = get_target(target_name)
    cfg = dense_gemv_config(target, n=n, k=k, rows=rows, x_dtype=x_dtype, w_dtype=w_dtype)
    if out_dtype != "float32" and cfg.kind not in ("bf16_dot", "fma"):
        raise ValueError(f"dense_gemv stores {out_dtype} only in its bf16_dot and fma forms; "
                         f"this target's is {cfg.kind!r} (fp32: round the result).")
    if cfg.kind == "bf16_dot":
        func = make_dense_gemv_bf16_dot(groups=groups, n=n, k=k, rows=rows, tn=cfg.tn,
                                        cb=cfg.cb, fma_rows=cfg.fma_rows,
                                        prefetch=cfg.prefetch, out_dtype=out_dtype,
                                        fp8=w_dtype == FP8_WEIGHT)
    elif cfg.kind == "fma":
        func = make_fp8_gemv_avx2(n=n, k=k, groups=groups, rows=rows, lanes=cfg.vec,
                                  prefetch=cfg.prefetch, out_dtype=out_dtype,
                                  w_dtype="fp8" if w_dtype == FP8_WEIGHT else w_dtype)
    elif rows > 1:
        func = make_dense_gemv_rows(groups=groups, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype,
                                    rows=rows)
    else:
        func = make_dense_gemv(groups=groups, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype)
    return schedule_dense_gemv(func, cfg, target)


def make_dense_gemm(*, groups: int, n: int, k: int, x_dtype: str, w_dtype: str, rb: int = 4
                    ) -> tvm.tirx.PrimFunc:
    """The prefill form of `make_dense_gemv` (same signature and buffers): y[i, g, c] = sum_j
    fp32(x[i, g, j]) * fp32(w[g * n + c, j]), the sum over K in order (j = 0, 1, ...), fp32 y.

    Stages: `wdec` widens the weight into a transposed [k, n] fp32 layout (scheduled into one
    [k, tn] tile per task, never materialised whole); `acc` is the outer-product accumulation of
    a GEMM microkernel over tiles of rb rows (per k, a row's value broadcast times a vector of
    the tile's columns); the last tile reads the last row again for its missing rows, so no loop
    carries a predicate, and `y` stores the m real rows. Products are rounded once in fp32 as in
    torch; the K additions run in order (the GEMV's run in `vec` lanes, then a horizontal add),
    so the two forms agree to fp32 rounding."""
    _check_dense_dtypes("dense_gemm", x_dtype, w_dtype)
    if rb < 1:
        raise ValueError(f"dense_gemm needs rb >= 1 rows per tile, got {rb}.")
    G, N, K, RB = i64(groups), i64(n), i64(k), i64(rb)
    row_groups = padded_row_groups()

    @T.prim_func(s_tir=True)
    def dense_gemm(x_h: T.handle, w: T.Buffer((G * N, K), w_dtype), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), x_dtype)
        y = T.match_buffer(y_h, (m, G, N), "float32")
        wdec = T.sblock_alloc_buffer((G, K, N), "float32")
        acc = T.sblock_alloc_buffer(((m + RB - i64(1)) // RB * RB, G, N), "float32")
        for g, j, c in T.grid(G, K, N):
            with T.sblock("wdec"):
                vg, vj, vc = T.axis.remap("SSS", [g, j, c])
                wdec[vg, vj, vc] = _load_f32(w, vg * N + vc, vj)
        row_groups(acc, y, x, wdec, m, G, N, K, RB, _load_f32, _transposed)

    return dense_gemm


@dataclass(frozen=True)
class DenseGemmConfig:
    """CPU: tn output columns per parallel task (their widened [k, tn] weight tile, k * tn * 4
    bytes, stays in L2 across every row of the call), rb rows x tn columns of fp32 accumulators
    held in registers over the whole of K (rb is part of the definition: `make_dense_gemm(rb=)`).
    64 x 4 measured best on the grouped o-projection at 512 rows (g 8, n 512, k 4096; 2 cores,
    loaded): 230 ms, against 300 for 32 x 4, 277 for 32 x 8, 234 for 64 x 3, 327 for 64 x 6,
    292 for 128 x 3, and 1400 for the row-at-a-time dense_gemv."""

    tn: int = 64
    rb: int = 4
    kind: str = "tile"  # "amx": bf16 x and w on AMX-BF16 (`make_dense_gemm_amx`); "bf16_dot":
    # bf16 x and w on AVX-512 BF16 without AMX (`bf16_gemm.make_dense_gemm_bf16`)
    block_rows: int = 128  # amx, bf16_dot: rows per block


def dense_gemm_config(target: TargetSpec, *, n: int, k: int, x_dtype: str | None = None,
                      w_dtype: str | None = None) -> DenseGemmConfig:
    if target.is_cuda:
        raise ValueError("dense_gemm has no CUDA schedule: CUDA builds keep the generic "
                         "(dlight-scheduled) lowering of the dense linears.")
    if (x_dtype == w_dtype == "bfloat16" and n % BLOCK == 0 and k % BLOCK == 0
            and has_amx_bf16(target)):
        return DenseGemmConfig(kind="amx", block_rows=amx_block_rows(k))
    # The grouped o-projection (g 8, n 512, k 4096) on a 2-core Zen 4 shared with other jobs
    # (load 3.7), min of 3, against "tile" in the same run: m 160 66 ms (120), m 2048 793 (1386).
    if x_dtype == w_dtype == "bfloat16" and k % 2 == 0 and has_avx512_bf16(target):
        return DenseGemmConfig(kind="bf16_dot", block_rows=256)
    # an FP8 weight (`FP8_WEIGHT`) without AMX: the bf16_dot form decodes each task's tile
    # (with AMX the weight is dequantized for the AMX GEMM; not measured there)
    if (x_dtype == "bfloat16" and w_dtype == FP8_WEIGHT and k % e4m3_words.CODES == 0
            and has_avx512_bf16(target) and has_features(target, "avx512vbmi")
            and not has_amx_bf16(target)):
        return DenseGemmConfig(kind="bf16_dot", block_rows=256)
    return DenseGemmConfig(tn=math.gcd(n, 64), rb=4)


def dense_gemm_reads_fp8(target: TargetSpec, *, n: int, k: int) -> bool:
    """Whether this target's prefill GEMM reads an FP8 weight as stored (else the caller
    dequantizes it to bf16 first)."""
    return dense_gemm_config(target, n=n, k=k, x_dtype="bfloat16",
                             w_dtype=FP8_WEIGHT).kind == "bf16_dot"


def schedule_dense_gemm(func: tvm.tirx.PrimFunc, config: DenseGemmConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Parallel over (group, column tile); the tile's weight widened once; per tile of rb rows an
    rb x tn register tile accumulated over K, then stored."""
    if config.kind in ("amx", "bf16_dot"):  # written scheduled
        return func
    sch = s_tir.Schedule(func)
    acc, wdec, out = sch.get_sblock("acc"), sch.get_sblock("wdec"), sch.get_sblock("y")
    io, ii, g, c, j = sch.get_loops(acc)
    if int(sch.get(ii).extent) != config.rb:
        raise ValueError(f"The kernel was built with rb = {int(sch.get(ii).extent)} but the "
                         f"config asks for {config.rb}; build it with make_dense_gemm(rb=...).")
    co, ci = sch.split(c, [None, config.tn])
    sch.reorder(g, co, io, j, ii, ci)
    sch.set_scope(acc, 0, "local")
    task = sch.fuse(g, co)
    sch.parallel(task)
    sch.reverse_compute_at(out, io)
    sch.compute_at(wdec, task)
    sch.vectorize(sch.get_loops(wdec)[-1])
    sch.vectorize(ci)
    sch.unroll(ii)
    sch.vectorize(sch.get_loops(out)[-1])
    sch.decompose_reduction(acc, j)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_dense_gemm(target_name: str, *, groups: int, n: int, k: int, x_dtype: str,
                     w_dtype: str, out_dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """out_dtype "bfloat16": where the GEMM stores bf16 itself (`dense_gemm_rounds`)."""
    target = get_target(target_name)
    func, cfg = unscheduled_dense_gemm(target, groups=groups, n=n, k=k, x_dtype=x_dtype,
                                       w_dtype=w_dtype, out_dtype=out_dtype)
    return schedule_dense_gemm(func, cfg, target)


def dense_gemm_rounds(target: TargetSpec, *, n: int, k: int, x_dtype: str,
                      w_dtype: str) -> bool:
    """Whether the prefill GEMM this target gets can store bf16 itself (`out_dtype`): the
    AVX-512 BF16 form (`make_dense_gemm_bf16`); the others store fp32 and the caller rounds."""
    return dense_gemm_config(target, n=n, k=k, x_dtype=x_dtype,
                             w_dtype=w_dtype).kind == "bf16_dot"


def unscheduled_dense_gemm(target: TargetSpec, *, groups: int, n: int, k: int, x_dtype: str,
                           w_dtype: str, out_dtype: str = "float32"
                           ) -> tuple[tvm.tirx.PrimFunc, DenseGemmConfig]:
    """The factory output the config's schedule expects, and the config."""
    cfg = dense_gemm_config(target, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype)
    if out_dtype != "float32" and cfg.kind != "bf16_dot":
        raise ValueError(f"dense_gemm stores {out_dtype} only in its bf16_dot form; this "
                         f"target's is {cfg.kind!r} (fp32: round the result).")
    if cfg.kind == "amx":
        return make_dense_gemm_amx(groups=groups, n=n, k=k, block_rows=cfg.block_rows), cfg
    if cfg.kind == "bf16_dot":
        return make_dense_gemm_bf16(groups=groups, n=n, k=k, row_block=cfg.block_rows,
                                    fp8=w_dtype == FP8_WEIGHT, out_dtype=out_dtype), cfg
    if w_dtype == FP8_WEIGHT:
        raise ValueError(f"dense_gemm reads an FP8 weight only in its bf16_dot form; this "
                         f"target's is {cfg.kind!r} (`dense_gemm_reads_fp8`: dequantize it).")
    return make_dense_gemm(groups=groups, n=n, k=k, x_dtype=x_dtype, w_dtype=w_dtype,
                           rb=cfg.rb), cfg
