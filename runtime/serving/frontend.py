"""What the OpenAI server is in front of: a `Frontend` takes requests and gives each one an
`EventStream` of `TokenEvent`s. The continuous batcher (runtime/serving/batcher.py, one process)
and the EPD gateway (runtime/serving/epd_gateway.py, the queues of the EPD stages) are the two
frontends; `create_app` and its routers use nothing of them but what is named here, so a third
(a router over several batchers, a test's scripted one) needs only these members.

The events, the timing and the stats are the frontends' common vocabulary, defined here so that
neither implementation imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, runtime_checkable

from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.engine.sampling import SamplingParams, TokenLogprob
from dsv41.runtime.tiers.dram_pool import SnapshotPoolStats
from dsv41.runtime.tiers.redis_pool import RedisPoolStats
from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocksStats
from dsv41.runtime.tiers.ssd_store import KVStoreStats


class FinishReason(Enum):
    """Why a request ended; the values are OpenAI's finish_reason strings where one exists."""

    STOP = "stop"  # EOS, a stop id or a stop string
    LENGTH = "length"  # max_tokens, or the model's max_seq_len reached
    CANCELLED = "cancelled"  # Stream.cancel() (client gone, timeout), or Batcher.stop()
    ERROR = "error"  # the engine failed on this request (message in TokenEvent.error)
    # the server lost the request on its way (an EPD worker or the queue's server went away, its
    # events could not be read): nothing wrong with it, sending it again may succeed (HTTP 503)
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class TokenEvent:
    """One per generated token; the last event of a stream has `finish` set."""

    token_id: int | None  # None only on a final event that carries no token
    text: str  # detokenised delta, stop strings withheld ("" with no tokenizer)
    logprob: float | None  # the token's, when the request asked for logprobs
    top: tuple[TokenLogprob, ...]  # the `logprobs` most likely, most likely first
    finish: FinishReason | None
    error: str | None = None
    index: int = 0  # the sample (choice) it belongs to: 0..n-1 for a request of n samples


@dataclass(frozen=True)
class RequestTiming:
    """Filled as the request runs (seconds, time.perf_counter based)."""

    queued_s: float  # submit to the start of its prefill (so far, while it waits)
    first_token_s: float | None  # submit to its first token
    per_token_s: tuple[float, ...]  # gaps between consecutive tokens
    prompt_tokens: int
    completion_tokens: int
    tier: str | None  # the tier that served its prefill (cold, snapshot, prefix, ...)
    reused_tokens: int  # leading prompt tokens the tiers held (not prefilled)
    # each piece of the prefill but the last (a decode step of the batch runs after each): the
    # chunks, then (CED) the encoder pass's end before the decoder's bounded replay
    prefill_chunk_s: tuple[float, ...] = ()
    # the prefill's last piece (the decoder's bounded replay, or the only chunk), the first
    # token and the join to the batch
    prefill_tail_s: float | None = None
    submitted_at: float = 0.0  # time.perf_counter() at submit (token i came at submitted_at +
    #   first_token_s + sum(per_token_s[:i]))
    replayed_tokens: int = 0  # reused tokens run through the encoder again (TurnRecord's)
    decoder_replayed_tokens: int = 0  # tokens through the decoder's bounded replay
    speculative: SpecCounts | None = None  # DSpark's drafts for it (None: no speculation)


class QueueFull(Exception):
    """submit() while the waiting queue is at its bound (a server answers 429)."""


@dataclass(frozen=True)
class BatcherStats:
    queued: int  # waiting for admission
    running: int  # in the decode batch
    finished: int  # ended with STOP, LENGTH or ERROR
    cancelled: int  # ended with CANCELLED
    prompt_tokens: int  # of the admitted requests
    completion_tokens: int  # tokens generated
    tiers: Mapping[str, int]  # turns per tier that served them (cold, snapshot, prefix, ...)
    speculative: SpecCounts | None = None  # DSpark's drafts of the finished requests (None:
    #   the engine does not speculate)
    # prompt tokens the tiers served (not prefilled), per engine tier (live, snapshot, prefix...)
    tier_tokens: Mapping[str, int] = field(default_factory=dict)
    replayed_tokens: int = 0  # served tokens run through the encoder again (TurnRecord's)
    decoder_replayed_tokens: int = 0  # tokens through the decoder's bounded replay
    cache_bytes: int = 0  # the runtime cache's bytes in use after the last step
    cache_budget_bytes: int = 0  # its budget (0: not known, e.g. a gateway)
    stores: TierStores | None = None  # the engine's stores (None: no engine in this process)


@dataclass(frozen=True)
class TierStores:
    """The engine's stores' stats, as the batcher last read them (on its stepping thread, after
    a request was admitted or finished)."""

    store: KVStoreStats | None  # the SSD block store (None: the engine has none)
    pool: SnapshotPoolStats | RedisPoolStats | None  # the snapshot pool (DRAM, or Redis)
    runtime_blocks: RuntimeBlocksStats | None = None  # the runtime prefix tier (None: off)


@runtime_checkable
class EventStream(Protocol):
    """One request's events, as `Frontend.submit` returns them (`Stream`, `RemoteStream`);
    thread-safe. The server reads them `poll_s` at a time, cancels a stream whose client left
    or whose deadline passed, and reads its timing for the usage and the metrics."""

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event; None on timeout, or once the final event was read."""

    def cancel(self) -> None:
        """Idempotent; the request ends CANCELLED (a no-op once it has ended)."""

    @property
    def timing(self) -> RequestTiming:
        """The request's timing so far."""


@runtime_checkable
class Frontend(Protocol):
    """What `create_app` serves: requests in, a stream of events out, and the counts /metrics
    shows. Starting and stopping are the owner's (the app never starts or stops a frontend)."""

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               images: Sequence = ()) -> EventStream:
        """Queue a request, checked first: RequestError (a ValueError, the 400's sentence) for
        a bad one, QueueFull (a 429) at the frontend's bound. `images`: one per image
        placeholder of the prompt (bytes, data URLs, PIL images)."""

    def stats(self) -> BatcherStats:
        """The counts so far (queued, running, finished, tokens, tiers)."""


@runtime_checkable
class SampleFrontend(Protocol):
    """A frontend that also serves several samples of one prompt (OpenAI's `n`, `best_of`): the
    continuous batcher does (the prompt prefilled once, its rows forked); a frontend without it
    answers such requests with a 400."""

    def submit_samples(self, prompt_ids: Sequence[int], params: SamplingParams, n: int,
                       images: Sequence = ()) -> EventStream:
        """As `Frontend.submit`, for `n` samples: one stream of every sample's events (each
        event's `index` names its sample), ending after the n-th final event; its timing is the
        prompt's (sample 0's), its cancel ends every sample."""
