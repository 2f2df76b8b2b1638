"""One request never fails the batch (issue 38): a row whose next token cannot be chosen (NaN
logits, a constraint's own error), or whose text cannot be made (a token the tokenizer does not
have, a stop-string failure), ends alone with a clear error; the other rows of the same decode
batch go on and produce exactly the tokens they produce alone. Faults are injected at the real
code path: NaN written into one request's logits as its sampler reads them (the request marked
by its seed), a constraint that raises, a tokenizer with fewer ids than the model, a stop
matcher that raises.

shared-small (vocabulary 512); pages of 8, prefill chunks of 8; greedy requests, EOS ignored
(lengths exact)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dsv41.graph.config import preset
from dsv41.graph.vocab import SMALL_STUB_JSON, TokenizerSource
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.records import Tier, TurnRecord
from dsv41.runtime.engine.sampling import Sampler, SamplingParams, StopMatcher
from dsv41.runtime.engine.turn import Turn, TurnFailed
from dsv41.runtime.serving.batcher import Batcher, FinishReason
from dsv41.runtime.serving.tokenizer import Tokenizer

PAGE, CHUNK = 8, 8
POISON_SEED = 4242  # marks the request whose logits the hook poisons
NAN_ERROR = "The model's logits hold NaN or +inf values: no token can be sampled from them."


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


# two requests whose outputs (greedy: [114, 252, 104, 3] and [234, 185, 239]) stay below id
# 256, and a third whose second token (383) does not
GOOD = [(_ids(3, 0), 4), (_ids(9, 6), 3)]
BAD_PROMPT = _ids(4, 1)


def _engine(model) -> Engine:
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE,
                             prefill_chunk_tokens=CHUNK)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _run(b: Batcher) -> None:
    while b.step():
        pass


def _events(stream):
    events = list(stream)
    assert events[-1].finish is not None and all(e.finish is None for e in events[:-1])
    return events


def _tokens(stream) -> list[int]:
    return [e.token_id for e in _events(stream) if e.token_id is not None]


@pytest.fixture(scope="module")
def solo(small_model):
    """The GOOD requests' tokens, each served alone."""
    out = []
    for ids, n in GOOD:
        b = Batcher(_engine(small_model))
        s = b.submit(ids, _greedy(n))
        _run(b)
        out.append(_tokens(s))
    return out


def _batch_of_three(small_model, bad_params, *, tokenizer=None, bad_prompt=BAD_PROMPT):
    """GOOD[0], the bad request, GOOD[1], submitted together (the bad one in the middle row);
    every step run. Returns (engine, batcher, good streams, bad stream)."""
    e = _engine(small_model)
    b = Batcher(e, tokenizer=tokenizer)
    first = b.submit(GOOD[0][0], _greedy(GOOD[0][1]))
    bad = b.submit(bad_prompt, bad_params)
    last = b.submit(GOOD[1][0], _greedy(GOOD[1][1]))
    _run(b)
    return e, b, [first, last], bad


def _assert_alone(e, b, good, solo):
    """The good streams' events: their solo tokens, ended by their length."""
    events = [_events(s) for s in good]
    assert [[ev.token_id for ev in evs] for evs in events] == solo
    assert [evs[-1].finish for evs in events] == [FinishReason.LENGTH] * 2
    st = b.stats()
    assert (st.finished, st.cancelled, st.running, st.queued) == (3, 0, 0, 0)
    assert e.runtime_bytes() == 0 and e.stats().sessions_live == 0  # every row let go
    return events


def _poison(monkeypatch, at: int) -> None:
    """NaN in one logit of the POISON_SEED request's row when it samples output token `at`
    (0: the token of its prefill)."""
    real = Sampler.sample

    def sample(self, logits, generated=(), prompt=()):
        if self.params.seed == POISON_SEED and len(generated) == at:
            logits = logits.clone()
            logits[7] = math.nan
        return real(self, logits, generated, prompt)

    monkeypatch.setattr(Sampler, "sample", sample)


POISONED = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=4, ignore_eos=True)


def test_nan_logits_in_one_decode_row_fail_that_request_alone(small_model, solo, monkeypatch):
    """The break: NaN probabilities in one row at its first decode step failed the whole decode
    batch (every stream ended with "The decode step failed")."""
    _poison(monkeypatch, at=1)
    e, b, good, bad = _batch_of_three(small_model, POISONED)
    _assert_alone(e, b, good, solo)
    events = _events(bad)
    assert len(events) == 2 and events[0].token_id is not None  # its prefill's token went out
    last = events[-1]
    assert (last.token_id, last.finish, last.error) == (None, FinishReason.ERROR, NAN_ERROR)


def test_nan_logits_at_one_prefill_fail_that_request_alone(small_model, solo, monkeypatch):
    """The same fault in a request's prefill (its first token), between the others' prefills
    and decode steps: it ends with the clear error and no token."""
    _poison(monkeypatch, at=0)
    e, b, good, bad = _batch_of_three(small_model, POISONED)
    _assert_alone(e, b, good, solo)
    events = _events(bad)
    assert [(ev.token_id, ev.finish, ev.error) for ev in events] == \
        [(None, FinishReason.ERROR, NAN_ERROR)]


class _ExplodingConstraint:
    """Allows every token for the first output token, then its own code fails (a bug)."""

    vocab_size = 512

    def start(self):
        return 0

    def allowed(self, state):
        if state >= 1:
            raise RuntimeError("the grammar's table is corrupt")
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def advance(self, state, token):
        return state + 1


def test_a_constraint_that_raises_fails_its_request_alone(small_model, solo):
    e, b, good, bad = _batch_of_three(small_model,
                                      _greedy(4, constraint=_ExplodingConstraint()))
    _assert_alone(e, b, good, solo)
    events = _events(bad)
    assert len(events) == 2
    assert (events[-1].finish, events[-1].error) == (
        FinishReason.ERROR,
        "Sampling this request's next token failed (RuntimeError: the grammar's table is "
        "corrupt).")


def test_a_token_the_tokenizer_lacks_fails_its_request_alone(small_model, solo, tmp_path):
    """A tokenizer with fewer ids than the model (a padded vocabulary): the request that
    samples an id past it (383, its second token) ends with the decoder's error; the others'
    text is theirs."""
    import json

    spec = json.loads(SMALL_STUB_JSON.read_text())
    spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if v < 256}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    tok = Tokenizer.from_file(path, preset("small"), TokenizerSource.SMALL_STUB)
    assert tok.n_ids == 256
    e, b, good, bad = _batch_of_three(small_model, _greedy(4), tokenizer=tok)
    for evs, ref in zip(_assert_alone(e, b, good, solo), solo, strict=True):
        assert "".join(ev.text for ev in evs) == tok.decode(ref)
    events = _events(bad)
    assert [ev.token_id for ev in events] == [120, None]
    assert (events[-1].finish, events[-1].error) == (
        FinishReason.ERROR,
        "The request failed at token 2 of its output: Token id 383 is outside the "
        "tokenizer's 256 ids.")


def test_a_stop_matcher_failure_fails_its_request_alone(small_model, solo, monkeypatch):
    """A stop-string check that raises at the request's second token (a decode step's)."""
    real = StopMatcher.feed

    def feed(self, delta):
        self.calls = getattr(self, "calls", 0) + 1
        if "boom" in self.stops and self.calls == 2:
            raise RuntimeError("the stop matcher broke")
        return real(self, delta)

    monkeypatch.setattr(StopMatcher, "feed", feed)
    tok = Tokenizer.from_file(SMALL_STUB_JSON, preset("small"), TokenizerSource.SMALL_STUB)
    e, b, good, bad = _batch_of_three(small_model, _greedy(4, stop=("boom",)), tokenizer=tok)
    _assert_alone(e, b, good, solo)
    events = _events(bad)
    assert [ev.token_id for ev in events] == [120, None]
    assert (events[-1].finish, events[-1].error) == (
        FinishReason.ERROR, "The request failed at token 2 of its output: the stop matcher "
        "broke")


def _turn(sampler: Sampler | None, temperature: float = 0.0) -> Turn:
    rec = TurnRecord(session=1, turn=1, tier=Tier.COLD, prefilled=0, replayed=0,
                     decoder_replayed=0, decoded=0, token_layers=0, cached_blocks=0)
    return Turn(rec, 8, frozenset({1}), temperature, torch.Generator().manual_seed(0), False,
                sampler)


@pytest.mark.parametrize("sampler,temperature", [
    (Sampler(SamplingParams(temperature=0.0)), 0.0),
    (Sampler(SamplingParams(temperature=1.0, seed=3)), 0.0),
    (None, 0.0),  # the plain greedy turn (Session.send without SamplingParams)
    (None, 0.7),
])
def test_a_turn_fails_alone_on_nan_logits_plain_or_speculative(sampler, temperature):
    """Turn.fed and Turn.fed_draft (a speculative step's verified position): NaN logits fail
    the turn (done, `failure` set, a stop id in place of a token), never a NaN's index taken as
    the argmax or a draft token accepted against a NaN distribution."""
    logits = torch.tensor([0.5, 2.0, math.nan, 1.0])
    t = _turn(sampler, temperature)
    t.fed(logits)
    assert (t.done, t.failure, t.tokens) == (True, NAN_ERROR, [1])
    t = _turn(sampler, temperature)
    assert t.fed_draft(logits, 2) is False
    assert (t.done, t.failure, t.tokens) == (True, NAN_ERROR, [1])


def test_session_send_raises_where_its_turn_failed(small_model, monkeypatch):
    """Session.send (no batcher): the tokens before the failure, then TurnFailed with the clear
    error, never the stop id that stands in for the missing token."""
    _poison(monkeypatch, at=2)
    s = _engine(small_model).session()
    gen = s.send(GOOD[0][0], sampling=replace(POISONED, temperature=0.0))
    got = [next(gen), next(gen)]
    assert got == [114, 252]  # GOOD[0]'s greedy tokens alone
    with pytest.raises(TurnFailed, match=r"^The model's logits hold NaN or \+inf values"):
        next(gen)
    s.close()


def test_a_failed_turn_stores_nothing_and_the_session_goes_on(small_model, monkeypatch,
                                                              tmp_path):
    """A turn that failed (its logits not finite) leaves nothing of its state in the tiers: the
    SSD store and the pool hold what they held before it, so a poisoned state is never served
    as a prefix; the session's next turn works, planned from what was stored before."""
    e = Engine.from_model(small_model, weights_hash="w" * 64, page_tokens=PAGE,
                          prefill_chunk_tokens=CHUNK, store_dir=tmp_path / "store")
    s = e.session()
    list(s.send(_ids(17, 3), sampling=_greedy(2)))  # a good first turn: two blocks stored
    e.flush()
    before = (e.stats().store.writes, e.stats().store.entries, e.stats().pool.entries)
    assert before[:2] == (2, 2)
    _poison(monkeypatch, at=2)
    gen = s.send(_ids(16, 5), sampling=replace(POISONED, temperature=0.0))
    assert len([next(gen), next(gen)]) == 2
    with pytest.raises(TurnFailed):
        next(gen)
    e.flush()
    assert (e.stats().store.writes, e.stats().store.entries, e.stats().pool.entries) == before
    assert s.pending is None and s.cache is None
    monkeypatch.undo()
    assert len(list(s.send([9, 10], sampling=_greedy(3)))) == 3
    s.close()
    e.close()
