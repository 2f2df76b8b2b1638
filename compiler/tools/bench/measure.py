"""What every `dsv41 bench ...` measures with and reports through: timing (best of, median of,
the budgeted sampler of single kernels), threads, peak memory, this machine's roofline (memory
bandwidth and fp32 GEMM rate), the number formatters and table printer of the text reports,
JSON writing, and `parse_tokens` (the token counts of their options). torch is imported where
it is used: the CLI's parser and the bundle's selftest read this module without it.

Timing follows one rule: a warm-up call first (thread pools, lazy initialisation), then timed
calls; `time_call` loops fast calls so that one sample outlasts the timer (>= `MIN_SAMPLE_S`)
and stops early at its time budget (a call slower than the budget is timed once).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv41.compiler.tools.bench.roof import (
    BANDWIDTH_PASSES,
    best_bandwidth,
    measure_compute,
    stream_passes,
)
from dsv41.runtime.backends.threads import pool_config, size_tvm_pool, tvm_num_threads

MIN_SAMPLE_S = 0.01  # a timed sample repeats the call until it lasts at least this long


# ---- token counts (the options of every benchmark) ---------------------------------------------


def parse_tokens(text: str) -> tuple[int, ...]:
    """'4K,64K,1M' -> (4096, 65536, 1048576): K = 1024, M = 1024^2 (contexts are powers of two)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1].upper(), 1)
        digits = part[:-1] if mult > 1 else part
        try:
            n = int(float(digits) * mult)
        except ValueError as e:
            raise ValueError(f"Cannot read {part!r} as a token count (e.g. 4096, 64K, 1M).") from e
        if n <= 0:
            raise ValueError(f"Token counts must be positive, got {part!r}.")
        out.append(n)
    if not out:
        raise ValueError(f"No token counts in {text!r}.")
    return tuple(out)


# ---- timing -------------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    """Seconds of one call of fn."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_time(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls, after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(reps):
        best = min(best, timed(fn))
    return best


def interleaved_times(calls: dict, rounds: int) -> dict:
    """Each of `calls` (key -> fn) timed once per round, in turn, for `rounds` rounds after one
    untimed round: key -> its `rounds` seconds. A slow phase of a noisy machine then falls on
    every call alike, where timing one call's rounds and then the next would compare phases."""
    times: dict = {key: [] for key in calls}
    for rnd in range(rounds + 1):
        for key, fn in calls.items():
            t = timed(fn)
            if rnd:  # round 0 warms every call up
                times[key].append(t)
    return times


def median_time(fn: Callable[[], object], reps: int) -> float:
    """The median of `reps` timed calls (no warm-up: the caller's first call may be one)."""
    return statistics.median(timed(fn) for _ in range(reps))


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float  # the fastest sample: less disturbed by other processes than the median
    samples: int  # timed samples (each the mean of `number` calls)
    number: int  # calls per sample


def time_call(fn: Callable[[], object], *, repeat: int, budget_s: float,
              warmed: bool = False) -> Timing:
    """Median time of one call of fn. A warm-up call first (the first call of a kernel or op can
    be far slower: thread pools, lazy init), unless the caller has just run fn (warmed=True);
    then one timed call sizes the samples, and a call slower than the budget is the only
    sample (the slow oracles are timed once)."""
    if not warmed:
        fn()
    first_s = timed(fn)
    if first_s >= budget_s or repeat == 1:
        return Timing(first_s, first_s, 1, 1)
    number = max(1, min(10_000, int(MIN_SAMPLE_S / max(first_s, 1e-9))))
    samples: list[float] = []
    spent = 0.0
    while len(samples) < repeat and (not samples or spent < budget_s):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        dt = time.perf_counter() - t0
        samples.append(dt / number)
        spent += dt
    return Timing(statistics.median(samples), min(samples), len(samples), number)


# ---- threads and memory -------------------------------------------------------------------------


def set_threads(n: int) -> dict:
    """The same number of threads for torch and TVM (TVM's pool otherwise takes half the
    hardware threads). Call before TVM starts its pool."""
    import torch  # heavy: torch; dsv41 --help imports this module

    n = n or torch.get_num_threads()
    torch.set_num_threads(n)
    tvm = size_tvm_pool(n)
    return {"torch": torch.get_num_threads(), "tvm": tvm, "requested": n,
            "tvm_pool": pool_config().to_dict()}


def _proc_status_bytes(field_name: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak_rss() -> bool:
    """Reset the process's peak resident set (Linux VmHWM) so the next reading is the peak of
    what follows; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss() -> int | None:
    return _proc_status_bytes("VmHWM")


def current_rss() -> int | None:
    return _proc_status_bytes("VmRSS")


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- the machine and its roofline ---------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What the roofline is drawn from (`roof.py`). bandwidth_gbs = the best of the STREAM-like
    passes (copy or triad; every pass in `bandwidth_passes`); gemm_gflops = the best torch.mm
    fp32 rate; compute_gflops = the best matrix rate of the dtypes this CPU has dot products for
    (each in `compute_by_dtype`); theoretical_gflops = cores x clock x fp32 FLOPs per cycle (None
    without a clock)."""

    cpu: str
    cores: int
    torch_threads: int
    tvm_threads: int  # threads of TVM's pool while timing (`default_tvm_pool`)
    copy_gbs: float
    triad_gbs: float
    bandwidth_gbs: float
    stream_mib: float  # size of one streamed array
    gemm_gflops: float
    gemm_size: int
    clock_ghz: float | None
    clock_source: str
    flops_per_cycle: int | None
    theoretical_gflops: float | None
    load_avg_start: tuple[float, float, float]
    notes: tuple[str, ...] = ()
    bandwidth_passes: tuple[dict, ...] = ()  # each pass: copy_gbs, triad_gbs, at_s (roof.py)
    compute_gflops: float = 0.0  # the best of compute_by_dtype: the roof's compute rate
    compute_dtype: str = "fp32"  # the dtype of compute_gflops
    compute_by_dtype: dict[str, float] | None = None  # fp32 / bf16 / int8 matmul rates
    compute_method: str = ""  # what measured compute_by_dtype
    flags: tuple[str, ...] = ()  # lscpu's flags the roof read (dot products, AVX-512, AMX)


def cpu_flags_and_clock() -> tuple[str, set[str], float | None, str]:
    """(model name, flags, clock GHz, where the clock came from): lscpu's max MHz when given,
    else /proc/cpuinfo's current MHz (a VM often reports only that)."""
    model, flags, ghz, source = platform.processor() or platform.machine(), set(), None, "none"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    for line in lscpu.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "Model name":
            model = val
        elif key == "Flags":
            flags = set(val.split())
        elif key == "CPU max MHz" and val:
            ghz, source = float(val) / 1000, "lscpu CPU max MHz"
    if ghz is None and Path("/proc/cpuinfo").exists():
        m = re.search(r"^cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text(), re.M)
        if m:
            ghz, source = float(m.group(1)) / 1000, "/proc/cpuinfo cpu MHz"
    return model, flags, ghz, source


ROOF_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
              "amx_int8", "amx_tile")


def measure_machine(*, quick: bool = False, passes: int = BANDWIDTH_PASSES) -> Machine:
    """Bandwidth and compute peak of this machine as the kernels see it (all cores): `passes`
    STREAM-like passes (the best is the roof) and the matrix rate of each dtype the CPU has dot
    products for (`roof.py`)."""
    import torch  # heavy: torch; dsv41 --help imports this module

    load = os.getloadavg()
    stream = (32 << 20) if quick else (512 << 20)
    runs = stream_passes(stream, passes=min(passes, 3) if quick else passes)
    copy = max(p.copy_gbs for p in runs)
    triad = max(p.triad_gbs for p in runs)
    size = 512 if quick else 2048
    model, flags, ghz, source = cpu_flags_and_clock()
    compute = measure_compute(flags, size, reps=3 if quick else 5)
    gflops = compute.gflops["fp32"]
    cores = os.cpu_count() or 1
    # two FMA ports x 16 (AVX-512) or 8 (AVX2) fp32 lanes x 2 FLOPs; an assumption about the
    # core (true for Xeon Gold/Platinum since Skylake-SP), stated in the notes
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else None
    theo = cores * ghz * per_cycle if ghz and per_cycle else None
    notes = []
    if per_cycle:
        notes.append(f"theoretical peak assumes 2 FMA ports x {per_cycle // 4} fp32 lanes")
    if quick:
        notes.append("quick: 32 MiB streams may sit in cache; bandwidth is not DRAM's")
    if tvm_num_threads() != torch.get_num_threads():
        notes.append(f"TVM's pool has {tvm_num_threads()} threads, torch {torch.get_num_threads()}:"
                     " the kernels and the roofline do not use the same cores")
    return Machine(cpu=model, cores=cores, torch_threads=torch.get_num_threads(),
                   tvm_threads=tvm_num_threads(), copy_gbs=copy,
                   triad_gbs=triad, bandwidth_gbs=best_bandwidth(runs),
                   stream_mib=stream / 2**20, gemm_gflops=gflops, gemm_size=size,
                   clock_ghz=ghz, clock_source=source, flops_per_cycle=per_cycle,
                   theoretical_gflops=theo, load_avg_start=load, notes=tuple(notes),
                   bandwidth_passes=tuple(asdict(p) for p in runs),
                   compute_gflops=compute.best_gflops, compute_dtype=compute.best_dtype,
                   compute_by_dtype=dict(compute.gflops), compute_method=compute.method,
                   flags=tuple(f for f in ROOF_FLAGS if f in flags))


def merge_machines(first: dict, later: dict) -> dict:
    """One roof from two samples of a machine (`Machine` dicts, e.g. at a bench's start and its
    end): every bandwidth pass of both (the roof the best of them all), each dtype's matrix rate
    the faster of the two, the rest from `first`. A VM's speed wanders over minutes (one
    bench's bf16 matrix rate read 629 GFLOP/s at its start, the same measurement 2,323-2,944 in
    a process of its own minutes later): a sample taken in a slow phase would make every
    fraction of the roof look better than the code is. `roof_samples` keeps what each sample
    read."""
    passes = tuple(first.get("bandwidth_passes") or ()) + tuple(later.get("bandwidth_passes")
                                                                 or ())
    by_dtype = dict(first.get("compute_by_dtype") or {})
    for dtype, rate in (later.get("compute_by_dtype") or {}).items():
        by_dtype[dtype] = max(rate, by_dtype.get(dtype, 0.0))
    merged = dict(first)
    merged.update(
        copy_gbs=max(first["copy_gbs"], later["copy_gbs"]),
        triad_gbs=max(first["triad_gbs"], later["triad_gbs"]),
        bandwidth_gbs=best_bandwidth(passes) if passes else max(first["bandwidth_gbs"],
                                                                later["bandwidth_gbs"]),
        bandwidth_passes=passes,
        gemm_gflops=max(first["gemm_gflops"], later["gemm_gflops"]))
    if by_dtype:
        best = max(by_dtype, key=by_dtype.__getitem__)
        merged.update(compute_by_dtype=by_dtype, compute_dtype=best,
                      compute_gflops=by_dtype[best])
    samples = list(first.get("roof_samples") or [_roof_sample(first)])
    merged["roof_samples"] = [*samples, *(later.get("roof_samples") or [_roof_sample(later)])]
    return merged


def _roof_sample(m: dict) -> dict:
    return {"bandwidth_gbs": m["bandwidth_gbs"], "gemm_gflops": m["gemm_gflops"],
            "compute_by_dtype": dict(m.get("compute_by_dtype") or {}),
            "load_avg_start": list(m.get("load_avg_start") or ())}


def format_machine(m: dict) -> str:
    """A `Machine` (as a dict) in four lines or so."""
    theo = (f", theoretical {m['theoretical_gflops']:.0f} GFLOP/s ({m['cores']} cores x "
            f"{m['clock_ghz']:.2f} GHz [{m['clock_source']}] x {m['flops_per_cycle']} "
            "FLOP/cycle)" if m["theoretical_gflops"] else "")
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, "
             f"TVM threads {m['tvm_threads']}, load avg {m['load_avg_start'][0]:.2f}",
             f"  bandwidth {m['bandwidth_gbs']:.1f} GB/s (copy {m['copy_gbs']:.1f}, triad "
             f"{m['triad_gbs']:.1f}; {m['stream_mib']:.0f} MiB arrays)",
             f"  fp32 GEMM {m['gemm_gflops']:.1f} GFLOP/s (torch.mm {m['gemm_size']}^3){theo}"]
    passes = m.get("bandwidth_passes") or ()
    if passes:
        lines.append("  bandwidth passes (best is the roof): " + ", ".join(
            f"{max(p['copy_gbs'], p['triad_gbs']):.1f}" for p in passes) + " GB/s")
    if m.get("compute_by_dtype"):
        lines.append("  compute roof {:.1f} GFLOP/s ({}); by dtype: {} [{}]".format(
            m["compute_gflops"], m["compute_dtype"], ", ".join(
                f"{k} {v:.1f}" for k, v in m["compute_by_dtype"].items()), m["compute_method"]))
    lines += [f"  note: {n}" for n in m["notes"]]
    return "\n".join(lines)


@dataclass(frozen=True)
class RoofPoint:
    """A measured time of `bytes` moved and `flops` done, on a machine's roofline."""

    bytes_floor_s: float  # bytes / bandwidth: the fastest a memory-bound call can be
    flops_floor_s: float  # flops / fp32 GEMM rate
    achieved_gbs: float | None
    bandwidth_frac: float | None
    achieved_gflops: float | None
    compute_frac: float | None

    @property
    def floor_s(self) -> float:
        return max(self.bytes_floor_s, self.flops_floor_s)

    @property
    def bound(self) -> str:
        return "memory" if self.bytes_floor_s >= self.flops_floor_s else "compute"


def roof_point(nbytes: int, flops: int, seconds: float | None, *, bandwidth_gbs: float,
               gemm_gflops: float) -> RoofPoint:
    """Where `seconds` for nbytes and flops sits against the measured bandwidth and fp32 GEMM
    rate (the rates are None without a time)."""
    gbs = nbytes / seconds / 1e9 if seconds else None
    gfl = flops / seconds / 1e9 if seconds else None
    return RoofPoint(nbytes / (bandwidth_gbs * 1e9), flops / (gemm_gflops * 1e9), gbs,
                     None if gbs is None else gbs / bandwidth_gbs, gfl,
                     None if gfl is None else gfl / gemm_gflops)


# ---- text ---------------------------------------------------------------------------------------


def ms(s: float | None) -> str:
    """'12.3 ms' (or '-')."""
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def ms_cell(s: float | None) -> str:
    """A milliseconds cell without the unit: three decimals below 100 ms, one above (or '-')."""
    if s is None:
        return "-"
    return f"{s * 1e3:.3f}" if s < 0.1 else f"{s * 1e3:.1f}"


def times(v: float | None, *, whole_from: float = math.inf) -> str:
    """'2.50x' (or '-'); at or above `whole_from`, whole numbers ('123x')."""
    if v is None:
        return "-"
    return f"{v:.0f}x" if v >= whole_from else f"{v:.2f}x"


def pct(v: float | None) -> str:
    """A fraction as '12.5%' (or '-')."""
    return "-" if v is None else f"{v * 100:.1f}%"


def gib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**30:.2f} GiB"


def table(header: list[str], rows: list[list[str]], *, free_last: bool = False) -> str:
    """Aligned text: the first column left-aligned, the others right-aligned, a rule under the
    header. free_last: the last column (a note) is neither padded nor counted in the rule, and
    trailing spaces are stripped."""
    cols = len(header) - 1 if free_last else len(header)
    w = [max(len(str(r[i])) for r in [header, *rows]) for i in range(cols)]

    def line(r) -> str:
        cells = [str(c).rjust(w[i]) if i else str(c).ljust(w[i]) for i, c in enumerate(r[:cols])]
        if free_last:
            return "  ".join([*cells, str(r[-1])]).rstrip()
        return "  ".join(cells)

    rule = "-" * (sum(w) + 2 * cols) if free_last else "  ".join("-" * x for x in w)
    return "\n".join([line(header), rule, *map(line, rows)])


def write_json(path: str | Path, doc: object, *, indent: int = 1,
               final_newline: bool = False) -> Path:
    """doc as JSON at path (its folder made when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + ("\n" if final_newline else ""))
    return path
