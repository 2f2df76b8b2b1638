"""`dsv41 compile`: the model's phases compiled into an artifact (compiler/build.py), or with
`--shards N` one worker's graph for N workers (compiler/sharded.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dsv41.compiler.progress import CompileBar
from dsv41.compiler.tools.cli.common import (
    args_from,
    check_target,
    count,
    model_name,
    model_opts,
    out_folder,
    print_args,
)

if TYPE_CHECKING:
    from dsv41.compiler.build import CompileOptions


def add_parser(sub) -> None:
    sp = sub.add_parser("compile", help="compile the model's phases into an artifact")
    model_opts(sp)
    sp.add_argument("--target", default="cpu",
                    help="cpu | cpu-avx2 | cpu-x86-64 | cuda-sm80 | cuda-sm90 | cuda-sm100")
    sp.add_argument("--out", default="artifacts")
    sp.add_argument("--entries", default="", help="comma-separated subset of the entries")
    sp.add_argument("--debug-dump", default=None, help="write the IR after each phase here")
    sp.add_argument("--format", default="tvm", choices=("tvm", "onnx"),
                    help="onnx: also export the captured graphs as ONNX (dsv41 domain)")
    sp.add_argument("--jobs", type=count, default=1,
                    help="CPU targets: entries built at once, each in a process of its own")
    sp.add_argument("--shards", type=count, default=None,
                    help="a sharded artifact: one worker's graph for N workers (CPU targets; "
                         "default entries: prefill_all)")
    sp.add_argument("--ccl", default="cpu-test", choices=("cpu-test", "disco"),
                    help="--shards: the collectives: cpu-test (the in-process test "
                         "collective, a ThreadedSession) or disco (the session's NCCL)")
    sp.set_defaults(func=run, options=options)


def entries_of(ns, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """--entries, checked against the graph's entries (default: every entry but vision)."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.graph.entries import ENTRIES, VISION_ENTRY

    entries = tuple(ns.entries.split(",")) if ns.entries else default or ENTRIES
    known = (*ENTRIES, VISION_ENTRY)  # vision: only when named (a model with a tower)
    bad = [e for e in entries if e not in known]
    if bad:
        raise ValueError(f"Unknown entries {bad}; entries: {', '.join(known)}.")
    return entries


def options(ns) -> CompileOptions:
    """`dsv41 compile` (one artifact) -> build.CompileOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.build import CompileOptions

    check_target(ns.target)
    return CompileOptions(args=args_from(ns), model_name=model_name(ns), target=ns.target,
                          out=out_folder(ns.out), entries=entries_of(ns),
                          debug_dump=Path(ns.debug_dump) if ns.debug_dump else None,
                          onnx=ns.format == "onnx", jobs=ns.jobs)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.build import PHASES, compile_artifact

    print_args("compile", ns)
    if ns.shards is not None:
        return run_sharded(ns)
    opts = options(ns)
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


def run_sharded(ns) -> int:
    """`dsv41 compile --shards N`: one worker's graph for every worker (compiler/sharded.py)."""
    # heavy: TVM and torch; dsv41 --help loads no verb's work
    from dsv41.compiler.sharded import compile_sharded
    from dsv41.graph.collectives import CclBackend

    check_target(ns.target)
    entries = entries_of(ns, ("prefill_all",))
    args, name = args_from(ns), model_name(ns)

    if ns.format != "tvm" or ns.debug_dump:
        raise ValueError("--shards builds TVM libraries only (no --format onnx, --debug-dump).")
    out = out_folder(ns.out) / f"{name}-{args.config_hash()[:12]}" / \
        f"{ns.target}-shards{ns.shards}"
    print(f"compile: model {name}, {ns.shards} workers, target {ns.target}, collectives "
          f"{ns.ccl}, entries {', '.join(entries)}, out {out}")
    path = compile_sharded(args, out, shards=ns.shards, entries=entries, target=ns.target,
                           ccl=CclBackend(ns.ccl), model_name=name)
    print(f"artifact: {path.parent}")
    return 0
