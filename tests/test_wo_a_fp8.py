"""`wo_a` kept in the hub's FP8 (`ModelArgs.wo_a_dtype` "fp8"): the loader takes it as stored (32 x
32 tiles), converts other tiles and `convert.py`'s BF16 exactly or refuses them by name, the eager
graph equals the BF16 model on the dequantized weight bit for bit, and the compiled artifact
(its decode reading the FP8 bytes, its prefill their bf16) gives the BF16 artifact's tokens and
logits bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cached_artifact
from safetensors.torch import load_file, save_file

from dsv41.graph.checkpoint import load_checkpoint, write_seeded_checkpoint
from dsv41.graph.checkpoint.fp8_tiles import (
    EXACT_SCALE_BYTES,
    dequantize_fp8_tiles,
    quantize_fp8_tiles_exact,
)
from dsv41.graph.config import load_config, preset, save_config
from dsv41.graph.model import Model
from dsv41.graph.targets import get_target

SMALL = preset("small")
FP8 = SMALL.replace(wo_a_dtype="fp8")
WO_A, SCALE = "layers.0.attn.wo_a.weight", "layers.0.attn.wo_a.scale"


def _files(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _one_file(path: Path, tensors: dict[str, torch.Tensor], args) -> Path:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_config(args, path / "config.json")
    return path


def _as_bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`inference/convert.py`'s layout: every FP8 wo_a dequantized to BF16, its scale dropped."""
    out = dict(tensors)
    for name in [n for n in out if n.endswith("attn.wo_a.weight")]:
        scale = out.pop(name[: -len("weight")] + "scale")
        out[name] = dequantize_fp8_tiles(out[name].view(torch.uint8), scale.view(torch.uint8),
                                         32)
    return out


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Path:
    return write_seeded_checkpoint(FP8, tmp_path_factory.mktemp("fp8") / "small", seed=0)


def test_fp8_layout_loads_as_stored_and_equals_its_bf16(fp8_ckpt, tmp_path):
    stored = _files(fp8_ckpt)
    got = load_checkpoint(fp8_ckpt, FP8)
    assert got[WO_A].dtype == torch.uint8 and got[SCALE].shape == (SMALL.o_groups
                                                                   * SMALL.o_lora_rank // 32,
                                                                   got[WO_A].shape[1] // 32)
    assert torch.equal(got[WO_A], stored[WO_A].view(torch.uint8))
    # convert.py's BF16 of it loads back to the same values (exactly re-tiled)
    conv = _one_file(tmp_path / "conv", _as_bf16(stored), FP8)
    back = load_checkpoint(conv, FP8)
    assert torch.equal(dequantize_fp8_tiles(back[WO_A], back[SCALE], 32),
                       dequantize_fp8_tiles(got[WO_A], got[SCALE], 32))
    # and the BF16 config loads either file to the same BF16
    bf16 = load_checkpoint(fp8_ckpt, SMALL)[WO_A]
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, dequantize_fp8_tiles(got[WO_A], got[SCALE], 32))


@pytest.mark.parametrize("tile", [16, 128])
def test_other_square_tiles_are_retiled_exactly(fp8_ckpt, tmp_path, tile):
    stored = _files(fp8_ckpt)
    values = dequantize_fp8_tiles(stored[WO_A].view(torch.uint8), stored[SCALE].view(torch.uint8),
                                  32).float()
    rows, cols = values.shape
    grid = (-(-rows // tile), -(-cols // tile))
    pad = torch.zeros(grid[0] * tile, grid[1] * tile)
    pad[:rows, :cols] = values
    t = pad.view(grid[0], tile, grid[1], tile)
    amax = t.abs().amax(dim=(1, 3))
    u = (torch.ceil(torch.log2(amax / 448)).clamp(min=-20) + 127).to(torch.int32)
    codes = (t / torch.exp2((u - 127).float())[:, None, :, None]).to(torch.float8_e4m3fn)
    out = dict(stored)
    out[WO_A] = codes.view(grid[0] * tile, grid[1] * tile)[:rows, :cols].contiguous()
    out[SCALE] = u.to(torch.uint8).view(torch.float8_e8m0fnu)
    made = dequantize_fp8_tiles(out[WO_A].view(torch.uint8), u.to(torch.uint8), tile)
    path = _one_file(tmp_path / "t", out, FP8)
    got = load_checkpoint(path, FP8)
    assert got[SCALE].shape == stored[SCALE].shape
    assert torch.equal(dequantize_fp8_tiles(got[WO_A], got[SCALE], 32), made)


def test_bf16_that_no_fp8_holds_is_refused_by_name(tmp_path):
    path = write_seeded_checkpoint(SMALL, tmp_path / "bf16", seed=0)  # random BF16 wo_a
    with pytest.raises(ValueError, match=r"layers\.\d+\.attn\.wo_a\.weight.*wo_a_dtype"):
        load_checkpoint(path, FP8)


def test_nan_codes_and_scales_out_of_range_are_refused(fp8_ckpt, tmp_path):
    stored = _files(fp8_ckpt)
    bad = dict(stored)
    codes = stored[WO_A].view(torch.uint8).clone()
    codes[3, 5] = 0x7F
    bad[WO_A] = codes.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"wo_a\.weight: E4M3 code 0x7f at \[3, 5\] is a NaN"):
        load_checkpoint(_one_file(tmp_path / "nan", bad, FP8), FP8)
    bad = dict(stored)
    scales = stored[SCALE].view(torch.uint8).clone()
    scales[1, 0] = EXACT_SCALE_BYTES.start - 1
    bad[SCALE] = scales.view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match=r"tile \[1, 0\] has the scale 2\^-118"):
        load_checkpoint(_one_file(tmp_path / "scale", bad, FP8), FP8)


def test_exact_quantization_round_trips_and_refuses_one_bit_off():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 126, (64, 96), generator=g, dtype=torch.uint8)
    codes[:32, :32] = 0  # an all-zero tile
    codes[40, 50] = 0x3A
    scales = torch.randint(100, 130, (2, 3), generator=g, dtype=torch.uint8)
    w = dequantize_fp8_tiles(codes, scales, 32)
    c2, s2 = quantize_fp8_tiles_exact(w, "w")
    assert torch.equal(dequantize_fp8_tiles(c2, s2, 32), w)
    w2 = w.clone()
    w2.view(torch.int16)[40, 50] += 1  # one bf16 ulp: 8 significant bits
    with pytest.raises(ValueError, match=r"w: tile \[1, 1\]"):
        quantize_fp8_tiles_exact(w2, "w")


def test_eager_graph_equals_the_bf16_model_bit_for_bit(fp8_ckpt):
    """`fp8_grouped_linear`'s oracle is the BF16 einsum on the dequantized weight: the prefill
    and a decode step of the two models give the same logits, bit for bit."""
    from dsv41.graph.cache import new_cache
    from dsv41.graph.phases import decode_step, prefill_exact

    a = Model.from_checkpoint(fp8_ckpt, FP8)
    b = Model.from_weights(SMALL, load_checkpoint(fp8_ckpt, SMALL))
    assert a.w[WO_A].dtype == torch.uint8 and b.w[WO_A].dtype == torch.bfloat16
    tokens = torch.tensor([[0, 17, 301, 44, 5, 260, 99, 3]])
    out = []
    for m in (a, b):
        cache = new_cache(m.plan, 1, 64)
        first = prefill_exact(m, cache, tokens, all_logits=True).logits
        out.append((first, decode_step(m, cache, first[:, -1:].argmax(-1)).logits))
    for x, y in zip(out[0], out[1], strict=True):
        assert torch.equal(x, y)


def test_compiled_fp8_artifact_equals_the_bf16_artifact(small_case, small_artifact, tmp_path):
    """shared-small's config with wo_a in FP8: its decode GEMV reads the codes and tile scales,
    its prefill dequantizes them; against the BF16 artifact on the dequantized weights, the same
    tokens and bit-identical logits of every step. The storage is the artifact's choice: each
    artifact runs either checkpoint (the loader converts wo_a exactly), and a BF16 wo_a that no
    FP8 holds is refused by the FP8 artifact, by name."""
    from dsv41.runtime.engine import Engine

    args = load_config(small_case.checkpoint)
    fp8_args = args.replace(wo_a_dtype="fp8")
    art = cached_artifact(fp8_args, "shared-small-fp8-wo-a", ("prefill_all", "decode"))
    fp8_path = write_seeded_checkpoint(fp8_args, tmp_path / "fp8", seed=3)
    bf16_path = _one_file(tmp_path / "bf16", _as_bf16(_files(fp8_path)), args)
    assert json.loads((fp8_path / "config.json").read_text())["wo_a_dtype"] == "fp8"
    prompt = [0, 17, 301, 44, 5, 260, 99, 3, 480, 12, 77, 150, 9, 31]
    runs = []
    for artifact, path in ((art, fp8_path), (small_artifact, bf16_path), (art, bf16_path),
                           (small_artifact, fp8_path)):
        engine = Engine.load(artifact, path, exact=True)
        s = engine.session()
        toks = list(s.send(prompt, max_new_tokens=5, keep_logits=True))
        runs.append((toks, s.turns[-1].logits))
        engine.close()
    for other in runs[1:]:
        assert other[0] == runs[0][0] and len(other[1]) == 5
        assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], other[1], strict=True))
    with pytest.raises(ValueError, match=r"attn\.wo_a\.weight: tile .*wo_a_dtype"):
        Engine.load(art, small_case.checkpoint, exact=True)  # the reference's random BF16


def test_fp8_wo_a_halves_its_bytes_not_its_flops():
    """The decode step's cost (graph.cost): the FP8 wo_a reads half its bytes (plus a scale
    byte per 32 x 32 tile); its products are bf16 either way, so the weighted FLOPs stay."""
    from dsv41.graph.cost import decode_step_cost

    full = preset("full")
    a, b = (decode_step_cost(full.replace(wo_a_dtype=d), 65536) for d in ("bf16", "fp8"))
    wo_a = full.o_groups * full.o_lora_rank * full.n_heads * full.head_dim // full.o_groups
    layers = full.n_layers
    assert a.weight_bytes - b.weight_bytes == layers * (wo_a - wo_a // 1024)
    assert (a.flops, a.weighted_flops) == (b.flops, b.weighted_flops)


def test_cli_wo_a_chooses_the_storage():
    import argparse

    from dsv41.compiler.tools.cli.common import args_from, model_opts

    p = argparse.ArgumentParser()
    model_opts(p)
    assert args_from(p.parse_args(["--preset", "small"])).wo_a_dtype == "bf16"
    assert args_from(p.parse_args(["--preset", "small", "--wo-a", "fp8"])).wo_a_dtype == "fp8"
    assert args_from(p.parse_args(["--preset", "bench", "--wo-a", "bf16"])).wo_a_dtype == "bf16"
    assert args_from(p.parse_args(["--preset", "full"])).wo_a_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--wo-a", "fp4"])


@pytest.mark.parametrize("target,entry,kernels", [
    # AVX-512 BF16 + VBMI: the decode GEMV and the prefill GEMM read the codes as stored (and
    # store bf16 themselves)
    ("cpu", "decode", {"k_dense_gemv_2_64_128_bfloat16_fp8_to_bf16"}),
    ("cpu", "prefill_all", {"k_dense_gemm_2_64_128_bfloat16_fp8_to_bf16"}),
    # a baseline x86-64: the scheduled GEMV decodes them; the prefill GEMM gets their bf16
    ("cpu-x86-64", "decode", {"k_dense_gemv_2_64_128_bfloat16_fp8"}),
    ("cpu-x86-64", "prefill_all", {"k_fp8_dequant_128", "k_dense_gemm_2_64_128_bfloat16_bfloat16"}),
    ("cuda-sm90", "decode", {"k_fp8_dequant_128"}),  # then the generic einsum
])
def test_fp8_wo_a_lowers_to_each_targets_form(small_case, target, entry, kernels):
    """Which kernels the grouped o-projection over the FP8 wo_a lowers to, per target and entry
    (shared-small's shape: g 2, n 64, k 128)."""
    from dsv41.compiler.build import lowered_module
    from dsv41.schedules.common import has_avx512_bf16, has_features

    if target == "cpu" and not (has_avx512_bf16(get_target("cpu"))
                                and has_features(get_target("cpu"), "avx512vbmi")):
        pytest.skip("this CPU lacks AVX-512 BF16 / VBMI")
    if target == "cpu" and entry == "prefill_all" and has_features(get_target("cpu"),
                                                                    "amx-bf16"):
        pytest.skip("AMX hosts dequantize for the AMX GEMM")
    args = load_config(small_case.checkpoint).replace(wo_a_dtype="fp8")
    mod = lowered_module(args.to_dict(), entry, target)
    names = {gv.name_hint for gv in mod.functions}
    assert kernels <= names, sorted(n for n in names if "dense" in n or "dequant" in n)
