"""The sharded graph: N worker models, each over its share of the checkpoint (`sharding.py`'s
plan), meeting through collectives (`collectives.py`) where partial results meet.

    models, group = load_workers(checkpoint, shards=2)   # each reads only its slices
    backend = ShardedBackend(models, group)              # scoring over the N workers
    result = score(backend, tokens, prefill=P)           # = the one-worker graph's result

Every worker runs the whole graph on its own thread (the replicated layers identically, the split
ones on its slice) and keeps the whole cache, as on separate devices; the collectives give every
worker the same sums, so every worker's logits are the same (checked at each call).

What differs from one worker, and why a tolerance is needed: only the order of fp32 additions
in the row-parallel GEMMs (`wo_b`, the shared expert's `w2`: each worker adds the 32-blocks of
its columns, then the all-reduce adds the workers' sums, where one worker adds every block in
turn), before the one bf16 rounding both do. The embedding (one non-zero row per token), the
head's all-gather, the routed experts (two per token: one addition either way) and everything
replicated are bit-identical. An fp32 reordering moves a sum by a few ulp (~1e-7 relative), so
a bf16 result flips by one ulp rarely; FP8 quantisation and top-k selection downstream can
carry such a flip further, so runs are compared with the conformance metrics (logit relative
L2, selections) rather than bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from dsv41.graph.checkpoint import checkpoint_config
from dsv41.graph.collectives import CollectiveError, ThreadGroup
from dsv41.graph.config import ModelArgs
from dsv41.graph.model import Model
from dsv41.graph.score import GraphBackend
from dsv41.graph.sharding import WorkerShard, shard_plan

T = TypeVar("T")


def load_workers(path: str | Path, shards: int, args: ModelArgs | None = None, *,
                 group: ThreadGroup | None = None) -> tuple[list[Model], ThreadGroup]:
    """The N worker models of a checkpoint, each loaded with only its own tensors and slices
    (`Model.from_checkpoint(..., shard=)`), joined by one in-process `ThreadGroup`."""
    args = args or checkpoint_config(path)
    shard_plan(args, shards)  # a clear error when the config does not split over `shards`
    group = group or ThreadGroup(shards)
    if group.shards != shards:
        raise ValueError(f"The thread group has {group.shards} workers, not {shards}.")
    models = [Model.from_checkpoint(path, args, shard=WorkerShard(w, shards, group.member(w)))
              for w in range(shards)]
    return models, group


def run_workers(fns: Sequence[Callable[[], T]], group: ThreadGroup) -> list[T]:
    """fns[w]() on worker w's thread, all at once; the results in worker order. A failing
    worker aborts the group (the others stop at their next collective) and its error is
    raised."""
    results: list = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def work(w: int) -> None:
        try:
            results[w] = fns[w]()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread below
            errors[w] = e
            group.abort()

    threads = [threading.Thread(target=work, args=(w,), name=f"dsv41-worker-{w}")
               for w in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:  # the first failure, not the aborts it caused
        raise next((e for e in failed if not isinstance(e, CollectiveError)), failed[0])
    return results


class ShardedBackend:
    """Scoring (`score.Backend`) over N worker models in one process: every call runs on every
    worker at once; worker 0's result is returned, after checking every worker got the same
    logits."""

    def __init__(self, models: Sequence[Model], group: ThreadGroup, **kwargs):
        shards = [m.shard for m in models]
        if any(s is None for s in shards) or [s.worker for s in shards] != list(
                range(len(models))) or len(models) != group.shards:
            raise ValueError(f"ShardedBackend takes the {group.shards} worker models of one "
                             "group, in worker order.")
        self.group = group
        self.workers = [GraphBackend(m, **kwargs) for m in models]

    def _all(self, call: Callable[[GraphBackend], dict]) -> dict:
        outs = run_workers([lambda b=b: call(b) for b in self.workers], self.group)
        for w, out in enumerate(outs[1:], start=1):
            if not np.array_equal(out["logits"], outs[0]["logits"], equal_nan=True):
                raise CollectiveError(f"Worker {w}'s logits differ from worker 0's: the "
                                      "collectives did not give every worker the same sums.")
        return outs[0]

    def prefill(self, tokens: np.ndarray, *, mode: str, record: tuple[int, ...] = ()) -> dict:
        return self._all(lambda b: b.prefill(tokens, mode=mode, record=record))

    def decode(self, token: int) -> dict:
        return self._all(lambda b: b.decode(token))
