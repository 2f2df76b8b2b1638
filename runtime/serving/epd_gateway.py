"""The EPD gateway: the OpenAI server's `Frontend` over the stages' queues (every stage process
is also a gateway: any worker's `/v1` takes requests). It checks a request as the batcher does,
queues it (images prepared and stored first), and feeds each request's `RemoteStream` from its
reply stream on one reader thread; text and stop strings are the gateway's.

The reader delivers each request's events once and in order (`ReplyEvent` numbers them: one
seen, or of another attempt, is dropped; a gap fails the request), and never dies of one event:
a malformed one fails its request with an error that says so. It also reads its requests'
leases (runtime/serving/epd.py): a request whose lease is gone longer than `lease_grace_s` was
lost with a dead worker or a restarted Redis; one with no event yet is queued again (its next
attempt, `max_attempts` in all), any other ends with an error naming the worker or the queue.
A request whose worker died while another of its stage lives changes hands before that
(epd_stages.py: its entry reclaimed), and the new worker runs it again from the prompt: the
events it sends again (sequence numbers already delivered) are dropped once their tokens are
checked equal to those delivered; a different one ends the request with an error.
Should the reader thread end all the same, its requests end with an error at once and new ones
are refused with one: nothing waits for a reader that is gone."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from dsv41.graph.model import Model
from dsv41.runtime.engine.images import TurnImage, expand_placeholders, image_record
from dsv41.runtime.engine.requests import RequestError, TurnRequest, check_token_ids
from dsv41.runtime.engine.sampling import SamplingParams, StopMatcher
from dsv41.runtime.serving.chat_format import IncrementalDecoder
from dsv41.runtime.serving.epd import QUEUED, EpdKeys, EpdRequest, ReplyEvent
from dsv41.runtime.serving.event_log import EventLog, LoggedStream
from dsv41.runtime.serving.frontend import (
    BatcherStats,
    FinishReason,
    QueueFull,
    TokenEvent,
)
from dsv41.runtime.serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RemoteStream(LoggedStream):
    """One request's events as the batcher's `Stream` gives them (get, cancel, timing, done),
    fed by the gateway's reader thread from the request's reply stream."""

    def __init__(self, gateway: EpdGateway, req: EpdRequest, turn: TurnRequest,
                 tokenizer: Tokenizer | None, stops: Sequence[str],
                 images: Sequence[TurnImage] = ()):
        self.gateway, self.rid, self.req = gateway, req.rid, req
        self.images = tuple(images)  # stored again when the request is queued again
        prompt_tokens = len(req.prompt)
        # events, and the timing they make (queued: the gateway cannot see the workers' queue)
        self.log = EventLog(prompt_tokens, f"request {req.rid}")
        self.log.started = self.log.submitted
        self._lock = threading.Lock()
        self._stop_ids = turn.stop
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._matcher = StopMatcher(tuple(stops)) if stops else None
        self._cancelled = False
        self.ended_here = False  # a stop string ended it: the workers must be told
        self.last_id = "0-0"
        self.next_seq = 0  # the sequence number of the next event to deliver
        self.delivered: list[int] = []  # the token ids delivered, by sequence number
        self.holder: str | None = None  # its lease when last read (`queued:<stage>`, a worker)
        self.lease_gone_since: float | None = None  # monotonic time the lease was first missed
        self.server_restarted = False  # Redis restarted (a new run_id) while it was in flight

    def cancel(self) -> None:
        """Idempotent; a no-op once the request has ended."""
        with self._lock:
            if self._cancelled or self.log.finished:
                return
            self._cancelled = True
        self.gateway.cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def feed(self, ev: ReplyEvent) -> bool:
        """One event from the reply stream (the gateway checked its attempt and number);
        True when the request has ended."""
        if self.log.finished:
            return True
        if ev.tier is not None:
            with self.log.lock:
                self.log.tier, self.log.reused = ev.tier, ev.reused
        finish = ev.finish
        if ev.token is None:
            self._put(TokenEvent(None, "", None, (), finish, ev.error))
            return True
        tok = ev.token.token_id
        text, stopped = self._text(tok, finish is not None)
        if stopped:
            self.ended_here = finish is None
            finish = FinishReason.STOP
        self._put(TokenEvent(tok, text, ev.token.logprob, ev.token.top, finish))
        self.delivered.append(tok)
        self.next_seq = ev.seq + 1
        return finish is not None

    def _text(self, tok: int, final: bool) -> tuple[str, bool]:
        """As the batcher's: (text to emit, a stop string matched); stop ids' text withheld."""
        if self._decoder is None:
            return "", False
        delta = "" if tok in self._stop_ids else self._decoder.feed(tok)
        if final:
            delta += self._decoder.flush()
        if self._matcher is None:
            return delta, False
        check = self._matcher.feed(delta)
        if check.stopped or not final:
            return check.text, check.stopped
        return check.text + self._matcher.flush(), False

    def _put(self, ev: TokenEvent) -> bool:
        """Queue the event unless the request has ended (the reader and a cancel may both
        end it); whether it was queued."""
        with self._lock:
            if self.log.finished:
                return False
            self.log.put(ev)
            return True


class EpdGateway:
    """A `Frontend` (runtime/serving/frontend.py): `submit` / `stats` as the batcher's, over the
    queues (runtime/serving/app.py serves it)."""

    def __init__(self, client, fingerprint: bytes, *, vocab_size: int, max_seq_len: int,
                 tokenizer: Tokenizer | None = None, max_queue: int = 64,
                 cancel_ttl_s: float = 600.0, model: Model | None = None,
                 image_ttl_s: float = 600.0, queue_ttl_s: float = 600.0,
                 lease_check_s: float = 0.5, lease_grace_s: float = 2.0,
                 max_attempts: int = 2):
        """`model`: the deployment's model, when its requests may hold images (it prepares
        them: planning, patches; the tower runs in the vision stage). Leases are read every
        `lease_check_s`; one missing for `lease_grace_s` (more than the workers' heartbeat:
        a live worker writes its lease again after a Redis restart) means the request is
        lost; a lost request with no event yet is queued again up to `max_attempts` in all."""
        if not 0 < lease_check_s <= lease_grace_s:
            raise ValueError(f"lease_check_s must be above 0 and at most lease_grace_s, got "
                             f"{lease_check_s!r} and {lease_grace_s!r}.")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be a whole number >= 1, got "
                             f"{max_attempts!r}.")
        self.r, self.keys = client, EpdKeys(fingerprint)
        self.model, self.image_ttl_ms = model, int(image_ttl_s * 1000)
        self.vocab_size, self.max_seq_len, self.tokenizer = vocab_size, max_seq_len, tokenizer
        self.max_queue = max_queue
        self.cancel_ttl_ms, self.queue_ttl_ms = int(cancel_ttl_s * 1000), int(queue_ttl_s * 1000)
        self.lease_check_s, self.lease_grace_s = lease_check_s, lease_grace_s
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._active: dict[str, RemoteStream] = {}
        self._counts = {"finished": 0, "cancelled": 0, "prompt_tokens": 0,
                        "completion_tokens": 0}
        self._tiers: dict[str, int] = {}
        self._stop = threading.Event()
        self._reader_gone: str | None = None  # why the reader thread ended (None: it runs)
        self._next_check = 0.0
        try:  # the Redis server's run id (a new one: it restarted, and lost what it held)
            self._run_id: str | None = self.r.info("server").get("run_id")
        except Exception:  # unreachable now: the first lease check reads it
            self._run_id = None
        self._thread = threading.Thread(target=self._loop, name="dsv41-gateway", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               images: Sequence = ()) -> RemoteStream:
        """Checked as the batcher checks (RequestError: a 400); QueueFull past max_queue
        requests of this gateway in flight. `images` as the batcher's (one per placeholder):
        prepared and stored here, the request queued for the vision stage."""
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise RequestError("submit() takes its images as a list (one per placeholder).")
        if images and (self.model is None or not self.model.vision):
            raise RequestError("This deployment's gateway takes no images: its model has no "
                               "vision tower (or the gateway was given none).")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"submit() takes SamplingParams, got {type(params).__name__}.")
        try:
            params.validate(self.vocab_size)
        except ValueError as err:
            raise RequestError(str(err)) from err
        if params.stop and self.tokenizer is None:
            raise RequestError("Stop strings are matched on text; this gateway has no "
                               "tokenizer (give stop_token_ids instead).")
        ids = check_token_ids(prompt_ids, vocab_size=self.vocab_size, what="submit()")
        turn_images: list[TurnImage] = []
        if self.model is not None and self.model.vision:
            ids, turn_images = expand_placeholders(self.model, ids, images)
        req = EpdRequest(uuid.uuid4().hex, tuple(ids), replace(params, stop=()),
                         tuple(im.digest.hex() for im in turn_images),
                         tuple(im.offset for im in turn_images))
        turn = req.turn(self.vocab_size, self.max_seq_len)
        stream = RemoteStream(self, req, turn, self.tokenizer, params.stop, turn_images)
        if self._reader_gone is not None:  # nothing would read its events: an error at once
            stream._put(TokenEvent(None, "", None, (), FinishReason.UNAVAILABLE,
                                   self._reader_gone))
            return stream
        with self._lock:
            if len(self._active) >= self.max_queue:
                raise QueueFull(f"This gateway has {len(self._active)} requests in flight, its "
                                "bound; retry later.")
            self._active[req.rid] = stream
        try:
            self._enqueue(stream)
        except Exception as err:  # the queue server is down: the client retries later (429)
            with self._lock:
                self._active.pop(req.rid, None)
            raise QueueFull(f"The queue server is unreachable ({err}); retry later.") from None
        return stream

    def _enqueue(self, stream: RemoteStream) -> None:
        """Store the request's images and queue it (its lease first: `queued:<stage>`)."""
        req = stream.req
        stage = "vision" if stream.images else "prefill"
        pipe = self.r.pipeline(transaction=False)
        for im in stream.images:  # what the vision, prefill and decode stages read
            pipe.set(self.keys.image(im.digest.hex()),
                     image_record(im.image, im.digest, fingerprint=self.keys.fingerprint,
                                  created_at=time.time()), px=self.image_ttl_ms)
        pipe.set(self.keys.lease(req.rid), f"{QUEUED}{stage}", px=self.queue_ttl_ms)
        pipe.xadd(self.keys.vision if stream.images else self.keys.prefill,
                  {"req": req.to_json()})
        pipe.execute()

    def cancel(self, stream: RemoteStream) -> None:
        """The workers drop the request (its cancel key), the stream ends CANCELLED."""
        self._tell_workers(stream)
        stream._put(TokenEvent(None, "", None, (), FinishReason.CANCELLED))
        self._retire(stream, FinishReason.CANCELLED)

    def fail(self, stream: RemoteStream, message: str,
             reason: FinishReason = FinishReason.ERROR) -> None:
        """End the request with an error (the workers told to drop it): ERROR, or UNAVAILABLE
        where the request was lost on its way and may be sent again."""
        log.warning("request %s failed: %s", stream.rid, message)
        self._tell_workers(stream)
        stream._put(TokenEvent(None, "", None, (), reason, message))
        self._retire(stream, reason)

    def _tell_workers(self, stream: RemoteStream) -> None:
        try:
            self.r.set(self.keys.cancel(stream.rid), b"1", px=self.cancel_ttl_ms)
        except Exception as e:  # Redis is down: its rows end at their max_tokens
            log.warning("could not set the cancel key of %s: %s", stream.rid, e)

    def _retire(self, stream: RemoteStream, reason: FinishReason | None) -> None:
        with self._lock:
            if self._active.pop(stream.rid, None) is None:
                return
            self._counts["cancelled" if reason is FinishReason.CANCELLED else "finished"] += 1
            t = stream.timing
            self._counts["prompt_tokens"] += t.prompt_tokens
            self._counts["completion_tokens"] += t.completion_tokens
            if t.tier is not None:
                self._tiers[t.tier] = self._tiers.get(t.tier, 0) + 1
        try:
            self.r.delete(self.keys.out(stream.rid), self.keys.lease(stream.rid))
        except Exception as e:  # both have a TTL
            log.warning("could not delete the reply stream of %s: %s", stream.rid, e)

    # ---- the reader thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        """Polls until closed; should it end otherwise, every request ends with an error."""
        try:
            while not self._stop.is_set():
                try:
                    self._poll()
                except Exception:  # Redis unreachable, ...: the next poll tries again
                    log.exception("the gateway's read failed")
                    self._stop.wait(0.5)
        finally:
            if not self._stop.is_set():
                self._reader_gone = ("This gateway's reader thread stopped, so it cannot "
                                     "take requests; send them to another worker or restart "
                                     "this one.")
                log.error("the gateway's reader thread stopped")
                with self._lock:
                    streams = list(self._active.values())
                for s in streams:
                    s._put(TokenEvent(None, "", None, (), FinishReason.UNAVAILABLE,
                                      self._reader_gone))
                    self._retire(s, FinishReason.UNAVAILABLE)

    def _poll(self) -> None:
        with self._lock:
            streams = {self.keys.out(s.rid): s for s in self._active.values()}
        if not streams:
            self._stop.wait(0.01)
            return
        got = self.r.xread({k: s.last_id for k, s in streams.items()}, block=100)
        for key, entries in got or []:
            s = streams.get(key.decode() if isinstance(key, bytes) else key)
            if s is None:
                log.warning("dropped %d events of a reply stream not asked for: %r",
                            len(entries), key)
                continue
            for mid, fields in entries:
                s.last_id = mid
                if self._deliver(s, fields):
                    break
        if time.monotonic() >= self._next_check:
            self._check_leases(list(streams.values()))
            self._next_check = time.monotonic() + self.lease_check_s

    def _deliver(self, s: RemoteStream, fields: dict) -> bool:
        """One reply-stream entry to its request; True when the request has ended."""
        if s.log.finished:
            return True
        try:
            ev = ReplyEvent.from_fields(fields)
        except ValueError as err:
            self.fail(s, f"The request's reply stream held an event this gateway cannot read; "
                         f"send the request again. {err}", FinishReason.UNAVAILABLE)
            return True
        if ev.attempt != s.req.attempt:
            return False  # an earlier attempt's (it was queued again)
        if ev.token is not None and ev.seq != s.next_seq:
            if ev.seq < s.next_seq:  # delivered already: an event sent twice, or a worker
                # that took the request over from a dead one and runs it again from the prompt
                if ev.token.token_id == s.delivered[ev.seq]:
                    return False
                self.fail(s, f"The worker that took the request over gave token "
                             f"{ev.token.token_id} at place {ev.seq}, where token "
                             f"{s.delivered[ev.seq]} was delivered (an unseeded sampled "
                             f"request cannot be run again the same); send it again.",
                          FinishReason.UNAVAILABLE)
                return True
            self.fail(s, f"The request's events {s.next_seq} to {ev.seq - 1} were lost (the "
                         "queue server restarted?); send the request again.",
                      FinishReason.UNAVAILABLE)
            return True
        try:
            ended = s.feed(ev)
        except Exception as err:  # a token the tokenizer cannot spell, ...
            self.fail(s, f"The request's event {ev.seq} could not be delivered "
                         f"({type(err).__name__}: {err}); send the request again.")
            return True
        if ended:
            if s.ended_here:  # a stop string: the decode worker lets its row go
                self._tell_workers(s)
            self._retire(s, None)
        return ended

    def _check_leases(self, streams: list[RemoteStream]) -> None:
        """Requests whose lease has been gone for `lease_grace_s`: queued again, or failed."""
        streams = [s for s in streams if not s.log.finished]
        if not streams:
            return
        run_id = self.r.info("server").get("run_id")
        if self._run_id is not None and run_id != self._run_id:
            for s in streams:  # what Redis held of them is gone
                s.server_restarted = True
        self._run_id = run_id
        held = self.r.mget([self.keys.lease(s.rid) for s in streams])
        now = time.monotonic()
        for s, value in zip(streams, held, strict=True):
            if value is not None:
                s.holder, s.lease_gone_since = value.decode(errors="replace"), None
            elif s.lease_gone_since is None:
                s.lease_gone_since = now
            elif now - s.lease_gone_since >= self.lease_grace_s:
                self._lost(s)

    def _lost(self, s: RemoteStream) -> None:
        holder = s.holder or f"{QUEUED}prefill"
        seen = (f"in the {holder[len(QUEUED):]} queue" if holder.startswith(QUEUED)
                else f"with {holder}")
        if s.server_restarted:
            where = (f"the queue server restarted and lost what it held of it (it was last "
                     f"seen {seen})")
        elif holder.startswith(QUEUED):
            where = (f"the queue server lost it while it waited in the "
                     f"{holder[len(QUEUED):]} queue (was Redis restarted?)")
        else:
            where = f"the worker running it, {holder}, stopped (its heartbeat lapsed)"
        if s.next_seq == 0 and s.req.attempt + 1 < self.max_attempts and not s.log.finished:
            log.warning("request %s lost (%s); queued again", s.rid, where)
            s.req = replace(s.req, attempt=s.req.attempt + 1)
            s.holder, s.lease_gone_since, s.server_restarted = None, None, False
            try:
                self._enqueue(s)
                return
            except Exception as err:
                where += f", and queueing it again failed ({err})"
        self.fail(s, f"The request was lost: {where}; send it again.", FinishReason.UNAVAILABLE)

    def stats(self) -> BatcherStats:
        with self._lock:
            return BatcherStats(queued=0, running=len(self._active), tiers=dict(self._tiers),
                                **self._counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
