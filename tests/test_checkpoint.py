"""Checkpoint layout, loader, fingerprint and seeded writer, against the conformance checkpoints.

The conformance `tensors.json` files are the ground truth for the layout; the raw bytes of the
conformance `model.safetensors` files (parsed here independently with json + numpy) are the
ground truth for what the loader returns.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.graph import checkpoint as ckpt
from dsv41.graph.checkpoint import (
    checkpoint_config,
    load_checkpoint,
    param_spec,
    weights_fingerprint,
    write_seeded_checkpoint,
)
from dsv41.graph.checkpoint import load as ckpt_load
from dsv41.graph.config import load_config, preset
from dsv41.graph.formats import np_dequant_fp8, np_dequant_fp8_weight, np_e8m0_decode

CASES = ("shared-small", "shared-v41-small")
REPO = Path(__file__).resolve().parents[1]


def _conformance_root() -> Path | None:
    candidates = [os.environ.get("DSV41_CONFORMANCE"), REPO / "shared" / "conformance",
                  REPO.parent / "shared" / "conformance"]
    for c in candidates:
        if c and (Path(c) / CASES[0] / "checkpoint" / "tensors.json").exists():
            return Path(c)
    return None


ROOT = _conformance_root()
needs_conformance = pytest.mark.skipif(ROOT is None, reason="conformance checkpoints not found")


def _case_dir(case: str) -> Path:
    assert ROOT is not None
    return ROOT / case / "checkpoint"


def _raw_tensors(file: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Independent reader: name -> (dtype, shape, raw bytes) straight from the file."""
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[8 + n + start:8 + n + end])
    return out


def _file_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where `path` is memory-mapped in this process."""
    target = str(path.resolve())
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(target):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ---- layout ---------------------------------------------------------------------------------


@needs_conformance
@pytest.mark.parametrize("case", CASES)
def test_param_spec_equals_tensors_json(case):
    ref = json.loads((_case_dir(case) / "tensors.json").read_text())
    spec = param_spec(load_config(_case_dir(case)))
    assert list(spec) == list(ref["tensors"])  # same names, same order
    for name, r in ref["tensors"].items():
        s = spec[name]
        got = (s.dtype, list(s.shape), list(s.logical_shape), s.kind, s.reference_dtype)
        want = (r["dtype"], r["shape"], r["logical_shape"], r["kind"], r["reference_dtype"])
        assert got == want, name
    assert not set(ref["aliases_not_stored"]) & set(spec)


def test_param_spec_follows_dtype_settings():
    """bf16 Linear weights carry no scale; non-FP4 experts follow the Linear dtype; the Engram
    table stays FP8 with row scales whatever the setting."""
    args = preset("small").replace(dtype="bf16", expert_dtype=None)
    spec = param_spec(args)
    scales = {n for n in spec if n.endswith(".scale")}
    assert scales == {"layers.1.engram.embed.scale", "layers.14.engram.embed.scale"}
    assert spec["layers.0.ffn.experts.0.w1.weight"].dtype == "BF16"
    assert spec["layers.0.attn.wq_a.weight"].kind == "bfloat16"
    fp8_experts = param_spec(preset("small").replace(expert_dtype=None))
    assert fp8_experts["layers.0.ffn.experts.3.w2.scale"].shape == (8, 4)


def test_param_spec_is_deterministic_and_sized():
    a, b = param_spec(preset("bench")), param_spec(preset("bench"))
    assert list(a.items()) == list(b.items())
    full = ckpt.checkpoint_nbytes(preset("full"))
    assert full > 100e9  # the released model: hundreds of GB


# ---- loading --------------------------------------------------------------------------------


@needs_conformance
@pytest.mark.parametrize("case", CASES)
def test_load_conformance_bit_exact(case):
    d = _case_dir(case)
    args = load_config(d)
    spec = param_spec(args)
    weights = load_checkpoint(d, args)
    assert list(weights) == list(spec)
    raw = _raw_tensors(d / "model.safetensors")
    want_dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.uint8,
                  "F8_E8M0": torch.uint8, "I8": torch.uint8}
    for name, t in weights.items():
        dtype, shape, data = raw[name]
        assert t.dtype == want_dtype[dtype], name
        assert list(t.shape) == shape, name
        assert _bytes_of(t) == data, name
    assert checkpoint_config(d) == args


@needs_conformance
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_loaded_tensors_are_views_of_the_mapped_file():
    """64-byte aligned tensors are views of the mapping; the others (TVM cannot import them in
    place) are read into aligned memory of their own, outside the mapping."""
    d = _case_dir("shared-small")
    weights = load_checkpoint(d, load_config(d))
    header = ckpt_load._read_header(d / "model.safetensors")
    ranges = _file_ranges(d / "model.safetensors")
    assert ranges, "the checkpoint file is not memory-mapped"
    aligned = {n for n, e in header.entries.items() if e.start % ckpt_load.ALIGNMENT == 0}
    assert 0 < len(aligned) < len(weights)  # both kinds occur in this file
    for name, t in weights.items():
        assert any(lo <= t.data_ptr() < hi for lo, hi in ranges) == (name in aligned), name
        assert t.data_ptr() % ckpt_load.ALIGNMENT == 0, name


@needs_conformance
def test_stacks_and_owned_tensors_are_read_in_place_bit_exact():
    """`stacks` gives the members stacked in the order named (bit-exact, outside the mapping,
    the members themselves not returned); `owned` tensors are read, never mapped."""
    d = _case_dir("shared-small")
    args = load_config(d)
    plain = load_checkpoint(d, args)
    members = [f"layers.0.ffn.experts.{e}.w1.weight" for e in (2, 0, 1)]
    got = load_checkpoint(d, args, stacks={"w1s": members}, owned={"norm.weight"},
                          device="cpu")
    assert "w1s" in got and not set(members) & set(got)
    assert got["w1s"].shape == (3, *plain[members[0]].shape)
    assert torch.equal(got["w1s"], torch.stack([plain[m] for m in members]))
    ranges = _file_ranges(d / "model.safetensors")
    for name in ("w1s", "norm.weight"):
        assert not any(lo <= got[name].data_ptr() < hi for lo, hi in ranges), name
    assert _bytes_of(got["norm.weight"]) == _bytes_of(plain["norm.weight"])


@needs_conformance
@pytest.mark.parametrize("stacks", [{"x": ["norm.weight", "embed.weight"]},
                                    {"x": ["no.such.tensor"]}, {"embed.weight": ["norm.weight"]},
                                    {"x": []}])
def test_bad_stacks_are_refused(stacks):
    d = _case_dir("shared-small")
    with pytest.raises(ValueError, match="stack 'x'|stack 'embed.weight'"):
        load_checkpoint(d, load_config(d), stacks=stacks)


@needs_conformance
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_own_mmap_reader_matches_safetensors():
    """The fallback reader (for a torch that lacks a float8 dtype) gives the same bits, also as
    views of a mapping of the file."""
    file = _case_dir("shared-small") / "model.safetensors"
    header = ckpt_load._read_header(file)
    names = list(header.entries)
    ours = ckpt_load._load_shard_mmap(header, names)
    theirs = ckpt_load._load_shard_safetensors(header, names)
    ranges = _file_ranges(file)
    for name in names:
        assert ours[name].dtype == theirs[name].dtype, name
        assert _bytes_of(ours[name]) == _bytes_of(theirs[name]), name
        assert any(lo <= ours[name].data_ptr() < hi for lo, hi in ranges), name


@pytest.fixture(scope="module")
def small_state():
    """The shared-small conformance weights as an in-memory dict (native dtypes)."""
    if ROOT is None:
        pytest.skip("conformance checkpoints not found")
    d = _case_dir("shared-small")
    return load_config(d), load_file(str(d / "model.safetensors"))


def _write_variant(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path


def _load_error(path: Path, args) -> str:
    with pytest.raises(ValueError) as e:
        load_checkpoint(path, args)
    return str(e.value)


def test_missing_tensor_is_named(tmp_path, small_state):
    args, state = small_state
    state = dict(state)
    del state["layers.3.attn.indexer.wk.weight"]
    msg = _load_error(_write_variant(tmp_path, state), args)
    assert "'layers.3.attn.indexer.wk.weight' is missing" in msg
    assert "BF16 [64, 64]" in msg
    # strict=False accepts the gap and returns everything else
    loaded = load_checkpoint(tmp_path, args, strict=False)
    assert "layers.3.attn.indexer.wk.weight" not in loaded and len(loaded) == len(state)


def test_unexpected_tensor_is_named(tmp_path, small_state):
    args, state = small_state
    state = dict(state, **{"layers.2.attn.compressor.norm.weight": torch.ones(64)})
    msg = _load_error(_write_variant(tmp_path, state), args)
    assert "'layers.2.attn.compressor.norm.weight'" in msg and "not part of the layout" in msg
    loaded = load_checkpoint(tmp_path, args, strict=False)
    assert "layers.2.attn.compressor.norm.weight" not in loaded


def test_reshaped_tensor_is_named_with_both_shapes(tmp_path, small_state):
    args, state = small_state
    state = dict(state)
    state["layers.0.attn.wo_a.weight"] = state["layers.0.attn.wo_a.weight"].reshape(64, 256)
    msg = _load_error(_write_variant(tmp_path, state), args)
    assert "'layers.0.attn.wo_a.weight'" in msg
    assert "BF16 [64, 256], expected BF16 [128, 128]" in msg
    with pytest.raises(ValueError, match="wo_a"):
        load_checkpoint(tmp_path, args, strict=False)  # shape errors are never tolerated


def test_wrong_dtype_is_named_with_both_dtypes(tmp_path, small_state):
    args, state = small_state
    state = dict(state)
    state["layers.1.attn.wq_a.scale"] = state["layers.1.attn.wq_a.scale"].view(torch.uint8)
    msg = _load_error(_write_variant(tmp_path, state), args)
    assert "'layers.1.attn.wq_a.scale'" in msg and "U8 [2, 8], expected F8_E8M0 [2, 8]" in msg


def test_all_problems_reported_at_once(tmp_path, small_state):
    args, state = small_state
    state = dict(state)
    del state["embed.weight"]
    state["head.weight"] = state["head.weight"].float()
    for i in range(30):
        state[f"junk.{i}"] = torch.zeros(1)
    msg = _load_error(_write_variant(tmp_path, state), args)
    assert "32 problem(s)" in msg and "'embed.weight' is missing" in msg
    assert "'head.weight'" in msg and "F32 [512, 256], expected BF16 [512, 256]" in msg
    assert "... and 12 more" in msg  # at most 20 listed


def test_duplicate_across_shards_is_an_error(tmp_path, small_state):
    args, state = small_state
    names = sorted(state)
    first = {n: state[n] for n in names[: len(names) // 2]}
    second = {n: state[n] for n in names[len(names) // 2:]}
    second["norm.weight"] = state["norm.weight"].clone()
    first["norm.weight"] = state["norm.weight"]
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    msg = _load_error(tmp_path, args)
    assert "'norm.weight' is stored in both model-00001-of-00002.safetensors and " \
           "model-00002-of-00002.safetensors" in msg
    with pytest.raises(ValueError, match="stored in both"):
        load_checkpoint(tmp_path, args, strict=False)


def test_index_must_agree_with_shards(tmp_path, small_state):
    args, state = small_state
    save_file(state, str(tmp_path / "model-00001-of-00001.safetensors"))
    weight_map = dict.fromkeys(state, "model-00001-of-00001.safetensors")
    weight_map["norm.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="do not exist"):
        load_checkpoint(tmp_path, args)
    weight_map["norm.weight"] = "model-00001-of-00001.safetensors"
    weight_map["ghost.weight"] = "model-00001-of-00001.safetensors"
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="'ghost.weight' is listed in the index"):
        load_checkpoint(tmp_path, args)


def test_vision_tensors_are_skipped_only_when_vision_is_on(tmp_path, small_state):
    args, state = small_state
    state = dict(state, **{"vision.blocks.0.norm.weight": torch.ones(4),
                           "layers.0.ffn.gate.bias_vl": torch.zeros(4)})
    _write_variant(tmp_path, state)
    assert "vision.blocks.0.norm.weight" in _load_error(tmp_path, args)
    loaded = load_checkpoint(tmp_path, args.replace(vision_n_layers=2))
    assert len(loaded) == len(state) - 2 and "layers.0.ffn.gate.bias_vl" not in loaded


def test_empty_or_missing_directory_is_a_clear_error(tmp_path):
    args = preset("small")
    with pytest.raises(ValueError, match=r"holds no \*\.safetensors files"):
        load_checkpoint(tmp_path, args)
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", args)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(tmp_path, args)


# ---- fingerprint ----------------------------------------------------------------------------


@needs_conformance
def test_fingerprint_is_content_based(tmp_path):
    src = _case_dir("shared-small") / "model.safetensors"
    fp = weights_fingerprint(src.parent)
    assert fp == weights_fingerprint(src.parent)
    copy = tmp_path / "model.safetensors"
    copy.write_bytes(src.read_bytes())
    assert weights_fingerprint(tmp_path) == fp  # no paths, no mtimes
    data = bytearray(src.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != fp


@needs_conformance
def test_fingerprint_samples_large_files(tmp_path, monkeypatch):
    """Above the full-hash limit only the header, size and 64 chunks count."""
    monkeypatch.setattr(ckpt_load, "_FULL_HASH_LIMIT", 1 << 20)
    monkeypatch.setattr(ckpt_load, "_SAMPLE_BYTES", 1024)
    data = bytearray((_case_dir("shared-small") / "model.safetensors").read_bytes())
    copy = tmp_path / "model.safetensors"
    copy.write_bytes(bytes(data))
    fp = weights_fingerprint(tmp_path)
    span = len(data) - 1024
    sampled = {i * span // 63 + k for i in range(64) for k in range(1024)}
    outside = next(i for i in range(len(data) // 2, len(data)) if i not in sampled)
    data[outside] ^= 1
    copy.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) == fp
    data[len(data) - 1] ^= 1  # the last chunk is always sampled
    copy.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != fp


# ---- seeded checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("seeded") / "seed0"
    return write_seeded_checkpoint(preset("small"), out, seed=0)


def test_seeded_small_loads_and_is_deterministic(seeded_small, tmp_path):
    args = preset("small")
    assert sorted(p.name for p in seeded_small.iterdir()) == [
        ".dsv41-checkpoint.json", "config.json", "model.safetensors"]
    assert checkpoint_config(seeded_small) == args
    weights = load_checkpoint(seeded_small, args)
    assert list(weights) == list(param_spec(args))
    fp = weights_fingerprint(seeded_small)
    again = write_seeded_checkpoint(args, tmp_path / "again", seed=0)
    assert weights_fingerprint(again) == fp
    other = write_seeded_checkpoint(args, tmp_path / "other", seed=1)
    assert weights_fingerprint(other) != fp
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        write_seeded_checkpoint(args, again, seed=0)


def test_seeded_sharded_write_loads_identically(seeded_small, tmp_path):
    args = preset("small")
    out = write_seeded_checkpoint(args, tmp_path / "sharded", seed=0, max_shard_bytes=3 << 20)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / ckpt.INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == ckpt.checkpoint_nbytes(args)
    for shard in shards:
        assert (out / shard).stat().st_size <= (3 << 20) + (64 << 10)  # data plus header
    one, many = load_checkpoint(seeded_small, args), load_checkpoint(out, args)
    assert list(one) == list(many)
    for name in one:
        assert _bytes_of(one[name]) == _bytes_of(many[name]), name


def _values(weights: dict[str, torch.Tensor], name: str, kind: str) -> np.ndarray | None:
    """fp32 values of a loaded tensor (None for scales and packed FP4)."""
    t = weights[name]
    if kind == "fp8_e4m3":
        scale = weights[name[: -len("weight")] + "scale"].numpy()
        if name.endswith("engram.embed.weight"):
            return np_dequant_fp8(t.numpy(), scale)
        return np_dequant_fp8_weight(t.numpy(), scale)
    if kind in ("bfloat16", "float32", "bf16_in_checkpoint_fp32_in_reference"):
        return t.float().numpy()
    return None


def _group_stats(weights, spec) -> dict[str, tuple[float, float, int]]:
    pooled = defaultdict(list)
    for name, s in spec.items():
        v = _values(weights, name, s.kind)
        if v is not None:
            pooled[re.sub(r"\.\d+\.", ".N.", name)].append(v.ravel().astype(np.float64))
    return {k: (np.concatenate(v).mean(), np.concatenate(v).std(), sum(map(len, v)))
            for k, v in pooled.items()}


def test_seeded_statistics(seeded_small):
    args = preset("small")
    w = load_checkpoint(seeded_small, args)
    emb = w["embed.weight"].float()
    assert abs(emb.std().item() / 0.12 - 1) < 0.05
    norms = torch.stack([w[f"layers.{i}.attn_norm.weight"].float() for i in range(40)])
    assert abs(norms.mean().item() / 0.025 - 1) < 0.02
    assert abs(norms.std().item() / 0.0025 - 1) < 0.1
    # routed experts: 2^(round(log2(fan_in^-0.5 * gain / 3.2)) + j), j in {-1, 0, 1}
    for proj, fan_in, gain in (("w1", args.dim, 1.5), ("w2", args.moe_inter_dim, 1.05)):
        base = 127 + round(math.log2(fan_in ** -0.5 * gain / 3.2))
        scales = torch.cat([w[f"layers.{i}.ffn.experts.{e}.{proj}.scale"].flatten()
                            for i in range(40) for e in range(args.n_routed_experts)])
        counts = torch.bincount(scales.long() - (base - 1), minlength=3)
        assert counts.numel() == 3 and (counts > 0.3 * scales.numel() / 3).all()
        assert np.isclose(np_e8m0_decode(np.array([base], np.uint8))[0],
                          2.0 ** (base - 127))
    codes = torch.cat([w[f"layers.5.ffn.experts.{e}.w3.weight"].flatten() for e in range(4)])
    low, high = torch.bincount(codes & 15, minlength=16), torch.bincount(codes >> 4, minlength=16)
    expected = codes.numel() / 16
    assert (abs(low / expected - 1) < 0.15).all() and (abs(high / expected - 1) < 0.15).all()
    wq_a = _values(w, "layers.7.attn.wq_a.weight", "fp8_e4m3")
    assert abs(wq_a.std() * args.dim ** 0.5 / 1.6 - 1) < 0.05


@needs_conformance
def test_seeded_statistics_match_the_conformance_checkpoint(seeded_small):
    """The `small` preset is shared-v41-small's config, whose weights were drawn with the same
    statistics: every tensor family must agree in mean and spread."""
    args = preset("small")
    ref_dir = _case_dir("shared-v41-small")
    assert load_config(ref_dir) == args
    spec = param_spec(args)
    ours = _group_stats(load_checkpoint(seeded_small, args), spec)
    ref = _group_stats(load_checkpoint(ref_dir, args), spec)
    assert ours.keys() == ref.keys()
    for key, (mean, std, n) in ref.items():
        if n < 2000:  # a handful of 0.5 * N scalars: too few to compare
            continue
        o_mean, o_std, _ = ours[key]
        assert abs(o_std / std - 1) < 0.1, key
        assert abs(o_mean - mean) < 0.1 * std + 0.05 * abs(mean), key


def test_full_preset_is_refused_with_its_size(tmp_path):
    with pytest.raises(ValueError, match=r"would be \d+\.\d GB") as e:
        write_seeded_checkpoint(preset("full"), tmp_path / "full")
    assert "bench" in str(e.value)
    assert not (tmp_path / "full").exists()


@needs_conformance
@pytest.mark.slow
def test_seeded_activations_stay_in_the_released_ranges(seeded_small, v41_model):
    """The seeded `small` checkpoint's residual stream keeps the conformance checkpoint's scale
    through the stack (the point of the weight statistics): per-block RMS within 2x."""
    import torch

    from dsv41.graph.cache import new_cache
    from dsv41.graph.model import Model
    from dsv41.graph.phases import prefill_exact

    ours = Model.from_checkpoint(seeded_small)
    toks = torch.from_numpy(np.random.default_rng(3).integers(3, 511, 48))[None]
    layers = (0, 5, 13, 20, 30, 39)

    def rms(model):
        c = new_cache(model.plan, 1, 64, engram_pad=model.engram.pad_id)
        res = prefill_exact(model, c, toks, record=layers)
        return {k: float(v.float().square().mean().sqrt()) for k, v in res.hidden.items()}

    a, b = rms(ours), rms(v41_model)
    print({k: (round(a[k], 3), round(b[k], 3)) for k in layers})
    for k in layers:
        assert 0.5 < a[k] / b[k] < 2.0, (k, a[k], b[k])
