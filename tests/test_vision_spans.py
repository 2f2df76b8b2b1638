"""The compiled entries' span inputs (`vision.packed_rows` / `unpacked_rows`,
`entries.takes_spans`) in the graph itself: the captured module (`capture.PhaseGraph`, run
eagerly on shared-vision-small's weights) with packed span rows gives the graph phases' outputs
bit for bit, with and without an image, so a text chunk through a span-taking entry is the text
graph exactly (exact equality: the same ops in the same order; off the spans every
`torch.where` picks the text value). A text model's entries are unchanged (no span inputs, no
`bias_vl` parameters)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CONFORMANCE
from PIL import Image

from dsv41.compiler.capture import PhaseGraph
from dsv41.graph.cache import new_cache
from dsv41.graph.config import load_config
from dsv41.graph.entries import cache_names, cache_tensors, entry_inputs, takes_spans
from dsv41.graph.image_processor import preprocess
from dsv41.graph.model import Model
from dsv41.graph.phases import encoder_prefill, new_chunk, prefill_exact
from dsv41.graph.vision import (
    PlacedSpan,
    SequenceImages,
    SpanRows,
    encode_image,
    packed_rows,
    span_rows,
    unpacked_rows,
)

CASE = CONFORMANCE / "shared-vision-small"
IMG = 510


@pytest.fixture(scope="module")
def vmodel():
    if not CASE.exists():
        pytest.skip(f"conformance pack {CASE} is not present")
    ckpt = CASE / "checkpoint"  # 84 x 42 images: a 5-position span (as test_engine_images.py)
    return Model.from_checkpoint(ckpt, load_config(ckpt).replace(vision_min_pixels=1))


@pytest.fixture(scope="module")
def chunk_rows(vmodel):
    rgb = np.random.default_rng(1).integers(0, 256, (42, 84, 3), dtype=np.uint8)
    im = preprocess(Image.fromarray(rgb, "RGB"), vmodel.args)
    types = np.array([-1] * 4 + im.grid.span_types().tolist() + [-1] * 3)
    tokens = torch.tensor([[11, 12, 13, 14] + [IMG] * im.grid.span_length + [7, 8, 9]])
    return tokens, span_rows(vmodel.w, types, [encode_image(vmodel.w, vmodel.args, im)])


def test_packed_rows_round_trip(vmodel, chunk_rows):
    tokens, rows = chunk_rows
    d = vmodel.args.dim
    index, packed = packed_rows(rows, 1, tokens.size(1), d)
    assert index.tolist() == [[0] * 4 + [1, 2, 3, 4, 5] + [0] * 3]
    assert packed.shape == (6, d) and not packed[0].any()
    back = unpacked_rows(index, packed)
    assert torch.equal(back.mask, rows.mask) and torch.equal(back.rows, rows.rows)
    index, packed = packed_rows(None, 2, 3, d)  # text: one zero row, no span position
    assert not index.any() and index.shape == (2, 3) and packed.shape == (1, d)
    assert not packed.any()
    with pytest.raises(ValueError, match="image rows cover"):
        packed_rows(rows, 1, 5, d)


def _cache_equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(cache_tensors(a), b, strict=True))


@pytest.mark.parametrize("with_image", [False, True])
@pytest.mark.slow
def test_span_entries_equal_the_graph_bit_for_bit(vmodel, chunk_rows, with_image):
    tokens, rows = chunk_rows
    image = rows if with_image else None
    if not with_image:
        tokens = torch.tensor([[int(x) for x in np.random.default_rng(2).integers(3, 500, 12)]])
    m = vmodel
    for entry in ("prefill_all", "encoder"):
        assert takes_spans(m.args, entry)
        ref, mine = (new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id) for _ in range(2))
        if entry == "prefill_all":
            want = (prefill_exact(m, ref, tokens, all_logits=True, image=image).logits,)
        else:
            spans = None if image is None else SequenceImages(
                (PlacedSpan(4, image.rows[0, 4:4 + int(image.mask.sum())]),))
            enc = encoder_prefill(m, ref, tokens, images=spans)
            want = (enc.h, enc.pre)
        graph = PhaseGraph(m, entry, mine)
        assert any(n.endswith("bias_vl") for n in graph.weight_names)
        chunk = new_chunk(m, mine, tokens, image=image)
        x = entry_inputs(m, mine, entry, tokens, start=chunk.start, hash_ids=chunk.hash_ids,
                         rope=chunk.rope, image=image)
        assert isinstance(x[0], tuple) and len(x[0]) == 3  # (tokens, span_index, span_rows)
        with torch.no_grad():
            out = graph(*x)
        for a, b in zip(want, out, strict=False):
            assert torch.equal(a, b), entry
        assert _cache_equal(ref, out[-len(cache_names(ref)):]), entry


def test_a_text_model_has_no_span_inputs(small_model):
    m = small_model
    assert not any(takes_spans(m.args, e) for e in ("prefill", "prefill_all", "encoder",
                                                    "encoder_replay", "decoder", "decode"))
    cache = new_cache(m.plan, 1, 64)
    tokens = torch.tensor([[3, 4, 5]])
    x = entry_inputs(m, cache, "prefill_all", tokens)
    assert x[0] is tokens
    assert not any(n.endswith("bias_vl") for n in PhaseGraph(m, "prefill_all", cache).weight_names)
    rows = SpanRows(torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 3, m.args.dim))
    with pytest.raises(ValueError, match="takes no image-span rows"):
        entry_inputs(m, cache, "prefill_all", tokens, image=rows)
