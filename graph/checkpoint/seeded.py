"""Seeded random checkpoints in the official layout, with the released weight statistics (the
benches' and tests' weights).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import ml_dtypes
import numpy as np
from tqdm import tqdm

from dsv41.graph.checkpoint.spec import (
    E8M0,
    ENGRAM_GROUP,
    FP4,
    FP4_GROUP,
    FP8,
    FP8_TILE,
    INDEX_FILE,
    ITEMSIZE,
    RELEASE_FP8_SUFFIX,
    RELEASE_FP8_TILE,
    SINGLE_FILE,
    GiB,
    TensorSpec,
    param_spec,
    release_spec,
    scale_name,
)
from dsv41.graph.config import ModelArgs, hf_config, save_config
from dsv41.graph.formats import (
    E4M3_MAX,
    FP8_AMAX_FLOOR,
    FP8_MAX_INV,
    np_e4m3_encode,
    np_e8m0_decode,
    np_quant_fp8,
    np_quant_fp8_weight,
    np_round_scale_pow2,
)

LAYOUTS = ("converted", "release")

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
    return {name: codes, scale_name(name): scales}


def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return values.astype(ml_dtypes.bfloat16)
    assert dtype == "F32", f"unexpected plain dtype {dtype}"
    return values.astype(np.float32)


def _quant_fp8_tiles(w: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """`np_quant_fp8_weight` with square tiles of any size (the power-of-two scale of each
    tile's amax, codes E4M3 of value / scale): the hub's FP8 `wo_a` at a tile other than 32."""
    rows, cols = -(-w.shape[0] // tile), -(-w.shape[1] // tile)
    padded = np.zeros((rows * tile, cols * tile), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = np.abs(padded.reshape(rows, tile, cols, tile)).max(axis=(1, 3))
    scale_bytes = np_round_scale_pow2(np.maximum(amax, np.float32(FP8_AMAX_FLOOR)), FP8_MAX_INV)
    scale = np_e8m0_decode(scale_bytes).repeat(tile, 0).repeat(tile, 1)[: w.shape[0], : w.shape[1]]
    return np_e4m3_encode(np.clip(w / scale, -E4M3_MAX, E4M3_MAX)), scale_bytes


def _make_tensor(name: str, s: TensorSpec, seed: int,
                 wo_a_tile: int = FP8_TILE) -> dict[str, np.ndarray]:
    """Arrays (stored layout) for `name`; a quantised weight also yields its `.scale`. The
    values depend on the name and seed only, so the release layout's FP8 `wo_a` encodes the
    values the converted layout stores as BF16."""
    rng = _rng(seed, name)
    if s.kind == FP4:
        return _fp4_expert(name, s, rng)
    values = _float_values(name, s, rng)
    if s.kind == FP8:
        if name.endswith("engram.embed.weight"):
            codes, scales = np_quant_fp8(values, ENGRAM_GROUP)
        elif name.endswith(RELEASE_FP8_SUFFIX) and wo_a_tile != FP8_TILE:
            codes, scales = _quant_fp8_tiles(values, wo_a_tile)
        else:
            codes, scales = np_quant_fp8_weight(values)
        return {name: codes, scale_name(name): scales}
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


def _is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


def _plan_release_shards(spec: Mapping[str, TensorSpec], max_shard_bytes: int
                         ) -> list[list[str]]:
    """The hub's sharding: the model, then the Engram tables in final shards of their own (the
    host-resident part, memory-mapped apart from everything the device reads)."""
    tables = {n: s for n, s in spec.items() if _is_engram_table(n)}
    rest = {n: s for n, s in spec.items() if n not in tables}
    return _plan_shards(rest, max_shard_bytes) + (_plan_shards(tables, max_shard_bytes)
                                                   if tables else [])


def _shard_names(count: int, single: bool = True) -> list[str]:
    if count == 1 and single:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _data_order(names: list[str], spec: Mapping[str, TensorSpec]) -> list[str]:
    """Wider dtypes first (stable), so every tensor's offset is aligned to its element size and
    the loader can view it in place -- the order safetensors' own writer uses."""
    return sorted(names, key=lambda n: -ITEMSIZE[spec[n].dtype])


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
                 pending: dict[str, np.ndarray], bar: tqdm | None,
                 wo_a_tile: int = FP8_TILE) -> None:
    """Stream one safetensors file: the header is known from the spec, then each tensor is
    generated and written, so memory stays at one tensor (plus its pending scale)."""
    order = _data_order(names, spec)
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as f:
        f.write(_header_bytes(order, spec))
        for name in order:
            s = spec[name]
            if name not in pending:
                made = _make_tensor(_owner(name, s), spec[_owner(name, s)], seed, wo_a_tile)
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


WRITTEN_FILES = ".dsv41-checkpoint.json"  # the files write_seeded_checkpoint wrote in a folder
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _ours(name: str) -> bool:
    """A file name this writer writes (a hostile WRITTEN_FILES can name nothing else)."""
    return name in (SINGLE_FILE, INDEX_FILE, "config.json") or bool(_SHARD_NAME.fullmatch(name))


def _written_files(out_dir: Path) -> frozenset[str]:
    """The files an earlier write_seeded_checkpoint recorded in `out_dir` (none: no record)."""
    path = out_dir / WRITTEN_FILES
    if not path.is_file():
        return frozenset()
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"Output directory {out_dir}: its {WRITTEN_FILES} is unreadable ({e}); "
                         "remove it or choose another folder.") from e
    if not isinstance(files, list):
        raise ValueError(f"Output directory {out_dir}: its {WRITTEN_FILES} lists no files.")
    return frozenset(f for f in files if isinstance(f, str) and _ours(f))


def _prepare_out_dir(out_dir: Path, files: list[str], overwrite: bool) -> None:
    """Refuse a folder that holds anything but a checkpoint this writer wrote (unless
    `overwrite`: then beside files it did not write, none of which it would replace or mix into
    the checkpoint); with `overwrite`, remove only the files the earlier write recorded. Then
    record `files` (before any is written, so a killed write's files are known as ours)."""
    present = {p.name for p in out_dir.iterdir()} - {WRITTEN_FILES}
    recorded = _written_files(out_dir)  # and their `.partial` forms (a killed write's)
    ours = {f for f in present if f.removesuffix(".partial") in recorded}
    foreign = present - ours
    if present and not overwrite:
        if ours:
            raise ValueError(f"Output directory {out_dir} already holds a checkpoint "
                             f"({sorted(ours)[0]}, ...); pass overwrite=True (--overwrite) to "
                             "replace it.")
        raise ValueError(f"Output directory {out_dir} is not empty ({sorted(present)[0]}, ...) "
                         "and holds no checkpoint written here; choose a new or empty folder.")
    clash = sorted(f for f in foreign if f in (*files, "config.json", INDEX_FILE)
                   or f.endswith(".safetensors"))
    if clash:
        raise ValueError(f"Output directory {out_dir} holds {', '.join(clash[:4])}, which no "
                         "seeded checkpoint write recorded there; --overwrite replaces only the "
                         "files an earlier write recorded. Choose a new or empty folder.")
    for name in sorted(ours):
        (out_dir / name).unlink()
    record = out_dir / (WRITTEN_FILES + ".partial")
    record.write_text(json.dumps({"files": [*files, "config.json"]}, indent=1) + "\n")
    os.replace(record, out_dir / WRITTEN_FILES)


def write_seeded_checkpoint(args: ModelArgs, out_dir: str | Path, *, seed: int = 0,
                            progress: bool = False, max_shard_bytes: int = 2 * GiB,
                            max_total_bytes: int = 64 * GiB,
                            overwrite: bool = False, layout: str = "converted",
                            wo_a_tile: int = RELEASE_FP8_TILE) -> Path:
    """Write a random checkpoint in the official layout, plus `config.json`, into `out_dir`.

    `layout`: "converted" (default) is the layout `inference/convert.py` writes (`wo_a` BF16,
    the inference `config.json`); "release" is the hub's files as downloaded: `wo_a` FP8 E4M3
    with an E8M0 `.scale` per `wo_a_tile` x `wo_a_tile` tile, always `model-*-of-*.safetensors`
    shards with `model.safetensors.index.json`, the Engram tables in final shards of their own,
    and the hub-style `config.json` (`config.hf_config`). Both hold the same values: the
    release `wo_a` dequantized is the converted one rounded through FP8.

    The values follow the released checkpoint's statistics (conformance README, "Weight
    statistics for seeded checkpoints"), so a synthetic stack behaves like the real one. They
    depend only on (args, seed): every tensor has its own generator. One `model.safetensors`
    when the data fits in `max_shard_bytes`, else shards of at most that size plus
    `model.safetensors.index.json`. Tensors are generated and written one at a time, so memory
    stays near the largest tensor. Raises ValueError when the checkpoint would exceed
    `max_total_bytes` (the `full` preset) or the free disk space.

    `out_dir` must be new or empty, or (with `overwrite`) hold a checkpoint written here: the
    files written are recorded in `WRITTEN_FILES`, and `overwrite` removes only those, never a
    file this function did not write (`_prepare_out_dir`).
    """
    if seed < 0:
        raise ValueError(f"The seed of a seeded checkpoint must be non-negative, got {seed}.")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown checkpoint layout {layout!r}; choose one of "
                         f"{', '.join(LAYOUTS)}.")
    if wo_a_tile <= 0 or wo_a_tile & (wo_a_tile - 1):
        raise ValueError(f"wo_a_tile must be a power of two, got {wo_a_tile}.")
    release = layout == "release"
    out_dir = Path(out_dir)
    spec = release_spec(args, wo_a_tile) if release else param_spec(args)
    total = sum(s.nbytes for s in spec.values())
    _check_total_size(args, total, max_total_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_free_disk(total, out_dir)
    shards = (_plan_release_shards if release else _plan_shards)(spec, max_shard_bytes)
    files = _shard_names(len(shards), single=not release)
    index = len(files) > 1 or release
    _prepare_out_dir(out_dir, [*files, *([INDEX_FILE] if index else [])], overwrite)
    bar = _progress_bar(total, progress)
    pending: dict[str, np.ndarray] = {}
    try:
        for file, names in zip(files, shards, strict=True):
            _write_shard(out_dir / file, names, spec, seed, pending, bar, wo_a_tile)
    finally:
        if bar is not None:
            bar.close()
    assert not pending, f"generated but never written: {sorted(pending)[:3]}"
    if index:
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if release:
        (out_dir / "config.json").write_text(json.dumps(hf_config(args), indent=2) + "\n")
    else:
        save_config(args, out_dir / "config.json")
    return out_dir


def _progress_bar(total: int, enabled: bool) -> tqdm | None:
    if not enabled:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="seeded checkpoint")
