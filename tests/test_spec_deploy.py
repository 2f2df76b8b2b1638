"""DSpark deployed (issue 39 items 2 and 3): `--speculative auto|on|off` and `--max-draft` from
the CLI to the engine, the refusal at load of `on` without the `draft` / `verify` entries, the
policy's k = 0 when verifying costs too much, a k per row in one decode batch (greedy tokens
unchanged), and the counts a request's usage and /metrics report.

shared-small: 6 layers, DSpark block 2; pages of 8."""

from __future__ import annotations

import logging

import pytest
import torch
from test_speculative import (
    GRAPH_PHASES,
    PAGE,
    ScriptedDraft,
    _engine,
    prompt_tokens,
)

from dsv41.graph.dspark import Draft
from dsv41.graph.speculative import verify_step
from dsv41.runtime.engine.options import EngineOptions, SpecMode
from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.engine.speculative import FixedLength, SpecPolicy

# ---- the options ---------------------------------------------------------------------------------


def _ns(argv):
    from dsv41.compiler.tools.cli.main import build_parser

    return build_parser().parse_args(argv)


def test_cli_flags_reach_the_engine_options(small_case):
    from dsv41.compiler.tools.cli.bench import serve_options
    from dsv41.runtime.serving.assembly import ServingOptions, serving_engine

    for verb in (["serve"], ["chat"]):
        ns = _ns([*verb, "--speculative", "on", "--max-draft", "1"])
        sv = ns.options(ns).serving
        assert (sv.speculative, sv.max_draft) == (SpecMode.ON, 1)
        ns = _ns(verb)
        assert (ns.options(ns).serving.speculative, ns.options(ns).serving.max_draft) == \
            (SpecMode.AUTO, None)
    sv = serve_options(_ns(["bench", "serve", "--speculative", "off"])).serving
    assert sv.speculative == SpecMode.OFF
    run = _ns(["run", "--speculative", "on", "--max-draft", "2"])
    assert (run.speculative, run.max_draft) == ("on", 2)
    with pytest.raises(ValueError, match="--max-draft and --speculative off exclude each other"):
        ServingOptions(speculative="off", max_draft=2).validate()
    with pytest.raises(ValueError, match="--speculative must be auto, on or off, got 'yes'"):
        ServingOptions(speculative="yes").validate()
    with pytest.raises(ValueError, match="speculative must be auto, on or off, got 'yes'"):
        EngineOptions(speculative="yes")
    assert EngineOptions(speculative=True).speculative == SpecMode.AUTO  # the old flag
    # the options reach the engine: on with one draft token, auto with the DSpark block
    for mode, max_draft, want in (("on", 1, (1, 1)), ("auto", None, (2, 0))):
        se = serving_engine(ServingOptions(backend="torch", checkpoint=small_case.checkpoint,
                                           speculative=mode, max_draft=max_draft))
        try:
            pol = se.engine.spec_policy
            assert se.engine.options.speculative == SpecMode(mode)
            assert (pol.max_draft, pol.floor) == want
        finally:
            se.close()
    se = serving_engine(ServingOptions(backend="torch", checkpoint=small_case.checkpoint,
                                       speculative="off"))
    assert se.engine.spec_policy is None
    se.close()


def test_the_on_demand_compile_adds_draft_and_verify_unless_off(small_case):
    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.graph.entries import CED_ENTRIES, EXACT_ENTRIES
    from dsv41.runtime.engine.spec_setup import compiled_entries

    args = checkpoint_config(small_case.checkpoint)
    assert compiled_entries(CED_ENTRIES, SpecMode.AUTO, args) == (
        "encoder", "decoder", "encoder_replay", "decode", "draft", "verify")
    assert compiled_entries(EXACT_ENTRIES, SpecMode.ON, args) == (
        "prefill", "decode", "draft", "verify")
    assert compiled_entries(CED_ENTRIES, SpecMode.OFF, args) == CED_ENTRIES
    plain = no_dspark(args)  # nothing to draft with
    assert compiled_entries(CED_ENTRIES, SpecMode.AUTO, plain) == CED_ENTRIES


def test_on_is_refused_at_load_without_the_entries_and_auto_runs_plain(small_artifact,
                                                                        small_case, caplog):
    """The cached artifact has no `draft` / `verify`: `on` is refused by `Engine.load` (no
    weight read, no decode step) naming both and the command; `auto` logs it and loads plain."""
    from dsv41.runtime.backends.artifact import ArtifactError
    from dsv41.runtime.engine import Engine

    ckpt = small_case.checkpoint
    cmd = (f"dsv41 compile --config {ckpt / 'config.json'} --target cpu --out "
           f"{small_artifact.parent.parent} --entries draft,verify")
    with pytest.raises(ArtifactError) as err:
        Engine.load(small_artifact, ckpt, speculative="on")
    assert str(err.value) == (
        f"speculative=on needs the artifact's draft and verify entries, which {small_artifact} "
        f"lacks; compile them with `{cmd}` (or run with speculative=auto or off).")
    with caplog.at_level(logging.WARNING, logger="dsv41.runtime.engine.spec_setup"):
        e = Engine.load(small_artifact, ckpt, speculative="auto", page_tokens=PAGE)
    try:
        assert e.spec_policy is None
        assert [r.getMessage() for r in caplog.records] == [
            f"speculative=auto: {small_artifact} lacks the draft and verify entries, so this "
            f"engine decodes without speculation; `{cmd}` compiles them."]
    finally:
        e.close()


def no_dspark(args):
    """The same model without its DSpark layers."""
    from dataclasses import replace

    return replace(args, dspark_block_size=0, compress_ratios=args.compress_ratios[:args.n_layers])


def test_on_needs_dspark_layers_and_a_draft_token(small_model):
    from dsv41.graph.model import Model

    for bad in (0, 3):
        with pytest.raises(ValueError, match="max_draft must be a whole number from 1 to 2 "
                                             r"\(the DSpark block\) with speculative=on"):
            _engine(small_model, speculative="on", max_draft=bad)
    plain = Model.placeholder(no_dspark(small_model.args))
    assert _engine(plain, speculative="auto").spec_policy is None
    with pytest.raises(ValueError, match="speculative=on needs a model with DSpark layers"):
        _engine(plain, speculative="on")


# ---- the policy: k = 0 when it does not pay, a k per row ----------------------------------------


def _measured(pol: SpecPolicy, batch: int, verify: list[float], draft: float) -> None:
    """Injected costs: a plain step verify[0] s, a step of k drafts verify[k], the draft pass."""
    for _ in range(pol.warmup + 1):
        for k, s in enumerate(verify):
            pol.observe_verify(batch, k, s)
        pol.observe_draft(batch, draft)


def test_auto_drops_to_zero_when_verifying_costs_too_much_and_speculates_when_cheap():
    sure, doubtful, hopeless = [0.98, 0.96], [0.9, 0.0], [0.05, 0.05]
    costly = SpecPolicy(2)  # a verify of k costs (1 + k) plain steps
    _measured(costly, 3, [0.010, 0.020, 0.030], 0.001)
    assert not costly.worth_drafting(3)
    assert costly.choose_rows(3, [sure, doubtful, hopeless], [2, 2, 2]) == [0, 0, 0]
    cheap = SpecPolicy(2)  # 10% more per draft token: each row its own k
    _measured(cheap, 3, [0.010, 0.011, 0.012], 0.001)
    assert cheap.worth_drafting(3)
    assert cheap.choose_rows(3, [sure, doubtful, hopeless], [2, 2, 2]) == [2, 1, 0]
    assert cheap.choose_rows(3, [sure, sure, sure], [2, 1, 0]) == [2, 1, 0]  # turns' ends
    # on: speculates at every step, k >= 1 even where it does not pay
    on = SpecPolicy(2, floor=1)
    _measured(on, 3, [0.010, 0.020, 0.030], 0.001)
    assert on.worth_drafting(3)
    assert on.choose_rows(3, [sure, doubtful, hopeless], [2, 2, 0]) == [1, 1, 0]
    with pytest.raises(ValueError, match="choose_rows takes scores and a cap for each of the 3"):
        cheap.choose_rows(3, [sure], [2])


class RowDrafts:
    """The graph's phases on a fake clock (a decode step `plain` s, the draft pass `draft`, a
    verify of k drafts `verify[k]`), with drafts right for each row's known sequence and the
    confidence head's scores per sequence (`scores[i]`: the logits of sequence i)."""

    def __init__(self, sequences, scores, clock, *, plain, draft, verify):
        self.seqs, self.scores, self.clock = sequences, scores, clock
        self.plain, self.draft, self.verify = plain, draft, verify
        self.ks: list[int] = []  # the k of every verify call

    def __getattr__(self, name):
        return getattr(GRAPH_PHASES, name)

    def decode_step(self, model, cache, tokens, **kw):
        self.clock[0] += self.plain
        return GRAPH_PHASES.decode_step(model, cache, tokens, **kw)

    def draft_after(self, model, cache, token):
        self.clock[0] += self.draft
        n, rows, conf = model.args.dspark_block_size, [], []
        for pos, tok in zip(cache.pos.tolist(), token.tolist(), strict=True):
            i = next(i for i, q in enumerate(self.seqs) if pos < len(q) and q[pos] == tok)
            q = self.seqs[i]
            rows.append([tok] + [q[pos + 1 + j] if pos + 1 + j < len(q) else 0
                                 for j in range(n)])
            conf.append(self.scores[i])
        b = len(rows)
        return Draft(torch.tensor(rows), torch.zeros(b, n, model.args.vocab_size),
                     torch.tensor(conf, dtype=torch.float32))

    def verify_step(self, model, cache, tokens):
        self.clock[0] += self.verify[tokens.size(1) - 1]
        self.ks.append(tokens.size(1) - 1)
        return verify_step(model, cache, tokens)  # decode steps' logits (the oracle)


def test_ragged_batch_greedy_with_speculation_equals_without(small_model):
    """Three requests in one decode batch, the confidence head sure of the first, sure of one
    token of the second, doubtful of the third: each row verifies its own k (2, 1, 0) in the
    same verify call, and every row's tokens are those of the batch without speculation."""
    m, n_new = small_model, 5
    prompts = [prompt_tokens(6, 21), prompt_tokens(7, 22), prompt_tokens(6, 23)]
    base = _engine(m)
    want = base.send_many([(base.session(), p, {"max_new_tokens": n_new}) for p in prompts])
    clock = [0.0]
    e = _engine(m, speculative="auto", spec_clock=lambda: clock[0])
    pol = SpecPolicy(2, warmup=0, refresh=1000)
    for b in (1, 2, 3):  # verifying 2 drafts costs 20% more than a plain step
        _measured(pol, b, [0.010, 0.011, 0.012], 0.001)
    e.spec_policy = pol
    e.phases = RowDrafts([p + w for p, w in zip(prompts, want, strict=True)],
                         [[4.0, 4.0], [2.2, -10.0], [-3.0, -3.0]], clock,
                         plain=0.010, draft=0.001, verify=[0.010, 0.011, 0.012])
    sessions = [e.session() for _ in prompts]
    got = e.send_many([(s, p, {"max_new_tokens": n_new}) for s, p in zip(sessions, prompts,
                                                                       strict=True)])
    assert got == want
    recs = [s.turns[-1] for s in sessions]
    # 4 tokens after the prefill's: row 0 a step of 3 then a plain one (1 left: no draft),
    # row 1 two steps of 2, row 2 four plain steps
    assert [(r.spec_steps, r.verified_at, r.accepted_at) for r in recs] == [
        (1, [1, 1], [1, 1]), (2, [2], [2]), (0, [], [])]
    assert [(r.verified, r.accepted, r.decoded) for r in recs] == [
        (2, 2, 4), (2, 2, 4), (0, 0, 4)]
    assert e.phases.ks == [2, 1]  # the 3 rows verified to k = 2, then to k = 1


# ---- the counts a request's usage and /metrics report --------------------------------------------


def test_usage_and_metrics_count_a_scripted_draft(small_model):
    """One request, a draft right for 2 tokens then 1 (the second of its 2 rejected): 2
    speculative steps (positions 1, 2 verified twice; kept 2 and 1 times), then a plain step
    for the last token. The stream's timing, the usage extension and /metrics say exactly
    that; a plain engine's usage has no `speculative` field."""
    from dsv41.runtime.engine.sampling import SamplingParams
    from dsv41.runtime.serving.batcher import Batcher
    from dsv41.runtime.serving.metrics import ServerMetrics, parse_metrics
    from dsv41.runtime.serving.openai_api import Usage

    m, prompt = small_model, prompt_tokens(11, 24)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    plain = Batcher(_engine(m), max_running=2)
    st0 = plain.submit(prompt, params)
    while plain.step():
        pass
    want = [ev.token_id for ev in st0 if ev.token_id is not None]
    assert plain.stats().speculative is None and st0.timing.speculative is None
    assert "speculative" not in Usage(11, 7, 0, speculative=st0.timing.speculative).body()
    e = _engine(m, speculative="on")
    e.spec_policy = FixedLength(2)
    e.phases = ScriptedDraft(prompt + want, [2, 1], m.args.vocab_size)
    b = Batcher(e, max_running=2)
    st = b.submit(prompt, params)
    while b.step():
        pass
    assert [ev.token_id for ev in st if ev.token_id is not None] == want
    counts = SpecCounts(2, (2, 2), (2, 1))
    assert st.timing.speculative == counts and b.stats().speculative == counts
    assert Usage(11, 7, 0, speculative=st.timing.speculative).body()["speculative"] == {
        "drafted": 4, "accepted": 3, "mean_accepted_length": 2.5}
    metrics = ServerMetrics("m")
    metrics.watch(b.stats)
    got = {k: v for k, v in parse_metrics(metrics.render()).items() if "spec" in k}
    assert got == {  # vLLM's positions: 0 is the first draft token
        "vllm:spec_decode_num_drafts_total": 2.0,
        "vllm:spec_decode_num_draft_tokens_total": 4.0,
        "vllm:spec_decode_num_accepted_tokens_total": 3.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 2.0,
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 1.0,
        'dsv41:spec_draft_tokens_per_pos_total{position="0"}': 2.0,
        'dsv41:spec_draft_tokens_per_pos_total{position="1"}': 2.0,
        "dsv41:spec_mean_accepted_length": 2.5, "dsv41:spec_acceptance_rate": 0.75}
