"""The one interface of the tiers a runtime keeps state in: the SSD block store
(`kv_store.KVStore`, and the `BlockWriter` every engine read and write goes through), the
host-DRAM snapshot pool (`snapshot_pool.SnapshotPool`) and the shared Redis pool
(`redis_pool.RedisSnapshotPool`). Each stores named arrays under a 64-hex (SSD) or session key
and answers with its own entry (a block's arrays, or a `Snapshot`) and its own stats record;
the calls and their arguments are the same (what the engine's `TurnPlanner` and `Engine.close`
call of every tier).

Two arguments serve the engine's reads and snapshots:
- `check` (get): the reader's own test of the arrays it is about to use (their names, shapes and
  dtypes for this engine). A well-formed entry that fails it (ValueError) is handled as a
  damaged one: not served, counted, deleted, so it cannot fail every later read until its TTL.
- `holder` (put, drop): who stands at a snapshot (a session's uid). Several sessions, in any
  process, may stand at one state; the pools keep one hold per holder, and a drop with a holder
  lets go of that hold only: the snapshot goes when the last holder lets go (or by its TTL or
  the budget). A session never deletes a snapshot another session holds. Blocks take no holder
  (they are shared by every sequence with the prefix and never dropped per session).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

Entry = TypeVar("Entry", covariant=True)
Stats = TypeVar("Stats", covariant=True)
NO_META: Mapping[str, Any] = MappingProxyType({})  # a put without metadata (a KV block has none)
ArrayCheck = Callable[[dict[str, np.ndarray]], None]  # raises ValueError on arrays it cannot use


@runtime_checkable
class StorageTier(Protocol[Entry, Stats]):
    def get(self, key: str, *, check: ArrayCheck | None = None) -> Entry | None:
        """The stored entry (fresh, writable arrays), or None: absent, expired, or found bad
        (by the tier's own checks or by `check`: deleted and counted)."""
        ...

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """Store a copy (held by `holder`, when given); False when the tier refuses it (no
        room, unreachable, ...)."""
        ...

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        """Forget the entry; True when it was present and is now gone. With `holder`: only
        that holder's hold goes, and the entry with it when no other holder remains."""
        ...

    def contains(self, key: str) -> bool:
        """Whether an entry is stored under `key` (a cheap check before `get`; `get` may still
        find it bad or gone)."""
        ...

    def close(self) -> None:
        """Let the tier's resources go (files, threads, connections); it serves nothing after."""
        ...

    def stats(self) -> Stats:
        """The tier's counters and occupancy now."""
        ...
