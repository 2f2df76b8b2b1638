"""The host-DRAM snapshot pool: per-session local state (the encoder's window rings and the
compressors' tails at the end of a turn) kept for a short TTL under a byte budget, so the next
turn of a session resumes without re-encoding its recent tokens.

Choices, stated once:
- Bytes are the sum of the snapshot arrays' `nbytes`; keys and metadata are not counted.
- TTL runs from the put: a hit refreshes LRU recency but not the TTL, so a snapshot never
  outlives `ttl_s` (a session that keeps resuming writes a fresh snapshot every turn anyway).
- Copies: `put` stores private, read-only copies of the arrays (and a deep copy of `meta`), and
  `get` returns fresh writable copies, so neither side can change the other's buffers.
- Size: by default 10% of the host's memory (`default_budget_bytes`, as the article provisions
  the pool); an explicit budget overrides it.
- Expiry on a schedule: every call (put, get, contains, stats) first removes every expired
  snapshot when `sweep_interval_s` has passed on the pool's clock since the last sweep, so
  expired state is freed while the pool is in use, not only when a later put needs room.
- Recency lives in the backend (`keys()` is least recently used first, `touch` marks use), so a
  shared backend such as Redis can keep one LRU order for all processes that use it.
- Holds: a put with a `holder` (a session's uid) records that holder at the snapshot; a drop with
  a holder lets go of that hold only, and removes the snapshot when no holder remains. Two
  sessions at one state share one snapshot, and one moving on never removes the other's.
- `get(key, check=...)`: a snapshot whose arrays the reader's check refuses is removed and
  counted (`corrupted`), a miss, like any damaged entry.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dsv41.runtime.tiers.base import NO_META, ArrayCheck


@dataclass(frozen=True, slots=True)
class Snapshot:
    key: str  # the session (or session + branch) the state belongs to
    arrays: dict[str, np.ndarray]  # named state tensors, e.g. window rings, compressor tails
    meta: dict[str, Any]  # small JSON-like facts the resume needs (position, turn, ...)
    created_at: float  # pool clock at put; the TTL runs from here
    nbytes: int  # sum of arrays' nbytes; what the budget counts


@runtime_checkable
class SnapshotBackend(Protocol):
    """Where snapshots live. A backend stores what it is given; the pool does the copying, the
    TTL and the budget. Implement this for Redis (hash per snapshot + a sorted set for recency)."""

    def get(self, key: str) -> Snapshot | None:
        """The stored snapshot, without changing recency."""

    def put(self, snapshot: Snapshot) -> None:
        """Insert or replace; the snapshot becomes most recently used."""

    def delete(self, key: str) -> bool:
        """Remove; True when the key was present."""

    def touch(self, key: str) -> None:
        """Make a present key most recently used."""

    def keys(self) -> list[str]:
        """All keys, least recently used first."""

    def bytes(self) -> int:
        """Sum of the stored snapshots' nbytes."""


class InProcessBackend:
    """A dict in this process, ordered by recency."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Snapshot] = OrderedDict()  # least recently used first
        self._bytes = 0

    def get(self, key: str) -> Snapshot | None:
        return self._items.get(key)

    def put(self, snapshot: Snapshot) -> None:
        self.delete(snapshot.key)
        self._items[snapshot.key] = snapshot
        self._bytes += snapshot.nbytes

    def delete(self, key: str) -> bool:
        old = self._items.pop(key, None)
        if old is None:
            return False
        self._bytes -= old.nbytes
        return True

    def touch(self, key: str) -> None:
        self._items.move_to_end(key)

    def keys(self) -> list[str]:
        return list(self._items)

    def bytes(self) -> int:
        return self._bytes


@dataclass(frozen=True, slots=True)
class SnapshotPoolStats:
    entries: int  # snapshots stored now
    bytes: int  # sum of their arrays' nbytes
    budget: int  # budget_bytes
    hits: int  # get() that returned a snapshot
    misses: int  # get() that returned None, expired ones included
    expired: int  # snapshots removed because their TTL had passed (on get, by a sweep)
    evictions: int  # live snapshots removed, least recently used first, to make room
    refused: int  # put() of a snapshot bigger than the whole budget
    corrupted: int = 0  # snapshots the reader's check refused (removed; each also a miss)


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    expired: int = 0
    evictions: int = 0
    refused: int = 0
    corrupted: int = 0


HOST_MEMORY_SHARE = 0.10  # of the host's memory, the pool's default budget (the article's)


def default_budget_bytes() -> int:
    """10% of this host's physical memory (POSIX sysconf: a `dsv41 bundle`'s runtime has no
    psutil)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * HOST_MEMORY_SHARE)


class SnapshotPool:
    """Snapshots under a TTL and a byte budget.

    Making room for a put: first every expired snapshot is removed, then live ones least
    recently used first until the new one fits. A put of a present key replaces it (its old
    bytes are freed first) and restarts its TTL. Expired entries are also removed by the sweep
    every call runs once `sweep_interval_s` has passed since the last one, and by `sweep()`.
    `budget_bytes=None`: `default_budget_bytes()`.
    """

    def __init__(self, backend: SnapshotBackend | None = None, *, budget_bytes: int | None = None,
                 ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 sweep_interval_s: float = 1.0):
        if budget_bytes is None:
            budget_bytes = default_budget_bytes()
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int, got {budget_bytes!r}.")
        if not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}.")
        if not isinstance(sweep_interval_s, int | float) or isinstance(sweep_interval_s, bool) \
                or not math.isfinite(sweep_interval_s) or sweep_interval_s < 0:
            raise ValueError(f"sweep_interval_s must be a finite number >= 0, got "
                             f"{sweep_interval_s!r}.")
        if not callable(clock):
            raise ValueError("clock must be a callable returning seconds.")
        self.backend: SnapshotBackend = InProcessBackend() if backend is None else backend
        self.budget_bytes = budget_bytes
        self.ttl_s = float(ttl_s)
        self.clock = clock
        self.sweep_interval_s = float(sweep_interval_s)
        self._last_sweep = -math.inf
        self._n = _Counters()
        self._holders: dict[str, set[str]] = {}  # key -> the holders standing at it

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """Store a copy (held by `holder`, besides any holders it has); False (and counted)
        when it is bigger than the whole budget."""
        nbytes = check_put(key, arrays, meta)
        check_holder(holder)
        self._scheduled_sweep()
        if nbytes > self.budget_bytes:
            self._n.refused += 1
            return False
        self.backend.delete(key)
        now = self.clock()
        if self.backend.bytes() + nbytes > self.budget_bytes:
            self.sweep()
        for victim in self.backend.keys():
            if self.backend.bytes() + nbytes <= self.budget_bytes:
                break
            self._remove(victim)
            self._n.evictions += 1
        assert self.backend.bytes() + nbytes <= self.budget_bytes, "eviction did not make room"
        stored = {name: _frozen_copy(a) for name, a in arrays.items()}
        self.backend.put(Snapshot(key, stored, copy.deepcopy(dict(meta)), now, nbytes))
        if holder is not None:
            self._holders.setdefault(key, set()).add(holder)
        return True

    def get(self, key: str, *, check: ArrayCheck | None = None) -> Snapshot | None:
        """A copy of the snapshot, or None when absent, expired or refused by `check` (an
        expired or refused one is removed)."""
        _check_key(key)
        self._scheduled_sweep()
        snap = self.backend.get(key)
        if snap is None:
            self._n.misses += 1
            return None
        if self._is_expired(snap, self.clock()):
            self._remove(key)
            self._n.expired += 1
            self._n.misses += 1
            return None
        arrays = {name: np.array(a, copy=True) for name, a in snap.arrays.items()}
        if check is not None:
            try:
                check(arrays)
            except ValueError:
                self._remove(key)
                self._n.corrupted += 1
                self._n.misses += 1
                return None
        self.backend.touch(key)
        self._n.hits += 1
        return Snapshot(snap.key, arrays, copy.deepcopy(snap.meta), snap.created_at, snap.nbytes)

    def contains(self, key: str) -> bool:
        """Whether a live snapshot is stored under `key` (no copy, no counter, no recency
        change; an expired one is not live)."""
        _check_key(key)
        self._scheduled_sweep()
        snap = self.backend.get(key)
        return snap is not None and not self._is_expired(snap, self.clock())

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        """Forget a snapshot; True when it was present and is now gone. With `holder`: that
        holder lets go, and the snapshot goes only when it was its last holder."""
        _check_key(key)
        check_holder(holder)
        if holder is not None:
            holders = self._holders.get(key)
            if holders is None or holder not in holders:
                return False  # not this holder's: never removed by it
            holders.discard(holder)
            if holders:
                return False
        return self._remove(key)

    def sweep(self) -> int:
        """Remove every expired snapshot; how many were removed."""
        now, n = self.clock(), 0
        self._last_sweep = now
        for key in self.backend.keys():
            snap = self.backend.get(key)
            if snap is not None and self._is_expired(snap, now):
                self._remove(key)
                n += 1
        self._n.expired += n
        return n

    def close(self) -> None:
        """Nothing to let go (the pool lives in this process); the Redis pool's counterpart
        closes its connections."""

    def stats(self) -> SnapshotPoolStats:
        self._scheduled_sweep()
        return SnapshotPoolStats(entries=len(self.backend.keys()), bytes=self.backend.bytes(),
                                 budget=self.budget_bytes, hits=self._n.hits,
                                 misses=self._n.misses, expired=self._n.expired,
                                 evictions=self._n.evictions, refused=self._n.refused,
                                 corrupted=self._n.corrupted)

    def _scheduled_sweep(self) -> None:
        if self.clock() - self._last_sweep >= self.sweep_interval_s:
            self.sweep()

    def _is_expired(self, snap: Snapshot, now: float) -> bool:
        return now - snap.created_at >= self.ttl_s

    def _remove(self, key: str) -> bool:
        """The snapshot and its holds gone; True when it was present."""
        self._holders.pop(key, None)
        return self.backend.delete(key)


def check_put(key: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> int:
    """A put's arguments checked (ValueError otherwise); the snapshot's nbytes."""
    _check_key(key)
    _check_arrays(arrays)
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}.")
    return sum(a.nbytes for a in arrays.values())


def check_key(key: str) -> None:
    """A snapshot key is a non-empty string (ValueError otherwise)."""
    _check_key(key)


def check_holder(holder: str | None) -> None:
    """A holder is None or a non-empty string (ValueError otherwise)."""
    if holder is not None and (not isinstance(holder, str) or not holder):
        raise ValueError(f"A snapshot holder must be a non-empty string, got {holder!r}.")


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    out = np.array(a, copy=True, order="C")
    out.flags.writeable = False
    return out


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"A snapshot key must be a non-empty string, got {key!r}.")


def _check_arrays(arrays: Mapping[str, np.ndarray]) -> None:
    if not isinstance(arrays, Mapping):
        raise ValueError(f"A snapshot must be a mapping of name to numpy array, got "
                         f"{type(arrays).__name__}.")
    for name, a in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"Array names must be non-empty strings, got {name!r}.")
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            raise ValueError(f"Array {name!r} must be a numpy array of plain values, got "
                             f"{type(a).__name__}.")
