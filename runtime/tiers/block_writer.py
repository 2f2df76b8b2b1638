"""The SSD store's background writer: a turn hands its blocks over and goes on; the files are
written on one thread, and a block still queued is served from the queue (`BlockWriter`)."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsv41.runtime.tiers.base import NO_META, ArrayCheck
from dsv41.runtime.tiers.ssd_store import (
    KVStore,
    KVStoreStats,
    check_arrays,
    check_key,
    check_no_meta,
)


@dataclass(frozen=True, slots=True)
class BlockWriterStats:
    queued: int  # blocks waiting for (or in) their write now
    submitted: int  # submit() calls that queued a block (a key already queued is not)
    written: int  # queued blocks the store accepted (written, or already present)
    refused: int  # queued blocks the store refused (full of young entries)
    failed: int  # queued blocks whose write raised (the block is dropped; the store is intact)
    served_queued: int  # get() answered from the queue
    dropped_queued: int = 0  # drop() that removed a block still queued (never written)


class BlockWriter:
    """Writes a store's blocks on a background thread, so a turn does not wait for its files.

    `submit` queues a block (its arrays are the caller's own copies, kept read-only); one thread
    writes the queue in submission order through `KVStore.put` (checksummed, fsynced, renamed),
    so a crash loses at most the blocks still queued and never exposes a partial file (a
    temporary file it leaves is removed by the next scan). Reads go through the writer: a block
    still queued is served from the queue, and `contains` / `lookup_prefix` count queued
    blocks as stored. The store is touched only under one lock (it is not thread-safe), so a
    read waits at most for the one block being written. `drain()` waits until the queue is
    empty; `close()` drains and stops the thread. With more than `max_queued` blocks queued,
    `submit` waits for room.
    """

    def __init__(self, store: KVStore, *, max_queued: int = 4096,
                 on_start: Callable[[], None] | None = None):
        """on_start: run first on the writer's thread (the engine lowers its priority there,
        `runtime.backends.threads.lower_helper_priority`, so writes never take a core from a
        step)."""
        if not isinstance(max_queued, int) or isinstance(max_queued, bool) or max_queued < 1:
            raise ValueError(f"max_queued must be a positive int, got {max_queued!r}.")
        self.store = store
        self.max_queued = max_queued
        self._queue: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()  # guards the store
        self._cond = threading.Condition()  # guards the queue and counters
        self._closed = False
        self._n = {"submitted": 0, "written": 0, "refused": 0, "failed": 0, "served_queued": 0,
                   "dropped_queued": 0}
        self._writing: str | None = None  # the key the thread is writing now
        self.last_error: BaseException | None = None
        self._on_start = on_start
        self._thread = threading.Thread(target=self._run, name="dsv41-block-writer", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))  # a normal exit drains the queue

    def submit(self, key: str, arrays: Mapping[str, np.ndarray]) -> bool:
        """Queue a block; False when the key is already queued (a stored key is only
        touched when its turn comes)."""
        check_key(key)
        check_arrays(arrays)
        frozen = {}
        for name, a in arrays.items():
            a = np.array(a, copy=True, order="C")
            a.flags.writeable = False
            frozen[name] = a
        with self._cond:
            if self._closed:
                raise ValueError("This block writer is closed.")
            if key in self._queue:
                return False
            while len(self._queue) >= self.max_queued:
                self._cond.wait()
            self._queue[key] = frozen
            self._n["submitted"] += 1
            self._cond.notify_all()
        return True

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """The tier interface's put: `submit`, True once the block is queued (now or already);
        whether the store then keeps it is counted in `stats` (written / refused / failed).
        A block is arrays only: `meta` and `holder` must be empty."""
        check_no_meta(meta, holder)
        self.submit(key, arrays)
        return True

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        """Forget a block, queued or stored (`KVStore.drop`); True when it was either. A block
        being written when called is dropped once its write ends. No holders (None)."""
        check_key(key)
        check_no_meta(NO_META, holder)
        with self._cond:
            while self._writing == key:
                self._cond.wait()
            queued = self._queue.pop(key, None) is not None
            if queued:
                self._n["dropped_queued"] += 1
                self._cond.notify_all()
        with self._lock:
            stored = self.store.drop(key)
        return queued or stored

    def get(self, key: str, *, check: ArrayCheck | None = None) -> dict[str, np.ndarray] | None:
        """The block's arrays (fresh, writable) from the queue or the store, or None. `check`
        as for `KVStore.get`, on a stored block (a queued one is this process's own)."""
        check_key(key)
        with self._cond:
            queued = self._queue.get(key)
            if queued is not None:
                self._n["served_queued"] += 1
                return {name: np.array(a, copy=True) for name, a in queued.items()}
        with self._lock:
            return self.store.get(key, check=check)

    def contains(self, key: str) -> bool:
        check_key(key)
        with self._cond:
            if key in self._queue:
                return True
        with self._lock:
            return self.store.contains(key)

    def lookup_prefix(self, keys: Iterable[str]) -> int:
        """How many leading keys are queued or stored (no payload read, no LRU change)."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        with self._cond:
            queued = set(self._queue)
        n = 0
        with self._lock:
            for key in keys:
                if key not in queued and not self.store.contains(key):
                    break
                n += 1
        return n

    def drain(self) -> None:
        """Wait until every queued block is written (or refused, or failed)."""
        with self._cond:
            while self._queue:
                self._cond.wait()

    def close(self) -> None:
        """Drain, then stop the thread; later submits are refused with ValueError. Runs at
        interpreter exit too (a writer nobody closed still drains before the process ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def stats(self) -> BlockWriterStats:
        with self._cond:
            return BlockWriterStats(queued=len(self._queue), **self._n)

    def store_stats(self) -> KVStoreStats:
        """The store's stats, read while no write is in progress."""
        with self._lock:
            return self.store.stats()

    def _run(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                key, arrays = next(iter(self._queue.items()))
                self._writing = key
            outcome = "failed"
            try:
                with self._lock:
                    outcome = "written" if self.store.put(key, arrays) else "refused"
            except Exception as e:  # noqa: BLE001 - the block is dropped, the writer goes on
                self.last_error = e
            with self._cond:
                del self._queue[key]
                self._writing = None
                self._n[outcome] += 1
                self._cond.notify_all()


def _close_at_exit(ref: weakref.ref) -> None:
    writer = ref()
    if writer is not None:
        writer.close()
