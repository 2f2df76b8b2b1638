"""The hub's checkpoint as downloaded (issue 37): `wo_a` FP8 E4M3 + E8M0 scale, index + shards,
the HF `config.json`, an optional `model.` prefix. It loads as it is, to the same weights and
bit-identical logits as the layout `inference/convert.py` writes from it; its broken variants
are errors naming the tensor and the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41.compiler.tools.cli.main import main
from dsv41.graph.checkpoint import INDEX_FILE, load_checkpoint, write_seeded_checkpoint
from dsv41.graph.checkpoint.load import dequantize_fp8_tiles
from dsv41.graph.config import args_from_hf, hf_config, load_config, preset, save_config

SMALL = preset("small")
WO_A = "layers.0.attn.wo_a.weight"


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _tensors(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open has no iter


def _reference_dequant(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """convert.py's dequantization, through torch's own fp8 dtypes (not graph.formats): fp32
    of the E4M3 codes times the tile's 2^e, rounded to bf16. The tile is read off the shapes."""
    rows, cols = codes.shape
    tile = max(-(-rows // scale.shape[0]), -(-cols // scale.shape[1]))
    tile = 1 << (tile - 1).bit_length()  # tiles are powers of two
    s = scale.view(torch.float8_e8m0fnu).float()
    s = s.repeat_interleave(tile, 0)[:rows].repeat_interleave(tile, 1)[:, :cols]
    return (codes.view(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)


def _convert(release: Path, out: Path) -> Path:
    """The converted layout of a release checkpoint, written independently of the loader: every
    FP8 `wo_a` dequantized to BF16 and its scale dropped, one file, the inference config."""
    out.mkdir()
    merged: dict[str, torch.Tensor] = {}
    for file in _shards(release):
        merged.update(_tensors(file))
    for name in [n for n in merged if n.endswith("attn.wo_a.weight")]:
        scale = merged.pop(name[: -len("weight")] + "scale")
        merged[name] = _reference_dequant(merged[name], scale)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_config(load_config(release), out / "config.json")
    return out


def _rewrite(path: Path, edit) -> None:
    """Apply `edit(tensors) -> tensors` to every shard (and the index) of a checkpoint."""
    weight_map = {}
    for file in _shards(path):
        tensors = edit(_tensors(file))
        save_file(tensors, str(file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (path / INDEX_FILE).exists():
        (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """`dsv41 checkpoint --layout release` of `small`."""
    out = tmp_path_factory.mktemp("release") / "small"
    assert main(["checkpoint", "--preset", "small", "--out", str(out), "--layout",
                 "release"]) == 0
    return out


@pytest.fixture(scope="module")
def converted(release, tmp_path_factory) -> Path:
    return _convert(release, tmp_path_factory.mktemp("converted") / "small")


def _copy(release: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(release, tmp_path / "ckpt"))


def _error(path: Path) -> str:
    with pytest.raises(ValueError) as e:
        load_checkpoint(path, SMALL)
    return str(e.value)


# ---- the layout -----------------------------------------------------------------------------


def test_release_layout_is_the_hubs(release):
    """FP8 wo_a + F8_E8M0 scale of 32x32 tiles, index + `model-*-of-*` shards with the Engram
    tables alone in the last one, the HF config.json that maps back to `small`."""
    index = json.loads((release / INDEX_FILE).read_text())["weight_map"]
    shards = [p.name for p in _shards(release)]
    assert shards == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert {n for n, f in index.items() if f == shards[-1]} == {
        f"layers.{i}.engram.embed.{k}" for i in SMALL.engram_layer_ids for k in ("weight",
                                                                                 "scale")}
    with safe_open(str(release / index[WO_A]), framework="pt") as f:
        assert f.get_slice(WO_A).get_dtype() == "F8_E4M3"
        scale = f.get_slice(WO_A[: -len("weight")] + "scale")
        assert (scale.get_dtype(), scale.get_shape()) == ("F8_E8M0", [4, 4])
    cfg = json.loads((release / "config.json").read_text())
    assert cfg["text_config"]["topk_method"] == "noaux_tc" and "quantization_config" in cfg
    assert load_config(release) == SMALL


def test_release_logits_equal_the_converted_layout(release, converted):
    """Every weight the loader returns from the hub's files equals the converted layout's
    (wo_a dequantized at load = convert.py's BF16), and so do the logits of a prefill and a
    decode step through the graph, bit for bit."""
    from dsv41.graph.cache import new_cache
    from dsv41.graph.model import Model
    from dsv41.graph.phases import decode_step, prefill_exact

    a = load_checkpoint(release, SMALL)
    b = load_checkpoint(converted, SMALL)
    assert a.keys() == b.keys()
    assert a[WO_A].dtype == torch.bfloat16
    assert all(torch.equal(a[k], b[k]) for k in a)

    toks = torch.tensor([[0, 17, 301, 44, 5, 260, 99, 3, 480, 12, 77, 150, 9]])
    logits = []
    for path in (release, converted):
        m = Model.from_checkpoint(path)
        c = new_cache(m.plan, 1, 32, engram_pad=m.engram.pad_id)
        pre = prefill_exact(m, c, toks[:, :12]).logits
        logits.append((pre, decode_step(m, c, toks[:, 12:]).logits))
    assert torch.equal(logits[0][0], logits[1][0])
    assert torch.equal(logits[0][1], logits[1][1])


@pytest.mark.parametrize("tile, grid", [(32, [4, 4]), (128, [1, 1])])
def test_fp8_wo_a_tiles_load_as_bf16(tmp_path, tile, grid):
    """32x32 and 128x128 scale tiles: the tile is read from the scale's shape and the loaded
    BF16 equals an independent dequantization of the file's bytes."""
    path = write_seeded_checkpoint(SMALL, tmp_path, layout="release", wo_a_tile=tile)
    weights = load_checkpoint(path, SMALL)
    stored: dict[str, torch.Tensor] = {}
    for file in _shards(path):
        stored.update(_tensors(file))
    names = [n for n in weights if n.endswith("attn.wo_a.weight")]
    assert len(names) == SMALL.n_total_layers
    for name in names:
        scale = stored[name[: -len("weight")] + "scale"]
        assert list(scale.shape) == grid
        assert torch.equal(weights[name], _reference_dequant(stored[name], scale)), name


@pytest.mark.parametrize("shape, tile", [((100, 70), 32), ((256, 130), 128), ((8, 8), 32)])
def test_dequantize_partial_tiles(shape, tile):
    """Partial tiles at the edges use their tile's scale."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    grid = (-(-shape[0] // tile), -(-shape[1] // tile))
    scale = torch.randint(110, 135, grid, generator=g, dtype=torch.uint8)
    assert torch.equal(dequantize_fp8_tiles(codes, scale, tile), _reference_dequant(codes, scale))


# ---- config.json ----------------------------------------------------------------------------


def test_hub_config_with_extra_fields_loads(tmp_path):
    cfg = hf_config(SMALL)
    cfg["text_config"] |= {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                           "qk_nope_head_dim": SMALL.head_dim - SMALL.rope_head_dim,
                           "torch_dtype": "bfloat16", "use_cache": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    notes: list[str] = []
    assert load_config(tmp_path, notes=notes) == SMALL
    assert any(n.startswith("transformers_version") for n in notes)
    assert any(n.startswith("use_cache") for n in notes)


@pytest.mark.parametrize("where, key, value", [
    ("text_config", "topk_method", "greedy"),
    ("text_config", "n_group", 8),
    ("text_config", "num_key_value_heads", 8),
    ("text_config", "hidden_act", "gelu"),
    ("text_config", "tie_word_embeddings", True),
    ("text_config", "qk_nope_head_dim", 7),
    ("text_config", "some_new_switch", 1),
    ("top", "eos_token_id", 7),
    ("quantization_config", "weight_block_size", [128, 128]),
    ("quantization_config", "quant_method", "awq"),
    ("vision_config", "spatial_merge_size", 2),
])
def test_hub_config_value_dsv41_cannot_honour_is_refused(where, key, value):
    cfg = hf_config(SMALL)
    (cfg if where == "top" else cfg[where])[key] = value
    with pytest.raises(ValueError, match=key) as e:
        args_from_hf(cfg)
    assert repr(value) in str(e.value) or str(value) in str(e.value)


def test_hub_config_maps_dspark_experts():
    cfg = hf_config(SMALL)
    assert "dspark_num_experts_per_tok" in cfg["text_config"]
    cfg["text_config"]["dspark_num_experts_per_tok"] = 1
    assert args_from_hf(cfg).dspark_n_activated_experts == 1


# ---- names ----------------------------------------------------------------------------------


def test_model_prefix_is_accepted(release, tmp_path):
    path = _copy(release, tmp_path)
    _rewrite(path, lambda t: {f"model.{k}": v for k, v in t.items()})
    a, b = load_checkpoint(path, SMALL), load_checkpoint(release, SMALL)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_name_with_and_without_prefix_is_an_error(release, tmp_path):
    path = _copy(release, tmp_path)
    _rewrite(path, lambda t: t | ({f"model.{WO_A}": t[WO_A].clone()} if WO_A in t else {}))
    msg = _error(path)
    assert WO_A in msg and "twice" in msg and INDEX_FILE in msg
    (path / INDEX_FILE).unlink()  # the shard's own header says it too
    msg = _error(path)
    assert WO_A in msg and "twice" in msg and "model-00001-of-00002.safetensors" in msg


# ---- broken files ---------------------------------------------------------------------------


def test_missing_shard_names_its_tensors_and_file(release, tmp_path):
    path = _copy(release, tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    msg = _error(path)
    assert "model-00002-of-00002.safetensors" in msg and "layers.1.engram.embed.weight" in msg


def test_truncated_shard_names_tensor_and_file(release, tmp_path):
    path = _copy(release, tmp_path)
    file = path / "model-00001-of-00002.safetensors"
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size - 100)
    msg = _error(path)
    assert file.name in msg and "Tensor '" in msg and "outside" in msg


def test_wrong_dtype_names_tensor_and_file(release, tmp_path):
    path = _copy(release, tmp_path)
    _rewrite(path, lambda t: t | ({WO_A: t[WO_A].float().half()} if WO_A in t else {}))
    msg = _error(path)
    assert f"{WO_A!r} in model-00001-of-00002.safetensors is F16" in msg


def test_wrong_scale_shape_names_tensor_and_file(release, tmp_path):
    scale = WO_A[: -len("weight")] + "scale"
    path = _copy(release, tmp_path)
    _rewrite(path, lambda t: t | ({scale: t[scale][:3]} if scale in t else {}))
    msg = _error(path)
    assert f"{scale!r} in model-00001-of-00002.safetensors is F8_E8M0 [3, 4]" in msg


def test_missing_scale_names_tensor_and_file(release, tmp_path):
    scale = WO_A[: -len("weight")] + "scale"
    path = _copy(release, tmp_path)
    _rewrite(path, lambda t: {k: v for k, v in t.items() if k != scale})
    msg = _error(path)
    assert WO_A in msg and scale in msg and "model-00001-of-00002.safetensors" in msg


def test_sharded_worker_reads_its_slice_of_fp8_wo_a(release, converted):
    """A sharded worker's `only` / `slices` apply to the dequantized wo_a as to any tensor."""
    kw = {"only": {WO_A}, "slices": {WO_A: (0, 64, 128)}}
    a, b = load_checkpoint(release, SMALL, **kw), load_checkpoint(converted, SMALL, **kw)
    assert a.keys() == {WO_A} and a[WO_A].shape == (64, 128) and torch.equal(a[WO_A], b[WO_A])


def test_release_layout_through_the_compiled_artifact(small_artifact, small_case, tmp_path):
    """The compiled shared-small artifact with the hub's layout of seeded weights and with
    their converted layout: the same tokens and bit-identical logits of every turn."""
    from dsv41.runtime.engine import Engine

    args = load_config(small_case.checkpoint)
    rel = write_seeded_checkpoint(args, tmp_path / "release", seed=3, layout="release")
    conv = _convert(rel, tmp_path / "converted")
    prompt = [0, 17, 301, 44, 5, 260, 99, 3, 480, 12, 77, 150, 9, 31]
    runs = []
    for path in (rel, conv):
        engine = Engine.load(small_artifact, path)
        s = engine.session()
        toks = list(s.send(prompt, max_new_tokens=4, keep_logits=True))
        runs.append((toks, s.turns[-1].logits))
        engine.close()
    assert runs[0][0] == runs[1][0] and len(runs[0][1]) == 4
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
