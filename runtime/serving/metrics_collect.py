"""The /metrics series read at scrape time from a frontend's `BatcherStats`: a custom
prometheus_client collector (metrics.py registers it in the app's registry).

vLLM's names where the count means what vLLM's does:
- `vllm:num_requests_waiting`, `vllm:num_requests_running` (gauges): the queue, the batch's rows;
- `vllm:kv_cache_usage_perc` (gauge): runtime cache bytes in use over its budget (0 to 1);
- `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`: tokens admitted, generated;
- `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`: prompt tokens looked up in
  the tiers, and served by any of them;
- `vllm:spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total`
  and `_num_accepted_tokens_per_pos_total{position}`: DSpark's speculative steps, drafts
  verified, kept, kept per draft position (0: the first after the backbone's own token).

`dsv41:` for the rest: turns and prompt tokens per engine tier (`tier`: live, handoff,
runtime-prefix, snapshot, snapshot-ssd, prefix, cold), the same tokens per cache (`cache`:
runtime_cache, dram_pool, ssd_store: the usage's `dsv41_prompt_cache` buckets; runtime-prefix
counts at runtime_cache), replayed tokens, the batcher's finished and cancelled requests, drafts
verified per position, the mean accepted length and acceptance rate, the runtime prefix tier
(bytes, entries, block hits, blocks stored, evictions, refused), the SSD store (bytes, capacity,
entries, hits, misses, evictions, read and write errors, corrupt files) and the snapshot pool
(`pool`: dram or redis; bytes, entries, hits, misses, evictions). Series of a part the frontend
lacks (no speculation, no engine in this process: an EPD gateway) are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsv41.runtime.serving.frontend import BatcherStats, TierStores
from dsv41.runtime.serving.openai_api import TIER_OF, CacheTier
from dsv41.runtime.tiers.redis_pool import RedisPoolStats


def cache_label(tier: CacheTier) -> str:
    """The `cache` label of a CacheTier (its usage field without `_tokens`)."""
    return tier.value.removesuffix("_tokens")


class FrontendCollector(Collector):
    """Families from `stats()`, every sample labelled with the model's name."""

    def __init__(self, model_name: str, stats: Callable[[], BatcherStats]):
        self.model_name, self.stats = model_name, stats

    def describe(self) -> list[Metric]:
        return []  # no names claimed up front: the families depend on what the frontend has

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats(), self.model_name

        def one(family, value: float, *labels: str):
            family.add_metric([m, *labels], value)
            return family

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            return one(CounterMetricFamily(name, help_text, labels=["model_name"]), value)

        def by(name: str, help_text: str, label: str, values: dict) -> CounterMetricFamily:
            f = CounterMetricFamily(name, help_text, labels=["model_name", label])
            for key, n in sorted(values.items()):
                f.add_metric([m, key], n)
            return f

        yield one(
            GaugeMetricFamily(
                "vllm:num_requests_waiting",
                "Requests waiting for a row of the running batch.",
                labels=["model_name"],
            ),
            s.queued,
        )
        yield one(
            GaugeMetricFamily(
                "vllm:num_requests_running", "Requests in the running batch.", labels=["model_name"]
            ),
            s.running,
        )
        usage = s.cache_bytes / s.cache_budget_bytes if s.cache_budget_bytes else 0.0
        yield one(
            GaugeMetricFamily(
                "vllm:kv_cache_usage_perc",
                "Runtime cache in use, a fraction of its byte budget (1 = full).",
                labels=["model_name"],
            ),
            usage,
        )
        yield counter(
            "vllm:prompt_tokens", "Prompt tokens of the admitted requests.", s.prompt_tokens
        )
        yield counter("vllm:generation_tokens", "Tokens generated.", s.completion_tokens)
        hits = sum(s.tier_tokens.values())
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the tiers (every admitted prompt token).",
            s.prompt_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens the tiers served (not prefilled), any tier.",
            hits,
        )
        yield counter(
            "dsv41:batcher_finished",
            "Requests the batcher finished (stop, length, error).",
            s.finished,
        )
        yield counter("dsv41:batcher_cancelled", "Requests the batcher cancelled.", s.cancelled)
        yield by(
            "dsv41:tier_hits",
            "Turns served per engine tier (cold, live, snapshot, prefix, ...).",
            "tier",
            dict(s.tiers),
        )
        yield by(
            "dsv41:tier_hit_tokens",
            "Prompt tokens served per engine tier (cold: none).",
            "tier",
            dict(s.tier_tokens),
        )
        per_cache = dict.fromkeys((cache_label(t) for t in CacheTier), 0)
        for tier, n in s.tier_tokens.items():
            if tier in TIER_OF:
                per_cache[cache_label(TIER_OF[tier])] += n
        yield by(
            "dsv41:prompt_cache_hit_tokens",
            "Prompt tokens served per cache (the usage's "
            "dsv41_prompt_cache): runtime_cache, dram_pool, ssd_store.",
            "cache",
            per_cache,
        )
        yield counter(
            "dsv41:replayed_tokens",
            "Served prompt tokens run through the encoder again (a snapshot miss, a prefix hit).",
            s.replayed_tokens,
        )
        yield counter(
            "dsv41:decoder_replayed_tokens",
            "Tokens through the decoder's bounded replay.",
            s.decoder_replayed_tokens,
        )
        if s.speculative is not None:
            yield from self._spec(s)
        if s.stores is not None:
            yield from self._stores(s.stores)

    def _spec(self, s: BatcherStats) -> Iterator[Metric]:
        m, spec = self.model_name, s.speculative

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            f = CounterMetricFamily(name, help_text, labels=["model_name"])
            f.add_metric([m], value)
            return f

        def per_pos(name: str, help_text: str, values: tuple[int, ...]) -> CounterMetricFamily:
            f = CounterMetricFamily(name, help_text, labels=["model_name", "position"])
            for j, n in enumerate(values):
                f.add_metric([m, str(j)], n)
            return f

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            f = GaugeMetricFamily(name, help_text, labels=["model_name"])
            f.add_metric([m], value)
            return f

        yield counter(
            "vllm:spec_decode_num_drafts",
            "Decode steps of a request that verified drafts (DSpark's speculative steps).",
            spec.steps,
        )
        yield counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens put to the verify.", spec.drafted
        )
        yield counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.accepted
        )
        yield per_pos(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per draft position (0: the first after the backbone's own).",
            spec.accepted_at,
        )
        yield per_pos(
            "dsv41:spec_draft_tokens_per_pos",
            "Draft tokens put to the verify, per "
            "draft position (0: the first after the backbone's own).",
            spec.verified_at,
        )
        yield gauge(
            "dsv41:spec_mean_accepted_length",
            "Tokens per speculative step (accepted "
            "drafts and the backbone's own; 0 before a step speculated).",
            spec.mean_accepted_length or 0.0,
        )
        yield gauge(
            "dsv41:spec_acceptance_rate",
            "Draft tokens accepted / verified (0 before a step speculated).",
            spec.accepted / spec.drafted if spec.drafted else 0.0,
        )

    def _stores(self, t: TierStores) -> Iterator[Metric]:
        m = self.model_name

        def family(
            kind,
            name: str,
            help_text: str,
            rows: list[tuple[tuple[str, ...], float]],
            labels: tuple[str, ...] = (),
        ):
            f = kind(name, help_text, labels=["model_name", *labels])
            for values, n in rows:
                f.add_metric([m, *values], n)
            return f

        if t.runtime_blocks is not None:
            rb = t.runtime_blocks
            for name, kind, help_text, value in (
                (
                    "bytes",
                    GaugeMetricFamily,
                    "Bytes of the runtime prefix tier's blocks (within the runtime budget).",
                    rb.bytes,
                ),
                ("entries", GaugeMetricFamily, "Blocks the runtime prefix tier holds.", rb.entries),
                ("hits", CounterMetricFamily, "Blocks the runtime prefix tier served.", rb.hits),
                ("stored", CounterMetricFamily, "Prompt blocks it stored.", rb.stored),
                (
                    "evictions",
                    CounterMetricFamily,
                    "Blocks evicted (least recently used first) to make room.",
                    rb.evictions,
                ),
                ("refused", CounterMetricFamily, "Blocks refused for no room.", rb.refused),
            ):
                yield family(kind, f"dsv41:runtime_prefix_{name}", help_text, [((), value)])
        if t.store is not None:
            st = t.store
            for name, kind, help_text, value in (
                (
                    "bytes",
                    GaugeMetricFamily,
                    "Bytes of the SSD store's blocks, headers included.",
                    st.bytes,
                ),
                ("capacity_bytes", GaugeMetricFamily, "The SSD store's capacity.", st.capacity),
                ("entries", GaugeMetricFamily, "Blocks the SSD store indexes.", st.entries),
                ("hits", CounterMetricFamily, "Block reads the SSD store answered.", st.hits),
                (
                    "misses",
                    CounterMetricFamily,
                    "Block reads the SSD store could not answer (absent, or found bad).",
                    st.misses,
                ),
                ("writes", CounterMetricFamily, "Blocks written.", st.writes),
                ("evictions", CounterMetricFamily, "Blocks removed to make room.", st.evictions),
                (
                    "read_errors",
                    CounterMetricFamily,
                    "Block reads that failed (I/O).",
                    st.read_errors,
                ),
                (
                    "write_errors",
                    CounterMetricFamily,
                    "Block writes or deletions that failed.",
                    st.write_errors,
                ),
                (
                    "corrupt",
                    CounterMetricFamily,
                    "Files deleted for a bad header, checksum or length, or another model's.",
                    st.corrupt + st.truncated + st.foreign,
                ),
            ):
                yield family(kind, f"dsv41:ssd_store_{name}", help_text, [((), value)])
        if t.pool is not None:
            p, label = t.pool, ("redis" if isinstance(t.pool, RedisPoolStats) else "dram",)
            for name, kind, help_text, value in (
                (
                    "bytes",
                    GaugeMetricFamily,
                    "Bytes the snapshot pool holds (Redis: the server's used_memory).",
                    p.bytes,
                ),
                ("entries", GaugeMetricFamily, "Snapshots the pool holds.", p.entries),
                ("hits", CounterMetricFamily, "Snapshot reads the pool answered.", p.hits),
                (
                    "misses",
                    CounterMetricFamily,
                    "Snapshot reads the pool could not answer.",
                    p.misses,
                ),
                ("evictions", CounterMetricFamily, "Snapshots evicted to make room.", p.evictions),
            ):
                yield family(
                    kind, f"dsv41:snapshot_pool_{name}", help_text, [(label, value)], ("pool",)
                )
