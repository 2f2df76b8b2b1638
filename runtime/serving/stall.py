"""What the continuous batcher's chunked prefill buys: a long prompt arriving while streams
decode, measured on the engine's side (no HTTP). `dsv41 bench serve` and
scripts/batcher_stall.py report it next to the HTTP clients' view.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

import numpy as np

from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.frontend import RequestTiming


@dataclass(frozen=True)
class StallReport:
    """How long a long prompt's prefill holds up the running streams (seconds)."""

    streams: int  # decoding when the long prompt arrived
    long_prompt_tokens: int
    chunk_tokens: int
    chunks: int  # the long prompt's prefill pieces (chunks, then the decoder's replay)
    median_gap_s: float  # the running streams' per-token gap, median over the whole run
    worst_gap_s: float  # their worst gap while the long prompt was prefilled
    chunk_s: float  # one prefill chunk (median of the pieces but the last)
    worst_chunk_s: float  # the longest of them
    last_piece_s: float  # the last piece (decoder bounded replay) + first token + join
    extra_stall_s: float  # worst_gap_s - median_gap_s: what the long prompt added to a gap
    long_first_token_s: float  # the long prompt's submit to its first token
    gaps_during_prefill: int  # the streams' gaps that overlap the long prefill

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def token_times(timing: RequestTiming) -> list[float]:
    """perf_counter time of each token of a request."""
    if timing.first_token_s is None:
        return []
    t = [timing.submitted_at + timing.first_token_s]
    for gap in timing.per_token_s:
        t.append(t[-1] + gap)
    return t


def measure_long_prompt_stall(engine: Engine, *, streams: int = 8, stream_prompt: int = 16,
                              stream_tokens: int = 32, long_prompt: int = 2048,
                              chunk_tokens: int = 256, warm_tokens: int = 4,
                              seed: int = 0) -> StallReport:
    """`streams` greedy requests decode (each `stream_prompt` random ids, `stream_tokens`
    tokens); once each has `warm_tokens`, a `long_prompt`-token request arrives, prefilled in
    chunks of `chunk_tokens` with one decode step of the batch between two chunks. Compares the
    running streams' worst per-token gap during that prefill with their median gap and with one
    chunk's time. The engine must hold prompt + tokens within max_seq_len."""
    a = engine.model.args
    rng = np.random.default_rng(seed)
    ids = [[int(x) for x in rng.integers(3, a.vocab_size, stream_prompt)] for _ in range(streams)]
    long_ids = [int(x) for x in rng.integers(3, a.vocab_size, long_prompt)]
    b = Batcher(engine, max_running=streams + 1, max_queue=streams + 1,
                prefill_chunk_tokens=chunk_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=stream_tokens, ignore_eos=True)
    running = [b.submit(x, greedy) for x in ids]
    while min(s.timing.completion_tokens for s in running) < warm_tokens:
        b.step()
    long = b.submit(long_ids, replace(greedy, max_tokens=2))
    while not long.done or not all(s.done for s in running):
        b.step()
    lt = long.timing
    start = lt.submitted_at
    end = start + lt.first_token_s
    gaps, during = [], []
    for s in running:
        times = token_times(s.timing)
        for t0, t1 in zip(times, times[1:], strict=False):
            gaps.append(t1 - t0)
            if t1 > start and t0 < end:
                during.append(t1 - t0)
    if lt.completion_tokens < 1 or not during:
        raise RuntimeError("The streams ended before the long prompt's prefill; give them "
                           "more stream_tokens.")
    if max(s.timing.completion_tokens for s in running) < stream_tokens:
        raise RuntimeError("A running stream did not finish its tokens.")
    chunks = lt.prefill_chunk_s or (lt.first_token_s,)
    return StallReport(
        streams=streams, long_prompt_tokens=long_prompt, chunk_tokens=chunk_tokens,
        chunks=len(lt.prefill_chunk_s) + 1, median_gap_s=statistics.median(gaps),
        worst_gap_s=max(during), chunk_s=statistics.median(chunks),
        worst_chunk_s=max(chunks), last_piece_s=lt.prefill_tail_s,
        extra_stall_s=max(during) - statistics.median(gaps), long_first_token_s=lt.first_token_s,
        gaps_during_prefill=len(during))
