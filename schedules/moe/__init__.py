"""`moe_experts` as a chain of PrimFuncs whose intermediates the caller allocates (CPU and CUDA).

A single-function kernel could not target CUDA: its routing tables and per-pair activations
would be sized by the token count, and a CUDA kernel cannot allocate them. Here every
token-sized buffer is an argument; Relax allocates them between the `call_tir`s that
`moe_experts_plan` lists. The chain (n tokens, P = n * topk (token, slot) pairs, NT row tiles):

1. `moe_route`     ids -> row_pair [P], token_rows [n, topk], tiles [NT, 3]. Serial and tiny (one
                   thread on CUDA): counts pairs per expert, places them sorted by expert (stable),
                   cuts each expert's run into tiles of `row_tile` rows (expert, first row, rows).
2. `moe_qdq_x`     x bf16 [n, dim] -> xq fp32: FP8 quantise-dequantise per 32, once per token.
3. `moe_gate_up`   per (tile, column block): gathered xq rows x decoded w1/w3 tiles, block-scaled
                   fp32 accumulation, h = bf16(weight * swiglu(bf16(gate), bf16(up))) -> [P, inter].
4. `moe_qdq_h`     h -> hq fp32 [P, inter] (the oracle's FP8 requantisation of the w2 input).
5. `moe_down`      per (tile, column block): hq rows x decoded w2 tile -> o = bf16 [P, dim].
6. `moe_combine`   y[i] = sum of token i's rows of o in expert-id order from 0, fp32 [n, dim].

CPU decode on AVX-512 (`fused_decode`) runs the chain as two calls: `moe_gate_up_route` (1-3;
`moe_gate_up_route_topk` / `_gate` also the router's top-k / the gate's logits before it) and
`moe_down_combine(_plus)` (4-6), the same macros on the calling thread around the GEMV tasks, so
each is bit for bit the kernels it stands for (only the GEMVs are parallel; the rest is a few
thousand operations per token).

CPU prefill (`fused_tiles`, any CPU) runs the tile kernels as two calls too, of the same
names: `moe_gate_up_route` (1-3: row_pair, token_rows, tiles, h) and `moe_down_combine(_plus)`
(4-6, reading h, tiles and token_rows). Each is one PrimFunc holding the blocks of the kernels
it stands for, from the same stage macros, scheduled by the same steps (`tiles_pair`), so bit
for bit those kernels; xq, hq and o are allocated inside. CUDA keeps the six calls.

Numerics are those of schedules/gemm/'s block-scaled GEMMs (see its module docstring): activations
carried as their exact dequantised fp32 value, 32-blocks added in K order times the weight
scale, bf16 rounding where the oracle rounds. NT = ceil(P / row_tile) + min(P, E) bounds the
tile count: each non-empty expert adds at most one partial tile, and at most min(P, E) experts
are non-empty, so decode (P = topk) launches a handful of tiles, not E.
"""

from dsv41.schedules.moe.avx512_gemv import (
    GEMV_PREFETCH,
    make_moe_down_gemv_avx512,
    make_moe_gate_up_gemv_avx512,
)
from dsv41.schedules.moe.avx512_rows import (
    MAX_TILE_ROWS,
    make_moe_down_rows_avx512,
    make_moe_gate_up_rows_avx512,
)
from dsv41.schedules.moe.configs import (
    MoeSplitConfig,
    moe_split_config,
    schedule_moe_combine,
    schedule_moe_down_combine,
    schedule_moe_gate_up_route,
    schedule_moe_gemm,
    schedule_moe_gemv,
    schedule_moe_qdq,
    schedule_moe_route,
)
from dsv41.schedules.moe.experts import (
    make_moe_down,
    make_moe_down_gemv,
    make_moe_gate_up,
    make_moe_gate_up_gemv,
)
from dsv41.schedules.moe.plan import (
    MoeBuffer,
    MoeCall,
    MoePlan,
    build_moe_experts_split,
    emit_moe_experts,
    example_inputs_moe_experts,
    fused_chain,
    fused_decode,
    fused_tiles,
    moe_experts_plan,
)
from dsv41.schedules.moe.route import (
    check_expert_ids,
    make_moe_combine,
    make_moe_qdq,
    make_moe_route,
    num_tiles,
)
from dsv41.schedules.moe.tiles_pair import (
    fused_tiles_funcs,
    make_moe_down_combine_tiles,
    make_moe_gate_up_route_tiles,
)

__all__ = [
    "build_moe_experts_split",
    "check_expert_ids",
    "emit_moe_experts",
    "example_inputs_moe_experts",
    "fused_chain",
    "fused_decode",
    "fused_tiles",
    "fused_tiles_funcs",
    "GEMV_PREFETCH",
    "make_moe_combine",
    "make_moe_down",
    "make_moe_down_combine_tiles",
    "make_moe_down_rows_avx512",
    "make_moe_gate_up_rows_avx512",
    "MAX_TILE_ROWS",
    "make_moe_down_gemv",
    "make_moe_down_gemv_avx512",
    "make_moe_gate_up",
    "make_moe_gate_up_route_tiles",
    "make_moe_gate_up_gemv",
    "make_moe_gate_up_gemv_avx512",
    "make_moe_qdq",
    "make_moe_route",
    "moe_experts_plan",
    "moe_split_config",
    "MoeBuffer",
    "MoeCall",
    "MoePlan",
    "MoeSplitConfig",
    "num_tiles",
    "schedule_moe_combine",
    "schedule_moe_down_combine",
    "schedule_moe_gate_up_route",
    "schedule_moe_gemm",
    "schedule_moe_gemv",
    "schedule_moe_qdq",
    "schedule_moe_route",
]
