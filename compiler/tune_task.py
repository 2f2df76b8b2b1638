"""`dsv41 tune`'s work on one task, in this process: build a candidate or the hand schedule,
time it with the module's time evaluator, tune the task with MetaSchedule (`tune_task`) and verify
the best trace against the hand schedule (`verify_task`). `compiler/tune.py` runs the command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from collections.abc import Callable

import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms

from dsv41.compiler.build import schedule
from dsv41.compiler.tuning_db import (
    FAILED_S,
    best_record,
    record_counts,
    replay,
    trace_digest,
    workload_hash,
)
from dsv41.schedules.tuning_space import SPACE_FALLBACKS, Task, search_space, task_inputs

APPLY_MARGIN = 0.02  # a tuned function replaces the hand schedule only when this much faster
VERIFY_ROUNDS = 5  # alternating timings of hand and tuned function in a verification


def device_of(spec):
    """The TVM device a target's functions run on here."""

    return tvm.cuda() if spec.is_cuda else tvm.cpu()


# ---- building and measuring in this process ------------------------------------------------------


def build_function(func, spec):
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with spec.tvm_target():
        return tvm.tirx.build(mod, target=spec.tvm_target())


def hand_function(task: Task, spec):
    """What compile builds for the task's function without tuning (build.schedule on it)."""

    return schedule(tvm.IRModule({"main": task.hand}), spec.name)["main"]


def device_args(arrays, dev):
    return [tvm.runtime.tensor(a, dev) for a in arrays]


def time_function(rt_mod, args, dev, budget_s: float = 0.05) -> float:
    """Seconds per call: the fastest of 3 samples of >= budget_s/3 each (one call if slow)."""
    f = rt_mod.time_evaluator("main", dev, number=1, repeat=1)
    first = float(f(*args).mean)
    if first > budget_s:
        return first
    number = max(1, int(budget_s / 3 / max(first, 1e-7)))
    f = rt_mod.time_evaluator("main", dev, number=number, repeat=3)
    return min(float(x) for x in f(*args).results)


def _measure(cands, args, dev, target) -> list:
    """Build and time each candidate; failures become error results (FAILED_S in the DB)."""

    results = []
    for c in cands:
        try:
            with target:  # CUDA: nvcc reads the arch from the current target
                rt = tvm.tirx.build(c.sch.mod, target=target)
            results.append(ms.runner.RunnerResult([time_function(rt, args, dev)], None))
        except Exception as e:  # noqa: BLE001 - a candidate that fails is a recorded trial
            results.append(ms.runner.RunnerResult(None, f"{type(e).__name__}: {e}"[:1000]))
    return results


@contextlib.contextmanager
def _without_tensor_intrinsics():
    """TuneContext imports tvm.s_tir.tensor_intrin (~24 s: it registers every tensor-core and
    dot-product intrinsic) although our explicit rules use none. While a context is created, a
    placeholder stands in for that module, unless the real one is already loaded."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        sys.modules.pop(name, None)


def _quiet_logger():
    log = logging.getLogger("dsv41.tune.metaschedule")
    log.setLevel(logging.WARNING)
    return log


class Unsupported(Exception):
    """MetaSchedule cannot generate a design space for a task (recorded, not retried)."""


def _context(task: Task, wl, spec, per_round: int, rand_state: int, cores: int):
    """A tune context and its design spaces, trying the rule sets of SPACE_FALLBACKS in turn."""

    errors = []
    for drop in SPACE_FALLBACKS:
        with _without_tensor_intrinsics():
            ctx = ms.TuneContext(
                wl, target=spec.tvm_target(), space_generator=search_space(spec, drop),
                search_strategy=ms.search_strategy.EvolutionarySearch(
                    population_size=max(16, 8 * per_round), init_min_unmeasured=2 * per_round,
                    genetic_num_iters=2, max_fail_count=3),
                task_name=task.name, rand_state=rand_state, num_threads=max(1, cores),
                logger=_quiet_logger())
        try:
            spaces = ctx.generate_design_space()
        except Exception as e:  # noqa: BLE001 - TVM internal errors of many kinds
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[-1][:120]}")
            continue
        if spaces:
            return ctx, spaces
        errors.append("empty design space")
    raise Unsupported(f"MetaSchedule generates no design space ({'; '.join(errors)})")


def tune_task(task: Task, db, spec, *, trials: int, per_round: int, seed: int,
              on_round: Callable[[int, float | None], None] = lambda n, best: None) -> int:
    """Search one task until its workload has `trials` records; returns the number measured.
    on_round(candidates measured, best seconds so far) after every committed round."""

    wl = task.workload()
    workload = db.commit_workload(wl)
    h = workload_hash(wl)
    done = record_counts(db).get(h, 0)
    todo = trials - done
    if todo <= 0:
        return 0
    target, dev = spec.tvm_target(), device_of(spec)
    cores = int(spec.target.get("num-cores", os.cpu_count() or 1))
    ctx, spaces = _context(task, wl, spec, per_round, (seed * 1_000_003 + done) % (1 << 30) + 1,
                           cores)
    model = ms.cost_model.XGBModel(num_tuning_cores=max(1, cores))
    old = db.get_top_k(workload, done) if done else []
    if old:  # a resumed task starts from what the database already knows
        model.update(ctx, [r.as_measure_candidate() for r in old],
                     [ms.runner.RunnerResult(list(r.run_secs), None) for r in old])
    args = device_args(task_inputs(task.family, list(wl["main"].params), seed=seed), dev)
    ctx.pre_tuning(max_trials=todo, num_trials_per_iter=per_round, design_spaces=spaces,
                   database=db, cost_model=model)
    measured = 0
    best = best_record(db, wl)
    best_s = min(float(s) for s in best.run_secs) if best is not None else None
    while measured < todo:
        cands = ctx.generate_measure_candidates()
        if not cands:
            break
        cands = list(cands)[: todo - measured]
        results = _measure(cands, args, dev, target)
        ctx.notify_runner_results(cands, results)
        model.update(ctx, cands, results)
        for c, r in zip(cands, results, strict=True):
            secs = list(r.run_secs) if r.run_secs is not None else [FAILED_S]
            db.commit_tuning_record(ms.database.TuningRecord(c.sch.trace, workload, secs,
                                                             target, c.args_info))
            if r.run_secs is not None:
                s = float(secs[0])
                best_s = s if best_s is None else min(best_s, s)
        measured += len(cands)
        on_round(len(cands), best_s)
    ctx.post_tuning()
    return measured


# ---- verification: the tuned function against the hand schedule ----------------------------------


def same_outputs(a, b, cuda: bool) -> bool:
    if a.dtype.kind in "iub":
        return bool(np.array_equal(a, b))
    a, b = a.astype(np.float32), b.astype(np.float32)
    if not cuda:
        return bool(np.array_equal(a, b, equal_nan=True))
    scale = float(np.nanmax(np.abs(b))) if b.size else 0.0
    return bool(np.allclose(a, b, rtol=2e-2, atol=1e-3 * scale + 1e-6, equal_nan=True))


def verify_task(task: Task, db, spec, seed: int = 0, prefer: str = "faster") -> dict:
    """Replay the best record onto the symbolic function, build it, compare it with the hand
    schedule on the same inputs and time both. Returns the verdict stored in tasks.json."""

    wl = task.workload()
    verdict: dict = {"trials": record_counts(db).get(workload_hash(wl), 0), "apply": False,
                     "prefer": prefer}
    rec = best_record(db, wl)
    if rec is None:
        return {**verdict, "reason": "no candidate built and ran"}
    verdict["best_s"] = min(float(s) for s in rec.run_secs)
    verdict["trace"] = trace_digest(rec.trace)
    dev = device_of(spec)
    try:
        tuned = replay(task.func, rec.trace, task.name)
    except Exception as e:  # noqa: BLE001
        return {**verdict, "reason": f"trace does not replay on the symbolic function: "
                                     f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        built = {"hand": build_function(hand_function(task, spec), spec),
                 "tuned": build_function(tuned, spec)}
    except Exception as e:  # noqa: BLE001
        return {**verdict, "reason": f"replayed function does not build: {type(e).__name__}: "
                                     f"{str(e)[:200]}"}
    params = list(wl["main"].params)
    outs, args = {}, {}
    for which, rt in built.items():
        args[which] = device_args(task_inputs(task.family, params, seed=seed), dev)
        rt["main"](*args[which])
        outs[which] = [a.numpy() for a in args[which]]
    # alternate the two, several times: other processes' load comes and goes
    for which in ("hand", "tuned") * VERIFY_ROUNDS:
        s = time_function(built[which], args[which], dev)
        verdict[f"{which}_s"] = min(verdict.get(f"{which}_s", s), s)
    exact = all(same_outputs(a, b, spec.is_cuda) for a, b in zip(outs["tuned"], outs["hand"],
                                                            strict=True))
    verdict["exact"] = exact
    if not exact:
        return {**verdict, "reason": "outputs differ from the hand schedule"}
    if verdict["tuned_s"] <= verdict["hand_s"] * (1 - APPLY_MARGIN):
        return {**verdict, "apply": True, "reason": "faster"}
    if prefer == "tuned":
        return {**verdict, "apply": True, "reason": "not faster, used (--prefer tuned)"}
    return {**verdict, "reason": "not faster than the hand schedule"}

