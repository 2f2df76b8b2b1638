"""Moving one sequence's cache state in and out of the tiers, as named numpy arrays.

- A *prefix block* covers `block_tokens` positions [i*B, (i+1)*B): for every global source of
  ratio m, its entries [i*B/m, (i+1)*B/m) (FP4 main KV codes and scales, MXFP4 index K codes and
  scales). Entries of a block are final once the cache has processed all its positions, so a
  block never changes after it is written. These go to the SSD store.
- A *snapshot* is the rest of the state a turn resumes from: the window rings of the layers
  named (`snapshot_ring_layers`: the encoder's by default, since the decoder's are rebuilt by
  bounded replay at every prefill; every layer's in exact mode or with decoder carry-over), the
  compressor tails, the Engram lookback, the index-K pointer, the position, and the global
  entries past the last complete block. Restored over the prefix blocks, it gives back those
  parts of the cache byte for byte (other rings start empty). These go to the DRAM pool.

Everything works on batch-1 caches (one session); bf16 stores travel as their uint16 bits.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv41.graph.cache import ModelCache, ensure_capacity
from dsv41.graph.layout import KVLayout
from dsv41.graph.plan import FULL, ModelPlan
from dsv41.runtime.engine.transfer import Transfers

STORE_FIELDS = ("kv_codes", "kv_scales", "k_codes", "k_scales")
TAIL_FIELDS = ("tail_kv", "tail_score")


def _rows_into(io: Transfers, a: np.ndarray, t: torch.Tensor, r0: int, what: str) -> None:
    """Stored rows `a` into rows r0.. of sequence 0 of the store tensor `t` (`io.into` refuses
    rows of another shape or dtype)."""
    if a.ndim == 0 or r0 + a.shape[0] > t.size(1):
        raise ValueError(f"Stored rows {tuple(a.shape)} of {what} do not fit rows {r0}.. of a "
                         f"cache tensor {tuple(t.shape)}.")
    io.into(a, t[0, r0:r0 + a.shape[0]])


def _whole(io: Transfers, a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A batch-1 tensor shaped like `like` (1, ...) from its stored row (`io.into` refuses
    another shape or dtype)."""
    out = torch.empty_like(like)
    io.into(a, out[0])
    return out


def check_block_tokens(ratios, block_tokens: int) -> None:
    """A block must hold whole entries of every global source (`ratios`: their ratios)."""
    top = max([1, *ratios])
    if block_tokens <= 0 or block_tokens % top:
        raise ValueError(f"Block size {block_tokens} must be a positive multiple of the "
                         f"largest compression ratio {top}.")


def _ratios(cache: ModelCache) -> list[int]:
    return [st.ratio for st in cache.stores.values()]


def _single(cache: ModelCache) -> None:
    if cache.batch != 1:
        raise ValueError(f"Tier records hold one sequence; this cache has {cache.batch}.")


def _device(cache: ModelCache) -> torch.device:
    """Where the cache's tensors live (the rings, stores and pointer share a device)."""
    return cache.index_owner.device


def _block_fields(cache: ModelCache, index: int, block_tokens: int, stores=None):
    """(name, store tensor, first row, end row) of each array of prefix block `index`, the
    stores in `stores`' order (default the cache's): the rows every block copy moves."""
    for layer, st in cache.stores.items() if stores is None else stores:
        r0, r1 = index * block_tokens // st.ratio, (index + 1) * block_tokens // st.ratio
        for name in STORE_FIELDS:
            t = getattr(st, name)
            if t is not None:
                yield f"{layer}.{name}", t, r0, r1


def block_arrays(cache: ModelCache, index: int, block_tokens: int,
                 io: Transfers | None = None) -> dict[str, np.ndarray]:
    """Prefix block `index` of a batch-1 cache (its positions must all be processed). With
    `io`, its copies join that batch (the arrays hold their data after `io.ready_for_host`)."""
    _single(cache)
    check_block_tokens(_ratios(cache), block_tokens)
    end = (index + 1) * block_tokens
    if index < 0 or end > int(cache.pos[0]):
        raise ValueError(f"Block {index} ends at {end}, past the {int(cache.pos[0])} cached "
                         "tokens: its entries are not final yet.")
    mine = io is None
    io = Transfers(_device(cache)) if mine else io
    out = {key: io.out(t[0, r0:r1]) for key, t, r0, r1 in
           _block_fields(cache, index, block_tokens, sorted(cache.stores.items()))}
    if mine:
        io.ready_for_host()
    return out


def restore_blocks(cache: ModelCache, blocks: list[dict[str, np.ndarray]],
                   block_tokens: int, io: Transfers | None = None) -> None:
    """Write prefix blocks 0..n-1 into a fresh batch-1 cache and set its position to n*B. With
    `io`, its copies join that batch (the cache holds them after `io.ready_for_compute`)."""
    _single(cache)
    check_block_tokens(_ratios(cache), block_tokens)
    n = len(blocks) * block_tokens
    ensure_capacity(cache, n, exact=True)
    mine = io is None
    io = Transfers(_device(cache)) if mine else io
    for i, arrays in enumerate(blocks):
        for key, t, r0, r1 in _block_fields(cache, i, block_tokens):
            if key not in arrays:
                raise ValueError(f"Block {i} has no {key}.")
            if arrays[key].shape[:1] != (r1 - r0,):
                raise ValueError(f"Block {i} {key} has {arrays[key].shape[:1]} rows, not "
                                 f"{r1 - r0}.")
            _rows_into(io, arrays[key], t, r0, f"block {i} {key}")
    if mine:
        io.ready_for_compute()
    cache.pos = torch.full((1,), n, dtype=torch.int64)


def block_rows(cache: ModelCache, index: int, block_tokens: int) -> dict[str, torch.Tensor]:
    """Prefix block `index` of a batch-1 cache as a copy of its rows on the cache's device (the
    runtime tier's entry: the same names and rows `block_arrays` gives the SSD store, so a
    restore from either writes the same bytes)."""
    _single(cache)
    end = (index + 1) * block_tokens
    if index < 0 or end > int(cache.pos[0]):
        raise ValueError(f"Block {index} ends at {end}, past the {int(cache.pos[0])} cached "
                         "tokens: its entries are not final yet.")
    return {key: t[0, r0:r1].clone() for key, t, r0, r1 in
            _block_fields(cache, index, block_tokens, sorted(cache.stores.items()))}


def restore_block_rows(cache: ModelCache, blocks: list[dict[str, torch.Tensor]],
                       block_tokens: int) -> None:
    """`restore_blocks` from the runtime tier's rows (`block_rows`, on the cache's device): one
    device copy per array, read only. ValueError (nothing of the cache's position changed) when
    a block lacks an array or its rows do not fit."""
    _single(cache)
    check_block_tokens(_ratios(cache), block_tokens)
    n = len(blocks) * block_tokens
    ensure_capacity(cache, n, exact=True)
    for i, rows in enumerate(blocks):
        for key, t, r0, r1 in _block_fields(cache, i, block_tokens):
            src, dest = rows.get(key), t[0, r0:r1]
            if src is None or src.shape != dest.shape or src.dtype != dest.dtype:
                raise ValueError(f"Runtime block {i} has no rows {key} of "
                                 f"{tuple(dest.shape)} {dest.dtype}.")
            dest.copy_(src)
    cache.pos = torch.full((1,), n, dtype=torch.int64)


def index_owner_at(plan: ModelPlan, pos: int) -> int:
    """The index-K pointer after position pos-1 was processed (see `model.run_compressor`): the
    last index-owning source, in layer order, that completed an entry at that position. Restores
    of a prefix use it (the replay that follows moves no pointer)."""
    owner = -1
    if pos <= 0:
        return owner
    for layer, p in enumerate(plan.layers):
        if p.role == FULL and p.owns_index_k and pos % p.ratio == 0:
            owner = layer
    return owner


def snapshot_ring_layers(plan: ModelPlan, *, all_rings: bool) -> tuple[int, ...]:
    """The layers whose window rings a snapshot holds: the encoder's, or (`all_rings`: exact
    mode, decoder carry-over) every backbone and DSpark layer's."""
    layers = [p.layer for p in plan.layers]  # backbone then DSpark: every layer has a ring
    return tuple(sorted(lay for lay in layers if all_rings or lay < plan.decoder_start))


def snapshot_arrays(cache: ModelCache, block_tokens: int,
                    ring_layers: tuple[int, ...] | None = None,
                    io: Transfers | None = None) -> dict[str, np.ndarray]:
    """The state beyond the prefix blocks (see the module docstring); `ring_layers`: the rings
    it holds (None: all); `io` as for `block_arrays`."""
    _single(cache)
    check_block_tokens(_ratios(cache), block_tokens)
    mine = io is None
    io = Transfers(_device(cache)) if mine else io
    pos = int(cache.pos[0])
    done = pos // block_tokens * block_tokens
    out = {"pos": np.array([pos], dtype=np.int64),
           "index_owner": io.out(cache.index_owner)}
    for layer in _rings(cache, ring_layers):
        ring = cache.windows[layer]
        out[f"ring.{layer}.codes"] = io.out(ring.codes[0])
        out[f"ring.{layer}.scales"] = io.out(ring.scales[0])
    for layer, st in sorted(cache.stores.items()):
        for name in TAIL_FIELDS:
            t = getattr(st, name)
            if t is not None:
                out[f"{layer}.{name}"] = io.out(t[0])
        for name in STORE_FIELDS:
            t = getattr(st, name)
            if t is not None:
                out[f"partial.{layer}.{name}"] = io.out(t[0, done // st.ratio: pos // st.ratio])
    if cache.engram_history is not None:
        out["engram_history"] = cache.engram_history.copy()
    if mine:
        io.ready_for_host()
    return out


def restore_snapshot(cache: ModelCache, arrays: dict[str, np.ndarray], block_tokens: int,
                     ring_layers: tuple[int, ...] | None = None,
                     io: Transfers | None = None) -> None:
    """Complete a cache holding the prefix blocks up to the snapshot's last complete block.
    `ring_layers`: the rings the snapshot must hold, exactly (None: all); others stay empty.
    `io` as for `restore_blocks`."""
    _single(cache)
    pos = int(arrays["pos"][0])
    done = pos // block_tokens * block_tokens
    if int(cache.pos[0]) != done:
        raise ValueError(f"The snapshot continues {done} block tokens; the cache holds "
                         f"{int(cache.pos[0])}.")
    want = _rings(cache, ring_layers)
    have = sorted(int(k.split(".")[1]) for k in arrays if k.startswith("ring.")
                  and k.endswith(".codes"))
    if have != list(want):
        raise ValueError(f"The snapshot holds the rings of layers {have}; this engine restores "
                         f"those of {list(want)}.")
    ensure_capacity(cache, pos, exact=True)
    mine = io is None
    io = Transfers(_device(cache)) if mine else io
    for layer in want:
        ring = cache.windows[layer]
        ring.codes = _whole(io, arrays[f"ring.{layer}.codes"], ring.codes)
        ring.scales = _whole(io, arrays[f"ring.{layer}.scales"], ring.scales)
    for layer, st in cache.stores.items():
        for name in TAIL_FIELDS:
            t = getattr(st, name)
            if t is not None:
                setattr(st, name, _whole(io, arrays[f"{layer}.{name}"], t))
        for name in STORE_FIELDS:
            t = getattr(st, name)
            if t is not None:
                _rows_into(io, arrays[f"partial.{layer}.{name}"], t, done // st.ratio,
                           f"the snapshot's partial {layer}.{name}")
    owner = torch.empty_like(cache.index_owner)
    io.into(arrays["index_owner"], owner)
    cache.index_owner = owner
    if mine:
        io.ready_for_compute()
    if cache.engram_history is not None:
        cache.engram_history = arrays["engram_history"].copy()
    cache.pos = torch.full((1,), pos, dtype=torch.int64)


def _rings(cache: ModelCache, ring_layers: tuple[int, ...] | None) -> tuple[int, ...]:
    if ring_layers is None:
        return tuple(sorted(cache.windows))
    missing = [lay for lay in ring_layers if lay not in cache.windows]
    if missing:
        raise ValueError(f"Layers {missing} have no window ring in this cache.")
    return tuple(sorted(ring_layers))


def snapshot_nbytes(plan: ModelPlan, pos: int, block_tokens: int,
                    ring_layers: tuple[int, ...], kv_dtype: str = "fp4") -> dict[str, int]:
    """The bytes `snapshot_arrays` holds for a batch-1 cache at `pos`, from the plan alone (the
    sizes of `graph.layout`, which the bill prints), by part: `rings` (one FP8 ring per ring
    layer), `tails` (fp32 kv + score of m x d per ratio>1 KV source), `partial` (the global
    entries of the last incomplete block), `pointers` (position, index-K pointer, Engram
    lookback)."""
    a = plan.args
    check_block_tokens([s.ratio for s in plan.kv_sources], block_tokens)
    layout = KVLayout.from_plan(plan, kv_dtype=kv_dtype)
    done = pos // block_tokens * block_tokens
    rings = len(ring_layers) * layout.ring_bytes
    tails = layout.tail_bytes
    partial = sum((pos // s.ratio - done // s.ratio) * (s.main_kv_bytes + s.index_k_bytes)
                  for s in layout.sources)
    engram = (a.engram_max_ngram_size - 1) * 8 if a.engram_layer_ids else 0
    return {"rings": rings, "tails": tails, "partial": partial, "pointers": 8 + 8 + engram}


def runtime_state_arrays(cache: ModelCache, block_tokens: int) -> dict[str, np.ndarray]:
    """A batch-1 cache's whole runtime state: every complete block (`block.<i>.<name>`) and the
    snapshot of every ring, tail and pointer (`snap.<name>`), what an EPD decode worker restores
    byte for byte (`restore_runtime_state`)."""
    _single(cache)
    out = {}
    for i in range(int(cache.pos[0]) // block_tokens):
        out.update({f"block.{i}.{k}": v for k, v in block_arrays(cache, i, block_tokens).items()})
    out.update({f"snap.{k}": v for k, v in snapshot_arrays(cache, block_tokens, None).items()})
    return out


def restore_runtime_state(cache: ModelCache, arrays: dict[str, np.ndarray],
                          block_tokens: int) -> None:
    """Write `runtime_state_arrays` into a fresh batch-1 cache (ValueError when they do not
    fit it)."""
    blocks: dict[int, dict[str, np.ndarray]] = {}
    snap = {}
    for name, a in arrays.items():
        kind, _, rest = name.partition(".")
        if kind == "block":
            i, _, field = rest.partition(".")
            if not i.isdigit():
                raise ValueError(f"State array {name!r} names no block.")
            blocks.setdefault(int(i), {})[field] = a
        elif kind == "snap":
            snap[rest] = a
        else:
            raise ValueError(f"State array {name!r} is neither a block nor the snapshot.")
    if sorted(blocks) != list(range(len(blocks))) or "pos" not in snap:
        raise ValueError("The runtime state's blocks are not 0..n-1, or it has no position.")
    if int(snap["pos"][0]) // block_tokens != len(blocks):
        raise ValueError(f"The runtime state at position {int(snap['pos'][0])} holds "
                         f"{len(blocks)} blocks of {block_tokens}.")
    restore_blocks(cache, [blocks[i] for i in range(len(blocks))], block_tokens)
    restore_snapshot(cache, snap, block_tokens, None)


def _host_dtype(t: torch.Tensor) -> np.dtype:
    """The dtype of `t`'s host array in a tier record (bf16 travels as its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return np.dtype(np.uint16)
    return torch.empty(0, dtype=t.dtype).numpy().dtype


def _expect(arrays: dict[str, np.ndarray], want: dict[str, tuple[tuple[int, ...], np.dtype]],
            what: str) -> None:
    """ValueError naming the first difference between `arrays` and `want` (name -> shape,
    dtype): a missing or unknown array, another shape or another dtype."""
    missing, unknown = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
    if missing or unknown:
        raise ValueError(f"{what} lacks arrays {missing} and has unknown arrays {unknown}.")
    for name, (shape, dtype) in want.items():
        a = arrays[name]
        if not isinstance(a, np.ndarray) or tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"{what}'s {name} is {getattr(a, 'dtype', type(a).__name__)} "
                             f"{tuple(getattr(a, 'shape', ()))}; this engine reads {dtype} "
                             f"{shape}.")


def check_block(cache: ModelCache, arrays: dict[str, np.ndarray], block_tokens: int) -> None:
    """ValueError unless `arrays` are exactly a prefix block `block_arrays` gives this cache
    (every name, shape and dtype), checked before any of it is restored."""
    want = {}
    for layer, st in sorted(cache.stores.items()):
        for name in STORE_FIELDS:
            t = getattr(st, name)
            if t is not None:
                want[f"{layer}.{name}"] = ((block_tokens // st.ratio, *t.shape[2:]),
                                           _host_dtype(t))
    _expect(arrays, want, "The block")


def check_snapshot(cache: ModelCache, arrays: dict[str, np.ndarray], pos: int,
                   block_tokens: int, ring_layers: tuple[int, ...] | None) -> None:
    """ValueError unless `arrays` are exactly what `snapshot_arrays` gives this cache at `pos`
    (the position its key names) with these rings: every name, shape and dtype, and the
    position itself, checked before any of it is restored."""
    done = pos // block_tokens * block_tokens
    want = {"pos": ((1,), np.dtype(np.int64)),
            "index_owner": (tuple(cache.index_owner.shape), _host_dtype(cache.index_owner))}
    for layer in _rings(cache, ring_layers):
        ring = cache.windows[layer]
        want[f"ring.{layer}.codes"] = (tuple(ring.codes.shape[1:]), _host_dtype(ring.codes))
        want[f"ring.{layer}.scales"] = (tuple(ring.scales.shape[1:]), _host_dtype(ring.scales))
    for layer, st in sorted(cache.stores.items()):
        for name in TAIL_FIELDS:
            t = getattr(st, name)
            if t is not None:
                want[f"{layer}.{name}"] = (tuple(t.shape[1:]), _host_dtype(t))
        for name in STORE_FIELDS:
            t = getattr(st, name)
            if t is not None:
                want[f"partial.{layer}.{name}"] = ((pos // st.ratio - done // st.ratio,
                                                    *t.shape[2:]), _host_dtype(t))
    if cache.engram_history is not None:
        want["engram_history"] = (tuple(cache.engram_history.shape), cache.engram_history.dtype)
    _expect(arrays, want, "The snapshot")
    if int(arrays["pos"][0]) != pos:
        raise ValueError(f"The snapshot is at position {int(arrays['pos'][0])}; its key names "
                         f"position {pos}.")
