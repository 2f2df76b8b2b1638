"""Build a CPU artifact's parallel launcher (`runtime/backends/launcher.c` -> `launcher.so` in
the artifact's folder; why and how the runtime installs it: `runtime.backends.launcher`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from dsv41.runtime.backends.launcher import LAUNCHER_FILE, SOURCE

FLAGS = ("-O2", "-fPIC", "-shared", "-pthread", "-Wall", "-Werror")


def c_compiler() -> str:
    """$CC when set, else `cc` (the toolchain that links the entry libraries is there too)."""
    name = os.environ.get("CC") or "cc"
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"No C compiler {name!r} on PATH to build the artifact's parallel "
                           "launcher; install one (gcc) or set CC.")
    return found


def build_launcher(out_dir: Path) -> Path:
    """Compile the launcher into `out_dir` (replacing one there) and return its path."""
    out = out_dir / LAUNCHER_FILE
    tmp = out.with_name(out.name + ".tmp")
    cmd = [c_compiler(), *FLAGS, "-o", str(tmp), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"Building the parallel launcher failed ({' '.join(cmd)}):\n"
                           f"{done.stderr.strip()}")
    tmp.replace(out)
    return out
