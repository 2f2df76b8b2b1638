"""The vision path against shared-vision-small (the released code's image case).

Tolerances: the pack's acceptance bounds (`case.json` noise_floor.acceptance.bounds, 2x the
reference's own noise floor): logits, KL, top-1 and index Jaccard over the 224 teacher-forced
rows, and the three vision intermediates (`vit_output`, `aligner_embeddings`,
`input_embeddings`) as per-row relative L2, max and median. Preprocessing and the Engram hash
ids are integer / bf16-exact and must match bit for bit. The greedy chain: each of its K + 1
rows whose argmax differs from the golden must be a flip the reference itself could make, i.e.
the golden logit gap between the two tokens is within 2x the largest logit move of the worst
rerun (`max_abs_dlogit`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONFORMANCE
from PIL import Image

from dsv41.compiler.tools.cli.main import main
from dsv41.graph import vision
from dsv41.graph.cache import new_cache
from dsv41.graph.conformance import evaluate
from dsv41.graph.engram import empty_history, engram_hash
from dsv41.graph.image_processor import PreparedImage, TokenType, plan_image_grid, preprocess
from dsv41.graph.model import Model, engram_at, moe
from dsv41.graph.phases import prefill_exact
from dsv41.graph.score import GraphBackend, ScoreResult, image_rows, score

CASE = CONFORMANCE / "shared-vision-small"


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def image(vcase, vmodel) -> PreparedImage:
    return preprocess(Image.fromarray(vcase.golden["image_rgb"], "RGB"), vmodel.args)


@pytest.fixture(scope="module")
def png(vcase, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vision") / "image.png"
    Image.fromarray(vcase.golden["image_rgb"], "RGB").save(path)
    return path


@pytest.fixture(scope="module")
def scored(vcase, png, tmp_path_factory):
    """The case scored by `dsv41 score --images` (prompt + decode tokens, 216 prefilled)."""
    root = tmp_path_factory.mktemp("score")
    toks, out = root / "tokens.txt", root / "scored.npz"
    toks.write_text(" ".join(str(t) for t in vcase.tokens))
    assert main(["score", "--checkpoint", str(vcase.checkpoint), "--tokens", str(toks),
                 "--prefill", str(vcase.prefill), "--images", str(png), "--out", str(out)]) == 0
    return ScoreResult.from_npz(out)


def test_preprocessing_equals_the_released_patches(vcase, image):
    g = vcase.golden
    np.testing.assert_array_equal(image.patches.float().numpy(), g["image_patches"])
    grid = image.grid
    assert (grid.n_vit_h, grid.n_vit_w, grid.n_llm_h, grid.n_llm_w) == tuple(g["image_grid"])
    assert (grid.width, grid.height) == (630, 476)
    start, length = g["image_span"]
    assert grid.span_length == length
    np.testing.assert_array_equal(grid.span_types(), g["token_types"][start:start + length])


def test_span_layout_and_engram_dead_positions_exact(vcase, vmodel, image):
    g, a = vcase.golden, vmodel.args
    spans = vision.find_spans(g["prompt_ids"], [image.grid], a.image_token_id)
    assert spans == [vision.ImageSpan(12, image.grid)]
    types = vision.token_types(vcase.prefill, spans)
    np.testing.assert_array_equal(types, g["token_types"])
    dead = np.concatenate([types >= 0, np.zeros(len(vcase.tokens) - vcase.prefill, bool)])
    t = vmodel.engram
    ids = engram_hash(t, empty_history(t, 1), vcase.tokens[None], dead[None])[0]
    np.testing.assert_array_equal(ids, g["engram_hash_ids"])
    # without the dead mask the n-grams after the span would reach into it
    plain = engram_hash(t, empty_history(t, 1), vcase.tokens[None])[0]
    assert not np.array_equal(plain[206:209], g["engram_hash_ids"][206:209])


def test_tower_alone_within_bounds(vcase, vmodel):
    g, a, b = vcase.golden, vmodel.args, vcase.bounds
    grid = plan_image_grid(160, 120, a)
    patches = torch.from_numpy(g["image_patches"]).to(torch.bfloat16)
    feats = vision.vit(vmodel.w, a, patches, grid.n_vit_h, grid.n_vit_w)
    aligned = vision.align(vmodel.w, a, feats, grid)
    for key, got in (("vit_output", feats), ("aligner_embeddings", aligned)):
        e = _rel(got.float().numpy(), g[key])
        print(f"{key} rel L2 max {e.max():.3g} median {np.median(e):.3g}")
        assert e.max() <= b["hidden_states_rel_l2_max"][key]
        assert np.median(e) <= b["hidden_states_rel_l2_median"][key]


def test_vision_case_conformant(vcase, scored):
    rep = evaluate(vcase, scored)
    print(rep.metrics)
    assert set(rep.metrics["hidden_states"]) == {"vit_output", "aligner_embeddings",
                                                 "input_embeddings"}
    assert rep.conformant, rep.failures


def test_greedy_chain_flips_only_where_the_reference_could(vcase, scored):
    g, p = vcase.golden, vcase.prefill
    floor = vcase.info["noise_floor"]["worst"]
    rows = np.concatenate([g["prompt_logits_all"][-1:], g["decode_logits"]])  # (K+1, V)
    mine = scored.logits[p - 1:].argmax(-1)
    np.testing.assert_array_equal(rows.argmax(-1), g["greedy_tokens"])
    gap = rows[np.arange(len(rows)), g["greedy_tokens"]] - rows[np.arange(len(rows)), mine]
    print("greedy", mine.tolist(), "golden", g["greedy_tokens"].tolist(), "gaps", gap.round(3))
    assert (gap <= 2 * floor["max_abs_dlogit"]).all()
    e = _rel(scored.logits[p:], g["decode_logits"])
    assert e.max() <= 2 * floor["rel_l2_decode_max"]


def _prompt_rows(model, tokens, image, *, split=None, chunk_tokens=None):
    """Prompt logits of one prefill, of `split` text tokens then the rest (the image in the
    second turn), or chunked."""
    a = model.args
    cache = new_cache(model.plan, 1, 256, engram_pad=model.engram.pad_id)
    t = torch.from_numpy(tokens)[None]
    if split is None:
        rows, _ = image_rows(model, tokens, [image])
        return prefill_exact(model, cache, t, all_logits=True, image=rows,
                             chunk_tokens=chunk_tokens).logits[0].numpy()
    first = prefill_exact(model, cache, t[:, :split], all_logits=True).logits[0]
    spans = vision.find_spans(tokens[split:], [image.grid], a.image_token_id, offset=split)
    emb = vision.encode_image(model.w, a, image)
    rows = vision.span_rows(model.w, vision.token_types(len(tokens) - split, spans, split),
                            [emb])
    second = prefill_exact(model, cache, t[:, split:], all_logits=True, image=rows).logits[0]
    return torch.cat([first, second]).numpy()


@pytest.mark.slow
def test_image_in_a_later_turn_and_across_chunks(vcase, vmodel, image, scored):
    """An image arriving in the second turn (its span starting at 12 of a continued cache) and
    a span cut by the prefill's chunks both match the one-shot prefill within the bounds."""
    p, b = vcase.prefill, vcase.bounds
    ref = scored.logits[:p]
    prompt = vcase.golden["prompt_ids"]
    for other in (_prompt_rows(vmodel, prompt, image, split=12),
                  _prompt_rows(vmodel, prompt, image, chunk_tokens=100)):
        e = _rel(other, ref)
        print(f"rel L2 max {e.max():.3g} median {np.median(e):.3g}")
        assert e.max() <= b["rel_l2_max"] and np.median(e) <= b["rel_l2_median"]
        assert (other.argmax(-1) == ref.argmax(-1)).mean() >= b["top1_agreement_min"]


def test_bias_vl_picks_experts_on_span_positions(vmodel):
    torch.manual_seed(0)
    x = torch.randn(1, 6, vmodel.args.dim).to(torch.bfloat16)
    mask = torch.tensor([[False, True, True, False, True, False]])
    got = moe(vmodel, 0, x, mask)
    w = dict(vmodel.w)
    swapped = Model(vmodel.args, vmodel.plan, {**w, "layers.0.ffn.gate.bias":
                                              w["layers.0.ffn.gate.bias_vl"]},
                    vmodel.experts, vmodel.engram, vmodel.freqs)
    vl = moe(swapped, 0, x)
    torch.testing.assert_close(got[mask], vl[mask], rtol=0, atol=0)
    torch.testing.assert_close(got[~mask], moe(vmodel, 0, x)[~mask], rtol=0, atol=0)


def test_engram_gate_is_zero_on_span_positions(vmodel):
    from dsv41.graph.model import Chunk

    a = vmodel.args
    torch.manual_seed(1)
    h = torch.randn(1, 4, a.hc_mult, a.dim).to(torch.bfloat16)
    ids = torch.zeros(1, 4, len(a.engram_layer_ids), vmodel.engram.n_cols, dtype=torch.int64)
    mask = torch.tensor([[False, True, True, False]])
    rows = vision.SpanRows(mask, torch.zeros(1, 4, a.dim, dtype=torch.bfloat16))
    chunk = Chunk(start=torch.zeros(1, dtype=torch.int64), length=4, rope={}, hash_ids=ids,
                  image=rows)
    out = engram_at(vmodel, 0, h, chunk)
    assert torch.equal(out[mask], h[mask]) and not torch.equal(out[~mask], h[~mask])


def test_span_errors_are_clear(vcase, vmodel, image, small_model):
    a = vmodel.args
    prompt = vcase.golden["prompt_ids"].copy()
    with pytest.raises(ValueError, match="holds 193 image-id positions.*needs 194"):
        vision.find_spans(np.delete(prompt, 100), [image.grid], a.image_token_id)
    with pytest.raises(ValueError, match="outside every image's span"):
        vision.find_spans(np.append(prompt, a.image_token_id), [image.grid], a.image_token_id)
    with pytest.raises(ValueError, match="Image 1 .* has no span"):
        vision.find_spans(prompt, [image.grid, image.grid], a.image_token_id)
    with pytest.raises(ValueError, match="no vision tower"):
        image_rows(small_model, prompt, [image])
    with pytest.raises(ValueError, match="exact mode only"):
        score(GraphBackend(vmodel, capacity=256), prompt, mode="ced", images=[image])
    cache = new_cache(vmodel.plan, 1, 256, engram_pad=vmodel.engram.pad_id)
    rows, _ = image_rows(vmodel, prompt, [image])
    bad = torch.from_numpy(prompt)[None].clone()
    bad[0, 20] = 7
    with pytest.raises(ValueError, match="must hold the image id"):
        prefill_exact(vmodel, cache, bad, image=rows)
    assert rows.mask.sum() == 194 and TokenType.IMAGE == 1


def test_small_image_planning_and_shrink(vmodel):
    a = vmodel.args
    g = plan_image_grid(160, 120, a)
    assert (g.width, g.height, g.span_length) == (630, 476, 194)
    big = plan_image_grid(4000, 3000, a)  # over the 1024-position budget: shrunk to fit
    assert big.span_length <= a.vision_max_n_token
    assert big.width % a.vision_patch_size == 0 and big.height % a.vision_patch_size == 0
    tall = plan_image_grid(20, 20000, a)
    assert tall.span_length <= a.vision_max_n_token
    with pytest.raises(ValueError, match="at least 1 x 1"):
        plan_image_grid(0, 5, a)


def test_score_images_errors_are_clear(vcase, png, tmp_path, capsys, small_case):
    toks = tmp_path / "t.txt"
    prompt = vcase.golden["prompt_ids"]
    base = ["score", "--checkpoint", str(vcase.checkpoint), "--tokens", str(toks),
            "--out", str(tmp_path / "o.npz")]
    toks.write_text(" ".join(str(t) for t in np.delete(prompt, 50)))
    assert main([*base, "--images", str(png)]) == 2
    assert "holds 193 image-id positions; its planned 12 x 15 grid needs 194" in (
        capsys.readouterr().err)
    toks.write_text(" ".join(str(t) for t in prompt))
    assert main([*base, "--images", f"{png},{png}"]) == 2
    assert "Image 1" in capsys.readouterr().err
    assert main([*base, "--images", str(png), "--prefill", "100"]) == 2
    assert "must lie in the prompt" in capsys.readouterr().err
    assert main([*base, "--images", str(tmp_path / "none.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert main([*base, "--images", str(tmp_path / "bad.png")]) == 2
    assert "could not be decoded" in capsys.readouterr().err
    base[2] = str(small_case.checkpoint)
    assert main([*base, "--images", str(png)]) == 2
    assert "no vision.* tensors" in capsys.readouterr().err
