"""TVM's disco (multi-worker sessions) with the PyPI wheel.

The wheel ships disco in `libtvm_runtime_extra.so`, whose symbols resolve against
`libtvm_runtime.so` only when both are loaded with RTLD_GLOBAL before `tvm` is imported;
otherwise `tvm.runtime.disco` is None. `load_disco()` does that loading, so it must run in a
process before anything imports tvm (a worker process, a launcher), and says so clearly when it
is too late.

    disco = load_disco()                       # the tvm.runtime.disco module
    sess = disco.ThreadedSession(num_workers=2)

Collectives (`init_ccl`) take only nccl / rccl, and the wheel has no NCCL: a multi-GPU
deployment needs a TVM built with `USE_NCCL=ON` (`check_ccl` names the missing piece).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
from pathlib import Path

from dsv41.graph.artifact_format import SHARDED_FORMAT  # a sharded artifact's manifest format

RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_extra.so")


class DiscoUnavailable(RuntimeError):
    """disco cannot be used in this process (see the message for why and what to do)."""


def tvm_lib_dir() -> Path:
    """The installed tvm package's `lib/` folder, found without importing tvm."""
    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        raise DiscoUnavailable("TVM is not installed (no `tvm` package).")
    return Path(spec.origin).parent / "lib"


def is_sharded_dir(artifact_dir: str | Path) -> bool:
    """Whether `artifact_dir` holds a sharded artifact (its manifest's format), read without
    importing tvm: a process that will run one calls `load_disco` first (the CLI does)."""
    try:
        manifest = json.loads((Path(artifact_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == SHARDED_FORMAT


def load_disco():
    """The `tvm.runtime.disco` module, loading TVM's runtime libraries globally first."""
    if "tvm" in sys.modules:
        import tvm  # order: tvm loads here, after disco's libraries

        disco = getattr(tvm.runtime, "disco", None)
        if disco is None:
            raise DiscoUnavailable(
                "tvm was imported before its runtime libraries were loaded with RTLD_GLOBAL, so "
                "its disco module is missing; call "
                "dsv41.runtime.backends.disco.load_disco() before "
                "anything imports tvm (first thing in the process).")
        return disco
    lib = tvm_lib_dir()
    import tvm_ffi  # noqa: F401 - libtvm_ffi first: the runtime libraries link against it

    for name in RUNTIME_LIBS:
        path = lib / name
        if not path.is_file():
            raise DiscoUnavailable(f"{path} is missing: this TVM build has no disco runtime.")
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    import tvm  # order: tvm loads here, after disco's libraries

    disco = getattr(tvm.runtime, "disco", None)
    if disco is None:
        raise DiscoUnavailable(f"TVM's disco module did not load from {lib} even with its "
                               "runtime libraries loaded globally.")
    return disco


def check_ccl(backend: str = "nccl") -> None:
    """A clear error when this TVM has no `backend` collectives (the PyPI wheel has none)."""
    import tvm  # order: tvm loads here, after disco's libraries

    if backend not in ("nccl", "rccl"):
        raise DiscoUnavailable(f"disco's collectives are nccl or rccl, not {backend!r}.")
    if tvm.get_global_func(f"runtime.disco.{backend}.init_ccl", allow_missing=True) is None:
        raise DiscoUnavailable(
            f"This TVM has no {backend.upper()} collectives (the PyPI wheel is built without "
            f"them). Build TVM from source with USE_{backend.upper()}=ON (and USE_CUDA=ON or "
            "USE_ROCM=ON) for multi-GPU artifacts; see the README's multi-GPU section.")
