"""`dsv41 <verb>`: one parser tree (`build_parser`: every verb, `dsv41 bench <sub-verb>` and
`dsv41 selftest` as its subparsers). Each verb parses and validates, prints its arguments, builds
one options dataclass (`ns.options(ns)` where the verb has one) and calls one API function of
the package that owns the work, then ends with a short summary.

`dsv41 bench [options]` (no sub-verb) is `dsv41 bench e2e [options]`: `main` names the default
sub-verb before parsing (`with_default_bench_verb`), the one dispatch outside argparse."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from dsv41.compiler.tools.assets import ensure_artifact, ensure_checkpoint

BENCH_VERBS = ("e2e", "kernels", "serve", "pool", "soak", "load", "spec", "engram")
HIDDEN = ("func", "options", "error_prog")  # parser plumbing, never printed as an argument


def _args_from(ns):
    from dsv41.graph.config import resolve_args

    return resolve_args(getattr(ns, "preset", None), getattr(ns, "config", None))


def _print_args(verb: str, ns, hide: tuple[str, ...] = ()) -> None:
    shown = {k: v for k, v in vars(ns).items() if k not in (*HIDDEN, *hide)}
    print(f"dsv41 {verb} " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in shown.items()))


def cmd_plan(ns) -> int:
    from dsv41.graph.config import PRESETS
    from dsv41.graph.plan import build_plan, format_plan

    names = PRESETS if ns.preset == "all" else (ns.preset,)
    if ns.shards is not None:
        return _shard_plan(ns, names)
    for name in names:
        args = _args_from(argparse.Namespace(preset=name, config=ns.config))
        plan = build_plan(args)
        label = ns.config or name
        print(f"\n== layer plan: {label} (config {args.config_hash()[:12]}) ==")
        print(format_plan(plan))
        if ns.config:
            break
    return 0


def _shard_plan(ns, names) -> int:
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.sharding import format_shard_plan, shard_plan, shard_plan_json

    if not ns.config and len(names) != 1:
        raise ValueError("--shards needs one --preset (or --config), not all of them.")
    (context,) = parse_contexts(ns.context)
    args = _args_from(argparse.Namespace(preset=names[0], config=ns.config))
    plan = shard_plan(args, ns.shards)
    print(f"== shard plan: {ns.config or names[0]} (config {args.config_hash()[:12]}) ==")
    print(format_shard_plan(plan, context=context))
    if ns.json:
        Path(ns.json).write_text(json.dumps(shard_plan_json(plan, context=context), indent=1))
        print(f"json: {ns.json}")
    return 0


def cmd_bill(ns) -> int:
    from dsv41.graph.bill import bill_chart, bill_json, format_bill, make_bill, parse_contexts

    _print_args("bill", ns)
    bill = make_bill(_args_from(ns), contexts=parse_contexts(ns.context), kv_dtype=ns.kv_dtype)
    print(format_bill(bill))
    if ns.chart:
        print(f"chart: {bill_chart(bill, ns.chart)}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(bill_json(bill), indent=1))
        print(f"json: {ns.json}")
    return 0


def cmd_checkpoint(ns) -> int:
    from dsv41.graph.checkpoint import write_seeded_checkpoint

    _print_args("checkpoint", ns)
    t0 = time.time()
    out = write_seeded_checkpoint(_args_from(ns), ns.out, seed=ns.seed, progress=True,
                                  overwrite=ns.overwrite)
    print(f"wrote {out} in {time.time() - t0:.1f} s")
    return 0


def score_options(ns):
    """`dsv41 score` -> scoring.ScoreOptions."""
    from dsv41.compiler.tools.scoring import ScoreOptions

    return ScoreOptions(
        checkpoint=Path(ns.checkpoint), tokens=Path(ns.tokens), out=Path(ns.out),
        prefill=ns.prefill, mode=ns.mode, backend=ns.backend, kv_dtype=ns.kv_dtype,
        hidden_states=tuple(int(x) for x in ns.hidden_states.split(",")) if ns.hidden_states
        else (), images=tuple(Path(p) for p in ns.images.split(",")) if ns.images else ())


def cmd_score(ns) -> int:
    from dsv41.compiler.tools.scoring import score_command

    _print_args("score", ns)
    return score_command(score_options(ns))


def _check_target(target: str) -> None:
    from dsv41.graph.targets import target_names

    if target not in target_names():
        raise ValueError(f"Unknown target {target!r}; targets: {', '.join(target_names())}.")


def _model_name(ns) -> str:
    """The preset, or a --config's folder name (a checkpoint's config.json is named after its
    folder): how `compile` and `tune` name the artifact."""
    if not ns.config:
        return ns.preset
    cfg = Path(ns.config)
    name = cfg.parent.name if cfg.name == "config.json" else cfg.stem
    return cfg.parent.parent.name if name == "checkpoint" else name


def _compile_entries(ns, default: tuple[str, ...]) -> tuple[str, ...]:
    from dsv41.graph.entries import ENTRIES, VISION_ENTRY

    entries = tuple(ns.entries.split(",")) if ns.entries else default
    known = (*ENTRIES, VISION_ENTRY)  # vision: only when named (a model with a tower)
    bad = [e for e in entries if e not in known]
    if bad:
        raise ValueError(f"Unknown entries {bad}; entries: {', '.join(known)}.")
    return entries


def compile_options(ns):
    """`dsv41 compile` (one artifact) -> build.CompileOptions."""
    from dsv41.compiler.build import CompileOptions
    from dsv41.graph.entries import ENTRIES

    _check_target(ns.target)
    entries = _compile_entries(ns, ENTRIES)
    return CompileOptions(args=_args_from(ns), model_name=_model_name(ns), target=ns.target,
                          out=Path(ns.out), entries=entries,
                          debug_dump=Path(ns.debug_dump) if ns.debug_dump else None,
                          onnx=ns.format == "onnx")


def cmd_compile(ns) -> int:
    from dsv41.compiler.build import PHASES, compile_artifact
    from dsv41.compiler.progress import CompileBar

    _print_args("compile", ns)
    if ns.shards is not None:
        return _compile_sharded(ns)
    opts = compile_options(ns)
    print(f"compile: {opts.display()}")
    print(f"phases per entry: {' -> '.join(PHASES)}")
    bar = CompileBar(opts.entries, PHASES, desc="compile")
    try:
        report = compile_artifact(opts, progress=bar)
    finally:
        bar.close()
    print(f"\nartifact: {report.artifact_dir}")
    print(f"{'entry':16s}" + "".join(f"{p:>10s}" for p in PHASES) + f"{'library':>12s}")
    for entry, times in report.seconds.items():
        size = report.sizes.get(f"{entry}.so", 0)
        cols = "".join(f"{times.get(p, 0.0):9.1f}s" for p in PHASES) if times else \
            f"{'(kept from the existing artifact)':>50s}"
        print(f"{entry:16s}" + cols + f"{size / 1e6:10.1f}MB")
    if report.unfused:
        print(f"note: TVM's FuseTIR refused {', '.join(report.unfused)}; built unfused.")
    print(f"total {report.total_seconds:.1f} s, {sum(report.sizes.values()) / 1e6:.1f} MB")
    return 0


def _compile_sharded(ns) -> int:
    """`dsv41 compile --shards N`: one worker's graph for every worker (compiler/sharded.py)."""
    from dsv41.compiler.sharded import compile_sharded
    from dsv41.graph.collectives import CclBackend

    _check_target(ns.target)
    entries = _compile_entries(ns, ("prefill_all",))
    args, name = _args_from(ns), _model_name(ns)

    if ns.format != "tvm" or ns.debug_dump:
        raise ValueError("--shards builds TVM libraries only (no --format onnx, --debug-dump).")
    out = Path(ns.out) / f"{name}-{args.config_hash()[:12]}" / f"{ns.target}-shards{ns.shards}"
    print(f"compile: model {name}, {ns.shards} workers, target {ns.target}, collectives "
          f"{ns.ccl}, entries {', '.join(entries)}, out {out}")
    path = compile_sharded(args, out, shards=ns.shards, entries=entries, target=ns.target,
                           ccl=CclBackend(ns.ccl), model_name=name)
    print(f"artifact: {path.parent}")
    return 0


def cmd_bundle(ns) -> int:
    from dsv41.compiler.tools.bundle import BundleOptions, write_bundle

    _print_args("bundle", ns)
    artifacts = tuple(Path(a) for a in ns.artifact or ())
    if ns.gpu_check is not None:  # the check's own artifacts, compiled when missing
        from dsv41.compiler.tools.bundle import check_artifacts, check_bundle_folder

        if ns.case is None:
            raise ValueError("--gpu-check needs --case (the shared-small conformance case).")
        check_bundle_folder(Path(ns.out))  # refused before any compile
        artifacts += check_artifacts(ns.gpu_check, Path(ns.case), Path(ns.artifacts_out))
    report = write_bundle(BundleOptions(artifacts=artifacts, out=Path(ns.out),
                                        case=None if ns.case is None else Path(ns.case)))
    for name, info in report.artifacts.items():
        print(f"  artifact {name}: {', '.join(info['entries'])}")
    print(f"wrote {report.out}: {report.files} files, {report.total_bytes / (1 << 20):.1f} MiB; "
          f"run it with `python {report.out}/gpu_check.py` (needs torch and numpy)")
    return 0


def cmd_run(ns) -> int:
    from dsv41.runtime.backends.artifact import CED_ENTRIES, EXACT_ENTRIES
    from dsv41.runtime.engine.agent_loop import AgentLoopConfig, run_agent_loop

    _print_args("run", ns)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    cfg = AgentLoopConfig(
        checkpoint=ckpt, artifact=None, store_dir=None if ns.store is None else Path(ns.store),
        context=ns.context, turns=ns.turns, suffix=ns.suffix, decode=ns.decode, exact=ns.exact,
        restart_between_turns=ns.restart_between_turns, keep_store=ns.keep_store,
        page_tokens=ns.page_tokens, seed=ns.seed)
    cfg.validate()  # arguments and the store folder, before anything is compiled
    artifact = None
    if ns.backend == "artifact":
        artifact = ensure_artifact(ckpt, ns.preset, ns.target,
                                   EXACT_ENTRIES if ns.exact else CED_ENTRIES, Path(ns.out))
    elif ns.backend != "torch":
        raise ValueError(f"--backend must be artifact or torch, got {ns.backend!r}.")
    run_agent_loop(replace(cfg, artifact=artifact))
    return 0


def ledger_options(ns):
    """`dsv41 ledger` -> ledger_command.LedgerCommandOptions."""
    from dsv41.compiler.tools.bench.e2e import parse_tokens
    from dsv41.compiler.tools.ledger import LedgerCommandOptions
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.ledger import SWITCHES, LedgerOptions

    switches = tuple(s.strip() for s in ns.switches.split(",")) if ns.switches else \
        tuple(SWITCHES)
    ledger = LedgerOptions(
        contexts=parse_contexts(ns.contexts) if ns.contexts.strip() else (), decode=ns.decode,
        switches=switches, suffix=ns.suffix, seed=ns.seed,
        long_contexts=parse_tokens(ns.long_contexts) if ns.long_contexts else ())
    return LedgerCommandOptions(ledger, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
                                preset=ns.preset, json=Path(ns.json) if ns.json else None)


def cmd_ledger(ns) -> int:
    from dsv41.compiler.tools.ledger import run_command

    _print_args("ledger", ns)
    return run_command(ledger_options(ns))


def tune_options(ns):
    """`dsv41 tune` -> tune.TuneOptions."""
    from dsv41.compiler.tune import TuneOptions
    from dsv41.schedules.tuning_space import PhaseShape

    _check_target(ns.target)
    return TuneOptions(
        args=_args_from(ns), model_name=_model_name(ns), target=ns.target, out=Path(ns.out),
        entries=tuple(e for e in ns.entries.split(",") if e),
        ops=tuple(o for o in ns.ops.split(",") if o), trials=ns.trials,
        per_round=ns.per_round, shape=PhaseShape(batch=ns.batch, tokens=ns.tokens,
                                                 context=ns.context),
        resume=ns.resume, seed=ns.seed, prefer=ns.prefer)


def cmd_tune(ns) -> int:
    from dsv41.compiler.tune import compare_step, format_results, list_tasks, tune
    from dsv41.compiler.tuning_db import database_hash

    _print_args("tune", ns)
    opts = tune_options(ns)
    print(f"tune: {opts.display()}")
    if ns.list:
        for t in list_tasks(opts):
            print(f"  {t.name:60s} {t.label}, {t.calls} call sites")
        return 0
    try:
        report = tune(opts)
    except KeyboardInterrupt:
        return 130
    if report.noop:
        print(f"nothing to do: every selected task has {opts.trials} trials and a current "
              "verdict; the database is unchanged")
    print(format_results(report))
    print(f"tuning time {report.seconds:.0f} s (search, build and measure "
          f"{report.search_seconds:.0f} s; task extraction {report.extract_seconds:.0f} s)")
    used = sum(r.apply for r in report.results)
    print(f"database: {opts.tuning_dir} (sha256 {(database_hash(opts.tuning_dir) or '-')[:16]})"
          f"; `dsv41 compile` uses {used} tuned function(s), the rest keep their hand "
          "schedules")
    if ns.compare_step:
        print(compare_step(opts))
    return 0


# ---- serve, chat (runtime/serving/assembly.py) --------------------------------------------------


def serving_options(ns):
    """The engine and batcher options `serve`, `chat` and `bench serve` share."""
    from dsv41.runtime.serving.assembly import ServingOptions

    path = lambda v: None if v is None else Path(v)  # noqa: E731
    return ServingOptions(
        artifact=path(ns.artifact), backend=ns.backend, checkpoint=path(ns.checkpoint),
        preset=ns.preset, seed=ns.seed, store=path(ns.store), page_tokens=ns.page_tokens,
        target=ns.target, out=Path(ns.out), model_name=ns.model_name,
        max_running=ns.max_running, max_queue=ns.max_queue, prefill_chunk=ns.prefill_chunk,
        redis_url=ns.redis_url)


def serve_options(ns):
    """`dsv41 serve` -> serving.ServeOptions."""
    from dsv41.runtime.serving.assembly import ServeOptions

    return ServeOptions(serving_options(ns), host=ns.host, port=ns.port, api_key=ns.api_key,
                        request_timeout_s=None if ns.request_timeout <= 0 else ns.request_timeout,
                        log_level=ns.log_level, role=ns.role).validate()


def cmd_serve(ns) -> int:
    from dsv41.compiler.tools.assets import COMPILING
    from dsv41.runtime.serving.assembly import masked_url, serve

    _print_args("serve", argparse.Namespace(**{
        **vars(ns), "api_key": "***" if ns.api_key else None,
        "redis_url": masked_url(ns.redis_url)}))
    return serve(serve_options(ns), COMPILING)


def chat_options(ns):
    """`dsv41 chat` -> serving.ChatOptions."""
    from dsv41.runtime.serving.assembly import ChatOptions

    return ChatOptions(serving_options(ns), system=ns.system, thinking=ns.thinking,
                       max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                       seed_sampling=ns.seed_sampling)


def cmd_chat(ns) -> int:
    from dsv41.compiler.tools.assets import COMPILING
    from dsv41.runtime.serving.assembly import chat

    _print_args("chat", ns)
    return chat(chat_options(ns), COMPILING)


# ---- bench <sub-verb> ---------------------------------------------------------------------------


def _split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def bench_options(ns):
    """`dsv41 bench [e2e]` -> bench.BenchOptions."""
    from dsv41.compiler.tools.bench.e2e import BenchOptions, parse_tokens

    return BenchOptions(
        preset=ns.preset, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
        artifact=Path(ns.artifact) if ns.artifact else None, out=Path(ns.out),
        target=ns.target, compile_missing=not ns.no_compile, contexts=parse_tokens(ns.contexts),
        impls=_split(ns.impls), reps=ns.reps, budget_s=ns.budget_s,
        prefill_tokens=ns.prefill_tokens, prefill_impls=_split(ns.prefill_impls),
        prefill_reps=ns.prefill_reps,
        prefill_lengths=parse_tokens(ns.prefill_lengths) if ns.prefill_lengths else (),
        prefill_chunk_tokens=ns.prefill_chunk, tiers=ns.tiers, tier_context=ns.tier_context,
        tier_suffix=ns.tier_suffix, tier_impls=_split(ns.tier_impls), threads=ns.threads,
        profile=ns.profile, profile_context=parse_tokens(ns.profile_context)[0],
        profile_top=ns.profile_top,
        json=Path(ns.json) if ns.json else None, plots=Path(ns.plots) if ns.plots else None,
        seed=ns.seed)


def cmd_bench(ns) -> int:
    from dsv41.compiler.tools.bench.e2e import run_command

    return run_command(bench_options(ns))


def bench_kernels_options(ns):
    """`dsv41 bench kernels` -> bench_kernels.KernelBenchOptions."""
    from dsv41.compiler.tools.bench.kernels import KernelBenchOptions

    return KernelBenchOptions(
        preset=ns.preset, target=ns.target, cases=_split(ns.cases or "") or None,
        repeat=ns.repeat, budget_s=ns.budget, json=Path(ns.json) if ns.json else None,
        quick=ns.quick, use_compile=not ns.no_compile, stat=ns.stat, list_cases=ns.list)


def cmd_bench_kernels(ns) -> int:
    from dsv41.compiler.tools.bench.kernels import run_command

    return run_command(bench_kernels_options(ns))


def bench_serve_options(ns):
    """`dsv41 bench serve` -> serve_bench.BenchServeOptions."""
    from dsv41.compiler.tools.bench.serve import BenchServeOptions, ServeBenchOptions

    try:
        clients = tuple(int(c) for c in ns.clients.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--clients must be comma-separated counts, got {ns.clients!r}.") from None
    bench = ServeBenchOptions(
        clients=clients, requests=ns.requests, prompt_tokens=ns.prompt_tokens,
        max_tokens=ns.max_tokens, long_streams=ns.long_streams,
        long_prompt_tokens=ns.long_prompt_tokens, long_max_tokens=ns.long_max_tokens,
        seed=ns.seed)
    return BenchServeOptions(serving_options(ns), bench, Path(ns.json) if ns.json else None)


def cmd_bench_serve(ns) -> int:
    from dsv41.compiler.tools.bench.serve import run_command

    _print_args("bench serve", ns, hide=("verb", "bench_verb"))
    return run_command(bench_serve_options(ns))


def bench_pool_options(ns):
    """`dsv41 bench pool` -> pool_bench.PoolBenchOptions."""
    from dsv41.compiler.tools.bench.pool import PoolBenchOptions

    return PoolBenchOptions(ns.preset, ns.reps, ns.redis_url,
                            Path(ns.json) if ns.json else None).validate()


def cmd_bench_pool(ns) -> int:
    from dsv41.compiler.tools.bench.pool import run_command

    return run_command(bench_pool_options(ns))


def bench_soak_options(ns):
    """`dsv41 bench soak` -> soak.SoakOptions (the checkpoint resolved when the soak runs)."""
    from dsv41.compiler.tools.bench.soak import SoakOptions

    kw = {f.name: getattr(ns, f.name) for f in fields(SoakOptions)}
    for k in ("checkpoint", "artifact", "json"):
        kw[k] = Path(kw[k]) if kw[k] else None
    opts = SoakOptions(**kw)
    opts.validate()
    return opts


def cmd_bench_soak(ns) -> int:
    from dsv41.compiler.tools.bench.soak import run_command

    return run_command(bench_soak_options(ns))


def bench_load_options(ns):
    """`dsv41 bench load` -> bench_load.LoadBenchOptions."""
    from dsv41.compiler.tools.bench.load import LoadBenchOptions

    return LoadBenchOptions(preset=ns.preset,
                            checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
                            device=ns.device, json=Path(ns.json) if ns.json else None)


def cmd_bench_load(ns) -> int:
    from dsv41.compiler.tools.bench.load import run_command

    return run_command(bench_load_options(ns))


def bench_engram_options(ns):
    """`dsv41 bench engram` -> engram_bench.EngramBenchOptions."""
    from dsv41.compiler.tools.bench.e2e import parse_tokens
    from dsv41.compiler.tools.bench.engram import EngramBenchOptions

    return EngramBenchOptions(
        artifact=Path(ns.artifact) if ns.artifact else None,
        checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
        preset=ns.preset, device=ns.device,
        prompt_tokens=parse_tokens(ns.prompt_tokens),
        decode_steps=ns.decode_steps, reps=ns.reps, threads=ns.threads,
        json=Path(ns.json) if ns.json else None)


def cmd_bench_engram(ns) -> int:
    from dsv41.compiler.tools.bench.engram import run_command

    return run_command(bench_engram_options(ns))


def bench_spec_options(ns):
    """`dsv41 bench spec` -> spec_bench.SpecBenchOptions."""
    from dsv41.compiler.tools.bench.e2e import parse_tokens
    from dsv41.compiler.tools.bench.spec import SpecBenchOptions

    try:
        rates = tuple(float(r) for r in ns.rates.split(","))
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {ns.rates!r}.") from None
    return SpecBenchOptions(
        preset=ns.preset, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
        contexts=parse_tokens(ns.contexts), max_draft=ns.max_draft, reps=ns.reps,
        tokens=ns.tokens, prompt_tokens=ns.prompt_tokens, rates=rates, threads=ns.threads,
        json=Path(ns.json) if ns.json else None, seed=ns.seed, impls=_split(ns.impls),
        artifact=Path(ns.artifact) if ns.artifact is not None else None).validate()


def cmd_bench_spec(ns) -> int:
    from dsv41.compiler.tools.bench.spec import run_command

    return run_command(bench_spec_options(ns))


def selftest_options(ns):
    """`dsv41 selftest` -> selftest.SelftestOptions."""
    from dsv41.compiler.tools.selftest import options_from

    return options_from(ns)


def cmd_selftest(ns) -> int:
    from dsv41.compiler.tools.selftest import run_command

    return run_command(selftest_options(ns))


# ---- the parser tree ----------------------------------------------------------------------------


def _model_opts(sp, default="small") -> None:
    sp.add_argument("--preset", default=default, help="small | bench | full | long")
    sp.add_argument("--config", default=None, help="a config.json (inference or HF form)")


def _serving_args(sp, *, server: bool) -> None:
    """The engine and batcher options of `serve`, `chat` and `bench serve`."""
    sp.add_argument("--artifact", default=None, help="a compiled artifact folder")
    sp.add_argument("--backend", default="artifact",
                    help="artifact (compiled; compiles what is missing) | torch")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--seed", type=int, default=0, help="the seeded checkpoint's seed")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue (default:"
                         " a fresh temporary store, removed at the end)")
    sp.add_argument("--page-tokens", type=int, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--model-name", default=None,
                    help="the served model's id (default: the preset, or the checkpoint folder)")
    sp.add_argument("--max-running", type=int, default=16, help="sequences decoded together")
    sp.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting for a slot (beyond: 429)" if server else
                    "requests waiting for a slot")
    sp.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill tokens per batcher step (default: the batcher's)")
    sp.add_argument("--redis-url", default=None,
                    help="the DRAM snapshot pool on this Redis server, shared by every process "
                         "that names it (default: an in-process pool)")


def _bench_e2e_args(p) -> None:
    p.add_argument("--preset", default="bench", help="small | bench | full (seeded checkpoint)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    p.add_argument("--artifact", default=None, help="an artifact folder (default: under --out)")
    p.add_argument("--out", default="artifacts", help="where artifacts live")
    p.add_argument("--target", default="cpu")
    p.add_argument("--no-compile", action="store_true",
                   help="never compile missing artifact entries")
    p.add_argument("--contexts", default="4K,16K,64K,256K",
                   help="decode contexts, e.g. 4K,64K,1M (K=1024)")
    p.add_argument("--impls", default="artifact,eager,compile", help="decode implementations")
    p.add_argument("--reps", type=int, default=5, help="timed decode steps per cell")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="seconds one implementation may spend at one context")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="0: no prefill")
    p.add_argument("--prefill-impls", default="artifact,eager")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--prefill-lengths", default=None,
                   help="a prefill row per prompt length, e.g. 8K,32K,128K (default: "
                        "--prefill-tokens)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="prefill chunk in tokens (the engine's default)")
    p.add_argument("--tiers", dest="tiers", action="store_true", default=True)
    p.add_argument("--no-tiers", dest="tiers", action="store_false")
    p.add_argument("--tier-context", type=int, default=1024, help="the cold turn's prompt")
    p.add_argument("--tier-suffix", type=int, default=32, help="later turns' new tokens")
    p.add_argument("--tier-impls", default="artifact,eager")
    p.add_argument("--threads", type=int, default=0, help="torch and TVM threads (0: torch's)")
    p.add_argument("--profile", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--profile-context", default="64K")
    p.add_argument("--profile-top", type=int, default=15,
                   help="rows of the decode-step profile (functions by time)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")
    p.add_argument("--seed", type=int, default=0)


def _bench_kernels_args(p) -> None:
    p.add_argument("--preset", default="bench", help="small | bench | full (sizes of the cases)")
    p.add_argument("--target", default="cpu",
                   help="cpu | cpu-x86-64 (CUDA targets need a GPU: refused here)")
    p.add_argument("--cases", default=None,
                   help="comma-separated case names or families (attend, indexer, fp8, moe, "
                   "gemv)")
    p.add_argument("--repeat", type=int, default=20, help="timed samples per measurement (max)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per measurement before it stops early (default 1.5, quick "
                        "0.3)")
    p.add_argument("--json", default=None, help="write machine numbers + rows here")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, short probes: a smoke run of the harness, not a measurement")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--stat", default="median", choices=("median", "min"),
                   help="statistic of the samples the table reports (min: least disturbed by "
                        "other processes on a shared machine)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")


def _bench_serve_args(sp) -> None:
    _serving_args(sp, server=True)
    sp.add_argument("--clients", default="1,4,16", help="concurrent client counts")
    sp.add_argument("--requests", type=int, default=2, help="requests per client, in turn")
    sp.add_argument("--prompt-tokens", type=int, default=32)
    sp.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    sp.add_argument("--long-streams", type=int, default=8,
                    help="streams decoding while a long prompt arrives (0: no such row)")
    sp.add_argument("--long-prompt-tokens", type=int, default=512)
    sp.add_argument("--long-max-tokens", type=int, default=48,
                    help="tokens each of those streams generates")
    sp.add_argument("--json", default=None, help="write the rows as JSON here")


def _bench_pool_args(p) -> None:
    p.add_argument("--preset", default="full", help="whose encoder snapshot (default: full)")
    p.add_argument("--reps", type=int, default=50, help="put + get repetitions (medians)")
    p.add_argument("--redis-url", default=None,
                   help="a Redis server (default: start a local redis-server on a free port)")
    p.add_argument("--json", default=None, help="write {\"pool\": {...}} here")


def _bench_soak_args(p) -> None:
    from dsv41.compiler.tools.bench.soak import SoakOptions

    d = SoakOptions()
    p.add_argument("--preset", default=d.preset, help="seeded checkpoint of this preset")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    p.add_argument("--artifact", default=None, help="a compiled artifact (default: PyTorch)")
    for name in ("turns", "sessions", "baseline_turn", "sample_every", "seed", "page_tokens",
                 "pool_snapshots", "store_blocks"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("pool_ttl_s", "turn_seconds"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    p.add_argument("--json", default=None, help="write the samples and the ratio here")


def _bench_load_args(p) -> None:
    p.add_argument("--preset", default="bench")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)


def _bench_engram_args(p) -> None:
    p.add_argument("--artifact", default=None,
                   help="a compiled artifact with prefill (or prefill_all) and decode entries "
                        "(needed)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    p.add_argument("--preset", default="bench", help="the seeded checkpoint's preset")
    p.add_argument("--device", default=None, help="cpu or cuda:N (default: the artifact's)")
    p.add_argument("--prompt-tokens", default="128,512", help="prompt lengths, e.g. 128,4K")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=2, help="timed repeats per mode (after a warm-up)")
    p.add_argument("--threads", type=int, default=None, help="TVM's CPU pool")
    p.add_argument("--json", default=None)


def _bench_spec_args(p) -> None:
    p.add_argument("--preset", default="small", help="small | bench | full (seeded checkpoint)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--contexts", default="256,896")
    p.add_argument("--max-draft", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24, help="decoded tokens per engine run")
    p.add_argument("--prompt-tokens", type=int, default=32,
                   help="the engine runs' prompt (their context)")
    p.add_argument("--rates", default="0.3,0.6,0.9")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impls", default="graph", help="graph and/or artifact, comma-separated")
    p.add_argument("--artifact", default=None, help="the artifact of --impls artifact")


def _verb(sub, name: str, help_: str, add_args, func, options, description: str | None = None,
          **defaults) -> None:
    """One sub-verb: its options, its command and its options dataclass builder."""
    sp = sub.add_parser(name, help=help_, description=description or help_)
    add_args(sp)
    sp.set_defaults(func=func, options=options, **defaults)


def _bench_parsers(bench) -> None:
    """`dsv41 bench <sub-verb>`: e2e (the default), kernels, serve, pool, soak, load, spec,
    engram."""
    sub = bench.add_subparsers(dest="bench_verb", required=True, metavar="SUB-VERB")
    _verb(sub, "e2e", "the default: decode against context, prefill and time to first token",
          _bench_e2e_args, cmd_bench, bench_options,
          "End-to-end benchmark: decode against context, prefill and time to first token, for "
          "the compiled artifact, PyTorch eager and torch.compile. `dsv41 bench kernels --help` "
          "benchmarks single kernels.")
    _verb(sub, "kernels", "each TIR kernel against its PyTorch oracle, on a roofline",
          _bench_kernels_args, cmd_bench_kernels, bench_kernels_options,
          "Time each TIR kernel against its PyTorch oracle (eager and torch.compile) on this "
          "machine's measured roofline.", error_prog="bench kernels")
    _verb(sub, "serve", "the HTTP server under concurrent streaming clients", _bench_serve_args,
          cmd_bench_serve, bench_serve_options)
    _verb(sub, "pool", "snapshot put / get: in-process pool vs Redis", _bench_pool_args,
          cmd_bench_pool, bench_pool_options)
    _verb(sub, "soak", "many turns with every tier evicting; RSS sampled", _bench_soak_args,
          cmd_bench_soak, bench_soak_options,
          "many turns over rotating sessions with every tier evicting, and the process's RSS "
          "sampled along the way")
    _verb(sub, "load", "peak RSS while loading a checkpoint", _bench_load_args, cmd_bench_load,
          bench_load_options)
    _verb(sub, "spec", "DSpark speculative decoding: verify, acceptance, tok/s", _bench_spec_args,
          cmd_bench_spec, bench_spec_options,
          "DSpark speculative decoding's numbers on the PyTorch graph and on a compiled artifact")
    _verb(sub, "engram", "host-resident Engram: the gathers and the part of them hidden",
          _bench_engram_args, cmd_bench_engram, bench_engram_options,
          "Host-resident Engram on a compiled artifact: per prefill and decode call, the rows' "
          "gather time, the time the entry waited for them and the part hidden behind its "
          "first blocks, with prefetch on and off (outputs compared bit for bit)")


def with_default_bench_verb(argv: list[str]) -> list[str]:
    """`dsv41 bench [options]` -> `dsv41 bench e2e [options]` (argparse has no optional
    sub-verb); `dsv41 bench --help` lists the sub-verbs, an unknown word is argparse's error."""
    if argv[:1] == ["bench"] and (len(argv) == 1 or (argv[1].startswith("-")
                                                     and argv[1] not in ("-h", "--help"))):
        return ["bench", "e2e", *argv[1:]]
    return argv


def build_parser() -> argparse.ArgumentParser:
    """The one parser of every verb and sub-verb."""
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment tools")
    sub = p.add_subparsers(dest="verb", required=True)

    sp = sub.add_parser("plan", help="print the layer plan")
    sp.add_argument("--preset", default="all", help="small | bench | full | long | all")
    sp.add_argument("--config", default=None)
    sp.add_argument("--shards", type=int, default=None,
                    help="the sharding plan over N workers (expert + tensor parallel) instead")
    sp.add_argument("--context", default="1M",
                    help="--shards: the one context the cache bytes are given at")
    sp.add_argument("--json", default=None, help="--shards: also write the plan as JSON")
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("bill", help="the KV bill: global bytes per token and local state")
    _model_opts(sp, "full")
    sp.add_argument("--context", default="128K,1M", help="e.g. 128K,1M (K=1e3, Ki=1024)")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--chart", default=None, help="write a PNG chart here")
    sp.add_argument("--json", default=None, help="write the bill as JSON here")
    sp.set_defaults(func=cmd_bill)

    sp = sub.add_parser("checkpoint", help="write a seeded checkpoint in the official layout")
    _model_opts(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--overwrite", action="store_true")
    sp.set_defaults(func=cmd_checkpoint)

    sp = sub.add_parser("score", help="teacher-forced logits of a token sequence")
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--tokens", required=True, help=".npy or whitespace-separated ids")
    sp.add_argument("--prefill", type=int, default=None, help="tokens prefilled at position 0")
    sp.add_argument("--mode", default="exact", choices=("exact", "ced"))
    sp.add_argument("--backend", default="torch")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--hidden-states", default="", help="e.g. 0,1,2,3")
    sp.add_argument("--images", default="",
                    help="comma-separated image files whose spans the prompt holds, in order")
    sp.add_argument("--out", required=True)
    sp.set_defaults(func=cmd_score, options=score_options)

    sp = sub.add_parser("compile", help="compile the model's phases into an artifact")
    _model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100")
    sp.add_argument("--out", default="artifacts")
    sp.add_argument("--entries", default="", help="comma-separated subset of the entries")
    sp.add_argument("--debug-dump", default=None, help="write the IR after each phase here")
    sp.add_argument("--format", default="tvm", choices=("tvm", "onnx"),
                    help="onnx: also export the captured graphs as ONNX (dsv41 domain)")
    sp.add_argument("--shards", type=int, default=None,
                    help="a sharded artifact: one worker's graph for N workers (CPU targets; "
                         "default entries: prefill_all)")
    sp.add_argument("--ccl", default="cpu-test", choices=("cpu-test", "disco"),
                    help="--shards: the collectives: cpu-test (the in-process test "
                         "collective, a ThreadedSession) or disco (the session's NCCL)")
    sp.set_defaults(func=cmd_compile, options=compile_options)

    sp = sub.add_parser("bundle", help="a self-contained folder that runs artifacts with only "
                                       "torch installed (and the GPU check)")
    sp.add_argument("--artifact", action="append", default=None,
                    help="an artifact folder (repeat for more)")
    sp.add_argument("--out", required=True)
    sp.add_argument("--case", default=None, help="a conformance case folder to carry")
    sp.add_argument("--gpu-check", default=None, metavar="TARGET",
                    help="also the artifacts gpu_check.py runs for TARGET (cuda-sm90: "
                         "shared-small's prefill_all + decode, bench's decode), compiled into "
                         "--artifacts-out when missing")
    sp.add_argument("--artifacts-out", default="artifacts")
    sp.set_defaults(func=cmd_bundle)

    from dsv41.compiler.tools.selftest import DESCRIPTION, add_arguments

    sp = sub.add_parser("selftest", description=DESCRIPTION,
                        help="the device check: conformance, gpu kernel tests, decode roofline")
    add_arguments(sp)
    sp.set_defaults(func=cmd_selftest, options=selftest_options)

    sp = sub.add_parser("bench", help="benchmarks: `dsv41 bench [e2e] [options]` end to end "
                                      "(the default), or a sub-verb: kernels, serve, pool, "
                                      "soak, load, spec (`dsv41 bench SUB-VERB --help`)",
                        description="Benchmarks. `dsv41 bench [options]` runs the end-to-end "
                                    "benchmark (sub-verb e2e, the default).")
    _bench_parsers(sp)

    sp = sub.add_parser("run", help="the agent-loop demo: long context, then short turns")
    sp.add_argument("--preset", default="small")
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--context", type=int, default=512)
    sp.add_argument("--turns", type=int, default=3)
    sp.add_argument("--suffix", type=int, default=32, help="new tokens per turn")
    sp.add_argument("--decode", type=int, default=16, help="tokens decoded per turn")
    sp.add_argument("--exact", action="store_true", help="exact phases throughout (no CED)")
    sp.add_argument("--restart-between-turns", action="store_true",
                    help="a new engine per turn: only the SSD store carries over")
    sp.add_argument("--backend", default="artifact", help="artifact (compiled) | torch")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue with "
                         "--keep-store (default: a fresh temporary store, removed at the end)")
    sp.add_argument("--page-tokens", type=int, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--keep-store", action="store_true",
                    help="continue from the --store folder's contents (without it that folder "
                         "must be new or empty; dsv41 run never deletes a folder)")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("ledger", help="each approximation's cost against exact mode")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--seed", type=int, default=0, help="seeded checkpoint and prompt ids")
    sp.add_argument("--contexts", default="64,256,900",
                    help="prompt lengths, e.g. 64,256,900 ('' for none)")
    sp.add_argument("--long-contexts", default="",
                    help="candidate_pool and shared_selection also over the bench's synthetic "
                         "cache of these many positions, decode steps scored (e.g. 32K,64K; "
                         "K = 1024)")
    sp.add_argument("--decode", type=int, default=8, help="teacher-forced steps scored after it")
    sp.add_argument("--suffix", type=int, default=32, help="replay: new tokens after the prefix")
    sp.add_argument("--switches", default="",
                    help="comma-separated subset of ced,replay,fp4_kv,candidate_pool,"
                         "decoder_carry,shared_selection (default all)")
    sp.add_argument("--json", default=None, help="write the records as JSON here")
    sp.set_defaults(func=cmd_ledger, options=ledger_options)

    sp = sub.add_parser("tune", help="MetaSchedule the artifact's kernels (database in tuning/)")
    _model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100 (CUDA: on a GPU)")
    sp.add_argument("--trials", type=int, default=64,
                    help="measured candidates per task, counted in the database")
    sp.add_argument("--ops", default="",
                    help="comma-separated op families (fp8_linear, sparse_attend, index_scores, "
                         "fp8_dequant, quant_fp8, quant_fp4_kv, quant_mxfp4, qdq_mxfp4, dense) "
                         "or task names (--list); default all")
    sp.add_argument("--resume", action="store_true",
                    help="add to the database an earlier (or interrupted) run left")
    sp.add_argument("--entries", default="decode", help="entries whose kernels are tuned")
    sp.add_argument("--context", type=int, default=8192, help="cache tokens at tuning time")
    sp.add_argument("--tokens", type=int, default=256, help="tokens per call (not decode)")
    sp.add_argument("--batch", type=int, default=1, help="sequences per call")
    sp.add_argument("--per-round", type=int, default=8, help="candidates per search round")
    sp.add_argument("--prefer", default="faster", choices=("faster", "tuned"),
                    help="use a tuned function when faster than the hand schedule (default), "
                         "or whenever its outputs match")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--list", action="store_true", help="list the tasks and exit")
    sp.add_argument("--compare-step", action="store_true",
                    help="also time the decode step compiled with and without the database "
                         "(compiles the decode entry twice)")
    sp.set_defaults(func=cmd_tune, options=tune_options)

    sp = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    _serving_args(sp, server=True)
    sp.add_argument("--host", default="127.0.0.1", help="the address to bind (default: local)")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--api-key", default=None,
                    help="require `Authorization: Bearer KEY` on /v1 (default: no key)")
    sp.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may run before it is cancelled (0: none)")
    sp.add_argument("--log-level", default="info", help="uvicorn's log level")
    sp.add_argument("--role", default="all",
                    help="all (one process) | vision | prefill | decode: one EPD stage, its queues "
                         "and hand-offs on --redis-url (runtime/epd.py)")
    sp.set_defaults(func=cmd_serve, options=serve_options)

    sp = sub.add_parser("chat", help="a terminal chat on the embedded engine (reads stdin)")
    _serving_args(sp, server=False)
    sp.add_argument("--system", default=None, help="a system message")
    sp.add_argument("--thinking", action="store_true", help="thinking mode")
    sp.add_argument("--max-tokens", type=int, default=64, help="tokens per reply at most")
    sp.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--seed-sampling", type=int, default=None, help="the sampler's seed")
    sp.set_defaults(func=cmd_chat, options=chat_options)
    return p



def load_disco_first(ns) -> bool:
    """A command given a sharded artifact (`--artifact DIR`) runs it on disco workers, whose
    runtime libraries must be loaded before anything imports tvm: load them first thing.
    Whether it did."""
    from dsv41.runtime.backends.disco import is_sharded_dir, load_disco

    art = getattr(ns, "artifact", None)
    if isinstance(art, str) and is_sharded_dir(art):
        load_disco()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    from dsv41.runtime.backends.onednn import bound_onednn_caches

    argv = with_default_bench_verb(list(sys.argv[1:] if argv is None else argv))
    ns = build_parser().parse_args(argv)
    try:
        load_disco_first(ns)
        bound_onednn_caches()  # before any torch work of any command (runtime/onednn.py)
        return ns.func(ns)
    except ValueError as e:
        print(f"dsv41 {getattr(ns, 'error_prog', ns.verb)}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
