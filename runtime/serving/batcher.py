"""Continuous batching: requests join and leave one running decode batch between steps.

    batcher = Batcher(engine, tokenizer=tok, max_running=16, max_queue=64)
    batcher.start()                                   # or call batcher.step() yourself
    stream = batcher.submit(prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))
    for event in stream:                              # a TokenEvent per token, the last finishes
        print(event.text, end="")
    batcher.stop()

One step: cancelled requests leave the batch; the head of the queue is admitted when a row is
free and its cache fits the runtime budget (first come, first served: the head waits until it
fits and the rest wait behind it, so no request starves); its prefill runs in chunks of
`prefill_chunk_tokens` with one decode step of the running batch between two chunks (a long new
prompt holds the running streams up for one chunk at a time); then one decode step of the
running batch. The batch is the engine's `DecodeBatch` (a stacked cache with a row per request:
a joining request's cache is copied into a free row once, a leaving one's row is copied out and
the last row moved into its slot), so nothing is re-stacked when requests come and go.

A request of n samples (`submit_samples`: OpenAI's `n`, `best_of`) is queued as one: it is
admitted when n rows are free and n rows' caches fit, its prompt prefilled once and its rows
forked per sample (`DecodeBatch.start_samples`: sample i seeded by `sample_seed(seed, i)`); the
samples then decode and leave as ordinary rows, each its own `Stream`, their events merged in
one `SampleStreams`. Only sample 0's turn is stored in the tiers. A request of more samples than
`max_running` rows is refused at submit (it could never be admitted).

Each request is a new engine session: prefix hits come from the tiers (SSD blocks, DRAM
snapshots), and a finished request's turn is stored there like any turn. Sampling is the
engine's (`runtime.sampling.Sampler`, seeded per request: the same seed gives the same tokens
whatever shares the batch). With a tokenizer, each request's text is decoded incrementally and
its stop strings matched on it (a matched stop string ends the request and is never emitted).

A request's own failure ends it alone with an error event: its next token cannot be chosen (the
turn's `failure`: logits that are not finite, its constraint's error), or its text cannot be
made (a sampled id its tokenizer lacks, its stop strings); the other rows decode on. Only a
failed decode step of the whole batch (the model's pass) ends every running request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from dsv41.graph.phases import chunk_spans
from dsv41.runtime.engine import DecodeBatch, Engine, PrefillPacing, Session
from dsv41.runtime.engine.images import TurnImage
from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.engine.requests import (
    RequestError,
    TurnLimits,
    TurnRequest,
    check_token_ids,
    check_turn,
)
from dsv41.runtime.engine.sampling import MAX_SAMPLES, SamplingParams, StopMatcher
from dsv41.runtime.serving.chat_format import IncrementalDecoder
from dsv41.runtime.serving.event_log import EventLog, LoggedStream
from dsv41.runtime.serving.frontend import (
    BatcherStats,
    FinishReason,
    QueueFull,
    RequestTiming,
    TierStores,
    TokenEvent,
)
from dsv41.runtime.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_ROWS = 64  # the compiled decode entry's static batch bound


class Stream(LoggedStream):
    """One request's events, returned by `Batcher.submit`; thread-safe."""

    def __init__(self, sid: int, prompt_tokens: int, wake, *, index: int = 0,
                 merged: queue.Queue | None = None):
        self.id = sid
        self.log = EventLog(prompt_tokens, f"stream {sid}")  # events, and the timing they make
        self._wake = wake  # tells the batcher there is work (a cancel)
        self._cancel = threading.Event()
        self.index = index  # its sample's index in a request of several (`SampleStreams`)
        self._merged = merged  # that request's merged events (None: a request of one)

    def cancel(self) -> None:
        """Idempotent; the request leaves the batch (or the queue) at the next step."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # ---- the batcher's side ---------------------------------------------------------------------

    def _put(self, event: TokenEvent) -> None:
        self.log.put(event)
        if self._merged is not None:
            self._merged.put(replace(event, index=self.index))


class SampleStreams:
    """The events of a request of several samples (`Batcher.submit_samples`), every sample's
    in arrival order, each carrying its sample's `index`; an `EventStream` that ends once every
    sample's final event was read. Its timing is sample 0's (the prompt counted once); `cancel`
    ends every sample. Thread-safe."""

    def __init__(self, streams: Sequence[Stream], merged: queue.Queue):
        self.streams = tuple(streams)
        self._events = merged
        self._open = len(self.streams)  # samples whose final event was not read yet

    def __len__(self) -> int:
        return len(self.streams)

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event of any sample; None on timeout, or once every final event was read."""
        if not self._open:
            return None
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if event.finish is not None:
            self._open -= 1
        return event

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    @property
    def cancelled(self) -> bool:
        return all(s.cancelled for s in self.streams)

    @property
    def timing(self) -> RequestTiming:
        return self.streams[0].timing


@dataclass(eq=False)
class _Request:
    stream: Stream
    prompt: tuple[int, ...]
    turn_request: TurnRequest  # checked at submit: the engine's turn of a new session
    positions: int  # the cache positions its turn reserves
    decoder: IncrementalDecoder | None
    matcher: StopMatcher | None
    images: tuple[TurnImage, ...] = ()  # decoded at submit, their spans laid out in `prompt`
    session: Session | None = None
    turn: object | None = None  # the engine's turn in flight
    chunk_t: float = 0.0  # when its current prefill chunk began
    emitted: int = 0  # tokens of its turn already sent as events
    # the other samples of its prompt (a request of n samples: this one is sample 0, the one
    # queued); they are admitted with it, each then its own row
    group: tuple[_Request, ...] = field(default_factory=tuple)

    @property
    def samples(self) -> tuple[_Request, ...]:
        return (self, *self.group)


class _Abandoned(Exception):
    """Raised between prefill chunks when the request being prefilled was cancelled."""


class Batcher:
    """The engine's continuous batcher (see the module docstring). The engine is driven only
    from the thread that steps (start()'s, or the caller of step()); submit, cancel, stats and
    the streams may be used from any thread."""

    def __init__(self, engine: Engine, *, tokenizer: Tokenizer | None = None,
                 max_running: int = 16, max_queue: int = 64,
                 prefill_chunk_tokens: int | None = None):
        if not isinstance(max_running, int) or not 1 <= max_running <= MAX_ROWS:
            raise ValueError(f"max_running must be an integer from 1 to {MAX_ROWS}, "
                             f"got {max_running!r}.")
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}.")
        if prefill_chunk_tokens is not None:
            chunk_spans(1, prefill_chunk_tokens)  # refused here if it is not a chunk size
        if tokenizer is not None and tokenizer.n_ids > engine.model.args.vocab_size:
            raise ValueError(f"The tokenizer's {tokenizer.n_ids} ids do not fit the model's "
                             f"{engine.model.args.vocab_size}.")
        self.engine, self.tokenizer = engine, tokenizer
        self.max_running, self.max_queue = max_running, max_queue
        self.chunk_tokens = prefill_chunk_tokens
        self._batch = DecodeBatch(engine, max_rows=max_running)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one stepper at a time
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # by session id, in the batch
        self._next_id = 1
        self._counts = {"finished": 0, "cancelled": 0, "prompt_tokens": 0,
                        "completion_tokens": 0, "replayed_tokens": 0,
                        "decoder_replayed_tokens": 0}
        self._tiers: dict[str, int] = {}
        self._tier_tokens: dict[str, int] = {}  # prompt tokens served per tier
        # what /metrics reads of the engine, taken on the stepping thread (`_observe`)
        self._cache_bytes = 0
        self._stores = self._read_stores()
        self._stores_stale = False
        # DSpark's drafts of the finished requests (None: the engine does not speculate)
        self._spec = None if getattr(engine, "spec_policy", None) is None else SpecCounts()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False

    # ---- the client's side ----------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               images: Sequence = ()) -> Stream:
        """Queue a request; every argument checked first (RequestError, a 400-ready sentence):
        ids in the vocabulary, prompt + max_tokens within max_seq_len, params.validate(), a
        cache that fits the runtime budget at all. QueueFull at the queue's bound. `images`
        (bytes, data URLs, PIL images): one per `image_token_id` placeholder of the prompt,
        decoded here, on the caller's thread; each span is laid out in the prompt (its
        positions count as prompt tokens) and the tower runs at the request's prefill."""
        req = self._check(prompt_ids, params, images)
        with self._lock:
            self._queue(req, 1, None)
        return req.stream

    def submit_samples(self, prompt_ids: Sequence[int], params: SamplingParams, n: int,
                       images: Sequence = ()) -> SampleStreams:
        """Queue a request of `n` samples of one prompt (see the module docstring), checked as
        `submit` checks one, and n from 1 to `max_running` (RequestError otherwise): its events
        come merged, each carrying its sample's index."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
            raise RequestError(f"A request takes 1 to {MAX_SAMPLES} samples, not {n!r}.")
        if n > self.max_running:
            raise RequestError(f"{n} samples need {n} rows of the running batch at once; this "
                               f"server runs at most {self.max_running} (max_running).")
        first = self._check(prompt_ids, params, images, samples=n)
        reqs = [first] + [replace(first, decoder=self._decoder(), matcher=self._matcher(params))
                          for _ in range(n - 1)]
        merged: queue.Queue[TokenEvent] = queue.Queue()
        with self._lock:
            self._queue(first, n, merged)
            for i, r in enumerate(reqs[1:], start=1):
                r.stream = Stream(first.stream.id, len(first.prompt), self._wake, index=i,
                                  merged=merged)
            first.group = tuple(reqs[1:])
        return SampleStreams([r.stream for r in reqs], merged)

    def _queue(self, req: _Request, n: int, merged: queue.Queue | None) -> None:
        """Queue `req` (a request of `n` samples), its stream made; under the lock."""
        if self._stopped or self._stopping:
            raise RequestError("The batcher is stopped; it takes no more requests.")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"The queue holds {len(self._waiting)} requests, its bound; "
                            f"retry later.")
        req.stream = Stream(self._next_id, len(req.prompt), self._wake, merged=merged)
        self._next_id += 1
        self._waiting.append(req)
        self._work.notify_all()

    def _decoder(self) -> IncrementalDecoder | None:
        return None if self.tokenizer is None else IncrementalDecoder(self.tokenizer)

    def _matcher(self, params: SamplingParams) -> StopMatcher | None:
        return StopMatcher(params.stop) if self.tokenizer is not None and params.stop else None

    def _check(self, prompt_ids, params, images: Sequence = (), samples: int = 1) -> _Request:
        e = self.engine
        a = e.model.args
        if not isinstance(params, SamplingParams):
            raise RequestError(f"submit() takes SamplingParams, got {type(params).__name__}.")
        try:
            params.validate(a.vocab_size)
        except ValueError as err:
            raise RequestError(str(err)) from err
        ids = check_token_ids(prompt_ids, vocab_size=a.vocab_size, what="submit()")
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise RequestError("submit() takes its images as a list (one per placeholder).")
        expanded, turn_images = e.expand_images(ids, images)
        ids = tuple(expanded)
        if params.stop and self.tokenizer is None:
            raise RequestError("Stop strings are matched on text; this batcher has no "
                               "tokenizer (give stop_token_ids instead).")
        room = a.max_seq_len - len(ids)
        if room < 1:
            raise RequestError(f"The prompt's {len(ids)} tokens leave no room to generate "
                               f"within the model's max_seq_len of {a.max_seq_len}.")
        # stop strings are the batcher's (on text); the engine's turn sees stop ids only
        turn = check_turn(ids, TurnLimits(a.vocab_size, a.max_seq_len, 0),
                          max_new_tokens=room, sampling=replace(params, stop=()))
        positions = len(ids) + turn.max_new_tokens + 1  # as Session reserves its turn
        # its own cache, then a row in the batch per sample
        alone = (1 + samples) * e.cache_bytes(positions)
        if alone > e.options.cache_budget_bytes:
            rows = "its row" if samples == 1 else f"{samples} rows"
            raise RequestError(f"The request needs {alone:,} bytes of runtime cache for "
                               f"{positions} positions ({rows} and its prefill); the budget is "
                               f"{e.options.cache_budget_bytes:,}. Lower max_tokens or the "
                               f"prompt{'' if samples == 1 else ', or n'}.")
        return _Request(None, ids, turn, positions, self._decoder(), self._matcher(params),
                        tuple(turn_images))

    def _wake(self) -> None:
        with self._lock:
            self._work.notify_all()

    def stats(self) -> BatcherStats:
        with self._lock:
            return BatcherStats(queued=sum(len(r.samples) for r in self._waiting),
                                running=len(self._running),
                                tiers=dict(self._tiers), speculative=self._spec,
                                tier_tokens=dict(self._tier_tokens),
                                cache_bytes=self._cache_bytes,
                                cache_budget_bytes=self.engine.options.cache_budget_bytes,
                                stores=self._stores, **self._counts)

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration: cancelled requests leave, the head of the queue is admitted (its
        prefill chunked, one decode step of the running batch between two chunks), then one
        decode step of the running batch. Returns whether work remains."""
        with self._step_lock:
            self._reap()
            self._admit()
            self._decode()
            self._observe()
            with self._lock:
                return bool(self._waiting or self._running)

    def start(self) -> None:
        """A daemon thread running step() while there is work (idle otherwise)."""
        with self._lock:
            if self._stopped or self._stopping:
                raise RuntimeError("The batcher is stopped; make a new one.")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="dsv41-batcher",
                                            daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread; every unfinished stream finishes CANCELLED (a running request's
        turn is stored, as at any end). The batcher takes no requests after."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._step_lock:
            for req in list(self._running.values()):
                self._finish(req, FinishReason.CANCELLED)
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for req in waiting:
                for r in req.samples:
                    self._finish(r, FinishReason.CANCELLED)
            self._batch.close()
            with self._lock:
                self._stopped = True

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
            try:
                busy = self.step()
            except Exception as err:  # a bug: no stream may hang on it
                log.exception("batcher step failed")
                self._fail_all(f"The engine failed: {err}")
                busy = False
            if not busy:
                with self._lock:
                    if not self._stopping and not self._waiting and not self._running:
                        self._work.wait()

    # ---- one step's parts -----------------------------------------------------------------------

    def _read_stores(self) -> TierStores:
        e = self.engine
        rb = getattr(e, "runtime_blocks", None)
        return TierStores(None if e.blocks is None else e.blocks.store_stats(),
                          None if e.pool is None else e.pool.stats(),
                          None if rb is None else rb.stats())

    def _observe(self) -> None:
        """What /metrics reads of the engine, read here, on the stepping thread (the engine and
        its DRAM pool are driven from it alone): the runtime cache's bytes after every step,
        the stores' stats after a step that admitted or finished a request."""
        used = self.engine.runtime_bytes()
        stores = self._read_stores() if self._stores_stale else None
        with self._lock:
            self._cache_bytes = used
            if stores is not None:
                self._stores, self._stores_stale = stores, False

    def _reap(self) -> None:
        """Cancelled requests leave: the running ones free their row now."""
        for req in [r for r in self._running.values() if r.stream.cancelled]:
            self._finish(req, FinishReason.CANCELLED)
        with self._lock:  # a request of n samples leaves the queue once all n are cancelled
            gone = [r for r in self._waiting if all(x.stream.cancelled for x in r.samples)]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            for x in r.samples:
                self._finish(x, FinishReason.CANCELLED)

    def _fits(self, req: _Request) -> bool:
        e = self.engine
        n = len(req.samples)
        need = e.cache_bytes(req.positions) + self._batch.join_bytes(req.positions, n)
        return e.fits(need)  # the runtime prefix tier's blocks make way (Engine.make_room)

    def _admit(self) -> None:
        with self._lock:
            if not self._waiting:
                return
            req = self._waiting[0]
            if len(self._running) + len(req.samples) > self.max_running or not self._fits(req):
                return  # it waits for running requests to leave (and so do those behind it)
            self._waiting.popleft()
            req.stream.log.started = time.perf_counter()
        for r in req.group:
            r.stream.log.started = req.stream.log.started
        req.session = self.engine.session()
        req.chunk_t = time.perf_counter()
        pacing = PrefillPacing(self.chunk_tokens, lambda: self._between_chunks(req))
        try:
            started = self._batch.start_samples(req.session, req.turn_request,
                                                len(req.samples), pacing=pacing,
                                                images=req.images)
        except _Abandoned:
            for r in req.samples:
                self._finish(r, FinishReason.CANCELLED)
            return
        except Exception as err:  # CacheFullError, or a failure of the phases
            log.warning("request %d failed in its prefill: %s", req.stream.id, err)
            for r in req.samples:
                self._finish(r, FinishReason.ERROR, str(err))
            return
        for r, (s, turn) in zip(req.samples, started, strict=True):
            r.session, r.turn = s, turn
        record = req.turn.record
        tail = time.perf_counter() - req.chunk_t
        stores = self._read_stores()  # its lookups counted before its first token is out
        with self._lock:
            self._stores = stores
            self._tiers[record.tier] = self._tiers.get(record.tier, 0) + 1
            self._tier_tokens[record.tier] = self._tier_tokens.get(record.tier, 0) \
                + record.reused_tokens
            self._counts["prompt_tokens"] += len(req.prompt)  # once for all its samples
            self._counts["replayed_tokens"] += record.replayed
            self._counts["decoder_replayed_tokens"] += record.decoder_replayed
            for r in req.samples:
                events = r.stream.log
                with events.lock:
                    events.tier, events.reused = record.tier, record.reused_tokens
                    events.tail = tail
                    events.replayed = (record.replayed, record.decoder_replayed)
                if not r.turn.ended:
                    self._running[r.session.id] = r
        for r in req.samples:
            self._emit(r)

    def _between_chunks(self, req: _Request) -> None:
        """Between two chunks of `req`'s prefill: the running batch's decode step."""
        now = time.perf_counter()
        with req.stream.log.lock:
            req.stream.log.chunks.append(now - req.chunk_t)
        if all(r.stream.cancelled for r in req.samples) or self._stopping:
            raise _Abandoned()
        self._reap()
        self._decode()
        req.chunk_t = time.perf_counter()

    def _decode(self) -> None:
        if not len(self._batch):
            return
        try:
            members = self._batch.step()
        except Exception as err:
            log.exception("decode step failed")
            self._batch.drop()  # the rows are in no known state: nothing of them is stored
            self._batch = DecodeBatch(self.engine, max_rows=self.max_running)
            for req in list(self._running.values()):
                self._finish(req, FinishReason.ERROR, f"The decode step failed: {err}",
                             in_batch=False)
            return
        for s, _ in members:
            self._emit(self._running[s.id])

    def _emit(self, req: _Request) -> None:
        """The events of `req`'s tokens not yet sent; an error of its own (its text: the
        tokenizer, its stop strings) ends `req` alone, never the batch or the other events."""
        try:
            self._emit_tokens(req)
        except Exception as err:  # noqa: BLE001 -- this request's failure, not the batch's
            log.warning("request %d failed emitting its tokens", req.stream.id, exc_info=err)
            if req.stream.done:  # its final event went out: the failure came after
                return
            in_batch = any(s is req.session for s, _ in self._batch.members)
            self._finish(req, FinishReason.ERROR, f"The request failed at token {req.emitted} "
                         f"of its output: {err}", in_batch=in_batch)

    def _emit_tokens(self, req: _Request) -> None:
        """The events of `req`'s tokens not yet sent (one per step; several after a
        speculative step), in order, until the request ends."""
        turn = req.turn
        while req.emitted < len(turn.tokens):
            req.emitted += 1
            if self._emit_one(req, req.emitted - 1):
                return

    def _emit_one(self, req: _Request, i: int) -> bool:
        """The event of token i of `req`'s turn; the request ends (True) on a stop, a stop
        string or its length."""
        turn = req.turn
        tok = turn.tokens[i]
        chosen = turn.sampled[i]
        final = turn.done and i == len(turn.tokens) - 1
        if final and turn.failure is not None:  # its last token stands for no token
            self._finish(req, FinishReason.ERROR, turn.failure)
            return True
        text, stopped = self._text(req, tok, final)
        finish = None
        if stopped or (final and tok in turn.stop):
            finish = FinishReason.STOP
        elif final:
            finish = FinishReason.LENGTH
        event = TokenEvent(tok, text, chosen.logprob, chosen.top, finish)
        with self._lock:
            self._counts["completion_tokens"] += 1
        if finish is None:
            req.stream._put(event)
            return False
        self._finish(req, finish, event=event)
        return True

    def _text(self, req: _Request, tok: int, final: bool) -> tuple[str, bool]:
        """(text to emit, a stop string matched). Stop ids' own text is never emitted."""
        if req.decoder is None:
            return "", False
        delta = "" if tok in req.turn.stop else req.decoder.feed(tok)
        if final:
            delta += req.decoder.flush()
        if req.matcher is None:
            return delta, False
        check = req.matcher.feed(delta)
        if check.stopped or not final:
            return check.text, check.stopped
        return check.text + req.matcher.flush(), False

    def _finish(self, req: _Request, reason: FinishReason, error: str | None = None, *,
                event: TokenEvent | None = None, in_batch: bool = True) -> None:
        """End `req`: out of the batch (its turn stored), its session closed, then the final
        event queued (`event`, its last token's, or a token-less one)."""
        s = req.session
        if s is not None:
            if in_batch and req.turn is not None and not req.turn.ended:
                self._batch.leave(s)
            if self._spec is not None and req.turn is not None:
                counts = SpecCounts.of(req.turn.record)
                with req.stream.log.lock:
                    req.stream.log.speculative = counts
                with self._lock:
                    self._spec = self._spec.plus(counts)
            with self._lock:
                self._running.pop(s.id, None)
            s.close()
        with self._lock:
            self._counts["cancelled" if reason is FinishReason.CANCELLED else "finished"] += 1
            self._stores_stale = True
        req.stream._put(event or TokenEvent(None, "", None, (), reason, error))

    def _fail_all(self, message: str) -> None:
        with self._step_lock:
            self._batch.drop()
            self._batch = DecodeBatch(self.engine, max_rows=self.max_running)
            for req in list(self._running.values()):
                self._finish(req, FinishReason.ERROR, message, in_batch=False)
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for req in waiting:
                for r in req.samples:
                    self._finish(r, FinishReason.ERROR, message)
