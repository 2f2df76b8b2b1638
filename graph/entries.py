"""The calling convention of the compiled entries, shared by the compiler (capture) and the
runtime (compiled phases): entry names, the cache as a flat list of named tensors in a stable
order, each entry's outputs, and the host half of a phase (the real inputs of an entry built from
a cache and validated tokens). Nothing here compiles or runs TVM.
"""

from __future__ import annotations

import torch

from dsv41.graph.cache import GlobalStore, ModelCache, WindowRing
from dsv41.graph.entry_names import (  # noqa: F401 - re-exported: the convention's names
    CED_ENTRIES,
    ENTRIES,
    ENTRY_ARGS,
    EXACT_ENTRIES,
    HASH_IDS,
    HASH_IDS_AT,
    HOST_INPUTS,
    SELECTING,
    SPAN_ENTRIES,
    VISION_ENTRY,
    VISION_INPUTS,
    VISION_OUTPUTS,
    Entry,
    is_cache_input,
    is_x_input,
)
from dsv41.graph.model import Model, rope_window
from dsv41.graph.vision import SpanRows, packed_rows


def takes_spans(args, entry: str) -> bool:
    """Whether `entry` of a model with these args takes image-span rows."""
    return entry in SPAN_ENTRIES and args.vision_n_layers > 0


def selection_keys(plan) -> list[int]:
    """Index sources in layer order, then -1 (the candidate blocks) if there is a source."""
    keys = [p.layer for p in plan.backbone if p.runs_indexer]
    return keys + ([-1] if any(p.candidate_source for p in plan.backbone) else [])


def tail_row_layers(template: ModelCache) -> list[int]:
    """The KV sources whose compressors keep a partial-group tail (ratio > 1), in layer order:
    the `verify` entry returns their fp32 rows of every verified token (`tail.<layer>.kv`,
    `tail.<layer>.score`, (b, n, hd)), from which the host cuts the tails back."""
    return [lay for lay in sorted(template.stores) if template.stores[lay].tail_kv is not None]


def entry_outputs(plan, entry: str, template: ModelCache) -> list[str]:
    """Names of an entry's outputs, in order."""
    head = {"encoder": ["h", "pre"], "encoder_replay": ["h", "pre"],
            "draft": ["draft_ids", "draft_logits", "confidence"]}.get(entry, ["logits"])
    if entry == "verify":
        head = head + [f"tail.{lay}.{f}" for lay in tail_row_layers(template)
                       for f in ("kv", "score")]
    if entry in SELECTING:
        head += [f"sel.{k}" for k in selection_keys(plan)]
    return head + ([] if entry == "draft" else cache_names(template))


# ---- the cache as a flat list --------------------------------------------------------------------


def cache_names(cache: ModelCache) -> list[str]:
    """Stable order of the cache tensors an entry takes and returns."""
    names = []
    for layer in sorted(cache.windows):
        names += [f"window.{layer}.codes", f"window.{layer}.scales"]
    for layer in sorted(cache.stores):
        st = cache.stores[layer]
        names += [f"store.{layer}.kv_codes", f"store.{layer}.kv_scales"]
        if st.k_codes is not None:
            names += [f"store.{layer}.k_codes", f"store.{layer}.k_scales"]
        if st.tail_kv is not None:
            names += [f"store.{layer}.tail_kv", f"store.{layer}.tail_score"]
    return names + ["index_owner"]


def cache_tensors(cache: ModelCache) -> list[torch.Tensor]:
    return [cache_tensor(cache, name) for name in cache_names(cache)]


def cache_slot(cache: ModelCache, name: str):
    """(object, attribute) holding the cache tensor `name`."""
    if name == "index_owner":
        return cache, "index_owner"
    kind, layer, field = name.split(".")
    return (cache.windows[int(layer)] if kind == "window" else cache.stores[int(layer)]), field


def cache_tensor(cache: ModelCache, name: str) -> torch.Tensor:
    obj, field = cache_slot(cache, name)
    return getattr(obj, field)


def load_cache_tensors(cache: ModelCache, tensors) -> None:
    """Put an entry's returned cache tensors back into `cache`."""
    names = cache_names(cache)
    if len(tensors) != len(names):
        raise ValueError(f"Expected {len(names)} cache tensors, got {len(tensors)}.")
    for name, t in zip(names, tensors, strict=True):
        setattr(*cache_slot(cache, name), t)


def cache_view(template: ModelCache, tensors, start: torch.Tensor) -> ModelCache:
    """A ModelCache view over the entry's input tensors (the template gives the structure)."""
    it = dict(zip(cache_names(template), tensors, strict=True))
    windows = {lay: WindowRing(it[f"window.{lay}.codes"], it[f"window.{lay}.scales"])
               for lay in template.windows}
    stores = {}
    for lay, st in template.stores.items():
        stores[lay] = GlobalStore(st.ratio, it[f"store.{lay}.kv_codes"],
                                  it[f"store.{lay}.kv_scales"], it.get(f"store.{lay}.k_codes"),
                                  it.get(f"store.{lay}.k_scales"), it.get(f"store.{lay}.tail_kv"),
                                  it.get(f"store.{lay}.tail_score"))
    return ModelCache(layout=template.layout, batch=start.size(0), pos=start, windows=windows,
                      stores=stores, engram_history=None, kv_dtype=template.kv_dtype,
                      index_owner=it["index_owner"])


def entry_inputs(model: Model, cache: ModelCache, entry: str, x, *, start=None, floor=None,
                 hash_ids=None, rope=None, image: SpanRows | None = None) -> tuple:
    """The host half of a phase: real inputs for `entry` from a cache and validated tokens (or
    the encoder stream for `decoder`, or the accepted token for `draft`). Engram ids must be
    passed in (they advance the cache's lookback, so the caller computes them once); so may
    RoPE tables a graph `Chunk` already holds for the same start. `verify` takes the pair
    (tokens (b, n), each token's index-K pointer before it (b, n)). `image`: the chunk's
    image-span rows, appended to x as `vision.packed_rows` for the entries that take them."""
    a = model.args
    if entry == "draft":
        s = a.dspark_block_size
    elif entry in ("decoder", "verify"):
        s = x[0].size(1)
    else:
        s = x.size(1)
    start = cache.pos.clone() if start is None else start
    floor = torch.zeros_like(start) if floor is None else floor
    rope = rope_window(model, start, s) if rope is None else rope
    if hash_ids is None:
        n_eng = len(a.engram_layer_ids)
        cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads if n_eng else 0
        hash_ids = torch.zeros(start.size(0), s, n_eng, cols, dtype=torch.int64)
    if takes_spans(a, entry):
        x = (*(x if isinstance(x, tuple) else (x,)),
             *packed_rows(image, start.size(0), s, a.dim))
    elif image is not None:
        raise ValueError(f"The {entry} entry of this model takes no image-span rows (it has "
                         f"{'no' if a.vision_n_layers <= 0 else 'a'} vision tower).")
    return (x, start, floor, rope[True][0], rope[True][1], rope[False][0], rope[False][1],
            hash_ids, *cache_tensors(cache))  # hash_ids at HASH_IDS_AT
