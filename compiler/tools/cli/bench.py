"""`dsv41 bench <sub-verb>`: e2e (the default), kernels, serve, pool, soak, load, spec, engram;
one `<sub>_args` / `<sub>_options` / `run_<sub>` per sub-verb, each calling the `run_command` of
its module in compiler/tools/bench/.

`dsv41 bench [options]` (no sub-verb) is `dsv41 bench e2e [options]`: `main` names the default
sub-verb before parsing (`with_default_bench_verb`), the one dispatch outside argparse."""

from __future__ import annotations

from dataclasses import fields
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from dsv41.compiler.tools.bench.e2e_records import IMPLS, BenchOptions, Impl, Profile
from dsv41.compiler.tools.bench.measure import parse_tokens
from dsv41.compiler.tools.bench.pool import PoolBenchOptions
from dsv41.compiler.tools.bench.pool import run_command as run_pool_command
from dsv41.compiler.tools.bench.soak import SoakOptions
from dsv41.compiler.tools.bench.soak import run_command as run_soak_command
from dsv41.compiler.tools.cli.common import (
    count,
    counts,
    natural,
    path_or_none,
    positive_seconds,
    print_args,
    split,
)
from dsv41.compiler.tools.cli.serve import check_redis, serving_args, serving_options

if TYPE_CHECKING:
    from dsv41.compiler.tools.bench.engram import EngramBenchOptions
    from dsv41.compiler.tools.bench.kernels import KernelBenchOptions
    from dsv41.compiler.tools.bench.load import LoadBenchOptions
    from dsv41.compiler.tools.bench.serve import BenchServeOptions
    from dsv41.compiler.tools.bench.spec import SpecBenchOptions


class BenchVerb(StrEnum):
    """The sub-verbs of `dsv41 bench`, in the order `--help` lists them."""

    E2E = "e2e"  # the default: decode against context, prefill, time to first token
    KERNELS = "kernels"
    SERVE = "serve"
    POOL = "pool"
    SOAK = "soak"
    LOAD = "load"
    SPEC = "spec"
    ENGRAM = "engram"


BENCH_VERBS = tuple(BenchVerb)


def with_default_bench_verb(argv: list[str]) -> list[str]:
    """`dsv41 bench [options]` -> `dsv41 bench e2e [options]` (argparse has no optional
    sub-verb); `dsv41 bench --help` lists the sub-verbs, an unknown word is argparse's error."""
    if argv[:1] == ["bench"] and (len(argv) == 1 or (argv[1].startswith("-")
                                                     and argv[1] not in ("-h", "--help"))):
        return ["bench", BenchVerb.E2E.value, *argv[1:]]
    return argv


# ---- e2e ----------------------------------------------------------------------------------------


def e2e_args(p) -> None:
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
    p.add_argument("--reps", type=count, default=5, help="timed decode steps per cell")
    p.add_argument("--budget-s", type=positive_seconds, default=120.0,
                   help="seconds one implementation may spend at one context")
    p.add_argument("--prefill-tokens", type=natural, default=1024, help="0: no prefill")
    p.add_argument("--prefill-impls", default="artifact,eager")
    p.add_argument("--prefill-reps", type=count, default=3)
    p.add_argument("--prefill-lengths", default=None,
                   help="a prefill row per prompt length, e.g. 8K,32K,128K (default: "
                        "--prefill-tokens)")
    p.add_argument("--prefill-chunk", type=count, default=2048,
                   help="prefill chunk in tokens (the engine's default)")
    p.add_argument("--tiers", dest="tiers", action="store_true", default=True)
    p.add_argument("--no-tiers", dest="tiers", action="store_false")
    p.add_argument("--tier-context", type=count, default=1024, help="the cold turn's prompt")
    p.add_argument("--tier-suffix", type=count, default=32, help="later turns' new tokens")
    p.add_argument("--tier-impls", default="artifact,eager")
    p.add_argument("--threads", type=natural, default=0, help="torch and TVM threads (0: torch's)")
    p.add_argument("--profile", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--profile-context", default="64K")
    p.add_argument("--profile-top", type=count, default=15,
                   help="rows of the decode-step profile (functions by time)")
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")
    p.add_argument("--seed", type=natural, default=0)
    p.add_argument("--contend", type=natural, default=0,
                   help="N busy-loop processes at nice 19 beside a second decode pass (the "
                        "artifact's), reported with the quiet figure (0: none)")


def impls_of(text: str) -> tuple[Impl | str, ...]:
    """'artifact,eager' -> (Impl.ARTIFACT, Impl.EAGER); an unknown name stays a string, for
    `BenchOptions.validate` to refuse with every bad name of the three lists."""
    return tuple(Impl(x) if x in IMPLS else x for x in split(text))


def e2e_options(ns) -> BenchOptions:
    """`dsv41 bench [e2e]` -> e2e.BenchOptions."""
    return BenchOptions(
        preset=ns.preset, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
        artifact=Path(ns.artifact) if ns.artifact else None, out=Path(ns.out),
        target=ns.target, compile_missing=not ns.no_compile, contexts=parse_tokens(ns.contexts),
        impls=impls_of(ns.impls), reps=ns.reps, budget_s=ns.budget_s,
        prefill_tokens=ns.prefill_tokens, prefill_impls=impls_of(ns.prefill_impls),
        prefill_reps=ns.prefill_reps,
        prefill_lengths=parse_tokens(ns.prefill_lengths) if ns.prefill_lengths else (),
        prefill_chunk_tokens=ns.prefill_chunk, tiers=ns.tiers, tier_context=ns.tier_context,
        tier_suffix=ns.tier_suffix, tier_impls=impls_of(ns.tier_impls), threads=ns.threads,
        profile=Profile(ns.profile), profile_context=parse_tokens(ns.profile_context)[0],
        profile_top=ns.profile_top,
        json=Path(ns.json) if ns.json else None, plots=Path(ns.plots) if ns.plots else None,
        seed=ns.seed, contend=ns.contend)


def run_e2e(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.e2e import run_command

    return run_command(e2e_options(ns))


# ---- kernels ------------------------------------------------------------------------------------


def kernels_args(p) -> None:
    p.add_argument("--preset", default="bench", help="small | bench | full (sizes of the cases)")
    p.add_argument("--target", default="cpu",
                   help="cpu | cpu-avx2 | cpu-x86-64 (CUDA targets need a GPU: refused here)")
    p.add_argument("--cases", default=None,
                   help="comma-separated case names or families (attend, indexer, fp8, moe, "
                   "gemv)")
    p.add_argument("--repeat", type=count, default=20, help="timed samples per measurement (max)")
    p.add_argument("--budget", type=positive_seconds, default=None,
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


def kernels_options(ns) -> KernelBenchOptions:
    """`dsv41 bench kernels` -> kernels.KernelBenchOptions."""
    # heavy: TVM; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.kernels import KernelBenchOptions

    return KernelBenchOptions(
        preset=ns.preset, target=ns.target, cases=split(ns.cases or "") or None,
        repeat=ns.repeat, budget_s=ns.budget, json=Path(ns.json) if ns.json else None,
        quick=ns.quick, use_compile=not ns.no_compile, stat=ns.stat, list_cases=ns.list)


def run_kernels(ns) -> int:
    # heavy: TVM; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.kernels import run_command

    return run_command(kernels_options(ns))


# ---- serve --------------------------------------------------------------------------------------


def serve_args(sp) -> None:
    serving_args(sp, server=True)
    sp.add_argument("--clients", type=counts, default="1,4,16", help="concurrent client counts")
    sp.add_argument("--requests", type=count, default=2, help="requests per client, in turn")
    sp.add_argument("--prompt-tokens", type=count, default=32)
    sp.add_argument("--max-tokens", type=count, default=32, help="tokens generated per request")
    sp.add_argument("--long-streams", type=natural, default=8,
                    help="streams decoding while a long prompt arrives (0: no such row)")
    sp.add_argument("--long-prompt-tokens", type=count, default=512)
    sp.add_argument("--long-max-tokens", type=count, default=48,
                    help="tokens each of those streams generates")
    sp.add_argument("--structured-clients", type=counts, default="1,8",
                    help="client counts of the structured-output row (json_schema requests "
                    "against plain ones)")
    sp.add_argument("--json", default=None, help="write the rows as JSON here")


def serve_options(ns) -> BenchServeOptions:
    """`dsv41 bench serve` -> serve.BenchServeOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.serve import BenchServeOptions, ServeBenchOptions

    bench = ServeBenchOptions(
        clients=ns.clients, requests=ns.requests, prompt_tokens=ns.prompt_tokens,
        max_tokens=ns.max_tokens, long_streams=ns.long_streams,
        long_prompt_tokens=ns.long_prompt_tokens, long_max_tokens=ns.long_max_tokens,
        seed=ns.seed, structured_clients=ns.structured_clients)
    return BenchServeOptions(serving_options(ns), bench, Path(ns.json) if ns.json else None)


def run_serve(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.serve import run_command

    print_args("bench serve", ns, hide=("verb", "bench_verb"))
    opts = serve_options(ns)
    check_redis(ns.redis_url)  # before the model loads
    return run_command(opts)


# ---- pool, soak, load ---------------------------------------------------------------------------


def pool_args(p) -> None:
    p.add_argument("--preset", default="full", help="whose encoder snapshot (default: full)")
    p.add_argument("--reps", type=count, default=50, help="put + get repetitions (medians)")
    p.add_argument("--redis-url", default=None,
                   help="a Redis server (default: start a local redis-server on a free port)")
    p.add_argument("--json", default=None, help="write {\"pool\": {...}} here")


def pool_options(ns) -> PoolBenchOptions:
    """`dsv41 bench pool` -> pool.PoolBenchOptions."""
    return PoolBenchOptions(ns.preset, ns.reps, ns.redis_url,
                            Path(ns.json) if ns.json else None).validate()


def run_pool(ns) -> int:
    return run_pool_command(pool_options(ns))


def soak_args(p) -> None:
    d = SoakOptions()
    p.add_argument("--preset", default=d.preset, help="seeded checkpoint of this preset")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    p.add_argument("--artifact", default=None, help="a compiled artifact (default: PyTorch)")
    for name in ("turns", "sessions", "baseline_turn", "sample_every", "seed", "page_tokens",
                 "pool_snapshots", "store_blocks"):
        p.add_argument("--" + name.replace("_", "-"), type=natural if name == "seed" else count,
                       default=getattr(d, name))
    for name in ("pool_ttl_s", "turn_seconds"):
        p.add_argument("--" + name.replace("_", "-"), type=positive_seconds,
                       default=getattr(d, name))
    p.add_argument("--threads", type=count, default=None, help="torch's threads (default: its own)")
    p.add_argument("--json", default=None, help="write the samples and the ratio here")


def soak_options(ns) -> SoakOptions:
    """`dsv41 bench soak` -> soak.SoakOptions (the checkpoint resolved when the soak runs)."""
    kw = {f.name: getattr(ns, f.name) for f in fields(SoakOptions)}
    for k in ("checkpoint", "artifact", "json"):
        kw[k] = Path(kw[k]) if kw[k] else None
    opts = SoakOptions(**kw)
    opts.validate()
    return opts


def run_soak(ns) -> int:
    return run_soak_command(soak_options(ns))


def load_args(p) -> None:
    p.add_argument("--preset", default="bench")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)


def load_options(ns) -> LoadBenchOptions:
    """`dsv41 bench load` -> load.LoadBenchOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.load import LoadBenchOptions

    return LoadBenchOptions(preset=ns.preset,
                            checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
                            device=ns.device, json=Path(ns.json) if ns.json else None)


def run_load(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.load import run_command

    return run_command(load_options(ns))


# ---- engram, spec -------------------------------------------------------------------------------


def engram_args(p) -> None:
    p.add_argument("--artifact", default=None,
                   help="a compiled artifact with prefill (or prefill_all) and decode entries "
                        "(needed)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    p.add_argument("--preset", default="bench", help="the seeded checkpoint's preset")
    p.add_argument("--device", default=None, help="cpu or cuda:N (default: the artifact's)")
    p.add_argument("--prompt-tokens", default="128,512", help="prompt lengths, e.g. 128,4K")
    p.add_argument("--decode-steps", type=count, default=8)
    p.add_argument("--reps", type=count, default=2, help="timed repeats per mode (after a warm-up)")
    p.add_argument("--threads", type=count, default=None, help="TVM's CPU pool")
    p.add_argument("--json", default=None)


def engram_options(ns) -> EngramBenchOptions:
    """`dsv41 bench engram` -> engram.EngramBenchOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.engram import EngramBenchOptions

    return EngramBenchOptions(
        artifact=path_or_none(ns.artifact), checkpoint=path_or_none(ns.checkpoint),
        preset=ns.preset, device=ns.device,
        prompt_tokens=parse_tokens(ns.prompt_tokens),
        decode_steps=ns.decode_steps, reps=ns.reps, threads=ns.threads,
        json=path_or_none(ns.json))


def run_engram(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.engram import run_command

    return run_command(engram_options(ns))


def spec_args(p) -> None:
    p.add_argument("--preset", default="small", help="small | bench | full (seeded checkpoint)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--contexts", default="256,896")
    p.add_argument("--max-draft", type=count, default=5)
    p.add_argument("--reps", type=count, default=3)
    p.add_argument("--tokens", type=count, default=24, help="decoded tokens per engine run")
    p.add_argument("--prompt-tokens", type=count, default=32,
                   help="the engine runs' prompt (their context)")
    p.add_argument("--rates", default="0.3,0.6,0.8,0.9")
    p.add_argument("--batches", type=counts, default="1",
                   help="batch sizes of the injected-acceptance rows, comma-separated")
    p.add_argument("--rounds", type=count, default=1,
                   help="timed plain / speculative runs per injected row, alternating; each "
                        "figure the best of its rounds")
    p.add_argument("--profile", action="store_true",
                   help="an artifact's decode step and verify of 1 + --max-draft rows at the "
                        "largest context, profiled per function")
    p.add_argument("--threads", type=natural, default=0, help="torch threads (0: torch's)")
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=natural, default=0)
    p.add_argument("--impls", default="graph", help="graph and/or artifact, comma-separated")
    p.add_argument("--artifact", default=None, help="the artifact of --impls artifact")


def spec_options(ns) -> SpecBenchOptions:
    """`dsv41 bench spec` -> spec.SpecBenchOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.spec import SpecBenchOptions

    try:
        rates = tuple(float(r) for r in ns.rates.split(","))
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {ns.rates!r}.") from None
    return SpecBenchOptions(
        preset=ns.preset, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
        contexts=parse_tokens(ns.contexts), max_draft=ns.max_draft, reps=ns.reps,
        tokens=ns.tokens, prompt_tokens=ns.prompt_tokens, rates=rates, batches=ns.batches,
        rounds=ns.rounds, profile=ns.profile, threads=ns.threads,
        json=Path(ns.json) if ns.json else None, seed=ns.seed, impls=split(ns.impls),
        artifact=Path(ns.artifact) if ns.artifact is not None else None).validate()


def run_spec(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.bench.spec import run_command

    return run_command(spec_options(ns))


# ---- the sub-verb tree --------------------------------------------------------------------------


def _verb(sub, name: BenchVerb, help_: str, add_args, func, options,
          description: str | None = None, **defaults) -> None:
    """One sub-verb: its options, its command and its options dataclass builder."""
    sp = sub.add_parser(name.value, help=help_, description=description or help_)
    add_args(sp)
    sp.set_defaults(func=func, options=options, **defaults)


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: `dsv41 bench [e2e] [options]` end to end "
                                         "(the default), or a sub-verb: kernels, serve, pool, "
                                         "soak, load, spec (`dsv41 bench SUB-VERB --help`)",
                           description="Benchmarks. `dsv41 bench [options]` runs the end-to-end "
                                       "benchmark (sub-verb e2e, the default).")
    sub = bench.add_subparsers(dest="bench_verb", required=True, metavar="SUB-VERB")
    _verb(sub, BenchVerb.E2E, "the default: decode against context, prefill and time to first "
          "token", e2e_args, run_e2e, e2e_options,
          "End-to-end benchmark: decode against context, prefill and time to first token, for "
          "the compiled artifact, PyTorch eager and torch.compile. `dsv41 bench kernels --help` "
          "benchmarks single kernels.")
    _verb(sub, BenchVerb.KERNELS, "each TIR kernel against its PyTorch oracle, on a roofline",
          kernels_args, run_kernels, kernels_options,
          "Time each TIR kernel against its PyTorch oracle (eager and torch.compile) on this "
          "machine's measured roofline.", error_prog="bench kernels")
    _verb(sub, BenchVerb.SERVE, "the HTTP server under concurrent streaming clients", serve_args,
          run_serve, serve_options)
    _verb(sub, BenchVerb.POOL, "snapshot put / get: in-process pool vs Redis", pool_args,
          run_pool, pool_options)
    _verb(sub, BenchVerb.SOAK, "many turns with every tier evicting; RSS sampled", soak_args,
          run_soak, soak_options,
          "many turns over rotating sessions with every tier evicting, and the process's RSS "
          "sampled along the way")
    _verb(sub, BenchVerb.LOAD, "peak RSS while loading a checkpoint", load_args, run_load,
          load_options)
    _verb(sub, BenchVerb.SPEC, "DSpark speculative decoding: verify, acceptance, tok/s",
          spec_args, run_spec, spec_options,
          "DSpark speculative decoding's numbers on the PyTorch graph and on a compiled artifact")
    _verb(sub, BenchVerb.ENGRAM, "host-resident Engram: the gathers and the part of them hidden",
          engram_args, run_engram, engram_options,
          "Host-resident Engram on a compiled artifact: per prefill and decode call, the rows' "
          "gather time, the time the entry waited for them and the part hidden behind its "
          "first blocks, with prefetch on and off (outputs compared bit for bit)")
