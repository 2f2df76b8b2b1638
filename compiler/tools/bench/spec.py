"""`dsv41 bench spec`: DSpark speculative decoding's numbers on the PyTorch graph and on a
compiled artifact.

- verify cost: seconds of a verify of k = 0..max_draft drafts at each context (a synthetic
  cache, `bench.synthetic`), in the engine's decode-steps form (1+k decode steps:
  bit-identical to decoding) and the one-pass form (the graph: one forward over 1+k tokens;
  an artifact: one call of its `verify` entry, bit-identical to its decode steps), with the
  draft pass's seconds: medians of --reps rounds that each time every form in turn
  (`one_pass_over_decode`), and the fastest of each (`one_pass_over_decode_best`);
- acceptance of DSpark's own drafts on the checkpoint in use (seeded random weights draft
  noise: their acceptance is near zero, which says nothing about trained weights);
- at injected acceptance rates (a draft right at each position with probability r, and a
  confidence head that says r; the real draft pass still runs and is paid for), the tokens/s
  the policy predicts from the measured costs (both forms, at the first context), and, from
  an engine whose policy learned its own timings in a first session, what that policy
  predicts (`policy_*`: its k, tokens/s, per-k step seconds, steps taken per k) and the
  tokens/s it achieves in a second session, against plain decoding timed the same way (the
  graph's engine verifies by decode steps; an artifact's by its verify entry). The engine
  runs at a context of --prompt-tokens + --tokens. With --batches 1,8: the same at batch 8
  (`injected_batch`: 8 sequences decoded together, a k per row from the engine's policy).
  --rounds N: the timed plain and speculative sessions alternate N times and each figure is
  the best of its N (`plain_runs` / `achieved_runs` keep them all): on a machine whose speed
  moves from one minute to the next, a ratio of two sessions timed minutes apart says as
  much about the machine as about speculation. --profile (an artifact): one decode step and
  one verify of 1 + --max-draft rows at the largest context, profiled per function (JSON
  `profile`; `growth`: what the verify adds to each function, its `_r<rows>` form matched to
  the decode kernel).

`--impls graph` (default) writes the JSON section `spec`; `--impls artifact --artifact DIR` the
section `spec_artifact` (same fields; the engine in exact mode: the artifact's prefill_all,
decode, draft and verify entries; the model's config is the artifact's).

    dsv41 bench spec [--preset small | --checkpoint DIR] [--contexts 256,896] [--max-draft N]
                     [--reps 3] [--tokens 24] [--prompt-tokens 32] [--rates 0.3,0.6,0.8,0.9]
                     [--batches 1,8] [--rounds 1] [--profile]
                     [--threads N] [--json F] [--impls graph,artifact] [--artifact DIR]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dsv41.compiler.tools.assets import ensure_checkpoint
from dsv41.compiler.tools.bench.macs import row_macs, verify_floor_steps
from dsv41.compiler.tools.bench.measure import (
    cpu_flags_and_clock,
    interleaved_times,
    median_time,
    write_json,
)
from dsv41.compiler.tools.bench.profile import format_growth, profile_verify
from dsv41.compiler.tools.bench.roof import measure_compute
from dsv41.compiler.tools.bench.synthetic import synthetic_cache
from dsv41.graph.dspark import Draft
from dsv41.graph.model import Model
from dsv41.graph.phases_api import GraphPhases, Phases
from dsv41.graph.speculative import cut_back, verify_step
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases
from dsv41.runtime.engine import Engine, EngineOptions
from dsv41.runtime.engine.batch import DecodeBatch
from dsv41.runtime.engine.speculative import FixedLength, SpecPolicy, expected_tokens


class InjectedDraft:
    """A backend's phases (the engine's own) with DSpark's draft replaced: the backend's own
    draft pass runs (the step pays for it), then each row's draft token is that row's reference
    token with probability `rate` (else a wrong one) and the confidence head says `rate`.
    `sequence`: the reference of a batch of one, or a callable giving each current row's
    reference (rows move as turns leave a decode batch)."""

    def __init__(self, sequence: list[int] | Callable[[], Sequence[Sequence[int]]], rate: float,
                 vocab: int, seed: int, backend: Phases):
        self.rows = sequence if callable(sequence) else (lambda: [sequence])
        self.rate, self.vocab, self.backend = rate, vocab, backend
        self.rng = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def draft_after(self, model, cache, token):
        self.backend.draft_after(model, cache, token)  # its cost, not its tokens
        n, refs = model.args.dspark_block_size, self.rows()
        token = torch.as_tensor(token).reshape(-1)
        ids = []
        for row, ref in enumerate(refs[: token.numel()]):
            pos, out = int(cache.pos[row]), [int(token[row])]
            for i in range(n):
                good = ref[pos + 1 + i] if pos + 1 + i < len(ref) else 0
                out.append(good if self.rng.random() < self.rate else (good + 1) % self.vocab)
            ids.append(out)
        b = len(ids)
        conf = torch.full((b, n), math.log(self.rate / (1 - self.rate)))
        return Draft(torch.tensor(ids), torch.zeros(b, n, self.vocab), conf)


@dataclass(frozen=True)
class Backend:
    """What the bench runs on: the phases, the one-pass verify, and an engine over them."""

    name: str  # the JSON's `backend`
    phases: Phases  # GraphPhases or runtime.compiled.CompiledPhases
    one_pass: Callable[[Model, object, torch.Tensor], object]  # -> Verified
    engine_field: str  # the verify cost the engine's own speculative step pays
    engine: Callable[..., Engine]  # (**EngineOptions fields) -> Engine


def graph_backend(model: Model) -> Backend:
    return Backend("PyTorch graph", GraphPhases(),
                   lambda m, c, t: verify_step(m, c, t, one_pass=True), "steps_s",
                   lambda **kw: Engine.from_model(model, weights_hash="bench-spec", **kw))


def artifact_backend(model: Model, artifact_dir: Path) -> Backend:
    """The artifact's compiled phases; its engine in exact mode (prefill_all, decode, draft,
    verify: the entries a speculating exact engine runs)."""
    art = Artifact.load(artifact_dir, args=model.args)
    missing = [e for e in ("prefill_all", "decode", "draft", "verify") if e not in art.entries]
    if missing:
        raise ValueError(f"{artifact_dir} lacks the entries {', '.join(missing)} this bench "
                         f"runs; compile them with `dsv41 compile --entries "
                         f"prefill_all,decode,draft,verify`.")
    ph = CompiledPhases(art, model)

    def engine(**kw) -> Engine:
        return Engine(model, ph, weights_hash="bench-spec", backend=f"artifact {artifact_dir}",
                      options=EngineOptions(exact=True, **kw))

    return Backend(f"artifact {artifact_dir}", ph, ph.verify_step, "one_pass_s", engine)


def verify_once(be: Backend, model: Model, cache, toks: torch.Tensor, *,
                one_pass: bool) -> None:
    """One verify of `toks` (1 + k tokens per sequence) by the backend's one pass or by decode
    steps, then the cache cut back to the first token (each call advances it by one)."""
    v = be.one_pass(model, cache, toks) if one_pass else \
        verify_step(model, cache, toks, step=be.phases.decode_step)
    cut_back(model, cache, v, [1])


def verify_costs(model: Model, context: int, max_draft: int, reps: int, seed: int,
                 backend: Backend | None = None) -> list[dict]:
    """Per k = 0..max_draft, a verify of 1 + k tokens by decode steps (`steps_s`) and by the
    backend's one pass (`one_pass_s`): medians of `reps` timed calls after one untimed round,
    the rounds interleaved (each times every k's two forms in turn, so a slow phase of a noisy
    machine falls on all of them alike); `*_best_s` the fastest of each. The ratios are against
    one decode step (k = 0 by decode steps: one decode call)."""
    be = backend or graph_backend(model)
    cache = synthetic_cache(model, context, seed=seed,
                            margin=64 + 2 * (reps + 1) * (max_draft + 2))
    gen = torch.Generator().manual_seed(seed)
    draft_s = median_time(lambda: be.phases.draft_after(model, cache, torch.tensor([5])), reps)
    tokens = [torch.randint(3, model.args.vocab_size, (1, 1 + k), generator=gen)
              for k in range(max_draft + 1)]
    times = interleaved_times(
        {(k, one): (lambda k=k, one=one: verify_once(be, model, cache, tokens[k], one_pass=one))
         for k in range(max_draft + 1) for one in (False, True)}, reps)
    rows = [{"context": context, "k": k, "steps_s": statistics.median(times[k, False]),
             "one_pass_s": statistics.median(times[k, True]), "draft_s": draft_s,
             "steps_best_s": min(times[k, False]), "one_pass_best_s": min(times[k, True])}
            for k in range(max_draft + 1)]
    for row in rows:
        row["one_pass_over_decode"] = row["one_pass_s"] / rows[0]["steps_s"]
        row["one_pass_over_decode_best"] = row["one_pass_best_s"] / rows[0]["steps_best_s"]
    return rows


def predicted(costs: list[dict], rate: float, field: str) -> tuple[int, float]:
    """(k, tokens/s) the policy picks from measured costs at acceptance `rate`."""
    pol = SpecPolicy(len(costs) - 1, warmup=0)  # medians of warm calls
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


def batch_rate(engine: Engine, prompts: Sequence[Sequence[int]], n: int, *,
               refs: Sequence[Sequence[int]] | None = None, rate: float = 0.0,
               seed: int = 0) -> tuple[list[list[int]], float]:
    """Each prompt a session, their turns of `n` tokens decoded together in one `DecodeBatch`:
    (each row's tokens, decoded tokens per second of the batch's decode steps). With `refs`
    (each row's reference sequence, prompt included) the engine's draft is an `InjectedDraft`
    at acceptance `rate` over them (its phases are replaced for good)."""
    sessions = [engine.session() for _ in prompts]
    index = {s.id: i for i, s in enumerate(sessions)}
    batch = DecodeBatch(engine)
    if refs is not None:
        if not isinstance(engine.phases, InjectedDraft):
            engine.phases = InjectedDraft(lambda: [], rate, engine.model.args.vocab_size, seed,
                                          engine.phases)
        engine.phases.rows = lambda: [refs[index[s.id]] for s, _ in batch.members]
    turns = [batch.start(s, s.request(list(p), max_new_tokens=n))
             for s, p in zip(sessions, prompts, strict=True)]
    t0 = time.perf_counter()
    try:
        while len(batch):
            for s, t in batch.step():
                if t.done:
                    batch.leave(s)
    finally:
        batch.close()
    seconds = time.perf_counter() - t0
    return [list(t.tokens) for t in turns], sum(len(t.tokens) - 1 for t in turns) / seconds


def alternating(rounds: int, plain: Callable[[], object], spec: Callable[[], object]
                ) -> tuple[list, list]:
    """`rounds` runs of `plain` and of `spec`, alternating (plain first): their results."""
    pairs = [(plain(), spec()) for _ in range(rounds)]
    return [p for p, _ in pairs], [s for _, s in pairs]


def _best_of(rounds: int) -> str:
    return f" (each the best of {rounds} alternating runs)" if rounds > 1 else ""


def run_batch_injected(be: Backend, model: Model, *, batch: int, tokens: int,
                       prompt_tokens: int, max_draft: int, rates, seed: int,
                       say=print, rounds: int = 1) -> list[dict]:
    """At each injected acceptance, `batch` sequences decoded together by an engine whose own
    policy (per-row k, 0 included) learned its timings in a first run, against plain decoding
    of the same batch timed the same way (the first token of each turn, from its prefill, is
    not counted); `rounds` timed runs of each, alternating, the best of each reported."""
    gen = np.random.default_rng(seed + batch)
    prompts = [[int(x) for x in gen.integers(3, model.args.vocab_size - 1, prompt_tokens)]
               for _ in range(batch)]
    plain_engine = be.engine()
    ref, _ = batch_rate(plain_engine, prompts, tokens)  # warms it up; timed below
    refs = [list(p) + r for p, r in zip(prompts, ref, strict=True)]
    rows = []
    for rate in rates:
        e = be.engine(speculative=True, max_draft=max_draft)
        batch_rate(e, prompts, tokens, refs=refs, rate=rate, seed=seed)
        before = dict(e.spec_policy.samples)
        plain_runs, specs = alternating(
            rounds, lambda: batch_rate(plain_engine, prompts, tokens)[1],
            lambda e=e, rate=rate: batch_rate(e, prompts, tokens, refs=refs, rate=rate,
                                              seed=seed))
        spec_runs = [tok_s for _, tok_s in specs]
        equal = all(got == ref for got, _ in specs)
        plain, achieved = max(plain_runs), max(spec_runs)
        steps = {j: samples_since(e.spec_policy, "verify", (batch, j), before)
                 for j in range(max_draft + 1)}
        row = {"batch": batch, "rate": rate, "achieved_tok_s": achieved, "plain_tok_s": plain,
               "speedup": achieved / plain, "equal_to_plain": equal,
               "plain_runs": plain_runs, "achieved_runs": spec_runs,
               "steps_by_k": {str(j): c for j, c in steps.items()},
               "draft_passes": draft_passes(e.spec_policy, batch, before),
               "engine_verify": be.engine_field, "engine_context": prompt_tokens + tokens}
        rows.append(row)
        say(f"batch {batch}, acceptance {rate}: {achieved:.2f} tok/s against plain "
            f"{plain:.2f} ({row['speedup']:.2f}x; verify steps by k "
            f"{', '.join(f'{j}: {c}' for j, c in steps.items() if c)}; draft passes "
            f"{row['draft_passes']}; output "
            f"{'equal to' if row['equal_to_plain'] else 'DIFFERENT from'} plain)"
            f"{_best_of(rounds)}")
    return rows


def policy_state(pol: SpecPolicy, rate: float, before: dict) -> dict:
    """What the engine's policy measured (per k: steps taken since `before`, its moving
    averages) and what it predicts from them at acceptance `rate`."""
    acc = [rate] * pol.max_draft
    k = pol.choose(1, acc)
    steps = {j: samples_since(pol, "verify", (1, j), before) for j in range(pol.max_draft + 1)}
    return {"policy_k": k, "policy_tok_s": pol.rate(1, k, acc),
            "policy_step_s": {str(j): pol.verify_s.get((1, j)) for j in steps},
            "policy_draft_s": pol.draft_s.get(1), "steps_by_k": {str(j): n for j, n in
                                                                 steps.items()},
            "draft_passes": draft_passes(pol, 1, before)}


def samples_since(pol: SpecPolicy, name: str, key, before: dict) -> int:
    """Measurements of `name` ("verify", "draft") at `key` the policy took since `before` (a
    copy of its `samples`)."""
    return pol.samples.get((name, key), 0) - before.get((name, key), 0)


def draft_passes(pol: SpecPolicy, batch: int, before: dict) -> int:
    """Draft passes the policy saw at this batch size since `before`: each step that drafted,
    whether its rows then verified (k > 0) or all declined (k = 0)."""
    return samples_since(pol, "draft", batch, before)


def add_floors(rows: list[dict], model: Model, macs_per_s: float) -> dict:
    """Each verify row's floor in decode steps (`macs.verify_floor_steps`: its decode step plus
    k rows' multiply-adds at the machine's best matrix rate) as `floor_over_decode`; returns
    what the floor was computed from."""
    macs = row_macs(model.plan)
    for r in rows:
        decode_s = next(x["steps_s"] for x in rows if x["context"] == r["context"] and not x["k"])
        r["floor_over_decode"] = verify_floor_steps(r["k"], decode_s=decode_s, macs=macs,
                                                    macs_per_s=macs_per_s)
    return {"row_macs": macs.to_dict(), "macs_per_s": macs_per_s}


def machine_macs_per_s() -> tuple[float, dict]:
    """The best multiply-add rate of the dot products a row runs (fp32 FMA, or bf16 dot
    products where the CPU has them; int8 is the index sweep's, not counted in `row_macs`),
    from the bench's matrix rates, and those rates."""
    _, flags, _, _ = cpu_flags_and_clock()
    roof = measure_compute(flags, 2048).to_dict()
    return best_macs_per_s(roof, ("fp32", "bf16")), roof


def best_macs_per_s(roof: dict, dots: Sequence[str]) -> float:
    """The best multiply-add rate among the matrix rates `roof` (`ComputeRoof.to_dict`)
    measured for the dot products `dots`."""
    return max(g for d, g in roof["gflops"].items() if d in dots) * 1e9 / 2


def artifact_dots(manifest) -> tuple[str, ...]:
    """The dot products an artifact's code can run: bf16 only where the CPU features its
    compiler recorded include AVX-512 BF16 or AMX-BF16 (a `cpu-avx2` artifact sums in fp32
    on any CPU); an older manifest without the record: both."""
    recorded = manifest.target.cpu_features
    if recorded is None or {"avx512_bf16", "amx_bf16"} & set(recorded):
        return ("fp32", "bf16")
    return ("fp32",)


def run_spec_bench(model: Model, *, contexts, max_draft: int, reps: int, tokens: int,
                   rates, seed: int, say=print, backend: Backend | None = None,
                   prompt_tokens: int = 32, batches: Sequence[int] = (1,),
                   macs_per_s: float | None = None, rounds: int = 1,
                   profile: bool = False) -> dict:
    """`macs_per_s`: the machine's best multiply-add rate (`machine_macs_per_s`); given, each
    verify row gets its floor (`floor_over_decode`) and the report what it came from.
    `rounds`: timed plain / speculative sessions, alternating, per injected row (best of
    each). `profile` (a compiled verify entry): one decode step and one verify of
    1 + max_draft rows at the largest context, profiled per function (`profile_verify`)."""
    a = model.args
    be = backend or graph_backend(model)
    if not model.plan.dspark:
        raise ValueError("This model has no DSpark layers to benchmark.")
    if not 1 <= max_draft <= min(a.dspark_block_size, a.window_size - 1):
        raise ValueError(f"--max-draft must lie in 1..{a.dspark_block_size}.")
    one = "verify entry" if be.engine_field == "one_pass_s" else "one pass"
    out = {"backend": be.name, "verify": [], "injected": []}
    for n in contexts:
        rows = verify_costs(model, n, max_draft, reps, seed, be)
        if macs_per_s is not None:
            out["floor"] = add_floors(rows, model, macs_per_s)
        out["verify"] += rows
        for r in rows:
            floor = (f"; floor {r['floor_over_decode']:.2f}" if "floor_over_decode" in r
                     else "")
            say(f"verify context {n} k {r['k']}: decode-steps {r['steps_s'] * 1e3:.2f} ms, "
                f"{one} {r['one_pass_s'] * 1e3:.2f} ms = {r['one_pass_over_decode']:.2f} "
                f"decode steps (fastest of each: {r['one_pass_over_decode_best']:.2f})"
                f"{floor} (draft {r['draft_s'] * 1e3:.2f} ms)")
        if profile and be.engine_field == "one_pass_s" and n == max(contexts):
            cache = synthetic_cache(model, n, seed=seed, margin=64 + 2 * (max_draft + 2))
            out["profile"] = profile_verify(be.phases, model, cache, k=max_draft, reps=reps)
            say(f"profile at context {n}:")
            for line in format_growth(out["profile"]):
                say(line)
    if "floor" in out:
        f = out["floor"]
        say(f"floor: one row's dense multiply-adds {f['row_macs']['total'] / 1e9:.2f} G at "
            f"{f['macs_per_s'] / 1e9:.0f} GMAC/s (the machine's best matrix rate of the dot "
            f"products the code runs: fp32, or bf16 where it has them)")
    prompt = [int(x) for x in np.random.default_rng(seed).integers(3, a.vocab_size - 1,
                                                                    prompt_tokens)]
    e = be.engine(speculative=True, max_draft=max_draft)
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
    plain_engine = be.engine()
    ref, _, _ = _decode_rate(plain_engine, prompt, tokens)  # warms it up; timed below
    short = [r for r in out["verify"] if r["context"] == contexts[0]]
    for rate in rates:
        k_s, pred_s = predicted(short, rate, "steps_s")
        k_o, pred_o = predicted(short, rate, "one_pass_s")
        # the engine's own policy, on its own timings (a learning session first, then the
        # timed one); the draft pass runs and is paid for, its tokens injected
        e = be.engine(speculative=True, max_draft=max_draft)
        e.phases = InjectedDraft(prompt + ref, rate, a.vocab_size, seed, e.phases)
        _decode_rate(e, prompt, tokens)
        before = dict(e.spec_policy.samples)
        plain_runs, specs = alternating(
            rounds, lambda: _decode_rate(plain_engine, prompt, tokens)[1],
            lambda e=e: _decode_rate(e, prompt, tokens))
        if any(got != ref for got, _, _ in specs):
            raise AssertionError("speculative greedy output differs from plain decoding")
        spec_runs = [tok_s for _, tok_s, _ in specs]
        verified = sum(rec.verified for _, _, rec in specs)
        accepted = sum(rec.accepted for _, _, rec in specs)
        plain, achieved = max(plain_runs), max(spec_runs)
        row = {"rate": rate, "context": contexts[0], "predicted_k": k_s,
               "predicted_tok_s": pred_s, "predicted_one_pass_k": k_o,
               "predicted_one_pass_tok_s": pred_o, "achieved_tok_s": achieved,
               "plain_tok_s": plain, "speedup": achieved / plain, "verified": verified,
               "accepted": accepted, "plain_runs": plain_runs, "achieved_runs": spec_runs,
               "expected_tokens_per_verify": expected_tokens([rate] * max_draft, k_o),
               "engine_verify": be.engine_field, "engine_context": len(prompt) + tokens,
               **policy_state(e.spec_policy, rate, before)}
        out["injected"].append(row)
        steps = ", ".join(f"k={j}: {n}" for j, n in row["steps_by_k"].items() if n)
        say(f"acceptance {rate}: predicted {pred_s:.1f} tok/s (k={k_s}, decode-steps verify), "
            f"{pred_o:.1f} tok/s (k={k_o}, {one} verify) at context {contexts[0]}; the "
            f"engine's policy predicts {row['policy_tok_s']:.1f} tok/s (k={row['policy_k']}) "
            f"from its own timings, achieves {achieved:.1f} tok/s (steps {steps}; verified "
            f"{verified}, accepted {accepted}); plain {plain:.1f} tok/s{_best_of(rounds)}")
    out["injected_batch"] = []
    for b in (b for b in batches if b > 1):
        out["injected_batch"] += run_batch_injected(
            be, model, batch=b, tokens=tokens, prompt_tokens=prompt_tokens,
            max_draft=max_draft, rates=rates, seed=seed, say=say, rounds=rounds)
    return out


@dataclass(frozen=True)
class SpecBenchOptions:
    """`dsv41 bench spec`."""

    preset: str = "small"  # whose seeded checkpoint, without a checkpoint folder
    checkpoint: Path | None = None
    contexts: tuple[int, ...] = (256, 896)
    max_draft: int = 5
    reps: int = 3
    tokens: int = 24  # decoded tokens per engine run
    prompt_tokens: int = 32  # the engine runs' prompt (their context)
    rates: tuple[float, ...] = (0.3, 0.6, 0.8, 0.9)
    batches: tuple[int, ...] = (1,)  # batch sizes of the injected rows (> 1: `injected_batch`)
    rounds: int = 1  # timed plain / speculative runs per injected row, alternating (best of)
    profile: bool = False  # artifact: decode step and verify profiled per function
    threads: int = 0  # torch threads (0: torch's)
    json: Path | None = None
    seed: int = 0
    impls: tuple[str, ...] = ("graph",)  # graph and/or artifact
    artifact: Path | None = None  # the artifact of impls "artifact"

    def validate(self) -> SpecBenchOptions:
        if any(not 0.0 < r < 1.0 for r in self.rates):
            raise ValueError(f"--rates must lie strictly between 0 and 1, got "
                             f"{','.join(map(str, self.rates))!r}.")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--batches takes batch sizes >= 1, got {self.batches!r}.")
        if self.reps < 1 or self.tokens < 2 or self.prompt_tokens < 1 or self.rounds < 1:
            raise ValueError("--reps and --rounds must be >= 1, --tokens >= 2 and "
                             "--prompt-tokens >= 1.")
        if not self.impls or any(i not in ("graph", "artifact") for i in self.impls):
            raise ValueError(f"--impls takes graph and/or artifact, got "
                             f"{','.join(self.impls)!r}.")
        if ("artifact" in self.impls) != (self.artifact is not None):
            raise ValueError("--impls artifact and --artifact DIR go together.")
        if self.profile and "artifact" not in self.impls:
            raise ValueError("--profile profiles an artifact's decode and verify entries: it "
                             "needs --impls artifact --artifact DIR.")
        return self


def run_command(opts: SpecBenchOptions, *,
                default_checkpoint: Callable[[str, int], Path] = ensure_checkpoint) -> int:
    """`dsv41 bench spec`: the rows printed, the report to the JSON.
    `default_checkpoint(preset, seed)`: the checkpoint without `opts.checkpoint`."""
    opts.validate()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    ckpt = opts.checkpoint or default_checkpoint(opts.preset, opts.seed)
    art = None if opts.artifact is None else Artifact.load(opts.artifact)
    # the artifact's config (e.g. a longer max_seq_len)
    model = Model.from_checkpoint(ckpt, None if art is None else art.args)
    macs_per_s, roof = machine_macs_per_s()
    kw = dict(contexts=opts.contexts, max_draft=opts.max_draft, reps=opts.reps,
              tokens=opts.tokens, rates=opts.rates, seed=opts.seed,
              prompt_tokens=opts.prompt_tokens, batches=opts.batches, macs_per_s=macs_per_s,
              rounds=opts.rounds, profile=opts.profile)
    report = {"compute_roof": roof}
    if "graph" in opts.impls:
        report["spec"] = run_spec_bench(model, **kw)
    if "artifact" in opts.impls:
        # the floor at the rate of the dot products the artifact's code runs
        kw["macs_per_s"] = best_macs_per_s(roof, artifact_dots(art.manifest))
        report["spec_artifact"] = run_spec_bench(
            model, **kw, backend=artifact_backend(model, opts.artifact))
    report |= {"checkpoint": str(ckpt), "threads": torch.get_num_threads()}
    if opts.json:
        write_json(opts.json, report)
        print(f"json: {opts.json}")
    return 0
