"""`dsv41 bench load`: peak resident memory while a checkpoint loads, against the bytes the model
keeps resident.

A fresh child process (so the peak is this load's alone) imports everything first, reads its
resident set (Linux VmRSS) and resets its peak (VmHWM), then loads the checkpoint the way
`Engine.load` does (`Model.from_checkpoint` on the device) and makes the TVM view of every weight
an artifact binds (`runtime.artifact.to_tvm`, what `Artifact.bind` does for each parameter). The
peak over that is `load_peak_bytes`; then every weight byte is read once (what serving does over
time: memory-mapped weights become resident when first read) and the peak is read again
(`touched_peak_bytes`). Both are above the RSS before loading, and are compared with
`resident_bytes`, the bytes of the tensors the model holds (`ratio`: touched peak over it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsv41.compiler.tools.assets import ensure_checkpoint
from dsv41.compiler.tools.bench.measure import current_rss, peak_rss, reset_peak_rss, write_json
from dsv41.graph.checkpoint import checkpoint_config, checkpoint_nbytes
from dsv41.graph.model import Model
from dsv41.runtime.backends.tensors import to_tvm

MiB = 1 << 20
TARGET_RATIO = 1.1  # the bound: peak RSS within 1.1x of the resident bytes


@dataclass(frozen=True)
class LoadMemory:
    checkpoint: str
    device: str
    checkpoint_bytes: int  # tensor data in the files
    resident_bytes: int  # bytes of the tensors the loaded model holds
    rss_before_bytes: int  # resident set after the imports, before loading
    load_peak_bytes: int  # peak resident set above rss_before while loading and binding
    touched_peak_bytes: int  # the same after every weight byte has been read once
    ratio: float  # touched_peak_bytes / resident_bytes
    load_seconds: float

    @property
    def within_target(self) -> bool:
        return self.ratio <= TARGET_RATIO


def model_tensors(model) -> list:
    """Every tensor the model holds: the named weights and the expert stacks."""
    out = list(model.w.values())
    for ex in model.experts.values():
        out += [ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2]
    return out


def _tensor_bytes(tensors) -> int:
    """Bytes of the tensors' data, a range shared by two tensors counted once."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.device.type, t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def _touch(tensors) -> None:
    """Read every byte of every tensor (`max` over 16 MiB pieces of its bytes: no temporary
    beyond the piece, unlike `sum`, which widens to int64)."""
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous()
        for i in range(0, flat.numel(), 16 * MiB):
            int(flat[i:i + 16 * MiB].max())


def measure_in_this_process(checkpoint: Path, device: str) -> LoadMemory:
    """The measurement itself; run it in a fresh process (`measure_load`)."""
    args = checkpoint_config(checkpoint)
    if not reset_peak_rss():
        raise ValueError("Measuring the peak resident set needs Linux's /proc/self/clear_refs.")
    before = current_rss() or 0
    t0 = time.perf_counter()
    model = Model.from_checkpoint(checkpoint, args, device=device)
    tensors = model_tensors(model)
    bound = [to_tvm(t) for t in tensors]
    seconds = time.perf_counter() - t0
    load_peak = (peak_rss() or 0) - before
    _touch(tensors)
    touched = (peak_rss() or 0) - before
    del bound
    resident = _tensor_bytes(tensors) if device == "cpu" else 0
    return LoadMemory(str(checkpoint), device, checkpoint_nbytes(args), resident, before,
                      load_peak, touched, touched / resident if resident else 0.0, seconds)


def measure_load(checkpoint: Path, device: str = "cpu") -> LoadMemory:
    """`measure_in_this_process` in a fresh Python process."""
    res = subprocess.run([sys.executable, "-m", "dsv41.compiler.tools.bench.load", str(checkpoint),
                          device],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"The load measurement failed:\n{res.stderr[-3000:]}")
    return LoadMemory(**json.loads(res.stdout.strip().splitlines()[-1]))


def report(m: LoadMemory) -> str:
    verdict = "within" if m.within_target else "ABOVE"
    return (f"load {m.checkpoint} on {m.device}: {m.checkpoint_bytes / MiB:.1f} MiB of tensors, "
            f"model resident {m.resident_bytes / MiB:.1f} MiB\n"
            f"  peak RSS above the {m.rss_before_bytes / MiB:.0f} MiB before loading: "
            f"{m.load_peak_bytes / MiB:.1f} MiB while loading and binding "
            f"({m.load_seconds:.1f} s), {m.touched_peak_bytes / MiB:.1f} MiB with every weight "
            f"read\n  ratio {m.ratio:.3f} to the resident bytes ({verdict} {TARGET_RATIO}x)")


@dataclass(frozen=True)
class LoadBenchOptions:
    """`dsv41 bench load`."""

    preset: str = "bench"  # whose seeded checkpoint, without a checkpoint folder
    checkpoint: Path | None = None
    device: str = "cpu"
    json: Path | None = None


def run_command(opts: LoadBenchOptions, *,
                default_checkpoint: Callable[[str], Path] = ensure_checkpoint) -> int:
    """The measurement in a fresh process, printed and written to the JSON.
    `default_checkpoint(preset)`: the checkpoint without `opts.checkpoint`."""
    ckpt = opts.checkpoint or default_checkpoint(opts.preset)
    m = measure_load(ckpt, opts.device)
    print(report(m))
    if opts.json:
        write_json(opts.json, {"load": {**asdict(m), "within_target": m.within_target}},
                   indent=2, final_newline=True)
    return 0


if __name__ == "__main__":  # the child of `measure_load`: CHECKPOINT DEVICE, JSON out
    checkpoint, device = sys.argv[1:3]
    print(json.dumps(asdict(measure_in_this_process(Path(checkpoint), device))))
