"""The embedded engine over the PyTorch graph's phases (the same turn logic drives compiled
artifacts; `test_engine_artifact.py` runs it there): turn planning across the tiers, exact
resume, bounded replay counts, bytes, corruption, budgets, batched decode and bad input.

shared-small: 6 layers (encoder 0-2, decoder 3-5), window 16, ratios up to 2; pages of 8."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dsv41.graph.bill import make_bill
from dsv41.graph.config import preset
from dsv41.graph.model import Model
from dsv41.runtime.engine import CacheFullError, Engine

PAGE = 8


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _engine(model, tmp_path=None, **kw):
    if tmp_path is not None:
        kw.setdefault("store_dir", tmp_path / "store")
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, **kw)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _turns(engine, turns, *, max_new=4, session=None):
    """Play turns; returns (tokens per turn, logits per turn, records)."""
    s = session or engine.session()
    toks, logits = [], []
    for ids in turns:
        toks.append(list(s.send(ids, max_new_tokens=max_new, keep_logits=True)))
        logits.append(np.stack(s.turns[-1].logits))
    return toks, logits, s.turns[-len(turns):]


TURNS = [_prompt(37, 1), _prompt(5, 2), _prompt(11, 3)]


def test_exact_resume_from_the_ssd_tier_equals_an_uninterrupted_run(small_model, tmp_path):
    ref_toks, ref_logits, _ = _turns(_engine(small_model, exact=True), TURNS)
    # the same conversation, the engine (and its DRAM pool) thrown away after every turn
    toks, logits, tiers = [], [], []
    transcript: list[int] = []
    for ids in TURNS:
        e = _engine(small_model, tmp_path, exact=True)
        s = e.session(transcript=transcript)
        toks.append(list(s.send(ids, max_new_tokens=4, keep_logits=True)))
        logits.append(np.stack(s.turns[-1].logits))
        tiers.append(s.turns[-1].tier)
        transcript = s.transcript
        e.close()  # one owner per store folder: the next engine is the next process
    assert tiers == ["cold", "snapshot-ssd", "snapshot-ssd"]
    assert toks == ref_toks
    for a, b in zip(logits, ref_logits, strict=True):
        np.testing.assert_array_equal(a, b)


def test_snapshot_hit_equals_the_live_cache(small_model, tmp_path):
    live_toks, live_logits, live = _turns(_engine(small_model), TURNS)
    toks, logits, recs = _turns(_engine(small_model, tmp_path), TURNS)
    assert [r.tier for r in live] == ["cold", "live", "live"]
    assert [r.tier for r in recs] == ["cold", "snapshot", "snapshot"]
    assert toks == live_toks
    for a, b in zip(logits, live_logits, strict=True):
        np.testing.assert_array_equal(a, b)


def test_snapshot_miss_replays_window_plus_suffix(small_model, tmp_path):
    clock = Clock()
    e = _engine(small_model, tmp_path, pool_clock=clock)
    s = e.session()
    list(s.send(_prompt(37, 1), max_new_tokens=4))  # 37 + 3 fed = 40 cached, 5 blocks of 8
    assert len(s.history) == 40 and s.stored_blocks == 5
    clock.t += 601  # the snapshot's TTL (600 s) has passed
    new = _prompt(6, 2)
    list(s.send(new, max_new_tokens=2))
    r = s.turns[-1]
    a = small_model.args
    w, n_dec = a.window_size, a.n_layers - small_model.plan.decoder_start
    suffix = 1 + len(new)  # the pending token + the new ones (the blocks cover all 40)
    assert (r.tier, r.cached_blocks, r.replayed, r.prefilled) == ("prefix", 5, w, suffix)
    assert r.token_layers == small_model.plan.decoder_start * (w + suffix) + \
        n_dec * min(w, w + suffix)
    assert e.stats().pool.expired == 1


def test_prefix_hit_replay_is_the_graphs_replay_prefill(small_model, tmp_path):
    """The engine's prefix path runs exactly `replay_prefill` over the restored blocks."""
    from dsv41.graph.cache import drop_local_state, new_cache
    from dsv41.graph.phases import ced_prefill, replay_prefill

    clock = Clock()
    e = _engine(small_model, tmp_path, pool_clock=clock)
    s = e.session()
    first = _prompt(40, 4)
    list(s.send(first, max_new_tokens=1))  # 40 cached, pending one token
    clock.t += 601
    list(s.send([7], max_new_tokens=1, keep_logits=True))
    got = s.turns[-1].logits[0]
    cache = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
    ced_prefill(small_model, cache, torch.tensor([first]))
    drop_local_state(cache)
    want = replay_prefill(small_model, cache, torch.tensor([first]),
                          torch.tensor([[s.history[40], 7]])).logits[0, -1].numpy()
    np.testing.assert_array_equal(got, want)


def test_runtime_bytes_per_token_equal_the_bill(small_model, tmp_path):
    e = _engine(small_model)
    s = e.session()
    list(s.send(_prompt(37, 1), max_new_tokens=4))
    st = e.stats()
    cap = min(x.capacity * x.ratio for x in s.cache.stores.values())
    assert cap % PAGE == 0 and cap >= 41
    bill = make_bill(small_model.args, contexts=(cap,)).global_bytes_per_token
    assert (st.runtime_bytes["main_kv"] + st.runtime_bytes["index_k"]) == bill * cap
    assert st.runtime_tokens == 40 and st.sessions_live == 1
    # with an SSD store the runtime cache lets the session go at the end of the turn
    e2 = _engine(small_model, tmp_path)
    list(e2.session().send(_prompt(37, 1), max_new_tokens=4))
    assert e2.stats().sessions_live == 0 and e2.stats().runtime_bytes["main_kv"] == 0


def test_full_preset_allocation_at_1m_tokens_is_890_bytes_per_token():
    model = Model.placeholder(preset("full"))
    e = Engine.from_model(model, weights_hash="0" * 64, cache_budget_bytes=8 << 30)
    cache = e.new_cache()
    e.reserve(cache, 1_000_000)  # not a whole number of 256-position pages
    nb = cache.nbytes()
    cap = min(st.capacity * st.ratio for st in cache.stores.values())
    assert cap == 1_000_192  # 3907 pages
    assert make_bill(model.args, contexts=(cap,)).global_bytes_per_token == 890
    assert nb["main_kv"] + nb["index_k"] == 890 * cap
    per = (nb["main_kv"] + nb["index_k"]) / 1_000_000
    assert 890 <= per <= 890 * 1.005, per


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_bad_ssd_blocks_are_misses(small_model, tmp_path, damage):
    clock = Clock()
    e = _engine(small_model, tmp_path, pool_clock=clock)
    s = e.session()
    list(s.send(_prompt(37, 1), max_new_tokens=4))
    e.flush()  # the blocks are written in the background
    files = sorted((tmp_path / "store").rglob("*.blk"))
    keys = e.block_keys(s.history)
    victim = next(p for p in files if p.stem == keys[2])
    data = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:  # the same block written by another model
        other = Engine.from_model(small_model, weights_hash="x" * 64, page_tokens=PAGE,
                                  store_dir=tmp_path / "other")
        o = other.session()
        list(o.send(_prompt(37, 1), max_new_tokens=4))
        other.close()
        theirs = next((tmp_path / "other").rglob(f"{other.block_keys(o.history)[2]}.blk"))
        victim.write_bytes(theirs.read_bytes())
    clock.t += 601
    list(s.send([5], max_new_tokens=1))
    r = s.turns[-1]
    assert (r.tier, r.cached_blocks) == ("prefix", 2)  # blocks 0-1 served, 2 was the miss
    st = e.stats().store
    assert {"flip": st.corrupt, "truncate": st.truncated, "foreign": st.foreign}[damage] == 1
    # deleted when detected; the turn's end wrote the block again from the rebuilt cache
    e.flush()
    assert e.store.get(keys[2]) is not None
    assert e.stats().store.corrupt + e.stats().store.truncated + e.stats().store.foreign == 1


def test_budget_refusal_leaves_other_sessions_intact(small_model):
    e = _engine(small_model)
    a = e.session()
    list(a.send(_prompt(20, 1), max_new_tokens=2))
    before = {k: v.clone() for k, v in
              {"kv": a.cache.stores[1].kv_codes, "ring": a.cache.windows[0].codes}.items()}
    used = e.runtime_bytes()
    e.options = type(e.options)(**{**e.options.__dict__, "cache_budget_bytes": used + 1000})
    b = e.session()
    with pytest.raises(CacheFullError, match="runtime cache needs"):
        b.send(_prompt(60, 2), max_new_tokens=2)
    assert b.cache is None and b.history == []
    assert torch.equal(a.cache.stores[1].kv_codes, before["kv"])
    assert torch.equal(a.cache.windows[0].codes, before["ring"])
    assert e.runtime_bytes() == used


def test_send_many_decodes_sessions_together(small_model):
    prompts = [_prompt(30, 5), _prompt(19, 6), _prompt(25, 7)]
    alone = []
    for p in prompts:
        alone.append(list(_engine(small_model).session().send(p, max_new_tokens=5)))
    e = _engine(small_model)
    sessions = [e.session() for _ in prompts]
    outs = e.send_many([(s, p, {"max_new_tokens": n}) for s, p, n in
                        zip(sessions, prompts, (5, 3, 5), strict=True)])
    assert outs[0] == alone[0] and outs[2] == alone[2] and outs[1] == alone[1][:3]
    assert [len(s.history) for s in sessions] == [34, 21, 29]
    assert [s.pending for s in sessions] == [o[-1] for o in outs]
    # the sessions continue on their own afterwards
    nxt = list(sessions[1].send([9], max_new_tokens=2))
    assert len(nxt) == 2


def test_sampling_is_seeded(small_model):
    e = _engine(small_model)
    a = list(e.session().send(_prompt(12), max_new_tokens=6, temperature=1.0, seed=3))
    b = list(e.session().send(_prompt(12), max_new_tokens=6, temperature=1.0, seed=3))
    assert a == b


def test_stop_token_and_abandoned_turn(small_model, tmp_path):
    e = _engine(small_model, tmp_path)
    s = e.session()
    first = list(s.send(_prompt(12), max_new_tokens=6))
    s2 = e.session()
    out = list(s2.send(_prompt(12), max_new_tokens=6, stop=(first[2],)))
    assert out == first[: first.index(first[2]) + 1]
    s3 = e.session()
    gen = s3.send(_prompt(12), max_new_tokens=6)
    got = [next(gen), next(gen)]
    s3.send([4], max_new_tokens=1)  # the abandoned turn is stored first
    assert got == first[:2]
    assert s3.turns[0].decoded == 1 and len(s3.history) == 12 + 2 + 1


def test_bad_input_is_a_clear_error(small_model):
    e = _engine(small_model)
    s = e.session()
    for bad, msg in [([], "non-empty"), ([1, 10**6], "must lie in"), ([-1], "must lie in"),
                     ([[1, 2]], "1-D"), ([1.5], "integer")]:
        with pytest.raises(ValueError, match=msg):
            s.send(bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.send([1], max_new_tokens=-1)
    with pytest.raises(ValueError, match="max_seq_len"):
        s.send([1] * 120, max_new_tokens=20)
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.send([1])
    with pytest.raises(ValueError, match="multiple of the largest"):
        Engine.from_model(small_model, weights_hash="w", page_tokens=3)


# ---- chunked prefill ---------------------------------------------------------------------------


def test_chunk_spans_cover_the_segment_without_one_token_chunks():
    from dsv41.graph.phases import chunk_spans

    assert chunk_spans(40, 7) == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40)]
    assert chunk_spans(15, 7) == [(0, 7), (7, 15)]  # a last token joins the chunk before it
    assert chunk_spans(1, 7) == [(0, 1)] and chunk_spans(7, 7) == [(0, 7)]
    for bad in (1, 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="at least 2 tokens"):
            chunk_spans(10, bad)
    with pytest.raises(ValueError, match="at least one token"):
        chunk_spans(0, 7)


def _chunked_conformance(case, model, chunk: int, one_shot):
    from dsv41.graph.conformance import against, evaluate
    from dsv41.graph.score import GraphBackend, score

    got = score(GraphBackend(model, chunk_tokens=chunk), case.tokens, prefill=case.prefill,
                hidden_layers=case.hidden_layers)
    # `against` keeps no hidden states (the one-shot run is the golden there)
    return evaluate(case, got), evaluate(against(case, one_shot), replace(got, hidden={}))


@pytest.mark.parametrize("chunk", [7, 13])  # cut through ratio-2 groups and the 16-wide window
def test_chunked_exact_prefill_is_conformant_on_shared_small(small_case, small_model, chunk):
    """Exact prefill in chunks against the golden and against the one-shot prefill, both with
    the pack's own bounds (the chunks' windows list continuation order: rounding-level
    differences only, amplified by bf16 selection ties)."""
    from dsv41.graph.score import GraphBackend, score

    one = score(GraphBackend(small_model), small_case.tokens, prefill=small_case.prefill,
                hidden_layers=small_case.hidden_layers)
    to_golden, to_one_shot = _chunked_conformance(small_case, small_model, chunk, one)
    assert to_golden.conformant, to_golden.failures
    assert to_one_shot.conformant, to_one_shot.failures


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [7, 37])
def test_chunked_exact_prefill_is_conformant_on_shared_v41_small(v41_case, v41_model, chunk):
    from dsv41.graph.score import GraphBackend, score

    one = score(GraphBackend(v41_model), v41_case.tokens, prefill=v41_case.prefill,
                hidden_layers=v41_case.hidden_layers)
    to_golden, to_one_shot = _chunked_conformance(v41_case, v41_model, chunk, one)
    assert to_golden.conformant, to_golden.failures
    assert to_one_shot.conformant, to_one_shot.failures


def _fresh(model):
    from dsv41.graph.cache import new_cache

    return new_cache(model.plan, 1, 128, engram_pad=model.engram.pad_id)


@pytest.mark.parametrize("chunk", [5, 7, 16])
def test_chunked_ced_prefill_keeps_the_token_layer_count(small_model, chunk):
    """n_enc * N + n_dec * min(N, window) per chunked CED prefill, layer by layer; the decoder
    replays the same last window (same cache position, logits close to the one-shot's)."""
    from dsv41.graph.phases import ced_prefill

    m, n = small_model, 40
    toks = torch.tensor([_prompt(n, 9)])
    d, w = m.plan.decoder_start, m.args.window_size
    one = ced_prefill(m, _fresh(m), toks)
    c2 = _fresh(m)
    got = ced_prefill(m, c2, toks, chunk_tokens=chunk)
    assert got.work == {lay: n if lay < d else min(n, w) for lay in range(m.args.n_layers)}
    assert got.token_layers == d * n + (m.args.n_layers - d) * min(n, w) == one.token_layers
    assert int(c2.pos[0]) == n and got.logits.shape == one.logits.shape == (1, 1, m.args.vocab_size)
    rel = float((got.logits - one.logits).norm() / one.logits.norm())
    assert rel < 0.33, rel  # shared-small's rel_l2_max bound (0.327)


def test_engine_chunks_every_prefill_kind(small_model, tmp_path):
    """cold (CED), snapshot miss (encoder bounded replay) and exact turns in chunks of 5: the
    same tiers and token-layer counts as unchunked, logits within shared-small's bound."""
    for exact in (False, True):
        clocks, runs = [Clock(), Clock()], []
        for i, chunk in enumerate((2048, 5)):
            e = _engine(small_model, tmp_path / f"{exact}{i}", pool_clock=clocks[i], exact=exact,
                        prefill_chunk_tokens=chunk)
            s = e.session()
            list(s.send(_prompt(37, 1), max_new_tokens=4, keep_logits=True))
            clocks[i].t += 601  # snapshot expired: the next turn is a prefix hit
            list(s.send(_prompt(19, 2), max_new_tokens=2, keep_logits=True))
            runs.append(s.turns)
        for a, b in zip(*runs, strict=True):
            assert (a.tier, a.prefilled, a.replayed, a.token_layers) == (
                b.tier, b.prefilled, b.replayed, b.token_layers)
            x, y = a.logits[0], b.logits[0]
            assert np.linalg.norm(x - y) / np.linalg.norm(x) < 0.33
        assert [t.tier for t in runs[1]] == (["cold", "snapshot-ssd"] if exact
                                             else ["cold", "prefix"])


def test_engine_refuses_a_one_token_prefill_chunk(small_model):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        _engine(small_model, prefill_chunk_tokens=1)
