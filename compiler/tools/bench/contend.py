"""`dsv41 bench --contend N`: N busy-loop processes at nice 19 beside the run, the way a served
model shares its machine (another tenant, a build, a backup). The quiet figure is measured
first, then the same cells with the loops running; the report keeps both.

A busy loop is a child Python process spinning on nothing, started with `nice -n 19` (lowest
priority) and stopped by its own pid (SIGTERM, then SIGKILL) when the block ends, also on an
error; nothing outlives the bench.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

BUSY_LOOP = "while True:\n    pass\n"
NICE = 19


@dataclass(frozen=True)
class Contention:
    """What ran beside the contended figures."""

    processes: int  # busy-loop processes
    nice: int = NICE
    pids: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"processes": self.processes, "nice": self.nice}


def _lower_priority() -> None:  # runs in the child, before exec
    os.nice(NICE)


@contextmanager
def contending(n: int) -> Iterator[Contention]:
    """n busy loops at nice 19 for the duration of the block (none when n is 0)."""
    if n < 0:
        raise ValueError(f"--contend takes a number of busy-loop processes >= 0, got {n}.")
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUSY_LOOP],
                    preexec_fn=_lower_priority,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield Contention(n, NICE, tuple(p.pid for p in procs))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
