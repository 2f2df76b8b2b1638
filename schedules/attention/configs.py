"""The sparse-attend kernel's configuration: how a target splits the heads into groups, stages
the entries and sizes its register tiles (`sparse_attend_config`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv41.graph.targets import TargetSpec
from dsv41.schedules.attention.amx_dot import TILE as AMX_TILE
from dsv41.schedules.common import has_amx_bf16, has_avx512, has_avx512_bf16, has_features

ATTN_BLOCK = 64  # entries per online-softmax block (graph.ops.ATTN_BLOCK)


# ---- config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseAttendConfig:
    heads_per_group: int  # heads that share one task and its staged entries
    stage_rows: int  # entries decoded into the staging tile at a time (divides 64)
    vector: int  # CPU: fp32 lanes per vector op
    unroll_rows: int  # CPU: entries per register tile in QK
    threads: int  # CUDA: threads per block (one block per (b, s, head group))
    vector_decode: bool = False  # CPU with AVX-512: the hand-vectorised staging (stage_vec)
    bf16_dot: bool = False  # CPU with AVX-512 BF16: QK and PV on vdpbf16ps (bf16_dot.py)
    amx_dot: bool = False  # CPU with AMX-BF16 (and bf16_dot): QK and PV on tiles (amx_dot.py)
    pv_heads: int = 4  # CPU: heads per PV register tile
    pv_cols: int = 64  # CPU: values of d per PV register tile (pv_heads x pv_cols fp32 sums)
    decode_lanes: int = 16  # vector_decode: the FP4 lookup's lanes, 16 (AVX-512) or 8 (AVX2)


def sparse_attend_config(target: TargetSpec, *, h: int, d: int, **_dims) -> SparseAttendConfig:
    """CPU: as few head groups as keep every core busy on one decode token (each group decodes
    the entries again; at h = 64 on 2 cores: 2 groups of 32), whole 64-entry blocks staged once
    and reused for PV, 16 fp32 lanes; the QK register tile is 8 entries x the group's heads with
    AVX-512 (32 zmm) and 2 entries without (16 ymm: at h 64, d 512, w 128, k 512 on one Zen 3
    core 2.5-2.7 ms against 3.5-3.8 at 8 or 4 entries, 2.9-3.7 at 1, 3.0 with 8 lanes at 1 or 2,
    4.0 with 32 lanes); the PV register tile 4 heads x 64 values of d with AVX-512 (16 of 32 zmm)
    and 4 x 16 without (8 of 16 ymm: 4 x 64 spilled 24 accumulators to the stack in every step
    of its loop; Zen 4 running the cpu-avx2 code, 2 threads, h 64 d 512 w 128 k 512, one row,
    min of 40 interleaved calls: 0.700 -> 0.538 ms, 2 x 32 0.554, 8 x 8 0.562; the same bits,
    each sum's order over the entries unchanged); with AVX-512 BF16 QK and PV on vdpbf16ps
    where the group has a multiple of 16 heads (bf16_dot.py). CUDA: 8 heads per thread block
    and as many staged fp32 rows as fit 16 KiB (8 at d = 512), so staged rows, accumulator
    (8 x d) and logits stay within 48 KiB of static shared memory; q is read from global
    memory (L1)."""
    if target.is_cuda:
        hg = math.gcd(h, 8)
        rows = max(1, min(ATTN_BLOCK, 16384 // (4 * d)))
        rows = 1 << (rows.bit_length() - 1)  # a power of two, so it divides 64
        return SparseAttendConfig(heads_per_group=hg, stage_rows=rows, vector=1,
                                  unroll_rows=1, threads=256)
    cores = int(target.target.get("num-cores", 1))
    avx512 = has_avx512(target)
    # the hand-vectorised staging on AVX2 too (its FP4 lookup in two 8-lane halves, bit for
    # bit): Zen 4 running the cpu-avx2 code, bench size, one row, 2 threads, min of 40
    # interleaved calls, against the per-element staging blocks: 0.713 -> 0.641 ms and, in a
    # slower minute, 0.786 -> 0.722
    vector_decode = (avx512 or has_features(target, "avx2", "fma")) and d % 16 == 0
    bf16 = vector_decode and has_avx512_bf16(target) and d % 32 == 0
    tiles = bf16 and has_amx_bf16(target) and h % AMX_TILE == 0 and d % AMX_TILE == 0
    per_group = AMX_TILE if tiles else 16  # AMX: groups of 32 heads (2 x 2 tiles of 16)
    groups = max(1, min(cores, h // per_group))
    while h % groups:
        groups -= 1
    hg = h // groups
    return SparseAttendConfig(heads_per_group=hg, stage_rows=ATTN_BLOCK, vector=16,
                              unroll_rows=8 if avx512 else 2, threads=1,
                              pv_heads=4, pv_cols=64 if avx512 else 16,
                              decode_lanes=16 if avx512 else 8,
                              vector_decode=vector_decode, bf16_dot=bf16 and hg % 16 == 0,
                              amx_dot=tiles and hg % AMX_TILE == 0)
