"""The one interface of the tiers a runtime keeps state in: the SSD block store
(`kv_store.KVStore`, and the `BlockWriter` every engine read and write goes through), the
host-DRAM snapshot pool (`snapshot_pool.SnapshotPool`) and the shared Redis pool
(`redis_pool.RedisSnapshotPool`). Each stores named arrays under a 64-hex (SSD) or session key
and answers with its own entry (a block's arrays, or a `Snapshot`) and its own stats record;
the calls and their arguments are the same (what the engine's `TurnPlanner` and `Engine.close`
call of every tier).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

Entry = TypeVar("Entry", covariant=True)
Stats = TypeVar("Stats", covariant=True)
NO_META: Mapping[str, Any] = MappingProxyType({})  # a put without metadata (a KV block has none)


@runtime_checkable
class StorageTier(Protocol[Entry, Stats]):
    def get(self, key: str) -> Entry | None:
        """The stored entry (fresh, writable arrays), or None: absent, expired, or found bad."""
        ...

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META) -> bool:
        """Store a copy; False when the tier refuses it (no room, unreachable, ...)."""
        ...

    def drop(self, key: str) -> bool:
        """Forget the entry; True when it was present."""
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
