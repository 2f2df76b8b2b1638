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

from dataclasses import dataclass, field

import numpy as np
import torch

from .layout import KVLayout
from .plan import ModelPlan


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
    """All state of a batch of sequences that share one length (`pos` tokens cached)."""

    layout: KVLayout
    batch: int
    pos: int  # tokens already processed (the next token's position)
    windows: dict[int, WindowRing]  # by layer (backbone and DSpark)
    stores: dict[int, GlobalStore]  # by KV source layer
    engram_history: np.ndarray | None  # int64 (b, max_ngram-1)
    kv_dtype: str = "fp4"
    index_k_layer: int = -1  # the KV source that published index K last (see model.select)
    # the window of a replayed segment starts here (CED approximations); 0 = full history
    window_floor: dict[int, int] = field(default_factory=dict)

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
              engram_pad: int | None = None) -> ModelCache:
    """Allocate the state for `batch` sequences of up to `capacity` tokens."""
    if kv_dtype not in ("fp4", "bf16"):
        raise ValueError(f"kv_dtype must be 'fp4' or 'bf16', got {kv_dtype!r}.")
    if capacity <= 0 or batch <= 0:
        raise ValueError("Cache batch and capacity must be positive.")
    layout = KVLayout.from_plan(plan, kv_dtype=kv_dtype)
    a = plan.args
    d, di = a.head_dim, a.index_head_dim
    windows = {
        lay: WindowRing(torch.zeros(batch, a.window_size, d, dtype=torch.uint8),
                        torch.zeros(batch, a.window_size, d // 32, dtype=torch.uint8))
        for lay in layout.window_layers
    }
    stores = {}
    for src in layout.sources:
        n = -(-capacity // src.ratio)
        if kv_dtype == "fp4":
            kv = torch.zeros(batch, n, d // 2, dtype=torch.uint8)
            ks = torch.zeros(batch, n, d // 16, dtype=torch.uint8)
        else:
            kv = torch.zeros(batch, n, d, dtype=torch.bfloat16)
            ks = torch.zeros(batch, n, 0, dtype=torch.uint8)
        kc = ksc = None
        if src.index_k_bytes:
            kc = torch.zeros(batch, n, di // 2, dtype=torch.uint8)
            ksc = torch.zeros(batch, n, di // 32, dtype=torch.uint8)
        tk = tsc = None
        if src.ratio > 1:
            tk = torch.zeros(batch, src.ratio, d, dtype=torch.float32)
            tsc = torch.full((batch, src.ratio, d), float("-inf"), dtype=torch.float32)
        stores[src.layer] = GlobalStore(src.ratio, kv, ks, kc, ksc, tk, tsc)
    hist = None
    if a.engram_layer_ids:
        pad = 0 if engram_pad is None else engram_pad
        hist = np.full((batch, a.engram_max_ngram_size - 1), pad, dtype=np.int64)
    return ModelCache(layout=layout, batch=batch, pos=0, windows=windows, stores=stores,
                      engram_history=hist, kv_dtype=kv_dtype)


def ensure_capacity(cache: ModelCache, tokens: int) -> None:
    """Grow every global store so `tokens` positions fit (amortised doubling)."""
    for store in cache.stores.values():
        need = -(-tokens // store.ratio)
        if need <= store.capacity:
            continue
        new = max(need, 2 * store.capacity)

        def grow(t: torch.Tensor | None, new: int = new) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.zeros(t.size(0), new, *t.shape[2:], dtype=t.dtype)
            out[:, : t.size(1)] = t
            return out

        store.kv_codes, store.kv_scales = grow(store.kv_codes), grow(store.kv_scales)
        store.k_codes, store.k_scales = grow(store.k_codes), grow(store.k_scales)
