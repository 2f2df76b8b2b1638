"""What every kernel shares: the uint8 bit route for low-precision decoding, and a
bf16 rounding helper.

LLVM's fp8/fp4 casts are wrong near zero and at NaN (../shared/TVM.md §2), so every decode goes
through integer bit manipulation on uint32 lanes; the results are bit-exact to `graph.formats`.
"""

from dsv41.schedules.common.decoders import (
    e4m3_to_f16_bits,
    e4m3_to_f32,
    e4m3_to_f32_select,
    e8m0_byte,
    e8m0_to_f32,
    f16_bits_to_f32,
    fp4_element,
    fp4_pair_f16_bits,
    fp4_to_f32,
    fp4_to_f32_select,
)
from dsv41.schedules.common.exprs import (
    bf16_of,
    bf16_to_f32,
    i64,
    idx,
    let,
    round_bf16,
    round_bf16_bound,
    round_bf16_finite,
    silu_times,
    u32,
)
from dsv41.schedules.common.tvmscript import fast_macro_parser_lookup
from dsv41.schedules.common.x86 import (
    AMX_BYTES,
    AMX_ROWS,
    BF16_DOT_LL,
    amx,
    amx_configure,
    amx_dot_2x2,
    bf16_bits_of_exact,
    bf16_pair_halves,
    dpbf16ps,
    dpbf16ps_by_fma,
    fma16,
    has_amx_bf16,
    has_avx512,
    has_avx512_bf16,
    has_features,
    pairwise_lane_sum,
    permps,
    prefetch,
    with_bf16_dot,
)

__all__ = [
    "amx",
    "AMX_BYTES",
    "amx_configure",
    "amx_dot_2x2",
    "AMX_ROWS",
    "BF16_DOT_LL",
    "bf16_bits_of_exact",
    "bf16_pair_halves",
    "bf16_to_f32",
    "dpbf16ps",
    "dpbf16ps_by_fma",
    "e4m3_to_f16_bits",
    "e4m3_to_f32",
    "e4m3_to_f32_select",
    "e8m0_byte",
    "e8m0_to_f32",
    "f16_bits_to_f32",
    "fma16",
    "fp4_element",
    "fp4_pair_f16_bits",
    "fp4_to_f32",
    "fp4_to_f32_select",
    "has_amx_bf16",
    "has_avx512",
    "has_avx512_bf16",
    "has_features",
    "i64",
    "idx",
    "let",
    "pairwise_lane_sum",
    "permps",
    "prefetch",
    "bf16_of",
    "round_bf16",
    "round_bf16_bound",
    "round_bf16_finite",
    "silu_times",
    "u32",
    "with_bf16_dot",
]

fast_macro_parser_lookup()  # every kernel factory imports this package (tvmscript.py says why)
