"""`/metrics` through prometheus_client (issue 41 item 4): a real server (uvicorn on a thread) over
the PyTorch graph's engine of shared-small (pages of 8, an SSD store, the DRAM pool), scraped and
parsed with `prometheus_client.parser`:

- every vLLM-named series is there with vLLM's type and a `model_name` label;
- one conversation going cold -> snapshot -> prefix moves the tier series by exactly the tokens
  each tier served, as the responses' usage says (`live` needs a session that outlives its
  request, which the batcher never keeps: each request is a new session; its mapping to the
  runtime cache is checked on the collector);
- a speculating server's spec counters move by exactly what the request's usage reports;
- two apps in one process keep their own registries.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv41.graph.config import load_config
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.frontend import BatcherStats
from dsv41.runtime.serving.metrics import ServerMetrics, parse_metrics
from dsv41.runtime.serving.tokenizer import Tokenizer

MODEL = "small"
PAGE = 8

# vLLM's series (the family name prometheus_client's parser gives: counters without `_total`)
VLLM_SERIES = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
VLLM_SPEC_SERIES = {
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
}


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _families(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=60).text)


def _complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.fixture(scope="module")
def tok(small_case):
    return Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)


def _serve(engine: Engine, tok: Tokenizer):
    batcher = Batcher(engine, tokenizer=tok, max_running=4, max_queue=8)
    batcher.start()
    a = engine.model.args
    srv = ServerThread(
        create_app(
            batcher,
            tok,
            ServerOptions(model_name=MODEL, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len),
        )
    ).start()
    return batcher, srv


@pytest.fixture(scope="module")
def served(small_model, tok, tmp_path_factory):
    engine = Engine.from_model(
        small_model,
        weights_hash="m" * 64,
        page_tokens=PAGE,
        store_dir=tmp_path_factory.mktemp("store"),
    )
    batcher, srv = _serve(engine, tok)
    yield {"url": srv.url, "engine": engine}
    srv.stop()
    batcher.stop()
    engine.close()


def test_every_vllm_series_is_there_with_vllms_type_and_model_name(served):
    _complete(served["url"], _prompt(9, 40), max_tokens=3)
    fams = _families(served["url"])
    assert {name: fams[name].type for name in VLLM_SERIES if name in fams} == VLLM_SERIES
    assert not set(VLLM_SPEC_SERIES) & set(fams)  # this engine does not speculate
    for name in (
        *VLLM_SERIES,
        "dsv41:tier_hits",
        "dsv41:tier_hit_tokens",
        "dsv41:prompt_cache_hit_tokens",
        "dsv41:ssd_store_bytes",
        "dsv41:snapshot_pool_hits",
        "dsv41:requests_rejected",
    ):
        assert all(s.labels.get("model_name") == MODEL for s in fams[name].samples), name
    assert fams["dsv41:ssd_store_read_errors"].type == "counter"
    assert fams["dsv41:ssd_store_bytes"].type == "gauge"
    assert [s.labels["pool"] for s in fams["dsv41:snapshot_pool_hits"].samples] == ["dram"]
    got = _metrics(served["url"])
    assert got["vllm:num_requests_running"] == 0 and got["vllm:num_requests_waiting"] == 0
    assert 0 <= got["vllm:kv_cache_usage_perc"] <= 1
    assert got["vllm:request_generation_tokens_count"] >= 1


TIER_SERIES = ('dsv41:tier_hits_total{tier="%s"}', 'dsv41:tier_hit_tokens_total{tier="%s"}')
CACHES = ("runtime_cache", "dram_pool", "ssd_store")


def _tier_view(got: dict[str, float]) -> dict[str, float]:
    keys = [k % t for k in TIER_SERIES for t in ("cold", "snapshot", "prefix", "live")]
    keys += [f'dsv41:prompt_cache_hit_tokens_total{{cache="{c}"}}' for c in CACHES]
    keys += [
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "dsv41:replayed_tokens_total",
        'dsv41:snapshot_pool_hits_total{pool="dram"}',
        'dsv41:snapshot_pool_misses_total{pool="dram"}',
    ]
    return {k: got.get(k, 0.0) for k in keys}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_tier_series_follow_a_conversation_cold_snapshot_prefix(served):
    """Turn 1 (21 tokens) is cold; turn 2 continues it (its 21 tokens + 2 new: one generated
    token stays pending, so the snapshot stands after the prompt) from the DRAM snapshot (the
    window's last 14 cached tokens replayed); a
    third request shares the first 18 tokens only: its 2 complete blocks (16 tokens) come from
    the SSD store (a prefix hit), replayed through the encoder (the window is 16)."""
    url, w = served["url"], served["engine"].model.args.window_size
    first = _prompt(21, 1)
    steps = [("cold", first), ("snapshot", first + [9, 10]), ("prefix", first[:18] + _prompt(5, 2))]
    want = {
        "cold": {'dsv41:tier_hits_total{tier="cold"}': 1, "vllm:prefix_cache_queries_total": 21},
        "snapshot": {
            'dsv41:tier_hits_total{tier="snapshot"}': 1,
            'dsv41:tier_hit_tokens_total{tier="snapshot"}': 21,
            'dsv41:prompt_cache_hit_tokens_total{cache="dram_pool"}': 21,
            "vllm:prefix_cache_queries_total": 23,
            "vllm:prefix_cache_hits_total": 21,
            'dsv41:snapshot_pool_hits_total{pool="dram"}': 1,
            # the window's cached tokens the 2 new ones do not cover, through the
            # encoder again (the decoder's bounded replay reads their outputs)
            "dsv41:replayed_tokens_total": w - 2,
        },
        "prefix": {
            'dsv41:tier_hits_total{tier="prefix"}': 1,
            'dsv41:tier_hit_tokens_total{tier="prefix"}': 16,
            'dsv41:prompt_cache_hit_tokens_total{cache="ssd_store"}': 16,
            "vllm:prefix_cache_queries_total": 23,
            "vllm:prefix_cache_hits_total": 16,
            "dsv41:replayed_tokens_total": min(w, 16),
        },
    }
    for tier, prompt in steps:
        before = _tier_view(_metrics(url))
        usage = _complete(url, prompt)
        got = _delta(before, _tier_view(_metrics(url)))
        assert got == want[tier], tier
        cache = usage["dsv41_prompt_cache"]
        assert cache["tier"] == tier
        assert usage["prompt_cache_hit_tokens"] == got.get("vllm:prefix_cache_hits_total", 0)
        for c in CACHES:  # the usage's buckets are the metric's deltas
            key = f'dsv41:prompt_cache_hit_tokens_total{{cache="{c}"}}'
            assert cache[f"{c}_tokens"] == got.get(key, 0), (tier, c)
        assert cache["replayed_tokens"] == got.get("dsv41:replayed_tokens_total", 0)


def test_the_collector_maps_every_engine_tier_to_its_cache():
    """live and handoff are the runtime cache, snapshot the DRAM pool, snapshot-ssd and prefix
    the SSD store, cold nothing; the SSD store's and the pool's stats when the batcher has
    them."""
    from dsv41.runtime.tiers.redis_pool import RedisPoolStats
    from dsv41.runtime.tiers.ssd_store import KVStoreStats

    tokens = {"live": 5, "handoff": 7, "snapshot": 11, "snapshot-ssd": 13, "prefix": 17, "cold": 0}
    store = KVStoreStats(
        entries=3,
        bytes=300,
        capacity=1000,
        hits=4,
        misses=2,
        writes=3,
        refused_writes=0,
        evictions=1,
        corrupt=1,
        truncated=1,
        foreign=0,
        read_errors=2,
    )
    pool = RedisPoolStats(
        entries=1,
        bytes=64,
        budget=128,
        hits=6,
        misses=3,
        expired=0,
        evictions=0,
        refused=0,
        lost=0,
        corrupted=0,
        foreign=0,
        unavailable=0,
        full=0,
        write_errors=0,
        restarts=0,
        nodes=1,
        nodes_down=0,
    )
    from dsv41.runtime.serving.frontend import TierStores

    stats = BatcherStats(
        0,
        0,
        6,
        0,
        60,
        6,
        dict.fromkeys(tokens, 1),
        tier_tokens=tokens,
        stores=TierStores(store, pool),
    )
    m = ServerMetrics(MODEL)
    m.watch(lambda: stats)
    got = parse_metrics(m.render())
    assert {c: got[f'dsv41:prompt_cache_hit_tokens_total{{cache="{c}"}}'] for c in CACHES} == {
        "runtime_cache": 12,
        "dram_pool": 11,
        "ssd_store": 30,
    }
    assert got["vllm:prefix_cache_hits_total"] == 53
    assert (
        got["dsv41:ssd_store_bytes"],
        got["dsv41:ssd_store_read_errors_total"],
        got["dsv41:ssd_store_evictions_total"],
        got["dsv41:ssd_store_corrupt_total"],
    ) == (300, 2, 1, 2)
    assert (
        got['dsv41:snapshot_pool_hits_total{pool="redis"}'],
        got['dsv41:snapshot_pool_misses_total{pool="redis"}'],
    ) == (6, 3)


def test_two_apps_in_one_process_keep_their_own_counts(tok, small_model):
    """Each app its own registry: a request to one moves only its series; one ServerMetrics
    cannot watch two frontends."""
    engine = Engine.from_model(small_model, weights_hash="m" * 64, page_tokens=PAGE)
    b1, s1 = _serve(engine, tok)
    try:
        a = engine.model.args
        m2 = ServerMetrics(MODEL)
        s2 = ServerThread(
            create_app(
                b1,
                tok,
                ServerOptions(model_name=MODEL, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len),
                metrics=m2,
            )
        ).start()
        try:
            _complete(s1.url, _prompt(5, 3))
            key = 'dsv41:requests_total{endpoint="completions"}'
            assert _metrics(s1.url)[key] == 1 and key not in _metrics(s2.url)
            with pytest.raises(ValueError, match="already watch a frontend"):
                create_app(
                    b1,
                    tok,
                    ServerOptions(
                        model_name=MODEL, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len
                    ),
                    metrics=m2,
                )
            with pytest.raises(ValueError, match="serves 'other'"):
                create_app(
                    b1,
                    tok,
                    ServerOptions(
                        model_name="other", vocab_size=a.vocab_size, max_seq_len=a.max_seq_len
                    ),
                    metrics=ServerMetrics(MODEL),
                )
        finally:
            s2.stop()
    finally:
        s1.stop()
        b1.stop()
        engine.close()


def test_spec_counters_move_by_what_the_usage_reports(small_model, tok):
    """A server whose engine speculates (`on`: DSpark drafts every step): one request's usage
    `speculative` and the spec series' deltas are the same numbers, in vLLM's names."""
    engine = Engine.from_model(
        small_model, weights_hash="m" * 64, page_tokens=PAGE, speculative="on"
    )
    batcher, srv = _serve(engine, tok)
    try:
        fams = _families(srv.url)
        assert {n: fams[n].type for n in VLLM_SPEC_SERIES} == VLLM_SPEC_SERIES
        before = _metrics(srv.url)
        usage = _complete(srv.url, _prompt(9, 5), max_tokens=5)
        after = _metrics(srv.url)
        spec = batcher.stats().speculative
        assert isinstance(spec, SpecCounts) and spec.steps >= 1
        d = {k: after[k] - before.get(k, 0) for k in after if "spec_decode" in k}
        assert d["vllm:spec_decode_num_drafts_total"] == spec.steps
        assert d["vllm:spec_decode_num_draft_tokens_total"] == usage["speculative"]["drafted"]
        assert d["vllm:spec_decode_num_accepted_tokens_total"] == usage["speculative"]["accepted"]
        per_pos = [
            d.get(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}', 0)
            for j in range(len(spec.accepted_at))
        ]
        assert per_pos == list(spec.accepted_at)
        assert usage["speculative"]["drafted"] == spec.drafted >= 1
    finally:
        srv.stop()
        batcher.stop()
        engine.close()


# every family /metrics exports with a frontend that has every part (speculation, the runtime
# prefix tier, the SSD store, the DRAM pool): (name as the parser gives it, type, label names),
# in exposition order; `_created` are prometheus_client's creation-time gauges of each counter
# and histogram
ALL_FAMILIES = [
    ("dsv41:requests", "counter", ("endpoint", "model_name")),
    ("dsv41:requests_created", "gauge", ("endpoint", "model_name")),
    ("dsv41:requests_rejected", "counter", ("code", "model_name")),
    ("dsv41:requests_rejected_created", "gauge", ("code", "model_name")),
    ("dsv41:requests_finished", "counter", ("model_name", "reason")),
    ("dsv41:requests_finished_created", "gauge", ("model_name", "reason")),
    ("vllm:request_success", "counter", ("finished_reason", "model_name")),
    ("vllm:request_success_created", "gauge", ("finished_reason", "model_name")),
    ("vllm:time_to_first_token_seconds", "histogram", ("model_name",)),
    ("vllm:time_to_first_token_seconds_created", "gauge", ("model_name",)),
    ("vllm:inter_token_latency_seconds", "histogram", ("model_name",)),
    ("vllm:inter_token_latency_seconds_created", "gauge", ("model_name",)),
    ("vllm:time_per_output_token_seconds", "histogram", ("model_name",)),
    ("vllm:time_per_output_token_seconds_created", "gauge", ("model_name",)),
    ("vllm:request_time_per_output_token_seconds", "histogram", ("model_name",)),
    ("vllm:request_time_per_output_token_seconds_created", "gauge", ("model_name",)),
    ("vllm:e2e_request_latency_seconds", "histogram", ("model_name",)),
    ("vllm:e2e_request_latency_seconds_created", "gauge", ("model_name",)),
    ("vllm:request_queue_time_seconds", "histogram", ("model_name",)),
    ("vllm:request_queue_time_seconds_created", "gauge", ("model_name",)),
    ("vllm:request_prompt_tokens", "histogram", ("model_name",)),
    ("vllm:request_prompt_tokens_created", "gauge", ("model_name",)),
    ("vllm:request_generation_tokens", "histogram", ("model_name",)),
    ("vllm:request_generation_tokens_created", "gauge", ("model_name",)),
    ("dsv41:generation_tokens_per_second", "gauge", ("model_name",)),
    ("vllm:num_requests_waiting", "gauge", ("model_name",)),
    ("vllm:num_requests_running", "gauge", ("model_name",)),
    ("vllm:kv_cache_usage_perc", "gauge", ("model_name",)),
    ("vllm:prompt_tokens", "counter", ("model_name",)),
    ("vllm:generation_tokens", "counter", ("model_name",)),
    ("vllm:prefix_cache_queries", "counter", ("model_name",)),
    ("vllm:prefix_cache_hits", "counter", ("model_name",)),
    ("dsv41:batcher_finished", "counter", ("model_name",)),
    ("dsv41:batcher_cancelled", "counter", ("model_name",)),
    ("dsv41:tier_hits", "counter", ("model_name", "tier")),
    ("dsv41:tier_hit_tokens", "counter", ("model_name", "tier")),
    ("dsv41:prompt_cache_hit_tokens", "counter", ("cache", "model_name")),
    ("dsv41:replayed_tokens", "counter", ("model_name",)),
    ("dsv41:decoder_replayed_tokens", "counter", ("model_name",)),
    ("vllm:spec_decode_num_drafts", "counter", ("model_name",)),
    ("vllm:spec_decode_num_draft_tokens", "counter", ("model_name",)),
    ("vllm:spec_decode_num_accepted_tokens", "counter", ("model_name",)),
    ("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", ("model_name", "position")),
    ("dsv41:spec_draft_tokens_per_pos", "counter", ("model_name", "position")),
    ("dsv41:spec_mean_accepted_length", "gauge", ("model_name",)),
    ("dsv41:spec_acceptance_rate", "gauge", ("model_name",)),
    ("dsv41:runtime_prefix_bytes", "gauge", ("model_name",)),
    ("dsv41:runtime_prefix_entries", "gauge", ("model_name",)),
    ("dsv41:runtime_prefix_hits", "counter", ("model_name",)),
    ("dsv41:runtime_prefix_stored", "counter", ("model_name",)),
    ("dsv41:runtime_prefix_evictions", "counter", ("model_name",)),
    ("dsv41:runtime_prefix_refused", "counter", ("model_name",)),
    ("dsv41:ssd_store_bytes", "gauge", ("model_name",)),
    ("dsv41:ssd_store_capacity_bytes", "gauge", ("model_name",)),
    ("dsv41:ssd_store_entries", "gauge", ("model_name",)),
    ("dsv41:ssd_store_hits", "counter", ("model_name",)),
    ("dsv41:ssd_store_misses", "counter", ("model_name",)),
    ("dsv41:ssd_store_writes", "counter", ("model_name",)),
    ("dsv41:ssd_store_evictions", "counter", ("model_name",)),
    ("dsv41:ssd_store_read_errors", "counter", ("model_name",)),
    ("dsv41:ssd_store_write_errors", "counter", ("model_name",)),
    ("dsv41:ssd_store_corrupt", "counter", ("model_name",)),
    ("dsv41:snapshot_pool_bytes", "gauge", ("model_name", "pool")),
    ("dsv41:snapshot_pool_entries", "gauge", ("model_name", "pool")),
    ("dsv41:snapshot_pool_hits", "counter", ("model_name", "pool")),
    ("dsv41:snapshot_pool_misses", "counter", ("model_name", "pool")),
    ("dsv41:snapshot_pool_evictions", "counter", ("model_name", "pool")),
]


def test_the_full_list_of_exported_families_names_types_and_labels():
    """The names, types and labels docs/serving.md's table documents, pinned in the order
    /metrics writes them: a refactor of how the families are built cannot change them."""
    from dsv41.runtime.engine.records import SpecCounts
    from dsv41.runtime.serving.frontend import TierStores
    from dsv41.runtime.serving.metrics import FinishTiming
    from dsv41.runtime.tiers.dram_pool import SnapshotPoolStats
    from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocksStats
    from dsv41.runtime.tiers.ssd_store import KVStoreStats

    stats = BatcherStats(
        1,
        2,
        3,
        4,
        50,
        60,
        {"cold": 1, "snapshot": 2},
        speculative=SpecCounts(5, (4, 3), (3, 1)),
        tier_tokens={"cold": 0, "snapshot": 16},
        replayed_tokens=7,
        decoder_replayed_tokens=8,
        cache_bytes=25,
        cache_budget_bytes=100,
        stores=TierStores(
            KVStoreStats(3, 300, 1000, 4, 2, 3, 0, 1, 1, 1, 0, 2, 1),
            SnapshotPoolStats(1, 64, 128, 6, 3, 0, 2, 0),
            RuntimeBlocksStats(2, 32, 64, 5, 1, 4, 1, 0),
        ),
    )
    m = ServerMetrics(MODEL)
    m.watch(lambda: stats)
    m.count_request("chat")
    m.count_rejected(400)
    m.observe_finish("stop", FinishTiming(0.1, 0.2, (0.01, 0.02), 3, 9))
    got = [
        (f.name, f.type, tuple(sorted({k for s in f.samples for k in s.labels} - {"le"})))
        for f in text_string_to_metric_families(m.render().decode())
    ]
    assert got == ALL_FAMILIES
    values = parse_metrics(m.render())
    assert (
        values["vllm:kv_cache_usage_perc"],
        values["dsv41:spec_acceptance_rate"],
        values['dsv41:spec_draft_tokens_per_pos_total{position="1"}'],
        values["dsv41:runtime_prefix_stored_total"],
        values["dsv41:ssd_store_corrupt_total"],
        values['dsv41:snapshot_pool_evictions_total{pool="dram"}'],
        values['dsv41:tier_hit_tokens_total{tier="snapshot"}'],
    ) == (0.25, 4 / 7, 3, 4, 2, 2, 16)
