"""The AMX-BF16 GEMMs: the FP8 linear and the dense bf16 GEMM on tile registers."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common import (
    amx,
    amx_configure,
    amx_dot_2x2,
    bf16_bits_of_exact,
    bf16_to_f32,
    e4m3_to_f32,
    e8m0_to_f32,
    i64,
    u32,
)
from dsv41.schedules.gemm.fp8 import BLOCK, check_out_dtype, fp8_qdq, pow2_scale_byte


def _row_tiles(m):
    """The 32-row tiles of m rows (the AMX kernels pad the last one with zero rows)."""
    return (m + i64(BLOCK - 1)) // i64(BLOCK)


def amx_block_rows(k: int) -> int:
    """Rows per block of the AMX GEMMs: a block's rearranged activation (block_rows x k bf16)
    stays near 512 KB of the 2 MB L2 while every weight panel passes over it. m 2048 on one
    core: fp8 n 1024 k 4096 233 GFLOP/s at 128 rows (197 at 512), n 32768 k 512 267 at 512
    rows (the tile kernel 19-39); the grouped o-projection (g 8, n 512, k 4096, m 512) 141 ms
    at 128 rows, 516-656 on the tile kernel."""
    return BLOCK * max(1, min(16, 16384 // k))


def make_fp8_linear_amx(*, n: int, k: int, block_rows: int,
                        out_dtype: str = "bfloat16") -> tvm.tirx.PrimFunc:
    """The CPU prefill form of `fp8_linear` on AMX-BF16 tiles (same signature and result; n a
    multiple of 32). Every operand is exact in bf16: the quantised activation `q * 2^s` and the
    weight `e4m3 * 2^e` with its E8M0 block scale folded in (a power of two), so each tile
    product is exact and AMX sums them in fp32; only the order of the fp32 additions differs
    from the oracle's (its block partial sums times the scale in K order: the same sum, since a
    power-of-two product commutes with every rounding), with the bound stated in the module
    docstring. Values under bf16's normal range would be flushed by AMX: the activation's are
    at least 2^-9 * 1e-4 / 448, and a weight's only for an E8M0 scale byte under 10.

    The tiles compute y^T: A = 16 weight rows x 32 K (the decoded panel, row-major as stored),
    B = 32 K x 16 activation rows in AMX's pair layout, so the activation (quantised once,
    shared by all N) is the side rearranged and the weights are only decoded.

    Stages: `xt` quantises x per 32 into bf16 pairs, blocked per 32 rows ([m/32 * k/2, 32]
    uint32: a row tile's k/2 rows; a B tile's 16 rows are 128 bytes apart); then, per block of
    block_rows rows, each parallel task decodes one 32-column weight panel into bf16 and runs
    2 x 2 tiles (32 columns x 32 rows, tile registers 4..7) over K, then writes y."""
    if k % BLOCK or n % BLOCK or block_rows % BLOCK or block_rows < BLOCK:
        raise ValueError(f"fp8_linear on AMX needs n, k and block_rows multiples of {BLOCK}, got "
                         f"n={n}, k={k}, block_rows={block_rows}.")
    check_out_dtype(out_dtype)
    N, K, KB, NB, K2 = i64(n), i64(k), i64(k // BLOCK), i64(n // BLOCK), i64(k // 2)
    TPB = i64(block_rows // BLOCK)  # 32-row tiles per block

    def pair(x, i, col, byte):  # two quantised activations as one uint32 of bf16 bits
        lo = bf16_bits_of_exact(fp8_qdq(bf16_to_f32(x[i, col]), byte))
        hi = bf16_bits_of_exact(fp8_qdq(bf16_to_f32(x[i, col + 1]), byte))
        return T.Cast("uint32", lo) | (T.Cast("uint32", hi) << u32(16))

    @T.prim_func
    def fp8_linear(x_h: T.handle, weight: T.Buffer((N, K), "uint8"),
                   scale: T.Buffer((NB, KB), "uint8"), y_h: T.handle):
        T.func_attr({"global_symbol": "fp8_linear", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, K), "bfloat16")
        y = T.match_buffer(y_h, (m, N), out_dtype)
        xt = T.alloc_buffer((_row_tiles(m) * K2, i64(BLOCK)), "uint32")  # a tile: K2 rows
        for i in T.parallel(_row_tiles(m) * i64(BLOCK)):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            byte = T.alloc_buffer((1,), "uint32", scope="local")
            for b in range(KB):
                if i < m:
                    amax[0] = T.float32(0)
                    for j in range(i64(BLOCK)):
                        amax[0] = T.max(amax[0], T.fabs(bf16_to_f32(x[i, b * BLOCK + j])))
                    byte[0] = pow2_scale_byte(amax[0])
                    for j in T.vectorized(i64(BLOCK // 2)):
                        xt[i // BLOCK * K2 + b * 16 + j, i % BLOCK] = pair(
                            x, i, b * BLOCK + j * 2, byte[0])
                else:  # padded rows: zero
                    for j in range(i64(BLOCK // 2)):
                        xt[i // BLOCK * K2 + b * 16 + j, i % BLOCK] = u32(0)
        for blk in range((_row_tiles(m) + TPB - i64(1)) // TPB):
            for p in T.parallel(NB):
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                wbf = T.alloc_buffer((i64(BLOCK), K), "uint16")
                yt = T.alloc_buffer((i64(BLOCK), i64(BLOCK)), "float32")
                for c, kb in T.grid(i64(BLOCK), KB):
                    for j in T.vectorized(i64(BLOCK)):
                        wbf[c, kb * BLOCK + j] = bf16_bits_of_exact(e4m3_to_f32(T.Cast(
                            "uint32", weight[p * BLOCK + c, kb * BLOCK + j])) * e8m0_to_f32(
                                T.Cast("uint32", scale[p, kb])))
                amx_configure(cfg)
                for t in range(TPB):
                    if blk * TPB + t < _row_tiles(m):
                        amx_dot_2x2(wbf, 0, 0, K * 2, 32, xt, (blk * TPB + t) * K2, 0, 16,
                                    i64(128), KB, yt, 0, 0, i64(128))
                        for r in range(i64(BLOCK)):
                            if (blk * TPB + t) * BLOCK + r < m:
                                for c in T.vectorized(i64(BLOCK)):
                                    y[(blk * TPB + t) * BLOCK + r, p * BLOCK + c] = T.Cast(
                                        out_dtype, yt[c, r])
                amx("tilerelease")

    return fp8_linear


def make_dense_gemm_amx(*, groups: int, n: int, k: int, block_rows: int) -> tvm.tirx.PrimFunc:
    """`make_dense_gemm` for bf16 x and w on AMX-BF16 tiles (same signature and buffers; n and
    k multiples of 32): bf16 products are exact in fp32 and the tiles sum them in fp32, so the
    result differs from the in-order sum only by the order of the additions. The weight rows
    are A tiles read in place; x is rearranged once into AMX's B layout per group and 32 rows
    (`xt`, [g * m/32 * k/2, 32] bf16 pairs), then each parallel task (group, 32-column panel)
    runs `amx_dot_2x2` over the row tiles of a block of block_rows rows."""
    if n % BLOCK or k % BLOCK or block_rows % BLOCK or block_rows < BLOCK:
        raise ValueError(f"dense_gemm on AMX needs n, k and block_rows multiples of {BLOCK}, got "
                         f"n={n}, k={k}, block_rows={block_rows}.")
    G, N, K, KB, K2 = i64(groups), i64(n), i64(k), i64(k // BLOCK), i64(k // 2)
    NP, TPB = i64(n // BLOCK), i64(block_rows // BLOCK)

    @T.prim_func
    def dense_gemm(x_h: T.handle, w: T.Buffer((G * N, K), "bfloat16"), y_h: T.handle):
        T.func_attr({"global_symbol": "dense_gemv", "tirx.noalias": True,
                     "tirx.is_scheduled": True})
        m = T.int64()
        x = T.match_buffer(x_h, (m, G, K), "bfloat16")
        y = T.match_buffer(y_h, (m, G, N), "float32")
        xt = T.alloc_buffer((G * _row_tiles(m) * K2, i64(BLOCK)), "uint32")  # a tile: K2 rows
        for task in T.parallel(G * _row_tiles(m)):  # (group, 32-row tile)
            for r, j in T.grid(i64(BLOCK), K2):
                if task % _row_tiles(m) * BLOCK + r < m:
                    xt[task * K2 + j, r] = T.reinterpret("uint32", x.vload(
                        [task % _row_tiles(m) * BLOCK + r, task // _row_tiles(m), j * 2],
                        "bfloat16x2"))
                else:  # padded rows: zero
                    xt[task * K2 + j, r] = u32(0)
        for blk in range((_row_tiles(m) + TPB - i64(1)) // TPB):
            for task in T.parallel(G * NP):
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                yt = T.alloc_buffer((i64(BLOCK), i64(BLOCK)), "float32")
                amx_configure(cfg)
                for t in range(TPB):
                    if blk * TPB + t < _row_tiles(m):
                        amx_dot_2x2(w, task * BLOCK, 0, K * 2, 32, xt,
                                    (task // NP * _row_tiles(m) + blk * TPB + t) * K2, 0, 16,
                                    i64(128), KB, yt, 0, 0, i64(128))
                        for r in range(i64(BLOCK)):
                            if (blk * TPB + t) * BLOCK + r < m:
                                for c in T.vectorized(i64(BLOCK)):
                                    y[(blk * TPB + t) * BLOCK + r, task // NP,
                                      task % NP * BLOCK + c] = yt[c, r]
                amx("tilerelease")

    return dense_gemm
