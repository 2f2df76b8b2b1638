"""The turn planner: the one place that knows the tiers' order. It decides where a turn's cache
starts (`restore`) and what goes to the tiers at the turn's end (`offload`), and answers with a
small frozen result (`TurnPlan`, `Offloaded`), never tuples.

The restore order is `TurnPlanner.levels`, walked first to last (the first that serves wins):

| level | holds | serves when |
|---|---|---|
| live | the session's own cache | the runtime cache still holds it |
| DRAM snapshot | a pool snapshot of the local state | blocks + snapshot of a prefix |
| SSD snapshot (exact mode) | an SSD record of the whole state | blocks + record of a prefix |
| runtime prefix (CED mode, `runtime_prefix`) | blocks in the runtime cache | as SSD prefix |
| SSD prefix (CED mode) | the blocks alone | encoder bounded replay from their end |
| cold | nothing | always (the whole sequence prefilled) |

Consecutive state levels are searched together, longest prefix first and at one length in their
order (the latest state within the block after the stored blocks wins, whichever tier holds
it); so are consecutive block levels (the longest run of blocks wins, the runtime tier's at a
tie: a device copy instead of a read from the SSD). Without an SSD store only live, runtime
prefix and cold remain: sessions stay live. A new level is one more entry of `levels`.

The runtime prefix tier is filled at the end of every prefill (`keep_prompt_blocks`), so a
request admitted after another's prefill reuses its prompt blocks while that one still decodes,
and after it finished until they are evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from itertools import takewhile

import torch

from dsv41.graph.cache import ModelCache
from dsv41.graph.model import Model
from dsv41.runtime.engine.images import SessionImage, key_tokens
from dsv41.runtime.engine.keys import TierKeys
from dsv41.runtime.engine.options import EngineOptions
from dsv41.runtime.engine.records import StateKind, Tier
from dsv41.runtime.engine.state import (
    block_arrays,
    block_rows,
    check_block,
    check_snapshot,
    index_owner_at,
    restore_block_rows,
    restore_blocks,
    restore_snapshot,
    snapshot_arrays,
)
from dsv41.runtime.engine.transfer import Transfers
from dsv41.runtime.tiers.base import StorageTier
from dsv41.runtime.tiers.block_writer import BlockWriter
from dsv41.runtime.tiers.dram_pool import Snapshot
from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocks


class Holds(Enum):
    """What a level of the restore order holds of a sequence."""

    CACHE = "cache"  # the session's live cache
    STATE = "state"  # a state record after a prefix (with the SSD blocks before it)
    BLOCKS = "blocks"  # blocks of a prefix (SSD or runtime tier), no state
    NOTHING = "nothing"  # cold


@dataclass(frozen=True)
class Level:
    """One level of the restore order."""

    tier: Tier  # what a turn it serves reports
    holds: Holds
    source: StorageTier | None = None  # where its records live (STATE and BLOCKS levels)
    kind: StateKind | None = None  # the kind its state records are keyed by (STATE levels)


@dataclass(frozen=True)
class TurnPlan:
    """Where a turn starts: the cache, the tier that gave it, how many leading tokens of the
    turn's sequence it holds (the prefill starts there), and the blocks read for it (SSD or
    runtime tier); `stored_blocks`: how many of them the SSD store is known to hold (None: all
    of them), from where the turn's end writes its blocks."""

    cache: ModelCache
    tier: Tier
    cached: int
    keys: tuple[str, ...]
    stored_blocks: int | None = None


@dataclass(frozen=True)
class Offloaded:
    """What a turn's end left in the tiers: the sequence's complete blocks queued for the SSD
    store (`stored_blocks`: how many the store now holds), and the snapshot's pool key."""

    stored_blocks: int
    snapshot: str


def tier_levels(options: EngineOptions, pool: StorageTier, blocks: StorageTier | None,
                runtime: RuntimeBlocks | None = None) -> tuple[Level, ...]:
    """The restore order of an engine with these options and tiers (the table above);
    `runtime`: the runtime prefix tier (None: off)."""
    levels = [Level(Tier.LIVE, Holds.CACHE)]
    if blocks is not None:  # without an SSD store nothing outside a live session holds state
        levels.append(Level(Tier.SNAPSHOT, Holds.STATE, pool, StateKind.SNAPSHOT))
        if options.exact:
            levels.append(Level(Tier.SNAPSHOT_SSD, Holds.STATE, blocks, StateKind.STATE))
    if runtime is not None and not options.exact:  # (EngineOptions refuses the two together)
        levels.append(Level(Tier.RUNTIME_PREFIX, Holds.BLOCKS, runtime))
    if blocks is not None and not options.exact:  # no bounded replay: blocks do not restore
        levels.append(Level(Tier.PREFIX, Holds.BLOCKS, blocks))
    levels.append(Level(Tier.COLD, Holds.NOTHING))
    return tuple(levels)


def entry_arrays(entry: Snapshot | dict) -> dict:
    """A state record's arrays, whichever tier answered (a pool's `Snapshot`, an SSD dict)."""
    return entry.arrays if isinstance(entry, Snapshot) else entry


class TurnPlanner:
    """Plans each turn over the engine's tiers (`levels`). `blocks`: the SSD store's writer
    (None: no SSD store); `new_cache`: an empty one-sequence cache within the engine's budget;
    `ring_layers`: the rings a snapshot holds (`state.snapshot_ring_layers`)."""

    def __init__(self, model: Model, options: EngineOptions, keys: TierKeys,
                 pool: StorageTier, blocks: BlockWriter | None,
                 new_cache: Callable[[], ModelCache], ring_layers: Sequence[int],
                 runtime: RuntimeBlocks | None = None):
        self.model, self.options, self.keys = model, options, keys
        self.pool, self.blocks, self.new_cache = pool, blocks, new_cache
        self.ring_layers = ring_layers
        self.runtime = runtime  # the runtime prefix tier (None: off)
        self.levels = tier_levels(options, pool, blocks, runtime)

    @property
    def offloads(self) -> bool:
        """Whether a turn's end moves the session's state to the tiers (and lets its cache
        go): with an SSD store."""
        return self.blocks is not None

    # ---- the turn's start -----------------------------------------------------------------------

    def restore(self, keyed: Sequence[int], *, live: ModelCache | None, live_tokens: int,
                resumed: bool) -> TurnPlan:
        """The cache a turn over `keyed` (the tokens the keys hash: image spans named by
        content, `images.key_tokens`) starts from. Any session's records serve: the longest run
        of stored blocks of `keyed[:-1]` (the last token always runs: its logits start the
        turn), then the latest state within the block after them. `live`: the session's cache,
        holding `live_tokens`; `resumed`: the session has a history (which a cold start without
        an SSD store cannot have)."""
        keys: list[str] | None = None
        for i, level in enumerate(self.levels):
            if level.holds is Holds.CACHE:
                if live is not None:
                    return TurnPlan(live, Tier.LIVE, live_tokens, ())
                continue
            if keys is None and level.holds is not Holds.NOTHING:
                keys = self.keys.block_keys(keyed[:-1])
            if level.holds is Holds.STATE:
                if i and self.levels[i - 1].holds is Holds.STATE:
                    continue  # searched with the first of its run
                run = tuple(takewhile(lambda lv: lv.holds is Holds.STATE, self.levels[i:]))
                plan = self._from_state(run, keyed, keys)
            elif level.holds is Holds.BLOCKS:
                if i and self.levels[i - 1].holds is Holds.BLOCKS:
                    continue  # searched with the first of its run
                run = tuple(takewhile(lambda lv: lv.holds is Holds.BLOCKS, self.levels[i:]))
                plan = self._from_blocks(run, keys)
            else:
                if resumed and self.blocks is None:
                    raise RuntimeError("A released session needs the SSD store.")
                return TurnPlan(self.new_cache(), level.tier, 0, ())
            if plan is not None:
                return plan
        raise AssertionError("the restore order ends with the cold level")

    def _from_state(self, run: Sequence[Level], keyed: Sequence[int],
                    keys: list[str]) -> TurnPlan | None:
        """Blocks + the longest state of keyed[:L], L in the block after the stored ones (and
        below len(keyed)), over the state levels `run` (at one length, in their order)."""
        b = self.options.page_tokens
        n = self.blocks.lookup_prefix(keys)
        lo, hi = max(1, n * b), min(len(keyed) - 1, (n + 1) * b - 1)
        if hi < lo:
            return None
        found, cache = None, None
        candidates = [self.keys.state_keys(keyed, keys, lv.kind, lo, hi) for lv in run]
        for at in reversed(range(hi - lo + 1)):
            for lv, states in zip(run, candidates, strict=True):
                length, key = states[at]
                if lv.source.contains(key):
                    cache = self.new_cache() if cache is None else cache
                    # a record this engine cannot restore (an array missing, reshaped or
                    # retyped) is a miss the tier counts and deletes, never an error
                    entry = lv.source.get(key, check=self._fits_state(cache, length))
                    if entry is not None:
                        found = length, entry_arrays(entry), lv.tier
                        break
            if found is not None:
                break
        if found is None:
            return None
        length, arrays, tier = found
        blocks = self._blocks(keys[: length // b], cache)
        if len(blocks) != length // b:
            return None
        io = Transfers(self.model.device)  # one batch of copies, waited for on the device
        restore_blocks(cache, blocks, b, io)
        restore_snapshot(cache, arrays, b, self.ring_layers, io)
        io.ready_for_compute()
        return TurnPlan(cache, tier, length, tuple(keys[: len(blocks)]))

    def _from_blocks(self, run: Sequence[Level], keys: list[str]) -> TurnPlan | None:
        """The longest run of blocks alone over the block levels `run` (at one length, in their
        order), then encoder bounded replay from their end. A tier whose blocks read back
        shorter (an SSD block found bad) gives way to the next longest."""
        b = self.options.page_tokens
        found = sorted(((lv.source.lookup_prefix(keys), -i, lv) for i, lv in enumerate(run)),
                       key=lambda f: f[:2], reverse=True)
        best: TurnPlan | None = None
        for n, _, lv in found:
            if n == 0 or (best is not None and best.cached >= n * b):
                break
            cache = self.new_cache()
            if lv.source is self.runtime:
                got = self._runtime_blocks(keys[:n], cache)
            else:
                blocks = self._blocks(keys[:n], cache)
                if blocks:
                    restore_blocks(cache, blocks, b)
                got = len(blocks)
            if got and (best is None or got * b > best.cached):
                cache.index_owner = torch.tensor([index_owner_at(self.model.plan, got * b)],
                                                 device=self.model.device)
                stored = None if lv.source is self.blocks else self._ssd_blocks(keys[:got])
                best = TurnPlan(cache, lv.tier, got * b, tuple(keys[:got]), stored)
        return best

    def _runtime_blocks(self, keys: list[str], cache: ModelCache) -> int:
        """The runtime tier's blocks of `keys` (all held: `lookup_prefix`) copied into
        `cache`; read last to first, so the chain's first block stays the most recently used
        (the tier evicts the end of a chain before its start)."""
        rows = [self.runtime.get(k) for k in reversed(keys)][::-1]
        restore_block_rows(cache, rows, self.options.page_tokens)
        return len(rows)

    def _ssd_blocks(self, keys: list[str]) -> int:
        """How many leading `keys` the SSD store holds or has queued (0 without one)."""
        return 0 if self.blocks is None else self.blocks.lookup_prefix(keys)

    def _blocks(self, keys: list[str], cache: ModelCache) -> list[dict]:
        """The stored blocks of `keys`, up to the first missing or bad one (a block whose
        arrays do not fit `cache` is bad: counted and deleted by the store)."""
        b = self.options.page_tokens
        out = []
        for k in keys:
            arrays = self.blocks.get(k, check=lambda a: check_block(cache, a, b))
            if arrays is None:  # missing, or bad and now deleted: the prefix ends here
                break
            out.append(arrays)
        return out

    def _fits_state(self, cache: ModelCache, length: int) -> Callable[[dict], None]:
        """The check of a state record keyed at `length`: exactly the arrays this engine's
        snapshot of a `length`-token sequence has (`state.check_snapshot`)."""
        b, rings = self.options.page_tokens, self.ring_layers
        return lambda arrays: check_snapshot(cache, arrays, length, b, rings)

    # ---- the runtime prefix tier ----------------------------------------------------------------

    def keep_prompt_blocks(self, cache: ModelCache, keyed: Sequence[int]) -> int:
        """After a prefill of `keyed` (the cache holds all of it): its complete blocks to the
        runtime prefix tier, a copy of the rows each (those it holds are touched). Last block
        first, so a chain's start is the most recently used and the tier evicts its end
        first. Returns the blocks newly stored (0 with the tier off or no room at all)."""
        if self.runtime is None:
            return 0
        if int(cache.pos[0]) != len(keyed):
            raise AssertionError("the prompt and the cache position disagree")
        b = self.options.page_tokens
        stored = 0
        for i, key in reversed(list(enumerate(self.keys.block_keys(keyed)))):
            if self.runtime.contains(key):
                self.runtime.touch(key)
            elif self.runtime.put(key, block_rows(cache, i, b)):
                stored += 1
            else:  # no room for one block (the live caches fill the budget)
                break
        return stored

    # ---- the turn's end -------------------------------------------------------------------------

    def offload(self, cache: ModelCache, history: list[int], images: Sequence[SessionImage], *,
                session: int, holder: str, stored_blocks: int,
                previous: str | None) -> Offloaded:
        """The new complete blocks (after the `stored_blocks` known stored) to the SSD writer's
        queue (written in the background: a refused one is found missing by the next turn's
        walk, which then writes it again), the snapshot to the pool, held by `holder` (the
        session's uid; exact mode: also to the SSD store). `previous`: the session's last
        snapshot key, which it lets go of once it has moved past it: the pool deletes it only
        when no other session, of this engine or any other on the pool, holds it."""
        b = self.options.page_tokens
        if len(history) != int(cache.pos[0]):
            raise AssertionError("history and cache position disagree")
        keyed = key_tokens(history, images)
        keys = self.keys.block_keys(keyed)
        io = Transfers(self.model.device)  # every copy of the turn's end, then one wait
        new = [(keys[i], block_arrays(cache, i, b, io)) for i in range(stored_blocks, len(keys))]
        arrays = snapshot_arrays(cache, b, self.ring_layers, io)
        io.ready_for_host()
        for key, block in new:
            self.blocks.submit(key, block)
        key = self.keys.history_key(keyed, StateKind.SNAPSHOT)
        self.pool.put(key, arrays, {"session": session, "tokens": len(history)}, holder=holder)
        if previous not in (None, key):  # moved past it: this session's hold goes (only)
            self.pool.drop(previous, holder=holder)
        if self.options.exact:
            self.blocks.submit(self.keys.history_key(keyed, StateKind.STATE), arrays)
        return Offloaded(len(keys), key)
