"""Build CUDA modules into real SASS/PTX on a machine without a GPU (../shared/TVM.md §5).

TVM's CUDA runtime library only loads against a libcuda; without one the codegen keeps CUDA
source and never calls nvcc. The build therefore runs in a child process whose loader sees a stub
libcuda that lives only in a temporary folder of this build (never shipped, never installed),
with `TVM_CUDA_COMPILE_MODE=nvcc`. The stub must never be on a real GPU machine's path, which is
why it is created per build and removed afterwards.

`build_cuda(builder, kwargs, target_name, out)` calls `builder(**kwargs)` in the child (a
"module:function" string returning a scheduled PrimFunc or IRModule) and exports the library;
`pipeline` ("module:function" of the target name) replaces tvm.compile's Relax pipeline.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_STUB_C = r"""
#define STUB(name) int name() { return 100; }
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuLaunchKernelEx) STUB(cuModuleGetFunction)
STUB(cuModuleLoadData) STUB(cuModuleUnload) STUB(cuTensorMapEncodeTiled)
int cuGetErrorName(int e, const char** s) { *s = "stub"; return 0; }
int cuGetErrorString(int e, const char** s) { *s = "stub"; return 0; }
"""

_CHILD = r"""
import importlib, json, sys, time
import tvm
from dsv41.graph.targets import get_target
req = json.loads(sys.argv[1])
mod_name, fn_name = req["builder"].split(":")
builder = getattr(importlib.import_module(mod_name), fn_name)
spec = get_target(req["target"])
tgt = spec.tvm_target()
import tvm_ffi, tvm.support.nvcc as nvcc
num = spec.arch.split("_")[1]
@tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
def _compile(code, *_):  # SASS for the arch plus PTX for forward compatibility
    return nvcc.compile_cuda(code, target_format="fatbin", compiler="nvcc", arch=[
        "-gencode", f"arch=compute_{num},code=sm_{num}",
        "-gencode", f"arch=compute_{num},code=compute_{num}"])
t0 = time.perf_counter()
kw = {}
if req.get("pipeline"):
    p_mod, p_fn = req["pipeline"].split(":")
    kw["relax_pipeline"] = getattr(importlib.import_module(p_mod), p_fn)(req["target"])
with tgt:
    mod = builder(**req["kwargs"])
    ex = tvm.compile(mod, target=tgt, **kw)
ex.export_library(req["out"])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def toolchain_problem() -> str | None:
    """Why CUDA modules cannot be built here, or None."""
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        return "no C compiler for the libcuda stub"
    return None


def build_cuda(builder: str, kwargs: dict, target_name: str, out: str | Path,
               timeout: float = 600, pipeline: str | None = None) -> dict:
    """Build `builder(**kwargs)` for a CUDA target into `out` (.so with SASS + PTX). Returns the
    child's report ({"seconds": ...}). Raises RuntimeError with the child's log on failure."""
    problem = toolchain_problem()
    if problem:
        raise RuntimeError(f"Cannot build CUDA modules here: {problem}.")
    cc = shutil.which("gcc") or shutil.which("cc")
    with tempfile.TemporaryDirectory(prefix="dsv41-cuda-stub-") as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text(_STUB_C)
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(Path(tmp) / "libcuda.so.1"), str(src)],
                       check=True, capture_output=True)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = tmp + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        env["TVM_CUDA_COMPILE_MODE"] = "nvcc"
        req = json.dumps({"builder": builder, "kwargs": kwargs, "target": target_name,
                          "out": str(out), "pipeline": pipeline})
        proc = subprocess.run([sys.executable, "-c", _CHILD, req], env=env, capture_output=True,
                              text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"CUDA build of {builder} for {target_name} failed:\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def has_device_code(path: str | Path, arch: str) -> bool:
    """True if the library embeds a fatbin/cubin for `arch` (e.g. sm_90), not CUDA source only."""
    data = Path(path).read_bytes()
    return b"\x50\xed\x55\xba" in data and arch.encode() in data  # fatbin magic 0xBA55ED50
