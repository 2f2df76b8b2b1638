"""`dsv41 serve` end to end on the compiled shared-small artifact (compiled once per session, see
conftest), talked to with the official `openai` client: chat and completions, streaming and not,
stop strings, seeds, logprobs, usage; every bad request's status and message; 16 concurrent
streams against the same requests served alone, token for token; a cancelled stream's slot
freed (seen in /metrics); the queue bound (429) and the per-request timeout; a real `dsv41 serve`
process and `dsv41 chat` driven through a pipe.

The server runs in this process (uvicorn on a thread, a free port) over one engine and batcher
for the module; greedy requests make every output exact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import worker_port

from dsv41.graph.config import load_config
from dsv41.runtime.engine import Engine
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.chat_format import messages_from_openai
from dsv41.runtime.serving.metrics import parse_metrics
from dsv41.runtime.serving.prompts import chat_prompt_ids
from dsv41.runtime.serving.tokenizer import Tokenizer

MODEL = "shared-small"
KEY = "test-key"
WAIT_S = 120  # the longest a condition is waited for (never a timing assert)
# one page holds shared-small's whole max_seq_len (128): no request leaves a complete block, so
# every request is served cold, alone or in the batch (a prefix hit runs the encoder's bounded
# replay, an approximation of its own, and would make "the same request" a different one)
PAGE = 128


def wait_for(cond, what: str):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > WAIT_S:
            raise AssertionError(f"{what} did not happen within {WAIT_S} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(small_artifact, small_case, tmp_path_factory):
    """One engine and batcher; an app without a key and one with (same batcher)."""
    ckpt = small_case.checkpoint
    args = load_config(ckpt)
    tok = Tokenizer.for_model(args, ckpt)
    engine = Engine.load(small_artifact, ckpt, store_dir=tmp_path_factory.mktemp("store"),
                         page_tokens=PAGE)
    batcher = Batcher(engine, tokenizer=tok, max_running=16, max_queue=16)
    batcher.start()
    opts = ServerOptions(model_name=MODEL, vocab_size=args.vocab_size,
                         max_seq_len=args.max_seq_len)
    open_srv = ServerThread(create_app(batcher, tok, opts)).start()
    keyed = ServerThread(create_app(batcher, tok, ServerOptions(
        model_name=MODEL, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len,
        api_key=KEY))).start()
    yield {"url": open_srv.url, "keyed": keyed.url, "tok": tok, "args": args,
           "batcher": batcher}
    open_srv.stop()
    keyed.stop()
    batcher.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0,
                         timeout=600)


def metrics(served) -> dict[str, float]:
    return parse_metrics(httpx.get(served["url"] + "/metrics").text)


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 512, n)]


NO_EOS = {"ignore_eos": True}  # exact token counts: EOS does not end these requests


def completion_tokens(client, prompt, *, stream: bool, max_tokens: int = 8, **kw):
    """(text, token strings, finish reason, usage) of a greedy completion. The small BPE's ids
    0-2 (BOS, EOS, PAD) are special: in the tokens, left out of the text."""
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, logprobs=0, stream=stream, extra_body=NO_EOS,
                                  **kw)
    if not stream:
        c = r.choices[0]
        return c.text, c.logprobs.tokens, c.finish_reason, r.usage
    text, toks, finish, usage = "", [], None, None
    for chunk in r:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                toks += c.logprobs.tokens
            finish = c.finish_reason or finish
    return text, toks, finish, usage


def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served["url"] + "/health").json() == {"status": "ok"}
    got = metrics(served)
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running",
            "dsv41:generation_tokens_per_second",
            "vllm:time_to_first_token_seconds_count"} <= set(got)


def test_chat_streaming_equals_non_streaming_with_usage_and_logprobs(served, client):
    msgs = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w3 W3w4"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.role == "assistant"
    n = len(chat_prompt_ids(served["tok"], messages_from_openai(msgs)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 6)
    lp = c.logprobs.content
    assert len(lp) == 6
    for e in lp:  # greedy: the chosen token is the most likely, logprobs sorted
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.total_tokens == n + 6


def test_completions_streaming_and_not(served, client):
    text, toks, finish, usage = completion_tokens(client, "w3 W3w4", stream=False)
    assert finish == "length" and len(toks) == 8
    n = 1 + len(served["tok"].encode("w3 W3w4"))  # BOS and the text
    assert (usage.prompt_tokens, usage.completion_tokens) == (n, 8)
    s_text, s_toks, s_finish, s_usage = completion_tokens(
        client, "w3 W3w4", stream=True, stream_options={"include_usage": True})
    assert (s_text, s_toks, s_finish) == (text, toks, finish)
    assert s_usage.completion_tokens == 8
    ids = served["tok"].encode("w3 W3w4")
    assert completion_tokens(client, [0, *ids], stream=False)[1] == toks  # ids = text + BOS


def test_stop_strings(served, client):
    text, _, _, _ = completion_tokens(client, prompt_ids(1), stream=False, max_tokens=10)
    stop = text[len(text) // 2:][:5]  # most likely across two tokens (they are 2-5 long)
    want = text[:text.find(stop)]
    for stream in (False, True):
        got, _, finish, _ = completion_tokens(client, prompt_ids(1), stream=stream,
                                              max_tokens=10, stop=[stop, "w999 W999"])
        assert (got, finish) == (want, "stop")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7"}],
                                       max_tokens=10, temperature=0, extra_body=NO_EOS)
    chat_text = r.choices[0].message.content
    cut = chat_text[len(chat_text) // 2:][:4]
    r2 = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w7"}],
                                        max_tokens=10, temperature=0, stop=cut,
                                        extra_body=NO_EOS)
    assert r2.choices[0].message.content == chat_text[:chat_text.find(cut)]
    assert r2.choices[0].finish_reason == "stop"


def test_seed_reproducibility(served, client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=prompt_ids(2), max_tokens=8,
                                         temperature=1.0, top_p=0.95, seed=seed).choices[0].text

    first = [sample(s) for s in (11, 12, 13)]
    assert [sample(s) for s in (11, 12, 13)] == first  # same seed, same tokens
    assert len(set(first)) > 1  # the seed is what decides


def test_bad_requests(served, client):
    def status_of(fn):
        with pytest.raises(openai.APIStatusError) as e:
            fn()
        err = e.value.body if isinstance(e.value.body, dict) else {}
        return e.value.status_code, err.get("message", "")

    msgs = [{"role": "user", "content": "w3"}]
    code, msg = status_of(lambda: client.chat.completions.create(model="gpt-4", messages=msgs))
    assert code == 404 and "does not exist" in msg
    code, msg = status_of(lambda: client.chat.completions.create(model=MODEL, messages=msgs,
                                                                max_tokens=-3))
    assert code == 400 and "max_tokens must be a whole number >= 1" in msg
    code, msg = status_of(lambda: client.completions.create(model=MODEL, prompt=prompt_ids(3,
                                                            1030)))
    assert code == 400 and f"max_seq_len of {served['args'].max_seq_len}" in msg
    code, msg = status_of(lambda: client.chat.completions.create(model=MODEL, messages=msgs,
                                                                n=17))
    assert code == 400 and "n must be a whole number from 1 to 16, not 17." in msg
    raw = httpx.post(served["url"] + "/v1/chat/completions", content=b'{"model": ',
                     headers={"Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(served["url"] + "/v1/nothing").status_code == 404
    for key in ("wrong", None):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        r = httpx.post(served["keyed"] + "/v1/completions", headers=headers,
                       json={"model": MODEL, "prompt": "w3", "max_tokens": 2})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    keyed = openai.OpenAI(base_url=served["keyed"] + "/v1", api_key=KEY, max_retries=0)
    r = keyed.completions.create(model=MODEL, prompt="w3", max_tokens=2, extra_body=NO_EOS)
    assert r.usage.total_tokens == 1 + len(served["tok"].encode("w3")) + 2  # BOS w3, two
    assert httpx.get(served["keyed"] + "/health").status_code == 200  # open without a key
    assert metrics(served)['dsv41:requests_rejected_total{code="400"}'] >= 4


@pytest.mark.parametrize("text", ["Write the number 0 in words, then stop.",
                                  "用中文写数字零 👩‍👩‍👧‍👦🇯🇵 then stop.\t\x07"])
def test_any_text_is_served(served, client, text):
    """The small BPE spells any text (issue 37: the stub answered 400 to plain English), and
    its chats are in DeepSeek-V4.1's format (it has the markers)."""
    msgs = [{"role": "user", "content": text}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
          "extra_body": NO_EOS}
    r = client.chat.completions.create(**kw)
    n = len(chat_prompt_ids(served["tok"], messages_from_openai(msgs)))
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 4
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body=NO_EOS)
    assert c.usage.prompt_tokens == 1 + len(served["tok"].encode(text))


def test_16_concurrent_streams_equal_each_request_alone(served, client):
    prompts = [prompt_ids(100 + k, 6 + k) for k in range(16)]
    alone = [completion_tokens(client, p, stream=True)[:2] for p in prompts]
    results: list = [None] * 16
    errors: list = []
    go = threading.Barrier(16)

    def one(k):
        try:
            go.wait()
            results[k] = completion_tokens(client, prompts[k], stream=True)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for k in range(16):
        assert results[k][:2] == alone[k], f"stream {k} differs from the request alone"
        assert results[k][2] == "length" and len(results[k][1]) == 8  # no request starved


def test_cancelled_stream_frees_its_slot(served):
    before = metrics(served)
    room = served["args"].max_seq_len - 12  # what the request would generate uncancelled
    body = {"model": MODEL, "prompt": prompt_ids(5), "max_tokens": room, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body,
                      timeout=600) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                assert metrics(served)["vllm:num_requests_running"] == 1
                break  # leaving the block closes the connection
    wait_for(lambda: metrics(served)["vllm:num_requests_running"] == 0, "the slot's release")
    after = metrics(served)
    key = 'dsv41:requests_finished_total{reason="cancelled"}'
    assert after[key] == before[key] + 1
    key = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[key] == before[key] + 1
    assert after["dsv41:batcher_cancelled_total"] == before["dsv41:batcher_cancelled_total"] + 1
    key = "vllm:generation_tokens_total"
    assert after[key] - before[key] < room


def test_queue_bound_429_and_request_timeout(small_model, served):
    """On a batcher nobody steps (never started), so what waits stays queued: the queue bound
    and the timeout are then certain, whatever the machine's speed."""
    from dsv41.runtime.engine.sampling import SamplingParams

    args, tok = served["args"], served["tok"]
    engine = Engine.from_model(small_model, weights_hash="test")  # never runs a phase here
    batcher = Batcher(engine, tokenizer=tok, max_running=1, max_queue=2)
    opts = ServerOptions(model_name=MODEL, vocab_size=args.vocab_size,
                         max_seq_len=args.max_seq_len, request_timeout_s=0.5, poll_s=0.05)
    body = {"model": MODEL, "prompt": prompt_ids(6), "max_tokens": 4, "temperature": 0}
    try:
        with ServerThread(create_app(batcher, tok, opts)) as srv:
            held = [batcher.submit(prompt_ids(7), SamplingParams(max_tokens=4))
                    for _ in range(2)]
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            for s in held:
                s.cancel()
            assert batcher.step() is False  # the cancelled requests leave the queue
            assert [s.get(0).finish.value for s in held] == ["cancelled", "cancelled"]
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 504
            assert "request timeout of 0.5 s" in r.json()["error"]["message"]
            with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as s:
                lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) == 2
            assert "request timeout" in json.loads(lines[0][6:])["error"]["message"]
            got = parse_metrics(httpx.get(srv.url + "/metrics").text)
            assert got['dsv41:requests_finished_total{reason="timeout"}'] == 2
            assert got['dsv41:requests_rejected_total{code="429"}'] == 1
            assert got['dsv41:requests_rejected_total{code="504"}'] == 2
            assert got["vllm:num_requests_waiting"] == 2  # cancelled, left at the next step
    finally:
        batcher.stop()
        engine.close()


def test_dsv41_serve_process(small_artifact, small_case, tmp_path):
    port = worker_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsv41.compiler.tools.cli", "serve", "--artifact",
         str(small_artifact),
         "--checkpoint", str(small_case.checkpoint), "--port", str(port), "--api-key", KEY,
         "--store", str(tmp_path / "store"), "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, "the server's start")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        model = c.models.list().data[0].id
        assert model == small_case.checkpoint.name  # named after the checkpoint folder
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "w3"}],
                                      max_tokens=3, temperature=0, extra_body=NO_EOS)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "summary: 1 requests finished" in out
    assert "--api-key=***" in out and KEY not in out


def test_dsv41_chat_through_a_pipe(small_artifact, small_case):
    tok = Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)
    res = subprocess.run(
        [sys.executable, "-m", "dsv41.compiler.tools.cli", "chat", "--artifact",
         str(small_artifact),
         "--checkpoint", str(small_case.checkpoint), "--max-tokens", "4", "--system", "w1"],
        input="w3 W3\n\nhello, 世界 👋\n/exit\nw9\n", capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert out.count("assistant> ") == 2  # the blank line is skipped, /exit ends before w9
    assert "error:" not in out  # the small BPE spells any text
    # history kept: the second prompt holds the system message, the first message, its reply
    # and the new message
    n1 = len(chat_prompt_ids(tok, messages_from_openai([{"role": "system", "content": "w1"},
                                                        {"role": "user", "content": "w3 W3"}])))
    m = re.search(rf"summary: 2 replies, \d+ tokens, prompts of {n1}, (\d+) tokens", out)
    assert m and int(m.group(1)) > n1 + len(tok.encode("hello, 世界 👋")), out[-2000:]


def test_dsv41_bench_serve_json(small_artifact, small_case, tmp_path, capsys):
    from dsv41.compiler.tools.cli.main import main

    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--artifact", str(small_artifact), "--checkpoint",
               str(small_case.checkpoint), "--clients", "1,2", "--requests", "1",
               "--prompt-tokens", "8", "--max-tokens", "4", "--long-streams", "2",
               "--long-prompt-tokens", "40", "--long-max-tokens", "8", "--prefill-chunk", "8",
               "--structured-clients", "1,2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["serve"]
    assert [r["clients"] for r in res["clients"]] == [1, 2]
    assert [r["completion_tokens"] for r in res["clients"]] == [4, 8]  # ignore_eos: exact
    for r in res["clients"]:
        assert r["tokens_per_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
    lp = res["long_prompt"]
    assert (lp["streams"], lp["long_prompt_tokens"]) == (2, 40) and lp["long_ttft_s"] > 0
    assert res["prefill_chunk_tokens"] == 8
    eng = res["long_prompt_engine"]  # the batcher's own measurement, chunks of 8
    # the prefill's pieces: 40 / 8 = 5 encoder chunks, then the decoder's bounded replay
    assert (eng["streams"], eng["chunk_tokens"], eng["chunks"]) == (2, 8, 6)
    # the structured-output row: the same rounds plain and json_schema (strict)
    st = res["structured"]
    assert [r["clients"] for r in st] == [1, 2]
    assert [r["plain_completion_tokens"] for r in st] == [4, 8]
    for r in st:
        assert 1 <= r["json_schema_completion_tokens"] <= 4 * r["clients"]
        assert r["json_schema_tokens_per_s"] > 0 and r["plain_tokens_per_s"] > 0
        assert r["tokens_per_s_ratio"] == r["json_schema_tokens_per_s"] / r["plain_tokens_per_s"]
    out_text = capsys.readouterr().out
    assert "summary: 1 clients" in out_text and "2 clients json_schema:" in out_text


def test_long_prompt_round_keeps_reading_every_stream(monkeypatch):
    """The bench's decoding clients never stop reading: one stream's reads go on while the
    others have not yet started (a client that blocked after its second token, as it once did
    on a barrier, saw its queued tokens in a burst and reported the wait as a stall)."""
    from dsv41.compiler.tools.bench import serve as serve_bench
    from dsv41.compiler.tools.bench.serve import ServeBenchOptions, long_prompt_round

    first_reading = threading.Event()  # the first stream has read a token past its second
    lock, calls = threading.Lock(), []

    def fake_stream(host, port, body, trace, on_token=None):
        with lock:
            calls.append(body["max_tokens"])
            first = len(calls) == 1
        if body["max_tokens"] == 2:  # the long request: two tokens
            trace.token_times += [time.perf_counter(), time.perf_counter()]
            return trace
        if not first and not first_reading.wait(10):  # a failure's bound, not a timing
            raise RuntimeError("the first stream stopped reading after its second token")
        for _ in range(body["max_tokens"]):
            trace.token_times.append(time.perf_counter())
            if on_token is not None:
                on_token(trace)
            if first and len(trace.token_times) == 3:
                first_reading.set()
        return trace

    monkeypatch.setattr(serve_bench, "stream_completion", fake_stream)
    opts = ServeBenchOptions(long_streams=3, prompt_tokens=4, long_max_tokens=6,
                             long_prompt_tokens=8)
    row = long_prompt_round("127.0.0.1", 1, "m", opts, 64, np.random.default_rng(0))
    assert row.streams == 3 and sorted(calls) == [2, 6, 6, 6]
