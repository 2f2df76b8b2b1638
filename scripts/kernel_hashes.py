"""Print the structural hash of every kernel the registry builds, one line each, sorted.

A guard for refactors of `schedules/` (issue 36: kernel families as packages): the lines before
and after a change must be identical. Two sources of kernels:

- the model's: every entry of the given presets, captured and lowered for each target; each
  kernel key the lowering adds is hashed as the module holds it (factory + config + schedule);
- the factories' own variants that no lowering on this host reaches (the AVX-512 / VNNI / AMX /
  AVX2 index sweeps, the AMX GEMMs, the AVX-512 MoE GEMVs), built directly at small dims.

    python scripts/kernel_hashes.py > before.txt      # then, after the change:
    python scripts/kernel_hashes.py | diff before.txt -
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import tvm
import tvm_ffi

from dsv41.compiler.build import run_phases
from dsv41.graph.config import preset
from dsv41.graph.entries import ENTRIES
from dsv41.graph.model import Model
from dsv41.schedules import gemm, indexer, moe

TARGETS = ("cpu", "cpu-x86-64", "cuda-sm90")
PRESETS = ("small",)


def model_kernels(preset_name: str, target: str) -> dict[str, int]:
    """label -> structural hash of every kernel the preset's entries lower to on `target`."""
    model = Model.placeholder(preset(preset_name))
    out: dict[str, int] = {}
    for entry in ENTRIES:
        if entry in ("draft", "verify") and not model.plan.dspark:
            continue
        run = run_phases(model, entry, target, until="lower")
        for key, gv in run.kernels.items():
            label = f"model {preset_name} {target} {key.function_name} {key!r}"
            out[label] = tvm_ffi.structural_hash(run.module[gv])
    return out


def factory_variants() -> dict[str, Callable[[], tvm.tirx.PrimFunc]]:
    """The hand-vectorised variants, each at one small shape, by a readable label."""
    sweep = indexer.make_index_scores_avx512
    return {
        "sweep avx512 fp32": lambda: sweep(heads=16, dim=128),
        "sweep avx512 dim64": lambda: sweep(heads=16, dim=64),
        "sweep avx512 vnni": lambda: sweep(heads=16, dim=128, vnni=True),
        "sweep avx512 vnni alt2": lambda: sweep(heads=16, dim=128, vnni=True, n_alt=2),
        "sweep avx2 int8": lambda: sweep(heads=16, dim=128, vnni=True, lanes=8),
        "sweep amx": lambda: sweep(heads=32, dim=128, vnni=True, amx=True, tile=32),
        "sweep generic": lambda: indexer.make_index_scores(heads=16, dim=128),
        "sweep generic alt1": lambda: indexer.make_index_scores(heads=16, dim=128, n_alt=1),
        "fp8 linear amx": lambda: gemm.make_fp8_linear_amx(n=256, k=512, block_rows=32),
        "fp8 gemv avx2": lambda: gemm.make_fp8_gemv_avx2(n=256, k=512),
        "fp8 gemv avx512": lambda: gemm.make_fp8_gemv_avx2(n=256, k=512, lanes=16),
        "dense gemm amx": lambda: gemm.make_dense_gemm_amx(groups=1, n=256, k=512,
                                                           block_rows=32),
        "moe gate_up avx512": lambda: moe.make_moe_gate_up_gemv_avx512(
            dim=256, inter=128, n_experts=8, topk=2, swiglu_limit=10.0),
        "moe down avx512": lambda: moe.make_moe_down_gemv_avx512(
            dim=256, inter=128, n_experts=8, topk=2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--no-model", action="store_true", help="the factory variants only")
    args = ap.parse_args(argv)
    lines: dict[str, int] = {}
    for label, make in factory_variants().items():
        try:
            lines[f"factory {label}"] = tvm_ffi.structural_hash(make())
        except Exception as e:  # a variant's signature or shape limits: say so, do not hide it
            print(f"factory {label}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    if not args.no_model:
        for p in args.presets:
            for t in args.targets:
                lines.update(model_kernels(p, t))
    for label in sorted(lines):
        print(f"{lines[label]:020d}  {label}")
    print(f"{len(lines)} kernels", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
