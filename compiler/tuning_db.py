"""The tuning database kept with an artifact, `<artifact>/<target>/tuning/`: MetaSchedule's JSON
database (`database_workload.json`, `database_tuning_record.json`) and our task index
(`tasks.json`: each task's symbolic function, its key, shapes and the verdict of its last
verification). `dsv41 tune` writes it (compiler/tune.py); `dsv41 compile` reads it here
(`apply_tuning`: a verified task's best trace, replayed onto the symbolic function, replaces the
hand-scheduled function with the recorded structural hash), so build and tune share this module
and import nothing of each other's.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Instruction, Trace

from dsv41.schedules.tuning_space import Task

INDEX = "tasks.json"
INDEX_FORMAT = 1
DB_FILES = ("database_workload.json", "database_tuning_record.json")
FAILED_S = 1e10  # run time recorded for a candidate that did not build or run (MetaSchedule's)
TUNED_ATTR = "dsv41.tuned"  # set on a function compile replaced with a tuned one (task name)


def task_json(t: Task) -> dict:
    return {"name": t.name, "entry": t.entry, "kind": t.kind, "family": t.family,
            "function": t.function, "key": t.key, "label": t.label, "values": t.values,
            "calls": t.calls, "flops": t.flops if t.flops == t.flops else None,
            "func": tvm.ir.save_json(t.func),
            "hand": tvm.ir.save_json(t.hand)}


def task_from_json(d: dict) -> Task:
    return Task(name=d["name"], entry=d["entry"], kind=d["kind"], family=d["family"],
                function=d["function"], key=d["key"], func=tvm.ir.load_json(d["func"]),
                hand=tvm.ir.load_json(d["hand"]), values=d["values"], calls=d["calls"],
                flops=d["flops"] if d["flops"] is not None else float("nan"), label=d["label"])


def read_index(tuning_dir: Path) -> dict | None:
    path = Path(tuning_dir) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except ValueError:
        return None
    return index if index.get("format") == INDEX_FORMAT else None


def write_index(tuning_dir: Path, index: dict) -> None:
    tmp = Path(tuning_dir) / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp, Path(tuning_dir) / INDEX)


def open_database(tuning_dir: Path):
    tuning_dir.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=str(tuning_dir))


def workload_hash(mod) -> int:
    return tvm_ffi.structural_hash(mod)


def record_counts(db) -> dict[int, int]:
    """Records per workload (by the workload's structural hash)."""
    counts: dict[int, int] = {}
    for r in db.get_all_tuning_records():
        h = workload_hash(r.workload.mod)
        counts[h] = counts.get(h, 0) + 1
    return counts


def best_record(db, workload_mod):
    """The fastest successfully measured record of a workload, or None."""
    if not db.has_workload(workload_mod):
        return None
    top = db.get_top_k(db.commit_workload(workload_mod), 1)
    if not top or min(float(s) for s in top[0].run_secs) >= FAILED_S:
        return None
    return top[0]


def trace_digest(trace) -> str:
    return hashlib.sha256(json.dumps(trace.as_json(), sort_keys=True, default=str)
                          .encode()).hexdigest()[:16]


def generalise(trace):
    """The trace with every sampled tile size written in, its outermost factor left to infer.

    On the static workload that replays the same schedule (the inferred factor is the sampled
    one); on the symbolic function it tiles a symbolic loop the same way with the outer loop
    covering the rest (MetaSchedule's own replay cannot: it samples `None` for a symbolic
    extent and rejects it)."""

    subst: dict = {}
    insts, decisions = [], {}
    for inst in trace.insts:
        if inst.kind.name == "SamplePerfectTile":
            factors = [int(x) for x in trace.get_decision(inst)]
            vals = [None] + [tirx.IntImm("int64", f) for f in factors[1:]]
            for out, val in zip(inst.outputs, vals, strict=True):
                subst[out] = val
            continue
        inputs = [substitute(x, subst) for x in inst.inputs]
        new = inst
        if any(a is not b for a, b in zip(inputs, inst.inputs, strict=True)):
            new = Instruction(inst.kind, inputs, inst.attrs, inst.outputs)
        insts.append(new)
        decision = trace.get_decision(inst)
        if decision is not None:
            decisions[new] = decision
    return Trace(insts, decisions)


def substitute(x, subst: dict):
    if x is None or not hasattr(x, "same_as"):
        return x
    for old, new in subst.items():
        if old.same_as(x):
            return new
    return x


def replay(func, trace, task_name: str):
    """The symbolic function scheduled by a tuned trace (marked scheduled and tuned)."""

    sch = s_tir.Schedule(func)
    generalise(trace).apply_to_schedule(sch, remove_postproc=False)
    out = sch.mod["main"]
    return out.with_attr("tirx.is_scheduled", True).with_attr(TUNED_ATTR, task_name)


def database_hash(tuning_dir: Path) -> str | None:
    """sha256 over tuning/*.json in name order (what the artifact manifest records)."""
    files = sorted(Path(tuning_dir).glob("*.json"))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()


def has_records(tuning_dir: Path) -> bool:
    p = tuning_dir / DB_FILES[1]
    return p.is_file() and p.stat().st_size > 0


def apply_tuning(mod, target_name: str, tuning_dir: str | Path, entry: str):
    """build.schedule's hook: replace every function of `mod` that a verified task of `entry`
    recorded (by structural hash) with the task's best trace replayed onto its symbolic
    function. Returns the module (unchanged without a database or applicable tasks)."""

    tuning_dir = Path(tuning_dir)
    index = read_index(tuning_dir)
    if index is None or index.get("target") != target_name or not has_records(tuning_dir):
        return mod
    results = index.get("results", {})
    wanted = {d["key"]: d for d in index["tasks"]
              if d["entry"] == entry and results.get(d["name"], {}).get("apply")}
    if not wanted:
        return mod
    db = None
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        d = wanted.get(str(tvm_ffi.structural_hash(func)))
        if d is None:
            continue
        try:  # the hand schedule stays whenever the database cannot provide the function
            db = db or open_database(tuning_dir)
            task = task_from_json(d)
            rec = best_record(db, task.workload())
            if rec is None or trace_digest(rec.trace) != results[d["name"]].get("trace"):
                raise ValueError("its best record is not the verified one (run dsv41 tune)")
            updates[gv] = replay(task.func, rec.trace, task.name)
        except Exception as e:  # noqa: BLE001 - a damaged database must not stop a compile
            warnings.warn(f"{tuning_dir}: {d['name']} keeps its hand schedule: {e}",
                          stacklevel=2)
    if not updates:
        return mod
    mod = tvm.IRModule(mod.functions, mod.attrs)
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def tuned_functions(mod) -> list[str]:
    """Names of the module's functions that came from the tuning database."""

    return sorted(gv.name_hint for gv, f in mod.functions.items()
                  if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
                  and TUNED_ATTR in f.attrs)
