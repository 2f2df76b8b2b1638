"""`dsv41 selftest`: the device check a GPU machine runs, from a full install or from a bundle
(`dsv41 bundle`; there `python gpu_check.py`, no install).

Four checks, each timed, within one budget (default 8 minutes; a check that would start past
it is skipped with the reason), then a one-screen summary and a JSON file:

1. conformance: the `shared-small` case scored on the device with the compiled artifact of its
   config (its `prefill_all` and `decode` entries; weights loaded onto the device, the Engram
   tables in host memory), every metric against the case's bounds (`graph.conformance.evaluate`);
2. engram: the same artifact's prefill and decode steps with the host Engram rows gathered
   ahead (copied to the device on a side stream) and inside the entry, bit for bit, with the
   gathers' time and the part hidden (`check_engram`);
3. kernels: the tests marked `gpu` (`pytest -m gpu`), where the test suite and TVM's compiler
   are installed (they build kernels); a runtime bundle has neither and says so;
4. decode: the compiled `decode` entry of the checkpoint at `--bench-checkpoint` (the `bench`
   preset's seeded checkpoint, written on this host when missing) at each context (default 4K /
   64K / 128K; synthetic caches, `compiler.tools.bench.synthetic`, moved to the device), ms per
   token against the step's bytes (`graph.cost`) over this device's measured copy bandwidth: the
   fraction of HBM bandwidth.

On a host that cannot run the target (no GPU, another arch) it refuses before any work: it
prints why and writes the refusal to the JSON (exit status 2).

torch, TVM and the graph modules that import torch are imported inside the checks: the parser
(`add_arguments`, which `dsv41 --help` reads) and a refusal load without them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import dsv41.runtime
from dsv41.compiler.tools.bench.measure import best_time, parse_tokens, write_json
from dsv41.graph.config import load_config, preset

if TYPE_CHECKING:  # annotations only: the parser (`add_arguments`) loads without torch
    import torch

DEFAULT_CONTEXTS = (4096, 65536, 131072)
REFUSED = 2  # exit status of a refusal (the device cannot run the target)


class Status(Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class Check:
    name: str
    status: Status
    seconds: float
    summary: str  # one line for the screen
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SelftestOptions:
    target: str = "cuda-sm90"
    device: str | None = None  # default: the target's kind (cuda:0)
    artifacts: tuple[Path, ...] = ()  # searched by config for shared-small's and bench's
    case: Path | None = None  # the shared-small conformance case
    bench_checkpoint: Path = Path("artifacts") / "checkpoints" / "bench-seed0"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    reps: int = 5
    budget_s: float = 480.0
    tests: Path | None = None  # the test suite (kernel tests); None: a bundle has none
    json_out: Path = Path("selftest.json")


@dataclass
class SelftestReport:
    target: str
    device: str
    device_name: str
    checks: list[Check] = field(default_factory=list)
    refused: str | None = None
    seconds: float = 0.0
    environment: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.refused is None and all(c.status is not Status.FAIL for c in self.checks)

    def to_json(self) -> dict:
        checks = [{**asdict(c), "status": c.status.value} for c in self.checks]
        return {"selftest": {"target": self.target, "device": self.device,
                             "device_name": self.device_name, "refused": self.refused,
                             "passed": self.passed, "seconds": self.seconds,
                             "environment": self.environment, "checks": checks}}


# ---- helpers -------------------------------------------------------------------------------------


def find_artifact(dirs, config_hash: str, target: str, entries: tuple[str, ...]) -> Path | None:
    """The first artifact under `dirs` (an artifact folder, or a folder of them at any depth)
    built for `target` and this config that has `entries`."""
    # heavy: torch (see the module docstring)
    from dsv41.runtime.backends.artifact import ArtifactError, read_manifest

    for root in dirs:
        for manifest in sorted(Path(root).rglob("manifest.json")):
            try:
                m = read_manifest(manifest.parent)
            except ArtifactError:
                continue
            if (m.config_hash == config_hash and m.target.name == target
                    and set(entries) <= set(m.entries)):
                return manifest.parent
    return None


def move_cache(cache, device: torch.device):
    """The cache's tensors (`graph.entries.cache_names`) moved to `device`, in place."""
    # heavy: torch (see the module docstring)
    from dsv41.graph.entries import cache_names, cache_slot

    for name in cache_names(cache):
        obj, attr = cache_slot(cache, name)
        setattr(obj, attr, getattr(obj, attr).to(device))
    return cache


class PhasesOnDevice:
    """Compiled phases whose caches are moved to the artifact's device before a prefill (the
    scorer, `graph.score.GraphBackend`, allocates its cache on the host); a no-op on the CPU."""

    def __init__(self, phases, device: torch.device):
        self.phases, self.device = phases, device

    def prefill_exact(self, model, cache, tokens, **kw):
        return self.phases.prefill_exact(model, move_cache(cache, self.device), tokens, **kw)

    def ced_prefill(self, model, cache, tokens, **kw):
        return self.phases.ced_prefill(model, move_cache(cache, self.device), tokens, **kw)

    def decode_step(self, model, cache, tokens, **kw):
        return self.phases.decode_step(model, cache, tokens, **kw)


def device_bandwidth_gbs(device: torch.device, n_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Copy bandwidth of the device's memory (read + write counted), best of `reps` after a
    warm-up copy; each copy waits for the device (so the next starts on an idle one)."""
    import torch  # heavy: torch (see the module docstring)

    a = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)

    def copy() -> None:
        b.copy_(a)
        _sync(device)

    return 2 * n_bytes / best_time(copy, reps) / 1e9


def environment() -> dict:
    """Where the code that runs comes from (a bundle runs its own copies) and which TVM."""
    import torch  # heavy: torch (see the module docstring)
    import tvm  # heavy: TVM (see the module docstring)

    # heavy: torch (see the module docstring)
    from dsv41.runtime.backends.device import compiler_available

    return {"python": sys.version.split()[0], "torch": torch.__version__, "tvm": tvm.__file__,
            "dsv41_runtime": dsv41.runtime.__file__, "tvm_compiler_loaded": compiler_available(),
            "cuda_available": torch.cuda.is_available()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        import torch  # heavy: torch (see the module docstring)

        torch.cuda.synchronize(device)


# ---- the checks ----------------------------------------------------------------------------------


def case_artifact(opts: SelftestOptions, check: str):
    """(case, its config, the artifact of its config with prefill_all and decode), or the
    check's SKIP saying which is missing."""
    from dsv41.graph.conformance import load_case  # heavy: torch (see the module docstring)

    if opts.case is None or not (Path(opts.case) / "case.json").is_file():
        return Check(check, Status.SKIP, 0.0, f"no conformance case at {opts.case}")
    case = load_case(opts.case)
    args = load_config(case.checkpoint)
    art_dir = find_artifact(opts.artifacts, args.config_hash(), opts.target,
                            ("prefill_all", "decode"))
    if art_dir is None:
        return Check(check, Status.SKIP, 0.0,
                     f"no {opts.target} artifact of {case.name}'s config with prefill_all and "
                     f"decode under {', '.join(map(str, opts.artifacts)) or '(none given)'}")
    return case, args, art_dir


def check_conformance(opts: SelftestOptions, dev) -> Check:
    # heavy: torch (see the module docstring)
    from dsv41.graph.conformance import evaluate
    from dsv41.graph.model import Model
    from dsv41.graph.score import GraphBackend, score
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    t0 = time.perf_counter()
    found = case_artifact(opts, "conformance")
    if isinstance(found, Check):
        return found
    case, args, art_dir = found
    art = Artifact.load(art_dir, args=args, device=dev)
    model = Model.from_checkpoint(case.checkpoint, args, device=dev.torch)
    phases = PhasesOnDevice(CompiledPhases(art, model), dev.torch)
    res = score(GraphBackend(model, phases=phases), case.tokens, prefill=case.prefill)
    rep = evaluate(case, res)
    status = Status.PASS if rep.conformant else Status.FAIL
    shown = {k: v for k, v in rep.metrics.items() if isinstance(v, int | float)}
    line = (f"{case.name} on {dev}: " + ("within every bound" if rep.conformant else
                                         f"{len(rep.failures)} bound(s) missed: "
                                         + "; ".join(rep.failures[:2])))
    return Check("conformance", status, time.perf_counter() - t0, line,
                 {"case": case.name, "artifact": str(art_dir), "metrics": shown,
                  "failures": rep.failures})


def check_engram(opts: SelftestOptions, dev, prompt: int = 48, steps: int = 3) -> Check:
    """Host-resident Engram on the device: the `shared-small` artifact's prefill of the case's
    first `prompt` tokens and `steps` greedy decode steps, with the rows gathered ahead on the
    host (and copied over on a side stream) and inside the entry: every logit bit-equal, and
    the gathers' time and the part of it the entries did not wait for."""
    import torch  # heavy: torch (see the module docstring)

    # heavy: torch (see the module docstring)
    from dsv41.graph.cache import new_cache
    from dsv41.graph.model import Model
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    t0 = time.perf_counter()
    found = case_artifact(opts, "engram")
    if isinstance(found, Check):
        return found
    case, args, art_dir = found
    if not args.engram_layer_ids:
        return Check("engram", Status.SKIP, 0.0, f"{case.name}'s config has no Engram layers")
    art = Artifact.load(art_dir, args=args, device=dev)
    if not art.hosts_engram:
        return Check("engram", Status.SKIP, 0.0, f"{art_dir} gathers Engram on the device "
                     "(compiled before the tables were host-resident)")
    model = Model.from_checkpoint(case.checkpoint, args, device=dev.torch)
    phases = CompiledPhases(art, model)
    tokens = torch.as_tensor(case.tokens[:prompt], dtype=torch.int64)[None]
    pad = model.engram.pad_id if model.engram is not None else None
    logits, timing = {}, {}
    for prefetch in (True, False):
        art.set_engram_prefetch(prefetch)
        art.engram_timing(reset=True)
        cache = new_cache(model.plan, 1, prompt + steps + 8, engram_pad=pad, device=dev.torch)
        res = phases.prefill_exact(model, cache, tokens)
        got = [res.logits.float().cpu()]
        for _ in range(steps):
            res = phases.decode_step(model, cache, res.logits[:, -1].argmax(-1, keepdim=True))
            got.append(res.logits.float().cpu())
        logits[prefetch], timing[prefetch] = got, art.engram_timing(reset=True).to_dict()
    art.set_engram_prefetch(True)
    same = all(torch.equal(a, b) for a, b in zip(logits[True], logits[False], strict=True))
    on = timing[True]
    line = (f"prefetch on and off {'bit-equal' if same else 'DIFFER'}; gathers "
            f"{on['gather_ms']:.2f} ms over {on['calls']} calls, {on['hidden_ms']:.2f} ms hidden")
    return Check("engram", Status.PASS if same else Status.FAIL, time.perf_counter() - t0,
                 line, {"artifact": str(art_dir), "identical": same, "prefetch_on": on,
                        "prefetch_off": timing[False]})


def check_kernels(opts: SelftestOptions, remaining_s: float) -> Check:
    """`pytest -m gpu` over the suite, where it and TVM's compiler are installed."""
    # heavy: torch (see the module docstring)
    from dsv41.runtime.backends.device import compiler_available

    if opts.tests is None or not Path(opts.tests).is_dir():
        return Check("kernels", Status.SKIP, 0.0, "no test suite here (a bundle carries none): "
                     "run `dsv41 selftest` from a full install for the kernel tests")
    if not compiler_available():
        return Check("kernels", Status.SKIP, 0.0, "TVM's compiler is not loaded (runtime-only): "
                     "the kernel tests build their kernels")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           str(opts.tests)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, remaining_s))
    except subprocess.TimeoutExpired:
        return Check("kernels", Status.FAIL, time.perf_counter() - t0,
                     f"pytest -m gpu ran past the budget ({remaining_s:.0f} s)")
    tail = [ln for ln in res.stdout.strip().splitlines() if ln.strip()]
    last = tail[-1] if tail else "(no output)"
    status = Status.PASS if res.returncode == 0 else Status.FAIL
    if res.returncode == 5:  # nothing collected
        status = Status.SKIP
    return Check("kernels", status, time.perf_counter() - t0, f"pytest -m gpu: {last}",
                 {"returncode": res.returncode, "tail": res.stdout[-2000:]})


def check_decode(opts: SelftestOptions, dev, deadline: float) -> Check:
    import torch  # heavy: torch (see the module docstring)

    # heavy: torch (see the module docstring)
    from dsv41.compiler.tools.bench.synthetic import StepState, synthetic_cache
    from dsv41.graph.checkpoint import checkpoint_config, write_seeded_checkpoint
    from dsv41.graph.cost import decode_step_cost
    from dsv41.graph.model import Model
    from dsv41.runtime.backends.artifact import Artifact
    from dsv41.runtime.backends.compiled import CompiledPhases

    t0 = time.perf_counter()
    ckpt = Path(opts.bench_checkpoint)
    have = (ckpt / "config.json").is_file()
    args = checkpoint_config(ckpt) if have else preset("bench")
    art_dir = find_artifact(opts.artifacts, args.config_hash(), opts.target, ("decode",))
    if art_dir is None:
        return Check("decode", Status.SKIP, 0.0, f"no {opts.target} artifact of "
                     f"{ckpt.name}'s config with decode under "
                     f"{', '.join(map(str, opts.artifacts))}")
    wrote = None
    if not have:  # the seeded bench checkpoint, written once on this host
        w0 = time.perf_counter()
        write_seeded_checkpoint(args, ckpt, seed=0)
        wrote = time.perf_counter() - w0
    art = Artifact.load(art_dir, args=args, device=dev)
    model = Model.from_checkpoint(ckpt, args, device=dev.torch)
    phases = CompiledPhases(art, model)
    bw = device_bandwidth_gbs(dev.torch) if dev.is_cuda else None
    rows, skipped = [], []
    for n in opts.contexts:
        if time.perf_counter() > deadline:
            skipped.append(n)
            continue
        cache = move_cache(synthetic_cache(model, n), dev.torch)
        state = StepState.of(cache)
        tok = torch.tensor([[5]])
        times = []
        for i in range(opts.reps + 1):  # the first step warms up
            state.restore(cache)
            _sync(dev.torch)
            s0 = time.perf_counter()
            phases.decode_step(model, cache, tok)  # logits come to the host: a sync
            if i:
                times.append(time.perf_counter() - s0)
        cost = decode_step_cost(args, n)
        step = statistics.median(times)
        frac = cost.bytes / step / (bw * 1e9) if bw else None
        rows.append({"context": n, "ms_per_token": step * 1e3, "bytes": cost.bytes,
                     "hbm_fraction": frac})
        del cache
    parts = [f"{r['context'] // 1024}K {r['ms_per_token']:.2f} ms"
             + (f" ({r['hbm_fraction']:.0%} of HBM)" if r["hbm_fraction"] is not None else "")
             for r in rows]
    if skipped:
        parts.append(f"skipped {', '.join(str(n) for n in skipped)} (budget)")
    status = Status.PASS if rows and not skipped else Status.SKIP if not rows else Status.FAIL
    return Check("decode", status, time.perf_counter() - t0, "; ".join(parts),
                 {"artifact": str(art_dir), "rows": rows, "skipped": skipped,
                  "bandwidth_gbs": bw, "checkpoint_written_s": wrote})


# ---- the command ---------------------------------------------------------------------------------


def run_selftest(opts: SelftestOptions, say=print) -> SelftestReport:
    import torch  # heavy: torch (see the module docstring)

    # heavy: torch (see the module docstring)
    from dsv41.runtime.backends.device import DeviceError, device_for_target

    start = time.perf_counter()
    try:
        dev = device_for_target(opts.target, opts.device)
    except DeviceError as e:
        kind = "no GPU" if not torch.cuda.is_available() else "wrong device"
        return SelftestReport(opts.target, str(opts.device or "cuda:0"), "", refused=f"{kind}: "
                              f"{e}", seconds=time.perf_counter() - start,
                              environment=environment())
    name = torch.cuda.get_device_name(dev.index) if dev.is_cuda else "cpu"
    report = SelftestReport(opts.target, str(dev), name, environment=environment())
    deadline = start + opts.budget_s
    steps = (("conformance", lambda: check_conformance(opts, dev)),
             ("engram", lambda: check_engram(opts, dev)),
             ("kernels", lambda: check_kernels(opts, deadline - time.perf_counter())),
             ("decode", lambda: check_decode(opts, dev, deadline)))
    for name, run in steps:
        if time.perf_counter() > deadline:
            report.checks.append(Check(name, Status.SKIP, 0.0, "past the budget"))
            continue
        t0 = time.perf_counter()
        try:
            check = run()
        except Exception as e:  # noqa: BLE001 -- a check that crashes is a failed check
            check = Check(name, Status.FAIL, time.perf_counter() - t0,
                          f"{type(e).__name__}: {str(e)[:300]}")
        report.checks.append(check)
        say(f"  {check.name}: {check.status.value} ({check.seconds:.1f} s) {check.summary}")
    report.seconds = time.perf_counter() - start
    return report


def summary(report: SelftestReport) -> str:
    if report.refused:
        return f"selftest {report.target}: REFUSED ({report.refused})"
    lines = [f"selftest {report.target} on {report.device} ({report.device_name}), "
             f"{report.seconds:.0f} s:"]
    lines += [f"  {c.name:<12} {c.status.value:<5} {c.seconds:7.1f} s  {c.summary}"
              for c in report.checks]
    lines.append(f"  -> {'PASSED' if report.passed else 'FAILED'}")
    return "\n".join(lines)


DESCRIPTION = "the device check (see compiler/selftest.py)"


def add_arguments(p: argparse.ArgumentParser, *, count=int, seconds=float) -> None:
    """The options of `dsv41 selftest` (and of a bundle's gpu_check.py); `count`, `seconds`:
    the argparse types of --reps and --budget-s (`dsv41 selftest` passes the CLI's checked ones,
    `cli.common`; a bundle has no CLI)."""
    p.add_argument("--target", default="cuda-sm90")
    p.add_argument("--device", default=None, help="cpu | cuda:N (default: the target's kind)")
    p.add_argument("--artifacts", default="artifacts", help="comma-separated folders searched "
                   "for the artifacts of shared-small's and bench's configs")
    p.add_argument("--case", default=None, help="the shared-small conformance case")
    p.add_argument("--bench-checkpoint", default=str(SelftestOptions.bench_checkpoint))
    p.add_argument("--contexts", default="4K,64K,128K")
    p.add_argument("--reps", type=count, default=5)
    p.add_argument("--budget-s", type=seconds, default=480.0)
    p.add_argument("--tests", default=None, help="the test suite folder (kernel tests)")
    p.add_argument("--json", default="selftest.json")


def options_from(ns) -> SelftestOptions:
    return SelftestOptions(
        target=ns.target, device=ns.device,
        artifacts=tuple(Path(x) for x in ns.artifacts.split(",") if x),
        case=None if ns.case is None else Path(ns.case),
        bench_checkpoint=Path(ns.bench_checkpoint),
        contexts=parse_tokens(ns.contexts), reps=ns.reps,
        budget_s=ns.budget_s, tests=None if ns.tests is None else Path(ns.tests),
        json_out=Path(ns.json))


def main(argv: list[str], *, defaults: dict | None = None, prog: str = "dsv41 selftest") -> int:
    """A bundle's gpu_check.py: `dsv41 selftest`'s options under another program name and
    defaults (the bundle's own folders)."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(p)
    if defaults:
        p.set_defaults(**defaults)
    return run_command(options_from(p.parse_args(argv)))


def run_command(opts: SelftestOptions) -> int:
    """The checks in turn, the summary, the JSON; REFUSED, 1 on a failure, else 0."""
    print(f"selftest: target {opts.target}, budget {opts.budget_s:.0f} s, TVM "
          f"{'runtime-only' if os.environ.get('TVM_USE_RUNTIME_LIB') == '1' else 'full'}")
    report = run_selftest(opts)
    print(summary(report))
    write_json(opts.json_out, report.to_json(), indent=2, final_newline=True)
    print(f"json: {opts.json_out}")
    if report.refused:
        return REFUSED
    return 0 if report.passed else 1
