"""The runtime cache's byte budget: what a session's cache of N positions costs (whole pages),
admission before a turn restores anything, and growth within the budget."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from dsv41.graph.cache import ModelCache, ensure_capacity, new_cache
from dsv41.graph.model import Model
from dsv41.runtime.engine.options import CacheFullError, EngineOptions
from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocks


class CacheBudget:
    """Allocates the engine's caches and counts them against `cache_budget_bytes`. `live`: every
    cache the engine holds now (the sessions' and the decode batches'), what the budget counts
    with the runtime prefix tier's blocks (`blocks`, when on). The tier lives in the room the
    live caches leave (`block_room`): a cache that needs room takes it from the tier first,
    least recently used blocks evicted (`make_room`), before a turn is refused."""

    def __init__(self, model: Model, options: EngineOptions,
                 live: Callable[[], Iterable[ModelCache]]):
        self.model, self.options, self.live = model, options, live
        self.blocks: RuntimeBlocks | None = None  # the runtime prefix tier (the engine sets it)
        self.pad = model.engram.pad_id if model.engram is not None else None
        one_page = self.new_cache()
        self.first_page = sum(one_page.nbytes().values())  # everything, with its first page
        self.page_bytes = sum(t.nbytes for st in one_page.stores.values()
                              for t in (st.kv_codes, st.kv_scales, st.k_codes, st.k_scales)
                              if t is not None)  # each further page
        if self.first_page > options.cache_budget_bytes:
            raise ValueError(f"cache_budget_bytes={options.cache_budget_bytes:,} cannot hold one "
                             f"session's first page ({self.first_page:,} bytes with pages of "
                             f"{options.page_tokens} positions); raise it or lower page_tokens.")

    def new_cache(self, rows: int = 1, tokens: int | None = None) -> ModelCache:
        """An empty cache of `rows` sequences, `tokens` positions each (default: one page)."""
        return new_cache(self.model.plan, rows, tokens or self.options.page_tokens,
                         engram_pad=self.pad, device=self.model.device)

    def live_bytes(self) -> int:
        """The live caches' bytes (the prefix tier's apart)."""
        return sum(sum(c.nbytes().values()) for c in self.live())

    def runtime_bytes(self) -> int:
        """The live caches' bytes and the prefix tier's."""
        return self.live_bytes() + (0 if self.blocks is None else self.blocks.nbytes())

    def block_room(self) -> int:
        """The bytes the prefix tier may hold now: the budget less the live caches."""
        return self.options.cache_budget_bytes - self.live_bytes()

    def fits(self, extra: int) -> bool:
        """Whether `extra` more bytes of live cache fit, the prefix tier's blocks evicted if
        need be."""
        return self.live_bytes() + extra <= self.options.cache_budget_bytes

    def make_room(self, extra: int) -> None:
        """Evict the prefix tier's least recently used blocks until `extra` more bytes of live
        cache fit in the budget (or the tier is empty)."""
        if self.blocks is not None:
            over = self.runtime_bytes() + extra - self.options.cache_budget_bytes
            if over > 0:
                self.blocks.evict_bytes(over)

    def cache_bytes(self, tokens: int) -> int:
        """The bytes of one session's cache grown to hold `tokens` positions (whole pages)."""
        pages = max(1, -(-tokens // self.options.page_tokens))
        return self.first_page + (pages - 1) * self.page_bytes

    def admit(self, tokens: int) -> None:
        """Refuse (CacheFullError) a new cache of `tokens` positions that would not fit."""
        need = self.cache_bytes(tokens)
        if self.fits(need):  # refused: nothing changes, the tier's blocks included
            self.make_room(need)
        used = self.runtime_bytes()
        if used + need > self.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {need:,} more bytes for {tokens} positions; "
                f"{used:,} of its {self.options.cache_budget_bytes:,} are in use.")

    def reserve(self, cache: ModelCache, tokens: int) -> None:
        """Grow a cache to the pages `tokens` positions need, within the byte budget (a cache
        the engine does not hold yet counts whole); on refusal nothing changes."""
        page = self.options.page_tokens
        want = -(-tokens // page) * page
        have = min(st.capacity * st.ratio for st in cache.stores.values()) \
            if cache.stores else want
        if want <= have:
            return
        extra = sum(t.nbytes // t.size(1) * (want // st.ratio - t.size(1))
                    for st in cache.stores.values()
                    for t in (st.kv_codes, st.kv_scales, st.k_codes, st.k_scales)
                    if t is not None and t.size(1))
        live = list(self.live())
        if not any(c is cache for c in live):
            extra += sum(cache.nbytes().values())
        if self.fits(extra):
            self.make_room(extra)
        used = self.runtime_bytes()
        if used + extra > self.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {extra:,} more bytes for {want} positions; "
                f"{used:,} of its {self.options.cache_budget_bytes:,} are in use.")
        ensure_capacity(cache, want, exact=True)
