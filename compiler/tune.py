"""`dsv41 tune`: MetaSchedule over an artifact's kernels, at the shapes its phases run.

What is tuned (schedules/tuning_space.py): per entry (default `decode`), the custom-op kernels
and the heaviest generic dense ops of the entry's fused module, each specialised at the phase
shape (batch 1, one decode token or `tokens` prefill tokens, `context` tokens of cache).

Where it goes: `artifacts/<model>-<hash>/<target>/tuning/`:

* `database_workload.json`, `database_tuning_record.json`: MetaSchedule's JSON database (one
  workload per task, one record per measured candidate, appended as each round finishes, so an
  interrupted run loses at most one round);
* `tasks.json`: the task list (each task's unscheduled symbolic function, what it replaces, its
  shapes) and, per task, the verdict of the last verification: the best record's trace replayed
  onto the symbolic function, built, checked against the hand schedule on the same inputs (CPU:
  bit-identical outputs; CUDA: within bf16 tolerance) and timed against it.

`dsv41 compile` (build.schedule) applies a task where the verdict says so: the best trace,
replayed onto the symbolic function, replaces the function whose structural hash the task
recorded. Everything else keeps its hand schedule (our kernels) or the CPU rules / dlight
(generic ops). A trace tuned at a static shape replays onto the symbolic function because every
tile size MetaSchedule sampled is written into the trace with its outermost factor left to be
inferred (`generalise`): on the static shape that is the tuned schedule itself, on a symbolic
dim (batch, context) it is the same tiling with the outer loop counting what is left.

Runs accumulate: `--trials N` is the number of measured candidates each task should have in
the database, and a run measures only what is missing (an interrupted run resumes from the
records it committed; a run with nothing missing changes nothing). Adding to a database that an
earlier run left needs `--resume`.

Builds and measurements run in this process: candidates are built with `tvm.tirx.build` (the
default builder re-imports TVM's tensor intrinsics, ~24 s, in a new worker for every round),
and timed with the module's time evaluator on realistic inputs (valid indices, finite scales).
The search rules are given explicitly, so creating a tune context does not need the tensor
intrinsics either (`tune_task.py`). CUDA targets measure on this machine's GPU;
without one the command refuses before it writes anything.
"""

from __future__ import annotations

import hashlib
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import tvm
import tvm_ffi
from tqdm import tqdm
from tvm import relax

from dsv41.compiler.build import CompileOptions, compile_artifact, run_phases
from dsv41.compiler.capture import CaptureShapes, example_inputs
from dsv41.compiler.kernels import kernel_label, unscheduled
from dsv41.compiler.tune_task import (
    Unsupported,
    build_function,
    device_args,
    device_of,
    hand_function,
    same_outputs,
    time_function,
    tune_task,
    verify_task,
)
from dsv41.compiler.tuning_db import (
    INDEX,
    INDEX_FORMAT,
    best_record,
    has_records,
    open_database,
    read_index,
    record_counts,
    task_from_json,
    task_json,
    trace_digest,
    workload_hash,
    write_index,
)
from dsv41.graph.checkpoint import DEFAULT_CHECKPOINTS
from dsv41.graph.config import ModelArgs
from dsv41.graph.model import Model
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.artifact import read_manifest, weight_for
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.schedules import tuning_space as ts
from dsv41.schedules.tuning_space import OPS, PhaseShape, Task, bind_entry_vars, task_inputs


@dataclass(frozen=True)
class TuneOptions:
    args: ModelArgs
    model_name: str  # as `dsv41 compile` names the artifact
    target: str
    out: Path = Path("artifacts")
    entries: tuple[str, ...] = ("decode",)
    ops: tuple[str, ...] = ()  # families (tuning_space.OPS) or task names; () = all tasks
    trials: int = 64  # measured candidates per task, counted in the database
    per_round: int = 8  # candidates built and measured per search round
    shape: PhaseShape = PhaseShape()
    resume: bool = False
    seed: int = 0
    prefer: str = "faster"  # "faster": use a tuned function that beats the hand one; "tuned":
    # use every tuned function that matches the hand one's outputs

    def display(self) -> str:
        shapes = "; ".join(f"{e}: {self.shape.describe(e)}" for e in self.entries)
        return (f"model {self.model_name} (config {self.args.config_hash()[:12]}), target "
                f"{self.target}, entries {', '.join(self.entries)} ({shapes}), ops "
                f"{', '.join(self.ops) or 'all'}, {self.trials} trials per task, "
                f"{self.per_round} per round, database {self.tuning_dir}")

    @property
    def artifact_dir(self) -> Path:
        return self.out / f"{self.model_name}-{self.args.config_hash()[:12]}" / self.target

    @property
    def tuning_dir(self) -> Path:
        return self.artifact_dir / "tuning"


@dataclass
class TaskResult:
    """One task after a run: what the database holds and the last verification's verdict."""

    name: str
    label: str
    entry: str
    calls: int
    trials: int  # records in the database (failed candidates included)
    new_trials: int  # measured by this run
    best_s: float | None  # best measured candidate at the static shape
    hand_s: float | None  # hand schedule, same inputs, same timer
    tuned_s: float | None  # the best trace replayed onto the symbolic function
    exact: bool | None  # tuned outputs equal the hand schedule's
    apply: bool  # compile will use the tuned function
    reason: str  # why not applied (or "faster")

    @property
    def speedup(self) -> float | None:
        return self.hand_s / self.tuned_s if self.hand_s and self.tuned_s else None


@dataclass
class TuneReport:
    tuning_dir: Path
    results: list[TaskResult] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the run
    search_seconds: float = 0.0  # spent in search + build + measure
    extract_seconds: float = 0.0
    noop: bool = False  # nothing to measure and nothing to verify: files untouched


# ---- target checks -------------------------------------------------------------------------------


def check_target(target_name: str) -> None:
    """CUDA candidates are measured on a GPU of this machine; refuse clearly without one."""

    spec = get_target(target_name)
    if not spec.is_cuda:
        return

    if not tvm.cuda().exist:
        raise ValueError(
            f"Tuning {target_name} measures every candidate on a CUDA GPU, and this machine has "
            "none (tvm.cuda() does not exist). Run `dsv41 tune` on the GPU machine (it builds "
            "and measures there, and writes the database into its artifact folder; copy "
            "`tuning/` back next to this artifact). No database was written.")


# ---- the task list (extracted once per code / config / shape, cached in tasks.json) --------------


def _source_digest() -> str:
    """Digest of the code that shapes the tasks (kernels, graph, lowering, fusion)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = sorted([*(root / "graph").glob("*.py"), *(root / "schedules").glob("*.py"),
                    *(root / "compiler" / n for n in ("capture.py", "lower.py", "build.py",
                                                      "kernels.py", "kernel_keys.py",
                                                      "relax_ops.py"))])
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def fingerprint(opts: TuneOptions) -> dict:
    return {"tvm": tvm.__version__, "config": opts.args.config_hash(), "target": opts.target,
            "entries": list(opts.entries), "shape": vars(opts.shape), "code": _source_digest()}


def _entry_module(opts: TuneOptions, entry: str):
    """The entry's fused module exactly as `compile` builds it (the same phases,
    `build.run_phases`), and its kernels' keys by function name."""

    run = run_phases(Model.placeholder(opts.args), entry, opts.target, until="fuse")
    return run.module, {gv.name_hint: key for key, gv in run.kernels.items()}


def _entry_values(opts: TuneOptions, main, entry: str, batch: int) -> dict:
    shapes = CaptureShapes(batch=batch, tokens=opts.shape.tokens, context=opts.shape.context)
    inputs, _ = example_inputs(Model.placeholder(opts.args), entry, shapes)
    flat = [t for x in inputs for t in (x if isinstance(x, tuple) else (x,))]
    return bind_entry_vars(main, flat)


def entry_tasks(opts: TuneOptions, entry: str, mod, kernel_keys: dict) -> list[Task]:
    """The tasks of one entry's fused module (tuning_space docstring): kernels of the tuned
    families, and the heaviest dense generic ops."""

    spec = get_target(opts.target)
    main = mod["main"]
    values = _entry_values(opts, main, entry, opts.shape.batch)
    sites = ts.call_sites(main)
    kernels, dense = [], []
    for gv, func in mod.functions.items():
        name = gv.name_hint
        if not isinstance(func, tvm.tirx.PrimFunc) or name not in sites:
            continue
        shapes = ts.concrete(sites[name][0], values)
        if shapes is None:
            continue
        key = kernel_keys.get(name)
        if key is not None:
            unsched = unscheduled(key, spec)
            if unsched is None:
                continue
            unsched = ts.as_module_kernel(unsched)
            if ts.signature(unsched) != ts.signature(func):
                continue  # a config-specific variant with another signature: not replaceable
            kind, family, label = "kernel", key.family, kernel_label(key)
        else:
            if func.attrs is not None and func.attrs.get("tirx.is_scheduled"):
                continue
            if not ts.has_reduction(func) or ts.data_dependent(func):
                continue
            unsched, kind, family, label = func, "dense", ts.DENSE, name
        fvals = ts.bind_func_vars(unsched, shapes)
        if fvals is None:
            continue
        try:
            workload = ts.workload_of(unsched, fvals)
        except Exception:  # noqa: BLE001 - a shape TVM cannot specialise: not a task
            continue
        flops = ts.estimate_flops(workload)
        task = Task(name=f"{entry}.{name}", entry=entry, kind=kind, family=family,
                    function=name, key=str(tvm_ffi.structural_hash(func)), func=unsched,
                    hand=func, values=fvals, calls=len(sites[name]), flops=flops,
                    label=f"{label} [{_shape_label(fvals)}]")
        twin = next((t for t in kernels + dense if t.key == task.key), None)
        if twin is not None:  # the same function under another name: one task, all its calls
            twin.calls += task.calls
        elif kind == "dense":
            if flops == flops and flops >= ts.MIN_DENSE_FLOPS:  # not NaN, heavy enough
                dense.append(task)
        else:
            kernels.append(task)
    dense.sort(key=lambda t: -t.flops * t.calls)
    return kernels + dense[: ts.MAX_DENSE]


def _shape_label(values: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def extract_tasks(opts: TuneOptions, say: Callable[[str], None],
                  given: list[Task] | None = None) -> tuple[list[Task], dict]:
    """The tasks (from tasks.json when it was extracted for the same code, config, target,
    entries and shapes; otherwise capture + lower + fuse of each entry, or `given`) and the
    index."""
    fp = fingerprint(opts)
    index = read_index(opts.tuning_dir)
    if index is not None and index.get("fingerprint") == fp and (
            given is None or [d["name"] for d in index["tasks"]] == [t.name for t in given]):
        return [task_from_json(d) for d in index["tasks"]], index
    tasks: list[Task] = list(given or [])
    for entry in opts.entries if given is None else ():
        t0 = time.perf_counter()
        say(f"{entry}: capture + lower + fuse to find the tasks ...")
        mod, keys = _entry_module(opts, entry)
        found = entry_tasks(opts, entry, mod, keys)
        say(f"{entry}: {len(found)} tasks in {time.perf_counter() - t0:.0f} s")
        tasks += found
    old = index or {}
    new = {t.name: task_json(t) for t in tasks}
    same = {d["name"] for d in old.get("tasks", []) if d["name"] in new
            and (new[d["name"]]["key"], new[d["name"]]["func"]) == (d["key"], d["func"])}
    index = {"format": INDEX_FORMAT, "fingerprint": fp, "model": opts.model_name,
             "target": opts.target, "tasks": list(new.values()),
             # verdicts survive only for the same hand function and the same tuned function
             "results": {k: v for k, v in old.get("results", {}).items()
                         if k in same and not v.get("unsupported")}}
    return tasks, index


def select_tasks(tasks: list[Task], ops: tuple[str, ...]) -> list[Task]:
    if not ops:
        return list(tasks)
    names = {t.name for t in tasks} | {t.function for t in tasks}
    unknown = [o for o in ops if o not in OPS and o not in names]
    if unknown:
        raise ValueError(f"Unknown --ops {', '.join(unknown)}; choose op families "
                         f"({', '.join(OPS)}) or task names (`dsv41 tune --list`).")
    return [t for t in tasks if t.family in ops or t.name in ops or t.function in ops]


# ---- the database ---------------------------------------------------------------------------


# ---- replaying a tuned trace onto the symbolic function ------------------------------------------


# ---- the command ---------------------------------------------------------------------------------


def list_tasks(opts: TuneOptions, say: Callable[[str], None] = print) -> list[Task]:
    """The tasks a run would tune (extracting them if tasks.json is not current; nothing is
    written)."""
    tasks, _ = extract_tasks(opts, say)
    return select_tasks(tasks, opts.ops)


def tune(opts: TuneOptions, progress: bool = True, say: Callable[[str], None] = print,
         tasks: list[Task] | None = None) -> TuneReport:
    """Extract (or reuse) the tasks, top every selected task up to opts.trials records, verify
    the tasks whose best record changed, and write tasks.json. See the module docstring.
    `tasks` replaces the extraction (tests, and callers that build tasks themselves)."""

    if opts.trials < 1 or opts.per_round < 1:
        raise ValueError("--trials and --per-round must be at least 1.")
    if opts.prefer not in ("faster", "tuned"):
        raise ValueError(f"--prefer must be faster or tuned, got {opts.prefer!r}.")
    check_target(opts.target)
    try:
        import xgboost  # noqa: F401 - MetaSchedule's cost model
    except ImportError as e:
        raise ValueError("dsv41 tune needs xgboost, a dependency of dsv41: reinstall with "
                         "`python -m pip install -e .` (xgboost-cpu is enough).") from e
    spec = get_target(opts.target)
    t_start = time.perf_counter()
    tasks, index = extract_tasks(opts, say, tasks)
    t_extract = time.perf_counter() - t_start
    chosen = select_tasks(tasks, opts.ops)
    if not chosen:
        raise ValueError("No tasks to tune for these entries and --ops.")
    existing = has_records(opts.tuning_dir)
    db = open_database(opts.tuning_dir)
    counts = record_counts(db)
    results = index.get("results", {})
    todo = {t.name: 0 if _settled(results.get(t.name, {})) else
            max(0, opts.trials - counts.get(workload_hash(t.workload()), 0)) for t in chosen}
    stale = {t.name for t in chosen if not results.get(t.name, {}).get("unsupported") and (
        t.name not in results or results[t.name].get("trace") != _best_digest(db, t)
        or results[t.name].get("prefer", "faster") != opts.prefer)}
    if not any(todo.values()) and not stale and (opts.tuning_dir / INDEX).is_file():
        report = TuneReport(opts.tuning_dir, noop=True, extract_seconds=t_extract)
        report.results = [_result(t, results.get(t.name, {}), 0, counts) for t in chosen]
        report.seconds = time.perf_counter() - t_start
        return report
    if existing and any(todo.values()) and not opts.resume:
        raise ValueError(f"{opts.tuning_dir} already holds a tuning database; pass --resume to "
                         "add to it (each task is topped up to --trials), or delete the folder "
                         "to start over.")
    write_index(opts.tuning_dir, index)  # the task list first: an interrupted run resumes it
    measured: dict[str, int] = {}
    t_search = time.perf_counter()
    bar = tqdm(total=sum(todo.values()), desc="tune", unit="trial", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for t in chosen:
            if not todo[t.name]:
                continue
            hand = _quick_hand_time(t, spec, opts.seed)

            def on_round(n: int, best: float | None, t=t, hand=hand) -> None:
                bar.update(n)
                bar.set_postfix_str(f"{t.label}: best {_ms(best)} ms, hand {_ms(hand)} ms")

            bar.set_postfix_str(f"{t.label}: searching (hand {_ms(hand)} ms)")
            try:
                measured[t.name] = tune_task(t, db, spec, trials=opts.trials,
                                             per_round=opts.per_round, seed=opts.seed,
                                             on_round=on_round)
            except Unsupported as e:
                results[t.name] = {"apply": False, "trials": 0, "unsupported": True,
                                   "reason": str(e)}
                bar.update(todo[t.name])
                bar.write(f"  {t.name}: {e}")
                continue
            bar.update(todo[t.name] - measured[t.name])  # a search that ran out early
            rec = best_record(db, t.workload())
            bar.write(f"  {t.name}: {measured[t.name]} new trials, best "
                      f"{_ms(min(float(s) for s in rec.run_secs) if rec else None)} ms "
                      f"(hand {_ms(hand)} ms)")
    except BaseException:  # Ctrl-C may surface from native code as another exception
        bar.close()
        say(f"stopped: the rounds measured so far are in {opts.tuning_dir}; the same command "
            "with --resume continues from them")
        raise
    finally:
        bar.close()
    search_s = time.perf_counter() - t_search
    db = open_database(opts.tuning_dir)  # verify what later runs and compile will read back
    for t in chosen:
        prev = results.get(t.name, {})
        if prev.get("unsupported"):
            continue
        if t.name in measured or t.name in stale:
            say(f"verifying {t.name} ...")
            results[t.name] = verify_task(t, db, spec, seed=opts.seed, prefer=opts.prefer)
            # the search ran dry before --trials: its space holds no more new candidates
            if prev.get("exhausted") or measured.get(t.name, 0) < todo[t.name]:
                results[t.name]["exhausted"] = True
    index["results"] = results
    write_index(opts.tuning_dir, index)
    report = TuneReport(opts.tuning_dir, extract_seconds=t_extract, search_seconds=search_s)
    counts = record_counts(db)
    report.results = [_result(t, results.get(t.name, {}), measured.get(t.name, 0), counts)
                      for t in chosen]
    report.seconds = time.perf_counter() - t_start
    return report


def _settled(verdict: dict) -> bool:
    """No more trials for this task: no design space, or the search ran out of candidates."""
    return bool(verdict.get("unsupported") or verdict.get("exhausted"))


def _best_digest(db, t: Task) -> str | None:
    rec = best_record(db, t.workload())
    return trace_digest(rec.trace) if rec is not None else None


def _quick_hand_time(t: Task, spec, seed: int) -> float | None:
    try:
        rt = build_function(hand_function(t, spec), spec)
        args = device_args(task_inputs(t.family, list(t.workload()["main"].params), seed=seed),
                     device_of(spec))
        return time_function(rt, args, device_of(spec))
    except Exception:  # noqa: BLE001 - only for the progress line
        return None


def _result(t: Task, v: dict, new: int, counts: dict[int, int]) -> TaskResult:
    return TaskResult(name=t.name, label=t.label, entry=t.entry, calls=t.calls,
                      trials=counts.get(workload_hash(t.workload()), 0), new_trials=new,
                      best_s=v.get("best_s"),
                      hand_s=v.get("hand_s"), tuned_s=v.get("tuned_s"), exact=v.get("exact"),
                      apply=bool(v.get("apply")), reason=v.get("reason", "not verified")
                      + ("; the search found no more candidates" if v.get("exhausted") else ""))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.4f}" if s < 1e-3 else f"{s * 1e3:.3f}"


def format_results(report: TuneReport) -> str:
    """One row per task: trials, best measured, hand vs tuned (symbolic, as compiled), speedup,
    applied, why; then the per-entry estimate over call sites."""
    head = ("task", "calls", "trials", "best ms", "hand ms", "tuned ms", "speedup", "used",
            "note")
    rows = []
    for r in report.results:
        sp = r.speedup
        note = r.reason if len(r.reason) <= 72 else r.reason[:69] + "..."
        rows.append((r.label, str(r.calls), str(r.trials), _ms(r.best_s), _ms(r.hand_s),
                     _ms(r.tuned_s), f"{sp:.2f}x" if sp else "-", "yes" if r.apply else "no",
                     note))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head) - 1)]

    def line(cells):
        return "  ".join([cells[0].ljust(widths[0]),
                          *(c.rjust(w) for c, w in zip(cells[1:-1], widths[1:], strict=True)),
                          cells[-1]]).rstrip()

    out = [line(head), "-" * (sum(widths) + 2 * len(widths)), *(line(r) for r in rows)]
    hand = sum(r.hand_s * r.calls for r in report.results if r.hand_s)
    used = sum((r.tuned_s if r.apply else r.hand_s) * r.calls for r in report.results
               if r.hand_s and r.tuned_s)
    if hand and used:
        out.append(f"these tasks per entry call (time x call sites): hand {hand * 1e3:.3f} ms, "
                   f"as compiled {used * 1e3:.3f} ms ({hand / used:.2f}x)")
    return "\n".join(out)


# ---- compile's hook ------------------------------------------------------------------------------


# ---- the decode step, compiled with and without the database -------------------------------------


def _step_args(opts: TuneOptions, artifact_dir: Path, entry: str, dev):
    """Inputs at the tuning shape (the cache full up to `context`, the new token at its end) and
    the weights: a seeded checkpoint of the preset when one exists, else format-valid random
    values (FP8/FP4 codes without NaN codes, E8M0 scales near 1)."""

    shapes = CaptureShapes(batch=opts.shape.batch, tokens=opts.shape.tokens,
                           context=opts.shape.context)
    inputs, _ = example_inputs(Model.placeholder(opts.args), entry, shapes)
    flat = [t for x in inputs for t in (x if isinstance(x, tuple) else (x,))]
    spec = read_manifest(artifact_dir).entries[entry]
    at = spec.input_index("start")  # the flat inputs are the entry's declared inputs, in order
    flat[at] = torch.full_like(flat[at], opts.shape.context - 1)  # start: the cache is full
    args = [to_tvm(t) for t in flat]
    params = spec.params

    ckpt = DEFAULT_CHECKPOINTS / f"{opts.model_name}-seed0"  # where `ensure_checkpoint` writes
    if (ckpt / "config.json").is_file():
        model = Model.from_checkpoint(ckpt)
        return args + [to_tvm(weight_for(model, p.param, p)) for p in params], str(ckpt)

    rng = np.random.default_rng(0)
    for p in params:
        shape = p.dims
        last = p.param.rsplit("__", 1)[-1]
        if p.dtype == "uint8" and last in ("scale", "s1", "s2", "s3"):
            a = rng.integers(120, 128, size=shape, dtype=np.uint8)
        elif p.dtype == "uint8":
            a = rng.integers(0, 0x7F, size=shape, dtype=np.uint8) | (
                rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
        else:
            a = (rng.standard_normal(shape, dtype=np.float32) * 0.05)
            a = a.astype(ml_dtypes.bfloat16 if p.dtype == "bfloat16" else p.dtype)
        args.append(tvm.runtime.tensor(a, dev))
    return args, "random format-valid weights (no seeded checkpoint)"


def compare_step(opts: TuneOptions, rounds: int = 7) -> str:
    """Compile the decode entry twice, into the artifact (its tuning database applied) and into a
    temporary artifact without one (hand schedules); then time the two steps on the same inputs
    and weights, alternating, and report the fastest call of each."""

    if "decode" not in opts.entries:
        raise ValueError("--compare-step times the decode entry; tune --entries decode.")
    if get_target(opts.target).is_cuda:
        raise ValueError("--compare-step runs the steps on this machine's CPU; it needs a CPU "
                         "target.")
    dev = tvm.cpu()
    with tempfile.TemporaryDirectory(prefix="dsv41-hand-") as tmp:
        built = {}
        for label, out in (("hand", Path(tmp)), ("tuned", opts.out)):
            t0 = time.perf_counter()
            rep = compile_artifact(CompileOptions(args=opts.args, model_name=opts.model_name,
                                                  target=opts.target, out=out,
                                                  entries=("decode",)))
            lib = tvm.runtime.load_module(str(rep.artifact_dir / "decode.so"))
            built[label] = (relax.VirtualMachine(lib, dev), rep, time.perf_counter() - t0)
        args, source = _step_args(opts, built["tuned"][1].artifact_dir, "decode", dev)
        outs = {label: [o.numpy() for o in built[label][0]["main"](*args)]  # also the warm-up
                for label in ("hand", "tuned")}
        same = all(same_outputs(a, b, cuda=False) for a, b in zip(outs["tuned"], outs["hand"],
                                                           strict=True))
        best: dict[str, float] = {}
        for label in ("hand", "tuned") * rounds:
            f = built[label][0].time_evaluator("main", dev, number=1, repeat=1)
            best[label] = min(best.get(label, math.inf), float(f(*args).mean))
    lines = [f"decode step at {opts.shape.describe('decode')}, weights: {source}; fastest call "
             f"of {rounds}, hand and tuned alternating; outputs (logits, selections, cache) "
             f"{'identical' if same else 'DIFFER'}:"]
    for label in ("hand", "tuned"):
        _, rep, secs = built[label]
        where = "a temporary artifact" if label == "hand" else rep.artifact_dir
        n = len(rep.tuned.get("decode", []))
        lines.append(f"  {label:5s} {best[label] * 1e3:9.2f} ms  ({n} tuned functions; "
                     f"compiled in {secs:.0f} s into {where})")
    lines.append(f"  speedup {best['hand'] / best['tuned']:.3f}x")
    return "\n".join(lines)
