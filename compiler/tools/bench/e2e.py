"""`dsv41 bench`: the end-to-end benchmark of one machine, one set of weights, three
implementations of the same phase graphs (the compiled artifact, PyTorch eager, torch.compile
of the artifact's entry graphs: `torch_peer.py`).

- decode: one token (batch 1) from a cache holding N positions. Prefilling 256K tokens is out of
  reach on a CPU, so the cache is synthetic (`synthetic.py`): every ring and store row up to N
  filled with format-valid entries (the graph's own quantisers over random values), the
  compressor tails empty (N is a multiple of every ratio), the position, index-K pointer and
  Engram lookback those of N processed tokens. Each step is timed from the same state (the few
  per-step fields are reset between calls); implementations alternate within each repetition,
  in rotating order.
- prefill: CED prefill of a prompt from an empty cache (tokens per second).
- time to first token of agent-loop turns through the Engine: cold, snapshot hit and snapshot
  miss (the DRAM snapshot expired: bounded replay from the SSD prefix blocks).
- the roofline: the bytes and FLOPs of one decode step (`graph.cost`) against this machine's
  measured bandwidth and fp32 GEMM peak (`measure.measure_machine`).

A cell that would run past its time budget, or a context whose cache does not fit in memory, is
reported as skipped with the reason; no number is ever made up for it.

The options, records and their arithmetic are in `e2e_records.py`; the text, JSON and plot
reports in `e2e_report.py` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from dsv41.compiler.build import CompileOptions, missing_entries
from dsv41.compiler.tools.assets import ensure_artifact, ensure_checkpoint
from dsv41.compiler.tools.bench.contend import contending
from dsv41.compiler.tools.bench.e2e_records import (  # noqa: F401 - re-exported (CLI, tests)
    DECODE_TOKEN,
    IMPLS,
    SCHEMA,
    TARGET_VS_COMPILE,
    TARGET_VS_EAGER,
    BenchOptions,
    BenchReport,
    DecodeCell,
    Impl,
    PrefillRow,
    Profile,
    TierRow,
    ratios,
    roofline_row,
    speedup,
    targets,
)
from dsv41.compiler.tools.bench.e2e_report import (  # noqa: F401 - re-exported (CLI, tests)
    format_report,
    report_json,
    write_plots,
)
from dsv41.compiler.tools.bench.measure import (
    current_rss,
    measure_machine,
    mem_available,
    merge_machines,
    ms,
    peak_rss,
    reset_peak_rss,
    set_threads,
    write_json,
)
from dsv41.compiler.tools.bench.profile import profile_decode, profile_prefill
from dsv41.compiler.tools.bench.synthetic import (
    StepState,
    cache_bytes,
    check_contexts,
    synthetic_cache,
)
from dsv41.compiler.tools.bench.torch_peer import TorchCompiledEntries
from dsv41.graph.cache import new_cache
from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.config import load_config
from dsv41.graph.cost import PrefillMode, decode_step_cost, prefill_cost
from dsv41.graph.model import Model
from dsv41.graph.phases_api import GraphPhases, PrefillPacing
from dsv41.runtime.backends.artifact import Artifact
from dsv41.runtime.backends.compiled import CompiledPhases
from dsv41.runtime.backends.threads import pool_config
from dsv41.runtime.engine import Engine, EngineOptions

# ---- the three implementations ------------------------------------------------------------------


def make_phases(impl: str, model, artifact_dir: Path | None, entries: tuple[str, ...]):
    """The `graph.phases_api.Phases` of one implementation: the graph's (eager), the artifact's
    entries compiled by torch.compile (compile), or by TVM (artifact)."""
    if impl == Impl.EAGER:
        return GraphPhases()
    if impl == Impl.COMPILE:
        return CompiledPhases(TorchCompiledEntries(model, entries), model)
    return CompiledPhases(Artifact.load(artifact_dir, args=model.args), model)


# ---- decode -------------------------------------------------------------------------------------


def projected_skip(cell: DecodeCell, previous: DecodeCell | None, budget_s: float) -> str | None:
    """Skip a cell whose first step, scaled linearly from the last context, would overrun."""
    if previous is None or previous.median_s is None:
        if previous is not None and previous.skipped:
            return f"skipped at {previous.context} ({previous.skipped})"
        return None
    est = previous.median_s * cell.context / previous.context
    if est > budget_s:
        return (f"projected {est:.1f} s per step (from {previous.median_s:.2f} s at "
                f"{previous.context}) > budget {budget_s:.0f} s")
    return None


def bench_decode_context(runners: dict[str, Callable], cache, context: int, opts: BenchOptions,
                         previous: dict[str, DecodeCell], say=print,
                         compiles: frozenset[str] = frozenset()) -> list[DecodeCell]:
    """Interleaved repetitions of one decode step per implementation from the same state.
    Implementations in `compiles` compile at their first step here: that step is outside the
    budget (its time is reported as compile time)."""
    state = StepState.of(cache)
    token = torch.tensor([[DECODE_TOKEN]])
    cells = {impl: DecodeCell(impl, context) for impl in runners}
    for impl, cell in cells.items():
        cell.skipped = projected_skip(cell, previous.get(impl), opts.budget_s)
    order = list(runners)
    first: dict[str, torch.Tensor] = {}
    for rep in range(opts.reps + 1):  # rep 0: each implementation's first step
        for impl in order[rep % len(order):] + order[: rep % len(order)]:
            cell = cells[impl]
            spent = cell.spent_s - (cell.first_s or 0.0) * (impl in compiles)
            if cell.skipped or (rep and (spent >= opts.budget_s or cell.first_s is None)):
                continue
            state.restore(cache)
            t0 = time.perf_counter()
            res = runners[impl](cache, token)
            dt = time.perf_counter() - t0
            if rep == 0:
                first[impl] = res.logits[0, -1].float()
                cell.first_s = dt
                if dt >= opts.budget_s and impl not in compiles:
                    cell.skipped = (f"the first step took {dt:.1f} s, over the budget of "
                                    f"{opts.budget_s:.0f} s")
            else:
                cell.samples_s.append(dt)
    state.restore(cache)
    for impl, cell in cells.items():
        if Impl.EAGER in first and impl in first:
            cell.logits_diff = float((first[impl] - first[Impl.EAGER]).abs().max())
    for cell in cells.values():
        cell.load_avg = os.getloadavg()[0]
        if not cell.skipped and len(cell.samples_s) < opts.reps:
            say(f"  {cell.impl} @ {context}: {len(cell.samples_s)} of {opts.reps} reps within "
                f"the {opts.budget_s:.0f} s budget")
    return list(cells.values())


def contended_cells(runners: dict[str, Callable], cache, context: int, opts: BenchOptions,
                    quiet: list[DecodeCell], say=print) -> list[DecodeCell]:
    """The artifact's cell (else the first implementation's) again, beside `opts.contend`
    busy loops at nice 19 (`contend.py`); its quiet cell was just measured."""
    impl = Impl.ARTIFACT if Impl.ARTIFACT in runners else next(iter(runners))
    done = next(c for c in quiet if c.impl == impl)
    if done.median_s is None:
        return [DecodeCell(impl, context, skipped=f"no quiet figure ({done.skipped})")]
    with contending(opts.contend):
        cells = bench_decode_context({impl: runners[impl]}, cache, context, opts, {}, say=say)
    say(f"  {impl} beside {opts.contend} busy loop(s): {ms(cells[0].median_s)} "
        f"(quiet {ms(done.median_s)})")
    return cells


def memory_skip(plan, context: int, weights_loaded: bool = True) -> str | None:
    """A context whose cache (three copies: the cache, an entry's outputs, temporaries) does not
    fit in the memory available now."""
    need = 3 * cache_bytes(plan, context)
    avail = mem_available()
    if avail is not None and need > avail:
        return (f"cache needs ~{need / 2**30:.1f} GiB (3 copies), {avail / 2**30:.1f} GiB "
                "available")
    return None


# ---- prefill and turns --------------------------------------------------------------------------


def model_bytes(model) -> int:
    """Bytes of the loaded weights (dense tensors and expert stacks; views counted once)."""
    seen, total = set(), 0
    tensors = list(model.w.values())
    for ex in model.experts.values():
        tensors += [ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _measured_prefill(ph, model, n: int, tokens: torch.Tensor, chunk: int):
    """One CED prefill of `tokens` from a fresh cache: (seconds, peak RSS, RSS before, cache
    bytes)."""
    pad = model.engram.pad_id if model.engram is not None else None
    cache = new_cache(model.plan, 1, n + 64, engram_pad=pad)
    gc.collect()
    before = current_rss()
    tracked = reset_peak_rss()
    t0 = time.perf_counter()
    ph.ced_prefill(model, cache, tokens, pacing=PrefillPacing(chunk_tokens=chunk))
    dt = time.perf_counter() - t0
    peak = peak_rss() if tracked else None
    nbytes = sum(cache.nbytes().values())
    del cache
    gc.collect()
    return dt, peak, before, nbytes


def bench_prefill(phases_by_impl: dict, model, opts: BenchOptions,
                  machine: dict | None = None) -> list[PrefillRow]:
    """CED prefill (in chunks of `prefill_chunk_tokens`) from an empty cache at each prompt
    length; each implementation warms up once on one chunk, then `prefill_reps` timed
    prefills per length, interleaved. A length whose projection from the previous one (linear
    in the tokens, a lower bound: the sweeps grow faster) exceeds the budget is skipped."""
    rng = np.random.default_rng(opts.seed)
    lengths = opts.prefill_rows
    tokens_all = torch.tensor(rng.integers(3, model.args.vocab_size - 1, size=(1, max(lengths))))
    chunk = opts.prefill_chunk_tokens
    order = list(phases_by_impl)
    weights = model_bytes(model)
    skipped: dict[str, str | None] = {i: None for i in order}
    last: dict[str, tuple[int, float]] = {}
    for impl in order:  # warm-up (and compiles): one chunk of the shortest length
        n = min(min(lengths), chunk)
        dt = _measured_prefill(phases_by_impl[impl], model, n, tokens_all[:, :n], chunk)[0]
        last[impl] = (n, dt)
        if dt >= opts.budget_s:
            skipped[impl] = f"the first prefill ({n} tokens) took {dt:.1f} s, over the budget"
    rows = []
    for n in lengths:
        cost = prefill_cost(model.args, n, mode=PrefillMode.CED, chunk_tokens=chunk)
        samples: dict[str, list[float]] = {i: [] for i in order}
        mem: dict[str, list[tuple]] = {i: [] for i in order}
        why: dict[str, str | None] = dict(skipped)
        for impl in order:
            if why[impl] is None and impl in last:
                n0, dt0 = last[impl]
                est = dt0 * n / n0
                if est > opts.budget_s:
                    why[impl] = (f"projected {est:.0f} s (from {dt0:.1f} s at {n0} tokens) > "
                                 f"budget {opts.budget_s:.0f} s")
        for rep in range(opts.prefill_reps):
            for impl in order[rep % len(order):] + order[: rep % len(order)]:
                if why[impl] or (rep and sum(samples[impl]) >= opts.budget_s):
                    continue
                dt, peak, before, nbytes = _measured_prefill(
                    phases_by_impl[impl], model, n, tokens_all[:, :n], chunk)
                samples[impl].append(dt)
                mem[impl].append((peak, before, nbytes))
                last[impl] = (n, dt)
        for impl in order:
            m = mem[impl]
            peak = max((x[0] for x in m if x[0] is not None), default=None)
            before = max((x[1] for x in m if x[1] is not None), default=None)
            nbytes = m[0][2] if m else None
            med = statistics.median(samples[impl]) if samples[impl] else None
            gfl = cost.flops / med / 1e9 if med else None
            rows.append(PrefillRow(
                impl, n, tuple(samples[impl]), why[impl], chunk, peak, before, weights, nbytes,
                None if peak is None or nbytes is None else peak - weights - nbytes,
                cost.flops, cost.bytes, gfl, load_avg=os.getloadavg()[0],
                **prefill_fractions(gfl, machine)))
            if why[impl]:
                skipped[impl] = skipped[impl] or why[impl]  # longer lengths are skipped too
    return rows


def prefill_fractions(gflops: float | None, machine: dict | None) -> dict:
    """A prefill's achieved GFLOP/s against the machine: `PrefillRow`'s gemm_frac (the fp32
    GEMM rate), matrix_frac and matrix_dtype (`prefill_matrix_roof`)."""
    mdtype, mrate = prefill_matrix_roof(machine)
    return {"gemm_frac": None if gflops is None or not machine else
            gflops / machine["gemm_gflops"],
            "matrix_frac": None if gflops is None or not mrate else gflops / mrate,
            "matrix_dtype": mdtype}


def prefill_matrix_roof(machine: dict | None) -> tuple[str | None, float | None]:
    """(dtype, GFLOP/s): the machine's best matrix rate among the dtypes a prefill's GEMMs run
    in (fp32 FMA; bf16 dot products where the CPU has them; int8 is the index sweep's only)."""
    rates = {d: g for d, g in ((machine or {}).get("compute_by_dtype") or {}).items()
             if d in ("fp32", "bf16")}
    if not rates:
        return None, None
    best = max(rates, key=rates.__getitem__)
    return best, rates[best]


class _Clock:
    """The snapshot pool's clock, moved past its TTL to turn a snapshot hit into a miss."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _turn(session, ids: list[int]):
    t0 = time.perf_counter()  # send() plans and prefills the turn before returning
    gen = session.send(ids, max_new_tokens=1)
    next(gen)
    ttft = time.perf_counter() - t0
    for _ in gen:
        pass
    return ttft, session.turns[-1]


def bench_tiers(impl: str, phases, model, weights_hash: str, opts: BenchOptions) -> list[TierRow]:
    """Three turns of one session: a cold prompt, a suffix served from the DRAM snapshot, and a
    suffix after the snapshot expired (bounded replay from the SSD prefix blocks); then a new
    session in a new engine over the same store (what a new process sees) whose prompt shares
    the first turn's prompt and adds a suffix: a prefix hit on the first conversation's
    blocks."""
    rng = np.random.default_rng(opts.seed)
    hi = model.args.vocab_size - 1
    clock = _Clock()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsv41-bench-store-") as store:
        eo = EngineOptions(store_dir=store, page_tokens=64, pool_clock=clock, pool_ttl_s=60.0)
        engine = Engine(model, phases, weights_hash=weights_hash, options=eo, backend=impl)
        session = engine.session()
        first = []
        for expected, n in (("cold", opts.tier_context), ("snapshot", opts.tier_suffix),
                            ("prefix", opts.tier_suffix), ("prefix-new-session",
                                                            opts.tier_suffix)):
            if expected == "prefix":
                clock.t += 2 * eo.pool_ttl_s  # the snapshot expires: a miss
            ids = [int(x) for x in rng.integers(3, hi, size=n)]
            if expected == "cold":
                first = ids
            if expected == "prefix-new-session":
                engine.close()  # drains its SSD writer; the new engine rebuilds the index
                engine = Engine(model, phases, weights_hash=weights_hash, options=eo,
                                backend=impl)
                session = engine.session()
                ids = first + ids
            ttft, rec = _turn(session, ids)
            rows.append(TierRow(impl, rec.tier, expected, n, ttft,
                                {k: float(v) for k, v in rec.seconds.items()}, rec.prefilled,
                                rec.replayed, rec.reused_tokens))
        engine.close()
    return rows


# ---- profile ------------------------------------------------------------------------------------


def profile_torch_step(fn: Callable[[], object], top: int = 15) -> list[dict]:
    """Per-op self CPU time of one step (torch.profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ev) or 1.0
    return [{"name": e.key, "calls": e.count, "ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in ev[:top]]


# ---- the run ------------------------------------------------------------------------------------


def resolve_inputs(opts: BenchOptions, say=print) -> tuple[Path, Path | None]:
    """(checkpoint, artifact dir or None when no implementation needs it)."""
    ckpt = opts.checkpoint or ensure_checkpoint(opts.preset, opts.seed)
    wanted = set(opts.impls) | set(opts.prefill_impls if opts.prefill_tokens else ()) | \
        set(opts.tier_impls if opts.tiers else ())
    if Impl.ARTIFACT not in wanted:
        return ckpt, None
    entries = ("decode",) if Impl.ARTIFACT in opts.impls else ()
    if opts.prefill_tokens and Impl.ARTIFACT in opts.prefill_impls:
        entries += ("encoder", "decoder")  # the prefill rows run CED prefills only
    if opts.tiers and Impl.ARTIFACT in opts.tier_impls:
        entries += tuple(e for e in ("encoder", "decoder", "encoder_replay") if e not in entries)
    if opts.artifact is not None:
        todo = missing_entries(opts.artifact, load_config(ckpt), opts.target, entries)
        if todo:
            raise ValueError(f"{opts.artifact} lacks the entries {', '.join(todo)}; compile "
                             "them or leave --artifact out to compile into --out.")
        return ckpt, opts.artifact
    if not opts.compile_missing:
        d = CompileOptions(args=load_config(ckpt), model_name=opts.preset, target=opts.target,
                           out=opts.out, entries=entries).artifact_dir
        return ckpt, d
    return ckpt, ensure_artifact(ckpt, opts.preset, opts.target, entries, opts.out)


def run_bench(opts: BenchOptions, say: Callable[[str], None] = print) -> BenchReport:
    opts.validate()
    threads = set_threads(opts.threads)
    load0 = list(os.getloadavg())
    ckpt, art_dir = resolve_inputs(opts, say)
    say(f"threads: torch {threads['torch']}, TVM {threads['tvm']}; checkpoint {ckpt}; "
        f"artifact {art_dir}")
    machine = asdict(measure_machine())
    say(f"machine: bandwidth {machine['bandwidth_gbs']:.1f} GB/s, fp32 GEMM "
        f"{machine['gemm_gflops']:.1f} GFLOP/s, load {load0[0]:.2f}")
    model = Model.from_checkpoint(ckpt)
    if opts.impls:  # decode contexts matter only when something decodes
        check_contexts(model, opts.contexts)
    report = BenchReport(opts, machine, threads, None if art_dir is None else str(art_dir),
                         str(ckpt), load_avg={"start": load0})
    whash = weights_fingerprint(ckpt)
    all_impls = dict.fromkeys((*opts.impls, *(opts.prefill_impls if opts.prefill_rows else ()),
                               *(opts.tier_impls if opts.tiers else ())))
    entries = ("decode", "encoder", "decoder", "encoder_replay")
    phases = {i: make_phases(i, model, art_dir, entries) for i in all_impls}

    # decode against context
    runners = {i: (lambda cache, tok, ph=phases[i]: ph.decode_step(model, cache, tok))
               for i in opts.impls}
    previous: dict[str, DecodeCell] = {}
    bar = tqdm(opts.contexts if opts.impls else (), desc="decode", unit="ctx")
    for n in bar:
        bar.set_postfix_str(f"context {n}")
        why = memory_skip(model.plan, n)
        if why:
            cells = [DecodeCell(i, n, skipped=why) for i in opts.impls]
        else:
            cache = synthetic_cache(model, n, seed=opts.seed)
            cells = bench_decode_context(runners, cache, n, opts, previous, say=bar.write,
                                         compiles=frozenset() if previous else
                                         frozenset({Impl.COMPILE}))
            if opts.contend:
                report.contended += contended_cells(runners, cache, n, opts, cells, bar.write)
            if opts.profile != Profile.NEVER and n == opts.profile_context:
                report.profile = _maybe_profile(report, cells, phases, model, cache, n, opts,
                                                bar.write)
            del cache
            gc.collect()
        report.decode += cells
        previous = {c.impl: c for c in cells}
        cost = decode_step_cost(model.args, n)
        report.roofline += [roofline_row(c.impl, cost, c.median_s, machine) for c in cells]
        bar.write("  " + "  ".join(f"{c.impl} {ms(c.median_s)}" for c in cells))
    bar.close()

    if opts.prefill_tokens:
        say(f"prefill: CED over {', '.join(map(str, opts.prefill_rows))} tokens in chunks of "
            f"{opts.prefill_chunk_tokens} ({', '.join(opts.prefill_impls)})")
        report.prefill = bench_prefill({i: phases[i] for i in opts.prefill_impls}, model, opts,
                                       machine)
    if opts.tiers:
        for impl in opts.tier_impls:
            say(f"turns: {impl}")
            report.tiers += bench_tiers(impl, phases[impl], model, whash, opts)
    _compile_seconds(report, phases)
    report.load_avg["end"] = list(os.getloadavg())
    # what ran the parallel loops is known once the entries are loaded (the artifact's launcher)
    report.threads["tvm_pool"] = pool_config().to_dict()
    resample_roof(report, model, asdict(measure_machine()), say)
    return report


def resample_roof(report: BenchReport, model, end: dict, say: Callable[[str], None]) -> None:
    """The roof measured again after the run (`end`), merged with the first sample
    (`merge_machines`: the best of both), and every roofline and prefill fraction recomputed
    against it, so a first sample taken in a slow phase of the machine does not flatter the
    code."""
    start = report.machine
    merged = merge_machines(start, end)
    say(f"roof re-measured after the run: bandwidth {end['bandwidth_gbs']:.1f} GB/s (start "
        f"{start['bandwidth_gbs']:.1f}), matrix rates " + ", ".join(
            f"{d} {r:.0f} (start {(start.get('compute_by_dtype') or {}).get(d, 0.0):.0f})"
            for d, r in (end.get("compute_by_dtype") or {}).items())
        + " GFLOP/s; the fractions use the best of both")
    report.machine = merged
    report.roofline = [roofline_row(r.impl, decode_step_cost(model.args, r.context), r.seconds,
                                    merged) for r in report.roofline]
    report.prefill = [dataclasses.replace(r, **prefill_fractions(r.achieved_gflops, merged))
                      for r in report.prefill]


def _maybe_profile(report, cells, phases, model, cache, n, opts, say) -> dict | None:
    """The profile of the artifact's step at `n` (and of eager's, to compare), when asked for
    or when the artifact misses the 2x / 5x bar at this context."""
    by = {c.impl: c for c in cells}
    art = by.get(Impl.ARTIFACT)
    if art is None or art.median_s is None:
        return None
    vs = {o: speedup(by[o].median_s, art.median_s) for o in (Impl.EAGER, Impl.COMPILE) if o in by}
    missed = (vs.get(Impl.COMPILE) or math.inf) < TARGET_VS_COMPILE or \
        (vs.get(Impl.EAGER) or math.inf) < TARGET_VS_EAGER
    if opts.profile == Profile.AUTO and not missed:
        return None
    say(f"  profiling the decode step at {n} (ratios {vs})")
    state = StepState.of(cache)
    out = {"context": n, "ratios": vs}
    try:
        out["artifact_layers"] = profile_artifact(phases[Impl.ARTIFACT], model, cache, state,
                                                  opts)
        out[Impl.ARTIFACT] = out["artifact_layers"]["decode"]["top"]
    except Exception as e:  # the profile is a diagnostic: report why it is missing
        out["artifact_error"] = f"{type(e).__name__}: {e}"
    for impl in (Impl.EAGER, Impl.COMPILE):
        if impl in phases and impl in by and by[impl].median_s is not None:
            state.restore(cache)
            tok = torch.tensor([[DECODE_TOKEN]])
            out[impl] = profile_torch_step(
                lambda ph=phases[impl], tok=tok: ph.decode_step(model, cache, tok))
    state.restore(cache)
    return out


def profile_artifact(ph, model, cache, state: StepState, opts: BenchOptions) -> dict:
    """The artifact's decode step from `cache` and a CED prefill of one chunk (when the
    artifact has the prefill entries), through the engine's own path (`profile.py`)."""
    tok = torch.tensor([[DECODE_TOKEN]])
    out = {"decode": profile_decode(ph, model, cache, tok, restore=lambda: state.restore(cache),
                                    top=opts.profile_top)}
    if {"encoder", "decoder"} <= set(ph.art.entries):
        n = min(opts.prefill_chunk_tokens, max(opts.prefill_tokens, 16))
        rng = np.random.default_rng(opts.seed)
        tokens = torch.tensor(rng.integers(3, model.args.vocab_size - 1, size=(1, n)))
        out["prefill"] = profile_prefill(ph, model, tokens, chunk_tokens=n, top=opts.profile_top)
    return out


def _compile_seconds(report: BenchReport, phases: dict) -> None:
    """torch.compile's capture (torch.export) and Inductor compile seconds per entry (the first
    call less a steady decode step), and its first step at each later context (recompiles)."""
    ph = phases.get(Impl.COMPILE)
    if ph is None:
        return
    for entry, sec in ph.art.seconds.items():
        report.compile_s[f"{entry} capture"] = sec["capture"]
        if "first_call" in sec:
            report.compile_s[f"{entry} first call (Inductor compile + 1 call)"] = \
                sec["first_call"]


# ---- the command --------------------------------------------------------------------------------


def run_command(opts: BenchOptions) -> int:
    """`dsv41 bench`: the benchmark, its text report, the JSON and the plots."""
    opts.validate()
    print(f"dsv41 bench: {opts.display()}")
    t0 = time.time()
    report = run_bench(opts)
    print()
    print(format_report(report))
    if opts.json:
        write_json(opts.json, report_json(report))
        print(f"json: {opts.json}")
    if opts.plots:
        print("plots: " + ", ".join(str(p) for p in write_plots(report, opts.plots)))
    print(f"total {time.time() - t0:.0f} s")
    return 0
