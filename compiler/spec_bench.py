"""`dsv41 bench spec`: DSpark speculative decoding's numbers on the PyTorch graph.

- verify cost: seconds of a verify of k = 0..max_draft drafts at each context (a synthetic
  cache, `bench.synthetic_cache`), in the engine's form (1+k decode steps: bit-identical to
  decoding) and the one-pass form (one forward over 1+k tokens: what a compiled verify entry
  would run), with the draft pass's seconds;
- acceptance of DSpark's own drafts on the checkpoint in use (seeded random weights draft
  noise: their acceptance is near zero, which says nothing about trained weights);
- at injected acceptance rates (a draft right at each position with probability r, and a
  confidence head that says r), the tokens/s the policy predicts from the measured costs (both
  forms), and the tokens/s the engine achieves with its own policy and timings, against plain
  decoding.

    dsv41 bench spec [--preset small | --checkpoint DIR] [--contexts 256,896] [--max-draft N]
                     [--reps 3] [--tokens 24] [--rates 0.3,0.6,0.9] [--threads N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dsv41.compiler.bench import parse_tokens, synthetic_cache
from dsv41.graph import phases
from dsv41.graph.dspark import Draft
from dsv41.graph.model import Model
from dsv41.graph.speculative import cut_back, verify_step
from dsv41.runtime.engine import Engine
from dsv41.runtime.speculative import SpecPolicy, expected_tokens


class FixedLength(SpecPolicy):
    """Drafts at every step and verifies k drafts (for measuring acceptance)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.k = k

    def worth_drafting(self, batch: int) -> bool:
        return True

    def choose(self, batch: int, acceptance) -> int:
        return self.k


class InjectedDraft:
    """The graph's phases with DSpark's draft replaced: each draft token is the reference
    run's token with probability `rate` (else a wrong one), the confidence head says `rate`."""

    def __init__(self, sequence: list[int], rate: float, vocab: int, seed: int):
        self.sequence, self.rate, self.vocab = sequence, rate, vocab
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(phases, name)

    def draft_after(self, model, cache, token):
        pos, n = int(cache.pos[0]), model.args.dspark_block_size
        ids = [int(token[0])]
        for i in range(n):
            good = self.sequence[pos + 1 + i] if pos + 1 + i < len(self.sequence) else 0
            ids.append(good if self.rng.random() < self.rate else (good + 1) % self.vocab)
        conf = torch.full((1, n), math.log(self.rate / (1 - self.rate)))
        return Draft(torch.tensor([ids]), torch.zeros(1, n, self.vocab), conf)


def _median(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def verify_costs(model: Model, context: int, max_draft: int, reps: int, seed: int) -> list[dict]:
    cache = synthetic_cache(model, context, seed=seed, margin=64 + 2 * reps * (max_draft + 2))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    draft_s = _median(lambda: phases.draft_after(model, cache, torch.tensor([5])), reps)
    for k in range(max_draft + 1):
        toks = torch.randint(3, model.args.vocab_size, (1, 1 + k), generator=gen)

        def run(one_pass: bool, toks=toks) -> None:
            cut_back(model, cache, verify_step(model, cache, toks, one_pass=one_pass), [1])

        rows.append({"context": context, "k": k, "steps_s": _median(lambda: run(False), reps),
                     "one_pass_s": _median(lambda: run(True), reps), "draft_s": draft_s})
    return rows


def predicted(costs: list[dict], rate: float, field: str) -> tuple[int, float]:
    """(k, tokens/s) the policy picks from measured costs at acceptance `rate`."""
    pol = SpecPolicy(len(costs) - 1)
    for row in costs:
        pol.observe_verify(1, row["k"], row[field])
    pol.observe_draft(1, costs[0]["draft_s"])
    acc = [rate] * (len(costs) - 1)
    k = pol.choose(1, acc)
    return k, pol.rate(1, k, acc)


def _decode_rate(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, object]:
    s = engine.session()
    out = list(s.send(prompt, max_new_tokens=n))
    rec = s.turns[-1]
    return out, rec.decoded / rec.seconds["decode"], rec


def run_spec_bench(model: Model, *, contexts, max_draft: int, reps: int, tokens: int,
                   rates, seed: int, say=print) -> dict:
    a = model.args
    if not model.plan.dspark:
        raise ValueError("This model has no DSpark layers to benchmark.")
    if not 1 <= max_draft <= min(a.dspark_block_size, a.window_size - 1):
        raise ValueError(f"--max-draft must lie in 1..{a.dspark_block_size}.")
    out = {"backend": "PyTorch graph", "verify": [], "injected": []}
    for n in contexts:
        rows = verify_costs(model, n, max_draft, reps, seed)
        out["verify"] += rows
        for r in rows:
            say(f"verify context {n} k {r['k']}: decode-steps {r['steps_s'] * 1e3:.1f} ms, "
                f"one pass {r['one_pass_s'] * 1e3:.1f} ms (draft {r['draft_s'] * 1e3:.1f} ms)")
    prompt = [int(x) for x in np.random.default_rng(seed).integers(3, a.vocab_size - 1, 32)]
    e = Engine.from_model(model, weights_hash="bench-spec", speculative=True,
                          max_draft=max_draft)
    e.spec_policy = FixedLength(max_draft)
    _, _, rec = _decode_rate(e, prompt, tokens)
    out["acceptance"] = {"tokens": tokens, "drafted": rec.drafted, "verified": rec.verified,
                         "accepted": rec.accepted,
                         "rate": rec.accepted / rec.verified if rec.verified else None,
                         "note": "DSpark's own drafts on these weights; seeded random weights "
                                 "draft noise, so their acceptance says nothing about trained "
                                 "weights"}
    say(f"acceptance of DSpark's drafts: {rec.accepted}/{rec.verified} "
        f"({out['acceptance']['rate']}) over {tokens} tokens (random weights accept little)")
    ref, plain, _ = _decode_rate(Engine.from_model(model, weights_hash="bench-spec"), prompt,
                                 tokens)
    short = [r for r in out["verify"] if r["context"] == contexts[0]]
    for rate in rates:
        k_s, pred_s = predicted(short, rate, "steps_s")
        k_o, pred_o = predicted(short, rate, "one_pass_s")
        e = Engine.from_model(model, weights_hash="bench-spec", speculative=True,
                              max_draft=max_draft)
        for r in short:  # the measured costs seed the policy; the engine's timings follow
            e.spec_policy.observe_verify(1, r["k"], r["steps_s"])
        e.spec_policy.observe_draft(1, short[0]["draft_s"])
        e.phases = InjectedDraft(prompt + ref, rate, a.vocab_size, seed)
        got, achieved, rec = _decode_rate(e, prompt, tokens)
        if got != ref:
            raise AssertionError("speculative greedy output differs from plain decoding")
        row = {"rate": rate, "context": contexts[0], "predicted_k": k_s,
               "predicted_tok_s": pred_s, "predicted_one_pass_k": k_o,
               "predicted_one_pass_tok_s": pred_o, "achieved_tok_s": achieved,
               "plain_tok_s": plain, "verified": rec.verified, "accepted": rec.accepted,
               "expected_tokens_per_verify": expected_tokens([rate] * max_draft, k_o)}
        out["injected"].append(row)
        say(f"acceptance {rate}: predicted {pred_s:.1f} tok/s (k={k_s}, decode-steps verify), "
            f"{pred_o:.1f} tok/s (k={k_o}, one-pass verify); achieved {achieved:.1f} tok/s "
            f"(verified {rec.verified}, accepted {rec.accepted}); plain {plain:.1f} tok/s")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41 bench spec", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", help="small | bench | full (seeded checkpoint)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--contexts", default="256,896")
    p.add_argument("--max-draft", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens per engine run")
    p.add_argument("--rates", default="0.3,0.6,0.9")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None, *,
         default_checkpoint: Callable[[str, int], Path]) -> int:
    ns = build_parser().parse_args(argv)
    rates = tuple(float(r) for r in ns.rates.split(","))
    if any(not 0.0 < r < 1.0 for r in rates):
        raise ValueError(f"--rates must lie strictly between 0 and 1, got {ns.rates!r}.")
    if ns.reps < 1 or ns.tokens < 2:
        raise ValueError("--reps must be >= 1 and --tokens >= 2.")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else default_checkpoint(ns.preset, ns.seed)
    model = Model.from_checkpoint(ckpt)
    report = {"spec": run_spec_bench(model, contexts=parse_tokens(ns.contexts),
                                     max_draft=ns.max_draft, reps=ns.reps, tokens=ns.tokens,
                                     rates=rates, seed=ns.seed),
              "checkpoint": str(ckpt), "threads": torch.get_num_threads()}
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(report, indent=1))
        print(f"json: {ns.json}")
    return 0
