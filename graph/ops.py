"""Custom ops of the model graph, registered with `torch.library` in the namespace `dsv41`.

Each op is one kernel in `schedules/`; the body registered here is its plain-PyTorch reference (the
oracle every kernel is tested against), and each has a fake kernel so `torch.export` can capture
it. Boundaries are chosen so that the graph around them is plain aten:

- `fp8_linear`:    FP8 activation quantisation + block-scaled FP8 GEMM (weights in 32x32 tiles)
- `norm_fp8_linear`: the same of an RMS-normed input
- `fp8_linear_pair`: two of them of one input (one activation quantisation)
- `swiglu_fp8_linear`: the same of the SwiGLU of two inputs (the shared expert's w2)
- `fp8_q_kv`:      the attention's query (wq_a, q_norm, wq_b) and KV (wkv) projections
- `fp8_dequant`:   E4M3 codes + E8M0 scales -> values
- `fp8_grouped_linear`: the grouped o-projection over `wo_a` kept in FP8 (dequantised inside)
- `sparse_attend`: gather FP8 window entries and FP4 global entries, dequantise inside, online
                   softmax with the sink; index -1 is skipped
- `sparse_attend_rope`: the same between the queries' RoPE and the output's inverse RoPE
- `indexer_topk`:  MXFP4 index-K sweep (relu, head-weighted sum) + top-k, ties to the lower position
- `indexer_topk_shared`: the same, each token over the store the shared index-K pointer names
- `hier_topk`:     the candidate source's sweep + candidate blocks + its own top-k
- `pool_topk`:     a Reindex layer's sweep restricted to the candidate pool + top-k
- `route_topk`:    the MoE router's top-k experts of the biased scores and their weights
- `route_topk_logits`: the same from the gate's logits (the sqrt-softplus score inside)
- `moe_experts`:   the routed FP4 experts for the selected ids
- `moe_experts_plus`: the same plus the shared expert's output, rounded to bf16
- `scatter_rows`:  cache writes: rows into given rows of a store or ring (compiled in place)
- `rms_norm`:      RMSNorm of bf16 rows with a bf16 weight
- `rope`:          RoPE on the last rd dims of bf16 rows (the rest copied)
- `hc_pre_mix`:    a sublayer's mHC mixes of the stream + its collapse (lagged pre) + RMSNorm
- `hc_post`:       the sublayer's output mixed back into the hc streams
- `hc_post_pre_mix`: `hc_post` then the next sublayer's `hc_pre_mix`, one kernel
- `rope_quant`:    a new cache entry's RMSNorm (optional), RoPE and quantiser in one kernel
- `rope_quant_rows`: the same entries written into rows of a cache in place (one kernel)
- `rope_quant_window`: a chunk's window entries after a copy of the ring, and into its slots
- `engram_rows`:   an Engram layer's table rows at the chunk's hash ids (no kernel: compiled, it
                   is a call of the host runtime, which keeps the tables in host memory and
                   gathers the rows ahead of the block that reads them, `runtime.engram_host`)

The oracles reproduce the released reference kernels' arithmetic (block order, bf16 rounding
points) so that the graph matches the released model to its own noise floor.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from dsv41.graph import formats as fmt
from dsv41.graph import layers

FP8_BLOCK = 32
ATTN_BLOCK = 64  # the reference sparse-attention kernel walks indices in blocks of 64
NEG_INF = float("-inf")


# ---- cache writes ----------------------------------------------------------------------------


@torch.library.custom_op("dsv41::scatter_rows", mutates_args=())
def scatter_rows(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """dst with dst[b, idx[b, g]] = rows[b, g] wherever 0 <= idx[b, g] < dst.size(1) (-1: no
    write). dst (b, n, d), idx int64 (b, g) with distinct entries >= 0 per row, rows (b, g, d)
    of dst's dtype. Functional here (the oracle returns a new tensor); the compiled kernel
    writes the g rows into dst's own buffer (`call_tir_inplace`), so a cache write costs its
    rows, not the store."""
    if dst.dim() != 3 or rows.dim() != 3 or idx.dim() != 2:
        raise ValueError("scatter_rows takes dst (b, n, d), idx (b, g) and rows (b, g, d).")
    out = dst.clone()
    bi, gi = ((idx >= 0) & (idx < dst.size(1))).nonzero(as_tuple=True)
    out[bi, idx[bi, gi]] = rows[bi, gi].to(dst.dtype)
    return out


@scatter_rows.register_fake
def _(dst, idx, rows):
    return torch.empty_like(dst)


# ---- RMSNorm ---------------------------------------------------------------------------------


@torch.library.custom_op("dsv41::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.rms_norm` of bf16 rows x (..., d) with a bf16 weight (d,): bf16 (..., d)."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"dsv41::rms_norm takes bf16 x and weight, got {x.dtype} and "
                         f"{weight.dtype}.")
    return layers.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("dsv41::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
         inverse: bool) -> torch.Tensor:
    """`layers.apply_rope` of bf16 x (b, s, d) or (b, s, h, d) with fp32 cos / sin
    (b or 1, s, rd/2): bf16 like x."""
    if x.dtype != torch.bfloat16 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"dsv41::rope takes bf16 x and fp32 cos / sin, got {x.dtype}, "
                         f"{cos.dtype} and {sin.dtype}.")
    if x.dim() not in (3, 4) or cos.shape != sin.shape or cos.dim() != 3 \
            or cos.size(0) not in (1, x.size(0)) or cos.size(1) != x.size(1) \
            or 2 * cos.size(2) != rd or not 0 < rd <= x.size(-1):
        raise ValueError(f"dsv41::rope needs x (b, s, [h,] d) and cos / sin (b or 1, s, rd/2) "
                         f"with 0 < rd <= d; got x {tuple(x.shape)}, cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}, rd {rd}.")
    return layers.apply_rope(x, cos, sin, rd, inverse)


@rope.register_fake
def _(x, cos, sin, rd, inverse):
    return torch.empty_like(x)


# ---- mHC (hyper-connections) -----------------------------------------------------------------


@torch.library.custom_op("dsv41::hc_pre_mix", mutates_args=())
def hc_pre_mix(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               pre_in: torch.Tensor, weight: torch.Tensor, hc: int, iters: int, norm_eps: float,
               hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's entry, as `model.block` composes it: the mixes of the stream h (b, s, hc, d)
    (`layers.hc_mixes`: pre, post (b, s, hc), comb (b, s, hc, hc), fp32) and the collapse with
    the *lagged* pre_in, normed: x = rms_norm(hc_pre(h, pre_in), weight) (b, s, d) bf16.
    Returns (x, pre, post, comb)."""
    pre, post, comb = layers.hc_mixes(h, fn, scale, base, hc, iters, norm_eps, hc_eps)
    x = layers.rms_norm(layers.hc_pre(h, pre_in), weight, norm_eps)
    return x, pre, post, comb


@hc_pre_mix.register_fake
def _(h, fn, scale, base, pre_in, weight, hc, iters, norm_eps, hc_eps):
    b, s, _, d = h.shape
    f32 = torch.float32
    return (h.new_empty(b, s, d), h.new_empty(b, s, hc, dtype=f32),
            h.new_empty(b, s, hc, dtype=f32), h.new_empty(b, s, hc, hc, dtype=f32))


@torch.library.custom_op("dsv41::hc_post", mutates_args=())
def hc_post(f: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """h'_j = post_j * f + sum_i comb[i, j] * h_i (`layers.hc_post`): (b, s, hc, d) bf16."""
    return layers.hc_post(f, h, post, comb)


@hc_post.register_fake
def _(f, h, post, comb):
    return torch.empty_like(h, dtype=f.dtype)


@torch.library.custom_op("dsv41::hc_post_pre_mix", mutates_args=())
def hc_post_pre_mix(f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    pre_in: torch.Tensor, weight: torch.Tensor, hc: int, iters: int,
                    norm_eps: float, hc_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """Between two sublayers: the first's exit `hc_post(f, h, post, comb)` -> h', then the
    second's entry `hc_pre_mix(h', ...)`. Returns (h', x, pre, post', comb'): one kernel
    (schedules/mhc.py) where the block had two."""
    hn = hc_post(f, h, post, comb)
    return (hn, *hc_pre_mix(hn, fn, scale, base, pre_in, weight, hc, iters, norm_eps, hc_eps))


@hc_post_pre_mix.register_fake
def _(f, h, post, comb, fn, scale, base, pre_in, weight, hc, iters, norm_eps, hc_eps):
    b, s, _, d = h.shape
    f32 = torch.float32
    return (torch.empty_like(h, dtype=f.dtype), h.new_empty(b, s, d),
            h.new_empty(b, s, hc, dtype=f32), h.new_empty(b, s, hc, dtype=f32),
            h.new_empty(b, s, hc, hc, dtype=f32))


# ---- block-scaled GEMMs ----------------------------------------------------------------------


def _block_scaled_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                       block: int) -> torch.Tensor:
    """sum over K blocks of (A_k @ B_k^T) * a_s[:, k] * b_s[:, k], added in K order in fp32.

    a [M, K] and b [N, K] hold exact low-precision values in fp32, so each block product is
    exact up to fp32 summation inside the block; the blocks are added sequentially as the
    released kernel does."""
    m, k = a.shape
    acc = torch.zeros(m, b.size(0), dtype=torch.float32)
    for j in range(k // block):
        sl = slice(j * block, (j + 1) * block)
        part = a[:, sl] @ b[:, sl].T
        part.mul_(a_s[:, j : j + 1]).mul_(b_s[:, j].unsqueeze(0))  # in place: same roundings
        acc += part
    return acc


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 activations [M, K] -> FP8 values and per-32 E8M0 scales, both as fp32."""
    codes, scales = fmt.torch_quant_fp8(x.float(), FP8_BLOCK)
    return fmt.torch_e4m3_decode(codes), fmt.torch_e8m0_decode(scales)


@torch.library.custom_op("dsv41::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T. x: bf16 [..., K]; weight: E4M3 codes uint8 [N, K]; scale: E8M0 uint8
    [ceil(N/32), K/32]. The activation is quantised to FP8 per 32 first. Returns bf16 [..., N]."""
    return _fp8_gemm_f32(x, weight, scale).to(torch.bfloat16)


def _fp8_gemm_f32(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k, n = x.size(-1), weight.size(0)
    a, a_s = _act_quant(x.reshape(-1, k))
    b = fmt.torch_e4m3_decode(weight)
    b_s = fmt.torch_e8m0_decode(scale).repeat_interleave(FP8_BLOCK, dim=0)[:n]
    return _block_scaled_gemm(a, a_s, b, b_s, FP8_BLOCK).reshape(*x.shape[:-1], n)


@fp8_linear.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.size(0), dtype=torch.bfloat16)


@torch.library.custom_op("dsv41::norm_fp8_linear", mutates_args=())
def norm_fp8_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear(rms_norm(x, norm_weight, eps), weight, scale)`: a projection of a normed
    activation nothing else reads (the query's wq_b). Compiled on an AVX-512 BF16 CPU, the
    decode GEMV norms its input itself (one kernel)."""
    return fp8_linear(rms_norm(x, norm_weight, eps), weight, scale)


@norm_fp8_linear.register_fake
def _(x, norm_weight, eps, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.size(0), dtype=torch.bfloat16)


@torch.library.custom_op("dsv41::swiglu_fp8_linear", mutates_args=())
def swiglu_fp8_linear(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear(swiglu(gate, up, limit) as bf16, weight, scale)`, gate and up bf16 [..., K]:
    the shared expert's down projection of its SwiGLU, which nothing else reads. Compiled on an
    AVX-512 BF16 CPU, the decode GEMV forms the SwiGLU as it stages its input (one kernel)."""
    h = swiglu(gate.float(), up.float(), limit).to(torch.bfloat16)
    return fp8_linear(h, weight, scale)


@swiglu_fp8_linear.register_fake
def _(gate, up, limit, weight, scale):
    return gate.new_empty(*gate.shape[:-1], weight.size(0), dtype=torch.bfloat16)


@torch.library.custom_op("dsv41::fp8_linear_pair", mutates_args=())
def fp8_linear_pair(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    weight2: torch.Tensor, scale2: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two projections of one activation: (fp8_linear(x, weight, scale), fp8_linear(x, weight2,
    scale2)) (the attention's wq_a and wkv; the shared expert's w1 and w3). Compiled on an
    AVX-512 BF16 CPU, one decode GEMV quantises x once and runs both matrices' tiles."""
    return fp8_linear(x, weight, scale), fp8_linear(x, weight2, scale2)


@fp8_linear_pair.register_fake
def _(x, weight, scale, weight2, scale2):
    lead = x.shape[:-1]
    return (x.new_empty(*lead, weight.size(0), dtype=torch.bfloat16),
            x.new_empty(*lead, weight2.size(0), dtype=torch.bfloat16))


@torch.library.custom_op("dsv41::fp8_q_kv", mutates_args=())
def fp8_q_kv(x: torch.Tensor, wq_a: torch.Tensor, sq_a: torch.Tensor, wkv: torch.Tensor,
             skv: torch.Tensor, q_norm: torch.Tensor, eps: float, wq_b: torch.Tensor,
             sq_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, kv) = (wq_b(rms_norm(wq_a x)), wkv x), each `fp8_linear`: the attention's
    projections where nothing else reads the query latent. Compiled on an AVX-512 BF16 CPU, the
    decode GEMVs of `fp8_linear_pair` and `norm_fp8_linear` in one kernel."""
    q_lora, kv = fp8_linear_pair(x, wq_a, sq_a, wkv, skv)
    return norm_fp8_linear(q_lora, q_norm, eps, wq_b, sq_b), kv


@fp8_q_kv.register_fake
def _(x, wq_a, sq_a, wkv, skv, q_norm, eps, wq_b, sq_b):
    lead = x.shape[:-1]
    return (x.new_empty(*lead, wq_b.size(0), dtype=torch.bfloat16),
            x.new_empty(*lead, wkv.size(0), dtype=torch.bfloat16))


@torch.library.custom_op("dsv41::fp8_linear_f32", mutates_args=())
def fp8_linear_f32(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear` before its bf16 rounding: fp32 [..., N]. A row-parallel worker's partial
    sum over its input columns (`model.row_parallel`), rounded once after the all-reduce."""
    return _fp8_gemm_f32(x, weight, scale)


@fp8_linear_f32.register_fake
def _(x, weight, scale):
    return x.new_empty(*x.shape[:-1], weight.size(0), dtype=torch.float32)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with FP4 E2M1 weights (packed uint8 [N, K/2], E8M0 per 32 inputs [N, K/32])
    and FP8 activations. Returns bf16. The expert op's inner GEMM."""
    k, n = x.size(-1), weight.size(0)
    a, a_s = _act_quant(x.reshape(-1, k))
    b = fmt.torch_e2m1_decode(fmt.torch_unpack_fp4(weight))
    y = _block_scaled_gemm(a, a_s, b, fmt.torch_e8m0_decode(scale), 32)
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], n)


@torch.library.custom_op("dsv41::fp8_dequant", mutates_args=())
def fp8_dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 codes [..., D] with E8M0 scales per 32 [..., D/32] -> fp32 [..., D]."""
    return fmt.torch_dequant_fp8(codes, scales, FP8_BLOCK)


@fp8_dequant.register_fake
def _(codes, scales):
    return codes.new_empty(codes.shape, dtype=torch.float32)


@torch.library.custom_op("dsv41::fp8_grouped_linear", mutates_args=())
def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x bf16 (b, s, g, d) times the grouped weight [g * r, d] stored as E4M3 codes with an E8M0
    scale per 32 x 32 tile -> bf16 (b, s, g, r): `einsum("bsgd,grd->bsgr")` over the weight
    dequantized to bf16 (each code times its tile's scale in fp32, rounded once: the BF16 that
    `inference/convert.py` writes for the hub's FP8 `wo_a`), i.e. the released model's grouped
    o-projection on the converted checkpoint, bit for bit."""
    b, s, g, d = x.shape
    w = fmt.torch_dequant_fp8_weight(weight, scale).to(torch.bfloat16)
    return torch.einsum("bsgd,grd->bsgr", x, w.view(g, -1, d))


@fp8_grouped_linear.register_fake
def _(x, weight, scale):
    b, s, g, d = x.shape
    return x.new_empty((b, s, g, weight.size(0) // g))


# ---- Engram table rows (host-resident tables) ---------------------------------------------

ENGRAM_ROWS_FUNC = "dsv41.engram_rows"  # the host function a compiled entry calls for them


@torch.library.custom_op("dsv41::engram_rows", mutates_args=())
def engram_rows(hash_ids: torch.Tensor, slot: int, table: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one Engram layer's table at the hash ids of its slot: hash_ids int64
    (b, s, E, cols) (every id already checked against the table by the caller), table uint8
    E4M3 codes (rows, ed), scale uint8 E8M0 (rows, ed/32) -> codes (b, s, cols, ed) and scales
    (b, s, cols, ed/32), on the table's device (exact copies: a gather)."""
    ids = hash_ids[:, :, slot].to(table.device)  # (b, s, cols)
    return table[ids], scale[ids]


@engram_rows.register_fake
def _(hash_ids, slot, table, scale):
    b, s, _, cols = hash_ids.shape
    return (table.new_empty((b, s, cols, table.size(1))),
            scale.new_empty((b, s, cols, scale.size(1))))


# ---- quantisers (each one kernel; the graph never bit-casts) -------------------------------


@torch.library.custom_op("dsv41::quant_fp8", mutates_args=())
def quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> E4M3 codes uint8 [..., D] + E8M0 scales uint8 [..., D/32] (window
    entries, activations)."""
    return fmt.torch_quant_fp8(x, FP8_BLOCK)


@quant_fp8.register_fake
def _(x):
    return (x.new_empty(x.shape, dtype=torch.uint8),
            x.new_empty(*x.shape[:-1], x.size(-1) // FP8_BLOCK, dtype=torch.uint8))


@torch.library.custom_op("dsv41::quant_fp4_kv", mutates_args=())
def quant_fp4_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> main-KV FP4: packed E2M1 uint8 [..., D/2] + E4M3 scales [..., D/16]."""
    return fmt.torch_quant_fp4_kv(x)


@quant_fp4_kv.register_fake
def _(x):
    return (x.new_empty(*x.shape[:-1], x.size(-1) // 2, dtype=torch.uint8),
            x.new_empty(*x.shape[:-1], x.size(-1) // 16, dtype=torch.uint8))


@torch.library.custom_op("dsv41::quant_mxfp4", mutates_args=())
def quant_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> index-K MXFP4: packed E2M1 uint8 [..., D/2] + E8M0 scales [..., D/32]."""
    return fmt.torch_quant_mxfp4(x)


@quant_mxfp4.register_fake
def _(x):
    return (x.new_empty(*x.shape[:-1], x.size(-1) // 2, dtype=torch.uint8),
            x.new_empty(*x.shape[:-1], x.size(-1) // 32, dtype=torch.uint8))


@torch.library.custom_op("dsv41::qdq_mxfp4", mutates_args=())
def qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """bf16 [..., D] -> MXFP4 quantise-dequantise -> bf16 (the indexer's queries)."""
    return fmt.torch_qdq_mxfp4(x)


@qdq_mxfp4.register_fake
def _(x):
    return torch.empty_like(x, dtype=torch.bfloat16)


class EntryFormat(StrEnum):
    """How a new cache entry is quantised (`rope_quant`): the quantiser op it ends in."""

    FP8 = "fp8"  # quant_fp8: the window's KV
    FP4_KV = "fp4_kv"  # quant_fp4_kv: the compressor's main KV
    MXFP4 = "mxfp4"  # quant_mxfp4: the index keys


ENTRY_GROUP = {EntryFormat.FP8: FP8_BLOCK, EntryFormat.FP4_KV: fmt.FP4_KV_BLOCK,
               EntryFormat.MXFP4: fmt.MXFP4_BLOCK}


def entry_code_width(form: EntryFormat, d: int) -> int:
    """Code bytes of a d-wide entry: one a value (FP8), one a pair (the FP4 formats)."""
    return d if form == EntryFormat.FP8 else d // 2


@torch.library.custom_op("dsv41::rope_quant", mutates_args=())
def rope_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, form: str,
               weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """New cache entries: `quant(rope(rms_norm(x, weight, eps), cos, sin, rd).float())` with the
    quantiser of `form` (an `EntryFormat`), the norm left out when weight is None. x bf16
    (b, s, d), cos / sin fp32 (b or 1, s, rd/2) -> codes uint8 (b, s, `entry_code_width`),
    scales uint8 (b, s, d / group): what `quant_fp8` / `quant_fp4_kv` / `quant_mxfp4` return
    for those values. One kernel (schedules/rope_quant.py) where the graph had three or four."""
    form = EntryFormat(form)
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        raise ValueError(f"dsv41::rope_quant takes bf16 x (b, s, d); got {x.dtype} "
                         f"{tuple(x.shape)}.")
    y = x if weight is None else rms_norm(x, weight, eps)
    y = rope(y, cos, sin, rd, False).float()
    if form == EntryFormat.FP8:
        return quant_fp8(y)
    return quant_fp4_kv(y) if form == EntryFormat.FP4_KV else quant_mxfp4(y)


@rope_quant.register_fake
def _(x, cos, sin, rd, form, weight, eps):
    form = EntryFormat(form)
    return (x.new_empty(*x.shape[:-1], entry_code_width(form, x.size(-1)), dtype=torch.uint8),
            x.new_empty(*x.shape[:-1], x.size(-1) // ENTRY_GROUP[form], dtype=torch.uint8))


@torch.library.custom_op("dsv41::rope_quant_rows", mutates_args=())
def rope_quant_rows(codes: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor,
                    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, form: str,
                    weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_quant`'s entries written into rows idx (b, s) int64 of a cache's codes (b, n,
    width) and scales (b, n, d / group), each as `scatter_rows` writes (-1 or a row outside the
    cache: none). Returns the updated tensors; compiled, one kernel writes the rows in place."""
    new_codes, new_scales = rope_quant(x, cos, sin, rd, form, weight, eps)
    return scatter_rows(codes, idx, new_codes), scatter_rows(scales, idx, new_scales)


@rope_quant_rows.register_fake
def _(codes, scales, idx, x, cos, sin, rd, form, weight, eps):
    return torch.empty_like(codes), torch.empty_like(scales)


@torch.library.custom_op("dsv41::rope_quant_window", mutates_args=())
def rope_quant_window(codes: torch.Tensor, scales: torch.Tensor, slot: torch.Tensor,
                      x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int, form: str,
                      weight: torch.Tensor | None, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's window entries (`rope_quant`'s) against a ring's codes (b, w, width) and
    scales (b, w, d / group): returns (the ring with rows slot (b, s) int64 rewritten, as
    `scatter_rows` writes them, its scales likewise, buf codes (b, w + s, width) = the ring as
    it was then the entries, buf scales). What the attention of a chunk longer than one token
    reads (its earlier queries still see the positions the chunk overwrites); compiled, one
    kernel that writes the ring in place."""
    new_codes, new_scales = rope_quant(x, cos, sin, rd, form, weight, eps)
    return (scatter_rows(codes, slot, new_codes), scatter_rows(scales, slot, new_scales),
            torch.cat([codes, new_codes], dim=1), torch.cat([scales, new_scales], dim=1))


@rope_quant_window.register_fake
def _(codes, scales, slot, x, cos, sin, rd, form, weight, eps):
    b, w, s = codes.size(0), codes.size(1), x.size(1)
    return (torch.empty_like(codes), torch.empty_like(scales),
            codes.new_empty(b, w + s, codes.size(2)), scales.new_empty(b, w + s, scales.size(2)))


# ---- sparse gather-attend ----------------------------------------------------------------------


def _gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table [b, n, ...], idx [b, s, k] (-1 allowed) -> [b, s, k, ...] with -1 rows zeroed."""
    b = table.size(0)
    if table.size(1) == 0:  # nothing stored yet: every index must be -1
        return table.new_zeros(*idx.shape, *table.shape[2:])
    batch = torch.arange(b).view(b, 1, 1)
    rows = table[batch, idx.long().clamp_min(0)]
    valid = (idx >= 0).view(*idx.shape, *([1] * (rows.dim() - 3)))
    return torch.where(valid, rows, torch.zeros((), dtype=rows.dtype))


def _gather_decoded(codes: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor, decode
                    ) -> torch.Tensor:
    """decode(rows idx of codes, scales) -> [b, s, k, d] fp32, -1 rows zero. Decoding is per row,
    so decoding the whole table and then gathering gives the same values as gathering the codes
    first; whichever decodes fewer rows is used (prefill: the table; decode: the selection)."""
    if codes.size(1) == 0 or codes.size(1) >= idx[0].numel():
        return _gather_rows(decode(codes, scales), idx)
    return decode(_gather_rows(codes, idx), _gather_rows(scales, idx))


def attend_blocks(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                  softmax_scale: float) -> torch.Tensor:
    """Online softmax over gathered entries in blocks of 64, as the released kernel does.

    q [b, s, h, d] bf16; kv [b, s, k, d] fp32 (invalid rows zero); valid [b, s, k] bool.
    Probabilities are rounded to bf16 before PV relative to the running max; the sink joins the
    denominator only. A row with no valid entry returns zeros."""
    b, s, h, d = q.shape
    qf = q.float()
    scale = torch.tensor(softmax_scale, dtype=torch.float32)
    acc = torch.zeros(b, s, h, d, dtype=torch.float32)
    denom = torch.zeros(b, s, h, dtype=torch.float32)
    run_max = torch.full((b, s, h), -1e30, dtype=torch.float32)
    for t in range(0, kv.size(2), ATTN_BLOCK):
        blk, ok = kv[:, :, t : t + ATTN_BLOCK], valid[:, :, t : t + ATTN_BLOCK]
        logits = torch.einsum("bmhd,bmkd->bmhk", qf, blk)
        logits = torch.where(ok.unsqueeze(2), logits, NEG_INF) * scale
        prev = run_max
        run_max = torch.maximum(prev, logits.amax(dim=-1))
        rescale = torch.exp(prev - run_max)
        p = torch.exp(logits - run_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)
        pv = torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), blk)
        acc = acc * rescale.unsqueeze(-1) + pv
    denom = denom + torch.exp(sink.float() - run_max)
    return (acc / denom.unsqueeze(-1)).to(torch.bfloat16)


@torch.library.custom_op("dsv41::sparse_attend", mutates_args=())
def sparse_attend(q: torch.Tensor, win_codes: torch.Tensor, win_scales: torch.Tensor,
                  win_idx: torch.Tensor, kv_codes: torch.Tensor, kv_scales: torch.Tensor,
                  kv_idx: torch.Tensor, sink: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Each query attends over (its window entries) ++ (its selected global entries).

    q: bf16 [b, s, h, d]. Window: FP8 codes uint8 [b, W, d] + E8M0 scales [b, W, d/32], rows
    win_idx int32 [b, s, w]. Global: FP4 codes uint8 [b, N, d/2] + E4M3 scales [b, N, d/16], rows
    kv_idx int32 [b, s, k]. -1 = skipped. K = V = the entry, shared by all heads. Returns bf16."""
    win = _gather_decoded(win_codes, win_scales, win_idx,
                          lambda c, sc: fmt.torch_dequant_fp8(c, sc, FP8_BLOCK))
    glob = _gather_decoded(kv_codes, kv_scales, kv_idx, fmt.torch_dequant_fp4_kv)
    kv = torch.cat([win, glob], dim=2)
    valid = torch.cat([win_idx >= 0, kv_idx >= 0], dim=2)
    return attend_blocks(q, kv, valid, sink, softmax_scale)


@sparse_attend.register_fake
def _(q, win_codes, win_scales, win_idx, kv_codes, kv_scales, kv_idx, sink, softmax_scale):
    return torch.empty_like(q, dtype=torch.bfloat16)


@torch.library.custom_op("dsv41::sparse_attend_rope", mutates_args=())
def sparse_attend_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
                       win_codes: torch.Tensor, win_scales: torch.Tensor, win_idx: torch.Tensor,
                       kv_codes: torch.Tensor, kv_scales: torch.Tensor, kv_idx: torch.Tensor,
                       sink: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """`sparse_attend` of the RoPE'd queries, its output rotated back: `rope(sparse_attend(
    rope(q, cos, sin, rd), ...), cos, sin, rd, inverse)`, the attention as the block runs it
    (q unrotated in, the output ready for the grouped o-projection). Compiled on a CPU, one
    kernel rotates q as it stages it and the output as it stores it."""
    o = sparse_attend(rope(q, cos, sin, rd, False), win_codes, win_scales, win_idx, kv_codes,
                      kv_scales, kv_idx, sink, softmax_scale)
    return rope(o, cos, sin, rd, True)


@sparse_attend_rope.register_fake
def _(q, cos, sin, rd, win_codes, win_scales, win_idx, kv_codes, kv_scales, kv_idx, sink,
      softmax_scale):
    return torch.empty_like(q, dtype=torch.bfloat16)


@torch.library.custom_op("dsv41::sparse_attend_bf16", mutates_args=())
def sparse_attend_bf16(q: torch.Tensor, win_codes: torch.Tensor, win_scales: torch.Tensor,
                       win_idx: torch.Tensor, kv: torch.Tensor, kv_idx: torch.Tensor,
                       sink: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """`sparse_attend` with an unquantised bf16 global cache [b, N, d]: what FP4 costs."""
    win = _gather_decoded(win_codes, win_scales, win_idx,
                          lambda c, sc: fmt.torch_dequant_fp8(c, sc, FP8_BLOCK))
    glob = _gather_rows(kv.float(), kv_idx)
    valid = torch.cat([win_idx >= 0, kv_idx >= 0], dim=2)
    return attend_blocks(q, torch.cat([win, glob], dim=2), valid, sink, softmax_scale)


@sparse_attend_bf16.register_fake
def _(q, win_codes, win_scales, win_idx, kv, kv_idx, sink, softmax_scale):
    return torch.empty_like(q, dtype=torch.bfloat16)


# ---- indexer ---------------------------------------------------------------------------------


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal scores the lower index wins (a stable descending
    sort, then the first k). Returns (values, indices)."""
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def index_scores(q: torch.Tensor, k_packed: torch.Tensor, k_scales: torch.Tensor,
                 weights: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """score[b, s, t] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, t]) in bf16, -inf where
    t >= lens[b, s] (not yet visible). q: bf16 [b, s, H, D] (already MXFP4 QDQ'd); k: MXFP4
    [b, T, D/2] + [b, T, D/32]; weights: bf16 [b, s, H] (scale folded in)."""
    k = fmt.torch_dequant_mxfp4(k_packed, k_scales).to(torch.bfloat16)  # (b, t, d)
    score = torch.einsum("bshd,btd->bsht", q, k)
    score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # (b, s, t)
    t = torch.arange(score.size(-1))
    return score.masked_fill(t >= lens.unsqueeze(-1), NEG_INF)


def _select(score: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k positions sorted ascending; unreachable (score -inf) -> -1. int32 [b, s, topk]."""
    k = min(topk, score.size(-1))
    vals, idx = stable_topk(score, k)
    idx = torch.where(vals > NEG_INF, idx, -1)
    # sort ascending with -1 last: map -1 to a large key, sort, map back
    big = score.size(-1)
    idx = torch.sort(torch.where(idx < 0, big, idx), dim=-1).values
    idx = torch.where(idx >= big, -1, idx)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], topk - k), -1)], dim=-1)
    return idx.to(torch.int32)


@torch.library.custom_op("dsv41::indexer_topk", mutates_args=())
def indexer_topk(q: torch.Tensor, k_packed: torch.Tensor, k_scales: torch.Tensor,
                 weights: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """A full sweep: score every visible entry, keep the top-k by score, return their positions
    ascending, -1 padded. lens int64 [b, s]: entries visible to each query."""
    return _select(index_scores(q, k_packed, k_scales, weights, lens), topk)


@indexer_topk.register_fake
def _(q, k_packed, k_scales, weights, lens, topk):
    return q.new_empty(q.size(0), q.size(1), topk, dtype=torch.int32)


def shared_index_k(k_packed: torch.Tensor, k_scales: torch.Tensor, alt_packed, alt_scales,
                   pick: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The index K each sequence reads through the released shared pointer: its own keys
    [b, T, ...] where pick[b] = 0, else the first T rows of alternate pick[b] - 1 (a store of
    a source with a ratio no larger, so at least T rows)."""
    t = k_packed.size(1)
    kc, ks = k_packed, k_scales
    for i, (ac, as_) in enumerate(zip(alt_packed, alt_scales, strict=True), start=1):
        use = (pick == i).view(-1, 1, 1)
        kc = torch.where(use, ac[:, :t], kc)
        ks = torch.where(use, as_[:, :t], ks)
    return kc, ks


def check_pick(pick: torch.Tensor, n_alt: int, b: int, s: int) -> None:
    """The host's check of a per-token index-K pointer before a sweep reads through it: int64
    (b, s), each value a store the sweep was given (0 = own, 1..n_alt = an alternate)."""
    if pick.dtype != torch.int64 or tuple(pick.shape) != (b, s):
        raise ValueError(f"pick must be int64 of shape ({b}, {s}) (one store per sequence and "
                         f"token); got {pick.dtype} of shape {tuple(pick.shape)}.")
    bad = (pick < 0) | (pick > n_alt)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"pick must lie in 0..{n_alt} (the own store or one of the {n_alt} "
                         f"alternates); got {int(pick[at])} at (sequence, token) {at}.")


@torch.library.custom_op("dsv41::indexer_topk_shared", mutates_args=())
def indexer_topk_shared(q: torch.Tensor, k_packed: torch.Tensor, k_scales: torch.Tensor,
                        alt_packed: list[torch.Tensor], alt_scales: list[torch.Tensor],
                        pick: torch.Tensor, weights: torch.Tensor, lens: torch.Tensor,
                        topk: int) -> torch.Tensor:
    """`indexer_topk` where each query token reads the keys its own pick names (pick int64
    [b, s]): the own store where pick[b, t] = 0, else the first T rows of alternate
    pick[b, t] - 1 (`shared_index_k`). A decode step has one token per sequence; a verify pass's
    tokens may differ (a token that completes a compression group moves the released shared
    index-K pointer). Each token's result is the one its decode step (s = 1) computes: per store
    named, the sweep of every query over that store, each token keeping its own. The compiled
    sweep reads the named stores where they lie, all tokens in one pass: no store is copied."""
    check_pick(pick, len(alt_packed), q.size(0), q.size(1))
    t = k_packed.size(1)
    out = None
    for option in torch.unique(pick).tolist() or [0]:  # [0]: no tokens
        kc, ks = ((k_packed, k_scales) if option == 0
                  else (alt_packed[option - 1][:, :t], alt_scales[option - 1][:, :t]))
        idx = _select(index_scores(q, kc, ks, weights, lens), topk)
        out = idx if out is None else torch.where((pick == option).unsqueeze(-1), idx, out)
    return out


@indexer_topk_shared.register_fake
def _(q, k_packed, k_scales, alt_packed, alt_scales, pick, weights, lens, topk):
    return q.new_empty(q.size(0), q.size(1), topk, dtype=torch.int32)


def candidate_blocks(score: torch.Tensor, lens: torch.Tensor, topk_blocks: int,
                     block_size: int) -> torch.Tensor:
    """Level one of the hierarchical indexer: block score = max over its visible positions
    (-inf padded), the block with the newest visible entry pinned to +inf, top `topk_blocks`
    (lower id on ties), blocks with no visible entry dropped. int32 [b, s, topk_blocks] ascending,
    -1 padded."""
    width = score.size(-1)
    padded = torch.nn.functional.pad(score, (0, -width % block_size), value=NEG_INF)
    blocks = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)  # (b, s, nb)
    nb = blocks.size(-1)
    last = torch.div(lens - 1, block_size, rounding_mode="floor")
    blocks = blocks.masked_fill(torch.arange(nb) == last.unsqueeze(-1), float("inf"))
    return _select(blocks, topk_blocks)


def pool_mask(blocks: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """Candidate block ids [b, s, B] (-1 padded) -> bool [b, s, width]: position in the pool."""
    nb = -(-width // block_size)
    hit = torch.zeros(*blocks.shape[:-1], nb + 1, dtype=torch.bool)
    ids = torch.where(blocks < 0, nb, blocks).long()
    hit.scatter_(-1, ids, True)
    return hit[..., :nb].repeat_interleave(block_size, dim=-1)[..., :width]


@torch.library.custom_op("dsv41::hier_topk", mutates_args=())
def hier_topk(q: torch.Tensor, k_packed: torch.Tensor, k_scales: torch.Tensor,
              weights: torch.Tensor, lens: torch.Tensor, topk: int, topk_blocks: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate source: a full sweep giving its own top-k, and the candidate pool (block ids)
    that the Reindex layers score inside.
    Returns (positions [b, s, topk], blocks [b, s, topk_blocks])."""
    score = index_scores(q, k_packed, k_scales, weights, lens)
    return (_select(score, topk),
            candidate_blocks(score, lens, topk_blocks, block_size))


@hier_topk.register_fake
def _(q, k_packed, k_scales, weights, lens, topk, topk_blocks, block_size):
    b, s = q.size(0), q.size(1)
    return (q.new_empty(b, s, topk, dtype=torch.int32),
            q.new_empty(b, s, topk_blocks, dtype=torch.int32))


@torch.library.custom_op("dsv41::pool_topk", mutates_args=())
def pool_topk(q: torch.Tensor, k_packed: torch.Tensor, k_scales: torch.Tensor,
              weights: torch.Tensor, lens: torch.Tensor, blocks: torch.Tensor, topk: int,
              block_size: int) -> torch.Tensor:
    """A Reindex layer: its own scores, restricted to the candidate pool, then top-k."""
    score = index_scores(q, k_packed, k_scales, weights, lens)
    score = score.masked_fill(~pool_mask(blocks, score.size(-1), block_size), NEG_INF)
    return _select(score, topk)


@pool_topk.register_fake
def _(q, k_packed, k_scales, weights, lens, blocks, topk, block_size):
    return q.new_empty(q.size(0), q.size(1), topk, dtype=torch.int32)


# ---- MoE -------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up with the training clamps: up to +-limit, gate to <= limit."""
    if limit > 0:
        up = torch.clamp(up, min=-limit, max=limit)
        gate = torch.clamp(gate, max=limit)
    return torch.nn.functional.silu(gate) * up


@torch.library.custom_op("dsv41::route_topk", mutates_args=())
def route_topk(scores: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
               route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice: ids int64 (n, k) = the k largest of scores + bias (`stable_topk`),
    weights fp32 (n, k) = scores at ids, divided by their sum + 1e-20 when `normalize` and
    k > 1, times `route_scale`. scores fp32 (n, E); bias fp32 (E,) or (n, E)."""
    if scores.dtype != torch.float32 or bias.dtype != torch.float32 or scores.dim() != 2 \
            or bias.shape not in ((scores.size(1),), scores.shape) \
            or not 0 < k <= scores.size(1):
        raise ValueError(f"dsv41::route_topk takes fp32 scores (n, E), bias (E,) or (n, E) and "
                         f"0 < k <= E; got {scores.dtype} {tuple(scores.shape)}, {bias.dtype} "
                         f"{tuple(bias.shape)}, k {k}.")
    _, ids = stable_topk(scores + bias, k)
    weights = scores.gather(1, ids)
    if normalize and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, ids


@route_topk.register_fake
def _(scores, bias, k, normalize, route_scale):
    n = scores.size(0)
    return scores.new_empty(n, k), scores.new_empty(n, k, dtype=torch.int64)


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    """The V4 router's score of a logit: sqrt(softplus(x))."""
    return torch.nn.functional.softplus(x).sqrt()


@torch.library.custom_op("dsv41::route_topk_logits", mutates_args=())
def route_topk_logits(logits: torch.Tensor, bias: torch.Tensor, k: int, normalize: bool,
                      route_scale: float, gate_temp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_topk` of the scores sqrt(softplus(logits / gate_temp)) (the sqrt-softplus
    router's; logits fp32 (n, E) from the gate): one kernel where the graph had the score's
    elementwise kernel and the top-k."""
    return route_topk(sqrt_softplus(logits / gate_temp), bias, k, normalize, route_scale)


@route_topk_logits.register_fake
def _(logits, bias, k, normalize, route_scale, gate_temp):
    n = logits.size(0)
    return logits.new_empty(n, k), logits.new_empty(n, k, dtype=torch.int64)


@torch.library.custom_op("dsv41::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor, w2: torch.Tensor,
                s2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Routed FP4 experts. x: bf16 [n, dim]; weights fp32 [n, k]; ids int64 [n, k]; expert
    weights stacked [E, out, in/2] uint8 with E8M0 scales [E, out, in/32]. Returns fp32 [n, dim]:
    sum over the chosen experts of weight * expert(x), added in expert-id order."""
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        xe = x[rows]
        h = swiglu(fp4_linear(xe, w1[e], s1[e]).float(), fp4_linear(xe, w3[e], s3[e]).float(),
                   swiglu_limit)
        h = weights[rows, slot, None] * h
        y[rows] += fp4_linear(h.to(torch.bfloat16), w2[e], s2[e])
    return y


@moe_experts.register_fake
def _(x, weights, ids, w1, s1, w3, s3, w2, s2, swiglu_limit):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dsv41::moe_experts_plus", mutates_args=())
def moe_experts_plus(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                     w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float,
                     shared: torch.Tensor) -> torch.Tensor:
    """`moe_experts` plus the shared expert's output (bf16 [n, dim]), rounded to bf16 once: the
    MoE's output as an unsharded block forms it, `(routed + shared).to(bf16)`. Compiled, the
    chain's last kernel adds and rounds (`moe_combine_plus`)."""
    y = moe_experts(x, weights, ids, w1, s1, w3, s3, w2, s2, swiglu_limit)
    return (y + shared).to(torch.bfloat16)


@moe_experts_plus.register_fake
def _(x, weights, ids, w1, s1, w3, s3, w2, s2, swiglu_limit, shared):
    return x.new_empty(x.shape, dtype=torch.bfloat16)
