"""The EPD stages' workers (runtime/serving/epd.py says how a request flows): what every stage's
worker does (`StageWorker`: claims, leases, heartbeats, reclaim), the vision worker (the tower
once per image) and the decode worker (hand-offs checked and adopted into one continuous batch,
else prefilled again from the tiers), and a stage's /metrics. The prefill worker (prefill, first
token, the hand-off record) is runtime/serving/epd_prefill.py's."""

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
from dsv41.runtime.tiers.wire import RecordError, RecordFault, decode_record

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
    reclaimed: int = 0  # entries of a dead worker of this stage taken over (idle, XCLAIM)
    prefix_hits: int = 0  # prefill: hand-offs routed by prefix; decode: such ones it took
    # prefill: requests of a batch that waited for a batch-mate of a common prefix and started
    # from its blocks (the runtime prefix tier), and the prompt tokens those blocks held
    batch_prefix_reuses: int = 0
    batch_prefix_tokens: int = 0
    redirected: int = 0  # decode: entries read here but routed to another live worker
    rate: RateWindow = field(default_factory=lambda: RateWindow(10.0))  # tokens, last 10 s


class StageWorker:
    """What a worker of any stage does: claims and leases, heartbeats, queue reads, reclaim."""

    role: Role

    def __init__(self, engine: Engine, client, *, consumer: str | None = None,
                 reply_ttl_s: float = 600.0, handoff_ttl_s: float = 120.0,
                 image_ttl_s: float = 600.0, heartbeat_s: float = 1.0,
                 lease_ttl_s: float = 5.0, reclaim_idle_s: float = 3.0):
        """`heartbeat_s`: how often the running requests' leases are renewed (and their queue
        entries touched: their idle time starts again); `lease_ttl_s`: how long one outlives
        the worker's last heartbeat (the gateway's sign of a dead worker); `reclaim_idle_s`:
        an entry of this stage's group idle that long belongs to a dead worker and is taken
        over (XCLAIM) by a live one; below the lease's TTL plus the gateway's grace, so
        that the request changes hands before its gateway gives it up."""
        if not 0 < heartbeat_s < lease_ttl_s:
            raise ValueError(f"heartbeat_s must be above 0 and below lease_ttl_s, got "
                             f"{heartbeat_s!r} and {lease_ttl_s!r}.")
        if not heartbeat_s < reclaim_idle_s:
            raise ValueError(f"reclaim_idle_s must be above heartbeat_s, got "
                             f"{reclaim_idle_s!r} and {heartbeat_s!r}.")
        self.engine, self.r = engine, client
        self.image_ttl_ms = int(image_ttl_s * 1000)
        self.keys = EpdKeys(engine.key_salt.fingerprint())
        self.consumer = consumer or f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        self.reply_ttl_ms, self.handoff_ttl_ms = int(reply_ttl_s * 1000), int(handoff_ttl_s * 1000)
        self.heartbeat_s, self.lease_ttl_ms = heartbeat_s, int(lease_ttl_s * 1000)
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._next_reclaim = 0.0  # monotonic time of the next look for idle entries
        self.counters = StageCounters()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._held: set[str] = set()  # request ids whose lease this worker renews
        # request id -> its queue entry, pending (unacknowledged) while this worker runs it:
        # touched at each heartbeat, acknowledged when the request leaves this stage
        self._entries: dict[str, bytes] = {}
        self._reading: set[bytes] = set()  # entries read and not yet run or acknowledged
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

    def take(self, req: EpdRequest, *, reclaimed: bool = False) -> bool:
        """Claim this stage of the request's attempt and hold its lease; False (skip the
        entry) when it was claimed before (a redelivered entry) or the client left. A
        `reclaimed` entry (its worker died) takes the claim over."""
        claim = self.keys.claim(req.rid, req.attempt, self.role.value)
        if reclaimed:
            self.r.set(claim, self.consumer, px=self.reply_ttl_ms)
        elif not self.r.set(claim, self.consumer, nx=True, px=self.reply_ttl_ms):
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
        """Renew every held lease (written again: a restarted Redis lost them) and touch the
        entries this worker runs (XCLAIM to itself: their idle time starts again, so no live
        worker's entry is reclaimed)."""
        with self._held_lock:
            ids = list({*self._entries.values(), *self._reading})
            if not self._held and not ids:
                return
            pipe = self.r.pipeline(transaction=False)
            for rid in self._held:
                pipe.set(self.keys.lease(rid), self.consumer, px=self.lease_ttl_ms)
            if ids:
                stream, group = self.stage()
                pipe.xclaim(stream, group, self.consumer, 0, ids, justid=True)
            pipe.execute()

    def stage(self) -> tuple[str, str]:
        """This worker's stream and consumer group."""
        return {Role.VISION: (self.keys.vision, VISION_GROUP),
                Role.PREFILL: (self.keys.prefill, PREFILL_GROUP)}.get(
            self.role, (self.keys.decode, DECODE_GROUP))

    def reclaim(self, count: int) -> int:
        """Take over up to `count` entries of this stage that another (dead) worker left
        pending (`idle_entries`), and run them as new ones (the claim taken over); how many
        were taken."""
        stream, group = self.stage()
        entries = self.idle_entries(count)
        self._each(stream, group, entries, self.run, reclaimed=True)
        return len(entries)

    def idle_entries(self, count: int) -> list[tuple[bytes, dict]]:
        """Up to `count` entries of this stage that another (dead) worker left pending for
        `reclaim_idle_s` (looked for at most every half of that), now this worker's pending
        entries; the caller runs them (their claims taken over). XPENDING with its idle filter,
        then XCLAIM with the same minimum idle time (atomic: an entry another worker took in
        between is not taken): what XAUTOCLAIM does, without sweeping this worker's own idle
        entries (those routed here, which it reads as its own)."""
        now = time.monotonic()
        if count < 1 or now < self._next_reclaim:
            return []
        self._next_reclaim = now + self.reclaim_idle_ms / 2000
        stream, group = self.stage()
        try:
            pending = self.r.xpending_range(stream, group, min="-", max="+", count=64,
                                            idle=self.reclaim_idle_ms)
            ids = [p["message_id"] for p in pending
                   if _text(p["consumer"]) != self.consumer][:count]
            got = self.r.xclaim(stream, group, self.consumer, self.reclaim_idle_ms, ids) \
                if ids else []
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            return []  # the next read makes the group again
        entries = [(mid, fields) for mid, fields in got if fields]
        for mid, _ in entries:
            log.warning("%s took over entry %s of %s (its worker stopped)", self.consumer,
                        mid, stream)
        with self._lock:
            self.counters.reclaimed += len(entries)
        return entries

    def done(self, rid: str) -> None:
        """The request left this stage: its entry acknowledged and deleted."""
        with self._held_lock:
            mid = self._entries.pop(rid, None)
        if mid is not None:
            stream, group = self.stage()
            self.r.xack(stream, group, mid)
            self.r.xdel(stream, mid)

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
        stream, group = self.stage()
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

    def _each(self, stream: str, group: str, entries, run, *, reclaimed: bool = False) -> None:
        """`run(req)` for each entry that is a request this worker claims; one that fails is
        its request's error event (the others go on). An entry stays pending (touched by the
        heartbeats: reclaimed should this worker die) while `run` runs, and after it when
        `run` returns True (a decode row: until the row leaves, `done`); else it is
        acknowledged and deleted."""
        with self._held_lock:  # touched by the heartbeats until run or acknowledged
            self._reading.update(mid for mid, _ in entries)
        for mid, fields in entries:
            with self._held_lock:
                self._reading.discard(mid)
            if self.redirect(mid, fields, reclaimed=reclaimed):
                continue  # now another worker's
            req = parse_entry(fields)
            kept = False
            if req is not None:
                try:
                    if self.take(req, reclaimed=reclaimed):
                        with self._held_lock:
                            self._entries[req.rid] = mid
                        kept = bool(run(req))
                except Exception as e:
                    log.exception("request %s failed in its %s stage", req.rid, self.role.value)
                    self.fail(req, e)
                if not kept:
                    with self._held_lock:  # (a duplicate entry leaves the running one's)
                        if self._entries.get(req.rid) == mid:
                            del self._entries[req.rid]
            if not kept:
                self.r.xack(stream, group, mid)
                self.r.xdel(stream, mid)

    def redirect(self, mid: bytes, fields: dict, *, reclaimed: bool) -> bool:
        """Whether the entry was handed to another worker (decode: the one it was routed to)."""
        return False

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


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class VisionWorker(StageWorker):
    """One request at a time from the vision stream: each of its images through the tower
    (once per content), the rows stored for the prefill stage, the request passed on."""

    role = Role.VISION

    def step(self, block_ms: int | None = None) -> int:
        """Take and encode at most one request (a dead worker's first); how many entries were
        read."""
        if self.reclaim(1):
            return 1
        entries = self._read(self.keys.vision, VISION_GROUP, 1, block_ms)
        self._each(self.keys.vision, VISION_GROUP, entries, self._encode)
        return len(entries)

    def run(self, req: EpdRequest) -> None:
        self._encode(req)

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


@dataclass
class Row:
    """A decode row's request and the sequence number of its next event (the prefill
    worker's first token was 0)."""

    req: EpdRequest
    session: object  # its engine Session
    seq: int = 1


class DecodeWorker(StageWorker):
    """Hand-offs into one continuous decode batch; each step sends every row's token (through
    an outbox: a step's events wait there while Redis is unreachable, and the rows with them)."""

    role = Role.DECODE

    def __init__(self, engine: Engine, client, *, max_running: int = 16, **kw):
        super().__init__(engine, client, **kw)
        if not isinstance(max_running, int) or not 1 <= max_running <= 64:
            raise ValueError(f"max_running must be an integer from 1 to 64, got "
                             f"{max_running!r}.")
        self.max_running = max_running
        self.r.sadd(self.keys.decoders, self.consumer)  # known to the prefill workers' routing
        self.r.set(self.keys.decoder(self.consumer), 0, px=self.lease_ttl_ms)
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
        taken = self.reclaim(free)  # a dead decode worker's rows first
        free -= taken
        if free > 0:  # entries another worker routed here (XCLAIMed into this one's pending)
            mine = [(mid, f) for mid, f in self._read_pending(free + len(self._entries))
                    if mid not in self._entries.values()][:free]
            self._each(self.keys.decode, DECODE_GROUP, mine, self._join)
            taken += len(mine)
            free -= len(mine)
        if free > 0:
            entries = self._read(self.keys.decode, DECODE_GROUP, free,
                                 block_ms if not len(self.batch) and not taken else None)
            self._each(self.keys.decode, DECODE_GROUP, entries, self._join)
            taken += len(entries)
        self._reap()
        if len(self.batch):
            self._decode()
        return taken

    def _read_pending(self, count: int):
        """This worker's pending entries (its own history in the group: `0`)."""
        try:
            got = self.r.xreadgroup(DECODE_GROUP, self.consumer, {self.keys.decode: "0"},
                                    count=count)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            return []  # a restarted Redis: the next read makes the group again
        return [(mid, fields) for _, entries in (got or []) for mid, fields in entries
                if fields]

    def redirect(self, mid: bytes, fields: dict, *, reclaimed: bool) -> bool:
        """An entry routed to another live worker goes into that worker's pending entries
        (XCLAIM; it reads them); one routed to a worker not live, or taken over from a dead one
        (reclaimed), runs here. A prefix-routed entry that runs here is a prefix hit."""
        to = fields.get(b"to", fields.get("to"))
        to = to.decode() if isinstance(to, bytes) else to
        if to is None:
            self.r.hincrby(self.keys.load, self.consumer, 1)
            return False
        if to != self.consumer:
            if not reclaimed and self.r.exists(self.keys.decoder(to)):
                self.r.xclaim(self.keys.decode, DECODE_GROUP, to, 0, [mid], justid=True)
                with self._lock:
                    self.counters.redirected += 1
                return True
            pipe = self.r.pipeline(transaction=False)
            pipe.hincrby(self.keys.load, to, -1)
            pipe.hincrby(self.keys.load, self.consumer, 1)
            pipe.execute()
        elif fields.get(b"hit", fields.get("hit")) in (b"1", "1"):
            with self._lock:
                self.counters.prefix_hits += 1
        return False

    def heartbeat(self) -> None:
        """The leases and entries (`StageWorker.heartbeat`), and this worker's liveness for the
        prefill workers' routing."""
        super().heartbeat()
        self.r.set(self.keys.decoder(self.consumer), len(getattr(self, "rows", ())),
                   px=self.lease_ttl_ms)

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
                self.done(row.req.rid)
                self.r.hincrby(self.keys.load, self.consumer, -1)
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

    def run(self, req: EpdRequest) -> bool:
        return self._join(req)

    def _join(self, req: EpdRequest) -> bool:
        """Adopt the request's hand-off (else prefill it here: a missing hand-off, or an entry
        taken over from a dead worker, runs again from the prompt: its tokens from 1 are sent
        again and the gateway drops those it delivered, checking they match) into a row; True
        when it joined the batch (its entry stays pending until the row leaves)."""
        e, rid = self.engine, req.rid
        turn_req = req.turn(self.vocab_size, self.max_seq_len)
        value = self.r.getdel(self.keys.handoff(rid))
        s = turn = None
        try:
            images = self.turn_images(req)  # the tiers' keys name them by content
        except RequestError as err:
            self.fail(req, err, seq=1)
            return False
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
                return False
        if turn.done:  # cannot happen after a hand-off (the prefill worker ends those)
            s.finish(turn)
            s.close()
            self.release(rid)
            return False
        self.batch.join(s, turn)
        self.rows[s.id] = Row(req, s)
        return True

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
            self.done(row.req.rid)
            self.r.hincrby(self.keys.load, self.consumer, -1)

    def stop(self) -> None:
        super().stop()
        self.batch.close()
        try:  # no more routed here (a killed worker's key lapses with its lease)
            self.r.delete(self.keys.decoder(self.consumer))
        except Exception as e:
            log.warning("%s could not leave the routing: %s", self.consumer, e)


class EpdServerMetrics(ServerMetrics):
    """The server's metrics (the gateway's requests) and the worker's stage: its queue (the
    stage's stream entries not yet taken or acknowledged), running rows, throughput; each stage
    series labelled `role`, read at scrape time (`StageCollector`)."""

    def __init__(self, worker: StageWorker, model_name: str,
                 **kw):
        super().__init__(model_name, **kw)
        self.worker = worker
        self.registry.register(StageCollector(worker, model_name))


class StageCollector:
    """A worker's stage counts as prometheus_client families (EpdServerMetrics')."""

    def __init__(self, worker: StageWorker, model_name: str):
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
            ("dsv41:epd_entries_reclaimed", CounterMetricFamily, "Queue entries of a dead "
             "worker of this stage this worker took over (idle reclaim_idle_s, XCLAIM).",
             n.reclaimed),
            ("dsv41:epd_prefix_hits", CounterMetricFamily, "Hand-offs routed by prefix "
             "locality (prefill: routed to the worker holding the longest run of the prompt's "
             "leading blocks; decode: such hand-offs this worker took).", n.prefix_hits),
            ("dsv41:epd_batch_prefix_reuses", CounterMetricFamily, "Prefill: requests of a "
             "batch that waited for a batch-mate of a common prefix and started from its blocks "
             "(the runtime prefix tier).", n.batch_prefix_reuses),
            ("dsv41:epd_batch_prefix_tokens", CounterMetricFamily, "Prefill: prompt tokens "
             "those requests took from their batch-mates' blocks.", n.batch_prefix_tokens),
            ("dsv41:epd_redirected", CounterMetricFamily, "Entries this worker read that were "
             "routed to another live worker, moved to that worker's pending list.",
             n.redirected),
        ]
        for name, kind, help_text, value in rows:
            family = kind(name, help_text, labels=["model_name", "role"])
            family.add_metric([self.model_name, role], value)
            yield family
