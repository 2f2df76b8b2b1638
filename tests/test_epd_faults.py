"""EPD under faults (issue 38): a Redis restart, an entry or event delivered twice, a malformed
event, a worker that dies mid-generation. Each request ends complete with its exact tokens,
once, or with an error that says why, within a bounded time: never twice, never a hang.

The workers run in this process over a real redis-server (tests/test_epd.py's deployment);
the leases' timings are short so that a lost request is seen within a second. The last test
runs scripts/faults/epd_chaos.py (processes, all four faults at once) in a small form.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.epd import EpdKeys
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.epd_prefill import PrefillWorker
from dsv41.runtime.serving.epd_stages import DecodeWorker
from dsv41.runtime.serving.frontend import FinishReason

PAGE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPTS = [[int(x) for x in np.random.default_rng(300 + i).integers(3, 500, n)]
           for i, n in enumerate((5, 12, 19, 9))]

WORKER = {"heartbeat_s": 0.1, "lease_ttl_s": 0.5}  # a lease outlives a dead worker by 0.5 s
GATEWAY = {"lease_check_s": 0.1, "lease_grace_s": 0.4}
FP = bytes(32)  # a gateway without workers: the tests write its reply events by hand


def _engine(model, store, **kw) -> Engine:
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, store_dir=store,
                             **kw)


@pytest.fixture(scope="module")
def reference(small_model, tmp_path_factory):
    """The single-process batcher's greedy tokens: PROMPTS[:3] with GREEDY, PROMPTS[3] with
    40 tokens."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with _engine(small_model, tmp_path_factory.mktemp("ref") / "s") as e:
        b = Batcher(e, max_running=4)
        streams = [b.submit(p, GREEDY if i < 3 else long) for i, p in enumerate(PROMPTS)]
        while b.step():
            pass
        out = [[ev.token_id for ev in s if ev.token_id is not None] for s in streams]
        b.stop()
    return out


def _outcome(stream, within_s: float = 60.0) -> tuple[list[int], FinishReason, str | None]:
    """The stream's tokens, finish and error; fails (rather than hangs) past `within_s`."""
    tokens, deadline = [], time.monotonic() + within_s
    while True:
        ev = stream.get(timeout=max(0.0, deadline - time.monotonic()))
        assert ev is not None, f"the request did not end within {within_s:g} s (tokens {tokens})"
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        if ev.finish is not None:
            return tokens, ev.finish, ev.error


class _Deployment:
    """1 prefill + 1 decode worker and a gateway, in this process (short lease timings)."""

    def __init__(self, model, root: Path, url: str, *, max_attempts: int = 2):
        self.client = redis.Redis.from_url(url)
        self.engines = [_engine(model, root / f"e{i}", redis_url=url) for i in range(2)]
        self.prefill = PrefillWorker(self.engines[0], self.client, **WORKER)
        self.decode = DecodeWorker(self.engines[1], self.client, max_running=4, **WORKER)
        a = model.args
        self.keys = EpdKeys(self.engines[0].key_salt.fingerprint())
        self.gateway = EpdGateway(self.client, self.keys.fingerprint, vocab_size=a.vocab_size,
                                  max_seq_len=a.max_seq_len, max_attempts=max_attempts,
                                  **GATEWAY)

    def start(self) -> None:
        for w in (self.prefill, self.decode):
            w.start()

    def close(self) -> None:
        for w in (self.prefill, self.decode):
            w.stop()
        self.gateway.close()
        for e in self.engines:
            e.close()


# ---- 1. a Redis restart (no persistence) deletes the consumer groups ---------------------------

@pytest.mark.parametrize("max_attempts", [1, 2])
def test_after_a_redis_restart_new_requests_complete_and_lost_ones_end_or_run_again(
        small_model, tmp_path, redis_server, reference, max_attempts):
    """The workers make their groups again (NOGROUP); a request that waited in the prefill
    queue when Redis lost it is queued again (its next attempt), or with one attempt only ends
    with an error that says where it was lost."""
    d = _Deployment(small_model, tmp_path, redis_server.url, max_attempts=max_attempts)
    try:
        queued = d.gateway.submit(PROMPTS[0], GREEDY)  # no worker runs yet: it waits
        redis_server.restart()  # empty: the streams, their groups and the leases are gone
        d.start()
        fresh = d.gateway.submit(PROMPTS[1], GREEDY)
        assert _outcome(fresh) == (reference[1], FinishReason.LENGTH, None)
        if max_attempts == 1:
            assert _outcome(queued) == ([], FinishReason.UNAVAILABLE, (
                "The request was lost: the queue server restarted and lost what it held of it "
                "(it was last seen in the prefill queue); send it again."))
        else:
            assert _outcome(queued) == (reference[0], FinishReason.LENGTH, None)
        assert d.prefill.counters.regrouped + d.decode.counters.regrouped >= 1
    finally:
        d.close()


# ---- 2. an entry or an event delivered twice ----------------------------------------------------

@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_an_entry_delivered_twice_gives_each_token_once(small_model, tmp_path, redis_server,
                                                        reference, stage):
    d = _Deployment(small_model, tmp_path, redis_server.url)
    try:
        stream = d.gateway.submit(PROMPTS[2], GREEDY)
        if stage == "prefill":  # the entry again, as a redelivery (a reclaim, a retry) gives it
            ((_, fields),) = d.client.xrange(d.keys.prefill)
            d.client.xadd(d.keys.prefill, fields)
            assert d.prefill.step(block_ms=100) == 2  # one batch: the second is skipped
        else:
            assert d.prefill.step(block_ms=100) == 1
            ((_, fields),) = d.client.xrange(d.keys.decode)
            d.client.xadd(d.keys.decode, fields)
        steps = 0
        while not stream.done:
            d.decode.step(block_ms=100)
            steps += 1
            assert steps < 20, "the request did not end"
        assert _outcome(stream, 1) == (reference[2], FinishReason.LENGTH, None)
        d.decode.step(block_ms=10)
        assert len(d.decode.batch) == 0  # no second row of the request runs
        assert (d.prefill if stage == "prefill" else d.decode).counters.duplicates == 1
    finally:
        d.close()


def _event(**e) -> dict:
    return {"e": json.dumps(e)}


@pytest.fixture
def gateway(redis_server):
    """A gateway whose reply events the test writes (no workers)."""
    client = redis.Redis.from_url(redis_server.url)
    gw = EpdGateway(client, FP, vocab_size=512, max_seq_len=64)
    yield gw
    gw.close()


def test_reply_events_sent_twice_or_of_an_earlier_attempt_are_delivered_once(gateway):
    stream = gateway.submit([3, 4, 5], GREEDY)
    out = EpdKeys(FP).out(stream.rid)
    for e in (_event(q=0, a=0, t=7, tier="cold", reused=0), _event(q=1, a=0, t=8),
              _event(q=1, a=0, t=8), _event(q=0, a=0, t=7, tier="cold", reused=0),
              _event(q=2, a=1, t=99), _event(q=2, a=0, t=9, fin="length")):
        gateway.r.xadd(out, e)
    assert _outcome(stream, 5) == ([7, 8, 9], FinishReason.LENGTH, None)
    assert stream.timing.completion_tokens == 3


def test_a_gap_in_the_reply_events_is_an_error_never_a_skipped_token(gateway):
    stream = gateway.submit([3, 4, 5], GREEDY)
    out = EpdKeys(FP).out(stream.rid)
    gateway.r.xadd(out, _event(q=0, a=0, t=7, tier="cold", reused=0))
    gateway.r.xadd(out, _event(q=3, a=0, t=9, fin="length"))
    assert _outcome(stream, 5) == ([7], FinishReason.UNAVAILABLE, (
        "The request's events 1 to 2 were lost (the queue server restarted?); send the "
        "request again."))


# ---- 3. a malformed event in a reply stream -----------------------------------------------------

@pytest.mark.parametrize("fields,why", [
    ({"e": b"{not json"}, "JSONDecodeError: Expecting property name enclosed in double quotes: "
                          "line 1 column 2 (char 1)"),
    ({"x": b"1"}, "KeyError: 'e'"),
    ({"e": b"[1, 2]"}, "TypeError: not an object"),
    ({"e": b'{"q": 0, "a": 0, "t": "7"}'}, "TypeError: '7' is not a whole number"),
    ({"e": b'{"q": 0, "a": 0, "t": 7, "fin": "done"}'},
     "ValueError: 'done' is not a valid FinishReason"),
    ({"e": b'{"q": -1, "a": 0, "t": 7}'},
     "TypeError: its sequence number or attempt is not a whole number >= 0"),
])
def test_a_malformed_event_fails_its_request_and_the_reader_goes_on(gateway, fields, why):
    bad, good = gateway.submit([3, 4, 5], GREEDY), gateway.submit([6, 7], GREEDY)
    gateway.r.xadd(EpdKeys(FP).out(bad.rid), fields)
    assert _outcome(bad, 5) == ([], FinishReason.UNAVAILABLE, (
        "The request's reply stream held an event this gateway cannot read; send the request "
        f"again. The reply event is malformed ({why})."))
    later = gateway.submit([8, 9], GREEDY)  # a request after the bad event is served
    for s in (good, later):
        gateway.r.xadd(EpdKeys(FP).out(s.rid), _event(q=0, a=0, t=11, fin="length"))
        assert _outcome(s, 5) == ([11], FinishReason.LENGTH, None)
    assert gateway.stats().running == 0 and gateway.stats().finished == 3


class _ReaderKiller:
    """The gateway's client, but a read ends the reader thread (a BaseException)."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    def xread(self, *a, **kw):
        raise SystemExit("the reader is gone")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_if_the_reader_thread_ends_its_requests_fail_at_once_and_new_ones_too(gateway):
    running = gateway.submit([3, 4, 5], GREEDY)
    gateway.r = _ReaderKiller(gateway.r)
    message = ("This gateway's reader thread stopped, so it cannot take requests; send them to "
               "another worker or restart this one.")
    assert _outcome(running, 5) == ([], FinishReason.UNAVAILABLE, message)
    assert _outcome(gateway.submit([6, 7], GREEDY), 1) == ([], FinishReason.UNAVAILABLE, message)
    assert gateway.stats().running == 0


# ---- 4. a decode worker that dies mid-generation ------------------------------------------------

def test_a_decode_worker_that_dies_mid_generation_ends_its_request_with_an_error(
        small_model, tmp_path, redis_server, reference):
    d = _Deployment(small_model, tmp_path, redis_server.url)
    try:
        stream = d.gateway.submit(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40,
                                                             ignore_eos=True))
        assert d.prefill.step(block_ms=100) == 1
        assert d.decode.step(block_ms=100) == 1  # joined, and one token decoded
        first = [stream.get(timeout=30).token_id for _ in range(2)]
        assert first == reference[3][:2]
        worker = d.decode.consumer
        d.decode.stop()  # as a killed process: no more steps, no more heartbeats
        assert _outcome(stream, 10) == ([], FinishReason.UNAVAILABLE, (
            f"The request was lost: the worker running it, {worker}, stopped (its heartbeat "
            "lapsed); send it again."))
    finally:
        d.close()


def test_a_decode_worker_killed_mid_stream_another_finishes_the_response_once(
        small_model, tmp_path, redis_server, reference):
    """Issue 42: 1 prefill + 2 decode workers; the decode worker running a request dies after
    its first tokens. The other decode worker takes its queue entry over (XCLAIM once it
    has been idle reclaim_idle_s: the dead worker's heartbeats no longer touch it), runs the
    request again from the prompt (its hand-off was consumed), and the gateway drops the
    tokens it had delivered (checked equal): the client gets the reference's 40 tokens, each
    once, before its lease lapses (no error)."""
    d = _Deployment(small_model, tmp_path, redis_server.url)
    spare_engine = _engine(small_model, tmp_path / "e2", redis_url=redis_server.url)
    spare = None
    try:
        stream = d.gateway.submit(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40,
                                                             ignore_eos=True))
        assert d.prefill.step(block_ms=100) == 1  # routed to d.decode, the one live
        spare = DecodeWorker(spare_engine, d.client, max_running=4, reclaim_idle_s=0.3, **WORKER)
        assert d.decode.step(block_ms=100) == 1  # joined, and one token decoded
        d.decode.step()
        first = [stream.get(timeout=30).token_id for _ in range(3)]
        assert first == reference[3][:3]
        d.decode.stop()  # as a killed process: no more steps, no more heartbeats
        deadline = time.monotonic() + 60
        while not stream.done:
            spare.step(block_ms=50)
            assert time.monotonic() < deadline, "the request did not end"
        assert _outcome(stream, 1) == (reference[3][3:], FinishReason.LENGTH, None)
        assert stream.timing.completion_tokens == 40
        n = spare.counters
        assert (n.reclaimed, n.handoffs_rejected, n.requests, n.tokens) == (1, 1, 1, 39)
        assert d.client.xpending(d.keys.decode, "decode")["pending"] == 0  # acknowledged
    finally:
        if spare is not None:
            spare.stop()
        spare_engine.close()
        d.close()


def test_a_token_sent_again_that_differs_from_the_delivered_one_is_an_error(gateway):
    """A worker that took a request over runs it again from the prompt: its tokens already
    delivered are checked, never replaced or sent twice."""
    stream = gateway.submit([3, 4, 5], GREEDY)
    out = EpdKeys(FP).out(stream.rid)
    for e in (_event(q=0, a=0, t=7, tier="cold", reused=0), _event(q=1, a=0, t=8),
              _event(q=1, a=0, t=9), _event(q=2, a=0, t=10, fin="length")):
        gateway.r.xadd(out, e)
    assert _outcome(stream, 5) == ([7, 8], FinishReason.UNAVAILABLE, (
        "The worker that took the request over gave token 9 at place 1, where token 8 was "
        "delivered (an unseeded sampled request cannot be run again the same); send it again."))


# ---- all at once: processes, 16 streams in the script (4 here) ----------------------------------

def test_epd_chaos_script_ends_every_request_once_and_none_hangs(small_case, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts/faults/epd_chaos.py"
    env = {**os.environ, "DSV41_FAULT_CHECKPOINT": str(small_case.checkpoint),
           "TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script), str(tmp_path), "--clients", "4",
                          "--max-tokens", "12", "--timeout-s", "60"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["hung"] == 0 and summary["duplicated"] == 0 and summary["wrong"] == 0, summary
    assert summary["completed"] + sum(summary["errored"].values()) == 4, summary
    assert summary["faults"] == {"redis_restarted": 1, "worker_killed": 1,
                                 "entries_redelivered": 1, "events_redelivered": 1}, summary
