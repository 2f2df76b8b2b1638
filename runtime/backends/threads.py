"""TVM's CPU thread pool, sized to the cores the process may use.

TVM sizes its pool to hardware_concurrency / 2 on its own (it assumes SMT sibling pairs); on a VM
whose vCPUs are cores that is half the machine, so every compiled kernel would run on 1 of 2
cores. Loading a CPU artifact sizes the pool to torch's thread count unless the user chose one
(TVM_NUM_THREADS, or the engine's `threads` option)."""

from __future__ import annotations

import os


def tvm_num_threads() -> int:
    import tvm  # order: tvm loads only after disco's libraries (disco.load_disco)

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
