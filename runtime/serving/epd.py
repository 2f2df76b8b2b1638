"""EPD workers: vision, prefill and decode as separately scaled processes over one Redis server.

    dsv41 serve --role vision  --redis-url redis://host:6379/0 ...   # one or more (images)
    dsv41 serve --role prefill --redis-url redis://host:6379/0 ...   # one or more
    dsv41 serve --role decode  --redis-url redis://host:6379/0 ...   # one or more

A request flows gateway -> [vision ->] prefill -> decode -> gateway. Every worker process is also
a gateway (`EpdGateway`, the OpenAI server's front: any worker's `/v1` takes requests), so
clients may talk to any of them.

- Images: the gateway decodes and prepares each image (`runtime/images.py`: the patches, the
  grid; its span laid out in the prompt), stores it as a record keyed by its content digest
  (`EpdKeys.image`, a TTL) and sends the request to the vision stream; a vision worker runs the
  tower once per image (an image already encoded is not encoded again) and stores its aligned
  rows (`EpdKeys.features`), then passes the request on to the prefill stream. The prefill
  worker splices those rows (features that expired or fail their check are encoded again
  there: never a wrong answer), the decode worker reads the image records for the tiers' keys
  (an image names its span's blocks and snapshots by content). A request whose image record
  is gone ends with an error event.

- The gateway checks the request (as the batcher does), adds it to the prefill stream and reads
  the request's reply stream: token ids with their logprobs, the tier, the finish. Text and
  stop strings are the gateway's (it has the tokenizer); a matched stop string ends the stream
  and sets the request's cancel key, which the decode worker reads between steps.
- A prefill worker takes one request at a time from the prefill stream (a consumer group: each
  request goes to one worker), prefills it on its engine (the tiers: SSD blocks, the shared
  Redis snapshot pool), samples the first token and sends it; unless that ends the request, it
  hands the finished runtime state over: every complete global block, the encoder and decoder
  rings, the tails and the pointers (`Session.runtime_state`), the first token and the
  sampler's generator, as one `runtime.wire` record (model fingerprint, key, sha256) under a
  hand-off key with a short TTL, and adds the request to the decode stream. Then it ends its
  turn like any turn: the global blocks to its SSD store, the encoder snapshot to the pool
  (what the article persists; the hand-off record is a message, deleted when read).
- A decode worker takes hand-offs while it has free rows, checks each record (fingerprint,
  kind, key, checksum, layout) before use, restores the cache byte for byte (`Engine.adopt`)
  and joins it to its continuous `DecodeBatch`; each step sends every row's token. A hand-off
  that is missing (expired) or fails a check is counted and the request prefilled here from
  the tiers instead (its first token was already sent, the same one: never a wrong answer).

Why Redis streams: the pool's server is already there; a consumer group hands each entry to
exactly one of the workers reading it (start more processes of a stage to scale it), keeps a
per-group lag (the queue length `/metrics` shows) and acknowledgements; a reply stream per
request keeps its events in order for a reader that resumes from the last id. Lists would need
our own bookkeeping for all three.

All stages of one deployment run the same model, weights, page size and backend: the queues'
names carry the model fingerprint (runtime/salt.py), so stages of another model never meet.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

from dsv41.graph.model import Model
from dsv41.runtime.engine import DecodeBatch, Engine
from dsv41.runtime.engine.images import (
    TurnImage,
    expand_placeholders,
    features_record,
    image_record,
    read_features_record,
    read_image_record,
)
from dsv41.runtime.engine.requests import (
    RequestError,
    TurnLimits,
    TurnRequest,
    check_token_ids,
    check_turn,
)
from dsv41.runtime.engine.sampling import (
    SampledToken,
    SamplingParams,
    StopMatcher,
    TokenLogprob,
)
from dsv41.runtime.serving.batcher import BatcherStats, FinishReason, RequestTiming, TokenEvent
from dsv41.runtime.serving.chat_format import IncrementalDecoder
from dsv41.runtime.serving.metrics import RateWindow, ServerMetrics
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.tiers.wire import (
    RecordError,
    RecordFault,
    RecordKind,
    decode_record,
    encode_record,
)

log = logging.getLogger(__name__)

HANDOFF_KIND = RecordKind.HANDOFF
VISION_GROUP, PREFILL_GROUP, DECODE_GROUP = "vision", "prefill", "decode"


class Role(Enum):
    VISION = "vision"
    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"  # the single-process server (runtime/batcher.py)


@dataclass(frozen=True)
class EpdKeys:
    """The Redis names of one model's deployment (`fingerprint`: the engines' key salt)."""

    fingerprint: bytes

    @property
    def base(self) -> str:
        return f"dsv41:epd:{self.fingerprint.hex()[:32]}"

    @property
    def vision(self) -> str:
        return f"{self.base}:vision"

    @property
    def prefill(self) -> str:
        return f"{self.base}:prefill"

    def image(self, digest: str) -> str:
        return f"{self.base}:image:{digest}"

    def features(self, digest: str) -> str:
        return f"{self.base}:features:{digest}"

    @property
    def decode(self) -> str:
        return f"{self.base}:decode"

    def handoff(self, rid: str) -> str:
        return f"{self.base}:handoff:{rid}"

    def out(self, rid: str) -> str:
        return f"{self.base}:out:{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self.base}:cancel:{rid}"


@dataclass(frozen=True)
class EpdRequest:
    """What travels through the queues: a new session's prompt and its sampling."""

    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams  # stop strings removed: they are the gateway's
    image_keys: tuple[str, ...] = ()  # each image's content digest (hex): its records' keys
    image_offsets: tuple[int, ...] = ()  # where each image's span starts in `prompt`

    def to_json(self) -> str:
        return json.dumps({"rid": self.rid, "prompt": list(self.prompt),
                           "sampling": asdict(self.sampling), "image_keys": list(self.image_keys),
                           "image_offsets": list(self.image_offsets)})

    @classmethod
    def from_json(cls, text: str | bytes) -> EpdRequest:
        d = json.loads(text)
        s = dict(d["sampling"])
        s["stop"], s["stop_token_ids"] = tuple(s["stop"]), tuple(s["stop_token_ids"])
        keys = tuple(str(k) for k in d.get("image_keys", ()))
        offsets = tuple(int(o) for o in d.get("image_offsets", ()))
        if len(keys) != len(offsets):
            raise ValueError(f"The request names {len(keys)} images but {len(offsets)} spans.")
        return cls(str(d["rid"]), tuple(int(t) for t in d["prompt"]), SamplingParams(**s),
                   keys, offsets)

    def turn(self, vocab_size: int, max_seq_len: int) -> TurnRequest:
        """The engine's turn of a new session (RequestError when it does not fit)."""
        ids = check_token_ids(self.prompt, vocab_size=vocab_size, what="the request")
        room = max_seq_len - len(ids)
        if room < 1:
            raise RequestError(f"The prompt's {len(ids)} tokens leave no room to generate "
                               f"within the model's max_seq_len of {max_seq_len}.")
        return check_turn(ids, TurnLimits(vocab_size, max_seq_len, 0), max_new_tokens=room,
                          sampling=self.sampling)


def _event(token: SampledToken | None, finish: FinishReason | None, *, tier: str | None = None,
           reused: int | None = None, error: str | None = None) -> dict:
    e: dict = {}
    if token is not None:
        e["t"] = token.token_id
        if token.logprob is not None:
            e["lp"] = token.logprob
            e["top"] = [[x.token_id, x.logprob] for x in token.top]
    if finish is not None:
        e["fin"] = finish.value
    if tier is not None:
        e["tier"], e["reused"] = tier, reused
    if error is not None:
        e["err"] = error
    return {"e": json.dumps(e)}


def _parse(fields: dict) -> EpdRequest | None:
    """A queue entry's request; None (logged, dropped) when it is not one."""
    try:
        return EpdRequest.from_json(fields[b"req"])
    except (KeyError, ValueError, TypeError) as e:
        log.error("dropped a queue entry that is not a request: %s", e)
        return None


def _finish_of(turn) -> FinishReason | None:
    if not turn.done:
        return None
    return FinishReason.STOP if turn.tokens[-1] in turn.stop else FinishReason.LENGTH


@dataclass
class StageCounters:
    """A worker's throughput, for /metrics."""

    requests: int = 0  # requests this worker finished its stage of
    tokens: int = 0  # prompt tokens prefilled (prefill) or tokens decoded (decode)
    errors: int = 0
    handoffs_rejected: int = 0  # decode: records missing or failing a check (prefilled here)
    rate: RateWindow = field(default_factory=lambda: RateWindow(10.0))  # tokens, last 10 s


class _Worker:
    role: Role

    def __init__(self, engine: Engine, client, *, consumer: str | None = None,
                 reply_ttl_s: float = 600.0, handoff_ttl_s: float = 120.0,
                 image_ttl_s: float = 600.0):
        self.engine, self.r = engine, client
        self.image_ttl_ms = int(image_ttl_s * 1000)
        self.keys = EpdKeys(engine.key_salt.fingerprint())
        self.consumer = consumer or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        self.reply_ttl_ms, self.handoff_ttl_ms = int(reply_ttl_s * 1000), int(handoff_ttl_s * 1000)
        self.counters = StageCounters()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        a = engine.model.args
        self.vocab_size, self.max_seq_len = a.vocab_size, a.max_seq_len
        import redis

        for stream, group in ((self.keys.vision, VISION_GROUP), (self.keys.prefill, PREFILL_GROUP),
                              (self.keys.decode, DECODE_GROUP)):
            try:
                self.r.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as e:  # BUSYGROUP: another worker made it
                if "BUSYGROUP" not in str(e):
                    raise

    def send(self, rid: str, fields: dict, pipe=None) -> None:
        r = pipe if pipe is not None else self.r
        r.xadd(self.keys.out(rid), fields)
        r.pexpire(self.keys.out(rid), self.reply_ttl_ms)

    def queue_length(self) -> int:
        """Entries of this stage's stream not yet read by its group (Redis' group lag)."""
        stream, group = {Role.VISION: (self.keys.vision, VISION_GROUP),
                         Role.PREFILL: (self.keys.prefill, PREFILL_GROUP)}.get(
            self.role, (self.keys.decode, DECODE_GROUP))
        try:
            for g in self.r.xinfo_groups(stream):
                if g["name"] in (group, group.encode()):
                    return int(g.get("lag") or 0) + int(g.get("pending") or 0)
        except Exception:  # the server is unreachable: no number rather than a failed scrape
            return -1
        return 0

    def turn_images(self, req: EpdRequest) -> list[TurnImage]:
        """The request's images from their records (RequestError when one is gone or fails its
        check), each with the vision stage's rows when those are there and sound (else None:
        the tower runs again where they are needed)."""
        model, fp = self.engine.model, self.keys.fingerprint
        out = []
        for key, offset in zip(req.image_keys, req.image_offsets, strict=True):
            try:
                image = read_image_record(self.r.get(self.keys.image(key)), key,
                                          fingerprint=fp, args=model.args)
            except RecordError as e:
                raise RequestError(f"The request's image {key[:16]} is gone or damaged ({e}); "
                                   "send the request again.") from None
            try:
                rows = read_features_record(self.r.get(self.keys.features(key)), key,
                                            fingerprint=fp, rows=image.grid.n_embeddings,
                                            dim=model.args.dim)
            except RecordError as e:
                rows = None
                if self.role is not Role.VISION:
                    log.warning("image features %s unusable (%s); encoding them here",
                                key[:16], e)
            out.append(TurnImage(offset, image, bytes.fromhex(key), rows))
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"dsv41-{self.role.value}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(block_ms=200)
            except Exception:
                log.exception("%s worker step failed", self.role.value)
                with self._lock:
                    self.counters.errors += 1
                time.sleep(0.5)

    def _read(self, stream: str, group: str, count: int, block_ms: int | None):
        got = self.r.xreadgroup(group, self.consumer, {stream: ">"}, count=count,
                                block=block_ms)
        return [(mid, fields) for _, entries in (got or []) for mid, fields in entries]


class VisionWorker(_Worker):
    """One request at a time from the vision stream: each of its images through the tower
    (once per content), the rows stored for the prefill stage, the request passed on."""

    role = Role.VISION

    def step(self, block_ms: int | None = None) -> int:
        """Take and encode at most one request; how many were taken."""
        entries = self._read(self.keys.vision, VISION_GROUP, 1, block_ms)
        for mid, fields in entries:
            req = _parse(fields)
            if req is not None:
                self._encode(req)
            self.r.xack(self.keys.vision, VISION_GROUP, mid)
            self.r.xdel(self.keys.vision, mid)
        return len(entries)

    def _encode(self, req: EpdRequest) -> None:
        if self.r.exists(self.keys.cancel(req.rid)):
            return  # the client left while it waited
        encoded = 0
        try:
            for im in self.turn_images(req):
                if im.embeddings is not None:
                    continue  # this image's rows are there already (another request's)
                rows = self.engine.encode_image(im.image)  # the artifact's `vision` entry
                self.r.set(self.keys.features(im.digest.hex()),
                           features_record(rows, im.digest.hex(),
                                           fingerprint=self.keys.fingerprint,
                                           created_at=time.time()), px=self.image_ttl_ms)
                encoded += im.image.grid.n_patches
        except Exception as e:
            log.warning("request %s failed in its vision stage: %s", req.rid, e)
            with self._lock:
                self.counters.errors += 1
            self.send(req.rid, _event(None, FinishReason.ERROR, error=str(e)))
            return
        self.r.xadd(self.keys.prefill, {"req": req.to_json()})
        with self._lock:
            self.counters.requests += 1
            self.counters.tokens += encoded
        self.counters.rate.add(encoded)


class PrefillWorker(_Worker):
    """One request at a time from the prefill stream: prefill, first token, hand-off."""

    role = Role.PREFILL

    def step(self, block_ms: int | None = None) -> int:
        """Take and prefill at most one request; how many were taken."""
        entries = self._read(self.keys.prefill, PREFILL_GROUP, 1, block_ms)
        for mid, fields in entries:
            req = _parse(fields)
            if req is not None:
                self._prefill(req)
            self.r.xack(self.keys.prefill, PREFILL_GROUP, mid)
            self.r.xdel(self.keys.prefill, mid)
        return len(entries)

    def _prefill(self, req: EpdRequest) -> None:
        if self.r.exists(self.keys.cancel(req.rid)):
            return  # the client left while it waited
        s = self.engine.session()
        try:
            turn = s.begin(req.turn(self.vocab_size, self.max_seq_len),
                           images=self.turn_images(req))
        except Exception as e:
            s.close()
            log.warning("request %s failed in its prefill: %s", req.rid, e)
            with self._lock:
                self.counters.errors += 1
            self.send(req.rid, _event(None, FinishReason.ERROR, error=str(e)))
            return
        rec, first = turn.record, turn.sampled[-1]
        finish = _finish_of(turn)
        with self._lock:  # counted before the events go (a reader may look at once)
            self.counters.requests += 1
            self.counters.tokens += len(req.prompt)
        self.counters.rate.add(len(req.prompt))
        try:  # the first token before the hand-off: the decode worker's tokens come after it
            self.send(req.rid, _event(first, finish, tier=rec.tier, reused=rec.reused_tokens))
            if finish is None:
                self._hand_off(req, s, turn)
        finally:
            s.finish(turn)  # the blocks to the SSD store, the encoder snapshot to the pool
            s.close()

    def _hand_off(self, req: EpdRequest, s, turn) -> None:
        first = turn.sampled[-1]
        meta = {"request": req.to_json(), "tokens": list(s.history),
                "first": [first.token_id, first.logprob,
                          [[x.token_id, x.logprob] for x in first.top]],
                "generator": turn.sampler.generator.get_state().numpy().tobytes().hex()}
        value = encode_record(kind=HANDOFF_KIND, key=req.rid, fingerprint=self.keys.fingerprint,
                              created_at=time.time(), meta=meta, arrays=s.runtime_state())
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.handoff(req.rid), value, px=self.handoff_ttl_ms)
        pipe.xadd(self.keys.decode, {"rid": req.rid, "req": req.to_json()})
        pipe.execute()


class DecodeWorker(_Worker):
    """Hand-offs into one continuous decode batch; each step sends every row's token."""

    role = Role.DECODE

    def __init__(self, engine: Engine, client, *, max_running: int = 16, **kw):
        super().__init__(engine, client, **kw)
        if not isinstance(max_running, int) or not 1 <= max_running <= 64:
            raise ValueError(f"max_running must be an integer from 1 to 64, got "
                             f"{max_running!r}.")
        self.max_running = max_running
        self.batch = DecodeBatch(engine, max_rows=max_running)
        self.rids: dict[int, str] = {}  # session id -> request id

    def running(self) -> int:
        return len(self.batch)

    def step(self, block_ms: int | None = None) -> int:
        """Take hand-offs into free rows (blocking only when idle), drop cancelled rows, then
        one decode step; how many hand-offs were taken."""
        free = self.max_running - len(self.batch)
        taken = 0
        if free > 0:
            entries = self._read(self.keys.decode, DECODE_GROUP, free,
                                 block_ms if not len(self.batch) else None)
            for mid, fields in entries:
                req = _parse(fields)
                if req is not None:
                    self._join(req.rid, req)
                self.r.xack(self.keys.decode, DECODE_GROUP, mid)
                self.r.xdel(self.keys.decode, mid)
            taken = len(entries)
        self._reap()
        if len(self.batch):
            members = self.batch.step()
            pipe = self.r.pipeline(transaction=False)
            done = []
            for s, t in members:
                finish = _finish_of(t)
                self.send(self.rids[s.id], _event(t.sampled[-1], finish), pipe)
                if finish is not None:
                    done.append(s)
            with self._lock:  # counted before the events go (a reader may look at once)
                self.counters.tokens += len(members)
                self.counters.requests += len(done)
            self.counters.rate.add(len(members))
            pipe.execute()
            for s in done:
                self._leave(s)
        return taken

    def _join(self, rid: str, req: EpdRequest) -> None:
        e = self.engine
        turn_req = req.turn(self.vocab_size, self.max_seq_len)
        value = self.r.getdel(self.keys.handoff(rid))
        s = turn = None
        try:
            images = self.turn_images(req)  # the tiers' keys name them by content
        except RequestError as err:
            self.send(rid, _event(None, FinishReason.ERROR, error=str(err)))
            return
        try:
            rec = decode_record(value if value is not None else b"", kind=HANDOFF_KIND, key=rid,
                                fingerprint=self.keys.fingerprint)
            tokens = [int(t) for t in rec.meta["tokens"]]
            tok, lp, top = rec.meta["first"]
            first = SampledToken(int(tok), lp, tuple(TokenLogprob(int(i), float(x))
                                                     for i, x in top))
            if tokens != list(req.prompt) or EpdRequest.from_json(rec.meta["request"]) != req:
                raise RecordError(RecordFault.FOREIGN, "The hand-off is of another request.")
            s, turn = e.adopt(tokens, rec.arrays, turn_req, first,
                              bytes.fromhex(rec.meta["generator"]),
                              images=images)
        except (RecordError, ValueError, KeyError, TypeError) as err:
            # missing, expired, damaged or not this request's: prefill here from the tiers
            # (the first token, already sent by the prefill worker, comes out the same)
            log.warning("hand-off of %s unusable (%s); prefilling it here", rid,
                        err if value is not None else "missing or expired")
            with self._lock:
                self.counters.handoffs_rejected += 1
            s = e.session()
            try:
                turn = s.begin(turn_req, images=images)
            except Exception as err2:
                s.close()
                self.send(rid, _event(None, FinishReason.ERROR, error=str(err2)))
                return
        if turn.done:  # cannot happen after a hand-off (the prefill worker ends those)
            s.finish(turn)
            s.close()
            return
        self.batch.join(s, turn)
        self.rids[s.id] = rid

    def _reap(self) -> None:
        """Rows whose request was cancelled (client gone, stop string at the gateway) leave."""
        if not len(self.batch):
            return
        members = [s for s, _ in self.batch.members]
        flags = self.r.mget([self.keys.cancel(self.rids[s.id]) for s in members])
        for s, flag in zip(members, flags, strict=True):
            if flag is not None:
                self._leave(s)

    def _leave(self, s) -> None:
        self.batch.leave(s)  # the turn is stored in the tiers
        s.close()
        self.rids.pop(s.id, None)

    def stop(self) -> None:
        super().stop()
        self.batch.close()


# ---- the gateway: the OpenAI server's front over the queues --------------------------------------

class RemoteStream:
    """One request's events as the batcher's `Stream` gives them (get, cancel, timing, done),
    fed by the gateway's reader thread from the request's reply stream."""

    def __init__(self, gateway: EpdGateway, rid: str, prompt_tokens: int, turn: TurnRequest,
                 tokenizer: Tokenizer | None, stops: Sequence[str]):
        import queue

        self.gateway, self.rid = gateway, rid
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._q_empty = queue.Empty
        self._lock = threading.Lock()
        self._stop_ids = turn.stop
        self._decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self._matcher = StopMatcher(tuple(stops)) if stops else None
        self._submitted = time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None
        self._gaps: list[float] = []
        self._prompt, self._completion = prompt_tokens, 0
        self._tier: str | None = None
        self._reused = 0
        self._cancelled = False
        self._finished = False
        self.ended_here = False  # a stop string ended it: the workers must be told
        self._read_final = False
        self.last_id = "0-0"

    def __iter__(self):
        while True:
            ev = self.get()
            if ev is None:
                return
            yield ev
            if ev.finish is not None:
                return

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        if self._read_final:
            return None
        try:
            ev = self._events.get(timeout=timeout)
        except self._q_empty:
            return None
        if ev.finish is not None:
            self._read_final = True
        return ev

    def cancel(self) -> None:
        """Idempotent; a no-op once the request has ended."""
        with self._lock:
            if self._cancelled or self._finished:
                return
            self._cancelled = True
        self.gateway.cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def done(self) -> bool:
        return self._finished

    @property
    def timing(self) -> RequestTiming:
        with self._lock:
            return RequestTiming(
                queued_s=0.0,
                first_token_s=None if self._first is None else self._first - self._submitted,
                per_token_s=tuple(self._gaps), prompt_tokens=self._prompt,
                completion_tokens=self._completion, tier=self._tier, reused_tokens=self._reused,
                submitted_at=self._submitted)

    def feed(self, e: dict) -> bool:
        """One event from the reply stream; True when the request has ended."""
        if self._finished:
            return True
        if "tier" in e:
            self._tier, self._reused = e["tier"], int(e["reused"])
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
        with self._lock:
            if ev.token_id is not None:
                now = time.perf_counter()
                if self._first is None:
                    self._first = now
                else:
                    self._gaps.append(now - self._last)
                self._last = now
                self._completion += 1
            self._finished = ev.finish is not None
        self._events.put(ev)


class EpdGateway:
    """`submit` / `stats` as the batcher's, over the queues (runtime/server.py serves it)."""

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
        from dsv41.runtime.serving.batcher import QueueFull

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
            self._counts["prompt_tokens"] += stream._prompt
            self._counts["completion_tokens"] += stream._completion
            if stream._tier is not None:
                self._tiers[stream._tier] = self._tiers.get(stream._tier, 0) + 1
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


class EpdServerMetrics(ServerMetrics):
    """The server's metrics (the gateway's requests) and the worker's stage: its queue (the
    stage's stream entries not yet taken or acknowledged), running rows, throughput."""

    def __init__(self, worker: VisionWorker | PrefillWorker | DecodeWorker, **kw):
        super().__init__(**kw)
        self.worker = worker

    def render(self, stats) -> str:
        w, role = self.worker, self.worker.role.value
        with w._lock:
            n = replace(w.counters)
        rows = [
            ("dsv41_epd_queue_length", "gauge", "Entries of this stage's stream waiting for "
             "its workers (group lag + pending; -1: Redis unreachable).", w.queue_length()),
            ("dsv41_epd_running_sequences", "gauge", "Sequences this worker runs now (decode: "
             "rows of its batch).", w.running() if isinstance(w, DecodeWorker) else 0),
            ("dsv41_epd_stage_tokens_per_second", "gauge", "Tokens this worker processed per "
             "second over the last 10 s (vision: patches; prefill: prompt tokens; decode: "
             "decoded tokens).",
             round(n.rate.rate(), 6)),
            ("dsv41_epd_stage_requests_total", "counter", "Requests this worker finished its "
             "stage of.", n.requests),
            ("dsv41_epd_stage_tokens_total", "counter", "Tokens this worker processed (vision: "
             "patches; prefill: prompt tokens; decode: decoded tokens).", n.tokens),
            ("dsv41_epd_stage_errors_total", "counter", "Requests this worker failed.", n.errors),
            ("dsv41_epd_handoffs_rejected_total", "counter", "Hand-offs missing or failing a "
             "check (fingerprint, checksum, layout), prefilled again here.",
             n.handoffs_rejected),
        ]
        lines = [super().render(stats).rstrip("\n")]
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                      f'{name}{{role="{role}"}} {value}']
        return "\n".join(lines) + "\n"
