"""`dsv41 tune`: MetaSchedule the artifact's kernels, the database in tuning/
(compiler/tune.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv41.compiler.tools.cli.common import (
    args_from,
    check_target,
    count,
    model_name,
    model_opts,
    natural,
    out_folder,
    print_args,
)

if TYPE_CHECKING:
    from dsv41.compiler.tune import TuneOptions


def add_parser(sub) -> None:
    sp = sub.add_parser("tune", help="MetaSchedule the artifact's kernels (database in tuning/)")
    model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-avx2 | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100 "
                         "(CUDA: on a GPU)")
    sp.add_argument("--trials", type=count, default=64,
                    help="measured candidates per task, counted in the database")
    sp.add_argument("--ops", default="",
                    help="comma-separated op families (fp8_linear, sparse_attend, index_scores, "
                         "fp8_dequant, quant_fp8, quant_fp4_kv, quant_mxfp4, qdq_mxfp4, dense) "
                         "or task names (--list); default all")
    sp.add_argument("--resume", action="store_true",
                    help="add to the database an earlier (or interrupted) run left")
    sp.add_argument("--entries", default="decode", help="entries whose kernels are tuned")
    sp.add_argument("--context", type=count, default=8192, help="cache tokens at tuning time")
    sp.add_argument("--tokens", type=count, default=256, help="tokens per call (not decode)")
    sp.add_argument("--batch", type=count, default=1, help="sequences per call")
    sp.add_argument("--per-round", type=count, default=8, help="candidates per search round")
    sp.add_argument("--prefer", default="faster", choices=("faster", "tuned"),
                    help="use a tuned function when faster than the hand schedule (default), "
                         "or whenever its outputs match")
    sp.add_argument("--seed", type=natural, default=0)
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--list", action="store_true", help="list the tasks and exit")
    sp.add_argument("--compare-step", action="store_true",
                    help="also time the decode step compiled with and without the database "
                         "(compiles the decode entry twice)")
    sp.set_defaults(func=run, options=options)


def options(ns) -> TuneOptions:
    """`dsv41 tune` -> tune.TuneOptions."""
    # heavy: TVM; dsv41 --help loads no verb's work
    from dsv41.compiler.tune import TuneOptions
    from dsv41.schedules.tuning_space import PhaseShape

    check_target(ns.target)
    return TuneOptions(
        args=args_from(ns), model_name=model_name(ns), target=ns.target,
        out=out_folder(ns.out),
        entries=tuple(e for e in ns.entries.split(",") if e),
        ops=tuple(o for o in ns.ops.split(",") if o), trials=ns.trials,
        per_round=ns.per_round, shape=PhaseShape(batch=ns.batch, tokens=ns.tokens,
                                                 context=ns.context),
        resume=ns.resume, seed=ns.seed, prefer=ns.prefer)


def run(ns) -> int:
    # heavy: TVM; dsv41 --help loads no verb's work
    from dsv41.compiler.tune import compare_step, format_results, list_tasks, tune
    from dsv41.compiler.tuning_db import database_hash

    print_args("tune", ns)
    opts = options(ns)
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
