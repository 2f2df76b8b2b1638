"""The runtime-cache prefix tier (issue 42, item 1; runtime/tiers/runtime_blocks.py): prompt
blocks of running and finished requests reused by later requests under the SSD store's chained
keys, evicted LRU within the runtime budget, counted as the `runtime-prefix` tier. On the torch
graph over shared-small, pages of 8 positions (the window is 16: a hit of at most 2 blocks is
replayed whole, so its output is a cold prefill's)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.keys import TierKeys
from dsv41.runtime.engine.planner import TurnPlanner
from dsv41.runtime.engine.records import Tier
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.engine.state import snapshot_ring_layers
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.openai_api import CacheTier, PromptCache, Usage
from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocks

PAGE = 8


def _engine(model, store=None, **kw) -> Engine:
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, store_dir=store, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _send(session, ids, n=3):
    toks = list(session.send(ids, max_new_tokens=n, keep_logits=True))
    return toks, np.stack(session.turns[-1].logits)


def _rows(nbytes: int) -> dict[str, torch.Tensor]:
    return {"0.kv_codes": torch.zeros(nbytes, dtype=torch.uint8)}


# ---- the tier alone -----------------------------------------------------------------------------


def test_lru_eviction_order_within_the_room():
    room = [100]
    t = RuntimeBlocks(lambda: room[0])
    for k in "abcd":
        assert t.put(k, _rows(25))
    assert t.keys() == list("abcd") and t.nbytes() == 100
    assert t.get("a") is not None  # a use: "a" is now the most recent
    assert t.put("e", _rows(30))  # 130 > 100: b then c evicted (least recently used first)
    assert t.keys() == ["d", "a", "e"] and t.nbytes() == 80
    assert t.lookup_prefix(["d", "a", "b"]) == 2 and t.keys() == ["d", "a", "e"]  # no LRU change
    room[0] = 60  # the live caches grew: a cache takes its room from the tier
    assert t.evict_bytes(t.nbytes() - room[0]) == ["d"]
    assert not t.put("big", _rows(61))  # bigger than the whole room: refused, nothing evicted
    assert t.put("a", _rows(999))  # held already: only touched
    assert t.keys() == ["e", "a"]
    assert t.get("zz") is None
    s = t.stats()
    assert (s.entries, s.bytes, s.room, s.hits, s.misses, s.stored, s.evictions, s.refused) == (
        2,
        55,
        60,
        1,
        1,
        5,
        3,
        1,
    )
    with pytest.raises(ValueError, match="rows only"):
        t.put("f", _rows(1), {"x": 1})


# ---- the engine ---------------------------------------------------------------------------------


def test_a_request_reuses_the_rows_of_one_still_decoding(small_model):
    e = _engine(small_model, runtime_prefix=True)  # no SSD store: only live, runtime, cold
    assert [lv.tier for lv in e.planner.levels] == ["live", "runtime-prefix", "cold"]
    shared = _prompt(20, 1)
    a = e.session()
    gen = a.send(shared + _prompt(5, 2), max_new_tokens=8)
    next(gen)  # a decodes (its turn open, its cache live)
    a_keys = e.block_keys(shared + _prompt(5, 2))
    assert e.runtime_blocks.keys() == a_keys[::-1]  # last block first: the chain's start is MRU
    b = e.session()
    prompt = shared + _prompt(6, 3)  # shares blocks 0 and 1 (16 tokens), then diverges
    toks, logits = _send(b, prompt)
    r = b.turns[-1]
    assert (r.tier, r.cached_blocks, r.reused_keys, r.reused_tokens) == (
        "runtime-prefix",
        2,
        a_keys[:2],
        16,
    )
    assert (r.replayed, r.prefilled) == (16, len(prompt) - 16)
    assert e.tier_counts["runtime-prefix"] == 1 and e.token_counts["runtime_prefix"] == 16
    assert e.stats().runtime_blocks.hits == 2
    # the replay covers the whole reused prefix (16 = window): it is the first 16 positions'
    # prefill. The request served alone, cold, on a fresh engine without the tier, prefilled in
    # chunks of 16 (the same two chunks: 16 replayed, 10 new), gives the same tokens and every
    # logit to the bit. Prefilled as one chunk of 26 it gives the same tokens; its logits are
    # bit-equal only where torch's GEMMs round a row alike at every row count (not on a Xeon
    # with AMX), so they are held to a tolerance.
    fresh = _engine(small_model, prefill_chunk_tokens=16)
    c = fresh.session()
    toks_cold, logits_cold = _send(c, prompt)
    assert c.turns[-1].tier == "cold" and toks == toks_cold
    np.testing.assert_array_equal(logits, logits_cold)
    one = _engine(small_model)
    c = one.session()
    toks_one, logits_one = _send(c, prompt)
    assert c.turns[-1].tier == "cold" and toks == toks_one
    np.testing.assert_allclose(logits, logits_one, rtol=0, atol=0.5)  # Xeon, AMX: 0.28 seen
    assert list(gen)  # a decodes on, unchanged by b
    e.close()
    fresh.close()
    one.close()


def test_a_finished_requests_blocks_are_reused_as_the_ssd_tier_would_serve(small_model, tmp_path):
    """Past the window the reuse is the SSD prefix tier's bounded replay over the same bytes:
    the runtime tier's output equals the SSD tier's, token and logit, on a fresh engine."""
    e = _engine(small_model, tmp_path / "s1", runtime_prefix=True)
    shared = _prompt(36, 4)
    a = e.session()
    _send(a, shared + [7], n=4)  # 41 positions: blocks 0-3 of the prompt kept
    keys = e.block_keys(shared + [7])
    assert a.cache is None  # finished: with a store its cache is let go, its blocks stay here
    assert sorted(e.runtime_blocks.keys()) == sorted(keys) and len(keys) == 4
    e.flush()
    shutil.copytree(tmp_path / "s1", tmp_path / "s2")  # the SSD store as a's turn left it
    submitted = e.stats().writer.submitted
    b = e.session()
    prompt = shared[:28] + _prompt(9, 5)  # blocks 0-2 shared (the SSD holds them too: a tie)
    toks, logits = _send(b, prompt)
    r = b.turns[-1]
    assert (r.tier, r.reused_keys, r.reused_tokens, r.replayed) == (
        "runtime-prefix",
        keys[:3],
        24,
        16,
    )
    e.flush()
    # its turn end writes only the block the SSD store lacks (block 3 of b's 39-token history)
    assert e.stats().writer.submitted - submitted == len(e.block_keys(b.history)) - 3 == 1
    e.close()

    # the same request on a fresh engine over the SSD store alone: the prefix tier, same output
    ssd = _engine(small_model, tmp_path / "s2")
    c = ssd.session()
    toks_ssd, logits_ssd = _send(c, prompt)
    assert (c.turns[-1].tier, c.turns[-1].reused_keys) == ("prefix", keys[:3])
    assert toks == toks_ssd
    np.testing.assert_array_equal(logits, logits_ssd)
    ssd.close()


def test_the_budget_evicts_the_tiers_lru_blocks_for_a_live_cache(small_model, tmp_path):
    e = _engine(small_model, tmp_path / "s", runtime_prefix=True)
    a = e.session()
    _send(a, _prompt(40, 6), n=2)  # blocks 0-4 kept, a's cache let go
    keys = e.block_keys(a.history[:40])
    st = e.stats().runtime_blocks
    assert (st.entries, e.runtime_bytes()) == (5, st.bytes)
    block = st.bytes // 5
    # a budget that holds the next request's cache and 3 blocks, not 5: the admission evicts the
    # 2 least recently used (the end of a's chain), its prompt of 5 tokens adds none
    small = e.cache_bytes(5 + 2 + 1) + 3 * block + block // 2
    e.options = replace(e.options, cache_budget_bytes=small)
    b = e.session()
    gen = b.send(_prompt(5, 7), max_new_tokens=2)
    next(gen)
    assert e.runtime_blocks.keys() == keys[2::-1]  # keys 4 and 3 evicted, 0 the most recent
    assert e.stats().runtime_blocks.evictions == 2
    assert e.runtime_bytes() <= small
    list(gen)
    e.close()


def test_another_salt_never_reuses_the_tiers_blocks(small_model):
    e = _engine(small_model, runtime_prefix=True)
    prompt = _prompt(30, 8)
    s = e.session()
    _send(s, prompt)
    assert len(e.runtime_blocks) == 3
    # the same tier read under another model's (or salt's) keys: nothing matches, cold
    other = TierKeys(bytes(32), PAGE)
    assert not set(other.block_keys(prompt)) & set(e.runtime_blocks.keys())
    rings = snapshot_ring_layers(small_model.plan, all_rings=False)
    planner = TurnPlanner(
        small_model, e.options, other, e.pool, None, e.new_cache, rings, e.runtime_blocks
    )
    plan = planner.restore(prompt, live=None, live_tokens=0, resumed=False)
    assert (plan.tier, plan.cached, plan.keys) == ("cold", 0, ())
    st = e.stats().runtime_blocks
    assert (st.hits, st.misses) == (0, 0)
    # and a second engine of other weights has a tier of its own (empty): its turn is cold
    e2 = Engine.from_model(
        small_model, weights_hash="x" * 64, page_tokens=PAGE, runtime_prefix=True
    )
    s2 = e2.session()
    _send(s2, prompt)
    assert s2.turns[-1].tier == "cold"
    e.close()
    e2.close()


def test_exact_mode_refuses_the_tier():
    from dsv41.runtime.engine.options import EngineOptions

    with pytest.raises(ValueError, match="runtime_prefix needs the bounded replay"):
        EngineOptions(exact=True, runtime_prefix=True)


def test_usage_counts_a_runtime_prefix_hit_at_the_runtime_cache():
    u = Usage(
        prompt_tokens=40,
        completion_tokens=3,
        cached_tokens=32,
        cache=PromptCache(tier=Tier.RUNTIME_PREFIX, replayed=16, decoder_replayed=16),
    )
    pc = u.body()["dsv41_prompt_cache"]
    assert pc == {
        "tier": "runtime-prefix",
        CacheTier.RUNTIME.value: 32,
        "dram_pool_tokens": 0,
        "ssd_store_tokens": 0,
        "replayed_tokens": 16,
        "decoder_replayed_tokens": 16,
    }


# ---- through the batcher ------------------------------------------------------------------------


def test_concurrent_requests_with_one_prefix_prefill_it_once(small_model, tmp_path):
    e = _engine(small_model, tmp_path / "s", runtime_prefix=True)
    shared = _prompt(16, 9)  # 2 blocks: within the window, so each hit equals a cold prefill
    prompts = [shared + _prompt(4, 10 + i) for i in range(3)]  # one length: one shape each
    b = Batcher(e, max_running=3)
    streams = [b.submit(p, SamplingParams(temperature=0.0, max_tokens=2)) for p in prompts]
    while b.step():
        pass
    got = [[ev.token_id for ev in s] for s in streams]
    st = b.stats()
    assert st.tiers == {"cold": 1, "runtime-prefix": 2}  # the prefix prefilled once
    assert st.tier_tokens == {"cold": 0, "runtime-prefix": 2 * 16}
    assert e.token_counts["prefilled"] == sum(len(p) for p in prompts) - 2 * 16
    assert e.token_counts["runtime_prefix"] == 2 * 16
    assert st.stores.runtime_blocks.hits == 2 * 2
    # the same requests one by one on a fresh engine, all cold: the same tokens
    fresh = _engine(small_model)
    for p, toks in zip(prompts, got, strict=True):
        s = fresh.session()
        assert toks == list(s.send(p, max_new_tokens=2)) and s.turns[-1].tier == "cold"
        s.close()
    b.stop()
    e.close()
    fresh.close()
