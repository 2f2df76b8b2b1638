"""The server's metrics, through `prometheus_client`, one `CollectorRegistry` per app.

    m = ServerMetrics("my-model")
    m.watch(batcher.stats)                   # the frontend's counts, read at each scrape
    m.observe_finish("stop", timing)         # when a request ends (its RequestTiming's numbers)
    m.render()                               # the /metrics body (text format 0.0.4)

Names follow vLLM's where vLLM has a counterpart (`vllm:num_requests_waiting`,
`vllm:time_to_first_token_seconds`, `vllm:spec_decode_num_drafts_total`, ...; every series
labelled `model_name`, as vLLM's are), so dashboards and routers built for vLLM-compatible
servers read them; `dsv41:` names for the rest (the tiers, the stores, the pool, rejections).
Two kinds of source:
- request-level counters and histograms, fed by the server as each request ends
  (`observe_finish`) or is refused (`rejected`), kept here (prometheus_client's own, thread-safe);
- counts that live in the frontend, the engine and the stores (queue, running rows, tokens, tier
  hits, SSD store, snapshot pool, speculation), read at scrape time by a custom collector
  (metrics_collect.py) from `Frontend.stats()`, so they are never stale.
No global registry: several apps in one process never collide.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsv41.runtime.serving.frontend import BatcherStats
from dsv41.runtime.serving.metrics_collect import FrontendCollector

# seconds (vLLM's bounds for the same series, which share VLLM_MID); +Inf is added by
# prometheus_client
VLLM_MID = (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    *VLLM_MID,
    160.0,
    640.0,
    2560.0,
)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *VLLM_MID)
# the gaps of a fast backend are well under vLLM's first bound: finer ones below it
GAP_BUCKETS = (0.001, 0.0025, 0.005, *TOKEN_BUCKETS)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_COUNT_BUCKETS = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
    100000,
    200000,
    500000,
    1000000,
)

FINISH_LABELS = ("stop", "length", "cancelled", "error", "timeout")
# vLLM's finished_reason of each of ours (cancelled by the client or the timeout: vLLM's abort)
VLLM_FINISH = {
    "stop": "stop",
    "length": "length",
    "cancelled": "abort",
    "timeout": "abort",
    "error": "error",
}


# the request-level counters: key -> (name, help text, the label besides model_name)
COUNTERS = {
    "requests": ("dsv41:requests", "HTTP requests received per endpoint.", "endpoint"),
    "rejected": (
        "dsv41:requests_rejected",
        "Requests answered with an error status, per status code.",
        "code",
    ),
    "finished": (
        "dsv41:requests_finished",
        "Generation requests ended, per finish reason (timeout: the server's per-request timeout "
        "cancelled it).",
        "reason",
    ),
    "success": (
        "vllm:request_success",
        "Requests finished, per finished_reason (abort: cancelled by the client or the timeout).",
        "finished_reason",
    ),
}
# the request-level histograms, in the order /metrics shows them: key -> (name, help, buckets)
HISTOGRAMS = {
    "ttft": (
        "vllm:time_to_first_token_seconds",
        "Time from submission to the first generated token.",
        TTFT_BUCKETS,
    ),
    "itl": (
        "vllm:inter_token_latency_seconds",
        "Time between consecutive generated tokens of a request (one observation per gap).",
        GAP_BUCKETS,
    ),
    "tpot": (
        "vllm:time_per_output_token_seconds",
        "Time between consecutive generated tokens (vLLM's older name of inter_token_latency).",
        GAP_BUCKETS,
    ),
    "request_tpot": (
        "vllm:request_time_per_output_token_seconds",
        "A request's mean time per output token after its first.",
        GAP_BUCKETS,
    ),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Time from submission to a request's last token.",
        REQUEST_BUCKETS,
    ),
    "queue_time": (
        "vllm:request_queue_time_seconds",
        "Time a request waited before the batcher admitted it.",
        REQUEST_BUCKETS,
    ),
    "prompt_len": (
        "vllm:request_prompt_tokens",
        "Prompt tokens per finished request.",
        TOKEN_COUNT_BUCKETS,
    ),
    "gen_len": (
        "vllm:request_generation_tokens",
        "Generated tokens per finished request.",
        TOKEN_COUNT_BUCKETS,
    ),
}


class RateWindow:
    """Amounts over the last `window_s` seconds, as a rate per second."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        if not window_s > 0:
            raise ValueError(f"The rate window must be positive, got {window_s}.")
        self.window_s, self.clock = window_s, clock
        self._lock = threading.Lock()
        self._events: deque[tuple[float, float]] = deque()

    def add(self, amount: float) -> None:
        with self._lock:
            self._events.append((self.clock(), amount))

    def rate(self) -> float:
        now = self.clock()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(a for _, a in self._events) / self.window_s


@dataclass(frozen=True)
class FinishTiming:
    """What the metrics need of a finished request (from the frontend's RequestTiming)."""

    queued_s: float
    first_token_s: float | None  # time to first token, from submission
    per_token_s: tuple[float, ...]  # gaps between consecutive tokens
    completion_tokens: int
    prompt_tokens: int = 0


class ServerMetrics:
    """Everything /metrics shows (see the module docstring). `model_name` labels every series."""

    def __init__(
        self,
        model_name: str,
        *,
        rate_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(model_name, str) or not model_name:
            raise ValueError("The metrics need the served model's name (their model_name).")
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.tokens_rate = RateWindow(rate_window_s, clock)
        self._watched = False
        r, m = self.registry, ("model_name",)
        # by the keys of COUNTERS and HISTOGRAMS
        self.counters = {
            key: Counter(name, help_text, (*m, label), registry=r)
            for key, (name, help_text, label) in COUNTERS.items()
        }
        self.histograms = {
            key: Histogram(name, help_text, m, buckets=buckets, registry=r)
            for key, (name, help_text, buckets) in HISTOGRAMS.items()
        }
        for h in self.histograms.values():
            h.labels(model_name)  # shown (empty) before the first observation
        self.tokens_per_s = Gauge(
            "dsv41:generation_tokens_per_second",
            "Completion tokens per "
            f"second of the requests that ended in the last "
            f"{rate_window_s:g} s.",
            m,
            registry=r,
        )
        self.tokens_per_s.labels(model_name).set_function(lambda: round(self.tokens_rate.rate(), 6))
        for reason in FINISH_LABELS:  # every reason shows, at 0 until it happens
            self.counters["finished"].labels(model_name, reason)
            self.counters["success"].labels(model_name, VLLM_FINISH[reason])

    def watch(self, stats: Callable[[], BatcherStats]) -> None:
        """Read `stats()` (a frontend's) at every scrape; once per metrics object."""
        if self._watched:
            raise ValueError(
                "These metrics already watch a frontend; give each app its own ServerMetrics."
            )
        self.registry.register(FrontendCollector(self.model_name, stats))
        self._watched = True

    def count_request(self, endpoint: str) -> None:
        self.counters["requests"].labels(self.model_name, endpoint).inc()

    def count_rejected(self, status: int | str) -> None:
        self.counters["rejected"].labels(self.model_name, str(status)).inc()

    def observe_finish(self, reason: str, timing: FinishTiming) -> None:
        if reason not in FINISH_LABELS:
            raise ValueError(
                f"Unknown finish reason {reason!r}; known: {', '.join(FINISH_LABELS)}."
            )
        name = self.model_name
        self.counters["finished"].labels(name, reason).inc()
        self.counters["success"].labels(name, VLLM_FINISH[reason]).inc()
        gaps = timing.per_token_s
        if timing.first_token_s is not None:
            e2e = timing.first_token_s + sum(gaps)
        else:
            e2e = timing.queued_s
        seen = {
            "queue_time": [timing.queued_s],
            "prompt_len": [timing.prompt_tokens],
            "gen_len": [timing.completion_tokens],
            "ttft": [] if timing.first_token_s is None else [timing.first_token_s],
            "e2e": [e2e],
            "itl": gaps,
            "tpot": gaps,
            "request_tpot": [sum(gaps) / len(gaps)] if gaps else [],
        }
        for key, values in seen.items():
            h = self.histograms[key].labels(name)
            for v in values:
                h.observe(v)
        self.tokens_rate.add(timing.completion_tokens)

    def render(self) -> bytes:
        """The exposition text (prometheus_client's text format 0.0.4)."""
        return generate_latest(self.registry)


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_metrics(text: str | bytes) -> dict[str, float]:
    """`name{labels}` -> value for every sample of an exposition text, parsed by
    prometheus_client's parser (tests, bench). The `model_name` label is left out of the keys (a
    server serves one model); the other labels follow, sorted: `name{a="1",b="2"}`."""
    if isinstance(text, bytes):
        text = text.decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = sorted((k, v) for k, v in s.labels.items() if k != "model_name")
            inner = ",".join(f'{k}="{v}"' for k, v in labels)
            out[f"{s.name}{{{inner}}}" if inner else s.name] = s.value
    return out
