"""Where sharded workers' partial results meet: the collectives of a sharded graph.

A worker's model (`Model.shard`, see `sharding.WorkerShard`) calls two collectives, with the
semantics of NCCL and TVM disco's `ccl`:

    all_reduce(x)   every worker gets the sum of all workers' x, added in worker order
    all_gather(x)   every worker gets the workers' x concatenated along dim 0, in worker order

Three implementations, one contract:

- `ThreadGroup` / `ThreadMember`: N workers in one process (threads) meeting at a barrier. It is
  the oracle of the two collectives (`sum_in_worker_order`, `gather_in_worker_order`) and the
  CPU test collective: the PyPI TVM wheel has no CPU collective library, so a test registers
  this group's collectives as TVM functions for a ThreadedSession (`runtime/test_ccl.py`). It
  is for tests and CPU checks only; GPUs use NCCL.
- `ExportCollectives`: what a captured worker graph calls, the custom ops `dsv41::all_reduce`
  and `dsv41::all_gather`; the lowering turns them into calls the disco session's collective
  runs. Eagerly they exist only for one worker (the identity and a copy).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from dsv41.graph.ccl import CclBackend  # noqa: F401 - re-exported: what a sharded entry calls


class Collectives(Protocol):
    """The collectives one worker calls (its group and rank are the implementation's)."""

    shards: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


class CollectiveError(RuntimeError):
    """A worker did not reach a collective (it failed, or the group was aborted)."""


# ---- the oracles ------------------------------------------------------------------------------


def sum_in_worker_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-reduce of `parts` (one per worker): added in worker order, in fp32 for bf16 parts
    and rounded once (exact where at most one part is non-zero, as in the embedding)."""
    acc = parts[0].float() if parts[0].dtype == torch.bfloat16 else parts[0].clone()
    for p in parts[1:]:
        acc = acc + p.to(acc.dtype)
    return acc.to(parts[0].dtype)


def gather_in_worker_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The all-gather of `parts`: concatenated along dim 0 in worker order."""
    return torch.cat(list(parts), dim=0)


# ---- in-process workers -----------------------------------------------------------------------


class ThreadGroup:
    """N workers, each on its own thread of this process, exchanging tensors through shared
    slots between two barriers (test and CPU use only; see the module docstring).

        group = ThreadGroup(2)
        comm = group.member(worker)          # on worker's thread
        y = comm.all_reduce(x)

    A worker that fails should call `abort()` so that the others stop waiting with a
    `CollectiveError` instead of at the timeout."""

    def __init__(self, shards: int, *, timeout_s: float = 300.0):
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"A thread group needs a whole number >= 1 of workers, got "
                             f"{shards!r}.")
        self.shards = shards
        self._barrier = threading.Barrier(shards, timeout=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * shards

    def member(self, worker: int) -> ThreadMember:
        if not 0 <= worker < self.shards:
            raise ValueError(f"Worker {worker} is not in a group of {self.shards}.")
        return ThreadMember(self, worker)

    def abort(self) -> None:
        self._barrier.abort()

    def _wait(self, what: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError as e:
            raise CollectiveError(f"The {what} did not complete: another worker failed or did "
                                  "not arrive (the group was aborted or timed out).") from e

    def exchange(self, worker: int, x: torch.Tensor, what: str, combine) -> torch.Tensor:
        """combine(every worker's x, in worker order), computed by each worker while every `x`
        is still alive (a compiled entry may reuse its buffer as soon as its call returns)."""
        self._slots[worker] = x
        self._wait(what)
        parts = list(self._slots)
        ok = len({tuple(p.shape) for p in parts}) == 1 and len({p.dtype for p in parts}) == 1
        out = combine(parts) if ok else None
        self._wait(what)  # nobody moves on (or overwrites a slot) before every worker is done
        self._slots[worker] = None
        if out is None:
            raise CollectiveError(f"The {what} got different shapes or dtypes from its workers: "
                                  f"{[tuple(p.shape) for p in parts]}, "
                                  f"{[str(p.dtype) for p in parts]}.")
        return out


class ThreadMember:
    """One worker's view of a `ThreadGroup` (implements `Collectives`)."""

    def __init__(self, group: ThreadGroup, worker: int):
        self.group, self.worker, self.shards = group, worker, group.shards

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.exchange(self.worker, x, "all-reduce", sum_in_worker_order)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.exchange(self.worker, x, "all-gather", gather_in_worker_order)


# ---- the captured graph's collectives ---------------------------------------------------------


def _one_worker(op: str, x: torch.Tensor, shards: int) -> torch.Tensor:
    """The eager body of both collectives: only one worker exists outside a compiled entry."""
    if shards != 1:
        raise ValueError(f"dsv41::{op} over {shards} workers runs in a compiled sharded "
                         "entry (the disco session's collective); eager sharded runs use a "
                         "ThreadGroup.")
    return x.clone()


@torch.library.custom_op("dsv41::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, shards: int) -> torch.Tensor:
    """Sum over `shards` workers (a sharded entry's collective; lowered to the disco session's
    all-reduce). Eagerly only the one-worker case exists: the identity."""
    return _one_worker("all_reduce", x, shards)


@all_reduce.register_fake
def _(x, shards):
    return torch.empty_like(x)


@torch.library.custom_op("dsv41::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, shards: int) -> torch.Tensor:
    """Concatenation over `shards` workers along dim 0 (lowered to the disco session's
    all-gather). Eagerly only the one-worker case exists: a copy."""
    return _one_worker("all_gather", x, shards)


@all_gather.register_fake
def _(x, shards):
    return x.new_empty(shards * x.size(0), *x.shape[1:])


class ExportCollectives:
    """The collectives of a captured worker graph: `dsv41::all_reduce` / `dsv41::all_gather`."""

    def __init__(self, shards: int):
        self.shards = shards

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self.shards)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.shards)
