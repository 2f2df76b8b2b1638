"""The runtime-cache prefix tier: complete prompt blocks of running and recently finished
requests, kept in the runtime cache's memory (the device the caches live on) under the same
chained block keys the SSD store uses, so a new request with the same prefix restores them
instead of prefilling them (issue 42, the first tier of the article's picture).

Choices, stated once:
- One copy. Each session's global stores are contiguous (compiled gathers read them directly),
  so a block cannot be shared by reference between two caches: `put` keeps its own copy of a
  block's rows (a device-to-device copy at the end of a prefill), and a restore copies them
  into the new request's cache (one more device copy; the engine's `state.restore_block_rows`).
  A stored block is never written after its put; readers get the stored tensors and must only
  copy from them.
- Bytes are the sum of the stored tensors' `nbytes` (keys not counted). They count against the
  runtime cache's budget (`Engine.runtime_bytes`): the tier lives in the room the live caches
  leave. `room()` says how many bytes that is now; a put evicts what it must to fit in it, and
  a live cache that needs room takes it from here first (`evict_bytes`).
- Eviction order: least recently used first, where a put, a `get` and a `touch` are uses (the
  order `keys()` lists). A block whose chain predecessor is evicted stays until its own turn:
  `lookup_prefix` stops at the first missing key, so it is served only after a new put of the
  predecessor.
- A put bigger than `room()` with the tier empty is refused and counted (`refused`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsv41.runtime.tiers.base import NO_META, ArrayCheck


@dataclass(frozen=True, slots=True)
class RuntimeBlocksStats:
    entries: int  # blocks held now
    bytes: int  # sum of their tensors' nbytes (part of the runtime cache's bytes)
    room: int  # bytes the tier may hold now (the budget less the live caches)
    hits: int  # get() that returned a block
    misses: int  # get() that returned None
    stored: int  # put() that stored a new block
    evictions: int  # blocks removed, least recently used first, to make room
    refused: int  # put() of a block that did not fit even in an empty tier


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evictions: int = 0
    refused: int = 0


def _nbytes(rows: Mapping[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in rows.values())


class RuntimeBlocks:
    """Blocks of rows by chained block key, LRU within `room()` bytes (see the module
    docstring). Driven from the engine's one stepping thread (no lock)."""

    def __init__(self, room: Callable[[], int]):
        self._room = room  # bytes the tier may hold now
        self._items: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # LRU first
        self._bytes = 0
        self._n = _Counters()

    def __len__(self) -> int:
        return len(self._items)

    def nbytes(self) -> int:
        return self._bytes

    def keys(self) -> list[str]:
        """The keys held, least recently used first (the eviction order)."""
        return list(self._items)

    def contains(self, key: str) -> bool:
        return key in self._items

    def lookup_prefix(self, keys: Iterable[str]) -> int:
        """How many leading keys are held (no LRU change)."""
        n = 0
        for key in keys:
            if key not in self._items:
                break
            n += 1
        return n

    def get(self, key: str, *, check: ArrayCheck | None = None) -> dict[str, torch.Tensor] | None:
        """The block's stored rows (copy from them, never into them), now most recently used;
        None when absent. `check` is not used: a block here is this engine's own rows."""
        rows = self._items.get(key)
        if rows is None:
            self._n.misses += 1
            return None
        self._items.move_to_end(key)
        self._n.hits += 1
        return rows

    def touch(self, key: str) -> None:
        """A held block becomes most recently used (a prefill that has it again)."""
        if key in self._items:
            self._items.move_to_end(key)

    def put(
        self,
        key: str,
        rows: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] = NO_META,
        *,
        holder: str | None = None,
    ) -> bool:
        """Hold `rows` (the caller's own copy, kept as given) under `key`, most recently used,
        evicting least recently used blocks until it fits in `room()`; a key already held is
        only touched. False when it does not fit even alone (counted). A block takes no
        metadata and no holder."""
        if meta or holder is not None:
            raise ValueError("A runtime block is rows only: no metadata, no holder.")
        if key in self._items:
            self.touch(key)
            return True
        size = _nbytes(rows)
        if size > self._room():
            self._n.refused += 1
            return False
        self.evict_bytes(self._bytes + size - self._room())
        self._items[key] = dict(rows)
        self._bytes += size
        self._n.stored += 1
        return True

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        rows = self._items.pop(key, None)
        if rows is None:
            return False
        self._bytes -= _nbytes(rows)
        return True

    def evict_bytes(self, nbytes: int) -> list[str]:
        """Evict least recently used blocks until `nbytes` are freed (or none is left);
        returns the keys evicted, in order."""
        out = []
        freed = 0
        while freed < nbytes and self._items:
            key, rows = self._items.popitem(last=False)
            size = _nbytes(rows)
            self._bytes -= size
            freed += size
            out.append(key)
        self._n.evictions += len(out)
        return out

    def close(self) -> None:
        """Let every block go."""
        self._items.clear()
        self._bytes = 0

    def stats(self) -> RuntimeBlocksStats:
        return RuntimeBlocksStats(
            entries=len(self._items),
            bytes=self._bytes,
            room=max(0, self._room()),
            hits=self._n.hits,
            misses=self._n.misses,
            stored=self._n.stored,
            evictions=self._n.evictions,
            refused=self._n.refused,
        )
