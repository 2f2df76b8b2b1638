"""The continuous batcher (runtime/batcher.py) over the engine's DecodeBatch, on shared-small's
PyTorch graph and, in one test, its compiled artifact: batched requests give each request's
own tokens, seeded sampling ignores its neighbours, requests join and leave between steps
(exact rows), cancel, queue bound, the runtime budget, bad requests, stop strings.

shared-small: 6 layers, window 16, max_seq_len 128, vocabulary 512; pages of 8, prefill chunks
of 8 (so prompts over 8 tokens interleave their chunks with decode steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.runtime.engine import DecodeBatch, Engine
from dsv41.runtime.engine.requests import RequestError, TurnLimits, check_turn
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher, FinishReason, QueueFull
from dsv41.runtime.serving.tokenizer import Tokenizer

PAGE, CHUNK = 8, 8


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


# 16 requests of one chunk each (2..9 tokens), max_tokens 2..5 (EOS ignored: lengths are
# exact), then LONG (index 16): 33 tokens, four chunks
REQUESTS = [(_ids(2 + i % 8, i), 2 + i % 4) for i in range(16)] + [(_ids(33, 16), 3)]
LONG = 16


def _engine(model, **kw):
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE,
                             prefill_chunk_tokens=CHUNK, **kw)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _run(batcher: Batcher) -> int:
    steps = 0
    while batcher.step():
        steps += 1
    return steps


def _events(stream):
    events = list(stream)
    assert events[-1].finish is not None and all(e.finish is None for e in events[:-1])
    return events


def _tokens(stream) -> list[int]:
    return [e.token_id for e in _events(stream) if e.token_id is not None]


@pytest.fixture(scope="module")
def alone(small_model):
    """Each request served alone: Session.send with today's greedy (temperature 0), one engine
    with the same pages and chunks."""
    e = _engine(small_model)
    out = []
    for ids, n in REQUESTS:
        s = e.session()
        out.append(list(s.send(ids, max_new_tokens=n)))
        s.close()
    return out


def test_greedy_sampling_params_equal_todays_greedy(small_model, alone):
    e = _engine(small_model)
    for (ids, n), ref in list(zip(REQUESTS, alone, strict=True))[8:10]:
        s = e.session()
        assert list(s.send(ids, max_new_tokens=99, sampling=_greedy(n))) == ref
        s.close()


def _expected_running(ns: list[int]) -> list[int]:
    """The running count after each step of the batcher over single-chunk requests."""
    queue, alive, trace = list(ns), [], []
    while queue or alive:
        if queue:
            alive.append([1, queue.pop(0)])
        for a in alive:
            a[0] += 1
        alive = [a for a in alive if a[0] < a[1]]
        trace.append(len(alive))
    return trace


def test_sixteen_concurrent_requests_equal_each_alone(small_model, alone):
    e = _engine(small_model)
    b = Batcher(e, max_running=16)
    streams = [b.submit(ids, _greedy(n)) for ids, n in REQUESTS[:16]]
    assert b.stats().queued == 16
    running = []
    while True:
        more = b.step()
        running.append(b.stats().running)
        if not more:
            break
    # one admission per step (its first token from the prefill, its second from the step's
    # decode), the others leaving each at its own length
    assert running == _expected_running([n for _, n in REQUESTS[:16]])
    assert max(running) == 2
    for stream, ref, (_, n) in zip(streams, alone[:16], REQUESTS[:16], strict=True):
        events = _events(stream)
        assert [ev.token_id for ev in events] == ref
        assert events[-1].finish is FinishReason.LENGTH and len(ref) == n
        assert stream.done and stream.timing.completion_tokens == n
    st = b.stats()
    assert (st.finished, st.cancelled, st.queued, st.running) == (16, 0, 0, 0)
    assert st.completion_tokens == sum(n for _, n in REQUESTS[:16])
    assert st.prompt_tokens == sum(len(ids) for ids, _ in REQUESTS[:16])
    assert st.tiers == {"cold": 16}
    assert e.runtime_bytes() == 0 and e.stats().sessions_live == 0  # every row let go


def test_join_and_leave_mid_decode_leave_the_others_unchanged(small_model, alone):
    e = _engine(small_model)
    b = Batcher(e)
    first = [b.submit(*_req(i)) for i in (7, 15)]  # 5 tokens each
    b.step()
    assert (b.stats().running, b.stats().queued) == (1, 1)  # 7 decodes, 15 waits
    b.step()
    leaving = b.submit(*_req(4))  # 2 tokens: joins, decodes once, leaves
    long = b.submit(*_req(LONG))  # its 4 chunks interleave with the running decode
    b.step()
    assert b.stats().running == 2 and leaving.done  # left while the others decode
    assert [s.timing.completion_tokens for s in first] == [4, 3]
    b.step()  # LONG: a decode step of the batch after each of its 4 chunks but the last and
    # after its encoder pass (before the decoder's replay): four, which end both
    assert len(long.timing.prefill_chunk_s) == 4
    assert all(s.done for s in first) and long.timing.completion_tokens == 2
    _run(b)
    for stream, i in zip([*first, leaving, long], (7, 15, 4, LONG), strict=True):
        assert _tokens(stream) == alone[i]


def _req(i: int):
    ids, n = REQUESTS[i]
    return ids, _greedy(n)


def test_decode_batch_rows_join_and_leave_by_one_row(small_model):
    """Rows are slots: a leaving row is replaced by the last one (one row moved), the others
    stay where they are; the stacked cache grows by doubling rows."""
    e = _engine(small_model)
    batch = DecodeBatch(e)
    sessions = [e.session() for _ in range(3)]
    for s, (ids, _) in zip(sessions, REQUESTS[3:6], strict=True):
        batch.start(s, check_turn(ids, TurnLimits(512, 128, 0), max_new_tokens=5))
        assert s.cache is None  # the batch's row is the sequence's cache now
    assert [m[0] for m in batch.members] == sessions and batch.cache.batch == 4
    batch.step()
    last = {k: v[2].clone() for k, v in
            {"kv": batch.cache.stores[1].kv_codes, "ring": batch.cache.windows[0].codes}.items()}
    pos = batch.cache.pos[:3].tolist()
    batch.leave(sessions[0])
    assert [m[0] for m in batch.members] == [sessions[2], sessions[1]]
    assert batch.cache.pos[:2].tolist() == [pos[2], pos[1]]
    assert torch.equal(batch.cache.stores[1].kv_codes[0], last["kv"])
    assert torch.equal(batch.cache.windows[0].codes[0], last["ring"])
    assert sessions[0].turns[-1].decoded == 1 and sessions[0].pending is not None
    batch.close()
    assert e.runtime_bytes() == sum(sum(s.cache.nbytes().values()) for s in sessions)


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(small_model):
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7, max_tokens=5,
                            ignore_eos=True, logprobs=2)
    ids = REQUESTS[LONG][0]
    b = Batcher(_engine(small_model))
    solo = b.submit(ids, params)
    _run(b)
    ref = _events(solo)
    b = Batcher(_engine(small_model))
    others = [b.submit(*_req(i)) for i in (2, 9)]
    shared = b.submit(ids, params)
    noisy = b.submit(REQUESTS[3][0], SamplingParams(temperature=1.0, seed=1, max_tokens=4))
    _run(b)
    got = _events(shared)
    assert [ev.token_id for ev in got] == [ev.token_id for ev in ref]
    assert [ev.logprob for ev in got] == pytest.approx([ev.logprob for ev in ref], abs=1e-6)
    assert all(len(ev.top) == 2 and ev.logprob <= 0 for ev in got)
    assert all(s.done for s in [*others, noisy])


def test_cancel_frees_the_slot_and_ends_the_stream_cancelled(small_model):
    e = _engine(small_model)
    b = Batcher(e)
    a, c = (b.submit(REQUESTS[i][0], _greedy(30)) for i in (5, LONG))
    b.step()
    b.step()
    assert b.stats().running == 2
    a.cancel()
    a.cancel()  # idempotent
    b.step()
    st = b.stats()
    assert (st.running, st.cancelled) == (1, 1) and e.stats().sessions_live == 1
    events = _events(a)
    assert events[-1].finish is FinishReason.CANCELLED and events[-1].token_id is None
    assert len(events) >= 3 and a.done
    c.cancel()
    _run(b)
    assert _events(c)[-1].finish is FinishReason.CANCELLED
    # a request cancelled while it waits never runs
    w = b.submit(*_req(3))
    w.cancel()
    _run(b)
    assert [ev.finish for ev in _events(w)] == [FinishReason.CANCELLED]
    st = b.stats()
    assert (st.cancelled, st.finished, st.tiers) == (3, 0, {"cold": 2})
    assert e.runtime_bytes() == 0


def test_queue_bound_raises_queue_full(small_model):
    b = Batcher(_engine(small_model), max_queue=2)
    b.submit(*_req(0))
    b.submit(*_req(1))
    with pytest.raises(QueueFull, match="bound"):
        b.submit(*_req(2))
    assert b.stats().queued == 2


def test_a_request_that_does_not_fit_the_budget_waits(small_model, alone):
    probe = _engine(small_model)
    one = probe.cache_bytes(len(REQUESTS[LONG][0]) + REQUESTS[LONG][1] + 1)
    # room for one request's cache and its batch row, not for a second's as well
    e = _engine(small_model, cache_budget_bytes=3 * one - 1)
    b = Batcher(e)
    first, second = b.submit(*_req(LONG)), b.submit(*_req(10))
    b.step()
    assert (b.stats().running, b.stats().queued) == (1, 1)
    while not first.done:
        b.step()
        assert b.stats().queued == 1 or first.done
    _run(b)
    assert _tokens(first) == alone[LONG] and _tokens(second) == alone[10]
    big = [5] * 100  # 121 positions: never fits, refused at submit
    assert 2 * probe.cache_bytes(121) > 3 * one - 1
    with pytest.raises(RequestError, match="bytes of runtime cache"):
        b.submit(big, _greedy(20))


def test_bad_requests_raise_before_anything_ran(small_model):
    e = _engine(small_model)
    b = Batcher(e)
    ids = REQUESTS[0][0]
    for prompt, params, msg in [
            (ids, SamplingParams(temperature=3.0), "temperature"),
            (ids, SamplingParams(top_p=0.0), "top_p"),
            (ids, SamplingParams(logprobs=21), "logprobs"),
            (ids, SamplingParams(stop_token_ids=(600,)), "outside the model"),
            (ids, SamplingParams(stop=("x",)), "no tokenizer"),
            (ids, {"temperature": 0}, "SamplingParams"),
            ([1, 512], _greedy(2), "must lie in"),
            ([], _greedy(2), "non-empty"),
            (ids, _greedy(127), "max_seq_len"),
            ([5] * 128, SamplingParams(), "no room")]:
        with pytest.raises(RequestError, match=msg):
            b.submit(prompt, params)
    st = b.stats()  # nothing queued, ran or counted; no cache held
    assert (st.queued, st.running, st.finished, st.cancelled, st.prompt_tokens,
            st.completion_tokens, dict(st.tiers), dict(st.tier_tokens), st.cache_bytes) == \
        (0, 0, 0, 0, 0, 0, {}, {}, 0)
    assert e.stats().tiers["cold"] == 0 and e.runtime_bytes() == 0
    s = e.session()
    with pytest.raises(RequestError, match="inside sampling"):
        s.send(ids, temperature=0.5, sampling=_greedy(2))
    with pytest.raises(RequestError, match="stop ids only"):
        s.send(ids, sampling=SamplingParams(stop=("w1",)))


def test_stop_strings_end_with_stop_and_are_not_emitted(small_model):
    tok = Tokenizer.for_model(small_model.args)
    ids, _ = REQUESTS[LONG]
    b = Batcher(_engine(small_model), tokenizer=tok)
    full = b.submit(ids, _greedy(6))
    _run(b)
    events = _events(full)
    toks = [ev.token_id for ev in events]
    text = "".join(ev.text for ev in events)
    assert text == tok.decode(toks)
    stop = text[len(tok.decode(toks[:2])) + 1:][:4]  # from inside token 3: across tokens
    cut = text.index(stop)
    ends = next(k for k in range(1, 7) if stop in tok.decode(toks[:k]))  # where it completes
    stopped = b.submit(ids, _greedy(6, stop=(stop, "never")))
    _run(b)
    events = _events(stopped)
    assert events[-1].finish is FinishReason.STOP and len(events) == ends < 6
    assert "".join(ev.text for ev in events) == text[:cut]
    assert stop not in "".join(ev.text for ev in events)


def test_the_thread_serves_streams_and_stop_cancels_the_rest(small_model, alone):
    b = Batcher(_engine(small_model))
    b.start()
    done = b.submit(*_req(1))
    assert _tokens(done) == alone[1]  # iterating blocks until the thread has stepped
    running = b.submit(REQUESTS[2][0], _greedy(100))
    first = running.get(timeout=600)  # a guard against a hang, not a timing
    assert first is not None and first.finish is None
    b.stop()
    rest = _events(running)
    assert rest[-1].finish is FinishReason.CANCELLED and running.done
    assert b.stats().cancelled == 1 and b.stats().finished == 1
    with pytest.raises(RequestError, match="stopped"):
        b.submit(*_req(1))


def test_a_finished_request_is_stored_and_the_next_sharing_its_prefix_hits(small_model,
                                                                             tmp_path):
    e = _engine(small_model, store_dir=tmp_path / "store")
    b = Batcher(e)
    ids = REQUESTS[LONG][0]  # 33 tokens: 4 blocks of 8, then a snapshot
    first = b.submit(ids, _greedy(3))
    _run(b)
    toks = _tokens(first)
    e.flush()
    nxt = b.submit(ids + toks + [7, 8], _greedy(2))
    _run(b)
    # the first turn's history (prompt + the 2 tokens fed back) is what the tiers serve
    assert (nxt.timing.tier, nxt.timing.reused_tokens) == ("snapshot", 35)
    assert b.stats().tiers == {"cold": 1, "snapshot": 1}
    assert e.stats().store.entries >= 4
    e.close()


def test_compiled_artifact_batches_like_the_graph(small_artifact, small_case):
    """The compiled decode entry (batch bound 64, caches written in place) under the batcher:
    requests at different lengths joining and leaving give each request's tokens alone."""
    def engine():
        return Engine.load(small_artifact, small_case.checkpoint, page_tokens=PAGE,
                           prefill_chunk_tokens=CHUNK)

    picks = (4, LONG, 10, 5)
    ref = []
    e = engine()
    for i in picks:
        b = Batcher(e)
        s = b.submit(*_req(i))
        _run(b)
        ref.append(_tokens(s))
    b = Batcher(engine())
    streams = [b.submit(*_req(i)) for i in picks]
    _run(b)
    assert [_tokens(s) for s in streams] == ref
    assert [len(r) for r in ref] == [REQUESTS[i][1] for i in picks]
