"""The dense GEMV on `vdpbf16ps` (AVX-512 BF16): bf16 x over a bf16 weight or an FP8 one
(E4M3 codes, an E8M0 scale per 32 x 32 tile: the hub's `wo_a`), hand-vectorised, decode and the
verify's row groups (`make_dense_gemv_bf16_dot`), and the one-row sums other kernels reproduce
(`bf16_dot_rows`). Its config and builder are `dense.dense_gemv_config` / `build_dense_gemv`."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.graph.checkpoint.spec import FP8_TILE
from dsv41.schedules.common import (
    bf16_of,
    bf16_pair_halves,
    dpbf16ps,
    dpbf16ps_by_fma,
    e4m3_words,
    i64,
    pairwise_lane_sum,
    with_bf16_dot,
)
from dsv41.schedules.common import prefetch as prefetch_line


def fp8_tile_grid(rows, k):
    """The shape of a [rows, k] weight's E8M0 tile scales (32 x 32 tiles)."""
    return ((rows + i64(FP8_TILE - 1)) // i64(FP8_TILE), k // i64(FP8_TILE))


def dense_gemv_func(body, *, groups: int, n: int, k: int, out_dtype: str,
                    fp8: bool) -> tvm.tirx.PrimFunc:
    """`dense_gemv`'s signature around a kernel body (a macro `body(x, w, sc, y, m)`; sc None
    over a bf16 weight): x bf16 [m, groups, k]; w bf16 [groups * n, k], or E4M3 codes with
    their 32 x 32 tile scales (`fp8_tile_grid`); y [m, groups, n] of `out_dtype`. The hand
    GEMVs (`make_dense_gemv_bf16_dot`, `make_fp8_gemv_avx2`'s dense form) and the prefill
    GEMM (`make_dense_gemm_bf16`) share it."""
    G, N, K = i64(groups), i64(n), i64(k)

    if fp8:
        @T.prim_func
        def dense_gemv_fp8(x_h: T.handle, w: T.Buffer((G * N, K), "uint8"),
                           sc: T.Buffer(fp8_tile_grid(G * N, K), "uint8"), y_h: T.handle):
            T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True,
                         "tirx.is_scheduled": True})
            m = T.int64()
            x = T.match_buffer(x_h, (m, G, K), "bfloat16")
            y = T.match_buffer(y_h, (m, G, N), out_dtype)
            body(x, w, sc, y, m)

        return dense_gemv_fp8

    @T.prim_func
    def dense_gemv(x_h: T.handle, w: T.Buffer((G * N, K), "bfloat16"), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), "bfloat16")
        y = T.match_buffer(y_h, (m, G, N), out_dtype)
        body(x, w, None, y, m)

    return dense_gemv


DOT_K = 32  # K elements per vdpbf16ps: 16 fp32 lanes, each summing a pair of bf16 products
DOT_LANES = 16
DOT_ACCS = 24  # bf16_dot: most rows x cb accumulators (of 32 zmm registers; the rest load)
# its FP8 form also holds each column's decoded words (two vectors) and the lookup tables
DOT_ACCS_FP8 = 16
EXACT_ROWS = 8  # bf16_dot: rows left over after whole groups run as a group of exactly them


def dot_columns(tn: int, rows: int, fp8: bool = False) -> int:
    """Columns per register group (cb) of a bf16_dot group of `rows` rows in a tile of tn: one
    row 8 (8 weight streams in flight), more rows the widest of 4, 3, 2, 1 that divides tn
    with rows x cb within DOT_ACCS accumulators (DOT_ACCS_FP8 over an FP8 weight, whose decoded
    words take registers too; 1 past that). The FP8 o-projection of the bench preset (Zen 4, 2
    threads, weights cycled through 5 copies, min of 25 interleaved calls), a full group of 6
    rows: cb 4 (24 accumulators, spilled) 1.54 ms, cb 2 1.00 ms; one row 0.55."""
    widths = (8, 4, 3, 2, 1) if rows == 1 else (4, 3, 2, 1)
    most = DOT_ACCS_FP8 if fp8 else DOT_ACCS
    return next(c for c in widths if tn % c == 0 and (rows * c <= most or c == 1))


@T.macro
def bf16_dot_rows(y, x, w, m, n, k):
    """y[i, c] (fp32) = row i of x (bf16 [m, k]) times row c of w (bf16 [n, k]) as
    `make_dense_gemv_bf16_dot` sums each column at one row (16 lanes from 0, one `dpbf16ps` per
    32 along K in order, then `pairwise_lane_sum`): its totals bit for bit, for a kernel that
    forms such a product itself (the MoE gate's logits, `moe_gate_up_route_gate`). Columns in
    parallel (each weight row read once, by one thread, for every row of x)."""
    for c in T.parallel(n):
        acc = T.alloc_buffer((DOT_LANES,), "float32", scope="local")
        for i in range(m):
            acc[T.ramp(0, 1, DOT_LANES)] = T.broadcast(T.float32(0), DOT_LANES)
            for ch in range(i64(k // DOT_K)):
                acc[T.ramp(0, 1, DOT_LANES)] = dpbf16ps(
                    acc[T.ramp(0, 1, DOT_LANES)],
                    T.reinterpret(f"uint16x{DOT_K}",
                                  x.vload([i, ch * DOT_K], f"bfloat16x{DOT_K}")),
                    T.reinterpret(f"uint16x{DOT_K}",
                                  w.vload([c, ch * DOT_K], f"bfloat16x{DOT_K}")))
            y[i, c] = pairwise_lane_sum(acc[T.ramp(0, 1, DOT_LANES)], DOT_LANES)


def make_dense_gemv_bf16_dot(*, groups: int, n: int, k: int, rows: int = 1, tn: int = 32,
                             cb: int = 4, fma_rows: bool = False, prefetch: int = 0,
                             out_dtype: str = "float32", fp8: bool = False
                             ) -> tvm.tirx.PrimFunc:
    """`make_dense_gemv` for bf16 x and bf16 w on AVX-512 BF16 (same signature and buffers),
    hand-vectorised (its loops are the schedule): the products of two bf16 values are exact in
    fp32, so `vdpbf16ps` (32 multiply-adds per instruction against 16 for an fp32 FMA, no
    widening of either operand) computes them as the FMA form does; only the order of the fp32
    additions is its own.

    Per column: 16 fp32 lanes from 0; for each chunk of 32 along K (in order) lane l += the
    product at 2l + 1, then the one at 2l (`dpbf16ps`); then the 16 lanes added pairwise
    (`pairwise_lane_sum`). A lane sums k / 16 products in order, so against the oracle the
    error bound is that of an fp32 sum of k / 16 terms (the FMA form: k / 32); denormal
    products and sums are flushed to zero (vdpbf16ps' rule).

    Parallel over (group, tile of tn columns); per group of `rows` rows (static: 1 for decode,
    the verify entry's 1 + k) and `cb` columns, rows x cb accumulators in registers: each
    weight chunk is loaded once for the group's rows, each activation chunk once for the cb
    columns. Every column and row is summed in the order above whatever rows and cb are, so
    each row of a rows > 1 kernel equals the rows = 1 kernel bit for bit. The rows left after
    the whole groups (m % rows: a verify of fewer rows than its group, k = 0 included) run as a
    group of exactly that many (up to EXACT_ROWS, `dot_columns` wide), not padded to a whole
    group (at one row the verify form then costs what decode's kernel does, not 6 rows' dot
    products); past EXACT_ROWS a padded group reads row m - 1 again. A partial column tile
    reads its last column again (no predicate in the K loop); only real rows and columns are
    stored.

    `out_dtype` "bfloat16": each column's total is stored rounded to bf16 (`common.bf16_of`,
    the compiled graph's fp32 -> bf16 cast), so the kernel equals the fp32 one followed by that
    cast, bit for bit, without the cast's kernel (the grouped o-projection's output is bf16).

    `prefetch` > 0: beside each chunk's loads, the same chunk of the columns `prefetch`
    register groups ahead is prefetched (one line per column; the last group's reach past
    the weight is clamped to its last row), so the next group's rows are in cache when its
    sums start. The sums are unchanged.

    `fma_rows`: a group of 2 or more rows forms each vdpbf16ps as two FMAs (`dpbf16ps_by_fma`:
    the same sums, bit for bit, for these products: a product of two bf16 is exact and never a
    denormal while both are normal, and a sum of such products is a multiple of the smallest;
    a denormal activation or weight, which vdpbf16ps reads as zero, is where they may differ),
    x split into its fp32 halves once per call (`xf`), each weight chunk's halves shared by
    the group's rows: for CPUs whose vdpbf16ps issues at a quarter of their FMA rate
    (`dense_gemv_config`). One-row groups (decode) keep vdpbf16ps."""
    if k % DOT_K:
        raise ValueError(f"The bf16 dot-product GEMV needs k a multiple of {DOT_K}, got {k}.")
    if out_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"The bf16 dot-product GEMV stores float32 or bfloat16, got {out_dtype}.")
    if rows < 1 or cb < 1 or tn % cb:
        raise ValueError(f"The bf16 dot-product GEMV needs rows >= 1 and cb >= 1 dividing tn; "
                         f"got rows={rows}, cb={cb}, tn={tn}.")
    if fp8 and k % e4m3_words.CODES:
        raise ValueError(f"The FP8-weight dot-product GEMV needs k a multiple of "
                         f"{e4m3_words.CODES}, got {k}.")
    G, N, K, R = i64(groups), i64(n), i64(k), i64(rows)
    TN, NT, NCH = i64(tn), i64(-(-n // tn)), i64(k // DOT_K)
    L = DOT_LANES

    def width(nr: int) -> int:  # columns per register group of a group of nr rows
        return cb if nr == rows else dot_columns(tn, nr, fp8)

    ACC = max(nr * width(nr) for nr in (rows, *range(1, min(rows, EXACT_ROWS + 1))))

    def stored(total):  # a column's fp32 total as y holds it
        return bf16_of(total) if out_dtype == "bfloat16" else total

    def bits(buf, *idx):  # 32 bf16 values from idx on, as the uint16 lanes dpbf16ps takes
        return T.reinterpret(f"uint16x{DOT_K}", buf.vload(list(idx), f"bfloat16x{DOT_K}"))

    def column(task, cg, cbn, c):  # the weight row of column c of register group cg
        return task // NT * N + T.min(task % NT * TN + cg * cbn + c, N - i64(1))

    def wbits(w, task, cg, cbn, c, ch):  # column c of register group cg, chunk ch
        return bits(w, column(task, cg, cbn, c), ch * DOT_K)

    @T.macro
    def prefetch_group(w, task, cg, cbn, k0):
        """The line at K offset k0 of each column `prefetch` register groups on (none where
        prefetch is 0; the last group's reach past the weight clamped to its last row)."""
        if prefetch > 0:  # static
            for c in T.unroll(cbn):
                prefetch_line(T.address_of(w[T.min(
                    task // NT * N + task % NT * TN + (cg + prefetch) * cbn + c,
                    G * N - i64(1)), k0]))

    @T.macro
    def store_group(y, acc, m, task, row0, nr, cbn, cg):
        """The group's totals (row r, column c in accumulator r * cbn + c), real rows and
        columns only."""
        for r, c in T.grid(nr, cbn):
            if row0 + r < m and task % NT * TN + cg * cbn + c < N:
                y[row0 + r, task // NT, task % NT * TN + cg * cbn + c] = stored(
                    pairwise_lane_sum(acc[T.ramp((r * cbn + c) * L, 1, L)], L))

    @T.macro
    def block(x, xf, w, y, acc, task, row0, nr, cbn):
        """Rows row0 .. row0 + nr - 1 (nr, cbn static; rows past the call's last read it
        again and are not stored) of task's columns, cbn columns per register group."""
        m = T.meta_var(x.shape[0])
        for cg in range(TN // i64(cbn)):
            for a in T.unroll(nr * cbn):
                acc[T.ramp(a * L, 1, L)] = T.broadcast(T.float32(0), L)
            for ch in range(NCH):
                prefetch_group(w, task, cg, cbn, ch * DOT_K)  # chunk ch, `prefetch` groups on
                for a in T.unroll(nr * cbn):  # (row a // cbn, column a % cbn)
                    if fma_rows and nr > 1:  # static
                        row = T.meta_var(T.min(row0 + a // cbn, m - i64(1)))
                        wh = T.meta_var(bf16_pair_halves(wbits(w, task, cg, cbn, a % cbn, ch)))
                        acc[T.ramp(a * L, 1, L)] = dpbf16ps_by_fma(
                            acc[T.ramp(a * L, 1, L)],
                            xf[row, task // NT, T.ramp(ch * DOT_K, 1, L)],
                            xf[row, task // NT, T.ramp(ch * DOT_K + L, 1, L)], wh[0], wh[1])
                    else:
                        acc[T.ramp(a * L, 1, L)] = dpbf16ps(
                            acc[T.ramp(a * L, 1, L)],
                            bits(x, T.min(row0 + a // cbn, m - i64(1)), task // NT, ch * DOT_K),
                            wbits(w, task, cg, cbn, a % cbn, ch))
            store_group(y, acc, m, task, row0, nr, cbn, cg)

    # One-row groups (decode) where a task's 32 columns are one row of scale tiles: x scaled by
    # each chunk's tile scale once per task (`scaled_x`), the weights' words used unscaled, as
    # long as every scaled x is a normal bf16 (else the task scales the words, below).
    XSCALE = fp8 and tn == FP8_TILE and n % FP8_TILE == 0

    def column_words(w, sc, tables, task, cg, cbn, c, cp, h, scaled=True):
        """Chunk cp * 2 + h of column c of register group cg: its 32 codes' bf16 words, scaled
        (an expression: the 64 codes' lookups are the same for both halves, so LLVM forms
        them once per column and pair of chunks, as for every row of a group)."""
        col = column(task, cg, cbn, c)
        codes = w.vload([col, cp * i64(2 * DOT_K)], "uint8x64")
        words = e4m3_words.e4m3_bf16_words(codes, tables[0], tables[1], e4m3_words.HALVES[h])
        if not scaled:
            return words
        return e4m3_words.scaled_words(words, sc[col // i64(FP8_TILE), cp * i64(2) + i64(h)])

    @T.macro
    def scaled_x(x, sc, xs, bad, task, row):
        """xs = row `row` of x (its group's K) times each chunk's scale of the task's tile row,
        as bf16 bits (`e4m3_words.scaled_x_words`); bad[0] = 1 if some scaled value left the
        normal range (the task then scales the words instead). Where bad[0] is 0, x 2^e times a
        word is the product x times the word 2^e exactly, so the sums are the same bits."""
        flags = T.meta_var(bad[T.ramp(0, 1, DOT_K)])
        bad[T.ramp(0, 1, DOT_K)] = T.broadcast(T.uint16(0), DOT_K)
        for ch in range(NCH):
            r = T.meta_var(e4m3_words.scaled_x_words(
                bits(x, row, task // NT, ch * DOT_K),
                sc[column(task, 0, 1, 0) // i64(FP8_TILE), ch]))
            xs[T.ramp(ch * DOT_K, 1, DOT_K)] = r[0]
            bad[T.ramp(0, 1, DOT_K)] = flags | r[1]
        for j in range(1, DOT_K):
            bad[0] = bad[0] | bad[j]

    @T.macro
    def block_xs(xs, w, tables, y, acc, task, row, cbn):
        """`block_fp8` for one row over the scaled x (`scaled_x`) and unscaled words."""
        for cg in range(TN // i64(cbn)):
            for c in T.unroll(cbn):
                acc[T.ramp(c * L, 1, L)] = T.broadcast(T.float32(0), L)
            for cp in range(NCH // i64(2)):
                prefetch_group(w, task, cg, cbn, cp * i64(2 * DOT_K))
                for c in T.unroll(cbn):  # each accumulator sums chunk 2 cp, then 2 cp + 1
                    acc[T.ramp(c * L, 1, L)] = dpbf16ps(
                        acc[T.ramp(c * L, 1, L)], xs[T.ramp(cp * 2 * DOT_K, 1, DOT_K)],
                        column_words(w, None, tables, task, cg, cbn, c, cp, 0, False))
                    acc[T.ramp(c * L, 1, L)] = dpbf16ps(
                        acc[T.ramp(c * L, 1, L)], xs[T.ramp((cp * 2 + 1) * DOT_K, 1, DOT_K)],
                        column_words(w, None, tables, task, cg, cbn, c, cp, 1, False))
            store_group(y, acc, y.shape[0], task, row, 1, cbn, cg)

    @T.macro
    def half_fp8(x, xf, w, sc, tables, acc, task, row0, nr, cbn, cg, cp, c, h):
        """Every row's dot product with chunk cp * 2 + h (h static) of column c of the group."""
        m = T.meta_var(x.shape[0])
        words = T.meta_var(column_words(w, sc, tables, task, cg, cbn, c, cp, h))
        for r in T.unroll(nr):
            a = T.meta_var(r * cbn + c)  # the accumulator of (row r, column c)
            if fma_rows and nr > 1:  # static
                row = T.meta_var(T.min(row0 + r, m - i64(1)))
                wh = T.meta_var(bf16_pair_halves(words))
                acc[T.ramp(a * L, 1, L)] = dpbf16ps_by_fma(
                    acc[T.ramp(a * L, 1, L)],
                    xf[row, task // NT, T.ramp((cp * 2 + h) * DOT_K, 1, L)],
                    xf[row, task // NT, T.ramp((cp * 2 + h) * DOT_K + L, 1, L)],
                    wh[0], wh[1])
            else:
                acc[T.ramp(a * L, 1, L)] = dpbf16ps(
                    acc[T.ramp(a * L, 1, L)],
                    bits(x, T.min(row0 + r, m - i64(1)), task // NT, (cp * 2 + h) * DOT_K),
                    words)

    @T.macro
    def block_words(x, xf, w, sc, tables, y, acc, task, row0, nr, cbn):
        """`block` over an FP8 weight: per pair of chunks, each column's 64 codes decoded once
        (its two chunks' words, scaled: `column_words`), then every row's dot products with
        them in chunk order (the two chunks as `block` takes them). The words are
        expressions, not a buffer: a decoded-words buffer of the group (1 KB at 8 columns)
        was a heap workspace (TVM allocates 1 KB or more per task so), stored to on every
        chunk."""
        m = T.meta_var(x.shape[0])
        for cg in range(TN // i64(cbn)):
            for a in T.unroll(nr * cbn):
                acc[T.ramp(a * L, 1, L)] = T.broadcast(T.float32(0), L)
            for cp in range(NCH // i64(2)):
                prefetch_group(w, task, cg, cbn, cp * i64(2 * DOT_K))
                for c in T.unroll(cbn):  # each accumulator sums chunk 2 cp, then 2 cp + 1
                    half_fp8(x, xf, w, sc, tables, acc, task, row0, nr, cbn, cg, cp, c, 0)
                    half_fp8(x, xf, w, sc, tables, acc, task, row0, nr, cbn, cg, cp, c, 1)
            store_group(y, acc, m, task, row0, nr, cbn, cg)

    @T.macro
    def block_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, row0, nr, cbn):
        """`block_words`, or for one row where the scales allow (`XSCALE`) and every scaled x
        is normal, `block_xs`: the same sums, bit for bit."""
        if XSCALE and nr == 1:  # static
            scaled_x(x, sc, xs, bad, task, row0)
            if bad[0] == T.uint16(0):
                block_xs(xs, w, tables, y, acc, task, row0, cbn)
            else:
                block_words(x, xf, w, sc, tables, y, acc, task, row0, nr, cbn)
        else:
            block_words(x, xf, w, sc, tables, y, acc, task, row0, nr, cbn)

    @T.macro
    def rest_if(x, xf, w, y, acc, task, rest, nr):
        if nr < rows:  # static: a group of nr < rows rows can be left over
            if rest == nr:
                block(x, xf, w, y, acc, task, x.shape[0] - i64(nr), nr, width(nr))

    @T.macro
    def rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, rest, nr):
        if nr < rows:  # static
            if rest == nr:
                block_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, x.shape[0] - i64(nr), nr,
                          width(nr))

    @T.macro
    def body(x, w, sc, y, m):
        with T.attr(T.int32(0), *with_bf16_dot()):
            if fma_rows and rows > 1:  # static: per chunk of 32, the odd words, then the even
                xf = T.alloc_buffer((m, G, K), "float32")  # x's halves
                for i, g, ch in T.grid(m, G, NCH):
                    halves = T.meta_var(bf16_pair_halves(bits(x, i, g, ch * DOT_K)))
                    xf[i, g, T.ramp(ch * DOT_K, 1, L)] = halves[0]
                    xf[i, g, T.ramp(ch * DOT_K + L, 1, L)] = halves[1]
            else:
                xf = T.meta_var(None)  # no group sums by FMA pairs
            if fp8:  # static: the E4M3 -> bf16 lookup table
                tbl = T.alloc_buffer((256,), "uint8")
                e4m3_words.e4m3_bf16_table(tbl)
            for task in T.parallel(G * NT):  # (group, column tile)
                acc = T.alloc_buffer((ACC * L,), "float32")
                if fp8:  # static
                    tables = T.meta_var(e4m3_words.table_vectors(tbl))
                    if XSCALE:  # static: one row's scaled x, and whether it left the range
                        xs = T.alloc_buffer((K,), "uint16")
                        bad = T.alloc_buffer((DOT_K,), "uint16")
                    else:
                        xs = T.meta_var(None)
                        bad = T.meta_var(None)
                    for io in range(m // R):  # whole groups
                        block_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, io * R, rows,
                                  width(rows))
                    # the rows left (m % rows), as below
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 1)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 2)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 3)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 4)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 5)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 6)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 7)
                    rest_if_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m % R, 8)
                    if rows > EXACT_ROWS + 1:  # static
                        if m % R > i64(EXACT_ROWS):
                            block_fp8(x, xf, w, sc, tables, xs, bad, y, acc, task, m - m % R, rows,
                                      width(rows))
                else:
                    for io in range(m // R):  # whole groups
                        block(x, xf, w, y, acc, task, io * R, rows, width(rows))
                    # the rows left (m % rows): a group of exactly that many, up to EXACT_ROWS
                    rest_if(x, xf, w, y, acc, task, m % R, 1)
                    rest_if(x, xf, w, y, acc, task, m % R, 2)
                    rest_if(x, xf, w, y, acc, task, m % R, 3)
                    rest_if(x, xf, w, y, acc, task, m % R, 4)
                    rest_if(x, xf, w, y, acc, task, m % R, 5)
                    rest_if(x, xf, w, y, acc, task, m % R, 6)
                    rest_if(x, xf, w, y, acc, task, m % R, 7)
                    rest_if(x, xf, w, y, acc, task, m % R, 8)
                    if rows > EXACT_ROWS + 1:  # static: more left over: a padded group of rows
                        if m % R > i64(EXACT_ROWS):
                            block(x, xf, w, y, acc, task, m - m % R, rows, width(rows))

    return dense_gemv_func(body, groups=groups, n=n, k=k, out_dtype=out_dtype, fp8=fp8)
