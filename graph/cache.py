"""Cache state: explicit objects passed to the pure phase functions, holding the real packed bytes.

- window rings, per layer: FP8 E4M3 codes + E8M0 scales per 32 (528 B per 512-dim entry);
- main KV, per KV source: FP4 E2M1 codes + E4M3 scales per 16 (288 B), or bf16 (1024 B) when
  `kv_dtype="bf16"` (used to measure what FP4 costs);
- index K, per KV source that is also an index source: MXFP4 (68 B per 128-dim key);
- compressor tails, per ratio>1 KV source: fp32 kv and score of the partial group;
- Engram lookback: the last max_ngram-1 compressed token ids.

Sizes come from `layout.KVLayout`, the same plan `dsv41 bill` prints.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from dsv41.graph.layout import KVLayout
from dsv41.graph.plan import ModelPlan


@dataclass
class WindowRing:
    """Slot `pos % window` holds position pos's entry."""

    codes: torch.Tensor  # uint8 (b, window, d)
    scales: torch.Tensor  # uint8 (b, window, d/32)


@dataclass
class GlobalStore:
    """One KV source's compressed entries; entry j summarises tokens [j*m, (j+1)*m)."""

    ratio: int
    kv_codes: torch.Tensor  # uint8 (b, cap, d/2) FP4, or bf16 (b, cap, d) when unquantised
    kv_scales: torch.Tensor  # uint8 (b, cap, d/16) E4M3; empty for bf16
    k_codes: torch.Tensor | None  # uint8 (b, cap, di/2) MXFP4 index K
    k_scales: torch.Tensor | None  # uint8 (b, cap, di/32) E8M0
    tail_kv: torch.Tensor | None  # fp32 (b, m, d): the partial group, ratio > 1 only
    tail_score: torch.Tensor | None  # fp32 (b, m, d)

    @property
    def capacity(self) -> int:
        return self.kv_codes.size(1)


@dataclass
class ModelCache:
    """All state of a batch of sequences, each at its own length (`pos[b]` tokens cached).

    Phase functions replace these tensors by assignment (in place when eager, functionally
    under torch.export), so the same code serves both."""

    layout: KVLayout
    batch: int
    pos: torch.Tensor  # int64 (b,): tokens already processed (the next token's position)
    windows: dict[int, WindowRing]  # by layer (backbone and DSpark)
    stores: dict[int, GlobalStore]  # by KV source layer
    engram_history: np.ndarray | None  # int64 (b, max_ngram-1)
    kv_dtype: str = "fp4"
    # per sequence, the KV source that published index K last (-1: none; see model.index_keys)
    index_owner: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.index_owner is None:
            self.index_owner = torch.full((self.batch,), -1, dtype=torch.int64)

    def nbytes(self) -> dict[str, int]:
        """Live allocation bytes by kind."""
        out = {"window": 0, "main_kv": 0, "index_k": 0, "tails": 0}
        for w in self.windows.values():
            out["window"] += w.codes.nbytes + w.scales.nbytes
        for s in self.stores.values():
            out["main_kv"] += s.kv_codes.nbytes + s.kv_scales.nbytes
            if s.k_codes is not None:
                out["index_k"] += s.k_codes.nbytes + s.k_scales.nbytes
            if s.tail_kv is not None:
                out["tails"] += s.tail_kv.nbytes + s.tail_score.nbytes
        return out


def new_cache(plan: ModelPlan, batch: int, capacity: int, *, kv_dtype: str = "fp4",
              engram_pad: int | None = None,
              device: str | torch.device = "cpu") -> ModelCache:
    """Allocate the state for `batch` sequences of up to `capacity` tokens: the rings, stores and
    index-K pointer on `device` (where the compiled entries read them), the positions and the
    Engram lookback on the host (the host half of a phase reads them)."""
    if kv_dtype not in ("fp4", "bf16"):
        raise ValueError(f"kv_dtype must be 'fp4' or 'bf16', got {kv_dtype!r}.")
    if capacity <= 0 or batch <= 0:
        raise ValueError("Cache batch and capacity must be positive.")
    layout = KVLayout.from_plan(plan, kv_dtype=kv_dtype)
    capacity = _round_tokens(layout, capacity)
    a = plan.args
    d, di = a.head_dim, a.index_head_dim
    u8 = {"dtype": torch.uint8, "device": device}
    windows = {
        lay: WindowRing(torch.zeros(batch, a.window_size, d, **u8),
                        torch.zeros(batch, a.window_size, d // 32, **u8))
        for lay in layout.window_layers
    }
    stores = {}
    for src in layout.sources:
        n = capacity // src.ratio
        if kv_dtype == "fp4":
            kv = torch.zeros(batch, n, d // 2, dtype=torch.uint8, device=device)
            ks = torch.zeros(batch, n, d // 16, dtype=torch.uint8, device=device)
        else:
            kv = torch.zeros(batch, n, d, dtype=torch.bfloat16, device=device)
            ks = torch.zeros(batch, n, 0, dtype=torch.uint8, device=device)
        kc = ksc = None
        if src.index_k_bytes:
            kc = torch.zeros(batch, n, di // 2, dtype=torch.uint8, device=device)
            ksc = torch.zeros(batch, n, di // 32, dtype=torch.uint8, device=device)
        tk = tsc = None
        if src.ratio > 1:
            tk = torch.zeros(batch, src.ratio, d, dtype=torch.float32, device=device)
            tsc = torch.full((batch, src.ratio, d), float("-inf"), dtype=torch.float32,
                             device=device)
        stores[src.layer] = GlobalStore(src.ratio, kv, ks, kc, ksc, tk, tsc)
    hist = None
    if a.engram_layer_ids:
        pad = 0 if engram_pad is None else engram_pad
        hist = np.full((batch, a.engram_max_ngram_size - 1), pad, dtype=np.int64)
    return ModelCache(layout=layout, batch=batch, pos=torch.zeros(batch, dtype=torch.int64),
                      windows=windows, stores=stores, engram_history=hist, kv_dtype=kv_dtype,
                      index_owner=torch.full((batch,), -1, dtype=torch.int64, device=device))


def _round_tokens(layout: KVLayout, tokens: int) -> int:
    """Capacities are whole multiples of the largest ratio, so every store holds exactly
    tokens // ratio rows (a compiled entry relies on that relation between its context dims)."""
    top = max([1, *(s.ratio for s in layout.sources)])
    return -(-tokens // top) * top


def capacity_tokens(cache: ModelCache) -> int:
    """Tokens the global stores can hold."""
    return min((st.capacity * st.ratio for st in cache.stores.values()), default=1 << 62)


def ensure_capacity(cache: ModelCache, tokens: int, *, exact: bool = False) -> None:
    """Grow every global store so `tokens` positions fit (amortised doubling, or to exactly
    `tokens` rounded to the largest ratio)."""
    if not cache.stores or tokens <= capacity_tokens(cache):
        return
    grown = tokens if exact else max(tokens, 2 * capacity_tokens(cache))
    new_tokens = _round_tokens(cache.layout, grown)
    for store in cache.stores.values():
        new = new_tokens // store.ratio

        def grow(t: torch.Tensor | None, new: int = new) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.zeros(t.size(0), new, *t.shape[2:], dtype=t.dtype, device=t.device)
            out[:, : t.size(1)] = t
            return out

        store.kv_codes, store.kv_scales = grow(store.kv_codes), grow(store.kv_scales)
        store.k_codes, store.k_scales = grow(store.k_codes), grow(store.k_scales)


def _batch_tensors(cache: ModelCache):
    """(owner, attribute) of every per-sequence tensor, in a fixed order."""
    out = [(cache, "pos"), (cache, "index_owner")]
    for lay in sorted(cache.windows):
        out += [(cache.windows[lay], "codes"), (cache.windows[lay], "scales")]
    for lay in sorted(cache.stores):
        st = cache.stores[lay]
        for name in ("kv_codes", "kv_scales", "k_codes", "k_scales", "tail_kv", "tail_score"):
            if getattr(st, name) is not None:
                out.append((st, name))
    return out


def _shallow_copy(cache: ModelCache) -> ModelCache:
    """New cache, ring and store objects over the same tensors (callers then replace them)."""
    out = copy.copy(cache)
    out.windows = {k: WindowRing(v.codes, v.scales) for k, v in cache.windows.items()}
    out.stores = {k: copy.copy(v) for k, v in cache.stores.items()}
    return out


def stack_caches(caches: list[ModelCache]) -> ModelCache:
    """One batch from several caches of the same plan (sequences may have different lengths):
    stores are padded to the largest capacity. Batched decode runs on the result."""
    if not caches:
        raise ValueError("stack_caches needs at least one cache.")
    first = caches[0]
    if any(c.layout != first.layout or c.kv_dtype != first.kv_dtype for c in caches):
        raise ValueError("Only caches of the same model and KV dtype can be stacked.")
    tokens = max(st.capacity * st.ratio for c in caches for st in c.stores.values()) \
        if first.stores else 1
    for c in caches:
        ensure_capacity(c, tokens, exact=True)
    out = _shallow_copy(first)
    out.batch = sum(c.batch for c in caches)
    for (obj, name), *others in zip(_batch_tensors(out), *[_batch_tensors(c) for c in caches[1:]],
                                    strict=True):
        parts = [getattr(obj, name)] + [getattr(o, n) for o, n in others]
        setattr(obj, name, torch.cat(parts, dim=0))
    hists = [c.engram_history for c in caches]
    out.engram_history = None if hists[0] is None else np.concatenate(hists, axis=0)
    return out


def select_sequences(cache: ModelCache, rows: list[int]) -> ModelCache:
    """A cache holding only the given sequences (copies)."""
    if not rows or any(not 0 <= r < cache.batch for r in rows):
        raise ValueError(f"Sequence rows must lie in 0..{cache.batch - 1}, got {rows}.")
    out = _shallow_copy(cache)
    out.batch = len(rows)
    idx = torch.tensor(rows)
    for obj, name in _batch_tensors(out):
        setattr(obj, name, getattr(obj, name)[idx].clone())
    if cache.engram_history is not None:
        out.engram_history = cache.engram_history[rows].copy()
    return out


def drop_local_state(cache: ModelCache) -> None:
    """Forget the window rings and compressor tails (what a restore of the global entries alone
    gives: a prefix hit whose snapshot is gone). Global entries, positions and the index-K pointer
    stay."""
    for ring in cache.windows.values():
        ring.codes = torch.zeros_like(ring.codes)
        ring.scales = torch.zeros_like(ring.scales)
    for st in cache.stores.values():
        if st.tail_kv is not None:
            st.tail_kv = torch.zeros_like(st.tail_kv)
            st.tail_score = torch.full_like(st.tail_score, float("-inf"))


@dataclass
class LocalState:
    """Copies of a cache's per-sequence local state (see `save_local_state`)."""

    rings: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (codes, scales)
    tails: dict[int, tuple[torch.Tensor, torch.Tensor]]  # KV source -> (tail_kv, tail_score)
    index_owner: torch.Tensor
    engram_history: np.ndarray | None
    pos: torch.Tensor


def save_local_state(cache: ModelCache) -> LocalState:
    """Copies of the window rings, compressor tails, index-K pointer, Engram lookback and
    positions: what a pass that must leave them as they were (a replay run only for its
    outputs) puts back with `restore_local_state`. Global entries are not copied."""
    return LocalState(
        rings={k: (r.codes.clone(), r.scales.clone()) for k, r in cache.windows.items()},
        tails={k: (s.tail_kv.clone(), s.tail_score.clone()) for k, s in cache.stores.items()
               if s.tail_kv is not None},
        index_owner=cache.index_owner.clone(),
        engram_history=None if cache.engram_history is None else cache.engram_history.copy(),
        pos=cache.pos.clone())


def restore_local_state(cache: ModelCache, state: LocalState) -> None:
    for k, (codes, scales) in state.rings.items():
        cache.windows[k].codes, cache.windows[k].scales = codes, scales
    for k, (kv, score) in state.tails.items():
        cache.stores[k].tail_kv, cache.stores[k].tail_score = kv, score
    cache.index_owner = state.index_owner
    cache.engram_history = state.engram_history
    cache.pos = state.pos


# ---- slots: a stacked cache whose rows sequences join and leave ---------------------------------


def with_rows(cache: ModelCache, rows: int) -> ModelCache:
    """A copy of `cache` with `rows` sequence rows (at least its own): its rows first, then empty
    ones (zeros, empty tails, no index-K owner; a joining sequence overwrites its row whole). A
    batch of slots grows with this."""
    if rows < cache.batch:
        raise ValueError(f"with_rows cannot drop rows: {rows} < {cache.batch}.")
    out = _shallow_copy(cache)
    out.batch = rows
    for obj, name in _batch_tensors(out):
        t = getattr(obj, name)
        fill = float("-inf") if name == "tail_score" else -1 if name == "index_owner" else 0
        grown = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        grown[: t.size(0)] = t
        setattr(obj, name, grown)
    if cache.engram_history is not None:
        pad = np.zeros((rows - cache.batch, cache.engram_history.shape[1]), np.int64)
        out.engram_history = np.concatenate([cache.engram_history, pad], axis=0)
    return out


def put_sequence(dst: ModelCache, row: int, src: ModelCache) -> None:
    """Copy the one sequence of `src` into row `row` of `dst` (in place). The row then equals
    what `stack_caches` would hold for it: `src`'s entries, zeros past its capacity."""
    if src.batch != 1 or not 0 <= row < dst.batch:
        raise ValueError(f"put_sequence copies one sequence into a row of 0..{dst.batch - 1}; "
                         f"got {src.batch} sequences for row {row}.")
    if src.layout != dst.layout or src.kv_dtype != dst.kv_dtype:
        raise ValueError("Only caches of the same model and KV dtype share a batch.")
    if capacity_tokens(src) > capacity_tokens(dst):
        raise ValueError(f"A sequence of capacity {capacity_tokens(src)} does not fit a batch "
                         f"of capacity {capacity_tokens(dst)}; grow the batch first.")
    for (obj, name), (sobj, sname) in zip(_batch_tensors(dst), _batch_tensors(src), strict=True):
        d, s = getattr(obj, name)[row], getattr(sobj, sname)[0]
        if d.shape == s.shape:
            d.copy_(s)
        else:  # a global store: the source's rows, then zeros
            d[: s.size(0)].copy_(s)
            d[s.size(0):].zero_()
    if dst.engram_history is not None:
        dst.engram_history[row] = src.engram_history[0]


def move_sequence(cache: ModelCache, src: int, dst: int) -> None:
    """Copy row `src` over row `dst` (in place): one row, every per-sequence tensor."""
    if not (0 <= src < cache.batch and 0 <= dst < cache.batch):
        raise ValueError(f"Rows must lie in 0..{cache.batch - 1}, got {src} and {dst}.")
    for obj, name in _batch_tensors(cache):
        t = getattr(obj, name)
        t[dst] = t[src]
    if cache.engram_history is not None:
        cache.engram_history[dst] = cache.engram_history[src]


def leading_rows(cache: ModelCache, n: int) -> ModelCache:
    """A cache over rows [0, n) of `cache`, sharing its memory (views): a phase that writes in
    place writes the batch; `write_back` copies what a phase replaced instead."""
    if not 1 <= n <= cache.batch:
        raise ValueError(f"leading_rows takes 1..{cache.batch} rows, got {n}.")
    out = _shallow_copy(cache)
    out.batch = n
    for obj, name in _batch_tensors(out):
        setattr(obj, name, getattr(obj, name)[:n])
    if cache.engram_history is not None:
        out.engram_history = cache.engram_history[:n]
    return out


def write_back(cache: ModelCache, view: ModelCache) -> None:
    """After a phase ran on `leading_rows(cache, n)`: copy into `cache` every tensor the phase
    replaced rather than wrote in place (a tensor still over the batch's memory is skipped)."""
    n = view.batch
    if capacity_tokens(view) != capacity_tokens(cache):
        raise AssertionError("a phase grew a slot view; the batch must be grown before it runs")
    for (obj, name), (vobj, vname) in zip(_batch_tensors(cache), _batch_tensors(view),
                                          strict=True):
        dst, src = getattr(obj, name)[:n], getattr(vobj, vname)
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
    if cache.engram_history is not None:
        cache.engram_history[:n] = view.engram_history
