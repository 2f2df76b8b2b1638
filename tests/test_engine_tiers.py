"""The tiers across sessions and processes, and decoder bounded replay at every prefill, on the
PyTorch graph's phases (shared-small: window 16, encoder 0-2, decoder 3-5; pages of 8).

- a new session (in a fresh engine over the same store folder) reuses the blocks of another
  conversation it shares a prefix with, and only those; its own blocks follow the divergence;
- a decode step after any prefill reads no decoder-ring entry written before that prefill's
  replay segment (whatever the decoder rings held, the turn's logits are the same);
- the pool's snapshot bytes are the per-plan count of `state.snapshot_nbytes`: the bill's
  encoder snapshot (`layout.encoder_snapshot_bytes`) plus the entries of a page not yet whole."""

from __future__ import annotations

import numpy as np
import torch

from dsv41.graph.cache import new_cache
from dsv41.graph.layout import encoder_snapshot_bytes
from dsv41.graph.phases import ced_prefill, replay_prefill
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.state import (
    index_owner_at,
    restore_blocks,
    snapshot_nbytes,
    snapshot_ring_layers,
)

PAGE = 8


def _engine(model, store=None, **kw):
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, store_dir=store,
                             **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _cold(model, prompt):
    cache = new_cache(model.plan, 1, 64, engram_pad=model.engram.pad_id)
    return ced_prefill(model, cache, torch.tensor([prompt])).logits[0, -1].numpy()


def _send(session, ids, n=3):
    toks = list(session.send(ids, max_new_tokens=n, keep_logits=True))
    return toks, np.stack(session.turns[-1].logits)


def test_a_new_session_in_a_fresh_engine_reuses_a_shared_prefix(small_model, tmp_path):
    store = tmp_path / "store"
    first = _engine(small_model, store)
    a = first.session()
    _send(a, _prompt(37, 1), n=4)  # 40 positions: blocks 0-4
    old_keys = first.block_keys(a.history)
    first.close()  # drains the background writer

    # shares its first 20 tokens (blocks 0 and 1 whole, block 2 only in part), then diverges
    prompt = a.history[:20] + _prompt(10, 2)
    e = _engine(small_model, store)  # a new engine: empty pool, the store's index rebuilt
    b = e.session()
    _, logits = _send(b, prompt)
    r = b.turns[-1]
    new_keys = e.block_keys(prompt)
    assert new_keys[:2] == old_keys[:2] and new_keys[2] != old_keys[2]
    assert (r.tier, r.cached_blocks, r.reused_keys, r.reused_tokens) == \
        ("prefix", 2, old_keys[:2], 16)
    w = small_model.args.window_size
    assert (r.replayed, r.prefilled) == (min(w, 16), len(prompt) - 16)

    # the replay covers the whole cached prefix (16 = window), so this hit is a cold prefill
    np.testing.assert_array_equal(logits[0], _cold(small_model, prompt))

    # sharing 28 tokens: blocks 0-2 reused, the replay cut at 8; the logits are the graph's
    # bounded replay over exactly the stored blocks, and close to a cold prefill
    deeper = a.history[:28] + _prompt(7, 4)
    c = e.session()
    _, logits_c = _send(c, deeper)
    rc = c.turns[-1]
    assert (rc.tier, rc.reused_keys, rc.replayed) == ("prefix", old_keys[:3], w)
    cache = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
    restore_blocks(cache, [e.store.get(k) for k in old_keys[:3]], PAGE)
    cache.index_owner = torch.tensor([index_owner_at(small_model.plan, 24)])
    want = replay_prefill(small_model, cache, torch.tensor([deeper[:24]]),
                          torch.tensor([deeper[24:]])).logits[0, -1].numpy()
    np.testing.assert_array_equal(logits_c[0], want)
    cold = _cold(small_model, deeper)
    rel = np.linalg.norm(logits_c[0] - cold) / np.linalg.norm(cold)
    print(f"prefix hit (3 blocks, replay from 8) vs cold prefill: rel L2 {rel:.4f}")
    assert rel < 0.2  # bounded replay is approximate; the artifact-vs-graph bound of test_compile

    # after the divergence each conversation has its own blocks: b's block 2 and 3 are new
    # files, a's are untouched, and a's next turn is served from a's own blocks
    e.flush()
    b_keys = e.block_keys(b.history)
    assert len(b_keys) == 4 and not set(b_keys[2:]) & set(old_keys)
    assert not set(e.block_keys(c.history)[3:]) & set(old_keys + b_keys)
    assert all(e.store.contains(k) for k in old_keys + b_keys)
    a2 = e.session(transcript=a.transcript)
    _send(a2, [5])
    r2 = a2.turns[-1]
    assert (r2.tier, r2.reused_keys) == ("prefix", old_keys)  # a's snapshot died with `first`
    e.close()


def test_a_new_session_hits_another_sessions_snapshot(small_model, tmp_path):
    """A prompt that continues another conversation's transcript resumes from that
    conversation's snapshot (same engine, so the same pool) and matches the conversation's own
    next turn bit for bit."""
    e = _engine(small_model, tmp_path / "store")
    a = e.session()
    _send(a, _prompt(37, 1), n=4)
    transcript, more = a.transcript, _prompt(6, 3)
    b = e.session()
    toks_b, logits_b = _send(b, transcript + more)
    rb = b.turns[-1]
    assert (rb.tier, rb.reused_keys, rb.reused_tokens) == \
        ("snapshot", e.block_keys(transcript)[:5], 40)
    toks_a, logits_a = _send(a, more)
    assert a.turns[-1].tier == "snapshot"
    assert toks_a == toks_b
    np.testing.assert_array_equal(logits_a, logits_b)
    e.close()


def _scramble_decoder_rings(model, cache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer, ring in cache.windows.items():
        if layer >= model.plan.decoder_start:  # decoder and DSpark layers
            # finite e4m3 codes only (0x7f / 0xff are NaN): a scrambled entry that is read
            # must change the logits, not make them NaN (a NaN now fails the turn)
            mag = torch.randint(0, 0x7F, ring.codes.shape, dtype=torch.uint8, generator=g)
            sign = torch.randint(0, 2, ring.codes.shape, dtype=torch.uint8, generator=g) << 7
            ring.codes = mag | sign
            ring.scales = torch.randint(100, 140, ring.scales.shape, dtype=torch.uint8,
                                        generator=g)


def _live_turns(model, *, scramble: bool, carry: bool = False):
    """Two live turns (no store); before the second, optionally every decoder ring entry the
    first turn left is replaced by random bytes."""
    e = _engine(model, decoder_carry=carry)
    s = e.session()
    _send(s, _prompt(37, 1), n=4)
    if scramble:
        _scramble_decoder_rings(model, s.cache, 7)
    out = [_send(s, new, n=4) for new in (_prompt(5, 2),)]
    return out, s.turns[-1]


def test_decode_after_a_prefill_reads_no_decoder_entry_from_before_its_replay(small_model):
    """The second turn's prefill logits and every decode step after it are the same whatever
    the decoder rings held before the turn: nothing written before the replay segment (the
    last `window` prompt tokens) is read. With decoder carry-over the same scramble changes
    them, so the test can fail."""
    (clean,), rec = _live_turns(small_model, scramble=False)
    (dirty,), _ = _live_turns(small_model, scramble=True)
    w = small_model.args.window_size
    d, n_dec = small_model.plan.decoder_start, small_model.args.n_layers - \
        small_model.plan.decoder_start
    fresh = 1 + 5  # the pending token + the new ones
    assert (rec.tier, rec.prefilled, rec.replayed, rec.decoder_replayed) == \
        ("live", fresh, w - fresh, w)
    assert rec.token_layers == d * w + n_dec * w
    assert clean[0] == dirty[0]
    np.testing.assert_array_equal(clean[1], dirty[1])
    (carried,), crec = _live_turns(small_model, scramble=False, carry=True)
    (carried_dirty,), _ = _live_turns(small_model, scramble=True, carry=True)
    assert (crec.replayed, crec.decoder_replayed) == (0, fresh)
    assert not np.array_equal(carried[1], carried_dirty[1])


def test_pool_snapshot_bytes_are_the_per_plan_count(small_model, tmp_path):
    plan = small_model.plan
    for carry in (False, True):
        e = _engine(small_model, tmp_path / f"store-{carry}", decoder_carry=carry)
        s = e.session()
        _send(s, _prompt(37, 1), n=4)  # 40 positions: 5 whole blocks, no partial entries
        if not carry:  # the released design: exactly the bill's encoder snapshot
            assert e.stats().pool.bytes == encoder_snapshot_bytes(plan) == 4232  # shared-small
        _send(s, _prompt(6, 2), n=3)  # 49 positions: one partial entry of the ratio-1 source
        layers = snapshot_ring_layers(plan, all_rings=carry)
        want = snapshot_nbytes(plan, len(s.history), PAGE, layers)
        if not carry:  # plus the global entries of the page not yet whole (not in the SSD yet)
            assert e.stats().pool.bytes == encoder_snapshot_bytes(plan) + want["partial"]
        assert e.stats().pool.entries == 1  # the first turn's snapshot was dropped
        assert e.stats().pool.bytes == sum(want.values())
        assert want["partial"] > 0
        enc = [p.layer for p in plan.layers if p.layer < plan.decoder_start]
        assert layers == (tuple(p.layer for p in plan.layers) if carry else tuple(enc))
        e.close()


def test_resume_prefill_keeps_the_encoder_state_and_rebuilds_the_decoder_rings(small_model):
    """The cached tail replayed for its outputs leaves the encoder's rings, the tails, the
    pointers and the global entries exactly as a plain CED continuation leaves them; only the
    decoder (and DSpark) rings differ, rebuilt from the last `window` prompt tokens."""
    from dsv41.graph.cache import select_sequences
    from dsv41.graph.phases import resume_prefill

    m = small_model
    first, new = torch.tensor([_prompt(30, 1)]), torch.tensor([_prompt(5, 2)])
    a = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    ced_prefill(m, a, first)
    b = select_sequences(a, [0])
    res_a = ced_prefill(m, a, new)
    res_b = resume_prefill(m, b, first, new)
    w, d = m.args.window_size, m.plan.decoder_start
    assert res_b.work == {**{k: w for k in range(d)}, **{k: w for k in range(d, m.args.n_layers)}}
    assert res_a.work[d] == 5 and res_a.work[0] == 5
    assert torch.equal(a.pos, b.pos) and torch.equal(a.index_owner, b.index_owner)
    assert np.array_equal(a.engram_history, b.engram_history)
    for layer, st in a.stores.items():
        for name in ("kv_codes", "kv_scales", "k_codes", "k_scales", "tail_kv", "tail_score"):
            x, y = getattr(st, name), getattr(b.stores[layer], name)
            assert (x is None and y is None) or torch.equal(x, y), (layer, name)
    for layer, ring in a.windows.items():
        same = torch.equal(ring.codes, b.windows[layer].codes)
        assert same == (layer < d), layer
    # with at least `window` new tokens it is the plain CED continuation
    c, e = select_sequences(b, [0]), select_sequences(b, [0])
    more = torch.tensor([_prompt(w, 3)])
    np.testing.assert_array_equal(resume_prefill(m, c, torch.cat([first, new], 1), more).logits,
                                  ced_prefill(m, e, more).logits)


def test_resume_prefill_rows_are_the_replayed_tail_then_the_new_tokens(small_model):
    """With `record` and `keep_rows`, a resumed prefill's encoder rows are the t replayed cached
    tokens followed by the S new ones (t + S = window), as a chunked prefill joins its chunks:
    the new tokens' rows equal a plain encoder pass over them from the same cache, and no row
    of either part is dropped."""
    from dsv41.graph.cache import select_sequences
    from dsv41.graph.phases import encode_cached_tail, encoder_prefill, resume_prefill

    m = small_model
    w, layer = m.args.window_size, 0  # layer 0 is an encoder layer
    first, new = torch.tensor([_prompt(30, 4)]), torch.tensor([_prompt(5, 5)])
    a = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    ced_prefill(m, a, first)
    b, c = select_sequences(a, [0]), select_sequences(a, [0])
    t = min(30, w - 5)
    res = resume_prefill(m, a, first, new, record=(layer,), keep_rows=True)
    tail = encode_cached_tail(m, b, first, t, (layer,))
    fresh = encoder_prefill(m, c, new, (layer,))
    assert res.hidden[layer].shape[1] == t + 5
    torch.testing.assert_close(res.hidden[layer], torch.cat([tail.hidden[layer],
                                                             fresh.hidden[layer]], 1),
                               rtol=0, atol=0)
    assert tail.selections and res.selections.keys() >= tail.selections.keys()
    for k, rows in tail.selections.items():  # the tail's selections, then the new tokens'
        assert torch.equal(res.selections[k], torch.cat([rows, fresh.selections[k]], 1)), k


def test_a_stored_block_this_engine_cannot_restore_ends_the_prefix(small_model, tmp_path):
    """A block file with the right key, fingerprint and checksums whose arrays do not fit the
    engine (here: one reshaped) used to raise out of the turn; now the store counts it corrupt
    and deletes it, the prefix ends before it, and the turn's tokens are a cold run's."""
    e = _engine(small_model, tmp_path / "store")
    a = e.session()
    _send(a, _prompt(20, 1), n=1)
    e.flush()
    keys = e.block_keys(a.history)
    bad = e.blocks.get(keys[0])
    name = min(bad)
    shape = bad[name].shape
    bad[name] = bad[name].reshape(-1)
    assert e.blocks.drop(keys[0]) and e.store.put(keys[0], bad)
    b = e.session()
    toks, _ = _send(b, a.transcript + [5])
    assert (b.turns[-1].tier, b.turns[-1].reused_keys) == ("cold", [])
    e.flush()  # b's cold turn stores the block again, whole (its writer ran in the background)
    assert e.stats().store.corrupt == 1
    assert e.blocks.get(keys[0])[name].shape == shape
    e.close()
    ref = _engine(small_model).session()
    assert toks == _send(ref, a.transcript + [5])[0]
