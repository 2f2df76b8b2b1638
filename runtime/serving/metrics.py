"""The server's metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

    m = ServerMetrics()
    m.observe_finish(Finish.STOP, timing)     # when a request ends (its RequestTiming)
    m.render(batcher.stats())                # the /metrics body

Three kinds of series, each a small class that renders its own lines: `Counter` (only goes up;
labelled), `Histogram` (cumulative `_bucket{le=...}` counts, `_sum`, `_count`) and gauges, which
are read from the batcher at scrape time (`BatcherStats`: queue length, running sequences,
tokens, tier hits), so they are never stale. Tokens per second is the completion tokens of the
requests that ended within the last `rate_window_s` seconds over that window (`RateWindow`);
Prometheus users can also take `rate()` of `dsv41_completion_tokens_total`.

Everything is guarded by one lock per object: the server's handlers run on several threads.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# seconds; Prometheus convention: upper bounds, +Inf added on render
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Mapping[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(pairs.items())) + "}"


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotone count per label value (one label name, or none)."""

    def __init__(self, name: str, help_text: str, label: str | None = None,
                 values: Sequence[str] = ()):
        self.name, self.help, self.label = name, help_text, label
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {v: 0 for v in values}  # listed values show as 0

    def inc(self, amount: float = 1, value: str = "") -> None:
        if amount < 0:
            raise ValueError(f"The counter {self.name} only goes up; got {amount}.")
        with self._lock:
            self._counts[value] = self._counts.get(value, 0) + amount

    def get(self, value: str = "") -> float:
        with self._lock:
            return self._counts.get(value, 0)

    def render(self) -> list[str]:
        with self._lock:
            counts = dict(self._counts)
        lines = _header(self.name, "counter", self.help)
        if self.label is None:
            return lines + [f"{self.name} {_number(counts.get('', 0))}"]
        return lines + [f"{self.name}{_labels({self.label: v})} {_number(n)}"
                        for v, n in sorted(counts.items())]


class Histogram:
    """Observations counted into cumulative buckets (upper bounds in seconds)."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]):
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"The buckets of {name} must be increasing, got {buckets}.")
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._n = 0

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        with self._lock:
            self._counts[i] += 1
            self._sum += value
            self._n += 1

    def observe_all(self, values: Iterable[float]) -> None:
        for v in values:
            self.observe(v)

    @property
    def count(self) -> int:
        with self._lock:
            return self._n

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._n
        lines = _header(self.name, "histogram", self.help)
        running = 0
        for bound, c in zip((*self.buckets, math.inf), counts, strict=True):
            running += c
            lines.append(f"{self.name}_bucket{_labels({'le': _number(float(bound))})} "
                         f"{running}")
        return lines + [f"{self.name}_sum {_number(total)}", f"{self.name}_count {n}"]


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
    """What the metrics need of a finished request (from the batcher's RequestTiming)."""

    queued_s: float
    first_token_s: float | None  # time to first token, from submission
    per_token_s: tuple[float, ...]  # gaps between consecutive tokens
    completion_tokens: int


FINISH_LABELS = ("stop", "length", "cancelled", "error", "timeout")


class ServerMetrics:
    """Everything /metrics shows. Counters and histograms are fed by the server as requests end;
    gauges come from the batcher's stats at render time."""

    def __init__(self, rate_window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.requests = Counter("dsv41_requests_total", "HTTP requests received per endpoint.",
                                "endpoint")
        self.rejected = Counter("dsv41_requests_rejected_total",
                                "Requests answered with an error status, per status code.",
                                "code")
        self.finished = Counter("dsv41_requests_finished_total",
                                "Generation requests ended, per finish reason (timeout: the "
                                "server's per-request timeout cancelled it).", "reason",
                                FINISH_LABELS)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds",
                              "Time from submission to the first generated token.", TTFT_BUCKETS)
        self.per_token = Histogram("dsv41_time_per_output_token_seconds",
                                   "Time between consecutive generated tokens of a request.",
                                   TOKEN_BUCKETS)
        self.queue_time = Histogram("dsv41_request_queue_seconds",
                                    "Time a request waited before the batcher admitted it.",
                                    TTFT_BUCKETS)
        self.tokens_rate = RateWindow(rate_window_s, clock)

    def observe_finish(self, reason: str, timing: FinishTiming) -> None:
        if reason not in FINISH_LABELS:
            raise ValueError(f"Unknown finish reason {reason!r}; known: "
                             f"{', '.join(FINISH_LABELS)}.")
        self.finished.inc(1, reason)
        self.queue_time.observe(timing.queued_s)
        if timing.first_token_s is not None:
            self.ttft.observe(timing.first_token_s)
        self.per_token.observe_all(timing.per_token_s)
        self.tokens_rate.add(timing.completion_tokens)

    def render(self, stats) -> str:
        """The exposition text; `stats` is the batcher's BatcherStats."""
        lines: list[str] = []

        def gauge(name: str, help_text: str, value: float) -> None:
            lines.extend(_header(name, "gauge", help_text) + [f"{name} {_number(value)}"])

        def counter(name: str, help_text: str, value: float) -> None:
            lines.extend(_header(name, "counter", help_text) + [f"{name} {_number(value)}"])

        gauge("dsv41_queue_length", "Requests waiting for a slot in the running batch.",
              stats.queued)
        gauge("dsv41_running_sequences", "Sequences in the running batch.", stats.running)
        gauge("dsv41_generation_tokens_per_second",
              "Completion tokens per second of the requests that ended in the last "
              f"{self.tokens_rate.window_s:g} s.", round(self.tokens_rate.rate(), 6))
        counter("dsv41_prompt_tokens_total", "Prompt tokens of the admitted requests.",
                stats.prompt_tokens)
        counter("dsv41_completion_tokens_total", "Tokens generated.", stats.completion_tokens)
        counter("dsv41_batcher_finished_total", "Requests the batcher finished.",
                stats.finished)
        counter("dsv41_batcher_cancelled_total", "Requests the batcher cancelled.",
                stats.cancelled)
        lines.extend(_header("dsv41_tier_hits_total", "counter",
                             "Turns served per engine tier (cold, snapshot, prefix, ...)."))
        for tier, n in sorted(stats.tiers.items()):
            lines.append(f"dsv41_tier_hits_total{_labels({'tier': tier})} {_number(n)}")
        spec = getattr(stats, "speculative", None)
        if spec is not None:  # a speculating engine: DSpark's drafts of the finished requests
            lines.extend(spec_lines(spec))
        for metric in (self.requests, self.rejected, self.finished, self.ttft, self.per_token,
                       self.queue_time):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


def spec_lines(spec) -> list[str]:
    """DSpark's series from a `SpecCounts`: draft tokens verified and accepted per draft
    position (1 = the first token after the backbone's own), the speculative steps, and the
    mean accepted length (tokens per speculative step)."""
    lines = _header("dsv41_spec_draft_tokens_total", "counter",
                    "Draft tokens put to the verify, per draft position.")
    lines += [f"dsv41_spec_draft_tokens_total{_labels({'position': str(j + 1)})} {_number(n)}"
              for j, n in enumerate(spec.verified_at)]
    lines += _header("dsv41_spec_accepted_tokens_total", "counter",
                     "Draft tokens accepted, per draft position.")
    lines += [f"dsv41_spec_accepted_tokens_total{_labels({'position': str(j + 1)})} "
              f"{_number(n)}" for j, n in enumerate(spec.accepted_at)]
    lines += _header("dsv41_spec_steps_total", "counter",
                     "Decode steps of a request that verified drafts.")
    lines.append(f"dsv41_spec_steps_total {_number(spec.steps)}")
    lines += _header("dsv41_spec_mean_accepted_length", "gauge",
                     "Tokens per speculative step (accepted drafts and the backbone's own).")
    lines.append(f"dsv41_spec_mean_accepted_length {_number(spec.mean_accepted_length or 0.0)}")
    return lines


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line of an exposition text (tests, bench)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
