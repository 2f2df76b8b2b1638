"""`dsv41 bench --profile`: where one compiled decode step (and one prefill) spends its time,
per function, per layer and per layer kind, and what the Relax VM itself costs.

The step runs the way the engine runs it: `CompiledPhases.decode_step` / `ced_prefill` over
`Artifact.call` (host Engram gathers posted and claimed as always), with the VM's instrument set
for each call through `Artifact.instrumented`. The hook sees every call the VM makes:
- kernels (the artifact's own functions, names without a dot),
- the VM's builtins (`vm.builtin.*`: allocation, shapes, reshapes, tuples),
- host functions (any other dotted name, e.g. the Engram rows' gather `dsv41.engram_rows`).

A kernel belongs to the layer whose weights it reads: its arguments are compared with the
buffers the artifact bound (`Artifact.bound_params`); a kernel that reads no layer's weights
(an elementwise fusion, a cache write) belongs to the layer of the last kernel that did, so each
layer is the run of kernels from its first weighted kernel to the next layer's. Kernels before
any layer's weights are `entry` (the embedding, Engram hashing), those reading weights outside
every layer (the final norm, the head) `model`. Layer kinds are the plan's roles (local, full,
reindex, reuse) and `dspark` for the DSpark layers.

The VM's overhead: the time inside its builtins, plus whatever of the step's uninstrumented wall
time (best of a few) the kernels, builtins and host functions measured by the hook leave over
(the interpreter between calls). The hook's own time between calls (Python, a few microseconds
each) lets TVM's idle workers fall asleep, so the hook's kernel times are upper bounds and the
overhead, if anything, under-stated; the counts are exact.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from dsv41.graph.cache import new_cache, restore_local_state, save_local_state
from dsv41.graph.phases_api import PrefillPacing

LAYER_PARAM = re.compile(r"^(layers|mtp|experts)__(\d+)__")
ENTRY, MODEL = "entry", "model"  # the groups outside every layer
DSPARK = "dspark"


class CallKind(StrEnum):
    """What the VM called."""

    KERNEL = "kernel"  # one of the artifact's compiled functions
    BUILTIN = "builtin"  # vm.builtin.*: the VM's own bookkeeping
    HOST = "host"  # another registered function (the Engram rows' gather)


def call_kind(name: str) -> CallKind:
    if name.startswith("vm.builtin."):
        return CallKind.BUILTIN
    return CallKind.HOST if "." in name else CallKind.KERNEL


def param_layer(param: str, n_layers: int) -> int | None:
    """The layer a checkpoint parameter belongs to (DSpark's `mtp__i` is layer n_layers + i),
    None for the weights outside every layer."""
    m = LAYER_PARAM.match(param)
    if m is None:
        return None
    i = int(m.group(2))
    return n_layers + i if m.group(1) == "mtp" else i


def data_address(a) -> int | None:
    """A `tvm.runtime.Tensor` argument's data address (None for shapes and scalars)."""
    data_ptr = getattr(a, "data_ptr", None)
    return None if data_ptr is None else data_ptr()


def layer_kind(plan, layer: int) -> str:
    """local | full | reindex | reuse for a backbone layer, dspark for a DSpark layer."""
    p = plan.layers[layer]
    return DSPARK if p.stage == DSPARK else p.role


@dataclass(frozen=True)
class Call:
    name: str
    kind: CallKind
    group: int | str  # a layer, ENTRY or MODEL
    seconds: float


@dataclass
class CallLog:
    """Every VM call of one entry call, in order."""

    entry: str
    calls: list[Call] = field(default_factory=list)


class Recorder:
    """The hooks of one profiled run: one `CallLog` per entry call (`Artifact.instrumented`)."""

    def __init__(self, artifact, n_layers: int):
        self.logs: list[CallLog] = []
        self.n_layers = n_layers
        self.owner: dict[int, int | str] = {}  # data pointer of a bound weight -> its group
        for entry in artifact.entries:
            for param, t in artifact.bound_params(entry):
                layer = param_layer(param, n_layers)
                self.owner[t.data_ptr()] = MODEL if layer is None else layer

    def group_of(self, args) -> int | str | None:
        """The layer whose weights a call reads (the lowest, should it read several), else
        MODEL when it reads weights outside every layer, else None."""
        found = {g for a in args if (g := self.owner.get(data_address(a))) is not None}
        layers = [g for g in found if isinstance(g, int)]
        return min(layers) if layers else (MODEL if found else None)

    def hook_for_call(self, entry: str) -> Callable:
        log = CallLog(entry)
        self.logs.append(log)
        started: list[float] = []
        group: list[int | str] = [ENTRY]

        def hook(func, name, before_run, ret_value, *args):
            if before_run:
                name = str(name)
                if call_kind(name) == CallKind.KERNEL:
                    g = self.group_of(args)
                    if g is not None and not (g == MODEL and group[0] == ENTRY):
                        group[0] = g  # the embedding's gather stays in the entry's prologue
                started.append(time.perf_counter())
            else:
                dt = time.perf_counter() - started.pop()
                name = str(name)
                log.calls.append(Call(name, call_kind(name), group[0], dt))
            return 0  # VMInstrumentReturnKind.NO_OP

        return hook


def summarize(logs: list[CallLog], plan, wall_s: float, top: int) -> dict:
    """Per layer and per layer kind: kernels and their time; the builtins, host functions and
    the VM's overhead; the top functions by time."""
    calls = [c for log in logs for c in log.calls]
    kernels = [c for c in calls if c.kind == CallKind.KERNEL]
    per_layer: dict[int | str, list[Call]] = {}
    for c in kernels:
        per_layer.setdefault(c.group, []).append(c)
    layers = {
        str(g): {
            "kind": layer_kind(plan, g) if isinstance(g, int) else g,
            "kernels": len(v),
            "ms": sum(c.seconds for c in v) * 1e3,
            "names": [c.name for c in v],  # in call order
        }
        for g, v in sorted(per_layer.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0])))
    }
    by_kind: dict[str, dict] = {}
    for g, row in layers.items():
        k = by_kind.setdefault(row["kind"], {"layers": [], "kernels_per_layer": [], "ms": 0.0})
        k["layers"].append(int(g) if g.isdigit() else g)
        k["kernels_per_layer"].append(row["kernels"])
        k["ms"] += row["ms"]
    for k in by_kind.values():
        k["max_kernels_per_layer"] = max(k["kernels_per_layer"])
        # the kind's layer of the fewest kernels (the first such): the layer as most run it
        k["fewest_layer"] = k["layers"][k["kernels_per_layer"].index(min(k["kernels_per_layer"]))]
    by_name: dict[str, list[Call]] = {}
    for c in calls:
        by_name.setdefault(c.name, []).append(c)
    total = sum(c.seconds for c in calls) or 1.0
    rows = sorted(
        (
            {
                "name": k,
                "calls": len(v),
                "ms": sum(c.seconds for c in v) * 1e3,
                "share": sum(c.seconds for c in v) / total,
            }
            for k, v in by_name.items()
        ),
        key=lambda r: -r["ms"],
    )
    sums = {
        kind: (
            sum(1 for c in calls if c.kind == kind),
            sum(c.seconds for c in calls if c.kind == kind),
        )
        for kind in CallKind
    }
    work_s = sums[CallKind.KERNEL][1] + sums[CallKind.HOST][1]
    return {
        "entry_calls": [log.entry for log in logs],
        "layers": layers,
        "by_kind": by_kind,
        "kernels": sums[CallKind.KERNEL][0],
        "kernel_ms": sums[CallKind.KERNEL][1] * 1e3,
        "builtins": sums[CallKind.BUILTIN][0],
        "builtin_ms": sums[CallKind.BUILTIN][1] * 1e3,
        "host_calls": sums[CallKind.HOST][0],
        "host_ms": sums[CallKind.HOST][1] * 1e3,
        "step_ms": wall_s * 1e3,
        "vm_overhead_ms": max(0.0, wall_s - work_s) * 1e3,
        "top": rows[:top],
    }


def best_wall(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_run(
    phases,
    model,
    run: Callable[[], object],
    *,
    reset: Callable[[], object],
    reps: int = 3,
    top: int = 15,
) -> dict:
    """`run` once warm, `reps` uninstrumented (the wall time), once instrumented; `reset`
    restores the state before each."""
    reset()
    run()  # warm-up
    runs = []
    for _ in range(reps):
        reset()
        runs.append(best_wall(run, 1))
    rec = Recorder(phases.art, model.args.n_layers)
    reset()
    with phases.art.instrumented(rec.hook_for_call):
        run()
    reset()
    return summarize(rec.logs, model.plan, min(runs), top)


def profile_decode(
    phases,
    model,
    cache,
    token: torch.Tensor,
    *,
    restore: Callable[[], object],
    reps: int = 3,
    top: int = 15,
) -> dict:
    """One decode step from `cache` (restored before each run by `restore`)."""
    return profile_run(
        phases,
        model,
        lambda: phases.decode_step(model, cache, token),
        reset=restore,
        reps=reps,
        top=top,
    )


def profile_prefill(
    phases, model, tokens: torch.Tensor, *, chunk_tokens: int, reps: int = 3, top: int = 15
) -> dict:
    """One CED prefill of `tokens` from a fresh cache (one chunk when tokens fit one)."""
    pad = model.engram.pad_id if model.engram is not None else None
    n = tokens.size(1)
    holder: list = [None]

    def reset() -> None:
        holder[0] = new_cache(model.plan, 1, n + 64, engram_pad=pad)

    def run() -> None:
        phases.ced_prefill(
            model, holder[0], tokens, pacing=PrefillPacing(chunk_tokens=chunk_tokens)
        )

    out = profile_run(phases, model, run, reset=reset, reps=reps, top=top)
    out["tokens"], out["chunk_tokens"] = n, chunk_tokens
    return out


ROWS_SUFFIX = re.compile(r"_r\d+(?=_|$)")  # a kernel's verify form: `<decode name>_r<rows>`


def kernel_family(name: str) -> str:
    """A VM function's name with a verify form's `_r<rows>` taken out: the decode kernel it
    stands for (`k_fp8_linear_32768_512_1_r6` -> `k_fp8_linear_32768_512_1`)."""
    return ROWS_SUFFIX.sub("", name, count=1)


def verify_growth(decode: dict, verify: dict, top: int) -> list[dict]:
    """Per function family (`kernel_family`), its milliseconds in one decode step and in one
    verify (`summarize` outputs of each, all rows), the verify's extra first."""
    fams: dict[str, dict] = {}
    for side, prof in (("decode", decode), ("verify", verify)):
        for row in prof["top"]:
            f = fams.setdefault(kernel_family(row["name"]),
                                {"decode_ms": 0.0, "verify_ms": 0.0, "decode_calls": 0,
                                 "verify_calls": 0})
            f[f"{side}_ms"] += row["ms"]
            f[f"{side}_calls"] += row["calls"]
    rows = [{"name": k, **v, "extra_ms": v["verify_ms"] - v["decode_ms"]}
            for k, v in fams.items()]
    return sorted(rows, key=lambda r: -r["extra_ms"])[:top]


def profile_verify(phases, model, cache, *, k: int, reps: int = 3, top: int = 15) -> dict:
    """One decode step and one call of the compiled `verify` entry with 1 + k rows, both
    from `cache` (its local state put back after each run), profiled as `profile_run`;
    `growth`: the functions by what the verify adds to them (`verify_growth`)."""
    state = save_local_state(cache)
    gen = torch.Generator().manual_seed(k)
    toks = torch.randint(3, model.args.vocab_size, (1, 1 + k), generator=gen)

    def reset() -> None:
        restore_local_state(cache, state)

    every = 1 << 30  # summarize's rows: all of them (verify_growth matches them)
    decode = profile_run(phases, model, lambda: phases.decode_step(model, cache, toks[:, :1]),
                         reset=reset, reps=reps, top=every)
    verify = profile_run(phases, model, lambda: phases.verify_step(model, cache, toks),
                         reset=reset, reps=reps, top=every)
    growth = verify_growth(decode, verify, top)
    decode["top"], verify["top"] = decode["top"][:top], verify["top"][:top]
    return {"k": k, "decode": decode, "verify": verify, "growth": growth}


def format_growth(p: dict) -> list[str]:
    """`profile_verify`'s report in a few lines."""
    d, v = p["decode"]["step_ms"], p["verify"]["step_ms"]
    out = [f"  one decode step {d:.1f} ms, one verify of 1 + {p['k']} rows {v:.1f} ms "
           f"({v / d:.2f} decode steps); what the verify adds, by function (instrumented ms):"]
    for r in p["growth"]:
        out.append(f"    {r['extra_ms']:+9.2f} ms  {r['decode_ms']:8.2f} -> {r['verify_ms']:8.2f}"
                   f"  {r['decode_calls']:5d}x / {r['verify_calls']:5d}x  {r['name']}")
    return out


NAMED_LAYER_KERNELS = 20  # a kind's fewest-kernel layer up to this many: its kernels named


def format_layers(name: str, p: dict) -> list[str]:
    """Kernels per layer kind, the VM's share, in a few lines; for each kind whose layer of the
    fewest kernels has at most NAMED_LAYER_KERNELS, that layer's kernels in call order."""
    out = [
        f"  {name}: {p['kernels']} kernels {p['kernel_ms']:.2f} ms, {p['builtins']} VM "
        f"builtins {p['builtin_ms']:.2f} ms, {p['host_calls']} host calls "
        f"{p['host_ms']:.2f} ms; step {p['step_ms']:.2f} ms, VM overhead "
        f"{p['vm_overhead_ms']:.2f} ms ({', '.join(p['entry_calls'])})"
    ]
    for kind, k in p["by_kind"].items():
        out.append(
            f"    {kind:8s} layers {k['layers']}: kernels per layer "
            f"{k['kernels_per_layer']} ({k['ms']:.2f} ms)"
        )
        names = p["layers"][str(k["fewest_layer"])]["names"]
        if len(names) <= NAMED_LAYER_KERNELS:
            out.append(f"      layer {k['fewest_layer']}: {' '.join(names)}")
    return out
