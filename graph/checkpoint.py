"""The official checkpoint: its tensor layout, a memory-mapped loader, a fingerprint, and a writer
of seeded random checkpoints with the released weight statistics.

Why one module: the layout (`param_spec`) is the single contract between the released files, the
conformance checkpoints, the seeded checkpoints the benches use and the compiled graph. The loader
checks every file against it, so a checkpoint that does not match its `config.json` fails at load
time with the names of the offending tensors instead of producing wrong numbers later.

Returned representation ("the uint8 bit route" used across dsv41): F8_E4M3, F8_E8M0 and I8
(packed FP4) tensors come back as `torch.uint8` views of the file's bytes, BF16 as
`torch.bfloat16`, F32 as `torch.float32`. Nothing is converted: the low-precision decoders in
`graph.formats` work on the raw bytes, and the tensors stay views of the memory-mapped files.

`param_spec` covers the text model. The vision tower's tensors (`vision.*`, `aligner.*`,
`image_*`, the gates' `bias_vl`: `vision_spec`) are optional: `load_checkpoint` skips them when
`vision_n_layers > 0`, and `load_vision` loads them (all or none) from a checkpoint that holds
them. A model without them serves text only and refuses images.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from dsv41.graph.config import ModelArgs, load_config, save_config
from dsv41.graph.formats import np_quant_fp8, np_quant_fp8_weight
from dsv41.graph.plan import LayerPlan, build_plan

# where the CLI keeps the seeded checkpoints of the presets (`dsv41 run`, `bench`, `tune`, `serve`)
DEFAULT_CHECKPOINTS = Path("artifacts") / "checkpoints"

__all__ = [
    "TensorSpec",
    "param_spec",
    "checkpoint_nbytes",
    "load_checkpoint",
    "vision_spec",
    "load_vision",
    "checkpoint_config",
    "weights_fingerprint",
    "write_seeded_checkpoint",
    "INDEX_FILE",
    "SINGLE_FILE",
]

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
_ITEMSIZE = MappingProxyType({
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
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


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
    out += _linear(f"{p}attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups, BF16)
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


def checkpoint_nbytes(args: ModelArgs) -> int:
    """Bytes of tensor data in the checkpoint for `args` (headers excluded)."""
    return sum(s.nbytes for s in param_spec(args).values())


# =============================================================================================
# Reading safetensors files
# =============================================================================================


@dataclass(frozen=True, slots=True)
class _HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True, slots=True)
class _Header:
    path: Path
    header_bytes: int  # 8-byte length prefix plus the JSON header
    entries: dict[str, _HeaderEntry]


@dataclass(frozen=True, slots=True)
class _Files:
    paths: tuple[Path, ...]  # shards, sorted by name
    index: dict[str, str] | None  # weight_map of model.safetensors.index.json, if present


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def _read_header(path: Path) -> _Header:
    """Parse a safetensors header ourselves: it gives dtypes and shapes without touching data,
    so the whole layout can be checked before anything is mapped."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"Checkpoint file {path} is too short to be a safetensors file.")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise ValueError(f"Checkpoint file {path} has a header length of {n} bytes, which "
                             f"does not fit its size of {size} bytes: not a safetensors file.")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Checkpoint file {path} has a header that is not valid JSON: {e}.") from e
    if not isinstance(header, dict):
        raise ValueError(f"Checkpoint file {path} has a header that is not a JSON object.")
    base = 8 + n
    entries = {name: _header_entry(path, name, info, base, size)
               for name, info in header.items() if name != "__metadata__"}
    return _Header(path, base, entries)


def _header_entry(path: Path, name: str, info: object, base: int, size: int) -> _HeaderEntry:
    """Validate one header record; a corrupt record is an error naming the tensor and file."""
    try:
        dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"Tensor {name!r} in {path} has a malformed header record: {info!r}.") \
            from e
    if not 0 <= start <= end <= size - base or any(d < 0 for d in shape):
        raise ValueError(f"Tensor {name!r} in {path} has data offsets [{start}, {end}] outside "
                         f"the file's {size - base} data bytes.")
    if dtype in _ITEMSIZE and end - start != math.prod(shape) * _ITEMSIZE[dtype]:
        raise ValueError(f"Tensor {name!r} in {path} holds {end - start} bytes, but {dtype} "
                         f"{list(shape)} needs {math.prod(shape) * _ITEMSIZE[dtype]}.")
    return _HeaderEntry(dtype, shape, base + start, base + end)


def _checkpoint_files(path: Path) -> _Files:
    """The shards of a checkpoint: the files its index names, else every `*.safetensors` in
    the directory, else the file itself."""
    if not path.exists():
        raise ValueError(f"Checkpoint path {path} does not exist.")
    if path.is_file():
        return _Files((path,), None)
    index_path = path / INDEX_FILE
    if index_path.exists():
        weight_map = _read_index(index_path)
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"Checkpoint index {index_path} names shard(s) {missing} that do "
                             "not exist in its directory.")
        return _Files(tuple(path / n for n in names), weight_map)
    paths = tuple(sorted(path.glob("*.safetensors"), key=lambda p: p.name))
    if not paths:
        raise ValueError(f"Checkpoint directory {path} holds no *.safetensors files.")
    return _Files(paths, None)


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"Checkpoint index {index_path} is not valid JSON with a "
                         f"'weight_map' object: {e}.") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"Checkpoint index {index_path} has an empty or malformed weight_map.")
    return {str(k): str(v) for k, v in weight_map.items()}


def _locate(files: _Files, headers: list[_Header]) -> tuple[dict[str, _Header], list[str]]:
    """Which shard holds each tensor; a name in two shards, or a shard that disagrees with the
    index, is a problem (the loader would otherwise pick one silently)."""
    where: dict[str, _Header] = {}
    problems: list[str] = []
    for h in headers:
        for name in h.entries:
            if name in where:
                problems.append(f"tensor {name!r} is stored in both {where[name].path.name} "
                                f"and {h.path.name}")
                continue
            where[name] = h
            if files.index is not None and files.index.get(name) != h.path.name:
                problems.append(f"tensor {name!r} is stored in {h.path.name} but the index "
                                f"maps it to {files.index.get(name)}")
    if files.index is not None:
        for name, shard in files.index.items():
            if name not in where:
                problems.append(f"tensor {name!r} is listed in the index under {shard} but no "
                                "shard holds it")
    return where, problems


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


def load_vision(path: str | Path, args: ModelArgs) -> dict[str, torch.Tensor] | None:
    """The vision tower's tensors of a checkpoint, or None when it holds none of them (or
    `vision_n_layers` is 0). A checkpoint with some but not all of them, or with one of the
    wrong dtype or shape, is a ValueError naming every problem."""
    spec = vision_spec(args)
    if not spec:
        return None
    path = Path(path)
    files = _checkpoint_files(path)
    headers = [_read_header(p) for p in files.paths]
    where, problems = _locate(files, headers)
    if not any(name in where for name in spec):
        return None
    problems += _compare(spec, {n: h for n, h in where.items() if n in spec}, True, args)
    if problems:
        raise ValueError(_problem_report(path, problems))
    loaded: dict[str, torch.Tensor] = {}
    for h in headers:
        names = [n for n in h.entries if n in spec and where[n] is h]
        if names:
            loaded.update(_load_shard(h, names))
    return {name: loaded[name] for name in spec}


def _is_vision(name: str) -> bool:
    """Vision-tower tensors of the released checkpoint, which `load_checkpoint` skips."""
    return (name.startswith(("vision.", "aligner.", "image_start", "image_end", "image_newline"))
            or name.endswith(".gate.bias_vl"))


def _compare(spec: Mapping[str, TensorSpec], where: Mapping[str, _Header], strict: bool,
             args: ModelArgs) -> list[str]:
    """Every difference between the files and the layout, as one sentence per tensor."""
    problems = []
    for name, s in spec.items():
        if name not in where:
            if strict:
                problems.append(f"tensor {name!r} is missing (expected {s.dtype} "
                                f"{list(s.shape)})")
            continue
        got = where[name].entries[name]
        if got.dtype != s.dtype or got.shape != s.shape:
            problems.append(f"tensor {name!r} in {where[name].path.name} is {got.dtype} "
                            f"{list(got.shape)}, expected {s.dtype} {list(s.shape)}")
    if strict:
        for name, h in where.items():
            if name not in spec and not (args.vision_n_layers > 0 and _is_vision(name)):
                e = h.entries[name]
                problems.append(f"tensor {name!r} in {h.path.name} ({e.dtype} "
                                f"{list(e.shape)}) is not part of the layout for these ModelArgs")
    return problems


def _problem_report(path: Path, problems: list[str], limit: int = 20) -> str:
    lines = [f"  - {p}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return (f"Checkpoint {path} does not match the tensor layout of its ModelArgs "
            f"({len(problems)} problem(s)):\n" + "\n".join(lines))


def _bit_route(t: torch.Tensor, dtype: str, name: str) -> torch.Tensor:
    """Reinterpret (never convert) a loaded tensor as the representation dsv41 uses."""
    want = RETURNED_DTYPES[dtype]
    if t.dtype != want:
        assert t.element_size() == torch.empty(0, dtype=want).element_size(), (
            f"{name}: cannot view {t.dtype} as {want}")
        t = t.view(want)
    return t


def _load_shard_safetensors(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    """safetensors maps the whole file (MAP_PRIVATE) and hands out views into that mapping."""
    out = {}
    with safe_open(str(header.path), framework="pt") as f:
        for name in names:
            out[name] = _bit_route(f.get_tensor(name), header.entries[name].dtype, name)
    return out


def _load_shard_mmap(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    """Fallback for a torch/safetensors pair that cannot produce some dtype: map the file
    ourselves and view the raw bytes. A tensor whose offset is not aligned to its element size
    cannot be viewed in place and is copied (safetensors' own writer always aligns)."""
    size = header.path.stat().st_size
    storage = torch.UntypedStorage.from_file(str(header.path), shared=False, nbytes=size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
    out = {}
    for name in names:
        e = header.entries[name]
        raw = whole[e.start:e.end]
        want = RETURNED_DTYPES[e.dtype]
        itemsize = _ITEMSIZE[e.dtype]
        if e.start % itemsize:
            raw = raw.clone()
        out[name] = raw.view(want).view(e.shape)
    return out


def _load_shard(header: _Header, names: list[str]) -> dict[str, torch.Tensor]:
    try:
        return _load_shard_safetensors(header, names)
    except Exception:  # noqa: BLE001 -- any failure of the fast path: retry with our own reader
        return _load_shard_mmap(header, names)


ALIGNMENT = 64  # bytes: TVM imports a tensor by DLPack only at this alignment


def load_checkpoint(path: str | Path, args: ModelArgs, *, strict: bool = True,
                    device: str | torch.device = "cpu",
                    stacks: Mapping[str, Sequence[str]] | None = None,
                    owned: Collection[str] = (),
                    only: Collection[str] | None = None,
                    slices: Mapping[str, tuple[int, int, int]] | None = None,
                    host: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Load a checkpoint directory (one file or shards, with or without an index).

    The whole layout is checked from the headers first, and every problem is reported in one
    ValueError (a missing, unexpected, mistyped or misshaped tensor names the tensor, the file
    and both dtypes/shapes), so a bad checkpoint is fixed in one round. `strict=False` allows
    missing and unexpected tensors (unexpected ones are not returned); a name stored twice or a
    wrong dtype/shape is always an error. Returns tensors in `param_spec` order as uint8 /
    bfloat16 / float32 (see the module docstring), each stored once in memory:

    - on the CPU, a tensor whose data is 64-byte aligned in its file is a view of the
      memory-mapped file (no copy; its pages become resident when read);
    - every other tensor (unaligned on the CPU, any on another `device`, those named in `owned`,
      the members of `stacks`) is read from the file straight into its own allocation on
      `device` (on a GPU through a bounded pinned staging buffer), never through the mapping,
      so the host holds no second copy;
    - `stacks` maps a new name to member names of one dtype and shape: the result holds that
      name, the members stacked on a leading axis in the order given (written in place, member
      by member), and not the members. A stack with a missing member is not returned;
    - `only` (a sharded worker's tensors): nothing else is read or returned (stack members
      count as named);
    - `slices` maps a name to (dim, start, stop): only that slice of dims 0 or 1 is read, from
      the file straight into an allocation of the slice's size (the whole tensor is never
      read), and returned under the name;
    - `host` names tensors that stay in host memory whatever `device` is (the Engram tables,
      `engram.host_resident`): loaded as on the CPU (views of the mapping when aligned).
    """
    path = Path(path)
    device = torch.device(device)
    files = _checkpoint_files(path)
    headers = [_read_header(p) for p in files.paths]
    where, problems = _locate(files, headers)
    spec = param_spec(args)
    problems += _compare(spec, where, strict, args)
    problems += _stack_problems(spec, stacks or {})
    if problems:
        raise ValueError(_problem_report(path, problems))
    members = {m for names in (stacks or {}).values() for m in names}
    slices = slices or {}
    for name, (dim, start, stop) in slices.items():
        shape = spec[name].shape if name in spec else ()
        if dim not in (0, 1) or dim >= len(shape) or not 0 <= start < stop <= shape[dim]:
            raise ValueError(f"The slice ({dim}, {start}, {stop}) of {name} is not a slice of "
                             f"dims 0 or 1 of its stored shape {shape}.")
    with _Reader(device) as reader:
        loaded: dict[str, torch.Tensor] = {}
        for h in headers:
            names = [n for n in h.entries if n in spec and n not in members and where[n] is h
                     and (only is None or n in only)]
            for n in names:
                if n in slices:
                    loaded[n] = reader.read_slice(h, n, *slices[n])
            mapped = [n for n in names if (device.type == "cpu" or n in host)
                      and n not in owned and n not in slices
                      and h.entries[n].start % ALIGNMENT == 0]
            if mapped:
                loaded.update(_load_shard(h, mapped))
            for n in names:
                if n not in loaded:
                    on = torch.device("cpu") if n in host else device
                    loaded[n] = reader.read(h, n, _empty(h.entries[n], on))
        out = {name: loaded[name] for name in spec if name in loaded}
        for name, group in (stacks or {}).items():
            if all(m in where for m in group):
                first = where[group[0]].entries[group[0]]
                stack = torch.empty((len(group), *first.shape), dtype=RETURNED_DTYPES[
                    first.dtype], device=device)
                for i, m in enumerate(group):
                    reader.read(where[m], m, stack[i])
                out[name] = stack
    return out


def _stack_problems(spec: Mapping[str, TensorSpec], stacks: Mapping[str, Sequence[str]]
                    ) -> list[str]:
    problems = []
    for name, group in stacks.items():
        specs = {(spec[m].dtype, spec[m].shape) if m in spec else None for m in group}
        if not group or None in specs or len(specs) != 1 or name in spec:
            problems.append(f"stack {name!r} needs a new name and members of the layout with "
                            f"one dtype and shape, got {list(group)[:3]}")
    return problems


def _empty(e: _HeaderEntry, device: torch.device) -> torch.Tensor:
    return torch.empty(e.shape, dtype=RETURNED_DTYPES[e.dtype], device=device)


class _Reader:
    """Reads tensors from their files into allocations of the caller's: directly on the CPU
    (`os.preadv` into the tensor's memory), through one pinned staging buffer of at most
    `STAGING_BYTES` elsewhere. Files stay open for the whole load."""

    STAGING_BYTES = 64 << 20

    def __init__(self, device: torch.device):
        self.device = device
        self._files: dict[Path, int] = {}
        self._staging: torch.Tensor | None = None

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def _fd(self, path: Path) -> int:
        if path not in self._files:
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def read_slice(self, header: _Header, name: str, dim: int, start: int,
                   stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start..stop of `name`, read into a new tensor of
        that size on the CPU (one read for rows, one per row for columns), then moved to the
        reader's device."""
        e = header.entries[name]
        shape = list(e.shape)
        shape[dim] = stop - start
        out = torch.empty(shape, dtype=RETURNED_DTYPES[e.dtype])
        flat = out.view(-1).view(torch.uint8).numpy()
        unit = _ITEMSIZE[e.dtype] * math.prod(e.shape[dim + 1:])  # bytes per index of `dim`
        fd = self._fd(header.path)
        if dim == 0:
            _pread_into(fd, e.start + start * unit, flat, header.path, name)
        else:
            row, piece = unit * e.shape[1], unit * (stop - start)
            for i in range(e.shape[0]):
                _pread_into(fd, e.start + i * row + start * unit,
                            flat[i * piece:(i + 1) * piece], header.path, name)
        return out if self.device.type == "cpu" else out.to(self.device)

    def read(self, header: _Header, name: str, dest: torch.Tensor) -> torch.Tensor:
        """Fill `dest` (contiguous, of the tensor's size) with `name`'s bytes; returns it."""
        e = header.entries[name]
        flat = dest.view(-1).view(torch.uint8) if dest.numel() else dest.view(torch.uint8)
        assert flat.numel() == e.end - e.start, f"{name}: destination of the wrong size"
        fd = self._fd(header.path)
        if dest.device.type == "cpu":
            _pread_into(fd, e.start, flat.numpy(), header.path, name)
            return dest
        if self._staging is None:
            self._staging = torch.empty(self.STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        for off in range(0, flat.numel(), self.STAGING_BYTES):
            n = min(self.STAGING_BYTES, flat.numel() - off)
            _pread_into(fd, e.start + off, self._staging[:n].numpy(), header.path, name)
            flat[off:off + n].copy_(self._staging[:n])
        return dest


def _pread_into(fd: int, offset: int, buf: np.ndarray, path: Path, name: str) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"Checkpoint file {path} ended while reading tensor {name!r} "
                             f"({done} of {len(view)} bytes read).")
        done += n


def checkpoint_config(path: str | Path) -> ModelArgs:
    """The ModelArgs of a checkpoint, from the `config.json` next to its weights."""
    path = Path(path)
    return load_config(path.parent if path.is_file() else path)


# =============================================================================================
# Fingerprint
# =============================================================================================

_FULL_HASH_LIMIT = GiB
_SAMPLE_COUNT = 64
_SAMPLE_BYTES = 64 << 10


def _file_digest_parts(path: Path) -> Iterator[bytes]:
    """The bytes that identify one shard: all of them up to 1 GiB; above that the header, the
    size and 64 evenly spaced 64 KiB chunks (first and last included), which still catches any
    re-quantisation or re-seeding (they change bytes everywhere) while reading ~4 MiB instead of
    hundreds of GB."""
    size = path.stat().st_size
    yield path.name.encode() + b"\0" + size.to_bytes(8, "little")
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            while chunk := f.read(16 << 20):
                yield chunk
            return
        n = int.from_bytes(f.read(8), "little")
        f.seek(0)
        yield f.read(8 + min(n, _MAX_HEADER))
        span = size - _SAMPLE_BYTES
        for i in range(_SAMPLE_COUNT):
            f.seek(i * span // (_SAMPLE_COUNT - 1))
            yield f.read(_SAMPLE_BYTES)


def weights_fingerprint(path: str | Path) -> str:
    """sha256 (hex) identifying the weight files of a checkpoint, to salt persistent cache keys.

    Covers the shards the loader reads, sorted by file name, each by its name, size and content
    (all bytes up to 1 GiB, else header + 64 evenly spaced 64 KiB chunks). No mtimes, no absolute
    paths: the same files give the same fingerprint on any machine. Resharding the same weights
    changes it (the files differ), which only costs a cache refill.
    """
    files = _checkpoint_files(Path(path))
    h = hashlib.sha256(b"dsv41-weights-fingerprint-v1\0")
    for p in files.paths:
        for part in _file_digest_parts(p):
            h.update(part)
    return h.hexdigest()


# =============================================================================================
# Seeded checkpoints
# =============================================================================================

# RMSNorm weight means by module (last name component), measured on the released checkpoint
_NORM_MEANS = MappingProxyType({
    "attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "k_norm": 0.5,
})
_COMPRESSOR_NORM_MEAN = 0.6
# projection gains by module name (last name component); 1.0 elsewhere
_GAINS = MappingProxyType({
    "wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9,
    "w1": 1.5, "w3": 1.5, "w2": 1.05,
})
_EMBED_STD = 0.12
_VECTOR_STD = 0.5
_E2M1_UNIFORM_RMS = 3.2  # RMS of a uniformly random E2M1 code, as the statistics state it


def _rng(seed: int, name: str) -> np.random.Generator:
    """One generator per tensor from (seed, sha256(name)): values do not depend on the order in
    which tensors are generated, nor on Python's per-process string hash."""
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng([seed, *words])


def _module(name: str) -> list[str]:
    """Name components of the owning module: `layers.3.attn.wq_a.weight` -> [..., 'wq_a']."""
    parts = name.split(".")
    return parts[:-1] if parts[-1] in ("weight", "scale") else parts


def _norm_mean(name: str) -> float:
    mod = _module(name)
    if mod[-1] == "norm" and len(mod) > 1 and mod[-2] == "compressor":
        return _COMPRESSOR_NORM_MEAN
    return _NORM_MEANS.get(mod[-1], 1.0)


def _is_embedding(name: str) -> bool:
    return name == "embed.weight" or name.endswith("markov_head.embed.weight")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _float_values(name: str, s: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """fp32 values of a non-packed tensor, following the released checkpoint's statistics."""
    shape = s.logical_shape
    if name.endswith("engram.embed.weight"):
        return _normal(rng, shape, 1.0)
    if _is_embedding(name):
        return _normal(rng, shape, _EMBED_STD)
    if name.endswith("norm.weight"):
        return np.float32(_norm_mean(name)) * (1 + _normal(rng, shape, 0.1))
    if len(shape) == 1:
        return _normal(rng, shape, _VECTOR_STD)
    fan_in = shape[1]
    return _normal(rng, shape, fan_in ** -0.5 * _GAINS.get(_module(name)[-1], 1.0))


def _fp4_expert(name: str, s: TensorSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Uniformly random E2M1 codes in both nibbles, power-of-two scale per 32 inputs of
    2^(round(log2(fan_in^-0.5 * gain / 3.2)) + j), j uniform in {-1, 0, 1}."""
    out, fan_in = s.logical_shape
    codes = rng.integers(0, 256, size=s.shape, dtype=np.uint8)
    gain = _GAINS.get(_module(name)[-1], 1.0)
    base = round(math.log2(fan_in ** -0.5 * gain / _E2M1_UNIFORM_RMS))
    jitter = rng.integers(-1, 2, size=(out, fan_in // FP4_GROUP))
    scales = (base + 127 + jitter).astype(np.uint8)
    return {name: codes, _scale_name(name): scales}


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "scale"


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return values.astype(ml_dtypes.bfloat16)
    assert dtype == "F32", f"unexpected plain dtype {dtype}"
    return values.astype(np.float32)


def _make_tensor(name: str, s: TensorSpec, seed: int) -> dict[str, np.ndarray]:
    """Arrays (stored layout) for `name`; a quantised weight also yields its `.scale`."""
    rng = _rng(seed, name)
    if s.kind == FP4:
        return _fp4_expert(name, s, rng)
    values = _float_values(name, s, rng)
    if s.kind == FP8:
        if name.endswith("engram.embed.weight"):
            codes, scales = np_quant_fp8(values, ENGRAM_GROUP)
        else:
            codes, scales = np_quant_fp8_weight(values)
        return {name: codes, _scale_name(name): scales}
    return {name: _encode(values, s.dtype)}


def _owner(name: str, s: TensorSpec) -> str:
    """A scale is generated together with its weight (from the weight's generator)."""
    return name[: -len("scale")] + "weight" if s.kind == E8M0 else name


def _plan_shards(spec: Mapping[str, TensorSpec], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors (spec order) packed into shards of at most `max_shard_bytes`; a
    tensor larger than that gets a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, s in spec.items():
        if shards[-1] and used + s.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += s.nbytes
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _data_order(names: list[str], spec: Mapping[str, TensorSpec]) -> list[str]:
    """Wider dtypes first (stable), so every tensor's offset is aligned to its element size and
    the loader can view it in place -- the order safetensors' own writer uses."""
    return sorted(names, key=lambda n: -_ITEMSIZE[spec[n].dtype])


def _header_bytes(order: list[str], spec: Mapping[str, TensorSpec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        s = spec[name]
        header[name] = {"dtype": s.dtype, "shape": list(s.shape),
                        "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def _write_shard(path: Path, names: list[str], spec: Mapping[str, TensorSpec], seed: int,
                 pending: dict[str, np.ndarray], bar: tqdm | None) -> None:
    """Stream one safetensors file: the header is known from the spec, then each tensor is
    generated and written, so memory stays at one tensor (plus its pending scale)."""
    order = _data_order(names, spec)
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(_header_bytes(order, spec))
        for name in order:
            s = spec[name]
            if name not in pending:
                made = _make_tensor(_owner(name, s), spec[_owner(name, s)], seed)
                pending.update(made)
            arr = np.ascontiguousarray(pending.pop(name))
            assert arr.nbytes == s.nbytes and arr.shape == s.shape, f"{name}: generated wrong size"
            f.write(arr.view(np.uint8).reshape(-1).data)
            if bar is not None:
                bar.update(s.nbytes)
    os.replace(tmp, path)


def _check_total_size(args: ModelArgs, total: int, max_total_bytes: int) -> None:
    """Refuse configurations whose seeded checkpoint is unreasonably large (the full model is
    ~500 GB) before creating anything."""
    if total > max_total_bytes:
        raise ValueError(
            f"A seeded checkpoint for these ModelArgs (dim {args.dim}, {args.n_layers} layers, "
            f"{args.n_routed_experts} experts) would be {total / 1e9:.1f} GB, above the "
            f"{max_total_bytes / 1e9:.1f} GB allowed for seeded checkpoints; use the 'small' or "
            "'bench' preset, or pass a larger max_total_bytes.")


def _check_free_disk(total: int, out_dir: Path) -> None:
    free = shutil.disk_usage(out_dir).free
    if total > free:
        raise ValueError(f"A seeded checkpoint of {total / 1e9:.1f} GB does not fit in the "
                         f"{free / 1e9:.1f} GB free under {out_dir}.")


def _clear_old_checkpoint(out_dir: Path, overwrite: bool) -> None:
    old = sorted(out_dir.glob("*.safetensors")) + sorted(out_dir.glob(INDEX_FILE))
    if old and not overwrite:
        raise ValueError(f"Output directory {out_dir} already holds a checkpoint "
                         f"({old[0].name}, ...); pass overwrite=True to replace it.")
    for p in old:
        p.unlink()


def write_seeded_checkpoint(args: ModelArgs, out_dir: str | Path, *, seed: int = 0,
                            progress: bool = False, max_shard_bytes: int = 2 * GiB,
                            max_total_bytes: int = 64 * GiB,
                            overwrite: bool = False) -> Path:
    """Write a random checkpoint in the official layout, plus `config.json`, into `out_dir`.

    The values follow the released checkpoint's statistics (conformance README, "Weight
    statistics for seeded checkpoints"), so a synthetic stack behaves like the real one. They
    depend only on (args, seed): every tensor has its own generator. One `model.safetensors`
    when the data fits in `max_shard_bytes`, else shards of at most that size plus
    `model.safetensors.index.json`. Tensors are generated and written one at a time, so memory
    stays near the largest tensor. Raises ValueError when the checkpoint would exceed
    `max_total_bytes` (the `full` preset) or the free disk space.
    """
    if seed < 0:
        raise ValueError(f"The seed of a seeded checkpoint must be non-negative, got {seed}.")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
    out_dir = Path(out_dir)
    spec = param_spec(args)
    total = sum(s.nbytes for s in spec.values())
    _check_total_size(args, total, max_total_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_free_disk(total, out_dir)
    _clear_old_checkpoint(out_dir, overwrite)
    shards = _plan_shards(spec, max_shard_bytes)
    files = _shard_names(len(shards))
    bar = _progress_bar(total, progress)
    pending: dict[str, np.ndarray] = {}
    try:
        for file, names in zip(files, shards, strict=True):
            _write_shard(out_dir / file, names, spec, seed, pending, bar)
    finally:
        if bar is not None:
            bar.close()
    assert not pending, f"generated but never written: {sorted(pending)[:3]}"
    if len(files) > 1:
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    save_config(args, out_dir / "config.json")
    return out_dir


def _progress_bar(total: int, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="seeded checkpoint")
