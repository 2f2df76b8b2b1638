"""The synthetic cache of the decode benchmarks: a batch-1 cache as if N tokens had been
processed, filled with format-valid entries (the graph's own quantisers over random values), so
that decode at 256K or 1M positions can be timed on a machine that cannot prefill that many
(`dsv41 bench`, `dsv41 bench spec`, `dsv41 ledger --long-contexts`, the selftest's decode
roofline). `StepState` puts back the few per-step fields so every timed step starts from the same
state; `check_contexts` refuses a context the model cannot decode from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dsv41.graph import ops
from dsv41.graph.cache import new_cache
from dsv41.graph.engram import empty_history, engram_history_after
from dsv41.graph.layout import KVLayout
from dsv41.runtime.engine.state import index_owner_at


def cache_bytes(plan, context: int) -> int:
    """Bytes of one sequence's cache at `context` positions (rings, stores, tails)."""
    lay = KVLayout.from_plan(plan)
    per_tok = sum((s.main_kv_bytes + s.index_k_bytes) / s.ratio for s in lay.sources)
    return int(per_tok * context) + len(lay.window_layers) * lay.window * \
        lay.window_entry_bytes + lay.tail_bytes


def _fill(codes: torch.Tensor, scales: torch.Tensor, rows: int, quant, gen: torch.Generator,
          dim: int, chunk: int = 8192) -> None:
    """Rows [0, rows) of (b=1) codes/scales: the quantiser's output over N(0, 1) values."""
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        x = torch.randn(r1 - r0, dim, generator=gen)
        c, s = quant(x)
        codes[0, r0:r1], scales[0, r0:r1] = c, s


def synthetic_cache(model, context: int, *, seed: int = 0, margin: int = 64):
    """A batch-1 cache as if `context` tokens had been processed: every window slot and every
    store row below context // ratio hold format-valid entries of random values, the tails are
    empty (context is a multiple of every ratio), and pos, the index-K pointer and the Engram
    lookback match `context` processed tokens. Capacity is context + margin positions."""
    plan, a = model.plan, model.args
    check_contexts(model, (context,))
    pad = model.engram.pad_id if model.engram is not None else None
    cache = new_cache(plan, 1, context + margin, engram_pad=pad)
    gen = torch.Generator().manual_seed(seed)
    filled = min(context, a.window_size)  # slot p % W holds position p
    for ring in cache.windows.values():
        _fill(ring.codes, ring.scales, filled, ops.quant_fp8, gen, a.head_dim)
    for st in cache.stores.values():
        rows = context // st.ratio
        _fill(st.kv_codes, st.kv_scales, rows, ops.quant_fp4_kv, gen, a.head_dim)
        if st.k_codes is not None:
            _fill(st.k_codes, st.k_scales, rows, ops.quant_mxfp4, gen, a.index_head_dim)
    cache.pos = torch.tensor([context], dtype=torch.int64)
    cache.index_owner = torch.tensor([index_owner_at(plan, context)], dtype=torch.int64)
    if model.engram is not None:
        rng = np.random.default_rng(seed)
        recent = rng.integers(3, a.vocab_size - 1, size=(1, model.engram.max_ngram - 1))
        cache.engram_history = engram_history_after(model.engram, empty_history(model.engram, 1),
                                                    recent)
    return cache


@dataclass
class StepState:
    """The per-step fields of a cache, to put it back before each timed step (the big tensors
    change in one ring slot and one row per store, rewritten identically by every step)."""

    pos: torch.Tensor
    index_owner: torch.Tensor
    engram_history: np.ndarray | None

    @classmethod
    def of(cls, cache) -> StepState:
        h = cache.engram_history
        return cls(cache.pos.clone(), cache.index_owner.clone(), None if h is None else h.copy())

    def restore(self, cache) -> None:
        cache.pos = self.pos.clone()
        cache.index_owner = self.index_owner.clone()
        cache.engram_history = None if self.engram_history is None else self.engram_history.copy()
        for st in cache.stores.values():
            if st.tail_kv is not None:
                st.tail_kv = torch.zeros_like(st.tail_kv)
                st.tail_score = torch.full_like(st.tail_score, float("-inf"))


def check_contexts(model, contexts: tuple[int, ...]) -> None:
    """Refuse, before anything is measured, a decode context the model cannot decode from: the
    token at position N needs N + 1 <= max_seq_len, and the synthetic cache needs N to be a
    positive multiple of every compression ratio."""
    top = max([1, *(p.ratio for p in model.plan.kv_sources)])
    limit = model.args.max_seq_len
    longest = (limit - 1) // top * top
    for n in contexts:
        if n <= 0 or n % top or n > longest:
            raise ValueError(f"Cannot decode from a context of {n} positions: it must be a "
                             f"positive multiple of {top} and at most {longest} (max_seq_len "
                             f"{limit} leaves room for the decoded token), e.g. 1023K.")
