"""`dsv41 bundle`: a self-contained folder that runs artifacts where only torch (and numpy) is
installed: no pip install, no package index, no TVM compiler.

    OUT/
      gpu_check.py        the device check (`compiler/selftest.py`) over what the bundle holds
      bundle.json         what is inside: artifacts (target, config hash, entries), the case,
                          every file's sha256 and size, the Python it needs, its total size
      artifacts/<name>/<target>/   each artifact as compiled (manifest verified at load)
      cases/<name>/       a conformance case (checkpoint, goldens), when given
      lib/dsv41/          graph/ and runtime/ (the engine), and of compiler/ the check and what
                          it reads (selftest.py, bench.py's synthetic caches)
      lib/tvm/            TVM's Python package with its runtime libraries only (libtvm_runtime,
                          libtvm_runtime_extra, libtvm_runtime_cuda; not libtvm_compiler)
      lib/tvm_ffi/        TVM's FFI (its compiled core is this Python's ABI)
      lib/<deps>          the small third-party modules the runtime imports (ml_dtypes,
                          safetensors, tqdm, tokenizers: the Engram map)

`gpu_check.py` puts `lib/` first on `sys.path` and sets TVM_USE_RUNTIME_LIB=1, so the bundle's
copies are what runs, whatever else is installed. Refused before anything is written: an output
folder that exists and is not empty, and a bundle over `max_bytes` (default 64 MiB).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from dsv41.compiler.progress import LineProgress
from dsv41.graph.config import load_config, preset

MiB = 1 << 20
DEFAULT_MAX_BYTES = 64 * MiB
FORMAT = 1
PACKAGE = Path(__file__).resolve().parents[2]  # the dsv41 source tree (graph/, runtime/, ...)
# of compiler/, what gpu_check.py runs: the check and the bench modules it reads
COMPILER_FILES = ("__init__.py", "tools/__init__.py", "tools/selftest.py",
                  "tools/bench/__init__.py", "tools/bench/measure.py",
                  "tools/bench/roof.py", "tools/bench/synthetic.py")
TVM_RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_extra.so", "libtvm_runtime_cuda.so")
# folders of the tvm / tvm_ffi packages no runtime import reads (headers, sources, the web
# runtime, CMake files) and the compiler library
SKIP_DIRS = {"__pycache__", "3rdparty", "include", "src", "web", "cmake", "lib64"}
DEPS = ("ml_dtypes", "safetensors", "tqdm", "tokenizers")  # what graph/ and runtime/ import

ENTRY_SCRIPT = '''#!/usr/bin/env python3
"""The dsv41 device check, run from this bundle: `python gpu_check.py [--target cuda-sm90]
[--device cuda:0] [--json out.json] [--budget-s 480]` (`--help` for the rest). Needs Python
{python} and torch (a CUDA build for a GPU) with numpy; nothing else is installed or fetched."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if sys.version_info[:2] != {py_tuple}:
    sys.exit(f"This bundle's TVM runtime is built for Python {python}; this is "
             f"{{sys.version.split()[0]}}.")
os.environ["TVM_USE_RUNTIME_LIB"] = "1"  # TVM's runtime library only (no compiler here)
sys.path.insert(0, str(HERE / "lib"))

from dsv41.compiler.tools.selftest import main  # noqa: E402

sys.exit(main(sys.argv[1:], prog="gpu_check.py", defaults={{
    "artifacts": str(HERE / "artifacts"), "case": str(HERE / "cases" / "shared-small"),
    "target": "{target}", "json": "selftest.json",
    "bench_checkpoint": str(HERE / "checkpoints" / "bench-seed0")}}))
'''


@dataclass(frozen=True)
class BundleOptions:
    artifacts: tuple[Path, ...]
    out: Path
    case: Path | None = None
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class BundleReport:
    out: Path
    total_bytes: int
    files: int
    artifacts: dict  # name -> {"target", "config_hash", "entries"}


def _module_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"The module {name!r} is not installed here; the bundle copies it.")
    return Path(spec.origin).parent


def _copy_tree(src: Path, dst: Path, *, suffixes: tuple[str, ...] | None = None,
               skip_files: tuple[str, ...] = ()) -> None:
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if any(part in SKIP_DIRS for part in rel.parts) or path.is_dir():
            continue
        if path.name in skip_files or (suffixes is not None and path.suffix not in suffixes):
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _copy_tvm(lib: Path) -> None:
    src = _module_dir("tvm")
    _copy_tree(src, lib / "tvm", skip_files=("libtvm_compiler.so",))
    libdir = lib / "tvm" / "lib"
    missing = [n for n in TVM_RUNTIME_LIBS if not (libdir / n).is_file()]
    if missing:
        raise ValueError(f"TVM's runtime libraries {missing} are not in {src / 'lib'}.")
    for path in (lib / "tvm").rglob("*.so"):  # only the runtime libraries travel
        if path.parent == libdir and path.name not in TVM_RUNTIME_LIBS:
            path.unlink()
    _copy_tree(_module_dir("tvm_ffi"), lib / "tvm_ffi")


CUDART = "libcudart.so.13"  # what libtvm_runtime_cuda needs (found through its $ORIGIN runpath)


def _cudart() -> Path | None:
    """This machine's CUDA runtime library of the version TVM's CUDA runtime links, if any."""
    roots = [os.environ.get("CUDA_HOME", ""), *sorted(Path("/usr/local").glob("cuda*"))]
    for root in roots:
        for sub in ("lib", "lib64"):
            p = Path(root) / sub / CUDART if root else None
            if p is not None and p.is_file():
                return p.resolve()
    return None


def _copy_dsv41(lib: Path) -> None:
    pkg = lib / "dsv41"
    for sub in ("graph", "runtime"):
        _copy_tree(PACKAGE / sub, pkg / sub, suffixes=(".py", ".json"))
    for name in COMPILER_FILES:
        (pkg / "compiler" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PACKAGE / "compiler" / name, pkg / "compiler" / name)


def _artifact_info(path: Path) -> dict:
    from dsv41.runtime.backends.artifact import verify  # torch: as check_artifacts' build

    m = verify(path, check_device=False)
    return {"target": str(m.target.name), "config_hash": m.config_hash,
            "entries": sorted(str(e) for e in m.entries)}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_bundle_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"The bundle folder {out} exists and is not empty; name a new one.")


def write_bundle(opts: BundleOptions) -> BundleReport:
    """Write the bundle into a temporary sibling of `opts.out`, check its size, then rename it
    into place (a refused or failed bundle leaves nothing)."""
    out = Path(opts.out)
    check_bundle_folder(out)
    if not opts.artifacts:
        raise ValueError("A bundle needs at least one artifact (--artifact DIR).")
    infos = {}
    for a in opts.artifacts:
        info = _artifact_info(Path(a))
        name = f"{Path(a).resolve().parent.name}/{info['target']}"
        if name in infos:
            raise ValueError(f"Two artifacts would be bundled as {name}.")
        infos[name] = (Path(a), info)
    if opts.case is not None and not (Path(opts.case) / "case.json").is_file():
        raise ValueError(f"{opts.case} is not a conformance case (no case.json).")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    try:
        for name, (src, _) in infos.items():
            _copy_tree(src, work / "artifacts" / name)
        if opts.case is not None:
            _copy_tree(Path(opts.case), work / "cases" / "shared-small")
        lib = work / "lib"
        _copy_dsv41(lib)
        _copy_tvm(lib)
        cudart = _cudart()
        if cudart is not None:  # a host whose torch brings another CUDA runtime still runs it
            shutil.copy2(cudart, lib / "tvm" / "lib" / CUDART)
        for dep in DEPS:
            _copy_tree(_module_dir(dep), lib / dep)
        targets = sorted({info["target"] for _, info in infos.values()})
        py = f"{sys.version_info[0]}.{sys.version_info[1]}"
        script = ENTRY_SCRIPT.format(python=py, py_tuple=tuple(sys.version_info[:2]),
                                     target=next((t for t in targets if t.startswith("cuda")),
                                                 targets[0]))
        (work / "gpu_check.py").write_text(script)
        files = {str(p.relative_to(work)): p for p in sorted(work.rglob("*")) if p.is_file()}
        total = sum(p.stat().st_size for p in files.values())
        if total > opts.max_bytes:
            raise ValueError(f"The bundle would be {total / MiB:.1f} MiB, above the "
                             f"{opts.max_bytes / MiB:.0f} MiB allowed; bundle fewer entries.")
        manifest = {
            "format": FORMAT, "python": py, "needs": ["torch", "numpy"],
            "cudart": None if cudart is None else CUDART,
            "artifacts": {n: info for n, (_, info) in infos.items()},
            "case": None if opts.case is None else "cases/shared-small",
            "total_bytes": total,
            "files": {rel: {"sha256": _digest(p), "bytes": p.stat().st_size}
                      for rel, p in files.items()},
        }
        (work / "bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return BundleReport(out, total, len(files) + 1,
                        {n: info for n, (_, info) in infos.items()})


# ---- the GPU check's bundle ----------------------------------------------------------------------

SMALL_ENTRIES = ("prefill_all", "decode")  # what the conformance check scores with
BENCH_ENTRIES = ("decode",)  # what the decode check times


def check_artifacts(target: str, case: Path, out: Path, say=print) -> tuple[Path, Path]:
    """The artifacts `gpu_check.py` runs for `target`: shared-small's config (from the case's
    checkpoint) with SMALL_ENTRIES and the bench preset with BENCH_ENTRIES, under `out`,
    compiling the entries they lack (CUDA targets build real SASS here, without a GPU)."""
    # torch: compiler.build imports it; `dsv41 --help` reads this module's parser inputs without it
    from dsv41.compiler.build import CompileOptions, compile_artifact, missing_entries

    made = []
    for name, args, entries in (("shared-small", load_config(Path(case) / "checkpoint"),
                                 SMALL_ENTRIES), ("bench", preset("bench"), BENCH_ENTRIES)):
        opts = CompileOptions(args=args, model_name=name, target=target, out=out,
                              entries=entries)
        todo = missing_entries(opts.artifact_dir, args, target, entries)
        if todo:
            say(f"compiling {', '.join(todo)} of {name} for {target} into {opts.artifact_dir}")
            compile_artifact(CompileOptions(args=args, model_name=name, target=target, out=out,
                                            entries=todo), progress=LineProgress(say))
        made.append(opts.artifact_dir)
    return made[0], made[1]
