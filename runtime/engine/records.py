"""What the engine reports: the tier that served a turn, the kinds of state record, each turn's
record and the engine's stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np


class Tier(StrEnum):
    """What served a turn's start (a str: compares and prints as its value)."""

    LIVE = "live"  # the session's own cache, still in the runtime cache
    SNAPSHOT = "snapshot"  # SSD blocks + a DRAM-pool snapshot (encoder state)
    SNAPSHOT_SSD = "snapshot-ssd"  # exact mode: SSD blocks + an SSD state record
    PREFIX = "prefix"  # SSD blocks only: encoder bounded replay from their end
    # blocks of any request's prompt still in the runtime cache (runtime_blocks.RuntimeBlocks):
    # restored as SSD blocks are, then the same encoder bounded replay from their end
    RUNTIME_PREFIX = "runtime-prefix"
    COLD = "cold"  # nothing: the whole prompt prefilled
    HANDOFF = "handoff"  # an EPD prefill worker's runtime state (Engine.adopt)

    def __repr__(self) -> str:  # in printed dicts and lists, as the plain string it stands for
        return repr(self.value)


class StateKind(StrEnum):
    """The tier records of a session's state after a prefix (each salts its own keys)."""

    SNAPSHOT = "snapshot"  # the DRAM pool's snapshot of the local state (encoder rings, tails)
    STATE = "state"  # exact mode: the SSD record of the whole runtime state

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass
class TurnRecord:
    session: int
    turn: int
    tier: Tier
    prefilled: int  # new tokens that entered the cache
    replayed: int  # cached tokens run through the encoder again (snapshot miss)
    decoder_replayed: int  # tokens through the decoder's bounded replay
    decoded: int
    token_layers: int  # work of the prefill (tokens x blocks)
    cached_blocks: int  # SSD prefix blocks the turn started from (reused: len(reused_keys))
    seconds: dict[str, float] = field(default_factory=dict)
    logits: list[np.ndarray] = field(default_factory=list)  # when asked for: prefill, then steps
    reused_keys: list[str] = field(default_factory=list)  # the SSD blocks read, in order
    reused_tokens: int = 0  # leading tokens the turn did not prefill (blocks + snapshot, or live)
    drafted: int = 0  # draft tokens DSpark proposed (a whole block per draft pass)
    verified: int = 0  # draft tokens the backbone checked (the k of every verify)
    accepted: int = 0  # draft tokens kept
    spec_steps: int = 0  # decode steps of this turn that verified drafts (its k >= 1)
    # per draft position j (index j - 1): the steps that verified a draft token there, and
    # those that kept it (sums: `verified`, `accepted`)
    verified_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # n samples of one prompt: the session whose prefill this turn's cache was copied from
    # (its prompt was not prefilled again: `prefilled` 0); None: a turn of its own
    forked_from: int | None = None

    def count_verify(self, k: int, accepted: int) -> None:
        """A decode step verified k of this turn's draft tokens and kept `accepted`."""
        if k == 0:
            return
        grow = k - len(self.verified_at)
        if grow > 0:
            self.verified_at += [0] * grow
            self.accepted_at += [0] * grow
        self.spec_steps += 1
        self.verified += k
        self.accepted += accepted
        for j in range(k):
            self.verified_at[j] += 1
            self.accepted_at[j] += j < accepted

    def unaccept(self, accepted: int, kept: int) -> None:
        """The last step's `accepted` draft tokens cut to the first `kept` (its reader left)."""
        for j in range(kept, accepted):
            self.accepted_at[j] -= 1
        self.accepted -= max(0, accepted - kept)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per speculative step: its accepted draft tokens and the backbone's own
        (vLLM's "mean acceptance length"); None before one ran."""
        return None if not self.spec_steps else 1.0 + self.accepted / self.spec_steps


@dataclass(frozen=True)
class SpecCounts:
    """DSpark's work for a request (`of` a turn's record) or a server (their `plus`)."""

    steps: int = 0  # decode steps that verified drafts (k >= 1)
    verified_at: tuple[int, ...] = ()  # per draft position j (index j - 1): drafts verified
    accepted_at: tuple[int, ...] = ()  # ... and kept

    @classmethod
    def of(cls, record: TurnRecord) -> SpecCounts:
        return cls(record.spec_steps, tuple(record.verified_at), tuple(record.accepted_at))

    def plus(self, other: SpecCounts) -> SpecCounts:
        def add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
            n = max(len(a), len(b))
            return tuple(x + y for x, y in zip(a + (0,) * (n - len(a)), b + (0,) * (n - len(b)),
                                               strict=True))
        return SpecCounts(self.steps + other.steps, add(self.verified_at, other.verified_at),
                          add(self.accepted_at, other.accepted_at))

    @property
    def drafted(self) -> int:
        """Draft tokens put to the backbone's verify."""
        return sum(self.verified_at)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per speculative step (accepted drafts and the backbone's own token)."""
        return None if not self.steps else 1.0 + self.accepted / self.steps


@dataclass
class EngineStats:
    sessions_live: int
    runtime_bytes: dict[str, int]  # live allocations by kind (window, main_kv, index_k, tails)
    runtime_tokens: int  # positions the live caches hold
    runtime_budget: int
    tiers: dict[str, int]  # turns served per tier
    tokens: dict[str, int]  # prefilled, replayed, decoder_replayed, decoded
    store: object | None  # KVStoreStats
    pool: object | None  # SnapshotPoolStats
    writer: object | None = None  # BlockWriterStats
    runtime_blocks: object | None = None  # RuntimeBlocksStats (None: the tier is off)
