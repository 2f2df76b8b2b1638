"""A prefill worker's batch (issue 42): up to `prefill_requests` requests read together and
prefilled chunk-interleaved, so that a short request does not wait behind a long one.

Chunk-interleaved, not batched: a prefill phase takes `(b, s)` tokens whose sequences advance
alike (`graph.phases.prefill_exact` chunks every row at once), so prompts of different lengths
cannot share a call, and the batcher too admits each prefill as a sequence of its own. What the
engine does have is a prefill in chunks of `prefill_chunk_tokens` with a pause between two
(`PrefillPacing.between_chunks`: the batcher runs its decode step there). Here the pause hands
the turn to the next request's prefill: each request runs on a thread of its own, exactly one
holds the turn at a time (the engine is never entered twice at once), and the turn goes round in
order, one chunk each (`ChunkRounds`). A request whose prefill ends sends its first token and
its hand-off before it lets the turn go, so each goes out as soon as its own prefill ends.

Within a batch, a request sharing leading blocks with an earlier one waits for that one's
prefill to end (`prefix_waits`) when the engine's runtime prefix tier is on: it then starts from
that request's blocks (kept by `TurnPlanner.keep_prompt_blocks` at the end of every prefill)
instead of prefilling the shared prefix a second time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from dsv41.graph.phases import Pause
from dsv41.runtime.engine import CacheFullError, Engine, PrefillPacing
from dsv41.runtime.engine.records import Tier
from dsv41.runtime.engine.requests import TurnRequest
from dsv41.runtime.serving.epd import (
    HANDOFF_KIND,
    PREFILL_GROUP,
    EpdRequest,
    Role,
    Route,
    choose_decoder,
    finish_of,
    parse_entry,
    reply_event,
)
from dsv41.runtime.serving.epd_stages import StageWorker
from dsv41.runtime.tiers.wire import encode_record

log = logging.getLogger(__name__)

MAX_PREFILL_REQUESTS = 64  # the most requests a prefill worker reads at once


def check_prefill_requests(n: object) -> int:
    """`prefill_requests` (the requests a prefill worker reads and interleaves at once) as an
    int; ValueError when it is not one from 1 to MAX_PREFILL_REQUESTS."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PREFILL_REQUESTS:
        raise ValueError(f"prefill_requests must be an integer from 1 to "
                         f"{MAX_PREFILL_REQUESTS}, got {n!r}.")
    return n


def prefix_waits(block_keys: Sequence[Sequence[str]]) -> list[int | None]:
    """For each request of a batch (its prompt's chained block keys, in reading order), the
    earlier request it waits for: the one sharing the longest run of its leading blocks (at a
    tie the earliest, the first to start); None when no earlier one shares its first block.
    Chained keys: a common first key means a common first block, and so on."""
    waits: list[int | None] = []
    for i, keys in enumerate(block_keys):
        best, best_run = None, 0
        for j in range(i):
            run = 0
            for a, b in zip(keys, block_keys[j], strict=False):
                if a != b:
                    break
                run += 1
            if run > best_run:
                best, best_run = j, run
        waits.append(best)
    return waits


class ChunkRounds:
    """Jobs played one chunk at a time in turn. A job is `job(pause)`: a prefill that calls
    `pause()` between two of its chunks (`PrefillPacing.between_chunks`). Exactly one job holds
    the turn at a time; `pause` passes it to the next ready job, in the order they became
    ready (round robin), and waits for it to come back; a job that returns passes it on for
    good and makes ready the jobs that wait for it (`waits[i]`: the earlier job that job i
    starts after, or None). A job handles its own errors: one that escapes (a BaseException)
    ends only that job; `run` raises the first such once every job has ended."""

    def __init__(self, jobs: Sequence[Callable[[Pause], None]],
                 waits: Sequence[int | None] | None = None):
        waits = [None] * len(jobs) if waits is None else list(waits)
        if len(waits) != len(jobs):
            raise ValueError(f"ChunkRounds needs one wait per job, got {len(waits)} for "
                             f"{len(jobs)} jobs.")
        for i, w in enumerate(waits):
            if w is not None and not 0 <= w < i:
                raise ValueError(f"Job {i} may only wait for an earlier job, got {w!r}.")
        self.jobs, self.waits = list(jobs), waits
        self.turns: list[int] = []  # the job given the turn, each time it changes hands
        self._cond = threading.Condition()
        self._ready = deque(i for i, w in enumerate(waits) if w is None)
        self._turn: int | None = None
        self._escaped: list[BaseException] = []

    def run(self) -> None:
        """Every job to its end (a single job runs on this thread, as it would alone)."""
        if not self.jobs:
            return
        if len(self.jobs) == 1:
            self.turns.append(0)
            self.jobs[0](lambda: None)
            return
        with self._cond:
            self._pass()
        threads = [threading.Thread(target=self._play, args=(i,), daemon=True,
                                    name=f"dsv41-prefill-job-{i}") for i in range(len(self.jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._escaped:
            raise self._escaped[0]

    def _play(self, i: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == i)
        try:
            self.jobs[i](lambda: self._pause(i))
        except BaseException as e:  # noqa: BLE001 (the job's own errors are its own: this ends it)
            log.error("prefill job %d ended with %r", i, e)
            self._escaped.append(e)
        finally:
            with self._cond:
                self._ready.extend(j for j, w in enumerate(self.waits) if w == i)
                self._pass()

    def _pause(self, i: int) -> None:
        with self._cond:
            self._ready.append(i)
            self._pass()
            self._cond.wait_for(lambda: self._turn == i)

    def _pass(self) -> None:
        """The turn to the next ready job (None: every job has ended)."""
        self._turn = self._ready.popleft() if self._ready else None
        if self._turn is not None:
            self.turns.append(self._turn)
        self._cond.notify_all()


class PrefillWorker(StageWorker):
    """Up to `prefill_requests` requests at a time from the prefill stream, prefilled
    chunk-interleaved (runtime/serving/epd_prefill.py); each one's first token and hand-off
    go out as soon as its own prefill ends, and its entry is acknowledged after that."""

    role = Role.PREFILL

    def __init__(self, engine: Engine, client, *, prefill_requests: int = 4, **kw):
        check_prefill_requests(prefill_requests)
        super().__init__(engine, client, **kw)
        self.prefill_requests = prefill_requests
        self.last_rounds: ChunkRounds | None = None  # the last batch's turns (for the tests)

    def step(self, block_ms: int | None = None) -> int:
        """Take up to `prefill_requests` requests (a dead worker's first) and prefill them
        together; how many entries were read."""
        n = self.prefill_requests
        stale = self.idle_entries(n)
        fresh = self._read(self.keys.prefill, PREFILL_GROUP, n - len(stale),
                           None if stale else block_ms) if len(stale) < n else []
        self._prefill_batch([(mid, f, True) for mid, f in stale]
                            + [(mid, f, False) for mid, f in fresh])
        return len(stale) + len(fresh)

    def run(self, req: EpdRequest) -> None:
        """A request claimed already (`_each`), prefilled alone."""
        self._prefill(req, req.turn(self.vocab_size, self.max_seq_len), lambda: None, False)

    def _prefill_batch(self, entries: list[tuple[bytes, dict, bool]]) -> None:
        """Claim each entry's request (`take`: a duplicate or a cancelled one is acknowledged
        at once, as is one whose prompt does not fit: its error event sent), then prefill the
        claimed ones chunk-interleaved; each entry stays pending (touched by the heartbeats:
        reclaimed should this worker die) until its request's hand-off or error went out."""
        with self._held_lock:
            self._reading.update(mid for mid, _, _ in entries)
        jobs: list[tuple[EpdRequest, TurnRequest]] = []
        for mid, fields, reclaimed in entries:
            with self._held_lock:
                self._reading.discard(mid)
            req = parse_entry(fields)
            turn_req = None
            if req is not None:
                try:
                    if self.take(req, reclaimed=reclaimed):
                        with self._held_lock:
                            self._entries[req.rid] = mid
                        turn_req = req.turn(self.vocab_size, self.max_seq_len)
                except Exception as e:
                    log.warning("request %s failed in its prefill: %s", req.rid, e)
                    self.fail(req, e)
            if turn_req is not None:
                jobs.append((req, turn_req))
                continue
            if req is not None:
                with self._held_lock:  # (a duplicate entry leaves the running one's)
                    if self._entries.get(req.rid) == mid:
                        del self._entries[req.rid]
            self.r.xack(self.keys.prefill, PREFILL_GROUP, mid)
            self.r.xdel(self.keys.prefill, mid)
        waits = prefix_waits([self.engine.block_keys(req.prompt) for req, _ in jobs]) \
            if self.engine.options.runtime_prefix else None
        self.last_rounds = ChunkRounds(
            [partial(self._prefill_one, req, turn_req, waits is not None and w is not None)
             for (req, turn_req), w in zip(jobs, waits or [None] * len(jobs), strict=True)],
            waits)
        self.last_rounds.run()

    def _prefill_one(self, req: EpdRequest, turn_req: TurnRequest, after_mate: bool,
                     pause) -> None:
        """One request of a batch (a `ChunkRounds` job): prefill, first token, hand-off; an
        error fails this request alone. Its entry acknowledged after either."""
        try:
            self._prefill(req, turn_req, pause, after_mate)
        except Exception as e:
            log.exception("request %s failed in its prefill stage", req.rid)
            self.fail(req, e)
        self.done(req.rid)

    def _prefill(self, req: EpdRequest, turn_req: TurnRequest, pause, after_mate: bool) -> None:
        """Prefill, first token, hand-off. A request the runtime cache cannot hold while
        batch-mates hold theirs waits for them (`pause`, then again): it fails only when it
        does not fit alone, as it would one at a time."""
        while True:
            s = self.engine.session()
            try:
                turn = s.begin(turn_req, pacing=PrefillPacing(between_chunks=pause),
                               images=self.turn_images(req))
                break
            except CacheFullError as e:
                s.close()
                if any(x.cache is not None for x in self.engine.sessions.values()):
                    pause()  # a batch-mate holds a cache: it ends (and lets it go) first
                    continue
                log.warning("request %s failed in its prefill: %s", req.rid, e)
                self.fail(req, e)
                return
            except Exception as e:
                s.close()
                log.warning("request %s failed in its prefill: %s", req.rid, e)
                self.fail(req, e)
                return
        self._first_token(req, s, turn, after_mate)

    def _first_token(self, req: EpdRequest, s, turn, after_mate: bool) -> None:
        rec, first = turn.record, turn.sampled[-1]
        finish = finish_of(turn)
        with self._lock:  # counted before the events go (a reader may look at once)
            self.counters.requests += 1
            self.counters.tokens += len(req.prompt)
            if after_mate and rec.tier is Tier.RUNTIME_PREFIX:
                self.counters.batch_prefix_reuses += 1
                self.counters.batch_prefix_tokens += rec.reused_tokens
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
        blocks = self.engine.block_keys(req.prompt)
        route = self.route(blocks)
        fields = {"rid": req.rid, "req": req.to_json()}
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.keys.handoff(req.rid), value, px=self.handoff_ttl_ms)
        if route.consumer is not None:
            fields["to"], fields["hit"] = route.consumer, int(route.prefix_hit)
            pipe.hincrby(self.keys.load, route.consumer, 1)
            for k in blocks:  # this prompt's blocks now point at that worker
                pipe.set(self.keys.locality(k), route.consumer, px=self.reply_ttl_ms)
        self.pass_on(req.rid, Role.DECODE, pipe)
        pipe.xadd(self.keys.decode, fields)
        self.release(req.rid, pipe)
        if route.prefix_hit:
            with self._lock:
                self.counters.prefix_hits += 1

    def route(self, blocks: list[str]) -> Route:
        """The decode worker for a prompt of these block keys (`epd.choose_decoder`): the live
        ones (a heartbeat within their lease), their loads, the blocks' last workers."""
        names = sorted(n.decode() for n in self.r.smembers(self.keys.decoders))
        if not names:
            return Route(None)
        beats = self.r.mget([self.keys.decoder(n) for n in names])
        live = [n for n, b in zip(names, beats, strict=True) if b is not None]
        loads = dict(zip(live, (int(x or 0) for x in self.r.hmget(self.keys.load, live)),
                         strict=True)) if live else {}
        holders = [None if h is None else h.decode()
                   for h in self.r.mget([self.keys.locality(k) for k in blocks])] \
            if blocks else []
        return choose_decoder(loads, holders)
