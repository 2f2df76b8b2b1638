"""Images through the engine (`Session.send(..., images=[...])` on the graph, exact and CED
mode): the runtime lays out each span, the tower's rows are spliced in any turn, and the tiers
key on the image content (`runtime/images.py`).

The model is shared-vision-small's with `vision_min_pixels` 1 (planning only; the weights do
not depend on it), so an 84 x 42 image is a 3 x 6 patch grid, a 1 x 2 aligner grid and a
5-position span, and each turn runs in seconds. Outputs are greedy: equal token for token (and
logits bit for bit) to the graph's own phases run the same way (exact: prefill_exact; CED:
ced_prefill / resume_prefill / replay_prefill with the spans by position; then decode_step).

CED against exact mode (no engine): a segment of at most `window` (16) tokens is the same
computation in both (the decoder replays every token, its global KV is the encoder's), so the
two agree to float rounding: rel L2 of the logits <= 1e-3 (measured 0: bit for bit), where
leaving the span mask out of the decoder's replay alone (bias_vl and the Engram gate at span
positions) moves them by 0.065 (asserted > 10x the tolerance, so the test can fail). A prefix
hit's replay of a 10-token prefix holding the span, then 5 new tokens, is compared with exact
mode run in the same two pieces (10, then 5): a piece boundary just after a span moves this
seeded checkpoint's logits by 0.033 in exact mode itself (against one piece of 15; text:
1e-7), as a 1% perturbation of the span rows moves them by 0.065: its routing and top-k
selections amplify float rounding (as the README notes for the mHC kernels)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import CONFORMANCE
from PIL import Image

from dsv41.graph.cache import drop_local_state, new_cache
from dsv41.graph.config import load_config
from dsv41.graph.engram import empty_history, engram_history_after
from dsv41.graph.image_processor import preprocess
from dsv41.graph.model import Model
from dsv41.graph.phases import (
    DEFAULT_CHUNK_TOKENS,
    ced_prefill,
    decode_step,
    decoder_replay,
    encoder_prefill,
    prefill_exact,
    prepare_replay,
    replay_prefill,
    resume_prefill,
)
from dsv41.graph.vision import (
    PlacedSpan,
    SequenceImages,
    encode_image,
    place_span,
    span_rows,
)
from dsv41.runtime.engine import Engine, EngineOptions
from dsv41.runtime.engine.images import key_tokens
from dsv41.runtime.engine.requests import RequestError
from dsv41.runtime.engine.speculative import FixedLength
from dsv41.runtime.engine.state import index_owner_at, restore_blocks

CASE = CONFORMANCE / "shared-vision-small"
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
    # phases other than the graph's take images only when they say so (`check_images`, as
    # `CompiledPhases` does): refused before any phase runs (these stand-ins have none)
    other = Engine(model, SimpleNamespace(), weights_hash="v" * 64,
                   options=EngineOptions(page_tokens=PAGE), backend="other").session()
    with pytest.raises(RequestError, match=r"backend \(other\) takes no images"):
        other.send(TURN2, images=[a])

    def no_vision_entry(model):
        raise ValueError("The artifact has no `vision` entry; compile it with ...")

    compiled = Engine(model, SimpleNamespace(check_images=no_vision_entry), weights_hash="v" * 64,
                      options=EngineOptions(page_tokens=PAGE), backend="artifact").session()
    with pytest.raises(RequestError, match="no `vision` entry"):
        compiled.send(TURN2, images=[a])
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


# ---- CED mode --------------------------------------------------------------------------------

TOL = 1e-3  # CED vs exact over a segment within one window: float rounding only (see above)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _layout(model, ids, images, first: int):
    """(expanded ids, PlacedSpans) of a turn's ids whose placeholders stand for `images` (PNG
    bytes), the first id at position `first`: by hand, with the tower."""
    out, spans = [], []
    for t in ids:
        if t != IMG:
            out.append(t)
            continue
        im = preprocess(Image.open(io.BytesIO(images[len(spans)])), model.args)
        spans.append(place_span(model.w, first + len(out), im.grid,
                                encode_image(model.w, model.args, im)))
        out += [IMG] * im.grid.span_length
    return out, spans


def _fresh_cache(model, tokens: int = PAGE):
    return new_cache(model.plan, 1, tokens, engram_pad=model.engram.pad_id)


def _ced_graph_turns(model, turns, max_new=2):
    """The engine's CED live path by hand: a cold ced_prefill, then resume_prefill of each
    turn's [pending] + ids (the sequence's spans by position), then greedy decode steps."""
    cache = _fresh_cache(model)
    history, pending, spans, outs, logits = [], [], [], [], []
    for ids, images in turns:
        fresh, new = _layout(model, ids, images, len(history) + len(pending))
        fresh = pending + fresh
        spans += new
        seq = SequenceImages(tuple(spans)) if spans else None
        kw = {"chunk_tokens": DEFAULT_CHUNK_TOKENS, "images": seq}
        if history:
            res = resume_prefill(model, cache, torch.tensor([history]), torch.tensor([fresh]),
                                 **kw)
        else:
            res = ced_prefill(model, cache, torch.tensor([fresh]), **kw)
        history += fresh
        turn_logits = [res.logits[0, -1]]
        out = [int(turn_logits[-1].argmax())]
        while len(out) < max_new:
            history.append(out[-1])
            turn_logits.append(decode_step(model, cache, torch.tensor([[out[-1]]])).logits[0, -1])
            out.append(int(turn_logits[-1].argmax()))
        pending = [out[-1]]
        outs.append(out)
        logits.append(torch.stack(turn_logits).numpy())
    return outs, logits


def _ced(model, **kw):
    return Engine.from_model(model, weights_hash="v" * 64, page_tokens=PAGE, **kw)


def _send(session, ids, images=(), n=2):
    toks = list(session.send(ids, max_new_tokens=n, images=images, keep_logits=True))
    return toks, np.stack(session.turns[-1].logits)


def test_ced_phases_with_images_equal_exact_within_a_window(model):
    """ced_prefill and replay_prefill (a prefix hit: the span re-run by the encoder's bounded
    replay) with an image, over <= window tokens, against prefill_exact with the same rows."""
    ids, spans = _layout(model, TURN2, [_png(1)], 0)  # 15 positions, the span at 4..8
    seq = SequenceImages(tuple(spans))
    toks = torch.tensor([ids])
    exact = prefill_exact(model, _fresh_cache(model), toks, all_logits=True,
                          image=seq.rows(0, len(ids))).logits[0]
    ced = ced_prefill(model, _fresh_cache(model), toks, all_logits=True, images=seq).logits[0]
    cache = _fresh_cache(model)
    head = prefill_exact(model, cache, toks[:, :10], all_logits=True, image=seq.rows(0, 10))
    tail = prefill_exact(model, cache, toks[:, 10:], all_logits=True, image=seq.rows(10, 15))
    exact_pieces = torch.cat([head.logits[0], tail.logits[0]])  # exact in the replay's pieces
    cache = _fresh_cache(model)
    prefill_exact(model, cache, toks[:, :10], image=seq.rows(0, 10))
    drop_local_state(cache)  # the blocks alone: the encoder replays the prefix with its span
    replay = replay_prefill(model, cache, toks[:, :10], toks[:, 10:], all_logits=True,
                            images=seq).logits[0]
    # the bug this guards against: the decoder's replay without the span mask
    c = _fresh_cache(model)
    enc = encoder_prefill(model, c, toks, images=seq)
    unmasked = decoder_replay(model, c, enc, all_logits=True).logits[0]
    got = {"ced": _rel(ced, exact), "replay (vs exact in its pieces)": _rel(replay, exact_pieces),
           "decoder without the mask": _rel(unmasked, exact),
           "exact in two pieces vs one": _rel(exact_pieces, exact)}
    print("vs exact, rel L2: " + ", ".join(f"{k} {v:.3g}" for k, v in got.items()))
    assert got["ced"] <= TOL and got["replay (vs exact in its pieces)"] <= TOL
    assert got["decoder without the mask"] > 10 * TOL


def test_replay_lookback_treats_span_positions_as_dead(model):
    """The Engram lookback a bounded replay restores (the tokens just before it) is what the
    whole prefix gives with its span dead: pad at and before the span's last position."""
    ids, spans = _layout(model, TURN2, [_png(1)], 0)  # span at 4..8
    seq = SequenceImages(tuple(spans))
    toks = torch.tensor([ids])
    eng = model.engram
    for n in (len(ids) - 7, len(ids) - 10):  # lookback ends inside the span, or after it
        cache = _fresh_cache(model)
        prefill_exact(model, cache, toks, image=seq.rows(0, len(ids)))
        prepare_replay(model, cache, toks, replay=n, images=seq)
        cut = len(ids) - n
        want = engram_history_after(eng, empty_history(eng, 1), toks[:, :cut].numpy(),
                                    seq.dead(0, cut))
        np.testing.assert_array_equal(cache.engram_history, want)
    assert (want == eng.pad_id).sum() < want.size  # after the span: live ids again
    inside = engram_history_after(eng, empty_history(eng, 1), toks[:, :7].numpy(),
                                  seq.dead(0, 7))
    assert (inside == eng.pad_id).all()  # ends inside the span: all dead


T3 = (_text(2, 6), [])  # 3 new tokens with the pending one: the cached tail holds the span


def test_ced_image_turns_equal_the_graph_phases(model):
    """Live CED turns with images in later turns (one in turn 2, two in turn 4; turn 3's
    bounded replay of cached tokens covers turn 2's span) equal the phases by hand."""
    a, b = _png(1), _png(2)
    turns = [(TURN1, []), (TURN2, [a]), T3, ([IMG, *_text(2, 5), IMG], [b, a])]
    ref, ref_logits = _ced_graph_turns(model, turns)
    s = _ced(model).session()
    got = [_send(s, ids, ims) for ids, ims in turns]
    assert [t for t, _ in got] == ref
    for (_, lg), want in zip(got, ref_logits, strict=True):
        np.testing.assert_array_equal(lg, want)
    assert [r.tier for r in s.turns] == ["cold", "live", "live", "live"]
    assert [r.replayed for r in s.turns] == [0, 0, 13, 3]  # window 16 - new tokens
    # the images matter: another image in turn 2 gives other logits
    other = _ced(model).session()
    _send(other, *turns[0])
    _, lg = _send(other, TURN2, [b])
    assert not np.array_equal(lg, got[1][1])


def test_ced_fresh_process_equals_the_continued_session(model, tmp_path, redis_server):
    """A conversation with an image continued in its engine (a snapshot hit), and then sent
    whole to a fresh engine over the same SSD store and Redis pool (what another process sees):
    both equal the live session's turns, tokens and logits. With another image of the same
    size nothing is reused (the span is in block 0) and the output is a cold engine's. Without
    the pool a fresh engine replays from the blocks (prefix tier), bit for bit the graph's
    replay_prefill with the spans by position."""
    a, b = _png(1), _png(2)
    more, more2 = _text(5, 7), _text(5, 8)
    live = _ced(model).session()
    want = [_send(live, TURN2, [a]), _send(live, more), _send(live, more2)]
    store = tmp_path / "store"
    e1 = _ced(model, store_dir=store, redis_url=redis_server.url)
    s1 = e1.session()
    got1 = [_send(s1, TURN2, [a]), _send(s1, more)]
    assert [r.tier for r in s1.turns] == ["cold", "snapshot"]
    e1.close()
    prompt = TURN2 + got1[0][0] + more + got1[1][0] + more2  # s1's transcript + a new turn
    e2 = _ced(model, store_dir=store, redis_url=redis_server.url)  # a fresh engine
    s2 = e2.session()
    got2 = _send(s2, prompt, [a])
    assert s2.turns[-1].tier == "snapshot"
    for x, y in [(got1[1], want[1]), (got2, want[2])]:
        assert x[0] == y[0]
        np.testing.assert_array_equal(x[1], y[1])
    s3 = e2.session()
    other = _send(s3, prompt, [b])
    assert (s3.turns[-1].tier, s3.turns[-1].reused_tokens) == ("cold", 0)
    cold = _send(_ced(model).session(), prompt, [b])
    assert other[0] == cold[0]
    np.testing.assert_array_equal(other[1], cold[1])
    e2.close()
    # no pool: the blocks alone, the encoder's bounded replay runs over the span again
    e3 = _ced(model, store_dir=store)
    s4 = e3.session()
    toks, lg = _send(s4, prompt, [a])
    r = s4.turns[-1]
    ids, spans = _layout(model, prompt, [a], 0)
    assert (r.tier, r.reused_tokens) == ("prefix", (len(ids) - 1) // PAGE * PAGE)
    cut = r.reused_tokens
    cache = _fresh_cache(model)
    restore_blocks(cache, [e3.store.get(k) for k in r.reused_keys], PAGE)
    cache.index_owner = torch.tensor([index_owner_at(model.plan, cut)])
    res = replay_prefill(model, cache, torch.tensor([ids[:cut]]), torch.tensor([ids[cut:]]),
                         chunk_tokens=DEFAULT_CHUNK_TOKENS, images=SequenceImages(tuple(spans)))
    np.testing.assert_array_equal(lg[0], res.logits[0, -1].numpy())
    assert toks[0] == int(res.logits[0, -1].argmax())
    e3.close()


def test_speculative_decoding_with_an_image_keeps_the_greedy_tokens(model):
    """DSpark drafts text after a prefill whose rings hold an image span: the greedy tokens
    are the plain engine's."""
    a = _png(1)
    plain = _ced(model).session()
    engine = _ced(model, speculative=True, max_draft=1)
    engine.spec_policy = FixedLength(1)  # drafts and verifies one token at every step
    spec = engine.session()
    assert list(spec.send(TURN2, max_new_tokens=4, images=[a])) == \
        list(plain.send(TURN2, max_new_tokens=4, images=[a]))
    assert sum(r.drafted for r in spec.turns) > 0


def test_sequence_images_give_each_segment_its_own_rows(model):
    """Any segment's rows (a chunk, a replayed window) are the whole sequence's rows at its
    positions, a span cut anywhere; overlapping spans are refused."""
    ids, spans = _layout(model, [*_text(3, 1), IMG, *_text(2, 2), IMG], [_png(1), _png(2)], 5)
    seq = SequenceImages(tuple(spans))
    end = 5 + len(ids)  # the turn starts at position 5
    whole = seq.rows(0, end)
    assert [s.start for s in spans] == [8, 15] and int(whole.mask.sum()) == 10
    for size in (1, 2, 3, 4, 7):
        masks, rows = [], []
        for b in range(0, end, size):
            e = min(end, b + size)
            got = seq.rows(b, e)
            if got is None:
                assert seq.dead(b, e) is None
                got = type(whole)(torch.zeros(1, e - b, dtype=torch.bool),
                                  torch.zeros(1, e - b, model.args.dim, dtype=torch.bfloat16))
            else:
                np.testing.assert_array_equal(seq.dead(b, e), got.mask.numpy())
            masks.append(got.mask)
            rows.append(got.rows)
        assert torch.equal(torch.cat(masks, 1), whole.mask)
        assert torch.equal(torch.cat(rows, 1), whole.rows)
    assert seq.rows(0, 8) is None and seq.rows(20, 30) is None
    with pytest.raises(ValueError, match="overlap"):
        SequenceImages((spans[0], PlacedSpan(spans[0].end - 1, spans[1].rows)))
