"""Images through the engine (`Session.send(..., images=[...])`, exact mode on the graph): the
runtime lays out each span, the tower's rows are spliced in any turn, and the tiers key on the
image content (`runtime/images.py`).

The model is shared-vision-small's with `vision_min_pixels` 1 (planning only; the weights do
not depend on it), so an 84 x 42 image is a 3 x 6 patch grid, a 1 x 2 aligner grid and a
5-position span, and each turn runs in seconds. Outputs are greedy: equal token for token to
the graph's own phases run the same way (prefill_exact, decode_step)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dsv41.graph.cache import new_cache
from dsv41.graph.config import load_config
from dsv41.graph.image_processor import preprocess
from dsv41.graph.model import Model
from dsv41.graph.phases import decode_step, prefill_exact
from dsv41.graph.vision import encode_image, span_rows
from dsv41.runtime.engine import Engine
from dsv41.runtime.images import key_tokens
from dsv41.runtime.requests import RequestError

CASE = Path(__file__).resolve().parents[2] / "shared" / "conformance" / "shared-vision-small"
PAGE = 8
IMG = 510  # the case's image_token_id


@pytest.fixture(scope="module")
def model():
    if not CASE.exists():
        pytest.skip(f"conformance pack {CASE} is not present")
    ckpt = CASE / "checkpoint"
    return Model.from_checkpoint(ckpt, load_config(ckpt).replace(vision_min_pixels=1))


def _png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (42, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _text(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _engine(model, **kw):
    return Engine.from_model(model, weights_hash="v" * 64, page_tokens=PAGE, exact=True, **kw)


def _graph_turns(model, turns, max_new=2):
    """The engine's exact live path by hand: each turn's [pending] + ids (spans expanded, rows
    from the tower) through prefill_exact, then greedy decode steps."""
    cache = new_cache(model.plan, 1, PAGE, engram_pad=model.engram.pad_id)
    pending, outs = [], []
    for ids, images in turns:
        fresh, types, embs = list(pending), [-1] * len(pending), []
        for t in ids:
            if t == IMG:
                im = preprocess(Image.open(io.BytesIO(images[len(embs)])), model.args)
                embs.append(encode_image(model.w, model.args, im))
                span = im.grid.span_types().tolist()
                fresh += [IMG] * len(span)
                types += span
            else:
                fresh.append(t)
                types.append(-1)
        rows = span_rows(model.w, np.array(types), embs) if embs else None
        logits = prefill_exact(model, cache, torch.tensor([fresh]), image=rows).logits[0, -1]
        out = [int(logits.argmax())]
        while len(out) < max_new:
            out.append(int(decode_step(model, cache, torch.tensor([[out[-1]]])).logits[0, -1]
                           .argmax()))
        pending = [out[-1]]
        outs.append(out)
    return outs


TURN1 = _text(9, 1)
TURN2 = _text(4, 2) + [IMG] + _text(6, 3)  # the image arrives in the second turn
TURN3 = _text(3, 4)


def test_image_in_a_later_turn_equals_the_graph(model):
    a, b = _png(1), _png(2)
    turns = [(TURN1, []), (TURN2, [a]), ([IMG, *_text(2, 5), IMG], [b, a])]
    ref = _graph_turns(model, turns)
    s = _engine(model).session()
    got = [list(s.send(ids, max_new_tokens=2, images=ims)) for ids, ims in turns]
    assert got == ref
    assert [r.tier for r in s.turns] == ["cold", "live", "live"]
    first = len(TURN1) + 2 + 4  # turn 1, its 2 tokens (1 fed + pending), turn 2's text
    third = first + 5 + 6 + 1 + 1  # span, text, turn 2's fed token and pending one
    assert [im.start for im in s.images] == [first, third, third + 5 + 2]
    assert s.history[first:first + 5] == [IMG] * 5 and s.history[first - 1] != IMG


def test_tiers_key_on_the_image_content(model, tmp_path):
    a, b = _png(1), _png(2)
    prompt = TURN2
    e = _engine(model, store_dir=tmp_path / "store")
    s1 = e.session()
    out1 = list(s1.send(prompt, max_new_tokens=2, images=[a]))
    more = _text(5, 7)
    follow = list(s1.send(more, max_new_tokens=2))  # s1's cache was let go: a snapshot hit
    assert s1.turns[-1].tier == "snapshot-ssd" or s1.turns[-1].tier == "snapshot"
    # another session with the same image and tokens is served by s1's first-turn snapshot
    s2 = e.session()
    again = list(s2.send(prompt + out1 + more, max_new_tokens=2, images=[a]))
    assert s2.turns[-1].tier in ("snapshot", "snapshot-ssd") and again == follow
    # the same tokens with another image of the same size: no record of image a serves it
    s3 = e.session()
    other = list(s3.send(prompt + out1 + more, max_new_tokens=2, images=[b]))
    assert s3.turns[-1].tier == "cold"
    fresh = _engine(model).session()
    assert other == list(fresh.send(prompt + out1 + more, max_new_tokens=2, images=[b]))
    # keys: the blocks before the span agree, every key covering it differs
    ka = e.block_keys(key_tokens(s2.history, s2.images))
    kb = e.block_keys(key_tokens(s3.history, s3.images))
    span_block = s2.images[0].start // PAGE
    assert ka[:span_block] == kb[:span_block]
    assert all(x != y for x, y in zip(ka[span_block:], kb[span_block:], strict=True))
    text_only = e.block_keys(s2.history)  # the raw ids: what a text prompt would key
    assert all(x != y for x, y in zip(ka[span_block:], text_only[span_block:], strict=True))
    e.close()


def test_image_requests_are_clear_errors(model, small_model, tmp_path):
    a = _png(1)
    s = _engine(model).session()
    with pytest.raises(RequestError, match="1 image placeholder.*for 2 image"):
        s.send(TURN2, images=[a, a])
    with pytest.raises(RequestError, match="1 image placeholder.*for 0 image"):
        s.send(TURN2)
    with pytest.raises(RequestError, match="could not be decoded"):
        s.send(TURN2, images=[b"not a png"])
    ced = Engine.from_model(model, weights_hash="v" * 64, page_tokens=PAGE).session()
    with pytest.raises(RequestError, match="exact mode"):
        ced.send(TURN2, images=[a])
    text = Engine.from_model(small_model, weights_hash="v" * 64, page_tokens=PAGE,
                             exact=True).session()
    with pytest.raises(RequestError, match="no vision tower"):
        text.send(TURN2, images=[a])
    # a transcript holding image ids without their images cannot be resumed
    resumed = _engine(model, store_dir=tmp_path / "store").session(
        transcript=[*TURN1, IMG, IMG, IMG, IMG, IMG])
    with pytest.raises(RequestError, match="has no image for it"):
        list(resumed.send(TURN3, max_new_tokens=2))
    assert s.history == [] and s.turns == []
