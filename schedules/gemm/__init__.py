"""Block-scaled GEMMs and dequantisation: `fp8_linear`, the decode `dense_gemv`, `fp8_dequant`
(oracles in graph/ops.py, number formats in graph/formats.py; the routed experts' chain, which
shares this arithmetic: schedules/moe/).

Arithmetic shared by the GEMMs, and why it matches the oracle:

* Activations are quantised to FP8 per 32 along K exactly as `formats.torch_quant_fp8`: fp32
  amax floored at 1e-4, E8M0 byte = exponent(amax * fp32(1/448)) + (mantissa != 0), ratio
  clamped to +-448, E4M3 round-to-nearest-even. Every step is integer bit work or an exact
  power-of-two product (never an fp division or an LLVM fp8 cast), so it is bit-exact on CPU
  and with nvcc's fast math.
* The kernels keep the activation as its dequantised fp32 value `q * 2^s` (exact). Scaling all
  terms of an fp32 sum by a power of two scales every rounding with it, so
  `sum(q * 2^s * w) == sum(q * w) * 2^s` bit for bit; the oracle's `(A_k @ B_k^T) * a_s` is
  therefore reproduced without a separate activation-scale multiply.
* y = sum over K blocks, in block order from 0, of `partial_k * b_s`; every product of two
  decoded values is exact in fp32, so the only difference to the oracle is the order of the 32
  additions inside a block (torch's matmul picks its own): ~1 ulp of fp32 on a few partial
  sums, which shows up as 1 bf16 ulp on a small fraction of outputs.
* The CPU decode GEMV (`make_fp8_gemv`; on x86 at K <= 2048 `make_fp8_gemv_avx2`, the
  same arithmetic hand-vectorised on 256- or 512-bit vectors) folds the weight scales (and
  the 2^8 of its fp16 weight decode) into the activation instead (again exact products) and
  sums all of K at once, in vector lanes added pairwise at the end: a different order of fp32
  additions, with the same bound against the oracle.
* On AVX-512 BF16 (+ VBMI) targets, at any K a multiple of 64, the decode GEMV and the verify /
  draft row groups are one kernel (`bf16_gemv.make_fp8_gemv_bf16`): each E4M3 code looked up as its
  exact bf16 value (two vpermi2b), the activation times the weight scale as an exact bf16, summed
  by vdpbf16ps; each row of a group bit-identical to the single-row kernel.
* Weights are decoded per tile (registers / local or shared memory), never as a full copy.

TVM 0.27 traps met here (worked around below): a bf16 Cast inside a `Let` value is compiled as
an integer conversion (so bf16 is widened on the bits, `bf16_to_f32`); unsigned compares against a
Let-bound var crash the simplifier (signed compares instead); an intermediate buffer sized by a
symbolic dim cannot live in a CUDA kernel (the CUDA fp8_linear fuses its quantisation stage;
schedules/moe/ passes the routed experts' token-sized buffers as arguments).
"""

from dsv41.schedules.gemm.amx import (
    amx_block_rows,
    make_dense_gemm_amx,
    make_fp8_linear_amx,
)
from dsv41.schedules.gemm.avx2_gemv import (
    MAX_ROWS,
    make_fp8_gemv_avx2,
    make_fp8_q_kv_avx2,
)
from dsv41.schedules.gemm.dense import (
    FP8_WEIGHT,
    DenseGemmConfig,
    DenseGemvConfig,
    build_dense_gemm,
    build_dense_gemv,
    dense_gemm_config,
    dense_gemm_reads_fp8,
    dense_gemm_rounds,
    dense_gemv_config,
    dense_gemv_is_bf16_dot,
    dense_gemv_rounds,
    make_dense_gemm,
    make_dense_gemv,
    make_dense_gemv_rows,
    schedule_dense_gemm,
    schedule_dense_gemv,
    unscheduled_dense_gemm,
)
from dsv41.schedules.gemm.dense_dot import bf16_dot_rows, make_dense_gemv_bf16_dot
from dsv41.schedules.gemm.dequant import (
    DequantConfig,
    build_fp8_dequant,
    dequant_config,
    make_fp8_dequant,
    schedule_dequant,
)
from dsv41.schedules.gemm.fp8 import (
    BLOCK,
    e4m3_round,
    fp8_code,
    fp8_qdq,
    fp8_qdq_rows,
    fp8_ratio,
    inv_pow2_scale,
    pow2_scale,
    pow2_scale_byte,
)
from dsv41.schedules.gemm.lanes import (
    arrange_lane_sum,
    lane_split,
    place_lane_sums,
    vector_sum,
)
from dsv41.schedules.gemm.linear import (
    VERIFY_GROUP_ROWS,
    Fp8LinearConfig,
    bf16_value,
    build_fp8_linear,
    build_fp8_q_kv,
    example_inputs_fp8_linear,
    fp8_linear_config,
    fp8_linear_norms,
    fp8_q_kv_fuses,
    make_fp8_gemv,
    make_fp8_linear,
    schedule_fp8_linear,
    unscheduled_fp8_linear,
)

__all__ = [
    "bf16_value",
    "FP8_WEIGHT",
    "amx_block_rows",
    "arrange_lane_sum",
    "BLOCK",
    "build_dense_gemm",
    "build_dense_gemv",
    "build_fp8_dequant",
    "build_fp8_linear",
    "build_fp8_q_kv",
    "dense_gemm_config",
    "dense_gemm_reads_fp8",
    "dense_gemm_rounds",
    "bf16_dot_rows",
    "dense_gemv_config",
    "dense_gemv_is_bf16_dot",
    "dense_gemv_rounds",
    "DenseGemmConfig",
    "DenseGemvConfig",
    "dequant_config",
    "DequantConfig",
    "e4m3_round",
    "example_inputs_fp8_linear",
    "fp8_code",
    "fp8_linear_config",
    "fp8_linear_norms",
    "fp8_q_kv_fuses",
    "fp8_qdq",
    "fp8_qdq_rows",
    "fp8_ratio",
    "Fp8LinearConfig",
    "inv_pow2_scale",
    "lane_split",
    "make_dense_gemm",
    "make_dense_gemm_amx",
    "make_dense_gemv",
    "make_dense_gemv_bf16_dot",
    "make_dense_gemv_rows",
    "make_fp8_dequant",
    "make_fp8_gemv",
    "make_fp8_gemv_avx2",
    "make_fp8_q_kv_avx2",
    "make_fp8_linear",
    "make_fp8_linear_amx",
    "MAX_ROWS",
    "place_lane_sums",
    "pow2_scale",
    "pow2_scale_byte",
    "schedule_dense_gemm",
    "schedule_dense_gemv",
    "schedule_dequant",
    "schedule_fp8_linear",
    "unscheduled_dense_gemm",
    "unscheduled_fp8_linear",
    "vector_sum",
    "VERIFY_GROUP_ROWS",
]
