"""`n` samples of one prompt (issue 41, item 2): the prompt prefilled once, its rows forked per
sample (`DecodeBatch.start_samples`), each sample its own seed stream; then the same through the
batcher and the OpenAI API with the official `openai` client (`n`, `best_of`), and a cancelled
n-request freeing every row it held.

Engine tests run on the compiled shared-small artifact (conftest compiles it once); the server
tests reuse test_serve's module fixtures (one engine, batcher and app; one page of 128 holds the
whole max_seq_len, so every request is served cold and greedy outputs are exact)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import test_serve

from dsv41.runtime.engine import DecodeBatch, Engine
from dsv41.runtime.engine.batch import sample_request
from dsv41.runtime.engine.requests import RequestError, TurnLimits, check_turn
from dsv41.runtime.engine.sampling import SamplingParams, sample_seed
from dsv41.runtime.serving.batcher import Batcher

PAGE = 128


def prompt_ids(seed: int, n: int = 12) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 512, n)]


@pytest.fixture(scope="module")
def engine(small_artifact, small_case):
    e = Engine.load(small_artifact, small_case.checkpoint, page_tokens=PAGE)
    yield e
    e.close()


def turn_request(engine, prompt, params):
    a = engine.model.args
    return check_turn(prompt, TurnLimits(a.vocab_size, a.max_seq_len, 0), sampling=params)


def decode_all(batch: DecodeBatch) -> None:
    while len(batch):
        for s, t in batch.step():
            if t.done:
                batch.leave(s)


def test_sample_seed_derivation():
    assert sample_seed(None, 3) is None and sample_seed(7, 0) == 7
    seeds = [sample_seed(7, i) for i in range(16)]
    assert len(set(seeds)) == 16 and seeds == [sample_seed(7, i) for i in range(16)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(8, 1) != sample_seed(7, 1)


@pytest.fixture(scope="module")
def graph_engine(small_model):
    e = Engine.from_model(small_model, weights_hash="f" * 64, page_tokens=PAGE)
    yield e
    e.close()


@pytest.mark.parametrize("backend", ["artifact", "graph"])
def test_forked_rows_decode_as_independent_prefills(backend, request):
    """4 seeded samples of one prompt, on the compiled artifact and on the PyTorch graph:
    prefilled once (the engine's prefilled tokens grow by the prompt alone), each sample's
    tokens exactly those of a fresh session prefilling the prompt itself with the sample's
    derived seed."""
    engine = request.getfixturevalue("engine" if backend == "artifact" else "graph_engine")
    prompt = prompt_ids(1)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    req = turn_request(engine, prompt, params)
    before = dict(engine.token_counts)
    batch = DecodeBatch(engine, max_rows=8)
    samples = batch.start_samples(engine.session(), req, 4)
    assert engine.token_counts["prefilled"] - before["prefilled"] == len(prompt)
    assert len(batch) == 4 and engine.stats().sessions_live >= 4
    first = samples[0][1].record
    assert first.prefilled == len(prompt) and first.forked_from is None
    for s, t in samples[1:]:
        assert t.record.prefilled == 0 and t.record.forked_from == samples[0][0].id
        assert s.stores is False
    decode_all(batch)
    got = [list(t.tokens) for _, t in samples]
    assert all(len(g) == 10 for g in got)
    assert len({tuple(g) for g in got}) > 1  # four seed streams, not one
    for i, g in enumerate(got):
        alone = engine.session()
        want = list(alone.send(prompt, sampling=sample_request(req, i).sampling))
        alone.close()
        assert g == want, f"sample {i} differs from its own prefill"
    for s, _ in samples:
        s.close()
    batch.close()
    assert engine.stats().sessions_live == 0


def test_only_sample_0_is_stored_in_the_tiers(small_artifact, small_case, tmp_path):
    """With an SSD store and the DRAM pool, the samples' turns end like any turn, but only
    sample 0's history reaches the tiers: one snapshot in the pool, and sample 0's transcript
    resumes from it while another sample's is served cold."""
    e = Engine.load(small_artifact, small_case.checkpoint, store_dir=tmp_path / "store",
                    page_tokens=PAGE)
    try:
        prompt = prompt_ids(5)
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=4, ignore_eos=True)
        batch = DecodeBatch(e, max_rows=4)
        samples = batch.start_samples(e.session(), turn_request(e, prompt, params), 3)
        decode_all(batch)
        transcripts = [s.transcript for s, _ in samples]
        assert len({tuple(t) for t in transcripts}) == 3
        for s, _ in samples:
            s.close()
        batch.close()
        assert e.pool.stats().entries == 1
        tiers = []
        for t in transcripts[:2]:
            s = e.session(t)
            list(s.send([7], max_new_tokens=1))
            tiers.append(s.turns[-1].tier)
            s.close()
        assert tiers == ["snapshot", "cold"]
    finally:
        e.close()


def test_samples_done_at_the_first_token_never_join(engine):
    """max_tokens 1: every sample ends at its prefill's token; nothing joins the batch."""
    req = turn_request(engine, prompt_ids(2), SamplingParams(temperature=0, max_tokens=1))
    batch = DecodeBatch(engine, max_rows=4)
    samples = batch.start_samples(engine.session(), req, 3)
    assert len(batch) == 0 and [len(t.tokens) for _, t in samples] == [1, 1, 1]
    assert len({t.tokens[0] for _, t in samples}) == 1  # greedy: one token
    assert all(t.ended for _, t in samples)
    for s, _ in samples:
        s.close()
    batch.close()
    longer = turn_request(engine, prompt_ids(2), SamplingParams(temperature=0, max_tokens=5))
    b2 = DecodeBatch(engine, max_rows=4)
    held = b2.start_samples(engine.session(), longer, 2)
    late = engine.session()
    with pytest.raises(ValueError, match="The decode batch has 2 free rows; 3 samples need one "
                       "each."):
        b2.start_samples(late, longer, 3)
    assert late.turns == [] and len(b2) == 2  # refused before any prefill
    late.close()
    b2.close()
    for s, _ in held:
        s.close()
    assert engine.stats().sessions_live == 0


def test_batcher_queues_n_samples_until_their_rows_are_free(engine):
    """A request of 4 samples on a batcher of 4 rows, one of them busy: it waits (4 queued)
    until the running request leaves, then runs as 4 rows, its prompt prefilled once. More
    samples than the batcher has rows, or more than 16, are refused at submit."""
    b = Batcher(engine, max_running=4, max_queue=4)
    try:
        busy = b.submit(prompt_ids(3), SamplingParams(temperature=0, max_tokens=4,
                                                      ignore_eos=True))
        b.step()
        assert (b.stats().running, b.stats().queued) == (1, 0)
        prompt = prompt_ids(4)
        before = engine.token_counts["prefilled"]
        group = b.submit_samples(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=3,
                                                        ignore_eos=True), 4)
        assert (b.stats().running, b.stats().queued) == (1, 4)
        b.step()
        assert (b.stats().running, b.stats().queued) == (1, 4)  # 3 rows free: it waits
        while not busy.done:
            b.step()
        b.step()
        assert (b.stats().running, b.stats().queued) == (4, 0)
        assert engine.token_counts["prefilled"] - before == len(prompt)
        while b.step():
            pass
        events = []
        while (ev := group.get(0)) is not None:
            events.append(ev)
        assert sorted(e.index for e in events if e.token_id is not None) == [0] * 3 + [1] * 3 \
            + [2] * 3 + [3] * 3
        assert [e.finish.value for e in events if e.finish] == ["length"] * 4
        with pytest.raises(RequestError, match=r"^5 samples need 5 rows of the running batch "
                           r"at once; this server runs at most 4 \(max_running\)\.$"):
            b.submit_samples(prompt, SamplingParams(max_tokens=2), 5)
        with pytest.raises(RequestError, match=r"^A request takes 1 to 16 samples, not 17\.$"):
            b.submit_samples(prompt, SamplingParams(max_tokens=2), 17)
    finally:
        b.stop()
    assert engine.stats().sessions_live == 0


# ---- the OpenAI API (test_serve's server: max_running 16) ---------------------------------------

served, client = test_serve.served, test_serve.client
MODEL, NO_EOS = test_serve.MODEL, test_serve.NO_EOS


def completions(client, *, n: int, seed: int | None, stream: bool = False, **kw):
    """(texts by index, token strings by index, finish reasons, usage) of a completion."""
    r = client.completions.create(model=MODEL, prompt=prompt_ids(20), max_tokens=6, n=n,
                                  seed=seed, logprobs=0, stream=stream, extra_body=NO_EOS, **kw)
    if not stream:
        assert [c.index for c in r.choices] == list(range(n))
        return ([c.text for c in r.choices], [c.logprobs.tokens for c in r.choices],
                [c.finish_reason for c in r.choices], r.usage)
    texts, toks, finish, usage = [""] * n, [[] for _ in range(n)], [None] * n, None
    for chunk in r:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            toks[c.index] += c.logprobs.tokens if c.logprobs else []
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, toks, finish, usage


def test_n4_seeded_streaming_and_not(served, client):
    """n=4 seeded: 4 choices of 6 tokens, the same seed the same 4 (streamed or not), sample 0
    the n=1 request's (its seed is the request's own), the others their own streams; the
    usage counts the prompt once and every choice's tokens."""
    one = completions(client, n=1, seed=5)
    got = completions(client, n=4, seed=5)
    assert got[1] == completions(client, n=4, seed=5)[1]
    streamed = completions(client, n=4, seed=5, stream=True,
                           stream_options={"include_usage": True})
    assert streamed[:3] == got[:3]
    assert got[1][0] == one[1][0] and got[2] == ["length"] * 4
    assert len({tuple(t) for t in got[1]}) > 1
    assert (got[3].prompt_tokens, got[3].completion_tokens) == (one[3].prompt_tokens, 24)
    assert (streamed[3].prompt_tokens, streamed[3].completion_tokens) == (
        one[3].prompt_tokens, 24)


def test_greedy_n4_chat_is_four_times_the_n1_answer_prefilled_once(served, client):
    engine = served["batcher"].engine
    msgs = [{"role": "user", "content": "w3 w1"}]
    kw = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0,
          "extra_body": NO_EOS}
    one = client.chat.completions.create(**kw)
    before = engine.token_counts["prefilled"]
    four = client.chat.completions.create(**kw, n=4)
    assert engine.token_counts["prefilled"] - before == one.usage.prompt_tokens
    assert [c.message.content for c in four.choices] == [one.choices[0].message.content] * 4
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, n=4, stream=True))
    texts, roles = [""] * 4, [0] * 4
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
    assert texts == [one.choices[0].message.content] * 4 and roles == [1] * 4


def test_best_of_returns_the_n_best_samples_by_mean_logprob(served, client):
    """best_of=4, n=2 draws the 4 samples n=4 draws with the same seed (one seed stream per
    sample) and returns the 2 of highest mean token logprob, best first."""
    r4 = client.completions.create(model=MODEL, prompt=prompt_ids(21), max_tokens=6, n=4,
                                   seed=9, logprobs=0, extra_body=NO_EOS)
    means = [float(np.mean(c.logprobs.token_logprobs)) for c in r4.choices]
    order = sorted(range(4), key=lambda i: -means[i])[:2]
    best = client.completions.create(model=MODEL, prompt=prompt_ids(21), max_tokens=6, n=2,
                                     best_of=4, seed=9, extra_body=NO_EOS)
    assert [c.text for c in best.choices] == [r4.choices[i].text for i in order]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None  # not asked for: used for the rank alone
    assert best.usage.completion_tokens == 24  # every sample's tokens


@pytest.mark.parametrize("extra, match", [
    ({"n": 17}, "n must be a whole number from 1 to 16, not 17."),
    ({"n": 0}, "n must be a whole number from 1 to 16, not 0."),
    ({"n": 3, "best_of": 2}, "best_of (2) must be at least n (3): the n best of best_of "
     "samples are returned."),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of cannot be streamed"),
])
def test_bad_n_is_a_400(served, extra, match):
    body = {"model": MODEL, "prompt": prompt_ids(22), "max_tokens": 2, **extra}
    r = httpx.post(served["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and match in r.json()["error"]["message"]
    assert r.json()["error"]["param"] in ("n", "best_of")


def test_cancelled_n4_request_frees_all_four_rows(served):
    """A streamed n=4 request holds 4 rows (the batcher's running count and /metrics'
    `vllm:num_requests_running`, which counts the batch's rows); the client leaving frees all
    four, every sample counted cancelled by the batcher, the request once as aborted."""
    b = served["batcher"]
    before, cancelled = test_serve.metrics(served), b.stats().cancelled
    room = served["args"].max_seq_len - 12
    body = {"model": MODEL, "prompt": prompt_ids(23), "max_tokens": room, "ignore_eos": True,
            "temperature": 1.0, "seed": 1, "n": 4, "stream": True}
    with httpx.stream("POST", served["url"] + "/v1/completions", json=body, timeout=600) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if seen == {0, 1, 2, 3}:
                assert b.stats().running == 4
                assert test_serve.metrics(served)["vllm:num_requests_running"] == 4
                break  # leaving the block closes the connection
    test_serve.wait_for(lambda: b.stats().running == 0, "the rows' release")
    after = test_serve.metrics(served)
    assert after["vllm:num_requests_running"] == 0 and b.stats().cancelled == cancelled + 4
    # four rows cancelled, one request aborted
    key = "dsv41:batcher_cancelled_total"
    assert after[key] == before[key] + 4
    key = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[key] == before[key] + 1
    assert b.engine.stats().sessions_live == 0


class OneSample:
    """A frontend without `submit_samples` (as the EPD gateway): requests of one sample only."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher

    def submit(self, prompt_ids, params, images=()):
        return self.batcher.submit(prompt_ids, params, images)

    def stats(self):
        return self.batcher.stats()


def test_a_frontend_of_one_sample_answers_n_with_a_400(served):
    from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app

    a = served["args"]
    opts = ServerOptions(model_name=MODEL, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len)
    with ServerThread(create_app(OneSample(served["batcher"]), served["tok"], opts)) as srv:
        body = {"model": MODEL, "prompt": prompt_ids(24), "max_tokens": 2, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={**body, "n": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "This server's frontend serves one sample per request; n and best_of must be 1, not 2.")
