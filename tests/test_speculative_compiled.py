"""The compiled `verify` entry: one call over 1+k tokens per sequence against 1+k calls of the
compiled decode entry (logits bit for bit, every cache byte after `cut_back`), and the compiled
engine with speculation against the compiled engine without it (token for token).

The artifact (shared-small's weights, max_seq_len raised to 512 for 200+ tokens; entries
prefill_all, decode, verify, draft) is compiled once into the test cache (`conftest.
cached_artifact`, DSV41_TEST_CACHE), in minutes: the tests are slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import cached_artifact
from kernel_numerics import patch_fused_ops
from test_speculative import (
    PAGE,
    PerSessionDraft,
    ScriptedDraft,
    assert_same_cache,
    prompt_tokens,
)

from dsv41.graph.cache import new_cache, select_sequences, stack_caches
from dsv41.graph.speculative import cut_back, verify_step
from dsv41.runtime.engine.speculative import FixedLength

pytestmark = pytest.mark.slow

ENTRIES = ("prefill_all", "decode", "verify", "draft")


@pytest.fixture(scope="module")
def long_model(small_case):
    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.graph.model import Model

    args = replace(checkpoint_config(small_case.checkpoint), max_seq_len=512)
    return Model.from_checkpoint(small_case.checkpoint, args)


@pytest.fixture(scope="module")
def spec_artifact(long_model):
    return cached_artifact(long_model.args, "shared-small-512", ENTRIES)


class Counting:
    """CompiledPhases that count the entries they call."""

    def __init__(self, artifact, model):
        from dsv41.runtime.backends.artifact import Artifact
        from dsv41.runtime.backends.compiled import CompiledPhases

        self.inner = CompiledPhases(Artifact.load(artifact), model)
        self.calls: dict[str, int] = {}
        run = self.inner._run

        def counted(entry, *a, **kw):
            self.calls[entry] = self.calls.get(entry, 0) + 1
            return run(entry, *a, **kw)

        self.inner._run = counted

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def compiled(spec_artifact, long_model):
    return Counting(spec_artifact, long_model)


@pytest.fixture(scope="module")
def block5_model(small_case):
    """shared-small's weights with a DSpark block of 5, the released one (DSpark's weights do
    not depend on it: it is how many positions a pass drafts), so verifies of k = 3..5 run;
    max_seq_len 512 for 200+ tokens."""
    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.graph.model import Model

    args = replace(checkpoint_config(small_case.checkpoint), max_seq_len=512,
                   dspark_block_size=5)
    return Model.from_checkpoint(small_case.checkpoint, args)


@pytest.fixture(scope="module")
def block5_compiled(block5_model):
    return Counting(cached_artifact(block5_model.args, "shared-small-512-b5", ENTRIES),
                    block5_model)


def _prefilled(model, ph, tokens: list[int]):
    c = new_cache(model.plan, 1, 64, engram_pad=model.engram.pad_id)
    ph.prefill_exact(model, c, torch.tensor([tokens]))
    return c


@pytest.mark.parametrize("prefills,keeps", [((20,), (3,)), ((21,), (2,)), ((20, 27), (3, 1)),
                                            ((31, 18), (2, 3)), ((17, 24), (1, 2))])
def test_compiled_verify_equals_compiled_decode_steps(long_model, compiled, prefills, keeps):
    """Sequences at their own positions (even and odd starts: m=2 groups completed or left
    open; past the 16-wide window: the rings have wrapped), verified together in one call of
    the verify entry; each row's logits equal those of its own decode steps at batch 1, bit
    for bit, and after `cut_back` each row's cache equals theirs byte for byte."""
    _verify_equals_decode_steps(long_model, compiled, prefills, keeps)


@pytest.mark.parametrize("prefills,keeps", [((20,), (6,)), ((21,), (5,)), ((31, 18), (4, 6)),
                                            ((13, 24), (3, 1))])
def test_compiled_verify_of_3_to_5_drafts_equals_compiled_decode_steps(block5_model,
                                                                       block5_compiled,
                                                                       prefills, keeps):
    """The same at a DSpark block of 5: one call over 6 tokens per row (the window, 16, wraps
    inside the pass for the rows past it), kept 3..6."""
    _verify_equals_decode_steps(block5_model, block5_compiled, prefills, keeps)


def _verify_equals_decode_steps(m, compiled, prefills, keeps) -> None:
    n = 1 + m.args.dspark_block_size  # the sampled token and a whole draft block
    seqs = [prompt_tokens(p + n, seed=30 + i) for i, p in enumerate(prefills)]
    refs, want = [], []
    for seq, p, keep in zip(seqs, prefills, keeps, strict=True):
        ref = _prefilled(m, compiled, seq[:p])
        want.append(torch.cat([compiled.decode_step(m, ref, torch.tensor([[t]])).logits
                               for t in seq[p:p + keep]], dim=1))
        refs.append(ref)
    spec = stack_caches([_prefilled(m, compiled, seq[:p]) for seq, p in
                         zip(seqs, prefills, strict=True)])
    before = compiled.calls.get("verify", 0)
    v = compiled.verify_step(m, spec, torch.tensor([seq[p:p + n] for seq, p in
                                                    zip(seqs, prefills, strict=True)]))
    assert compiled.calls["verify"] == before + 1  # one call for the batch
    assert v.logits.shape == (len(seqs), n, m.args.vocab_size)
    for row, (w, keep) in enumerate(zip(want, keeps, strict=True)):
        assert torch.equal(v.logits[row, :keep], w[0]), (row, (v.logits[row, :keep] - w[0])
                                                         .abs().max())
    cut_back(m, spec, v, list(keeps))
    for row, ref in enumerate(refs):
        assert_same_cache(select_sequences(spec, [row]), ref)


def test_compiled_verify_matches_the_graphs_decode_steps(long_model, compiled, monkeypatch):
    """Against the oracle: the graph's verify (decode steps, its fused mHC / RMSNorm ops on the
    CPU kernels the artifact lowers them to: `kernel_numerics.patch_fused_ops`, as
    test_engine_artifact compares the compiled engine) on the same prefilled cache: the same
    greedy tokens, logits within rel L2 1e-5 per position."""
    m = long_model
    seq = prompt_tokens(24, seed=41)
    graph_c, comp_c = (_prefilled(m, compiled, seq[:21]) for _ in range(2))
    got = compiled.verify_step(m, comp_c, torch.tensor([seq[21:24]]))
    with monkeypatch.context() as mp:
        patch_fused_ops(mp)
        want = verify_step(m, graph_c, torch.tensor([seq[21:24]]))
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    rel = (got.logits - want.logits).norm(dim=-1) / want.logits.norm(dim=-1)
    print("compiled verify vs graph decode steps (same fused kernels): rel L2", rel.tolist())
    assert float(rel.max()) <= 1e-5


def test_compiled_verify_refuses_bad_input(long_model, compiled):
    m = long_model
    c = _prefilled(m, compiled, prompt_tokens(10, seed=42))
    with pytest.raises(ValueError, match="A verify pass takes 1..3 tokens"):
        compiled.verify_step(m, c, [[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="Token ids must lie in"):
        compiled.verify_step(m, c, [[5, 9999]])
    with pytest.raises(ValueError, match="Batch of 2 sequences"):
        compiled.verify_step(m, c, [[5, 6], [7, 8]])


def _engine(model, phases, **kw):
    from dsv41.runtime.engine import Engine, EngineOptions

    return Engine(model, phases, weights_hash="w" * 64, backend="artifact (test)",
                  options=EngineOptions(exact=True, page_tokens=PAGE, **kw))


def _compiled_greedy(model, phases, tmp_path, n_new: int, right: list[int] | None,
                     max_draft: int = 2):
    """Two turns (the second after a snapshot restore), greedy, a draft verified at every
    step by the verify entry (DSpark's own compiled draft, or with `right` one right for that
    many tokens in turn): the same tokens as the compiled engine without speculation."""
    turns = [prompt_tokens(23, 8), prompt_tokens(5, 9)]
    out, recs = [], None
    for spec in (False, True):
        e = _engine(model, phases, store_dir=tmp_path / f"store{spec}", speculative=spec,
                    max_draft=max_draft)
        if spec:
            e.spec_policy = FixedLength(max_draft)
            if right is not None:
                seq = [t for ids, got in zip(turns, out[0], strict=True) for t in ids + got]
                scripted = ScriptedDraft(seq, right, model.args.vocab_size)
                e.phases = _Forward(phases, scripted)
        s = e.session()
        out.append([list(s.send(t, max_new_tokens=n_new)) for t in turns])
        if spec:
            recs = s.turns
        e.close()
    assert out[0] == out[1]
    assert recs[1].tier == "snapshot"
    assert all(r.verified > 0 for r in recs)
    print("accepted / verified per turn:", [(r.accepted, r.verified) for r in recs])
    return out[0], recs


class _Forward:
    """`phases` with the scripted draft's `draft_after`."""

    def __init__(self, phases, scripted: ScriptedDraft):
        self.phases, self.scripted = phases, scripted

    def draft_after(self, model, cache, token):
        return self.scripted.draft_after(model, cache, token)

    def __getattr__(self, name):
        return getattr(self.phases, name)


def test_compiled_engine_speculates_with_dsparks_own_drafts(long_model, compiled, tmp_path):
    """DSpark's compiled draft and the compiled verify: greedy tokens unchanged, and every
    verify one call of the verify entry."""
    before = dict(compiled.calls)
    _, recs = _compiled_greedy(long_model, compiled, tmp_path, 12, None)
    verifies = compiled.calls.get("verify", 0) - before.get("verify", 0)
    drafts = compiled.calls.get("draft", 0) - before.get("draft", 0)
    assert verifies == drafts > 0  # a verify after every draft pass, no decode-steps fallback
    assert sum(r.drafted for r in recs) == 2 * drafts


def test_compiled_engine_greedy_with_speculation_equals_without_200_tokens(long_model, compiled,
                                                                          tmp_path):
    """2 x 200 decoded tokens on the compiled engine: many m=2 groups, window (16)
    wrap-arounds, a turn boundary with a snapshot restore; drafts right for 2, 0, 1, 2, 1, 0
    tokens in turn, each verified by one call of the verify entry."""
    out, recs = _compiled_greedy(long_model, compiled, tmp_path, 200, [2, 0, 1, 2, 1, 0])
    assert [len(t) for t in out] == [200, 200]
    assert all(r.accepted > 0 for r in recs)


def test_compiled_send_many_speculates_per_row(long_model, compiled, tmp_path):
    """A compiled decode batch of two sessions at different lengths, one k for the batch,
    acceptance per row (drafts right for 2 tokens): the same tokens as the compiled engine
    without speculation, each batch step's verify one call of the entry."""
    m = long_model
    prompts = [prompt_tokens(17, 6), prompt_tokens(22, 7)]
    base = _engine(m, compiled)
    want = base.send_many([(base.session(), p, {"max_new_tokens": 9}) for p in prompts])
    spec = _engine(m, compiled, speculative=True, max_draft=2)
    spec.spec_policy = FixedLength(2)
    spec.phases = _Forward(compiled, PerSessionDraft(prompts, want, m.args.vocab_size))
    sessions = [spec.session() for _ in prompts]
    before = compiled.calls.get("verify", 0)
    got = spec.send_many([(s, p, {"max_new_tokens": 9}) for s, p in zip(sessions, prompts,
                                                                         strict=True)])
    assert got == want
    assert all(s.turns[-1].accepted > 0 for s in sessions)
    assert compiled.calls["verify"] > before


def test_compiled_engine_greedy_with_3_to_5_drafts_equals_without_200_tokens(block5_model,
                                                                            block5_compiled,
                                                                            tmp_path):
    """2 x 200 decoded tokens on the compiled engine at a DSpark block of 5, a verify of 5
    drafts at every step (fewer only at a turn's end) by one call of the verify entry; drafts
    right for 5, 3, 0, 4, 1, 5, 2 tokens in turn (accepted runs of 3..5 across m=2 groups,
    window wrap-arounds inside a pass, a turn boundary with a snapshot restore)."""
    before = block5_compiled.calls.get("verify", 0)
    out, recs = _compiled_greedy(block5_model, block5_compiled, tmp_path, 200,
                                 [5, 3, 0, 4, 1, 5, 2], max_draft=5)
    assert [len(t) for t in out] == [200, 200]
    right = [5, 3, 0, 4, 1, 5, 2]
    passes, want = 0, []  # per turn (verified, accepted), the draft pattern running on
    for _ in recs:
        verified = accepted = 0
        left = 200 - 1  # the first token comes from the prefill
        while left:
            k = min(5, left - 1)
            a = min(right[passes % len(right)], k) if k else 0
            passes += k > 0
            verified, accepted, left = verified + k, accepted + a, left - a - 1
        want.append((verified, accepted))
    assert [(r.verified, r.accepted) for r in recs] == want
    assert block5_compiled.calls["verify"] - before == passes
