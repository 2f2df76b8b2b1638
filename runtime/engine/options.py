"""The engine's options and its one refusal of a turn for room (`CacheFullError`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from dsv41.graph.phases import DEFAULT_CHUNK_TOKENS

FORMAT_VERSION = 1  # of the tier records (part of every key)


class CacheFullError(RuntimeError):
    """The runtime cache's byte budget cannot hold a session's next turn."""


class SpecMode(StrEnum):
    """DSpark speculative decoding (the strings are `--speculative`'s)."""

    AUTO = "auto"  # speculate while it pays (the policy drops to k = 0, and probes to come back);
    # off without DSpark layers, or on an artifact without the `draft` and `verify` entries
    ON = "on"  # every step drafts and verifies k >= 1 (refused without DSpark or the entries)
    OFF = "off"  # plain decode steps


SPEC_MODES = tuple(SpecMode)


def spec_mode(value: SpecMode | str | bool) -> SpecMode:
    """`speculative` as the enum: a mode or its string; True is AUTO (the adaptive policy the
    flag meant before the modes), False OFF. ValueError for anything else."""
    if isinstance(value, bool):
        return SpecMode.AUTO if value else SpecMode.OFF
    if isinstance(value, str) and value in SPEC_MODES:
        return SpecMode(value)
    raise ValueError(f"speculative must be auto, on or off, got {value!r}.")


def has_dspark(args) -> bool:
    """Whether a model of these args (ModelArgs) has DSpark layers to draft with."""
    return bool(args.dspark_block_size) and args.n_mtp_layers > 0


@dataclass(frozen=True)
class EngineOptions:
    exact: bool = False  # exact phases throughout (no CED, no bounded replay)
    page_tokens: int = 256  # runtime-cache page and SSD block, in positions
    cache_budget_bytes: int = 4 << 30  # runtime cache (all live sessions)
    store_dir: str | Path | None = None  # SSD global-KV store (None: sessions stay live)
    store_capacity_bytes: int = 64 << 30
    store_min_lifetime_s: float = 72 * 3600.0
    pool_budget_bytes: int | None = None  # DRAM snapshot pool (None: 10% of host memory)
    pool_ttl_s: float = 600.0
    pool_sweep_s: float = 1.0  # expired snapshots are freed by the first pool call after this
    # keep the decoder and DSpark rings in the snapshot and run only the new tokens through the
    # decoder (the carry-over of before issue 17); default False: decoder bounded replay of the
    # last `window` tokens at every prefill, as the article describes. Salts every state key.
    decoder_carry: bool = False
    store_clock: Callable[[], float] = time.time
    pool_clock: Callable[[], float] = time.monotonic
    # the DRAM snapshot pool on this Redis server (runtime/redis_pool.py; shared by every engine
    # of the model that names it), instead of the in-process one; its maxmemory and policy are
    # read, never set (pool_budget_bytes, when smaller, caps a snapshot), pool_ttl_s its expiry
    redis_url: str | None = None
    threads: int | None = None  # TVM's CPU pool (None: TVM_NUM_THREADS, else torch's count)
    # every prefill runs in chunks of at most this many tokens: transient memory O(chunk x
    # entries) instead of O(N x entries)
    prefill_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # DSpark speculative decoding (runtime/speculative.py): draft, verify up to `max_draft`
    # tokens per row and step, each row's k chosen by `Engine.spec_policy` from its confidence
    # head and the measured step costs (`spec_clock`); greedy output and sampled distributions
    # unchanged. A SpecMode (its string, or a bool: True AUTO, False OFF)
    speculative: SpecMode = SpecMode.OFF
    max_draft: int | None = None  # None: the DSpark block (within the window)
    spec_clock: Callable[[], float] = time.perf_counter
    # an artifact's host-resident Engram rows gathered ahead on a background thread while the
    # entry's first blocks run (False: when the entry reaches the layer; the same rows)
    engram_prefetch: bool = True
    # the runtime-cache prefix tier (runtime/tiers/runtime_blocks.py): every prefill's complete
    # prompt blocks stay in the runtime cache's memory, within its budget (LRU), and serve any
    # later request with that prefix, running or finished; not in exact mode (blocks alone do
    # not restore without the bounded replay). Off in the embedded engine, on in `dsv41 serve`
    runtime_prefix: bool = False

    def __post_init__(self) -> None:  # the mode as the enum (ValueError for a bad one)
        object.__setattr__(self, "speculative", spec_mode(self.speculative))
        if self.runtime_prefix and self.exact:
            raise ValueError(
                "runtime_prefix needs the bounded replay, which exact mode does not "
                "run: blocks alone do not restore an exact turn."
            )
