"""The EPD stages' workers (runtime/serving/epd.py says how a request flows): the vision worker
(the tower once per image), the prefill worker (prefill, first token, the hand-off record) and the
decode worker (hand-offs checked and adopted into one continuous batch, else prefilled again
from the tiers), and a stage's /metrics."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import redis

from dsv41.runtime.engine import DecodeBatch, Engine
from dsv41.runtime.engine.images import (
    TurnImage,
    features_record,
    read_features_record,
    read_image_record,
)
from dsv41.runtime.engine.requests import RequestError
from dsv41.runtime.engine.sampling import SampledToken, TokenLogprob
from dsv41.runtime.serving.epd import (
    DECODE_GROUP,
    HANDOFF_KIND,
    PREFILL_GROUP,
    VISION_GROUP,
    EpdKeys,
    EpdRequest,
    Role,
    finish_of,
    parse_entry,
    reply_event,
)
from dsv41.runtime.serving.frontend import FinishReason
from dsv41.runtime.serving.metrics import RateWindow, ServerMetrics
from dsv41.runtime.tiers.wire import RecordError, RecordFault, decode_record, encode_record

log = logging.getLogger(__name__)


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
            req = parse_entry(fields)
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
            self.send(req.rid, reply_event(None, FinishReason.ERROR, error=str(e)))
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
            req = parse_entry(fields)
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
            self.send(req.rid, reply_event(None, FinishReason.ERROR, error=str(e)))
            return
        rec, first = turn.record, turn.sampled[-1]
        finish = finish_of(turn)
        with self._lock:  # counted before the events go (a reader may look at once)
            self.counters.requests += 1
            self.counters.tokens += len(req.prompt)
        self.counters.rate.add(len(req.prompt))
        try:  # the first token before the hand-off: the decode worker's tokens come after it
            self.send(req.rid, reply_event(first, finish, tier=rec.tier, reused=rec.reused_tokens))
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
                req = parse_entry(fields)
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
                finish = finish_of(t)
                self.send(self.rids[s.id], reply_event(t.sampled[-1], finish), pipe)
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
            self.send(rid, reply_event(None, FinishReason.ERROR, error=str(err)))
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
                self.send(rid, reply_event(None, FinishReason.ERROR, error=str(err2)))
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
