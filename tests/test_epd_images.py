"""Images through the EPD workers (runtime/epd.py) over a real redis-server: gateway -> vision ->
prefill -> decode, each worker with its own engine over the torch graph of shared-vision-small
(`vision_min_pixels` 1: an 84 x 42 image is a 5-position span; pages of 8), in this process.

Greedy outputs must equal the single-process batcher's token for token, with and without
images; the vision stage encodes each image once (its rows stored for the prefill stage); rows
that are gone or damaged are encoded again by the prefill worker (same tokens), an image record
that is gone ends the request with an error event naming it."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import CONFORMANCE, worker_port
from PIL import Image

from dsv41.graph.config import load_config
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher, FinishReason
from dsv41.runtime.serving.epd import EpdKeys, EpdRequest
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.epd_prefill import PrefillWorker
from dsv41.runtime.serving.epd_stages import DecodeWorker, VisionWorker

CASE = CONFORMANCE / "shared-vision-small"
PAGE = 8
IMG = 510
W = "v" * 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def _png(seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (42, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _text(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


# 8 requests, 4 with images (one with two, two sharing an image), each its own first tokens
A, B, C = _png(1), _png(2), _png(3)
REQUESTS = [
    (_text(3, 10) + [IMG] + _text(4, 11), [A]),
    (_text(6, 12), []),
    (_text(2, 13) + [IMG] + _text(1, 14) + [IMG], [B, C]),
    (_text(11, 15), []),
    ([*_text(1, 16), IMG], [A]),
    (_text(4, 17), []),
    (_text(9, 18) + [IMG] + _text(2, 19), [C]),
    (_text(17, 20), []),
]


@pytest.fixture(scope="module")
def model():
    if not CASE.exists():
        pytest.skip(f"conformance pack {CASE} is not present")
    ckpt = CASE / "checkpoint"
    return Model.from_checkpoint(ckpt, load_config(ckpt).replace(vision_min_pixels=1))


def _engine(model, store, **kw) -> Engine:
    return Engine.from_model(model, weights_hash=W, page_tokens=PAGE, store_dir=store, **kw)


def _tokens(stream) -> tuple[list[int], FinishReason, str | None]:
    out, last = [], None
    for ev in stream:
        if ev.token_id is not None:
            out.append(ev.token_id)
        last = ev
    return out, last.finish, last.error


@pytest.fixture(scope="module")
def single_process(model, tmp_path_factory):
    with _engine(model, tmp_path_factory.mktemp("ref") / "s") as e:
        b = Batcher(e, max_running=8)
        streams = [b.submit(ids, GREEDY, ims) for ids, ims in REQUESTS]
        while b.step():
            pass
        out = [_tokens(s) for s in streams]
        b.stop()
    assert all(f is FinishReason.LENGTH and len(t) == 3 for t, f, _ in out)
    return [t for t, _, _ in out]


class _Deployment:
    """1 vision + 1 prefill + `decoders` decode workers and a gateway, in this process."""

    def __init__(self, model, root: Path, url: str, decoders: int = 2):
        self.client = redis.Redis.from_url(url)
        self.engines = [_engine(model, root / f"e{i}", redis_url=url)
                        for i in range(2 + decoders)]
        self.vision = VisionWorker(self.engines[0], self.client)
        self.prefill = PrefillWorker(self.engines[1], self.client)
        self.decoders = [DecodeWorker(e, self.client, max_running=4) for e in self.engines[2:]]
        a = model.args
        self.keys = EpdKeys(self.engines[0].key_salt.fingerprint())
        self.gateway = EpdGateway(self.client, self.keys.fingerprint, vocab_size=a.vocab_size,
                                  max_seq_len=a.max_seq_len, model=model)

    @property
    def workers(self):
        return (self.vision, self.prefill, *self.decoders)

    def start(self) -> None:
        for w in self.workers:
            w.start()

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.gateway.close()
        for e in self.engines:
            e.close()


def test_vision_prefill_decode_workers_equal_the_single_process(model, tmp_path, redis_server,
                                                                single_process):
    d = _Deployment(model, tmp_path, redis_server.url)
    try:
        d.start()
        got: list = [None] * len(REQUESTS)
        go = threading.Barrier(len(REQUESTS))

        def one(k):
            go.wait()
            ids, ims = REQUESTS[k]
            got[k] = _tokens(d.gateway.submit(ids, GREEDY, ims))

        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [g[0] for g in got] == single_process
        assert all(g[1] is FinishReason.LENGTH for g in got)
        with_images = sum(1 for _, ims in REQUESTS if ims)
        assert d.vision.counters.requests == with_images
        assert d.vision.counters.tokens == 3 * (3 * 6)  # each distinct image encoded once
        assert d.prefill.counters.requests == len(REQUESTS)
        assert sum(w.counters.requests for w in d.decoders) == len(REQUESTS)
        assert sum(w.counters.handoffs_rejected for w in d.decoders) == 0
        assert len(d.client.keys(f"{d.keys.base}:features:*")) == 3
        assert not d.client.keys(f"{d.keys.base}:handoff:*")
    finally:
        d.close()


@pytest.mark.parametrize("fault", ["features missing", "features corrupted", "image missing"])
def test_damaged_image_records_are_never_used(model, tmp_path, redis_server, single_process,
                                              fault):
    """The stages stepped by hand: the request's records are damaged between the vision and
    the prefill stage."""
    d = _Deployment(model, tmp_path, redis_server.url, decoders=1)
    try:
        ids, ims = REQUESTS[0]
        stream = d.gateway.submit(ids, GREEDY, ims)
        assert d.vision.step(block_ms=1000) == 1
        key = EpdRequest.from_json(d.client.xrange(d.keys.prefill)[0][1][b"req"]).image_keys[0]
        if fault == "features missing":
            d.client.delete(d.keys.features(key))
        elif fault == "features corrupted":
            raw = bytearray(d.client.get(d.keys.features(key)))
            raw[-3] ^= 0xFF
            d.client.set(d.keys.features(key), bytes(raw))
        else:
            d.client.delete(d.keys.image(key))
        assert d.prefill.step(block_ms=1000) == 1
        for _ in range(20):
            if stream.done:
                break
            d.decoders[0].step(block_ms=200)
        toks, finish, error = _tokens(stream)
        if fault == "image missing":
            assert finish is FinishReason.ERROR and "is gone or damaged" in error
            assert d.prefill.counters.errors == 1
        else:
            assert (toks, finish) == (single_process[0], FinishReason.LENGTH)
    finally:
        d.close()


def test_a_gateway_without_a_vision_model_refuses_images(model):
    client = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    gw = EpdGateway(client, bytes(32), vocab_size=512, max_seq_len=256)
    try:
        from dsv41.runtime.engine.requests import RequestError

        with pytest.raises(RequestError, match="takes no images"):
            gw.submit([0, 3, IMG], GREEDY, [A])
        assert gw.stats().running == 0
    finally:
        gw.close()


def _wait_up(port: int, proc, timeout_s: float = 600.0) -> None:
    import time

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
def test_processes_1_vision_1_prefill_2_decode_answer_8_concurrent_chats(tmp_path,
                                                                         redis_server):
    """The must-show deployment: `dsv41 serve --role vision|prefill|decode` processes (the
    checkpoint as released: an 84 x 42 image is scaled up to a 202-position span) and a
    redis-server; 8 concurrent chats over HTTP, 4 with image_url parts, each sent to another
    worker; the replies equal the single-process batcher's."""
    import base64
    import os
    import subprocess
    import sys

    import httpx

    from dsv41.runtime.serving.metrics import parse_metrics
    from dsv41.runtime.serving.openai_api import parse_chat
    from dsv41.runtime.serving.tokenizer import Tokenizer

    if not CASE.exists():
        pytest.skip(f"conformance pack {CASE} is not present")
    ckpt = CASE / "checkpoint"
    model = Model.from_checkpoint(ckpt)
    tok = Tokenizer.for_model(model.args, ckpt)

    def uri(data: bytes) -> dict:
        return {"type": "image_url",
                "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}

    texts = [f"w{3 + k} W{5 + k}" for k in range(8)]
    chats, refs = [], []
    for k, text in enumerate(texts):
        ims = [[A], [], [B], [], [A], [], [C], []][k]  # one ~200-position span fits 256
        content = [{"type": "text", "text": text}, *(uri(x) for x in ims)]
        chats.append([{"role": "user", "content": content}])
        # the server's own prompt for the chat (the chat format: markers, the blank line
        # before an image part, the assistant's opening)
        req = parse_chat({"model": ckpt.name, "messages": chats[-1]}, tok, model_name=ckpt.name,
                         vocab_size=model.args.vocab_size, image_token_id=IMG)
        assert req.prompt_ids.count(IMG) == len(ims)
        refs.append((list(req.prompt_ids), ims))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    with _engine(model, tmp_path / "ref") as e:  # the single-process engine
        b = Batcher(e, tokenizer=tok, max_running=8)
        streams = [b.submit(ids, params, ims) for ids, ims in refs]
        while b.step():
            pass
        events = [list(s) for s in streams]
        ref = ["".join(ev.text for ev in evs) for evs in events]
        # each token's two most likely (id, logprob): where an answer differs, these tell a
        # near tie the two engines broke differently from another request's answer
        ref_top = [[[(x.token_id, round(x.logprob, 4)) for x in ev.top] for ev in evs
                    if ev.token_id is not None] for evs in events]
        b.stop()
    roles = ("vision", "prefill", "decode", "decode")
    ports = [worker_port() for _ in roles]
    env = {**os.environ, "TVM_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dsv41.compiler.tools.cli", "serve", "--role", role, "--backend",
         "torch", "--checkpoint", str(ckpt), "--page-tokens", str(PAGE),
         "--redis-url", redis_server.url, "--port", str(port), "--log-level", "info",
         "--store", str(tmp_path / f"store-{i}")], env=env, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"worker-{i}.log", "w"))
        for i, (role, port) in enumerate(zip(roles, ports, strict=True))]
    try:
        for port, proc in zip(ports, procs, strict=True):
            _wait_up(port, proc)
        results: list = [None] * len(chats)
        tops: list = [None] * len(chats)

        def ask(i: int) -> None:
            r = httpx.post(f"http://127.0.0.1:{ports[i % 4]}/v1/chat/completions", timeout=600,
                           json={"model": ckpt.name, "messages": chats[i], "max_tokens": 4,
                                 "temperature": 0, "ignore_eos": True, "logprobs": True,
                                 "top_logprobs": 2})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            results[i] = choice["message"]["content"]
            tops[i] = [[(x["token"], round(x["logprob"], 4)) for x in t["top_logprobs"]]
                       for t in choice["logprobs"]["content"]]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wrong = {i: {"got": results[i], "got_top2": tops[i], "want": ref[i],
                     "want_top2": ref_top[i]} for i in range(len(chats)) if results[i] != ref[i]}
        assert not wrong and all(ref), f"answers differ (worker logs: {tmp_path}): {wrong}"
        m = [parse_metrics(httpx.get(f"http://127.0.0.1:{p}/metrics").text) for p in ports]
        assert m[0]['dsv41:epd_stage_requests_total{role="vision"}'] == 4
        assert m[1]['dsv41:epd_stage_requests_total{role="prefill"}'] == len(chats)
        assert m[2]['dsv41:epd_stage_requests_total{role="decode"}'] + \
            m[3]['dsv41:epd_stage_requests_total{role="decode"}'] == len(chats)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
