"""One request's events and what they say of its timing: what the batcher's `Stream` and the EPD
gateway's `RemoteStream` (the two `EventStream`s of runtime/serving/frontend.py) share.

The producer (the batcher's stepping thread, the gateway's reader thread) `put`s each event, and
the log times it; the consumer (the server's handler) `get`s them in order. The producer records
what it learns of the request on the way (`started`, `tier`, `reused`, `chunks`, `tail`) under
`lock`. Thread-safe.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.serving.frontend import RequestTiming, TokenEvent


class EventLog:
    """Events in arrival order, and the timing they make (see the module docstring)."""

    def __init__(self, prompt_tokens: int, label: str):
        self.label = label  # names the request in an error (`stream 7`, `request <id>`)
        self.lock = threading.Lock()
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self.finished = False  # the final event is queued
        self._read_final = False  # ... and was read
        self.submitted = time.perf_counter()
        self.started: float | None = None  # its prefill began (None: still queued)
        self._first: float | None = None
        self._last: float | None = None
        self._gaps: list[float] = []
        self.chunks: list[float] = []  # each prefill piece but the last (RequestTiming's)
        self.tail: float | None = None  # the prefill's last piece
        self.prompt, self.completion = prompt_tokens, 0
        self.tier: str | None = None
        self.reused = 0
        self.replayed = (0, 0)  # the prefill's (encoder, decoder) replayed tokens
        self.speculative: SpecCounts | None = None  # DSpark's drafts (set as it finishes)

    # ---- the consumer's side --------------------------------------------------------------------

    def __iter__(self) -> Iterator[TokenEvent]:
        """Blocks for each next event; ends after the final one."""
        while True:
            event = self.get()
            if event is None:
                return
            yield event
            if event.finish is not None:
                return

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event; None on timeout, or once the final event was read."""
        if self._read_final:
            return None
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if event.finish is not None:
            self._read_final = True
        return event

    def timing(self) -> RequestTiming:
        """The request's timing so far (queued until `started`)."""
        with self.lock:
            now = time.perf_counter()
            queued = (self.started if self.started is not None else now) - self.submitted
            return RequestTiming(
                queued_s=queued,
                first_token_s=None if self._first is None else self._first - self.submitted,
                per_token_s=tuple(self._gaps), prompt_tokens=self.prompt,
                completion_tokens=self.completion, tier=self.tier, reused_tokens=self.reused,
                prefill_chunk_s=tuple(self.chunks), prefill_tail_s=self.tail,
                submitted_at=self.submitted, replayed_tokens=self.replayed[0],
                decoder_replayed_tokens=self.replayed[1], speculative=self.speculative)

    # ---- the producer's side --------------------------------------------------------------------

    def put(self, event: TokenEvent) -> None:
        """Queue one event, timing a token's; nothing may follow the final event."""
        with self.lock:
            if self.finished:
                raise AssertionError(f"{self.label} got an event after its final one")
            if event.token_id is not None:
                now = time.perf_counter()
                if self._first is None:
                    self._first = now
                else:
                    self._gaps.append(now - self._last)
                self._last = now
                self.completion += 1
            self.finished = event.finish is not None
        self._events.put(event)


class LoggedStream:
    """The reading side of an `EventStream` over an `EventLog` (`self.log`): what the batcher's
    `Stream` and the gateway's `RemoteStream` share; each adds its own `cancel`."""

    log: EventLog

    def __iter__(self) -> Iterator[TokenEvent]:
        """Blocks for each next event; ends after the final one."""
        return iter(self.log)

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event; None on timeout, or once the final event was read."""
        return self.log.get(timeout)

    @property
    def done(self) -> bool:
        """The request has ended (its final event is queued)."""
        return self.log.finished

    @property
    def timing(self) -> RequestTiming:
        """The request's timing so far."""
        return self.log.timing()
