"""The parallel launcher a CPU artifact brings (`launcher.so`, built from `launcher.c` by the
compiler), installed in place of TVM's thread pool for the artifact's entry libraries.

Why: a compiled kernel runs a parallel loop through `TVMBackendParallelLaunch`, and TVM's pool
has two ways to wait between kernels, both bad for a decode step of ~700 parallel launches.
Spinning (its default) is a loop of sched_yield calls, each of which can hand the core to any
other runnable process for a time slice (a step beside one nice-19 busy loop took 2-9x its
quiet time); sleeping at once (`TVM_THREAD_POOL_SPIN_COUNT=0`, `runtime.backends.threads`)
makes every launch wake a worker through the kernel, 11.5-16 us a launch on a Zen 4 VM. The
artifact's launcher waits on `pause` for `spin_us` (DEFAULT_SPIN_US) and then sleeps on a futex:
a launch within that time costs no system call, and the spin never gives the core away, so a
step beside a lower-priority process keeps its cores, and beside an equal one loses about the
CPU it is denied.

How it is installed: each entry library holds TVM's launch function as a pointer,
`__TVMBackendParallelLaunch`, which TVM fills when it loads the library; `Launcher.install`
points it at `dsv41_parallel_launch` instead (a library whose kernels use TVM's parallel barrier
keeps TVM's pool: this launcher has none). Results are bit for bit those of TVM's pool: each task
computes the same part of its loop (the task id and count are the same), on whichever thread.

One pool per process and launcher binary (`launchers()`), sized with TVM's pool
(`threads.size_tvm_pool` resizes both). An artifact without `launcher.so` (compiled before it
existed) runs on TVM's pool as before.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_FILE = "launcher.so"  # in a CPU artifact's folder, listed in its manifest's files
SOURCE = Path(__file__).with_name("launcher.c")
ABI = 1  # `dsv41_launcher_abi()` of the launchers this runtime installs
CHOICE_ENV = "DSV41_LAUNCHER"  # "artifact" (default): the artifact's launcher; "tvm": TVM's pool
SPIN_US_ENV = "DSV41_LAUNCHER_SPIN_US"
DEFAULT_SPIN_US = 50  # covers the gaps between a step's kernels; idle workers sleep after it
LAUNCH_SYMBOL = "__TVMBackendParallelLaunch"
BARRIER_SYMBOL = "__TVMBackendParallelBarrier"


class LauncherError(RuntimeError):
    """A launcher library that cannot be used (wrong ABI, missing symbols)."""


@dataclass(frozen=True)
class LauncherCounts:
    """Launches since the launcher was loaded: run by the pool, run serially on their caller
    (a nested launch, one task, or while another thread's launch held the pool)."""

    pooled: int
    serial: int


def use_artifact_launcher() -> bool:
    """Whether entries run on their artifact's launcher (DSV41_LAUNCHER, default "artifact") or
    on TVM's pool ("tvm")."""
    choice = os.environ.get(CHOICE_ENV, "artifact")
    if choice not in ("artifact", "tvm"):
        raise ValueError(f"{CHOICE_ENV} must be 'artifact' or 'tvm', got {choice!r}.")
    return choice == "artifact"


def spin_us() -> int:
    """The spin of idle workers, from DSV41_LAUNCHER_SPIN_US (default DEFAULT_SPIN_US)."""
    raw = os.environ.get(SPIN_US_ENV, str(DEFAULT_SPIN_US))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{SPIN_US_ENV} must be a whole number of microseconds, got "
                         f"{raw!r}.") from None
    if value < 0:
        raise ValueError(f"{SPIN_US_ENV} must be 0 or more microseconds, got {value}.")
    return value


class Launcher:
    """One loaded launcher library and its pool."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._lib = ctypes.CDLL(str(path))
            abi = self._lib.dsv41_launcher_abi()
        except (OSError, AttributeError) as e:
            raise LauncherError(f"{path} is not a dsv41 launcher library: {e}") from e
        if abi != ABI:
            raise LauncherError(f"{path} is launcher ABI {abi}; this runtime installs {ABI}. "
                                "Recompile the artifact.")
        self._lib.dsv41_launcher_configure.argtypes = [ctypes.c_int, ctypes.c_long]
        self._lib.dsv41_launcher_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)] * 2
        self.address = ctypes.cast(self._lib.dsv41_parallel_launch, ctypes.c_void_p).value
        self.threads, self.spin_us = 0, 0
        self._tvm_launch: dict[str, int] = {}  # library -> TVM's launch function it held
        self._lock = threading.Lock()

    def configure(self, threads: int, spin: int) -> int:
        """Size the pool (the calling thread included) and its spin; returns its threads."""
        if threads < 1:
            raise ValueError(f"A launcher needs at least 1 thread, got {threads}.")
        with self._lock:
            if (threads, spin) != (self.threads, self.spin_us):
                self.threads = self._lib.dsv41_launcher_configure(threads, spin * 1000)
                self.spin_us = spin
            return self.threads

    def install(self, library: Path) -> bool:
        """Point a loaded library's kernels at this launcher; False when it keeps TVM's pool
        (it launches nothing in parallel, or its kernels use TVM's parallel barrier)."""
        slot = _launch_slot(library)
        if slot is None:
            return False
        with self._lock:
            self._tvm_launch.setdefault(str(library), slot.value)
            slot.value = self.address
        return True

    def uninstall(self, library: Path) -> None:
        """Give the library TVM's launch function back (A/B measurements, tests)."""
        slot = _launch_slot(library)
        with self._lock:
            tvm_launch = self._tvm_launch.pop(str(library), None)
            if slot is not None and tvm_launch is not None:
                slot.value = tvm_launch

    def installed(self, library: Path) -> bool:
        """Whether the library is loaded and its kernels run on this launcher."""
        try:
            slot = _launch_slot(library)
        except LauncherError:  # not loaded
            return False
        return slot is not None and slot.value == self.address

    def counts(self) -> LauncherCounts:
        pooled, serial = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.dsv41_launcher_counts(ctypes.byref(pooled), ctypes.byref(serial))
        return LauncherCounts(pooled.value, serial.value)


def _launch_slot(library: Path) -> ctypes.c_void_p | None:
    """The library's pointer to its launch function (it must be loaded already); None when it
    has none or also uses TVM's barrier."""
    try:
        lib = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError as e:
        raise LauncherError(f"{library} is not loaded in this process: {e}") from e
    try:
        ctypes.c_void_p.in_dll(lib, BARRIER_SYMBOL)
        return None  # its kernels synchronise inside a launch: TVM's pool keeps it
    except ValueError:
        pass
    try:
        return ctypes.c_void_p.in_dll(lib, LAUNCH_SYMBOL)
    except ValueError:
        return None


class Launchers:
    """The launchers loaded in this process, one per library file content."""

    def __init__(self):
        self._by_digest: dict[str, Launcher] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, digest: str, threads: int) -> Launcher:
        """The launcher of this content (loaded from `path` the first time), sized to
        `threads` and the spin of the environment."""
        with self._lock:
            launcher = self._by_digest.get(digest)
            if launcher is None:
                launcher = self._by_digest[digest] = Launcher(path)
        launcher.configure(threads, spin_us())
        return launcher

    def resize(self, threads: int) -> None:
        """Every loaded launcher to `threads` (TVM's pool was resized)."""
        with self._lock:
            loaded = list(self._by_digest.values())
        for launcher in loaded:
            launcher.configure(threads, spin_us())

    def all(self) -> tuple[Launcher, ...]:
        with self._lock:
            return tuple(self._by_digest.values())


@functools.cache
def launchers() -> Launchers:
    """The process's launchers (its thread pools are process-wide, as TVM's is)."""
    return Launchers()
