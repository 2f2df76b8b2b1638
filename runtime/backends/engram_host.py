"""Host-resident Engram: the tables stay in host memory, and the rows a call needs are gathered
on a background thread while the entry's first blocks run.

A compiled entry gets an Engram layer's rows by calling the host function `ENGRAM_ROWS_FUNC`
(hash ids, slot, codes table, scales table) when it reaches that layer (`ops.engram_rows`,
lowered by `compiler.kernels._engram_rows`). The hash ids depend only on the tokens, so before
it calls an entry the runtime posts one gather per Engram layer (`EngramPrefetcher.post`); the
host function claims it: it waits for the rows, which on a GPU were copied to the device from
pinned staging on a side stream. With prefetch off the gather runs when it is claimed, inside
the entry: the same rows, the same bits, nothing hidden.

The function is TVM's, and TVM's function table is one per process; so is the board that
routes each call to its posted gather (`engram_board`), by the addresses of the very ids and
table buffers the entry was called with. A call with nothing posted for it is refused (it
could not know which device the rows belong on).
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dsv41.graph.ops import ENGRAM_ROWS_FUNC
from dsv41.runtime.backends.device import Device
from dsv41.runtime.backends.tensors import to_torch, to_tvm
from dsv41.runtime.backends.threads import lower_helper_priority


@dataclass(frozen=True)
class EngramTable:
    """One Engram layer's host tables, as the entry was bound to them (`Artifact.bind`)."""

    slot: int  # the layer's index in `engram_layer_ids` (its column of the hash ids)
    codes: torch.Tensor  # uint8 (rows, ed) E4M3, host
    scales: torch.Tensor  # uint8 (rows, ed/32) E8M0, host


@dataclass
class EngramTiming:
    """What the Engram gathers of the calls since the last reset cost: seconds gathering (on the
    prefetch thread, or inside the entry with prefetch off), seconds the entry waited for rows,
    rows and bytes fetched, entry calls."""

    gather_s: float = 0.0
    wait_s: float = 0.0
    rows: int = 0
    bytes: int = 0
    calls: int = 0

    @property
    def hidden_s(self) -> float:
        """The part of the gathers the entry did not wait for (ran beside its blocks)."""
        return max(0.0, self.gather_s - self.wait_s)

    def to_dict(self) -> dict:
        return {"gather_ms": round(self.gather_s * 1e3, 4), "wait_ms": round(self.wait_s * 1e3, 4),
                "hidden_ms": round(self.hidden_s * 1e3, 4), "rows": self.rows,
                "bytes": self.bytes, "calls": self.calls}


@dataclass
class _Gathered:
    codes: torch.Tensor  # (b, s, cols, ed) on the entry's device
    scales: torch.Tensor  # (b, s, cols, ed/32)
    seconds: float  # spent gathering (and staging)
    ready: object | None = None  # a torch.cuda.Event recorded after the device copies


class _Job:
    """One posted gather: run ahead on the prefetch thread (`future`) or when claimed."""

    def __init__(self, owner: EngramPrefetcher, ids: torch.Tensor, table: EngramTable):
        self.owner, self.ids, self.table = owner, ids, table
        self.future: Future | None = None

    def run(self) -> _Gathered:
        return self.owner.gather(self.ids, self.table)


class EngramBoard:
    """The posted gathers by (ids address, slot, codes table address); `claim` is the body of
    `ENGRAM_ROWS_FUNC`."""

    def __init__(self):
        self._jobs: dict[tuple[int, int, int], _Job] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(ids: torch.Tensor, slot: int, codes: torch.Tensor) -> tuple[int, int, int]:
        return ids.data_ptr(), int(slot), codes.data_ptr()

    def post(self, key: tuple[int, int, int], job: _Job) -> None:
        with self._lock:
            if key in self._jobs:
                raise RuntimeError("Two Engram gathers posted for the same ids and table: one "
                                   "entry call at a time per ids buffer.")
            self._jobs[key] = job

    def drop(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._jobs.pop(k, None)

    def claim(self, hash_ids, slot, codes, scales):
        """(tvm tensors and the slot) -> (codes rows, scales rows) as tvm tensors on the entry's
        device; RuntimeError when nothing was posted for these buffers."""
        key = self.key(to_torch(hash_ids), slot, to_torch(codes))
        with self._lock:
            job = self._jobs.pop(key, None)
        if job is None:
            raise RuntimeError(f"{ENGRAM_ROWS_FUNC}: no gather was posted for these Engram ids "
                               "and table; entries reading host-resident Engram tables run "
                               "through `runtime.artifact.Artifact.call`.")
        return job.owner.hand_over(job)


@functools.cache
def engram_board() -> EngramBoard:
    """The process's board, with `ENGRAM_ROWS_FUNC` registered to it (the first time)."""
    import tvm_ffi  # order: tvm loads only after disco's libraries (disco.load_disco)

    board = EngramBoard()
    tvm_ffi.register_global_func(ENGRAM_ROWS_FUNC, board.claim, override=True)
    return board


class EngramPrefetcher:
    """Gathers of one artifact's host tables onto its device: posted before an entry call,
    ahead on one background thread when `prefetch` (else inside the entry), timed."""

    def __init__(self, device: Device, *, prefetch: bool = True):
        self.device, self.prefetch = device, prefetch
        self.timing = EngramTiming()
        self._board = engram_board()
        self._pool: ThreadPoolExecutor | None = None
        self._stream = None  # the side stream of the device copies (CUDA)
        self._lock = threading.Lock()

    def post(self, ids: torch.Tensor, tables: tuple[EngramTable, ...]) -> tuple:
        """Post one gather per table for the entry call about to run on the host int64 ids
        (b, s, E, cols) (the buffer the entry receives); returns the keys, to `finish` after
        the call."""
        keys = []
        try:
            for table in tables:
                key = self._board.key(ids, table.slot, table.codes)
                job = _Job(self, ids, table)
                self._board.post(key, job)
                keys.append(key)
                if self.prefetch:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsv41-engram",
                                                        initializer=lower_helper_priority)
                    job.future = self._pool.submit(job.run)
        except BaseException:
            self.finish(keys)
            raise
        with self._lock:
            self.timing.calls += 1
        return tuple(keys)

    def finish(self, keys) -> None:
        """After the entry call: drop what it did not claim (it failed before the layer)."""
        self._board.drop(keys)

    def gather(self, ids: torch.Tensor, table: EngramTable) -> _Gathered:
        """The rows of `table` at the slot's ids, on this device."""
        t = time.perf_counter()
        own = ids[:, :, table.slot]  # (b, s, cols)
        flat, lead = own.reshape(-1), own.shape
        pin = self.device.is_cuda
        rows = []
        for src in (table.codes, table.scales):
            out = torch.empty((flat.numel(), src.size(1)), dtype=src.dtype, pin_memory=pin)
            torch.index_select(src, 0, flat, out=out)
            rows.append(out.view(*lead, src.size(1)))
        ready = None
        if pin:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device.torch)
            with torch.cuda.stream(self._stream):
                rows = [r.to(self.device.torch, non_blocking=True) for r in rows]
                ready = torch.cuda.Event()
                ready.record(self._stream)
        return _Gathered(rows[0], rows[1], time.perf_counter() - t, ready)

    def hand_over(self, job: _Job):
        """The claimed job's rows, as tvm tensors (waiting for them, or gathering them now)."""
        t = time.perf_counter()
        got = job.future.result() if job.future is not None else job.run()
        if got.ready is not None:
            got.ready.synchronize()  # the device copies are done (they ran beside the blocks)
            compute = torch.cuda.current_stream(self.device.torch)  # the entry's kernels read
            got.codes.record_stream(compute)  # them there: no reuse of their memory before
            got.scales.record_stream(compute)
        waited = time.perf_counter() - t
        with self._lock:
            self.timing.gather_s += got.seconds
            self.timing.wait_s += waited
            self.timing.rows += got.codes.numel() // got.codes.size(-1)
            self.timing.bytes += got.codes.numel() + got.scales.numel()
        return to_tvm(got.codes), to_tvm(got.scales)

    def reset_timing(self) -> EngramTiming:
        """The timing so far, and a fresh one from here."""
        with self._lock:
            done, self.timing = self.timing, EngramTiming()
        return done
