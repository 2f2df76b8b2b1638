"""`n` samples of one prompt (issue 41, item 2): the prompt prefilled once, its rows forked per
sample (`DecodeBatch.start_samples`), each sample its own seed stream; then the same through the
batcher and the OpenAI API with the official `openai` client (`n`, `best_of`), and a cancelled
n-request freeing every row it held.

Engine tests run on the compiled shared-small artifact (conftest compiles it once); the server
tests reuse test_serve's module fixtures (one engine, batcher and app; one page of 128 holds the
whole max_seq_len, so every request is served cold and greedy outputs are exact)."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41.runtime.engine import DecodeBatch, Engine
from dsv41.runtime.engine.batch import sample_request
from dsv41.runtime.engine.requests import TurnLimits, check_turn
from dsv41.runtime.engine.sampling import SamplingParams, sample_seed

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


def test_forked_rows_decode_as_independent_prefills(engine):
    """4 seeded samples of one prompt: prefilled once (the engine's prefilled tokens grow by
    the prompt alone), each sample's tokens exactly those of a fresh session prefilling the
    prompt itself with the sample's derived seed."""
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
