"""The official checkpoint's tensor layout: the one contract between the released files, the
conformance checkpoints, the seeded checkpoints the benches use and the compiled graph.

Returned representation ("the uint8 bit route" used across dsv41): F8_E4M3, F8_E8M0 and I8
(packed FP4) tensors come back as `torch.uint8` views of the file's bytes, BF16 as
`torch.bfloat16`, F32 as `torch.float32`. Nothing is converted: the low-precision decoders in
`graph.formats` work on the raw bytes, and the tensors stay views of the memory-mapped files.

`param_spec` covers the text model. The vision tower's tensors (`vision.*`, `aligner.*`,
`image_*`, the gates' `bias_vl`: `vision_spec`) are optional.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from dsv41.graph.config import ModelArgs
from dsv41.graph.plan import LayerPlan, build_plan

# where the CLI keeps the seeded checkpoints of the presets (`dsv41 run`, `bench`, `tune`, `serve`)
DEFAULT_CHECKPOINTS = Path("artifacts") / "checkpoints"

GiB = 1 << 30
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_TILE = 32  # one E8M0 scale per 32x32 FP8 weight tile
FP4_GROUP = 32  # one E8M0 scale per 32 logical FP4 inputs
ENGRAM_GROUP = 32  # one E8M0 scale per 32 entries of an Engram table row

# ---- kinds: how a stored tensor is to be read (tensors.json "kind") -------------------------
BF16 = "bfloat16"
F32 = "float32"
FP8 = "fp8_e4m3"
E8M0 = "e8m0_scale"
FP4 = "fp4_e2m1_packed_x2"
BF16_FP32 = "bf16_in_checkpoint_fp32_in_reference"

# kind -> (safetensors dtype, dtype the reference holds the parameter in)
_KINDS = MappingProxyType({
    BF16: ("BF16", "bfloat16"),
    F32: ("F32", "float32"),
    FP8: ("F8_E4M3", "float8_e4m3fn"),
    E8M0: ("F8_E8M0", "float8_e8m0fnu"),
    FP4: ("I8", "float4_e2m1fn_x2"),
    BF16_FP32: ("BF16", "float32"),
})

# safetensors dtype -> bytes per element, for every dtype a header may carry
ITEMSIZE = MappingProxyType({
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
})
# safetensors dtype -> the torch dtype load_checkpoint returns (the uint8 bit route)
RETURNED_DTYPES = MappingProxyType({
    "F8_E4M3": torch.uint8, "F8_E8M0": torch.uint8, "I8": torch.uint8,
    "BF16": torch.bfloat16, "F32": torch.float32,
})


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the checkpoint as stored (dtype, shape) and as meant (logical shape, kind).
    The two shapes differ only for packed FP4, which holds two logical columns per byte."""

    dtype: str  # safetensors dtype: BF16, F32, F8_E4M3, F8_E8M0 or I8
    shape: tuple[int, ...]  # stored shape
    logical_shape: tuple[int, ...]  # [out, in] of the values the bytes encode
    kind: str  # bfloat16, float32, fp8_e4m3, e8m0_scale, fp4_e2m1_packed_x2, bf16_in_checkpoint_...

    @property
    def reference_dtype(self) -> str:
        """The dtype the released reference code holds this parameter in (tensors.json)."""
        return _KINDS[self.kind][1]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


# =============================================================================================
# Layout
# =============================================================================================

Entries = list[tuple[str, TensorSpec]]


def _plain(name: str, shape: tuple[int, ...], kind: str) -> Entries:
    return [(name, TensorSpec(_KINDS[kind][0], shape, shape, kind))]


def _scale(name: str, shape: tuple[int, ...]) -> Entries:
    return _plain(name, shape, E8M0)


def _linear(prefix: str, out: int, inp: int, fmt: str) -> Entries:
    """`prefix.weight` [out, in] in storage format `fmt` plus its `.scale` where quantised.
    fmt: 'fp8' (32x32 tiles), 'fp4' (packed, 32 inputs per scale), or a plain kind."""
    if fmt == "fp8":
        return _plain(f"{prefix}.weight", (out, inp), FP8) + _scale(
            f"{prefix}.scale", (math.ceil(out / FP8_TILE), math.ceil(inp / FP8_TILE)))
    if fmt == "fp4":
        packed = TensorSpec("I8", (out, inp // 2), (out, inp), FP4)
        return [(f"{prefix}.weight", packed)] + _scale(f"{prefix}.scale", (out, inp // FP4_GROUP))
    return _plain(f"{prefix}.weight", (out, inp), fmt)


def _default_format(args: ModelArgs) -> str:
    """Linear layers without an explicit dtype follow `ModelArgs.dtype`."""
    return "fp8" if args.dtype == "fp8" else BF16


def _expert_format(args: ModelArgs) -> str:
    """Routed experts are FP4 when `expert_dtype` says so, else like every other Linear."""
    return "fp4" if args.expert_dtype == "fp4" else _default_format(args)


def _hc_entries(args: ModelArgs, p: str) -> Entries:
    mix, width = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
    out: Entries = []
    for part, shape in (("fn", (mix, width)), ("base", (mix,)), ("scale", (3,))):
        for sub in ("attn", "ffn"):
            out += _plain(f"{p}hc_{sub}_{part}", shape, F32)
    return out


def _attn_entries(args: ModelArgs, p: str, layer: LayerPlan) -> Entries:
    """Attention; the compressor only on KV sources, the indexer only on index sources, and the
    index-K weights only where both meet (the owner of index K)."""
    a, fmt = args, _default_format(args)
    hd = a.head_dim
    out = _plain(f"{p}attn.attn_sink", (a.n_heads,), F32)
    out += _linear(f"{p}attn.wq_a", a.q_lora_rank, a.dim, fmt)
    out += _plain(f"{p}attn.q_norm.weight", (a.q_lora_rank,), BF16)
    out += _linear(f"{p}attn.wq_b", a.n_heads * hd, a.q_lora_rank, fmt)
    out += _linear(f"{p}attn.wkv", hd, a.dim, fmt)
    out += _plain(f"{p}attn.kv_norm.weight", (hd,), BF16)
    out += _linear(f"{p}attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups,
                   "fp8" if a.wo_a_dtype == "fp8" else BF16)
    out += _linear(f"{p}attn.wo_b", a.dim, a.o_groups * a.o_lora_rank, fmt)
    if layer.is_kv_source:
        # ratio > 1 pools in fp32, so the reference promotes those weights; ratio 1 stays bf16
        pooled = layer.ratio > 1
        out += _plain(f"{p}attn.compressor.norm.weight", (hd,), BF16)
        out += _linear(f"{p}attn.compressor.wkv", hd, a.dim, BF16_FP32 if pooled else BF16)
        if pooled:
            out += _linear(f"{p}attn.compressor.wgate", hd, a.dim, BF16_FP32)
    if layer.runs_indexer:
        ihd = a.index_head_dim
        out += _linear(f"{p}attn.indexer.wq_b", a.index_n_heads * ihd, a.q_lora_rank, fmt)
        out += _linear(f"{p}attn.indexer.weights_proj", a.index_n_heads, a.dim, BF16)
        if layer.owns_index_k:
            out += _linear(f"{p}attn.indexer.wk", ihd, hd, BF16)
            out += _plain(f"{p}attn.indexer.k_norm.weight", (ihd,), BF16)
    return out


def _ffn_entries(args: ModelArgs, p: str, layer_id: int) -> Entries:
    n_routed, _ = args.moe_config(layer_id)
    dim, inter, efmt = args.dim, args.moe_inter_dim, _expert_format(args)
    out = _linear(f"{p}ffn.gate", n_routed, dim, BF16)
    out += _plain(f"{p}ffn.gate.bias", (n_routed,), F32)
    for e in range(n_routed):
        out += _expert_entries(f"{p}ffn.experts.{e}", dim, inter, efmt)
    out += _expert_entries(f"{p}ffn.shared_experts", dim, inter, _default_format(args))
    return out


def _expert_entries(prefix: str, dim: int, inter: int, fmt: str) -> Entries:
    return (_linear(f"{prefix}.w1", inter, dim, fmt) + _linear(f"{prefix}.w2", dim, inter, fmt)
            + _linear(f"{prefix}.w3", inter, dim, fmt))


def _engram_entries(args: ModelArgs, p: str, layer_id: int) -> Entries:
    """Engram: the table is always FP8 with a scale per row group of 32 (not 32x32 tiles)."""
    a = args
    rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer_id)]
    hd = a.engram_head_dim
    out = _plain(f"{p}engram.q_weight", (a.hc_mult, a.dim), BF16)
    out += _plain(f"{p}engram.k_weight", (a.hc_mult, a.dim), BF16)
    out += _plain(f"{p}engram.embed.weight", (rows, hd), FP8)
    out += _scale(f"{p}engram.embed.scale", (rows, hd // ENGRAM_GROUP))
    n_cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads * hd
    out += _linear(f"{p}engram.wkv", a.dim * (a.hc_mult + 1), n_cols, _default_format(a))
    return out


def _block_entries(args: ModelArgs, p: str, layer: LayerPlan) -> Entries:
    out = _hc_entries(args, p) + _attn_entries(args, p, layer)
    out += _ffn_entries(args, p, layer.layer)
    if layer.engram:
        out += _engram_entries(args, p, layer.layer)
    out += _plain(f"{p}attn_norm.weight", (args.dim,), BF16)
    out += _plain(f"{p}ffn_norm.weight", (args.dim,), BF16)
    return out


def _dspark_entries(args: ModelArgs, stage: int, layer: LayerPlan) -> Entries:
    """A DSpark block; the first stage also projects the taps, the last one owns the heads.
    `mtp.j.embed` / `mtp.j.head` alias the trunk's and are not stored."""
    a, p = args, f"mtp.{stage}."
    out = _block_entries(args, p, layer)
    if stage == 0:
        taps = len(a.dspark_target_layer_ids)
        out += _linear(f"{p}main_proj", a.dim, a.dim * taps, _default_format(a))
        out += _plain(f"{p}main_norm.weight", (a.dim,), BF16)
    if stage == a.n_mtp_layers - 1:
        rank = a.dspark_markov_rank
        out += _plain(f"{p}norm.weight", (a.dim,), BF16)
        out += _plain(f"{p}markov_head.embed.weight", (a.vocab_size, rank), BF16)
        out += _plain(f"{p}markov_head.head.weight", (a.vocab_size, rank), BF16_FP32)
        out += _plain(f"{p}confidence_head.proj.weight", (1, a.dim + rank), BF16_FP32)
    return out


def param_spec(args: ModelArgs) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint for `args`, in the conformance `tensors.json`
    order: embedding, backbone layers, final norm and head, then the DSpark layers."""
    plan = build_plan(args)
    entries = _plain("embed.weight", (args.vocab_size, args.dim), BF16)
    for layer in plan.backbone:
        entries += _block_entries(args, f"layers.{layer.layer}.", layer)
    entries += _plain("norm.weight", (args.dim,), BF16)
    entries += _plain("head.weight", (args.vocab_size, args.dim), BF16_FP32)
    for stage, layer in enumerate(plan.dspark):
        entries += _dspark_entries(args, stage, layer)
    spec = dict(entries)
    assert len(spec) == len(entries), "param_spec produced a tensor name twice"
    return spec


# BF16 tensors of the layout that the hub's files ship as FP8 E4M3 plus an E8M0 `.scale` per
# square tile (`inference/convert.py` dequantizes them to BF16 for its demo). The loader accepts
# both forms and dequantizes the FP8 one once, at load, to the BF16 the graph uses.
RELEASE_FP8_SUFFIX = ".attn.wo_a.weight"
RELEASE_FP8_TILE = FP8_TILE  # the tile `checkpoint --layout release` writes (the hub's 32x32)


def scale_name(weight_name: str) -> str:
    """The name of a block-scaled weight's E8M0 scale (`....weight` -> `....scale`)."""
    return weight_name[: -len("weight")] + "scale"


def release_fp8_names(spec: dict[str, TensorSpec]) -> tuple[str, ...]:
    """The tensors of `spec` that a release (hub) checkpoint may store as FP8 + scale."""
    return tuple(n for n, s in spec.items() if n.endswith(RELEASE_FP8_SUFFIX) and s.kind == BF16)


def fp8_scale_tile(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """The square tile of an FP8 weight's E8M0 scale, read from the two shapes: the smallest
    power of two t with scale_shape == (ceil(out / t), ceil(in / t)), or None when there is
    none. Two powers of two that both fit cover each axis the same way (a larger one fits only
    where a whole axis lies in one tile), so the choice never changes the dequantized values."""
    if len(weight_shape) != 2 or len(scale_shape) != 2:
        return None
    t = 1
    while t <= 2 * max(weight_shape, default=1):
        if scale_shape == (math.ceil(weight_shape[0] / t), math.ceil(weight_shape[1] / t)):
            return t
        t *= 2
    return None


def release_spec(args: ModelArgs, tile: int = RELEASE_FP8_TILE) -> dict[str, TensorSpec]:
    """The layout of the hub's checkpoint: `param_spec` with each `release_fp8_names` tensor
    stored as FP8 E4M3 plus its E8M0 `.scale` of `tile` x `tile` tiles (next to the weight)."""
    out: dict[str, TensorSpec] = {}
    spec = param_spec(args)
    fp8 = set(release_fp8_names(spec))
    for name, s in spec.items():
        if name not in fp8:
            out[name] = s
            continue
        (rows, cols) = s.shape
        out[name] = TensorSpec(_KINDS[FP8][0], s.shape, s.shape, FP8)
        scale = (math.ceil(rows / tile), math.ceil(cols / tile))
        out[scale_name(name)] = TensorSpec(_KINDS[E8M0][0], scale, scale, E8M0)
    return out


def checkpoint_nbytes(args: ModelArgs) -> int:
    """Bytes of tensor data in the checkpoint for `args` (headers excluded)."""
    return sum(s.nbytes for s in param_spec(args).values())



def vision_spec(args: ModelArgs) -> dict[str, TensorSpec]:
    """The vision tower's tensors (reference names and dtypes, `VISION.md`): the ViT, the
    aligner, the three span delimiters and every MoE gate's `bias_vl` (DSpark's included,
    unused). Empty when `vision_n_layers` is 0."""
    a = args
    if a.vision_n_layers <= 0:
        return {}
    d, p, r = a.vision_dim, a.vision_patch_size, a.vision_downsample_ratio
    out = _linear("vision.patch_embed.proj", d, 3 * p * p, BF16)
    out += _plain("vision.patch_embed.proj.bias", (d,), BF16)
    for i in range(a.vision_n_layers):
        b = f"vision.blocks.{i}."
        out += _plain(f"{b}norm1.weight", (d,), F32)
        out += _linear(f"{b}attn.wqkv", 3 * d, d, BF16) + _plain(f"{b}attn.wqkv.bias", (3 * d,),
                                                                  BF16)
        out += _linear(f"{b}attn.wo", d, d, BF16) + _plain(f"{b}attn.wo.bias", (d,), BF16)
        out += _plain(f"{b}norm2.weight", (d,), F32)
        out += _linear(f"{b}mlp.w1", 2 * a.vision_inter_dim, d, BF16)
        out += _linear(f"{b}mlp.w2", d, a.vision_inter_dim, BF16)
    out += _plain("vision.norm.weight", (d,), F32)
    out += _linear("aligner.w1", a.dim, d * r * r, BF16) + _plain("aligner.w1.bias", (a.dim,),
                                                                   BF16)
    out += _linear("aligner.w2", a.dim, a.dim, BF16) + _plain("aligner.w2.bias", (a.dim,), BF16)
    for name in ("image_start", "image_newline", "image_end"):
        out += _plain(name, (a.dim,), BF16)
    plan = build_plan(args)
    for layer in plan.layers:
        prefix = (f"layers.{layer.layer}" if layer.layer < a.n_layers
                  else f"mtp.{layer.layer - a.n_layers}")
        out += _plain(f"{prefix}.ffn.gate.bias_vl", (a.moe_config(layer.layer)[0],), F32)
    return dict(out)

