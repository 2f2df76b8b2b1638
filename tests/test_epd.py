"""EPD workers (runtime/epd.py) over a real redis-server: a prefill worker hands its finished
runtime state to decode workers, and the greedy tokens equal the single-process batcher's.

The fast tests run the workers in this process (each with its own engine over the torch graph
of shared-small, pages of 8); the slow one starts `dsv41 serve --role prefill|decode` processes
and sends 8 concurrent requests over HTTP (the must-show deployment).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import worker_port

from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher, FinishReason
from dsv41.runtime.serving.epd import EpdKeys, EpdRequest, Route, choose_decoder
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.epd_prefill import PrefillWorker
from dsv41.runtime.serving.epd_stages import DecodeWorker

PAGE = 8
W = "w" * 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
LENGTHS = (5, 12, 19, 9)  # below, at and past a block boundary


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


PROMPTS = [_prompt(n, 100 + i) for i, n in enumerate(LENGTHS)]


def _engine(model, store, **kw) -> Engine:
    return Engine.from_model(model, weights_hash=W, page_tokens=PAGE, store_dir=store, **kw)


def _tokens(stream) -> tuple[list[int], FinishReason]:
    out, last = [], None
    for ev in stream:
        if ev.token_id is not None:
            out.append(ev.token_id)
        last = ev
    return out, last.finish


@pytest.fixture(scope="module")
def single_process(small_model, tmp_path_factory):
    """The single-process batcher's tokens for PROMPTS, submitted together."""
    with _engine(small_model, tmp_path_factory.mktemp("ref") / "s") as e:
        b = Batcher(e, max_running=8)
        streams = [b.submit(p, GREEDY) for p in PROMPTS]
        while b.step():
            pass
        out = [_tokens(s) for s in streams]
        b.stop()
    assert all(f is FinishReason.LENGTH and len(t) == 3 for t, f in out)
    return [t for t, _ in out]


class _Deployment:
    """1 prefill + `decoders` decode workers and a gateway, in this process."""

    def __init__(self, model, root: Path, url: str, decoders: int = 2):
        self.client = redis.Redis.from_url(url)
        self.engines = [_engine(model, root / f"e{i}", redis_url=url)
                        for i in range(1 + decoders)]
        self.prefill = PrefillWorker(self.engines[0], self.client)
        self.decoders = [DecodeWorker(e, self.client, max_running=4) for e in self.engines[1:]]
        a = model.args
        self.gateway = EpdGateway(self.client, self.engines[0].key_salt.fingerprint(),
                                  vocab_size=a.vocab_size, max_seq_len=a.max_seq_len)

    def start(self) -> None:
        for w in (self.prefill, *self.decoders):
            w.start()

    def close(self) -> None:
        for w in (self.prefill, *self.decoders):
            w.stop()
        self.gateway.close()
        for e in self.engines:
            e.close()


def test_request_record_round_trips_and_is_checked():
    req = EpdRequest("r1", (3, 4, 5), SamplingParams(temperature=0.5, seed=7, stop_token_ids=(9,),
                                                     max_tokens=4))
    assert EpdRequest.from_json(req.to_json()) == req
    turn = req.turn(512, 64)
    assert turn.max_new_tokens == 4 and 9 in turn.stop
    with pytest.raises(ValueError, match="no room"):
        EpdRequest("r2", tuple(range(3, 67)), SamplingParams()).turn(512, 64)
    with pytest.raises(ValueError, match="Token ids"):
        EpdRequest("r3", (3, 600), SamplingParams()).turn(512, 64)


def test_one_prefill_two_decode_workers_equal_the_single_process(small_model, tmp_path,
                                                                 redis_server, single_process):
    d = _Deployment(small_model, tmp_path, redis_server.url)
    try:
        d.start()
        streams = [d.gateway.submit(p, GREEDY) for p in PROMPTS]
        got = [_tokens(s) for s in streams]
        assert [t for t, _ in got] == single_process
        assert all(f is FinishReason.LENGTH for _, f in got)
        assert d.prefill.counters.requests == len(PROMPTS)
        assert sum(w.counters.requests for w in d.decoders) == len(PROMPTS)
        assert sum(w.counters.handoffs_rejected for w in d.decoders) == 0
        # the prefill worker persisted what the article persists: blocks and encoder snapshots
        d.engines[0].flush()
        st = d.engines[0].stats()
        assert st.store.entries == sum(n // PAGE for n in LENGTHS)
        keys = EpdKeys(d.engines[0].key_salt.fingerprint())
        assert not d.client.keys(f"{keys.base}:handoff:*")  # every hand-off read and deleted
        assert d.gateway.stats().finished == len(PROMPTS)
    finally:
        d.close()


def test_choose_decoder_prefers_the_longest_prefix_then_the_least_load():
    loads = {"a": 2, "b": 0, "c": 0}
    assert choose_decoder(loads, []) == Route("b")  # least load, ties by name
    assert choose_decoder(loads, [None, None]) == Route("b")
    assert choose_decoder(loads, ["a", None]) == Route("a", True, 1)
    assert choose_decoder(loads, ["a", "c", None]) == Route("c", True, 2)  # the longer prefix
    assert choose_decoder(loads, ["a", "dead"]) == Route("a", True, 1)  # "dead" is not live
    assert choose_decoder({}, ["a"]) == Route(None)


def test_16_concurrent_requests_go_to_the_decode_worker_of_their_prefix(small_model, tmp_path,
                                                                       redis_server):
    """Issue 42: 1 prefill + 2 decode workers, 16 requests queued together: 4 sessions, each
    request a session's 16-token prefix (2 blocks) and 3 tokens of its own. A session's first
    request goes to the least loaded worker (ties: the first name): a, b, a, b; its next three
    follow its prefix there: 12 prefix hits, 6 on each worker, 8 requests each."""
    client = redis.Redis.from_url(redis_server.url)
    engines = [_engine(small_model, tmp_path / f"e{i}", redis_url=redis_server.url)
               for i in range(3)]
    prefill = PrefillWorker(engines[0], client)
    decoders = [DecodeWorker(engines[1 + i], client, max_running=16, consumer=f"decode-{c}")
                for i, c in enumerate("ab")]
    a = small_model.args
    gw = EpdGateway(client, engines[0].key_salt.fingerprint(), vocab_size=a.vocab_size,
                    max_seq_len=a.max_seq_len)
    try:
        prefixes = [_prompt(16, 500 + s) for s in range(4)]
        prompts = [prefixes[s] + _prompt(3, 600 + 4 * r + s) for r in range(4) for s in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        streams = [gw.submit(p, params) for p in prompts]
        for _ in range(4):  # four batches of four (the default prefill_requests)
            assert prefill.step(block_ms=100) == 4
        deadline = time.monotonic() + 300
        while not all(st.done for st in streams):
            for w in decoders:
                w.step(block_ms=10)
            assert time.monotonic() < deadline, "the requests did not end"
        got = [_tokens(st) for st in streams]
        assert all(f is FinishReason.LENGTH and len(t) == 2 for t, f in got)
        assert prefill.counters.prefix_hits == 12
        assert [(w.counters.prefix_hits, w.counters.requests) for w in decoders] == \
            [(6, 8), (6, 8)]
        keys = EpdKeys(engines[0].key_salt.fingerprint())
        where = [client.get(keys.locality(engines[0].block_keys(p)[-1])) for p in prefixes]
        assert where == [b"decode-a", b"decode-b", b"decode-a", b"decode-b"]
        assert {k: int(v) for k, v in client.hgetall(keys.load).items()} == \
            {b"decode-a": 0, b"decode-b": 0}  # every routed request has left
    finally:
        for w in (prefill, *decoders):
            w.stop()
        gw.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize("fault", ["corrupted", "missing"])
def test_a_bad_hand_off_is_prefilled_again_never_used(small_model, tmp_path, redis_server,
                                                      single_process, fault):
    d = _Deployment(small_model, tmp_path, redis_server.url, decoders=1)
    try:
        stream = d.gateway.submit(PROMPTS[2], GREEDY)
        while not d.prefill.step(block_ms=100):
            pass
        keys = EpdKeys(d.engines[0].key_salt.fingerprint())
        (key,) = d.client.keys(f"{keys.base}:handoff:*")
        if fault == "corrupted":
            d.client.setrange(key, d.client.strlen(key) // 2, b"\x00\x01")
        else:
            d.client.delete(key)  # as an expired hand-off
        while not stream.done:
            d.decoders[0].step(block_ms=100)
        assert _tokens(stream)[0] == single_process[2]
        assert d.decoders[0].counters.handoffs_rejected == 1
    finally:
        d.close()


def test_another_models_workers_never_see_the_request(small_model, tmp_path, redis_server):
    a = _engine(small_model, tmp_path / "a", redis_url=redis_server.url)
    b = Engine.from_model(small_model, weights_hash="x" * 64, page_tokens=PAGE,
                          store_dir=tmp_path / "b", redis_url=redis_server.url)
    try:
        assert EpdKeys(a.key_salt.fingerprint()).prefill != EpdKeys(b.key_salt.fingerprint()) \
            .prefill
        client = redis.Redis.from_url(redis_server.url)
        gw = EpdGateway(client, a.key_salt.fingerprint(), vocab_size=512, max_seq_len=64)
        gw.submit(PROMPTS[0], GREEDY)
        assert PrefillWorker(b, client).step(block_ms=50) == 0
        assert PrefillWorker(a, client).step(block_ms=50) == 1
        gw.close()
    finally:
        a.close()
        b.close()


# ---- the must-show deployment: separate processes over HTTP --------------------------------------

def _wait_health(port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"worker on port {port} exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"worker on port {port} did not come up")


@pytest.mark.slow
def test_processes_1_prefill_2_decode_answer_8_concurrent_requests(small_case, small_model,
                                                                   tmp_path, redis_server):
    import httpx

    from dsv41.graph.config import load_config
    from dsv41.runtime.serving.metrics import parse_metrics
    from dsv41.runtime.serving.tokenizer import Tokenizer

    prompts = [_prompt(n, 200 + i) for i, n in enumerate((5, 9, 12, 16, 19, 23, 7, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tok = Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)
    with _engine(small_model, tmp_path / "ref") as e:  # the single-process engine
        b = Batcher(e, tokenizer=tok, max_running=8)
        ref_streams = [b.submit(p, params) for p in prompts]
        while b.step():
            pass
        ref = ["".join(ev.text for ev in s) for s in ref_streams]
        b.stop()
    roles = ("prefill", "decode", "decode")
    ports = [worker_port() for _ in roles]
    env = {**os.environ, "TVM_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dsv41.compiler.tools.cli", "serve", "--role", role, "--backend",
         "torch", "--checkpoint", str(small_case.checkpoint), "--page-tokens", str(PAGE),
         "--redis-url", redis_server.url, "--port", str(port), "--log-level", "warning",
         "--store", str(tmp_path / f"store-{i}")], env=env, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"worker-{i}.log", "w"))
        for i, (role, port) in enumerate(zip(roles, ports, strict=True))]
    try:
        for port, proc in zip(ports, procs, strict=True):
            _wait_health(port, proc)
        results: list[list[int] | None] = [None] * len(prompts)

        def ask(i: int) -> None:  # each request to another worker: any of them is a gateway
            r = httpx.post(f"http://127.0.0.1:{ports[i % 3]}/v1/completions", timeout=600,
                           json={"model": Path(small_case.checkpoint).name, "prompt": prompts[i],
                                 "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            results[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == ref and all(ref)
        m = [parse_metrics(httpx.get(f"http://127.0.0.1:{p}/metrics").text) for p in ports]
        assert m[0]['dsv41:epd_stage_requests_total{role="prefill"}'] == len(prompts)
        assert m[1]['dsv41:epd_stage_requests_total{role="decode"}'] + \
            m[2]['dsv41:epd_stage_requests_total{role="decode"}'] == len(prompts)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def test_stop_strings_and_cancels_free_the_decode_row(small_case, small_model, tmp_path,
                                                      redis_server, single_process):
    """The gateway matches stop strings on the text (as the batcher does) and tells the decode
    worker through the cancel key; so does a client that leaves."""
    from dsv41.graph.config import load_config
    from dsv41.runtime.serving.tokenizer import Tokenizer

    tok = Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)
    stop = tok.decode([single_process[0][1]])  # the second token's text
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,))
    with _engine(small_model, tmp_path / "ref") as e:
        b = Batcher(e, tokenizer=tok, max_running=2)
        ref = b.submit(PROMPTS[0], params)
        while b.step():
            pass
        ref_events = list(ref)
        b.stop()
    d = _Deployment(small_model, tmp_path, redis_server.url, decoders=1)
    d.gateway.tokenizer = tok
    worker = d.decoders[0]
    try:
        stopped = d.gateway.submit(PROMPTS[0], params)
        left = d.gateway.submit(PROMPTS[1], replace_tokens(params, 40))
        read = 0  # both entries, in one batch or two (the worker reads up to 4 at once)
        for _ in range(50):
            read += d.prefill.step(block_ms=100)
            if read == 2:
                break
        assert read == 2, read
        first = None
        while first is None or first.token_id is None:
            first = left.get(timeout=5)
        left.cancel()  # the client of the second request leaves after its first token
        steps = 0
        while not stopped.done or len(worker.batch):
            worker.step(block_ms=100)
            steps += 1
            assert steps < 30, "the decode rows were not let go"
        events = list(stopped)
        assert [(ev.token_id, ev.text, ev.finish) for ev in events] == \
            [(ev.token_id, ev.text, ev.finish) for ev in ref_events]
        assert events[-1].finish is FinishReason.STOP
        assert worker.counters.tokens < 2 * 40 - 2 and worker.counters.requests == 0
        assert d.gateway.stats().cancelled == 1 and d.gateway.stats().finished == 1
    finally:
        d.close()


def replace_tokens(params: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, stop=(), max_tokens=n)


def test_serve_role_needs_a_redis_url_and_a_known_role(capsys):
    from dsv41.compiler.tools.cli import main as cli

    assert cli.main(["serve", "--role", "decode", "--backend", "torch"]) != 0
    assert "--role decode needs --redis-url" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # refused while parsing (a choice)
        cli.main(["serve", "--role", "encoder", "--backend", "torch"])
    assert exit_info.value.code == 2
    assert ("argument --role: invalid choice: 'encoder' (choose from 'all', 'vision', "
            "'prefill', 'decode')") in capsys.readouterr().err


def test_a_gateway_whose_queue_server_is_down_answers_retry_later():
    from dsv41.runtime.serving.batcher import QueueFull

    client = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    gw = EpdGateway(client, bytes(32), vocab_size=512, max_seq_len=64)
    try:
        with pytest.raises(QueueFull, match="unreachable"):
            gw.submit([3, 4, 5], GREEDY)
        assert gw.stats().running == 0
    finally:
        gw.close()


def test_a_queue_entry_that_is_not_a_request_is_dropped(small_model, tmp_path, redis_server):
    with _engine(small_model, tmp_path / "a", redis_url=redis_server.url) as e:
        client = redis.Redis.from_url(redis_server.url)
        worker = PrefillWorker(e, client)
        client.xadd(worker.keys.prefill, {"req": b"{not json"})
        client.xadd(worker.keys.prefill, {"other": b"1"})
        assert worker.step(block_ms=50) == 2  # one batch: both read, both dropped
        assert worker.step(block_ms=50) == 0
        assert worker.queue_length() == 0 and e.stats().tiers["cold"] == 0


def test_the_handed_off_state_restores_the_cache_byte_for_byte(small_model, tmp_path):
    from dsv41.runtime.engine.requests import TurnLimits, check_turn
    from dsv41.runtime.engine.state import restore_runtime_state

    with _engine(small_model, tmp_path / "a") as e:
        s = e.session()
        turn = s.begin(check_turn(PROMPTS[2], TurnLimits(512, 128, 0), sampling=GREEDY))
        state = s.runtime_state()
        cache = e.new_cache()
        restore_runtime_state(cache, state, PAGE)
        src = s.cache
        assert int(cache.pos[0]) == int(src.pos[0]) == len(PROMPTS[2])
        assert cache.index_owner.tolist() == src.index_owner.tolist()
        for layer, ring in src.windows.items():
            assert ring.codes.equal(cache.windows[layer].codes)
            assert ring.scales.equal(cache.windows[layer].scales)
        n = len(PROMPTS[2])
        for layer, st in src.stores.items():
            got = cache.stores[layer]
            for name in ("kv_codes", "kv_scales", "k_codes", "k_scales"):
                a, b = getattr(st, name), getattr(got, name)
                if a is not None:
                    assert a[:, : n // st.ratio].equal(b[:, : n // st.ratio]), (layer, name)
            for name in ("tail_kv", "tail_score"):
                if getattr(st, name) is not None:
                    assert getattr(st, name).equal(getattr(got, name))
        with pytest.raises(ValueError, match="neither a block"):
            restore_runtime_state(e.new_cache(), {**state, "x.y": state["snap.pos"]}, PAGE)
        s.finish(turn)


def test_a_seeded_sampled_request_continues_its_generator(small_model, tmp_path, redis_server):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=4, ignore_eos=True)
    with _engine(small_model, tmp_path / "ref") as e:
        b = Batcher(e, max_running=2)
        ref = b.submit(PROMPTS[1], params)
        while b.step():
            pass
        want = _tokens(ref)[0]
        b.stop()
    d = _Deployment(small_model, tmp_path, redis_server.url, decoders=1)
    try:
        d.start()
        assert _tokens(d.gateway.submit(PROMPTS[1], params))[0] == want
    finally:
        d.close()
