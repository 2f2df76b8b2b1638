"""The EPD gateway: the OpenAI server's `Frontend` over the stages' queues (every stage process
is also a gateway: any worker's `/v1` takes requests). It checks a request as the batcher does,
queues it (images prepared and stored first), and feeds each request's `RemoteStream` from its
reply stream on one reader thread; text and stop strings are the gateway's."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from dsv41.graph.model import Model
from dsv41.runtime.engine.images import TurnImage, expand_placeholders, image_record
from dsv41.runtime.engine.requests import RequestError, TurnRequest, check_token_ids
from dsv41.runtime.engine.sampling import SamplingParams, StopMatcher, TokenLogprob
from dsv41.runtime.serving.chat_format import IncrementalDecoder
from dsv41.runtime.serving.epd import EpdKeys, EpdRequest
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

    def __init__(self, gateway: EpdGateway, rid: str, prompt_tokens: int, turn: TurnRequest,
                 tokenizer: Tokenizer | None, stops: Sequence[str]):
        self.gateway, self.rid = gateway, rid
        # events, and the timing they make (queued: the gateway cannot see the workers' queue)
        self.log = EventLog(prompt_tokens, f"request {rid}")
        self.log.started = self.log.submitted
        self._lock = threading.Lock()
        self._stop_ids = turn.stop
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._matcher = StopMatcher(tuple(stops)) if stops else None
        self._cancelled = False
        self.ended_here = False  # a stop string ended it: the workers must be told
        self.last_id = "0-0"

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

    def feed(self, e: dict) -> bool:
        """One event from the reply stream; True when the request has ended."""
        if self.log.finished:
            return True
        if "tier" in e:
            with self.log.lock:
                self.log.tier, self.log.reused = e["tier"], int(e["reused"])
        finish = FinishReason(e["fin"]) if "fin" in e else None
        if "t" not in e:
            self._put(TokenEvent(None, "", None, (), finish, e.get("err")))
            return True
        tok = int(e["t"])
        top = tuple(TokenLogprob(int(i), float(x)) for i, x in e.get("top", ()))
        text, stopped = self._text(tok, finish is not None)
        if stopped:
            self.ended_here = finish is None
            finish = FinishReason.STOP
        self._put(TokenEvent(tok, text, e.get("lp"), top, finish))
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

    def _put(self, ev: TokenEvent) -> None:
        self.log.put(ev)


class EpdGateway:
    """A `Frontend` (runtime/serving/frontend.py): `submit` / `stats` as the batcher's, over the
    queues (runtime/serving/app.py serves it)."""

    def __init__(self, client, fingerprint: bytes, *, vocab_size: int, max_seq_len: int,
                 tokenizer: Tokenizer | None = None, max_queue: int = 64,
                 cancel_ttl_s: float = 600.0, model: Model | None = None,
                 image_ttl_s: float = 600.0):
        """`model`: the deployment's model, when its requests may hold images (it prepares
        them: planning, patches; the tower runs in the vision stage)."""
        self.r, self.keys = client, EpdKeys(fingerprint)
        self.model, self.image_ttl_ms = model, int(image_ttl_s * 1000)
        self.vocab_size, self.max_seq_len, self.tokenizer = vocab_size, max_seq_len, tokenizer
        self.max_queue = max_queue
        self.cancel_ttl_ms = int(cancel_ttl_s * 1000)
        self._lock = threading.Lock()
        self._active: dict[str, RemoteStream] = {}
        self._counts = {"finished": 0, "cancelled": 0, "prompt_tokens": 0,
                        "completion_tokens": 0}
        self._tiers: dict[str, int] = {}
        self._stop = threading.Event()
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
        with self._lock:
            if len(self._active) >= self.max_queue:
                raise QueueFull(f"This gateway has {len(self._active)} requests in flight, its "
                                "bound; retry later.")
            stream = RemoteStream(self, req.rid, len(req.prompt), turn, self.tokenizer,
                                  params.stop)
            self._active[req.rid] = stream
        try:
            pipe = self.r.pipeline(transaction=False)
            for im in turn_images:  # what the vision, prefill and decode stages read
                pipe.set(self.keys.image(im.digest.hex()),
                         image_record(im.image, im.digest, fingerprint=self.keys.fingerprint,
                                      created_at=time.time()), px=self.image_ttl_ms)
            pipe.xadd(self.keys.vision if turn_images else self.keys.prefill,
                      {"req": req.to_json()})
            pipe.execute()
        except Exception as err:  # the queue server is down: the client retries later (429)
            with self._lock:
                self._active.pop(req.rid, None)
            raise QueueFull(f"The queue server is unreachable ({err}); retry later.") from None
        return stream

    def cancel(self, stream: RemoteStream) -> None:
        """The workers drop the request (its cancel key), the stream ends CANCELLED."""
        self.r.set(self.keys.cancel(stream.rid), b"1", px=self.cancel_ttl_ms)
        stream._put(TokenEvent(None, "", None, (), FinishReason.CANCELLED))
        self._retire(stream, FinishReason.CANCELLED)

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
        self.r.delete(self.keys.out(stream.rid))

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                streams = {self.keys.out(s.rid): s for s in self._active.values()}
            if not streams:
                self._stop.wait(0.01)
                continue
            try:
                got = self.r.xread({k: s.last_id for k, s in streams.items()}, block=100)
            except Exception:
                log.exception("the gateway's read failed")
                self._stop.wait(0.5)
                continue
            for key, entries in got or []:
                s = streams[key.decode() if isinstance(key, bytes) else key]
                for mid, fields in entries:
                    s.last_id = mid
                    if s.feed(json.loads(fields[b"e"])):
                        if s.ended_here:  # a stop string: the decode worker lets its row go
                            self.r.set(self.keys.cancel(s.rid), b"1", px=self.cancel_ttl_ms)
                        self._retire(s, None)
                        break

    def stats(self) -> BatcherStats:
        with self._lock:
            return BatcherStats(queued=0, running=len(self._active), tiers=dict(self._tiers),
                                **self._counts)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
