"""The ledger switches (`Model.full_reindex`, `Model.per_layer_selection`) and `dsv41 ledger`.

shared-small: layer 1 Full (m=2), 2 Reuse of 1, 3 Full + candidate source (m=1), 4 Reuse of 3,
5 Reindex; index_topk 8, a candidate pool of 3 blocks of 4 entries, window 16.
Defaults are held to the released outputs (selections exactly, logits to the conformance test's
1e-5); a switch that cannot change anything is held bit-identical."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dsv41.compiler.tools.cli.main import main
from dsv41.graph.cache import new_cache
from dsv41.graph.conformance import golden_arithmetic_here
from dsv41.graph.ledger import (
    SWITCHES,
    Ledger,
    LedgerOptions,
    compare_logits,
    format_ledger,
    ledger_json,
    make_record,
    measure_on_cache,
    run_cache_trace,
    run_ledger,
    run_trace,
)
from dsv41.graph.phases import decode_step, prefill_exact


def _run(model, toks, n_prompt):
    """Prefill toks[:n_prompt], decode the rest: (all logits, {layer: selections of every row})."""
    c = new_cache(model.plan, 1, 64, engram_pad=model.engram.pad_id)
    res = [prefill_exact(model, c, toks[:, :n_prompt], all_logits=True)]
    res += [decode_step(model, c, toks[:, i : i + 1]) for i in range(n_prompt, toks.size(1))]
    logits = torch.cat([r.logits[0] for r in res])
    sel = {k: torch.cat([r.selections[k][0] for r in res]) for k in res[0].selections}
    return logits, sel


@pytest.fixture(scope="module")
def released(small_case, small_model):
    toks = torch.from_numpy(small_case.tokens)[None]
    return _run(small_model, toks, small_case.prefill)


@pytest.mark.skipif(not golden_arithmetic_here(),
                    reason="bit-exact to the goldens only where torch's CPU GEMMs sum in their "
                    "order (Intel AVX-512); elsewhere the conformance tests bound the graph")
def test_switch_defaults_are_the_released_graph(small_case, small_model, released):
    m = small_model
    assert not m.full_reindex and not m.per_layer_selection
    logits, sel = released
    g, p = small_case.golden, small_case.prefill
    assert set(sel) == {1, 3, 5, -1}  # Reuse layers publish no selection of their own
    for k in (1, 3, 5):
        np.testing.assert_array_equal(sel[k][:p].numpy(), g[f"idx_prefill_L{k}"])
        np.testing.assert_array_equal(sel[k][p:].numpy(), g[f"idx_decode_L{k}"])
    np.testing.assert_array_equal(sel[-1][:p].numpy(), g["cand_blocks_prefill_L3"])
    want = np.concatenate([g["prompt_logits_all"], g["decode_logits"]])
    rel = np.linalg.norm(logits.numpy() - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < 1e-5


def _pool_positions(blocks: torch.Tensor, block_size: int) -> list[set[int]]:
    return [{b * block_size + j for b in row.tolist() if b >= 0 for j in range(block_size)}
            for row in blocks]


def test_full_reindex_changes_reindex_selection_only_outside_the_pool(small_case, small_model,
                                                                      released):
    m, a = small_model, small_model.args
    toks = torch.from_numpy(small_case.tokens)[None]
    logits, sel = _run(dataclasses.replace(m, full_reindex=True), toks, small_case.prefill)
    base = released[1]
    for k in (1, 3, -1):  # upstream of the Reindex layer: untouched
        assert torch.equal(sel[k], base[k])
    pools = _pool_positions(base[-1], a.candidate_block_size)
    pool_size = a.candidate_topk_blocks * a.candidate_block_size
    changed = 0
    for pos, (mine, theirs, pool) in enumerate(zip(sel[5], base[5], pools, strict=True)):
        mine, theirs = set(mine.tolist()) - {-1}, set(theirs.tolist()) - {-1}
        assert theirs <= pool  # released: inside the pool
        if pos + 1 <= pool_size:  # the pool holds every visible entry: nothing to change
            assert mine == theirs
        elif mine != theirs:
            changed += 1
            assert mine - pool  # the sweep found an entry the pool had excluded
    assert changed > 0
    assert not torch.equal(logits, released[0])


def test_per_layer_selection_gives_reuse_layers_their_own_topk(small_case, small_model,
                                                               released):
    m, a = small_model, small_model.args
    toks = torch.from_numpy(small_case.tokens)[None]
    logits, sel = _run(dataclasses.replace(m, per_layer_selection=True), toks,
                       small_case.prefill)
    base, p = released[1], small_case.prefill
    # before the first Reuse layer: untouched in the prompt (decode steps differ: a filling
    # ratio-2 group scores the ratio-1 source's index K, the released shared pointer)
    assert torch.equal(sel[1][:p], base[1][:p])
    assert set(sel) == {1, 2, 3, 4, 5, -1}
    for reuse, source in ((2, 1), (4, 3)):
        ratio = m.plan.layers[reuse].ratio
        visible = (torch.arange(toks.size(1)) + 1) // ratio
        few = visible <= a.index_topk  # any top-k is every visible entry: the source's
        assert torch.equal(sel[reuse][few], sel[source][few])
        assert not torch.equal(sel[reuse][~few], sel[source][~few])
        for row, n in zip(sel[reuse], visible.tolist(), strict=True):  # a valid top-k
            ids = [i for i in row.tolist() if i >= 0]
            assert ids == sorted(set(ids)) and all(i < n for i in ids)
            assert len(ids) == min(n, a.index_topk)
    assert not torch.equal(logits, released[0])


def test_per_layer_selection_is_a_noop_below_topk(small_case, small_model):
    """8 tokens: at most 8 visible entries anywhere, so every top-k is the same set (and the
    3-block pool holds every entry, so full reindexing changes nothing either)."""
    m = small_model
    toks = torch.from_numpy(small_case.tokens[:8])[None]
    a = _run(m, toks, 6)
    b = _run(dataclasses.replace(m, per_layer_selection=True, full_reindex=True), toks, 6)
    assert torch.equal(a[0], b[0])


def test_compare_logits_metrics():
    x = torch.randn(5, 64)
    g = compare_logits(x, x)
    assert (g.kl == 0).all() and g.top1.all() and (g.rel_l2 == 0).all()
    y = x + 0.5 * torch.randn(5, 64)
    g = compare_logits(x, y)
    assert (g.kl > 0).all() and (g.rel_l2 > 0).all()
    e = torch.log_softmax(x.double(), -1)
    want = (e.exp() * (e - torch.log_softmax(y.double(), -1))).sum(-1)
    np.testing.assert_allclose(g.kl, want.numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        compare_logits(x, y[:4])


def test_ledger_records_are_consistent(small_case, small_model):
    """Context 10 (+1 decode) lies within the window and the pool, so the two replays and the
    pool cost nothing (the full-reindex no-op); context 20 is past the window, the pool and
    the top-k."""
    m, tokens = small_model, small_case.tokens
    base = run_trace(m, tokens, 10, 1)
    same = make_record("self", 10, base, base)
    assert same.kl_mean == same.kl_max == 0.0 and same.top1 == 1.0
    assert same.rel_l2_max == 0.0 and same.positions == 2
    within = run_ledger(m, LedgerOptions(contexts=(10,), decode=1, suffix=4,
                                         switches=("ced", "replay", "candidate_pool")))
    ledger = run_ledger(m, LedgerOptions(contexts=(20,), decode=1, suffix=6))
    assert [r.switch for r in ledger.records] == list(SWITCHES)
    for r in within.records + ledger.records:
        assert r.positions == 2 and 0 <= r.kl_mean <= r.kl_max and 0 <= r.top1 <= 1
        assert 0 <= r.rel_l2_median <= r.rel_l2_max
        assert (r.sel_overlap is not None) == (r.switch in ("candidate_pool",
                                                             "shared_selection"))
    for r in within.records:
        assert r.kl_max < 1e-8 and r.top1 == 1.0
    assert within.records[2].kl_max == 0.0 and within.records[2].sel_overlap == 1.0
    beyond = {r.switch: r for r in ledger.records}
    assert beyond["ced"].kl_mean > 0 and beyond["candidate_pool"].kl_mean > 0
    assert beyond["candidate_pool"].sel_overlap < 1 and beyond["shared_selection"].sel_overlap < 1
    assert "candidate_pool" in format_ledger(ledger)
    assert len(ledger_json(ledger)["records"]) == len(ledger.records)


def test_ledger_cli_end_to_end(tmp_path, capsys, small_case):
    out = tmp_path / "ledger.json"
    rc = main(["ledger", "--checkpoint", str(small_case.checkpoint), "--contexts", "8",
               "--decode", "1", "--suffix", "4", "--switches", "ced,candidate_pool",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "KL mean" in text and "candidate_pool" in text
    data = json.loads(out.read_text())
    assert [r["switch"] for r in data["records"]] == ["ced", "candidate_pool"]
    assert data["options"]["contexts"] == [8] and set(data["switches"]) == {"ced",
                                                                             "candidate_pool"}
    rc = main(["ledger", "--checkpoint", str(small_case.checkpoint), "--contexts", "8",
               "--switches", "fp8_kv"])
    assert rc == 2 and "Unknown or no switches" in capsys.readouterr().err


def _prefilled(model, tokens, n):
    c = new_cache(model.plan, 1, 64, engram_pad=model.engram.pad_id)
    prefill_exact(model, c, torch.from_numpy(tokens[:n])[None])
    return c


def test_cache_trace_is_the_decode_part_of_a_prompt_trace(small_case, small_model):
    """Over the cache a prompt left, the decode steps give the prompt trace's decode rows, bit
    for bit, and the given cache is not touched."""
    m, tokens = small_model, small_case.tokens
    full = run_trace(m, tokens, 20, 2)
    cache = _prefilled(m, tokens, 20)
    before = (cache.pos.clone(), {k: st.kv_codes.clone() for k, st in cache.stores.items()})
    forced = torch.from_numpy(tokens[20:22])[None]
    part = run_cache_trace(m, cache, forced)
    assert torch.equal(part.logits, full.logits[1:])
    assert part.selections.keys() == full.selections.keys()
    for k, sel in part.selections.items():
        assert torch.equal(sel, full.selections[k][1:])
    assert torch.equal(cache.pos, before[0])
    for k, st in cache.stores.items():
        assert torch.equal(st.kv_codes, before[1][k])


def test_selection_switches_over_a_given_cache(small_case, small_model):
    """Within the pool and the top-k (6 positions + 2 steps) the switches cost exactly nothing; past
    them (20) both change the selections and the logits."""
    m, tokens = small_model, small_case.tokens
    for n, trivial in ((6, True), (20, False)):
        cache = _prefilled(m, tokens, n)
        forced = torch.from_numpy(tokens[n : n + 2])[None]
        for name in ("candidate_pool", "shared_selection"):
            r = measure_on_cache(m, name, cache, n, forced)
            assert r.source == "cache" and r.positions == 2 and r.context == n
            if trivial:
                assert r.kl_max == 0.0 and r.sel_overlap == 1.0, name
            else:
                assert r.kl_mean > 0 and r.sel_overlap < 1, name
    with pytest.raises(ValueError, match="needs a prompt"):
        measure_on_cache(m, "ced", cache, 20, forced)


def test_long_context_options_and_runs(small_case, small_model):
    m = small_model
    with pytest.raises(ValueError, match="decode step"):
        LedgerOptions(contexts=(), long_contexts=(20,), decode=0)
    with pytest.raises(ValueError, match="none of"):
        LedgerOptions(long_contexts=(20,), switches=("ced",))
    with pytest.raises(ValueError, match="at least one"):
        LedgerOptions(contexts=())
    opts = LedgerOptions(contexts=(), long_contexts=(20,), decode=1)
    with pytest.raises(ValueError, match="cache factory"):
        run_ledger(m, opts)
    ledger = run_ledger(m, opts, cache_at=lambda n: _prefilled(m, small_case.tokens, n))
    assert [(r.switch, r.source, r.context) for r in ledger.records] == [
        ("candidate_pool", "cache", 20), ("shared_selection", "cache", 20)]
    assert "cache" in format_ledger(ledger)


def test_ledger_cli_long_contexts(tmp_path, capsys, small_case):
    """`--long-contexts` runs the selection switches over the bench's synthetic cache."""
    out = tmp_path / "ledger.json"
    rc = main(["ledger", "--checkpoint", str(small_case.checkpoint), "--contexts", "",
               "--long-contexts", "48", "--decode", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["options"]["long_contexts"] == [48] and data["options"]["contexts"] == []
    assert [(r["switch"], r["source"]) for r in data["records"]] == [
        ("candidate_pool", "cache"), ("shared_selection", "cache")]
    assert all(r["positions"] == 1 for r in data["records"])


@pytest.mark.slow
def test_switches_survive_export(small_case, small_model):
    """The captured graph is rebuilt from the model's switches: a switched export computes what
    the switched eager graph computes (about 2 minutes: two captures)."""
    from dsv41.compiler.capture import capture
    from dsv41.graph.entries import entry_inputs, selection_keys
    from dsv41.graph.phases import engram_ids

    toks = torch.from_numpy(small_case.tokens)[None]
    for sw in ("full_reindex", "per_layer_selection"):
        m = dataclasses.replace(small_model, **{sw: True})
        prog = capture(m, "prefill_all")[0].module()
        c = new_cache(m.plan, 1, 128, engram_pad=m.engram.pad_id)
        out = prog(*entry_inputs(m, c, "prefill_all", toks, hash_ids=engram_ids(m, c, toks)))
        ref = prefill_exact(m, new_cache(m.plan, 1, 128, engram_pad=m.engram.pad_id), toks,
                            all_logits=True)
        assert torch.equal(out[0], ref.logits), sw
        for k, sel in zip(selection_keys(m.plan), out[1:], strict=False):
            assert torch.equal(sel, ref.selections[k]), (sw, k)


def test_decoder_carry_switch_reports_both_designs(small_case, small_model):
    """Two turns of 30 tokens. A suffix of at least `window` (16) tokens rebuilds every decoder
    ring entry decoding reads under both designs, so carry-over and the released replay agree
    exactly; a shorter suffix leaves carry-over reading the first turn's rings, so they differ."""
    m = small_model
    short, long_ = (run_ledger(m, LedgerOptions(contexts=(30,), decode=2, carry_suffix=k,
                                                switches=("decoder_carry",))).records[0]
                    for k in (4, 20))
    for r in (short, long_):
        assert r.switch == "decoder_carry" and r.positions == 3 and r.sel_overlap is None
        assert r.released_kl_mean is not None and 0 <= r.released_top1 <= 1
    assert long_.kl_mean == long_.released_kl_mean and long_.top1 == long_.released_top1
    assert short.kl_mean != short.released_kl_mean
    text = format_ledger(Ledger(LedgerOptions(contexts=(30,), switches=("decoder_carry",)),
                                [short]))
    assert "decoder_carry at 30 (a second turn of 4 new tokens): carry-over KL mean" in text


def test_decoder_carry_scores_the_turn_where_carry_over_and_replay_differ(small_model):
    """By default (`dsv41 ledger`'s options) the carry-over turn is shorter than the decoder
    window (16 here), as the engine test where carry-over changes a second turn's output
    (test_engine_tiers): its row is not the `ced` row again, and carry-over and the released
    replay give different numbers."""
    ced, carry = run_ledger(small_model, LedgerOptions(
        contexts=(30,), decode=1, switches=("ced", "decoder_carry"))).records
    assert (ced.switch, carry.switch) == ("ced", "decoder_carry")
    assert carry.turn_tokens == small_model.args.window_size // 2 == 8
    assert carry.kl_mean > 0 and carry.released_kl_mean > 0
    assert (carry.kl_mean, carry.rel_l2_median) != (ced.kl_mean, ced.rel_l2_median)
    assert carry.kl_mean != carry.released_kl_mean
