"""A sharded artifact: one worker's graph compiled once for every worker (SPMD), with the
collectives in the graph, and the plan in the manifest.

    compile_sharded(args, out, shards=2, entries=("prefill_all",), ccl=CclBackend.CPU_TEST)

The worker graph is captured from a worker's placeholder model (`Model.placeholder(args,
shard)`: its slices' shapes, its experts plus the null expert, its rank as a weight), so every
worker runs the same library on its own weights; this needs every worker's shapes to be equal
(expert counts that divide by N; the heads, o-groups and vocabulary already must). The
collectives (`dsv41::all_reduce` / `all_gather`) lower to destination-passing calls of disco's
`runtime.disco.allreduce` / `allgather` (the session's NCCL: `CclBackend.DISCO`, for GPUs) or of
the CPU test collective (`CclBackend.CPU_TEST`, `runtime/sharded.py`). CPU targets only for now:
a CUDA build runs in a child process (`schedules/cuda_build.py`) that does not take a shard yet.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import tvm

from dsv41.compiler.build import (
    BOUNDED_ROWS,
    ROWS_HINT,
    entry_bounds,
    entry_signature,
    finish_pipeline,
    fuse,
    schedule,
    tir_pipeline,
)
from dsv41.compiler.capture import capture
from dsv41.compiler.lower import lower
from dsv41.graph.artifact_format import (
    ArtifactTarget,
    ShardedManifest,
    freeze,
    sha256_file,
    write_manifest_file,
)
from dsv41.graph.collectives import CclBackend, ExportCollectives
from dsv41.graph.config import ModelArgs
from dsv41.graph.entries import Entry
from dsv41.graph.model import Model
from dsv41.graph.plan import build_plan
from dsv41.graph.sharding import WorkerShard, expert_block, shard_plan, shard_plan_json
from dsv41.graph.targets import TargetName, get_target, target_cpu_features


def check_even_split(args: ModelArgs, shards: int) -> None:
    """ValueError unless every worker's shapes are the same (one library for all)."""
    shard_plan(args, shards)  # heads, o-groups, vocabulary, FP8 tiles
    for p in build_plan(args).layers:
        n_routed, _ = args.moe_config(p.layer)
        sizes = {len(expert_block(w, shards, n_routed)) for w in range(shards)}
        if len(sizes) != 1:
            raise ValueError(f"Layer {p.layer}'s {n_routed} routed experts do not split evenly "
                             f"over {shards} workers (blocks of {sorted(sizes)}): one library "
                             "cannot serve every worker; choose a worker count that divides "
                             "them.")


def compile_sharded(args: ModelArgs, out: str | Path, *, shards: int,
                    entries: tuple[str, ...] = ("prefill_all",), target: str = "cpu",
                    ccl: CclBackend = CclBackend.CPU_TEST, model_name: str = "model",
                    say=print) -> Path:
    """Build `entries` of the worker graph into `out` (one library per entry, every worker's),
    and write its manifest. Returns the manifest's path."""

    spec = get_target(target)
    if spec.is_cuda:
        raise ValueError("Sharded artifacts are built for CPU targets only so far (the CUDA "
                         "build's child process does not take a shard yet).")
    if shards < 2:
        raise ValueError(f"A sharded artifact has 2 or more workers, got {shards}; compile "
                         "one worker's artifact with `dsv41 compile`.")
    check_even_split(args, shards)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = Model.placeholder(args, WorkerShard(0, shards, ExportCollectives(shards)))
    sigs, seconds = {}, {}
    for entry in entries:
        t = time.perf_counter()
        ep, template = capture(model, entry)
        sigs[entry] = entry_signature(ep, template, model.plan, entry, host_engram=False)
        mod = lower(ep, spec, rows_hint=ROWS_HINT.get(entry),
                    bounds=entry_bounds(model, entry, ep, template), ccl=ccl,
                    null_expert=True,  # the pairs routed to other workers cost nothing
                    bounded_rows=entry in BOUNDED_ROWS,
                    host_engram=False)  # a worker process may not have the host runtime
        mod, _ = fuse(mod, target)
        mod = schedule(mod, target)
        ex = tvm.compile(mod, target=spec.tvm_target(), relax_pipeline=finish_pipeline(target),
                         tir_pipeline=tir_pipeline(target))
        ex.export_library(str(out / f"{entry}.so"))
        seconds[entry] = round(time.perf_counter() - t, 1)
        say(f"{entry}: built for {shards} workers in {seconds[entry]} s")
    plan = shard_plan(args, shards)
    files = {p.name: sha256_file(p) for p in sorted(out.iterdir())
             if p.is_file() and p.suffix == ".so" and p.stem in entries}
    manifest = ShardedManifest(
        model=model_name,
        config=freeze(args.to_dict()),
        config_hash=args.config_hash(),
        target=ArtifactTarget(TargetName(target), freeze(spec.target),
                              target_cpu_features(spec.target)),
        versions=freeze({"tvm": tvm.__version__, "torch": torch.__version__}),
        shards=shards,
        ccl=ccl,
        plan=freeze(shard_plan_json(plan, context=args.max_seq_len)),
        entries=freeze({Entry(e): sig for e, sig in sigs.items()}),
        files=freeze(files),
        compile_seconds=freeze(seconds),
        created_unix=int(time.time()),
    )
    return write_manifest_file(out, manifest)
