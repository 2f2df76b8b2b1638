"""TVM's CPU thread pool, sized to the cores the process may use and configured to share them.

TVM sizes its pool to hardware_concurrency / 2 on its own (it assumes SMT sibling pairs); on a VM
whose vCPUs are cores that is half the machine, so every compiled kernel would run on 1 of 2
cores. Loading a CPU artifact sizes the pool to torch's thread count unless the user chose one
(TVM_NUM_THREADS, or the engine's `threads` option).

Sharing: an idle TVM worker spins `TVM_THREAD_POOL_SPIN_COUNT` times (TVM's default 300000)
calling sched_yield before it sleeps, and a decode step launches hundreds of kernels. On a
machine with any other runnable thread, each yield hands the core to it for a time slice, so a
step paid one slice per kernel boundary (the 64K step took 1.7-2.8x as long beside one nice-19
process). With a spin count of 0 (`DEFAULT_SPIN_COUNT`) an idle worker sleeps at once and each
launch wakes it: a few microseconds per kernel on a quiet machine, and under contention the
woken worker preempts a lower-priority process, so a step loses about the CPU it is denied.
TVM reads the count once per process, when its pool first starts: `configure_pool` sets it
before anything here touches the pool; an explicit TVM_THREAD_POOL_SPIN_COUNT is kept. A CPU
artifact's entries run on the artifact's own launcher instead (`runtime.backends.launcher`:
workers that spin on `pause`, never yielding, then sleep), sized here with TVM's pool; TVM's
pool runs what the launcher does not (kernels built outside an artifact, older artifacts).

The engine's own helper threads (the SSD block writer, the Engram prefetcher) run at a lower
priority (`lower_helper_priority`, nice +HELPER_NICE for that thread only), so their work waits
for a free core rather than taking one from the step's workers."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from dsv41.runtime.backends.launcher import launchers, spin_us, use_artifact_launcher

SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"
DEFAULT_SPIN_COUNT = 0  # sleep at once: a step degrades with the CPU it loses, not per barrier
HELPER_NICE = 10  # the helper threads' nice, above the compute threads' (Linux: per thread)


@dataclass(frozen=True)
class PoolConfig:
    """How TVM's CPU pool runs in this process."""

    threads: int  # workers (TVM_NUM_THREADS / the engine's `threads`)
    spin_count: int  # yields an idle worker spins before sleeping (read once per process)
    bind_threads: bool  # TVM pins each worker to a core (TVM_BIND_THREADS, default on)
    launcher: str = "tvm"  # what runs the loaded entries' parallel loops: "artifact" or "tvm"
    launcher_spin_us: int = 0  # the artifact launcher's spin before its idle workers sleep

    def to_dict(self) -> dict:
        return {"threads": self.threads, "spin_count": self.spin_count,
                "bind_threads": self.bind_threads, "launcher": self.launcher,
                "launcher_spin_us": self.launcher_spin_us}


def configure_pool() -> None:
    """Set TVM's spin count to DEFAULT_SPIN_COUNT unless the user set one (call before TVM's
    pool starts; TVM reads it once)."""
    os.environ.setdefault(SPIN_ENV, str(DEFAULT_SPIN_COUNT))


def pool_config() -> PoolConfig:
    """The pool this process runs (starting it, configured, when it has not started)."""
    configure_pool()
    try:
        spin = int(os.environ[SPIN_ENV])
    except ValueError:
        raise ValueError(f"{SPIN_ENV} must be a whole number of spins, got "
                         f"{os.environ[SPIN_ENV]!r}.") from None
    artifact = use_artifact_launcher() and bool(launchers().all())
    return PoolConfig(tvm_num_threads(), spin, os.environ.get("TVM_BIND_THREADS", "1") != "0",
                      "artifact" if artifact else "tvm", spin_us() if artifact else 0)


def lower_helper_priority() -> None:
    """Lower the calling thread's priority to nice HELPER_NICE (Linux sets nice per thread;
    elsewhere, or where the OS refuses, the thread keeps its priority)."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < HELPER_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, HELPER_NICE)
    except (AttributeError, OSError):  # no per-thread priorities here: nothing to lower
        pass


def tvm_num_threads() -> int:
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    configure_pool()  # asking TVM for its size starts the pool: its spin count first

    return int(tvm.get_global_func("runtime.NumThreads")())


def size_tvm_pool(n: int) -> int:
    """TVM's CPU pool at n threads: TVM_NUM_THREADS caps the pool (and sizes it when it is
    created later); a pool that already exists at another size is rebuilt. Returns its size."""
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

    if n < 1:
        raise ValueError(f"A thread pool needs at least 1 thread, got {n}.")
    os.environ["TVM_NUM_THREADS"] = str(n)
    if tvm_num_threads() != n:
        tvm.get_global_func("runtime.config_threadpool")(1, n)  # 1: every (big) core
    launchers().resize(n)
    return tvm_num_threads()


def default_tvm_pool(threads: int | None = None) -> int:
    """`threads` when given; else an explicit TVM_NUM_THREADS is kept as set; else torch's
    thread count (the cores the process may use). Returns the pool size."""
    import torch  # heavy: torch; the CLI imports this module before any work

    if threads is not None:
        return size_tvm_pool(threads)
    if "TVM_NUM_THREADS" in os.environ:
        return tvm_num_threads()
    return size_tvm_pool(torch.get_num_threads())
