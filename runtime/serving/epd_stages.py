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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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
    QUEUED,
    VISION_GROUP,
    EpdKeys,
    EpdRequest,
    Role,
    ensure_group,
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
    duplicates: int = 0  # entries skipped: this stage of that request attempt was claimed
    regrouped: int = 0  # consumer groups made again (a restarted Redis had lost them)
    rate: RateWindow = field(default_factory=lambda: RateWindow(10.0))  # tokens, last 10 s


class _Worker:
    role: Role

    def __init__(self, engine: Engine, client, *, consumer: str | None = None,
                 reply_ttl_s: float = 600.0, handoff_ttl_s: float = 120.0,
                 image_ttl_s: float = 600.0, heartbeat_s: float = 1.0,
                 lease_ttl_s: float = 5.0):
        """`heartbeat_s`: how often the running requests' leases are renewed; `lease_ttl_s`:
        how long one outlives the worker's last heartbeat (the gateway's sign of a dead
        worker)."""
        if not 0 < heartbeat_s < lease_ttl_s:
            raise ValueError(f"heartbeat_s must be above 0 and below lease_ttl_s, got "
                             f"{heartbeat_s!r} and {lease_ttl_s!r}.")
        self.engine, self.r = engine, client
        self.image_ttl_ms = int(image_ttl_s * 1000)
        self.keys = EpdKeys(engine.key_salt.fingerprint())
        self.consumer = consumer or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        self.reply_ttl_ms, self.handoff_ttl_ms = int(reply_ttl_s * 1000), int(handoff_ttl_s * 1000)
        self.heartbeat_s, self.lease_ttl_ms = heartbeat_s, int(lease_ttl_s * 1000)
        self.counters = StageCounters()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()  # request ids whose lease this worker renews
        self._held_lock = threading.Lock()  # the lease writes and `_held` change together
        a = engine.model.args
        self.vocab_size, self.max_seq_len = a.vocab_size, a.max_seq_len
        for stream, group in ((self.keys.vision, VISION_GROUP), (self.keys.prefill, PREFILL_GROUP),
                              (self.keys.decode, DECODE_GROUP)):
            ensure_group(self.r, stream, group)
        # the leases live as long as this worker (stepped by `start` or by hand) until `stop`
        self._beat = threading.Thread(target=self._heartbeats, daemon=True,
                                      name=f"dsv41-{self.role.value}-heartbeat")
        self._beat.start()

    # ---- claims and leases ----------------------------------------------------------------------

    def take(self, req: EpdRequest) -> bool:
        """Claim this stage of the request's attempt and hold its lease; False (skip the
        entry) when it was claimed before (a redelivered entry) or the client left."""
        claim = self.keys.claim(req.rid, req.attempt, self.role.value)
        if not self.r.set(claim, self.consumer, nx=True, px=self.reply_ttl_ms):
            log.warning("skipped a %s entry of request %s (attempt %d) delivered again",
                        self.role.value, req.rid, req.attempt)
            with self._lock:
                self.counters.duplicates += 1
            return False
        if self.r.exists(self.keys.cancel(req.rid)):
            return False  # the client left while it waited
        with self._held_lock:
            self._held.add(req.rid)
            self.r.set(self.keys.lease(req.rid), self.consumer, px=self.lease_ttl_ms)
        return True

    def pass_on(self, rid: str, stage: Role, pipe) -> None:
        """Queue the request's lease for `stage` in `pipe` (with the entry that queues it)."""
        pipe.set(self.keys.lease(rid), f"{QUEUED}{stage.value}", px=self.reply_ttl_ms)

    def release(self, rid: str, pipe=None) -> None:
        """Let the request go: its lease is no longer renewed (`pipe` runs under the lock:
        a heartbeat never writes this worker's name over the lease `pipe` passes on)."""
        with self._held_lock:
            self._held.discard(rid)
            if pipe is not None:
                pipe.execute()

    def heartbeat(self) -> None:
        """Renew every held lease (written again: a restarted Redis lost them)."""
        with self._held_lock:
            if not self._held:
                return
            pipe = self.r.pipeline(transaction=False)
            for rid in self._held:
                pipe.set(self.keys.lease(rid), self.consumer, px=self.lease_ttl_ms)
            pipe.execute()

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as e:  # the server is unreachable: the next beat tries again
                log.warning("%s heartbeat failed: %s", self.consumer, e)

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
        """The loop and the heartbeats end (requests still held here are not renewed: the
        gateways see them lost, as with a worker that died)."""
        self._stop.set()
        for t in (self._thread, self._beat):
            if t is not None:
                t.join(timeout=60)

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
        """Up to `count` new entries; the group made again when Redis lost it (NOGROUP)."""
        try:
            got = self.r.xreadgroup(group, self.consumer, {stream: ">"}, count=count,
                                    block=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            log.warning("the %s group of %s was gone (Redis restarted?); made it again",
                        group, stream)
            ensure_group(self.r, stream, group)
            with self._lock:
                self.counters.regrouped += 1
            got = self.r.xreadgroup(group, self.consumer, {stream: ">"}, count=count,
                                    block=block_ms)
        return [(mid, fields) for _, entries in (got or []) for mid, fields in entries]

    def _each(self, stream: str, group: str, entries, run) -> None:
        """`run(req)` for each entry that is a request this worker claims; one that fails is
        its request's error event (the others go on); each entry acknowledged and deleted."""
        for mid, fields in entries:
            req = parse_entry(fields)
            if req is not None:
                try:
                    if self.take(req):
                        run(req)
                except Exception as e:
                    log.exception("request %s failed in its %s stage", req.rid, self.role.value)
                    self.fail(req, e)
            self.r.xack(stream, group, mid)
            self.r.xdel(stream, mid)

    def fail(self, req: EpdRequest, err: Exception | str, seq: int = 0) -> None:
        """The request's error event (best effort: Redis may be the failure); its lease let
        go."""
        with self._lock:
            self.counters.errors += 1
        self.release(req.rid)
        try:
            self.send(req.rid, reply_event(None, FinishReason.ERROR, seq=seq,
                                           attempt=req.attempt, error=str(err)))
        except Exception as e2:
            log.warning("could not send request %s its error: %s", req.rid, e2)


class VisionWorker(_Worker):
    """One request at a time from the vision stream: each of its images through the tower
    (once per content), the rows stored for the prefill stage, the request passed on."""

    role = Role.VISION

    def step(self, block_ms: int | None = None) -> int:
        """Take and encode at most one request; how many entries were read."""
        entries = self._read(self.keys.vision, VISION_GROUP, 1, block_ms)
        self._each(self.keys.vision, VISION_GROUP, entries, self._encode)
        return len(entries)

    def _encode(self, req: EpdRequest) -> None:
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
            self.fail(req, e)
            return
        pipe = self.r.pipeline(transaction=False)
        self.pass_on(req.rid, Role.PREFILL, pipe)
        pipe.xadd(self.keys.prefill, {"req": req.to_json()})
        self.release(req.rid, pipe)
        with self._lock:
            self.counters.requests += 1
            self.counters.tokens += encoded
        self.counters.rate.add(encoded)


class PrefillWorker(_Worker):
    """One request at a time from the prefill stream: prefill, first token, hand-off."""

    role = Role.PREFILL

    def step(self, block_ms: int | None = None) -> int:
        """Take and prefill at most one request; how many entries were read."""
        entries = self._read(self.keys.prefill, PREFILL_GROUP, 1, block_ms)
        self._each(self.keys.prefill, PREFILL_GROUP, entries, self._prefill)
        return len(entries)

    def _prefill(self, req: EpdRequest) -> None:
        s = self.engine.session()
        try:
            turn = s.begin(req.turn(self.vocab_size, self.max_seq_len),
                           images=self.turn_images(req))
        except Exception as e:
            s.close()
            log.warning("request %s failed in its prefill: %s", req.rid, e)
            self.fail(req, e)
            return
        rec, first = turn.record, turn.sampled[-1]
        finish = finish_of(turn)
        with self._lock:  # counted before the events go (a reader may look at once)
            self.counters.requests += 1
            self.counters.tokens += len(req.prompt)
        self.counters.rate.add(len(req.prompt))
        try:  # the first token before the hand-off: the decode worker's tokens come after it
            self.send(req.rid, reply_event(first, finish, seq=0, attempt=req.attempt,
                                           tier=rec.tier, reused=rec.reused_tokens))
            if finish is None:
                self._hand_off(req, s, turn)
            else:
                self.release(req.rid)
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
        self.pass_on(req.rid, Role.DECODE, pipe)
        pipe.xadd(self.keys.decode, {"rid": req.rid, "req": req.to_json()})
        self.release(req.rid, pipe)


@dataclass
class Row:
    """A decode row's request and the sequence number of its next event (the prefill
    worker's first token was 0)."""

    req: EpdRequest
    session: object  # its engine Session
    seq: int = 1


class DecodeWorker(_Worker):
    """Hand-offs into one continuous decode batch; each step sends every row's token (through
    an outbox: a step's events wait there while Redis is unreachable, and the rows with them)."""

    role = Role.DECODE

    def __init__(self, engine: Engine, client, *, max_running: int = 16, **kw):
        super().__init__(engine, client, **kw)
        if not isinstance(max_running, int) or not 1 <= max_running <= 64:
            raise ValueError(f"max_running must be an integer from 1 to 64, got "
                             f"{max_running!r}.")
        self.max_running = max_running
        self.batch = DecodeBatch(engine, max_rows=max_running)
        self.rows: dict[int, Row] = {}  # session id -> its request and next event's number
        self.outbox: list[tuple[str, dict]] = []  # (request id, event) not yet sent, in order

    def running(self) -> int:
        return len(self.batch)

    def step(self, block_ms: int | None = None) -> int:
        """Send what the outbox holds (raising while Redis is unreachable: the rows wait),
        take hand-offs into free rows (blocking only when idle), drop cancelled rows, then
        one decode step; how many entries were read."""
        self.flush()
        free = self.max_running - len(self.batch)
        taken = 0
        if free > 0:
            entries = self._read(self.keys.decode, DECODE_GROUP, free,
                                 block_ms if not len(self.batch) else None)
            self._each(self.keys.decode, DECODE_GROUP, entries, self._join)
            taken = len(entries)
        self._reap()
        if len(self.batch):
            self._decode()
        return taken

    def flush(self) -> None:
        """The outbox to the reply streams (in order; a resend after a failure may repeat an
        event: the gateway drops a sequence number it has seen)."""
        if not self.outbox:
            return
        pipe = self.r.pipeline(transaction=False)
        for rid, fields in self.outbox:
            self.send(rid, fields, pipe)
        pipe.execute()
        self.outbox.clear()

    def _decode(self) -> None:
        try:
            members = self.batch.step()
        except Exception as err:  # the rows are in no known state: each request fails
            log.exception("decode step failed")
            self.batch.drop()
            self.batch = DecodeBatch(self.engine, max_rows=self.max_running)
            for row in list(self.rows.values()):
                self.outbox.append((row.req.rid, self._event(row, None, FinishReason.ERROR,
                                                             f"The decode step failed: {err}")))
                self.release(row.req.rid)
                row.session.close()
            self.rows.clear()
            with self._lock:
                self.counters.errors += 1
            self.flush()
            return
        done = []
        for s, t in members:
            finish = finish_of(t)
            self.outbox.append((self.rows[s.id].req.rid,
                                self._event(self.rows[s.id], t.sampled[-1], finish)))
            if finish is not None:
                done.append(s)
        with self._lock:  # counted before the events go (a reader may look at once)
            self.counters.tokens += len(members)
            self.counters.requests += len(done)
        self.counters.rate.add(len(members))
        for s in done:
            self._leave(s)
        self.flush()

    @staticmethod
    def _event(row: Row, token: SampledToken | None, finish: FinishReason | None,
               error: str | None = None) -> dict:
        e = reply_event(token, finish, seq=row.seq, attempt=row.req.attempt, error=error)
        row.seq += 1
        return e

    def _join(self, req: EpdRequest) -> None:
        e, rid = self.engine, req.rid
        turn_req = req.turn(self.vocab_size, self.max_seq_len)
        value = self.r.getdel(self.keys.handoff(rid))
        s = turn = None
        try:
            images = self.turn_images(req)  # the tiers' keys name them by content
        except RequestError as err:
            self.fail(req, err, seq=1)
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
                self.fail(req, err2, seq=1)
                return
        if turn.done:  # cannot happen after a hand-off (the prefill worker ends those)
            s.finish(turn)
            s.close()
            self.release(rid)
            return
        self.batch.join(s, turn)
        self.rows[s.id] = Row(req, s)

    def _reap(self) -> None:
        """Rows whose request was cancelled (client gone, stop string at the gateway) leave."""
        if not len(self.batch):
            return
        members = [s for s, _ in self.batch.members]
        flags = self.r.mget([self.keys.cancel(self.rows[s.id].req.rid) for s in members])
        for s, flag in zip(members, flags, strict=True):
            if flag is not None:
                self._leave(s)

    def _leave(self, s) -> None:
        self.batch.leave(s)  # the turn is stored in the tiers
        s.close()
        row = self.rows.pop(s.id, None)
        if row is not None:
            self.release(row.req.rid)

    def stop(self) -> None:
        super().stop()
        self.batch.close()


class EpdServerMetrics(ServerMetrics):
    """The server's metrics (the gateway's requests) and the worker's stage: its queue (the
    stage's stream entries not yet taken or acknowledged), running rows, throughput; each stage
    series labelled `role`, read at scrape time (`StageCollector`)."""

    def __init__(self, worker: VisionWorker | PrefillWorker | DecodeWorker, model_name: str,
                 **kw):
        super().__init__(model_name, **kw)
        self.worker = worker
        self.registry.register(StageCollector(worker, model_name))


class StageCollector:
    """A worker's stage counts as prometheus_client families (EpdServerMetrics')."""

    def __init__(self, worker: VisionWorker | PrefillWorker | DecodeWorker, model_name: str):
        self.worker, self.model_name = worker, model_name

    def describe(self) -> list:
        return []

    def collect(self):
        w, role = self.worker, self.worker.role.value
        with w._lock:
            n = replace(w.counters)
        rows = [
            ("dsv41:epd_queue_length", GaugeMetricFamily, "Entries of this stage's stream "
             "waiting for its workers (group lag + pending; -1: Redis unreachable).",
             w.queue_length()),
            ("dsv41:epd_running_sequences", GaugeMetricFamily, "Sequences this worker runs now "
             "(decode: rows of its batch).", w.running() if isinstance(w, DecodeWorker) else 0),
            ("dsv41:epd_stage_tokens_per_second", GaugeMetricFamily, "Tokens this worker "
             "processed per second over the last 10 s (vision: patches; prefill: prompt "
             "tokens; decode: decoded tokens).", round(n.rate.rate(), 6)),
            ("dsv41:epd_stage_requests", CounterMetricFamily, "Requests this worker finished "
             "its stage of.", n.requests),
            ("dsv41:epd_stage_tokens", CounterMetricFamily, "Tokens this worker processed "
             "(vision: patches; prefill: prompt tokens; decode: decoded tokens).", n.tokens),
            ("dsv41:epd_stage_errors", CounterMetricFamily, "Requests this worker failed.",
             n.errors),
            ("dsv41:epd_handoffs_rejected", CounterMetricFamily, "Hand-offs missing or failing "
             "a check (fingerprint, checksum, layout), prefilled again here.",
             n.handoffs_rejected),
            ("dsv41:epd_duplicates_skipped", CounterMetricFamily, "Queue entries skipped: their "
             "request's stage was claimed already (an entry delivered twice).", n.duplicates),
            ("dsv41:epd_groups_recreated", CounterMetricFamily, "Consumer groups this worker "
             "made again after Redis lost them (a restart without persistence).", n.regrouped),
        ]
        for name, kind, help_text, value in rows:
            family = kind(name, help_text, labels=["model_name", "role"])
            family.add_metric([self.model_name, role], value)
            yield family
