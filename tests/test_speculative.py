"""DSpark speculative decoding: verify + cut back against decode steps (bit for bit), the engine
with speculation against the engine without it (token for token, cache byte for byte), the
rejection rule's distribution (chi-square), and the length policy on injected costs.

shared-small: 6 layers, window 16, ratios up to 2 (m=2 groups), DSpark block 2; pages of 8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.graph import phases
from dsv41.graph.cache import ModelCache, new_cache
from dsv41.graph.dspark import Draft
from dsv41.graph.phases import decode_step, prefill_exact
from dsv41.graph.phases_api import GraphPhases
from dsv41.graph.speculative import cut_back, verify_step
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    sampling_probs,
)
from dsv41.runtime.engine.speculative import (
    ENGINE_MIN_GAIN,
    FixedLength,
    SpecPolicy,
    accept_draft_token,
    expected_tokens,
)

PAGE = 8


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 500, n)]


def _state(cache: ModelCache) -> dict[str, np.ndarray]:
    """Every byte of a cache, by name."""
    out = {"pos": cache.pos.numpy(), "index_owner": cache.index_owner.numpy()}
    for lay, r in cache.windows.items():
        out[f"ring{lay}.codes"], out[f"ring{lay}.scales"] = r.codes.numpy(), r.scales.numpy()
    for lay, st in cache.stores.items():
        for f in ("kv_codes", "kv_scales", "k_codes", "k_scales", "tail_kv", "tail_score"):
            t = getattr(st, f)
            if t is not None:
                out[f"store{lay}.{f}"] = t.view(torch.uint8).numpy() if t.dtype == \
                    torch.bfloat16 else t.numpy()
    if cache.engram_history is not None:
        out["engram_history"] = cache.engram_history
    return out


def assert_same_cache(a: ModelCache, b: ModelCache) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].shape == sb[k].shape and sa[k].tobytes() == sb[k].tobytes(), k


# ---- the graph: verify + cut back == decode steps ---------------------------------------------


@pytest.mark.parametrize("prefill,keep", [(20, 3), (21, 2), (20, 1), (31, 2)])
def test_verify_then_cut_back_equals_decode_steps(small_case, small_model, prefill, keep):
    """Even and odd starts (an m=2 group completed or left open by the kept tokens), past the
    window (16: the rings have wrapped), every keep: logits and every cache byte equal those
    of `keep` decode steps."""
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    ref, spec = (new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id) for _ in range(2))
    prefill_exact(m, ref, toks[:, :prefill])
    prefill_exact(m, spec, toks[:, :prefill])
    want = torch.cat([decode_step(m, ref, toks[:, i:i + 1]).logits
                      for i in range(prefill, prefill + keep)], dim=1)
    v = verify_step(m, spec, toks[:, prefill:prefill + 3])
    assert torch.equal(v.logits[:, :keep], want)
    cut_back(m, spec, v, [keep])
    assert_same_cache(spec, ref)


@pytest.mark.slow
def test_one_pass_verify_keeps_each_tokens_pointer(small_case, small_model):
    """The one-pass form (a compiled entry's): the per-token index-K pointer gives every token
    its decode step's selections, and the cut-back cache equals the decode steps' (logits to
    GEMM rounding only: eager CPU GEMMs are not row-invariant)."""
    m = small_model
    toks = torch.from_numpy(small_case.tokens)[None]
    ref, spec = (new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id) for _ in range(2))
    prefill_exact(m, ref, toks[:, :20])
    prefill_exact(m, spec, toks[:, :20])
    want = torch.cat([decode_step(m, ref, toks[:, i:i + 1]).logits for i in range(20, 23)], 1)
    v = verify_step(m, spec, toks[:, 20:23], one_pass=True)
    assert torch.equal(v.logits.argmax(-1), want.argmax(-1))
    assert (v.logits - want).abs().max() < 1e-2
    cut_back(m, spec, v, [3])
    assert_same_cache(spec, ref)


def test_verify_and_cut_back_refuse_bad_input(small_model):
    m = small_model
    c = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    with pytest.raises(ValueError, match="needs a prefill first"):
        verify_step(m, c, [[5, 6]])
    prefill_exact(m, c, [[5, 6, 7]])
    with pytest.raises(ValueError, match="A verify pass takes 1..3 tokens"):
        verify_step(m, c, [[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="Token ids must lie in"):
        verify_step(m, c, [[5, 9999]])
    v = verify_step(m, c, [[5, 6]])
    for bad in ([0], [3], [1, 1]):
        with pytest.raises(ValueError, match="cut_back keeps 1..2 tokens"):
            cut_back(m, c, v, bad)
    with pytest.raises(ValueError, match="one token per sequence"):
        phases.draft_after(m, c, torch.tensor([1, 2]))


# ---- the engine: speculation changes nothing ---------------------------------------------------


GRAPH_PHASES = GraphPhases()


class ScriptedDraft:
    """The graph's phases, with DSpark's draft replaced by one that is right for the first
    `right[n % len(right)]` tokens of draft pass n (taken from a run without speculation)."""

    def __init__(self, sequence: list[int], right: list[int], vocab: int):
        self.sequence, self.right, self.vocab, self.calls = sequence, right, vocab, 0

    def __getattr__(self, name):  # everything else: the graph's phases (the Phases protocol)
        return getattr(GRAPH_PHASES, name)

    def draft_after(self, model, cache, token):
        pos = int(cache.pos[0])  # `token` sits at pos; the draft guesses pos+1..pos+B
        assert int(token[0]) == self.sequence[pos]
        n = model.args.dspark_block_size
        j = self.right[self.calls % len(self.right)]
        self.calls += 1
        ids = [int(token[0])]
        for i in range(n):  # past the known sequence (a turn's end: never verified), 0
            q = pos + 1 + i
            good = self.sequence[q] if q < len(self.sequence) else 0
            ids.append(good if i < j else (good + 1) % self.vocab)
        return Draft(torch.tensor([ids]), torch.zeros(1, n, self.vocab), torch.zeros(1, n))


def _engine(model, **kw):
    return Engine.from_model(model, weights_hash="w" * 64, page_tokens=PAGE, **kw)


@pytest.mark.slow
def test_forced_acceptance_pattern_counts_and_cache(small_model):
    """A draft right for j = 0, 1, 2, 1 tokens in turn: the accepted counts are exactly those,
    the tokens those of the run without speculation, and the session's cache after the turn
    equals that run's byte for byte."""
    m, prompt, n_new = small_model, prompt_tokens(19, 4), 24
    base = _engine(m)
    s0 = base.session()
    want = list(s0.send(prompt, max_new_tokens=n_new))
    spec = _engine(m, speculative=True, max_draft=2)
    spec.spec_policy = FixedLength(2)
    right = [0, 1, 2, 1]
    spec.phases = ScriptedDraft(prompt + want, right, m.args.vocab_size)
    s1 = spec.session()
    got = list(s1.send(prompt, max_new_tokens=n_new))
    assert got == want
    rec = s1.turns[-1]
    # every step yields accepted + 1 tokens, the last step capped by what is left to produce
    # (a plain step when one token is left: no draft pass)
    verified, accepted, passes, left = 0, 0, 0, n_new - 1
    while left:
        k = min(2, left - 1)
        a = min(right[passes % len(right)], k) if k else 0
        passes += k > 0
        verified, accepted, left = verified + k, accepted + a, left - a - 1
    assert (rec.drafted, rec.verified, rec.accepted) == (2 * passes, verified, accepted)
    assert spec.phases.calls == passes
    assert rec.decoded == s0.turns[-1].decoded == n_new - 1
    assert s1.history == s0.history and s1.pending == s0.pending
    assert_same_cache(s1.cache, s0.cache)


@pytest.mark.slow
def test_left_turn_cuts_back_to_the_tokens_read(small_model):
    """A caller leaving in the middle of a speculative step's tokens: the turn ends at the last
    token it read, the cache as if it had decoded without speculation up to there."""
    m, prompt = small_model, prompt_tokens(19, 5)
    base = _engine(m)
    s0 = base.session()
    want = list(s0.send(prompt, max_new_tokens=12))
    spec = _engine(m, speculative=True, max_draft=2)
    spec.spec_policy = FixedLength(2)
    spec.phases = ScriptedDraft(prompt + want, [2], m.args.vocab_size)
    s1 = spec.session()
    gen = s1.send(prompt, max_new_tokens=12)
    got = [next(gen) for _ in range(5)]  # steps of 3 tokens: leaves after 1 of the 2nd's 3
    gen.close()
    assert got == want[:5]
    s2 = _engine(m).session()
    list(s2.send(prompt, max_new_tokens=5))
    assert s1.history == s2.history and s1.pending == s2.pending == want[4]
    assert s1.turns[-1].decoded == 4 and s1.turns[-1].accepted == 3
    assert_same_cache(s1.cache, s2.cache)


@pytest.mark.slow
def test_send_many_speculates_per_row(small_model):
    """A decode batch of two sessions (different lengths), one k for the batch, acceptance
    per row: the same tokens as without speculation."""
    m = small_model
    prompts = [prompt_tokens(17, 6), prompt_tokens(22, 7)]
    base = _engine(m)
    want = base.send_many([(base.session(), p, {"max_new_tokens": 9}) for p in prompts])
    spec = _engine(m, speculative=True, max_draft=2)
    spec.spec_policy = FixedLength(2)
    sessions = [spec.session() for _ in prompts]
    got = spec.send_many([(s, p, {"max_new_tokens": 9}) for s, p in zip(sessions, prompts,
                                                                         strict=True)])
    assert got == want
    assert all(s.turns[-1].verified > 0 for s in sessions)


@pytest.mark.slow
def test_batcher_streams_every_token_of_a_speculative_step(small_model):
    """The continuous batcher over a speculating engine (drafts right for 2 tokens, so a step
    brings 3): each stream gets every token, in order, the same as without speculation."""
    from dsv41.runtime.serving.batcher import Batcher

    m = small_model
    prompts = [prompt_tokens(9, 11), prompt_tokens(14, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = _engine(m)
    want = [list(plain.session().send(p, max_new_tokens=8)) for p in prompts]
    spec = _engine(m, speculative=True, max_draft=2)
    spec.spec_policy = FixedLength(2)
    spec.phases = PerSessionDraft(prompts, want, m.args.vocab_size)
    b = Batcher(spec, max_running=4)
    streams = [b.submit(p, params) for p in prompts]
    while b.step():
        pass
    got = [[e.token_id for e in st if e.token_id is not None] for st in streams]
    assert got == want


class PerSessionDraft(ScriptedDraft):
    """Right drafts for whichever of several known sequences the row's position and token
    match (a batch: one row per sequence)."""

    def __init__(self, prompts, outputs, vocab):
        super().__init__([], [2], vocab)
        self.seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]

    def draft_after(self, model, cache, token):
        n = model.args.dspark_block_size
        rows = []
        for pos, tok in zip(cache.pos.tolist(), token.tolist(), strict=True):
            seq = next(q for q in self.seqs if pos < len(q) and q[pos] == tok)
            rows.append([tok] + [seq[pos + 1 + i] if pos + 1 + i < len(seq) else 0
                                 for i in range(n)])
        b = len(rows)
        return Draft(torch.tensor(rows), torch.zeros(b, n, self.vocab), torch.zeros(b, n))


def _greedy_equality(model, tmp_path, n_new: int, right: list[int] | None = None):
    """Two turns (the second after a snapshot restore from the tiers), greedy, a draft verified
    at every step (DSpark's own, or with `right` one right for that many tokens in turn, from
    the run without speculation): the same tokens as without speculation."""
    turns = [prompt_tokens(23, 8), prompt_tokens(5, 9)]
    out = []
    for spec in (False, True):
        e = _engine(model, store_dir=tmp_path / f"store{spec}", speculative=spec, max_draft=2)
        if spec:
            e.spec_policy = FixedLength(2)
            if right is not None:
                seq = [t for ids, got in zip(turns, out[0], strict=True) for t in ids + got]
                e.phases = ScriptedDraft(seq, right, model.args.vocab_size)
        s = e.session()
        out.append([list(s.send(t, max_new_tokens=n_new)) for t in turns])
        if spec:
            recs = s.turns
            assert recs[1].tier == "snapshot"
            assert all(r.verified > 0 for r in recs)
            if right is not None:
                assert all(r.accepted > 0 for r in recs)
            print("accepted / verified per turn:", [(r.accepted, r.verified) for r in recs])
        e.close()
    assert out[0] == out[1]
    return out[0]


@pytest.mark.slow
def test_greedy_with_speculation_equals_without(small_model, tmp_path):
    _greedy_equality(small_model, tmp_path, 12)


@pytest.fixture(scope="module")
def long_model(small_case):
    """shared-small's weights with room for 200+ tokens (max_seq_len is only a limit)."""
    from dataclasses import replace

    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.graph.model import Model

    args = replace(checkpoint_config(small_case.checkpoint), max_seq_len=512)
    return Model.from_checkpoint(small_case.checkpoint, args)


@pytest.mark.slow
def test_greedy_with_speculation_equals_without_200_tokens(long_model, tmp_path):
    """2 x 110 decoded tokens: many m=2 groups, window (16) wrap-arounds, a turn boundary with
    a snapshot restore; drafts right for 2, 0, 1, 2, 1, 0 tokens in turn."""
    out = _greedy_equality(long_model, tmp_path, 110, right=[2, 0, 1, 2, 1, 0])
    assert sum(len(t) for t in out) >= 200


def test_engine_refuses_bad_speculation_options(small_model):
    for bad in (-1, 3, True, 1.5):
        with pytest.raises(ValueError, match="max_draft must be a whole number from 0 to 2"):
            _engine(small_model, speculative=True, max_draft=bad)
    assert _engine(small_model).spec_policy is None


# ---- the rejection rule's distribution ----------------------------------------------------------


def _chi2_sf(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the counts under probs (cells with probability 0 must be empty)."""
    n = counts.sum()
    live = probs > 0
    assert counts[~live].sum() == 0
    exp = n * probs[live]
    stat = float(((counts[live] - exp) ** 2 / exp).sum())
    return _chi2_sf(stat, int(live.sum()) - 1)


@pytest.mark.slow
def test_speculative_sampler_draws_the_backbones_distribution():
    """A small vocabulary, a draft token of high, low and zero backbone probability, with
    penalties, temperature and top-k on: 20000 seeded draws each; chi-square against the
    distribution `Sampler.sample` draws from (p-value > 1e-3), and the acceptance rate is
    p(draft)."""
    v = 8
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    params = SamplingParams(temperature=0.8, top_k=6, frequency_penalty=0.3, seed=11)
    generated = [0, 0, 6]
    target = sampling_probs(apply_penalties(logits, params, generated), params).numpy()
    for draft in (0, 4, 7):  # 7 is cut by top-k: never accepted
        s = Sampler(params)
        counts, kept = np.zeros(v), 0
        for _ in range(20000):
            tok, accepted = s.sample_draft(logits, draft, generated=generated)
            counts[tok.token_id] += 1
            kept += accepted
        assert _chi2(counts, target) > 1e-3, (draft, counts)
        assert abs(kept / 20000 - target[draft]) < 0.015
    # reproducible under a seed
    a, b = Sampler(params), Sampler(params)
    assert [a.sample_draft(logits, 4)[0].token_id for _ in range(50)] == \
        [b.sample_draft(logits, 4)[0].token_id for _ in range(50)]


def test_rejection_rule_with_a_sampled_draft():
    """A draft drawn from its own q (not a point mass): the output is still p."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    q = torch.tensor([0.5, 0.1, 0.1, 0.3], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    counts = np.zeros(4)
    for _ in range(20000):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[accept_draft_token(p, d, q, generator=g).token] += 1
    assert _chi2(counts, p.numpy()) > 1e-3
    with pytest.raises(ValueError, match="probability 0 under its own"):
        accept_draft_token(p, 0, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="draft token in 0..3"):
        accept_draft_token(p, 4)


def test_greedy_sampler_keeps_the_argmax():
    s = Sampler(SamplingParams(temperature=0.0))
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert s.sample_draft(logits, 1)[0].token_id == 1 and s.sample_draft(logits, 1)[1]
    tok, accepted = s.sample_draft(logits, 2)
    assert tok.token_id == 1 and not accepted


# ---- the length policy ------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    with pytest.raises(ValueError):
        expected_tokens([0.5], 2)


def _measured(pol: SpecPolicy, batch: int, verify: list[float], draft: float) -> None:
    """Injected costs: a plain step verify[0] seconds, a step of k drafts verify[k], a draft
    pass `draft` (each observed warmup + 1 times)."""
    for _ in range(pol.warmup + 1):
        for k, s in enumerate(verify):
            pol.observe_verify(batch, k, s)
        pol.observe_draft(batch, draft)


def test_policy_picks_zero_when_speculation_cannot_pay_and_more_when_it_can():
    pol = SpecPolicy(5)
    assert pol.choose(1, [0.9] * 5) == 0  # nothing measured: a plain step first
    # verify of k costs (1 + k) decode steps (the decode-steps form): never pays
    _measured(pol, 1, [0.010 * (1 + k) for k in range(6)], 0.002)
    assert pol.choose(1, [0.99] * 5) == 0
    assert not pol.worth_drafting(1)
    # a one-pass verify: 10% more per draft token
    fast = SpecPolicy(5)
    _measured(fast, 1, [0.010 * (1 + 0.1 * k) for k in range(6)], 0.002)
    assert fast.worth_drafting(1)
    assert fast.choose(1, [0.9] * 5) == 5
    assert fast.choose(1, [0.9, 0.9, 0.05, 0.05, 0.05]) == 2
    assert fast.choose(1, [0.02] * 5) == 0
    # per batch size: batch 8 measured where verifying costs much more
    _measured(fast, 8, [0.020 * (1 + k) for k in range(6)], 0.002)
    assert fast.choose(8, [0.9] * 5) == 0 and fast.choose(1, [0.9] * 5) == 5
    # the draft pass counts: at 20 ms it eats what a verify of 2 gains at acceptance 0.5
    slow_draft = SpecPolicy(5)
    _measured(slow_draft, 1, [0.010 * (1 + 0.1 * k) for k in range(6)], 0.020)
    assert fast.choose(1, [0.5] * 5) == 2 and slow_draft.choose(1, [0.5] * 5) == 0


def test_policy_speculates_over_a_plain_step_only_by_its_margin():
    """min_gain: a k > 0 must promise that factor more tokens/s than a plain step (timings on a
    noisy machine); past that, the k with the most tokens/s as before; floor 1 (speculative
    on) is unaffected; the engine's policy takes ENGINE_MIN_GAIN."""
    costs, draft = [0.100, 0.110, 0.120], 0.010  # k 1 at 0.3: 1.3 / 0.120 = 1.083 x plain
    picks = {}
    for gain in (1.0, 1.05, 1.1):
        pol = SpecPolicy(2, warmup=0, min_gain=gain)
        _measured(pol, 1, costs, draft)
        picks[gain] = (pol.choose(1, [0.3, 0.0]), pol.choose(1, [0.8, 0.8]))
    assert picks == {1.0: (1, 2), 1.05: (1, 2), 1.1: (0, 2)}
    on = SpecPolicy(2, warmup=0, min_gain=1.1, floor=1)
    _measured(on, 1, costs, draft)
    assert on.choose(1, [0.3, 0.0]) == 1
    for bad in (0.9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="min_gain must be a finite factor >= 1"):
            SpecPolicy(2, min_gain=bad)
    assert ENGINE_MIN_GAIN == 1.05


def test_policy_moving_average_follows_the_engines_timings():
    pol = SpecPolicy(2, alpha=0.5)
    pol.observe_verify(1, 0, 9.0)  # the warm-up call: left out
    assert pol.cost(1, 0) is None and pol.choose(1, [1.0, 1.0]) == 0
    pol.observe_verify(1, 0, 1.0)
    pol.observe_verify(1, 0, 3.0)
    assert pol.cost(1, 0) == 2.0
    assert pol.cost(1, 2) == 2.0  # unmeasured k: optimistic, as the largest measured below
    pol.observe_verify(1, 2, 50.0)  # measured only cold: still counts as not measured
    assert pol.cost(1, 2) == 2.0
    for bad, msg in ((dict(max_draft=-1), "max_draft"), (dict(max_draft=2, refresh=0), "refresh"),
                     (dict(max_draft=2, warmup=-1), "warmup")):
        with pytest.raises(ValueError, match=msg):
            SpecPolicy(**bad)
    with pytest.raises(ValueError, match="k must lie in 0..2"):
        pol.observe_verify(1, 3, 1.0)
    with pytest.raises(ValueError, match="accepted must lie"):
        pol.observe_accepted(1, 1, 2)


def test_policy_refreshes_the_plain_cost_and_stops_drafting_what_is_rejected():
    pol = SpecPolicy(2, warmup=0, refresh=4)
    _measured(pol, 1, [0.010, 0.011, 0.012], 0.001)  # steps 1..3
    assert pol.last_plain[1] == 1
    for _ in range(2):  # steps 4, 5: speculating (draft, verify of 2, both kept)
        assert pol.worth_drafting(1) and pol.choose(1, [0.9, 0.9]) == 2
        pol.observe_draft(1, 0.001, [0.9, 0.9])
        pol.observe_verify(1, 2, 0.012)
        pol.observe_accepted(1, 2, 2)
    assert not pol.worth_drafting(1)  # step 6: 5 steps since the last plain one
    pol.observe_verify(1, 0, 0.008)  # the plain step got cheaper
    assert pol.verify_s[(1, 0)] == pytest.approx(0.8 * 0.010 + 0.2 * 0.008)
    assert pol.worth_drafting(1)
    # every draft rejected at its first position: the measured acceptance falls, drafting
    # stops but for a probe draft every `refresh` steps (declined by `choose` at a low head)
    drafted = []
    for _ in range(40):
        if pol.worth_drafting(1):
            drafted.append(pol.steps[1] + 1)
            pol.observe_draft(1, 0.001, [0.9, 0.9])
            pol.observe_verify(1, 2, 0.012)
            pol.observe_accepted(1, 1, 0)
        else:
            pol.observe_verify(1, 0, 0.010)
    assert pol.accepted[1][0] < 0.2 and pol.accepted[1][1] == 1.0  # position 2: never judged
    late = [d for d in drafted if d > drafted[0] + 20]
    assert late and all(b - a == 5 for a, b in zip(late, late[1:], strict=False))
    # a confidence head that expects rejection stops drafting too
    sure = SpecPolicy(2, warmup=0)
    _measured(sure, 1, [0.010, 0.011, 0.012], 0.001)
    assert sure.worth_drafting(1)
    for _ in range(30):
        sure.observe_draft(1, 0.001, [0.01, 0.01])
    assert not sure.worth_drafting(1)


class Clock:
    """A fake clock that moves only when a phase call says it took time."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class CostedPhases(ScriptedDraft):
    """The graph's phases on a fake clock: a decode step takes `plain` seconds, the draft pass
    `draft`, the artifact-style `verify_step` (what the engine calls when the backend has one)
    `verify[k]` for k drafts; drafts right for `right` tokens in turn. Counts the calls."""

    def __init__(self, sequence, right, vocab, clock: Clock, *, plain: float, draft: float,
                 verify: list[float]):
        super().__init__(sequence, right, vocab)
        self.clock, self.plain, self.draft, self.verify = clock, plain, draft, verify
        self.verified: list[int] = []  # k of every verify_step call
        self.decodes = 0

    def decode_step(self, model, cache, tokens, **kw):
        self.clock.t += self.plain
        self.decodes += 1
        return GRAPH_PHASES.decode_step(model, cache, tokens, **kw)

    def draft_after(self, model, cache, token):
        self.clock.t += self.draft
        return super().draft_after(model, cache, token)

    def verify_step(self, model, cache, tokens):
        k = tokens.size(1) - 1
        self.clock.t += self.verify[k]
        self.verified.append(k)
        return verify_step(model, cache, tokens)  # the decode steps' logits (the oracle)


def _costed_run(m, verify: list[float], right: list[int], n_new: int = 30):
    prompt = prompt_tokens(19, 10)
    want = list(_engine(m).session().send(prompt, max_new_tokens=n_new))
    clock = Clock()
    e = _engine(m, speculative=True, max_draft=2, spec_clock=clock)
    e.phases = CostedPhases(prompt + want, right, m.args.vocab_size, clock, plain=0.010,
                            draft=0.001, verify=verify)
    s = e.session()
    assert list(s.send(prompt, max_new_tokens=n_new)) == want
    return e, s.turns[-1]


@pytest.mark.slow
def test_engine_feeds_the_policy_the_measured_verify_entry_cost(small_model):
    """A backend with its own verify (the compiled entry): the policy's costs are exactly the
    injected seconds of the path taken (the verify call for k > 0, a decode step for k = 0,
    the draft pass apart); where verifying 2 costs 12 ms against a plain 10 ms and drafts are
    right, the engine speculates at k = 2 from its own timings, verifying only through the
    backend's verify."""
    e, rec = _costed_run(small_model, [0.010, 0.011, 0.012], right=[2])
    pol, ph = e.spec_policy, e.phases
    assert pol.verify_s[(1, 0)] == pytest.approx(0.010)
    assert pol.verify_s[(1, 2)] == pytest.approx(0.012)
    assert pol.draft_s[1] == pytest.approx(0.001)
    assert pol.accepted[1] == [1.0, 1.0]
    assert pol.worth_drafting(1) or pol.steps[1] - pol.last_plain[1] >= pol.refresh
    assert pol.choose(1, [0.5, 0.5]) == 2
    assert pol.verify_s[(1, 1)] == pytest.approx(0.011)
    # two plain steps (the first a warm-up), k = 2 and k = 1 tried twice each (unmeasured k
    # counts as cheap), then k = 2 (a 2-token step at 1.75 expected tokens / 13 ms beats k = 1's
    # 1.5 / 12 ms at the head's 0.5), the last step capped at 1 by the turn's 30 tokens
    assert ph.verified == [2, 2, 1, 1, 2, 2, 2, 2, 2, 1]
    assert ph.decodes == pol.samples[("verify", (1, 0))] == 2  # no decode step in a verify
    assert rec.verified == sum(ph.verified) and rec.accepted == rec.verified


@pytest.mark.slow
def test_engine_stops_speculating_when_its_own_timings_say_it_cannot_pay(small_model):
    """Verify costs (1 + k) plain steps (a decode-steps verify): once the engine has measured
    k = 1 and 2 (each past its warm-up call), it stops drafting (a probe draft every `refresh`
    steps, which `choose` declines); the tokens are those of the plain engine."""
    e, rec = _costed_run(small_model, [0.010, 0.020, 0.030], right=[2], n_new=40)
    pol, ph = e.spec_policy, e.phases
    assert pol.verify_s[(1, 1)] == pytest.approx(0.020)
    assert pol.verify_s[(1, 2)] == pytest.approx(0.030)
    assert ph.verified == [2, 2, 1, 1]  # explored, each k twice (warm-up + measured)
    assert not pol.worth_drafting(1) and pol.choose(1, [0.99, 0.99]) == 0
    # 39 tokens: 2 plain steps, 10 from the 4 verifies (drafts right), 27 plain steps; 5
    # drafts: the 4 verified and one probe (`refresh` = 16 steps after the last)
    assert (ph.decodes, ph.calls, rec.verified, rec.accepted) == (29, 5, 6, 6)


def test_spec_bench_refuses_bad_impls(tmp_path):
    from dsv41.compiler.tools.bench.spec import run_command
    from dsv41.compiler.tools.cli.bench import spec_options
    from dsv41.compiler.tools.cli.main import build_parser

    def no_checkpoint(preset, seed):
        raise AssertionError("the options are checked before any checkpoint is made")

    for argv, msg in ((["--impls", "artifact"], "go together"),
                      (["--artifact", str(tmp_path)], "go together"),
                      (["--impls", "graph,onnx"], "graph and/or artifact")):
        ns = build_parser().parse_args(["bench", "spec", *argv])
        with pytest.raises(ValueError, match=msg):
            run_command(spec_options(ns), default_checkpoint=no_checkpoint)


# ---- the captured verify entry ----------------------------------------------------------------


def test_captured_verify_entry_runs_the_one_pass_verify(small_model):
    """The `verify` entry's captured program (torch.export, symbolic tokens), run eagerly on
    the host half the compiled phases feed it: the graph's one-pass verify's logits to eager
    GEMM rounding (its compressor GEMMs run over all rows at once), the same greedy tokens, and
    after `cut_back` the same positions, index-K pointer and ring bytes. (The compiled entry
    against compiled decode steps, bit for bit: tests/test_speculative_compiled.py, slow.)"""
    from dsv41.compiler.capture import capture
    from dsv41.graph.entries import cache_names, entry_inputs, entry_outputs, load_cache_tensors
    from dsv41.graph.speculative import begin_verify, finish_verify, verify_chunk

    m = small_model
    ep, template = capture(m, "verify")
    prog = ep.module()
    names = entry_outputs(m.plan, "verify", template)
    assert names[:3] == ["logits", "tail.1.kv", "tail.1.score"]
    seq = prompt_tokens(30, 13)
    for p, keep in ((20, 3), (21, 2)):
        a, b = (new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id) for _ in range(2))
        prefill_exact(m, a, [seq[:p]])
        prefill_exact(m, b, [seq[:p]])
        want = verify_step(m, a, [seq[p:p + 3]], one_pass=True)
        toks, staged = begin_verify(m, b, [seq[p:p + 3]])
        chunk, hist = verify_chunk(m, b, toks, staged)
        out = prog(*entry_inputs(m, b, "verify", (toks, chunk.token_owner), start=chunk.start,
                                 hash_ids=chunk.hash_ids, rope=chunk.rope))
        named = dict(zip(names, out, strict=True))
        load_cache_tensors(b, out[len(names) - len(cache_names(template)):])
        tails = {lay: (named[f"tail.{lay}.kv"], named[f"tail.{lay}.score"])
                 for lay in staged.tails}
        got = finish_verify(m, b, toks, staged, hist, tails, named["logits"], {})
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        assert (got.logits - want.logits).abs().max() <= 1e-4 * want.logits.abs().max()
        cut_back(m, a, want, [keep])
        cut_back(m, b, got, [keep])
        assert torch.equal(a.pos, b.pos) and torch.equal(a.index_owner, b.index_owner)
        for lay in a.windows:
            assert torch.equal(a.windows[lay].codes, b.windows[lay].codes), lay


def test_spec_bench_policy_rows_and_injected_draft_pays_the_draft_pass():
    """`bench spec`'s injected rows: the engine policy's own prediction and steps per k, and
    the injected draft still runs the backend's draft pass (the step pays for it)."""
    from dsv41.compiler.tools.bench.spec import InjectedDraft, policy_state

    pol = SpecPolicy(2)
    _measured(pol, 1, [0.010, 0.011, 0.012], 0.001)
    before = dict(pol.samples)
    pol.observe_draft(1, 0.001)
    pol.observe_verify(1, 2, 0.012)
    pol.observe_verify(1, 2, 0.012)
    row = policy_state(pol, 0.9, before)
    assert row["policy_k"] == 2 and row["steps_by_k"] == {"0": 0, "1": 0, "2": 2}
    assert row["draft_passes"] == 1  # one step drafted since `before`, the other did not
    assert row["policy_tok_s"] == pytest.approx(expected_tokens([0.9, 0.9], 2) / 0.013)
    assert row["policy_step_s"] == pytest.approx({"0": 0.010, "1": 0.011, "2": 0.012})

    class Backend:
        calls = 0

        def draft_after(self, model, cache, token):
            Backend.calls += 1

    class Args:
        dspark_block_size = 3

    class M:
        args = Args()

    class C:
        pos = torch.tensor([1])

    inj = InjectedDraft([7, 8, 9, 10, 11, 12], 0.5, 50, 0, Backend())
    d = inj.draft_after(M(), C(), torch.tensor([8]))
    assert Backend.calls == 1 and d.ids.shape == (1, 4) and int(d.ids[0, 0]) == 8
    assert all(int(t) in (g, g + 1) for t, g in zip(d.ids[0, 1:], [9, 10, 11], strict=True))
    assert torch.sigmoid(d.confidence).allclose(torch.full((1, 3), 0.5))

    class C2:  # a batch of two, each row its own reference and position
        pos = torch.tensor([1, 2])

    refs = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
    sure = InjectedDraft(lambda: refs, 0.999999, 50, 0, Backend())
    d = sure.draft_after(M(), C2(), torch.tensor([8, 22]))
    assert d.ids.tolist() == [[8, 9, 10, 11], [22, 23, 24, 25]] and d.confidence.shape == (2, 3)


def test_spec_bench_batch_rows_equal_plain_and_accept_injected_drafts(small_model):
    """`bench spec --batches`: sequences decoded together with injected drafts (a k per row)
    give the plain batch's tokens, and drafts right with probability ~1 are accepted."""
    from dsv41.compiler.tools.bench.spec import batch_rate

    m = small_model
    prompts = [prompt_tokens(9, 3), prompt_tokens(12, 4)]
    plain = Engine.from_model(m, weights_hash="t")
    ref, _ = batch_rate(plain, prompts, 7)
    e = Engine.from_model(m, weights_hash="t", speculative=True, max_draft=2)
    e.spec_policy = FixedLength(2)
    refs = [p + r for p, r in zip(prompts, ref, strict=True)]
    got, rate = batch_rate(e, prompts, 7, refs=refs, rate=0.999999)
    assert got == ref and rate > 0
    recs = [s.turns[-1] for s in e.sessions.values()]
    assert sum(r.accepted for r in recs) >= 2 * 2 and all(r.verified for r in recs)


def test_policy_probes_try_one_unmeasured_k_at_a_time():
    """A probe's rows go at most one k beyond the largest measured at the batch size (an
    unmeasured k counts as cheap as the largest measured one below it, so without the cap a
    probe at batch 8 would verify 8 x (1 + max_draft) rows); outside probes no such cap."""
    pol = SpecPolicy(5, warmup=0, refresh=4)
    _measured(pol, 8, [0.010, 0.011], 0.001)  # k = 0 and 1 measured at batch 8
    for _ in range(20):
        pol.observe_accepted(8, 1, 0)  # drafts rejected: only probes draft now
    while not pol.worth_drafting(8):
        pol.observe_verify(8, 0, 0.010)
    assert pol.probe_step[8] == pol.steps[8] + 1  # this draft is a probe
    assert pol.choose_rows(8, [[0.99] * 5] * 8, [5] * 8) == [2] * 8  # 1 + the largest known
    assert pol.choose(8, [0.99] * 5) == 2
    pol.observe_draft(8, 0.001, [0.99] * 5)
    pol.observe_verify(8, 2, 0.012)  # k = 2 measured now
    pol.observe_tokens(8, 8)
    while not pol.worth_drafting(8):
        pol.observe_verify(8, 0, 0.010)
    assert pol.choose_rows(8, [[0.99] * 5] * 8, [5] * 8) == [3] * 8
    fresh = SpecPolicy(5, warmup=0)  # no probe: the heads and the costs alone
    _measured(fresh, 8, [0.010, 0.011], 0.001)
    assert fresh.choose_rows(8, [[0.99] * 5] * 8, [5] * 8) == [5] * 8


def test_policy_prices_an_unmeasured_k_by_another_batch_sizes_verify_ratio():
    """An unmeasured (batch, k) costs at least the batch's plain step times the verify-to-plain
    ratio of k at the nearest batch size that measured it: at a probe at batch 8 with only its
    plain step known, drafts scored 0.3 are not verified (k 1 costs 1.6 plain steps at batch
    1: 1.3 tokens do not pay), drafts scored 0.99 still are (one k past the known)."""
    pol = SpecPolicy(4, warmup=0, refresh=4)
    _measured(pol, 1, [0.100, 0.160, 0.180, 0.200, 0.220], 0.005)
    _measured(pol, 8, [0.400], 0.020)
    assert pol.cost(8, 1) == pytest.approx(0.400 * 1.6 + 0.020)
    assert pol.cost(8, 3) == pytest.approx(0.400 * 2.0 + 0.020)
    assert pol.cost(2, 1) is None  # nothing measured at batch 2
    pol.observe_verify(8, 1, 0.500)  # measured: its own cost
    assert pol.cost(8, 1) == pytest.approx(0.520)
    assert pol.cost(8, 2) == pytest.approx(max(0.500, 0.400 * 1.8) + 0.020)
    probe = SpecPolicy(4, warmup=0, refresh=4)
    _measured(probe, 1, [0.100, 0.160, 0.180, 0.200, 0.220], 0.005)
    _measured(probe, 8, [0.400], 0.020)
    for _ in range(20):
        probe.observe_accepted(8, 1, 0)  # only probes draft now
    while not probe.worth_drafting(8):
        probe.observe_verify(8, 0, 0.400)
    assert probe.choose_rows(8, [[0.3] * 4] * 8, [4] * 8) == [0] * 8
    assert probe.choose_rows(8, [[0.99] * 4] * 8, [4] * 8) == [1] * 8


def test_spec_bench_rounds_alternate_plain_and_speculative_runs(small_model):
    """`bench spec --rounds N`: the timed plain and speculative runs alternate N times per
    injected row, every run is kept and each figure is the best of its N; 0 rounds refused."""
    from dsv41.compiler.tools.bench.spec import (
        SpecBenchOptions,
        graph_backend,
        run_batch_injected,
    )

    rows = run_batch_injected(graph_backend(small_model), small_model, batch=2, tokens=5,
                              prompt_tokens=4, max_draft=2, rates=(0.5,), seed=0,
                              say=lambda _: None, rounds=2)
    (row,) = rows
    assert len(row["plain_runs"]) == len(row["achieved_runs"]) == 2
    assert row["plain_tok_s"] == max(row["plain_runs"])
    assert row["achieved_tok_s"] == max(row["achieved_runs"])
    assert row["speedup"] == pytest.approx(row["achieved_tok_s"] / row["plain_tok_s"])
    assert row["equal_to_plain"]
    with pytest.raises(ValueError, match="--reps and --rounds must be >= 1"):
        SpecBenchOptions(rounds=0).validate()


def test_spec_bench_profile_matches_each_verify_kernel_to_its_decode_kernel():
    """`bench spec --profile`: a verify kernel (`_r<rows>`) is counted with the decode kernel
    it stands for, the rows ordered by what the verify adds; it profiles an artifact only."""
    from dsv41.compiler.tools.bench.profile import kernel_family, verify_growth
    from dsv41.compiler.tools.bench.spec import SpecBenchOptions

    assert kernel_family("k_fp8_linear_32768_512_1_r6") == "k_fp8_linear_32768_512_1"
    assert kernel_family("k_moe_1024_512_16_2_10p0_1_r6_moe_down") == \
        "k_moe_1024_512_16_2_10p0_1_moe_down"
    assert kernel_family("k_rms_norm_512_1em20") == "k_rms_norm_512_1em20"
    assert kernel_family("vm.builtin.reshape") == "vm.builtin.reshape"
    decode = {"top": [{"name": "k_a_1", "calls": 40, "ms": 50.0},
                      {"name": "k_b", "calls": 40, "ms": 20.0},
                      {"name": "vm.builtin.make_shape", "calls": 100, "ms": 5.0}]}
    verify = {"top": [{"name": "k_a_1_r6", "calls": 40, "ms": 130.0},
                      {"name": "k_b", "calls": 40, "ms": 100.0},
                      {"name": "vm.builtin.make_shape", "calls": 104, "ms": 5.5},
                      {"name": "k_only_verify", "calls": 2, "ms": 1.0}]}
    rows = verify_growth(decode, verify, top=3)
    assert [r["name"] for r in rows] == ["k_a_1", "k_b", "k_only_verify"]
    assert rows[0] == {"name": "k_a_1", "decode_ms": 50.0, "verify_ms": 130.0,
                       "decode_calls": 40, "verify_calls": 40, "extra_ms": 80.0}
    assert rows[2]["decode_calls"] == 0 and rows[2]["extra_ms"] == 1.0
    with pytest.raises(ValueError, match="--profile profiles an artifact"):
        SpecBenchOptions(profile=True).validate()


def test_policy_backs_off_drafts_that_every_row_declines():
    """A draft pass after which every row chose k = 0 bought nothing: while that repeats the
    next draft waits 1, 2, 4, ... steps (up to `refresh`), so a plain-speed run pays a draft pass
    about once per `refresh` steps, not at every step; a draft that is verified resets it."""
    pol = SpecPolicy(2, warmup=0, refresh=16)
    _measured(pol, 1, [0.010, 0.0105, 0.011], 0.001)  # verifying is cheap: drafting looks worth it
    start = pol.steps[1]
    drafted = []
    for _ in range(80):
        if pol.worth_drafting(1):
            drafted.append(pol.steps[1] + 1 - start)
            pol.observe_draft(1, 0.001, [0.9, 0.9])
        pol.observe_verify(1, 0, 0.010)  # every row declined: a plain step
    gaps = [b - a for a, b in zip(drafted, drafted[1:], strict=False)]
    assert gaps == [2, 3, 5, 9, 17, 17, 17], drafted
    # a draft that is verified resets the wait: the next wasted one waits 1 step again
    while not pol.worth_drafting(1):
        pol.observe_verify(1, 0, 0.010)
    pol.observe_draft(1, 0.001, [0.9, 0.9])
    pol.observe_verify(1, 2, 0.011)
    assert pol.backoff[1] == 0 and pol.worth_drafting(1)
    pol.observe_draft(1, 0.001, [0.9, 0.9])
    pol.observe_verify(1, 0, 0.010)
    assert pol.backoff[1] == 1 and not pol.worth_drafting(1)
    pol.observe_verify(1, 0, 0.010)
    assert pol.worth_drafting(1)


def test_policy_probes_back_off_while_they_lose_and_heads_are_capped_by_what_is_kept():
    """Outside a probe a row's k follows the lower of its head's scores and the kept fraction;
    a probe (a draft only the `refresh` rule drew) follows the head alone, and a probe that
    yields fewer tokens per second than a plain step doubles the wait before the next one
    (up to refresh x max_probe_wait); a probe that pays resets it."""
    pol = SpecPolicy(2, warmup=0, refresh=4, max_probe_wait=4)
    # batch 8: a plain step 10 ms; a verify of 1 or 2 drafts 14 ms, a draft pass 2 ms
    _measured(pol, 8, [0.010, 0.014, 0.014], 0.002)
    for _ in range(20):  # the head promises 0.9, a third of the first drafts is kept
        pol.observe_accepted(8, 1, 0)
    assert pol.accepted[8][0] < 0.05
    assert pol.choose_rows(8, [[0.9, 0.9]] * 8, [2] * 8) == [0] * 8  # capped: no verify
    assert not pol.worth_drafting(8)
    probes = []
    for _ in range(200):
        if pol.worth_drafting(8):
            probes.append(pol.steps[8] + 1)
            pol.observe_draft(8, 0.002, [0.9, 0.9])
            ks = pol.choose_rows(8, [[0.9, 0.9]] * 8, [2] * 8)
            assert ks == [2] * 8  # a probe: the heads alone
            pol.observe_verify(8, 2, 0.014)
            for _ in range(8):
                pol.observe_accepted(8, 1, 0)
            pol.observe_tokens(8, 8)  # 8 tokens in 16 ms against 8 in 10: lost
        else:
            pol.observe_verify(8, 0, 0.010)
            pol.observe_tokens(8, 8)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[:3] == [9, 17, 17] and set(gaps[2:]) == {17}, probes
    assert pol.probe_wait[8] == 16
    # a probe that pays (every draft kept: 24 tokens in 16 ms) resets the wait
    while not pol.worth_drafting(8):
        pol.observe_verify(8, 0, 0.010)
    pol.observe_draft(8, 0.002, [0.9, 0.9])
    pol.observe_verify(8, 2, 0.014)
    for _ in range(8):
        pol.observe_accepted(8, 2, 2)
    pol.observe_tokens(8, 24)
    assert pol.probe_wait[8] == 4
    with pytest.raises(ValueError, match="tokens"):
        pol.observe_tokens(8, -1)
    with pytest.raises(ValueError, match="max_probe_wait"):
        SpecPolicy(2, max_probe_wait=0)
