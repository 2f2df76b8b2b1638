"""Prefill workers that take several requests (issue 42): a batch read at once and prefilled
chunk-interleaved (runtime/serving/epd_prefill.py), each request handed off when its own
prefill ends, a bad one failing alone, a worker killed mid-batch reclaimed entry by entry, and
the prefix a batch's requests share prefilled once (the runtime prefix tier).

The workers run in this process over the test's redis-server, on engines whose prefill chunk
is one page (8 tokens), so that the prompts here take several chunks and interleave.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import redis

from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.epd import EpdKeys, EpdRequest
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.epd_prefill import (
    ChunkRounds,
    PrefillWorker,
    check_prefill_requests,
    prefix_waits,
)
from dsv41.runtime.serving.epd_stages import DecodeWorker
from dsv41.runtime.serving.frontend import FinishReason

PAGE = CHUNK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
WORKER = {"heartbeat_s": 0.1, "lease_ttl_s": 0.5}  # a lease outlives a dead worker by 0.5 s
GATEWAY = {"lease_check_s": 0.1, "lease_grace_s": 0.4}


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


# long, short, middle: 4, 1 and 3 chunks of 8
PROMPTS = [_prompt(n, 700 + i) for i, n in enumerate((30, 5, 19))]
SHARED = _prompt(16, 800)  # two blocks
PREFIXED = [SHARED + _prompt(3, 810 + i) for i in range(3)] + [_prompt(19, 820)]


def _engine(model, store, **kw) -> Engine:
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, store_dir=store,
                             prefill_chunk_tokens=CHUNK, **kw)


def _one_at_a_time(model, store, prompts, **kw) -> list[list[int]]:
    """Each prompt served alone, in order, on one fresh engine (the batcher, one row)."""
    with _engine(model, store, **kw) as e:
        b = Batcher(e, max_running=1)
        out = []
        for p in prompts:
            s = b.submit(p, GREEDY)
            while b.step():
                pass
            out.append([ev.token_id for ev in s if ev.token_id is not None])
        b.stop()
    assert all(len(t) == 3 for t in out)
    return out


@pytest.fixture(scope="module")
def reference(small_model, tmp_path_factory):
    return _one_at_a_time(small_model, tmp_path_factory.mktemp("ref") / "s", PROMPTS)


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
    """A gateway, a prefill worker and a decode worker in this process."""

    def __init__(self, model, root, url, *, prefill_client=None, prefill_kw=None, **engine_kw):
        self.client = redis.Redis.from_url(url)
        self.engines = [_engine(model, root / f"e{i}", redis_url=url,
                                **{**engine_kw, **((prefill_kw or {}) if i == 0 else {})})
                        for i in range(2)]
        self.prefill = PrefillWorker(self.engines[0], prefill_client or self.client,
                                     prefill_requests=4, **WORKER)
        self.decode = DecodeWorker(self.engines[1], self.client, max_running=4, **WORKER)
        a = model.args
        self.keys = EpdKeys(self.engines[0].key_salt.fingerprint())
        self.gateway = EpdGateway(self.client, self.keys.fingerprint, vocab_size=a.vocab_size,
                                  max_seq_len=a.max_seq_len, **GATEWAY)

    def decode_until_done(self, streams, *also) -> None:
        deadline = time.monotonic() + 120
        while not all(s.done for s in streams):
            for w in (*also, self.decode):
                w.step(block_ms=20)
            assert time.monotonic() < deadline, "the requests did not end"

    def close(self) -> None:
        for w in (self.prefill, self.decode):
            w.stop()
        self.gateway.close()
        for e in self.engines:
            e.close()


def _rids(client, stream: str) -> list[str]:
    return [f[b"rid"].decode() for _, f in client.xrange(stream)]


# ---- the scheduler alone -------------------------------------------------------------------------

def _job(name: str, chunks: int, log: list[str]):
    def job(pause) -> None:
        for c in range(chunks):
            if c:
                pause()
            log.append(f"{name}{c}")
    return job


def test_chunk_rounds_give_each_job_one_chunk_in_turn_and_start_waiters_after_their_mate():
    log: list[str] = []
    rounds = ChunkRounds([_job("a", 3, log), _job("b", 1, log), _job("c", 2, log),
                          _job("d", 2, log)], waits=[None, None, None, 1])
    rounds.run()
    # b's single chunk ends between a's first and second; d waits for b, then joins the round
    assert log == ["a0", "b0", "c0", "a1", "d0", "c1", "a2", "d1"]
    assert rounds.turns == [0, 1, 2, 0, 3, 2, 0, 3]


def test_chunk_rounds_a_job_that_escapes_ends_alone_and_run_raises_it_after_the_others():
    log: list[str] = []

    def dies(pause) -> None:
        log.append("x0")
        pause()
        raise SystemExit("gone")

    rounds = ChunkRounds([dies, _job("a", 3, log)], waits=[None, None])
    with pytest.raises(SystemExit, match="gone"):
        rounds.run()
    assert log == ["x0", "a0", "a1", "a2"]


def test_chunk_rounds_refuse_a_wait_on_a_later_job_and_prefill_requests_out_of_range():
    with pytest.raises(ValueError, match=r"^Job 0 may only wait for an earlier job, got 1\.$"):
        ChunkRounds([lambda p: None, lambda p: None], waits=[1, None])
    with pytest.raises(ValueError, match=r"^ChunkRounds needs one wait per job, got 1 for 2 "):
        ChunkRounds([lambda p: None, lambda p: None], waits=[None])
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match=r"^prefill_requests must be an integer from 1 to "
                                             rf"64, got {bad!r}\.$"):
            check_prefill_requests(bad)
    assert check_prefill_requests(1) == 1


def test_prefix_waits_pick_the_earlier_request_of_the_longest_common_run():
    assert prefix_waits([["a", "b"], ["a", "c"], ["x"], ["a", "b", "d"], [], ["x", "y"]]) == \
        [None, 0, None, 0, None, 2]
    assert prefix_waits([["a"], ["a", "b"], ["a", "b", "c"]]) == [None, 0, 1]


def test_serve_refuses_prefill_requests_out_of_range(capsys):
    from dsv41.compiler.tools.cli import main as cli
    from dsv41.runtime.serving.assembly import ServeOptions, ServingOptions

    opts = ServeOptions(ServingOptions(redis_url="redis://x"), role="prefill", prefill_requests=0)
    with pytest.raises(ValueError, match=r"^--prefill-requests must be a whole number from 1 "
                                         r"to 64, got 0\.$"):
        opts.validate()
    with pytest.raises(SystemExit):  # refused while parsing (not a count)
        cli.main(["serve", "--role", "prefill", "--prefill-requests", "0"])
    assert "argument --prefill-requests: must be a whole number of at least 1, got '0'" in \
        capsys.readouterr().err


# ---- workers over Redis ------------------------------------------------------------------------

def test_three_requests_at_once_hand_off_each_when_its_prefill_ends_equal_to_one_at_a_time(
        small_model, tmp_path, redis_server, reference):
    d = _Deployment(small_model, tmp_path, redis_server.url)
    try:
        streams = [d.gateway.submit(p, GREEDY) for p in PROMPTS]
        assert d.prefill.step(block_ms=100) == 3  # one read, one batch
        # the short request's hand-off went first, the long one's last
        assert _rids(d.client, d.keys.decode) == [streams[i].rid for i in (1, 2, 0)]
        assert d.prefill.last_rounds.turns == [0, 1, 2, 0, 2, 0, 2, 0, 2, 0]
        assert d.client.xpending(d.keys.prefill, "prefill")["pending"] == 0
        d.decode_until_done(streams)
        assert [_outcome(s, 1) for s in streams] == \
            [(t, FinishReason.LENGTH, None) for t in reference]
        assert d.prefill.counters.requests == 3 and d.prefill.counters.errors == 0
    finally:
        d.close()


def test_a_bad_request_in_a_batch_fails_alone(small_model, tmp_path, redis_server, reference):
    d = _Deployment(small_model, tmp_path, redis_server.url)
    try:
        first = d.gateway.submit(PROMPTS[0], GREEDY)
        # a token past the vocabulary (refused before the batch runs), and an image whose record
        # is gone (fails in its own prefill, while the others run)
        bad_ids = EpdRequest("bad-ids", (3, 600, 4), GREEDY)
        no_image = EpdRequest("no-image", tuple(PROMPTS[2]), GREEDY, ("ab" * 32,), (0,))
        for req in (bad_ids, no_image):
            d.client.xadd(d.keys.prefill, {"req": req.to_json()})
        last = d.gateway.submit(PROMPTS[1], GREEDY)
        assert d.prefill.step(block_ms=100) == 4
        errors = {rid: [json.loads(f[b"e"]) for _, f in d.client.xrange(d.keys.out(rid))]
                  for rid in ("bad-ids", "no-image")}
        assert errors == {
            "bad-ids": [{"q": 0, "a": 0, "fin": "error",
                         "err": "Token ids must lie in [0, 512); got 3..600."}],
            "no-image": [{"q": 0, "a": 0, "fin": "error", "err": (
                "The request's image abababababababab is gone or damaged (The record is "
                "truncated (0 bytes).); send the request again.")}]}
        d.decode_until_done([first, last])
        assert [_outcome(s, 1) for s in (first, last)] == \
            [(reference[0], FinishReason.LENGTH, None), (reference[1], FinishReason.LENGTH, None)]
        n = d.prefill.counters
        assert (n.requests, n.errors) == (2, 2)
        assert d.client.xpending(d.keys.prefill, "prefill")["pending"] == 0
        assert d.client.xlen(d.keys.prefill) == 0
    finally:
        d.close()


class _Frozen:
    """A worker's client that freezes, as a killed process does, at the `at`-th reply event it
    sends: that call and every later one (its heartbeats too) wait until `thaw`, then raise
    SystemExit (the process is gone: nothing more is sent or acknowledged)."""

    def __init__(self, client, out_prefix: str, at: int):
        self.client, self.out_prefix, self.at = client, out_prefix, at
        self.sent = 0
        self.frozen, self._thawed = threading.Event(), threading.Event()

    def _wait(self) -> None:
        if self.frozen.is_set():
            self._thawed.wait()
            raise SystemExit("the worker was killed")

    def thaw(self) -> None:
        self._thawed.set()

    def __getattr__(self, name):
        self._wait()
        return getattr(self.client, name)

    def xadd(self, key, fields, *a, **kw):
        self._wait()
        if str(key).startswith(self.out_prefix):
            self.sent += 1
            if self.sent == self.at:
                self.frozen.set()
                self._wait()
        return self.client.xadd(key, fields, *a, **kw)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_prefill_worker_killed_mid_batch_has_each_entry_reclaimed_and_completed_once(
        small_model, tmp_path, redis_server, reference):
    """The worker reads the 3 requests and dies as it sends the second first token (the short
    one handed off; the middle one prefilled, nothing sent; the long one half prefilled).
    Another prefill worker takes its 2 pending entries over (idle reclaim_idle_s) and runs them
    again: each client gets its 3 reference tokens, once."""
    keys_client = redis.Redis.from_url(redis_server.url)
    probe = _engine(small_model, tmp_path / "probe")
    out_prefix = EpdKeys(probe.key_salt.fingerprint()).out("")
    probe.close()
    frozen = _Frozen(keys_client, out_prefix, at=2)
    d = _Deployment(small_model, tmp_path, redis_server.url, prefill_client=frozen)
    spare_engine = _engine(small_model, tmp_path / "spare", redis_url=redis_server.url)
    spare = PrefillWorker(spare_engine, d.client, prefill_requests=4, reclaim_idle_s=0.3,
                          **WORKER)
    killed = threading.Thread(target=d.prefill.step, kwargs={"block_ms": 100}, daemon=True)
    try:
        streams = [d.gateway.submit(p, GREEDY) for p in PROMPTS]
        killed.start()
        assert frozen.frozen.wait(120), "the worker did not reach its second first token"
        assert d.client.xpending(d.keys.prefill, "prefill")["pending"] == 2
        d.decode_until_done(streams, spare)
        assert [_outcome(s, 1) for s in streams] == \
            [(t, FinishReason.LENGTH, None) for t in reference]
        assert [s.timing.completion_tokens for s in streams] == [3, 3, 3]
        assert spare.counters.reclaimed == 2
        assert d.client.xpending(d.keys.prefill, "prefill")["pending"] == 0
        assert d.gateway.stats().finished == 3
    finally:
        frozen.thaw()
        killed.join(timeout=60)
        spare.stop()
        spare_engine.close()
        d.close()


def test_requests_of_a_batch_with_a_common_prefix_reuse_the_first_ones_blocks(
        small_model, tmp_path, redis_server):
    """Three requests of one 16-token prefix and one other in one batch: the second and third
    wait for the first's prefill and start from its two blocks (the runtime prefix tier),
    counted; the fourth interleaves with the first. The tokens equal the same requests served
    one at a time on a fresh engine (where the second and third reuse the same blocks)."""
    want = _one_at_a_time(small_model, tmp_path / "ref", PREFIXED, runtime_prefix=True)
    d = _Deployment(small_model, tmp_path, redis_server.url, runtime_prefix=True)
    try:
        streams = [d.gateway.submit(p, GREEDY) for p in PREFIXED]
        assert d.prefill.step(block_ms=100) == 4
        assert d.prefill.last_rounds.waits == [None, 0, 0, None]
        n = d.prefill.counters
        assert (n.batch_prefix_reuses, n.batch_prefix_tokens, n.requests) == (2, 32, 4)
        assert d.engines[0].tier_counts["runtime-prefix"] == 2
        d.decode_until_done(streams)
        assert [_outcome(s, 1) for s in streams] == [(t, FinishReason.LENGTH, None) for t in want]
    finally:
        d.close()


def test_a_request_the_runtime_cache_holds_only_alone_waits_for_its_batch_mate(
        small_model, tmp_path, redis_server, reference):
    """A prefill engine whose cache budget holds either request's cache but not both: the
    second waits for the first to end (never fails), as one at a time."""
    a = small_model.args
    sizes = []
    with _engine(small_model, tmp_path / "probe") as e:
        for p in (PROMPTS[0], PROMPTS[2]):
            s = e.session()
            turn = s.begin(EpdRequest("p", tuple(p), GREEDY).turn(a.vocab_size, a.max_seq_len))
            sizes.append(e.runtime_bytes())
            s.finish(turn)
            s.close()
    d = _Deployment(small_model, tmp_path, redis_server.url,
                    prefill_kw={"cache_budget_bytes": sum(sizes) - 1})
    try:
        streams = [d.gateway.submit(p, GREEDY) for p in (PROMPTS[0], PROMPTS[2])]
        assert d.prefill.step(block_ms=100) == 2
        assert _rids(d.client, d.keys.decode) == [s.rid for s in streams]
        n = d.prefill.counters
        assert (n.requests, n.errors) == (2, 0)
        d.decode_until_done(streams)
        assert [_outcome(s, 1) for s in streams] == \
            [(reference[i], FinishReason.LENGTH, None) for i in (0, 2)]
    finally:
        d.close()
