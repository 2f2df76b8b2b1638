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

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsv41.runtime.serving.frontend import BatcherStats, TierStores
from dsv41.runtime.serving.openai_api import TIER_OF, CacheTier
from dsv41.runtime.tiers.redis_pool import RedisPoolStats

GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily
# one row of a table of families: (kind, name, help text, value), one sample each
Row = tuple[type[Metric], str, str, float]


def cache_label(tier: CacheTier) -> str:
    """The `cache` label of a CacheTier (its usage field without `_tokens`)."""
    return tier.value.removesuffix("_tokens")


def family(
    kind: type[Metric],
    name: str,
    help_text: str,
    model: str,
    samples: Iterable[tuple[Sequence[str], float]],
    labels: Sequence[str] = (),
) -> Metric:
    """A family of `kind` whose samples are (label values, value), each also labelled with the
    model's name (first)."""
    f = kind(name, help_text, labels=["model_name", *labels])
    for values, n in samples:
        f.add_metric([model, *values], n)
    return f


def families(
    model: str,
    table: Iterable[Row],
    *,
    prefix: str = "",
    labels: Sequence[str] = (),
    values: Sequence[str] = (),
) -> Iterator[Metric]:
    """A table's families, in its order: each name after `prefix`, its one sample labelled
    `labels` = `values` (besides the model's name)."""
    for kind, name, help_text, value in table:
        yield family(kind, prefix + name, help_text, model, [(values, value)], labels)


def by(
    model: str, name: str, help_text: str, label: str, samples: Iterable[tuple[str, float]]
) -> Metric:
    """A counter family of one sample per value of `label`."""
    return family(COUNTER, name, help_text, model, (([k], n) for k, n in samples), (label,))


class FrontendCollector(Collector):
    """Families from `stats()`, every sample labelled with the model's name."""

    def __init__(self, model_name: str, stats: Callable[[], BatcherStats]):
        self.model_name, self.stats = model_name, stats

    def describe(self) -> list[Metric]:
        return []  # no names claimed up front: the families depend on what the frontend has

    def collect(self) -> Iterator[Metric]:
        s, m = self.stats(), self.model_name
        usage = s.cache_bytes / s.cache_budget_bytes if s.cache_budget_bytes else 0.0
        hits = sum(s.tier_tokens.values())
        yield from families(
            m,
            (
                (
                    GAUGE,
                    "vllm:num_requests_waiting",
                    "Requests waiting for a row of the running batch.",
                    s.queued,
                ),
                (GAUGE, "vllm:num_requests_running", "Requests in the running batch.", s.running),
                (
                    GAUGE,
                    "vllm:kv_cache_usage_perc",
                    "Runtime cache in use, a fraction of its byte budget (1 = full).",
                    usage,
                ),
                (
                    COUNTER,
                    "vllm:prompt_tokens",
                    "Prompt tokens of the admitted requests.",
                    s.prompt_tokens,
                ),
                (COUNTER, "vllm:generation_tokens", "Tokens generated.", s.completion_tokens),
                (
                    COUNTER,
                    "vllm:prefix_cache_queries",
                    "Prompt tokens looked up in the tiers (every admitted prompt token).",
                    s.prompt_tokens,
                ),
                (
                    COUNTER,
                    "vllm:prefix_cache_hits",
                    "Prompt tokens the tiers served (not prefilled), any tier.",
                    hits,
                ),
                (
                    COUNTER,
                    "dsv41:batcher_finished",
                    "Requests the batcher finished (stop, length, error).",
                    s.finished,
                ),
                (
                    COUNTER,
                    "dsv41:batcher_cancelled",
                    "Requests the batcher cancelled.",
                    s.cancelled,
                ),
            ),
        )
        yield by(
            m,
            "dsv41:tier_hits",
            "Turns served per engine tier (cold, live, snapshot, prefix, ...).",
            "tier",
            sorted(s.tiers.items()),
        )
        yield by(
            m,
            "dsv41:tier_hit_tokens",
            "Prompt tokens served per engine tier (cold: none).",
            "tier",
            sorted(s.tier_tokens.items()),
        )
        per_cache = dict.fromkeys((cache_label(t) for t in CacheTier), 0)
        for tier, n in s.tier_tokens.items():
            if tier in TIER_OF:
                per_cache[cache_label(TIER_OF[tier])] += n
        yield by(
            m,
            "dsv41:prompt_cache_hit_tokens",
            "Prompt tokens served per cache (the usage's "
            "dsv41_prompt_cache): runtime_cache, dram_pool, ssd_store.",
            "cache",
            sorted(per_cache.items()),
        )
        yield from families(
            m,
            (
                (
                    COUNTER,
                    "dsv41:replayed_tokens",
                    "Served prompt tokens run through the encoder again (a snapshot miss, a prefix "
                    "hit).",
                    s.replayed_tokens,
                ),
                (
                    COUNTER,
                    "dsv41:decoder_replayed_tokens",
                    "Tokens through the decoder's bounded replay.",
                    s.decoder_replayed_tokens,
                ),
            ),
        )
        if s.speculative is not None:
            yield from self._spec(s)
        if s.stores is not None:
            yield from self._stores(s.stores)

    def _spec(self, s: BatcherStats) -> Iterator[Metric]:
        m, spec = self.model_name, s.speculative
        yield from families(
            m,
            (
                (
                    COUNTER,
                    "vllm:spec_decode_num_drafts",
                    "Decode steps of a request that verified drafts (DSpark's speculative steps).",
                    spec.steps,
                ),
                (
                    COUNTER,
                    "vllm:spec_decode_num_draft_tokens",
                    "Draft tokens put to the verify.",
                    spec.drafted,
                ),
                (
                    COUNTER,
                    "vllm:spec_decode_num_accepted_tokens",
                    "Draft tokens accepted.",
                    spec.accepted,
                ),
            ),
        )
        yield by(
            m,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per draft position (0: the first after the backbone's own).",
            "position",
            ((str(j), n) for j, n in enumerate(spec.accepted_at)),
        )
        yield by(
            m,
            "dsv41:spec_draft_tokens_per_pos",
            "Draft tokens put to the verify, per "
            "draft position (0: the first after the backbone's own).",
            "position",
            ((str(j), n) for j, n in enumerate(spec.verified_at)),
        )
        yield from families(
            m,
            (
                (
                    GAUGE,
                    "dsv41:spec_mean_accepted_length",
                    "Tokens per speculative step (accepted "
                    "drafts and the backbone's own; 0 before a step speculated).",
                    spec.mean_accepted_length or 0.0,
                ),
                (
                    GAUGE,
                    "dsv41:spec_acceptance_rate",
                    "Draft tokens accepted / verified (0 before a step speculated).",
                    spec.accepted / spec.drafted if spec.drafted else 0.0,
                ),
            ),
        )

    def _stores(self, t: TierStores) -> Iterator[Metric]:
        m = self.model_name
        if t.runtime_blocks is not None:
            rb = t.runtime_blocks
            yield from families(
                m,
                (
                    (
                        GAUGE,
                        "bytes",
                        "Bytes of the runtime prefix tier's blocks (within the runtime budget).",
                        rb.bytes,
                    ),
                    (GAUGE, "entries", "Blocks the runtime prefix tier holds.", rb.entries),
                    (COUNTER, "hits", "Blocks the runtime prefix tier served.", rb.hits),
                    (COUNTER, "stored", "Prompt blocks it stored.", rb.stored),
                    (
                        COUNTER,
                        "evictions",
                        "Blocks evicted (least recently used first) to make room.",
                        rb.evictions,
                    ),
                    (COUNTER, "refused", "Blocks refused for no room.", rb.refused),
                ),
                prefix="dsv41:runtime_prefix_",
            )
        if t.store is not None:
            st = t.store
            yield from families(
                m,
                (
                    (
                        GAUGE,
                        "bytes",
                        "Bytes of the SSD store's blocks, headers included.",
                        st.bytes,
                    ),
                    (GAUGE, "capacity_bytes", "The SSD store's capacity.", st.capacity),
                    (GAUGE, "entries", "Blocks the SSD store indexes.", st.entries),
                    (COUNTER, "hits", "Block reads the SSD store answered.", st.hits),
                    (
                        COUNTER,
                        "misses",
                        "Block reads the SSD store could not answer (absent, or found bad).",
                        st.misses,
                    ),
                    (COUNTER, "writes", "Blocks written.", st.writes),
                    (COUNTER, "evictions", "Blocks removed to make room.", st.evictions),
                    (COUNTER, "read_errors", "Block reads that failed (I/O).", st.read_errors),
                    (
                        COUNTER,
                        "write_errors",
                        "Block writes or deletions that failed.",
                        st.write_errors,
                    ),
                    (
                        COUNTER,
                        "corrupt",
                        "Files deleted for a bad header, checksum or length, or another model's.",
                        st.corrupt + st.truncated + st.foreign,
                    ),
                ),
                prefix="dsv41:ssd_store_",
            )
        if t.pool is not None:
            p = t.pool
            yield from families(
                m,
                (
                    (
                        GAUGE,
                        "bytes",
                        "Bytes the snapshot pool holds (Redis: the server's used_memory).",
                        p.bytes,
                    ),
                    (GAUGE, "entries", "Snapshots the pool holds.", p.entries),
                    (COUNTER, "hits", "Snapshot reads the pool answered.", p.hits),
                    (COUNTER, "misses", "Snapshot reads the pool could not answer.", p.misses),
                    (COUNTER, "evictions", "Snapshots evicted to make room.", p.evictions),
                ),
                prefix="dsv41:snapshot_pool_",
                labels=("pool",),
                values=("redis" if isinstance(p, RedisPoolStats) else "dram",),
            )
