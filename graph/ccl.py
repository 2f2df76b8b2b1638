"""Which collective functions a compiled sharded entry calls (`CclBackend`): light (no torch), so
the artifact format names it without loading the collectives. `graph.collectives` re-exports it.
"""

from __future__ import annotations

from enum import Enum


class CclBackend(Enum):
    """The functions a compiled sharded entry calls for its collectives, with disco's
    signatures: allreduce(send, reduce_kind: Shape (0 = sum), in_group: bool, recv) and
    allgather(send, in_group: bool, recv); recv is the output (destination passing)."""

    DISCO = "disco"  # runtime.disco.*: the session's NCCL / RCCL (GPUs; a TVM with USE_NCCL)
    CPU_TEST = "cpu-test"  # dsv41.test_ccl.*: a ThreadGroup in a ThreadedSession (tests, CPU)

    def function(self, op: str) -> str:
        if op not in ("allreduce", "allgather"):
            raise ValueError(f"Unknown collective {op!r}; allreduce or allgather.")
        return f"{'runtime.disco' if self is CclBackend.DISCO else 'dsv41.test_ccl'}.{op}"
