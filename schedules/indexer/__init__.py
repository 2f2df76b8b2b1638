"""The indexer kernels: the MXFP4 index-key sweep and the exact top-k selections behind
`indexer_topk`, `hier_topk` and `pool_topk` (graph/ops.py).

Each op is two or three PrimFuncs, which Relax calls in sequence:

- a SWEEP writes bf16 scores, bit-identical to `ops.index_scores` (the pool sweep scores only the
  pool's B * block_size positions per query);
- a SELECT turns scores into positions (or candidate blocks): top-k, ties to the lower position,
  -inf dropped, ascending, -1 padded.

Numerics of the sweep (why the scores are bit-exact): q and the decoded keys are E2M1 x 2^e, so
every product is exact in fp32 and a D-long dot product is exact as long as the product exponents
span fewer than ~9 binades (true for the model's data; then summation order cannot matter); it is
rounded once to bf16 like the oracle's bf16 einsum (fp32 accumulate). relu, times the bf16 weight
(exact fp32 product) rounded to bf16, then the head sum in fp32 in torch's CPU reduction order:
sequential sums over chunks of 16 heads, chunk sums added in order (ATen's `multi_row_sum`), and one
final rounding to bf16. Outside that exponent span the oracle's own GEMM order decides ties at a
bf16 rounding boundary, which a kernel cannot reproduce.

The selection is exact: bf16 scores map to order-preserving 16-bit keys, so a two-pass radix
histogram (high byte, then low byte) finds the k-th key exactly; a final in-order scan emits every
entry above it plus the lowest-position entries equal to it, which yields the positions already
ascending and the tie rule for free. No sort is needed. On CPU a parallel, vectorised pass first
takes the maximum of every group of 32 entries; the k-th largest group maximum bounds the k-th
largest entry from below, so the radix passes and the emit visit only the groups that reach it
(about k groups: 0.7 ms instead of 20 ms for one 1M-entry row).

The CPU full sweep on AVX-512 is hand-vectorised (`make_index_scores_avx512`): a GEMM per key
tile with the FP4 keys decoded once per tile by an in-register transpose and a 16-entry table
lookup; with VNNI the GEMM is on int8 (q is E2M1 x 2^e per block after its QDQ, so it is int8 x
2^e exactly; per-block integer dots are exact, hence the same bits), falling back to fp32 for a q
that is not; with AMX (or, without it, AVX-512 VBMI) the block scales fold into int8 shifts
so that one int32 dot covers all of D. Everywhere else (pool sweep, CUDA, CPUs without
AVX-512) the sweep is the block definition below plus a schedule.

Scores are written over T rounded up to SCORE_PAD (entries past T are -inf), so every tile of the
sweep is whole: no predicates in the vector loops and compact per-tile buffers.
"""

from dsv41.schedules.indexer.amx_sweep import (
    AMX_EXP_HI,
    AMX_EXP_LO,
    AMX_HEADS,
    AMX_TILE,
)
from dsv41.schedules.indexer.build import (
    build_hier_topk,
    build_indexer_topk,
    build_pool_topk,
    example_inputs_hier_topk,
    example_inputs_indexer_topk,
    example_inputs_pool_topk,
    index_sweep,
)
from dsv41.schedules.indexer.configs import (
    SelectConfig,
    SweepConfig,
    schedule_index_scores,
    select_config,
    sweep_config,
)
from dsv41.schedules.indexer.pool import (
    emit_pool_scores,
    make_pool_gather,
    make_pool_mask,
    make_pool_scores,
    pool_gathers,
    schedule_pool_gather,
    schedule_pool_mask,
)
from dsv41.schedules.indexer.select import (
    NEG_KEY,
    POS_INF_KEY,
    make_select,
)
from dsv41.schedules.indexer.sweep import (
    HEAD_CHUNK,
    MAX_ALT,
    SCORE_PAD,
    make_index_scores,
    padded,
)
from dsv41.schedules.indexer.x86_sweep import (
    avx512_sweep_supported,
    make_index_scores_avx512,
)

__all__ = [
    "AMX_EXP_HI",
    "AMX_EXP_LO",
    "AMX_HEADS",
    "AMX_TILE",
    "avx512_sweep_supported",
    "build_hier_topk",
    "build_indexer_topk",
    "build_pool_topk",
    "emit_pool_scores",
    "example_inputs_hier_topk",
    "example_inputs_indexer_topk",
    "example_inputs_pool_topk",
    "HEAD_CHUNK",
    "index_sweep",
    "make_index_scores",
    "make_index_scores_avx512",
    "make_pool_gather",
    "make_pool_mask",
    "make_pool_scores",
    "make_select",
    "MAX_ALT",
    "NEG_KEY",
    "padded",
    "pool_gathers",
    "POS_INF_KEY",
    "schedule_index_scores",
    "schedule_pool_gather",
    "schedule_pool_mask",
    "SCORE_PAD",
    "select_config",
    "SelectConfig",
    "sweep_config",
    "SweepConfig",
]
