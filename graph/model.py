"""DeepSeek-V4.1-Flash, one block at a time, over explicit weights and explicit cache state.

`Model` holds the checkpoint's tensors under their official names (no module buffers, no
globals); `run_layers` pushes a chunk of tokens through a range of blocks at any start position,
reading and writing a `ModelCache`. The phase functions in `phases.py` are built from it.

Notation: b batch, s new tokens, hc copies of the residual stream, d = dim, h heads,
hd = head_dim (the 512-dim latent, K = V), m compress ratio, P0 = first new position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsv41.graph import ops
from dsv41.graph.cache import GlobalStore, ModelCache, WindowRing
from dsv41.graph.checkpoint import RETURNED_DTYPES as LOADED_DTYPES
from dsv41.graph.checkpoint import checkpoint_config, load_checkpoint, load_vision, param_spec
from dsv41.graph.config import ModelArgs
from dsv41.graph.engram import HOST_TABLES, EngramTables, build_tables, load_token_map
from dsv41.graph.layers import (
    BF16,
    bf16_linear,
    engram_gate,
    fp32_linear,
    hc_pre,
    rope_freqs,
    rope_table,
)
from dsv41.graph.plan import FULL, REUSE, ModelPlan, build_plan
from dsv41.graph.sharding import WorkerShard, shard_plan, sliced_spec, worker_slices
from dsv41.graph.vision import SpanRows, check_vision_args, has_vision


@dataclass(frozen=True)
class ExpertStack:
    """A layer's routed experts stacked on a leading expert axis (FP4 codes + E8M0 scales)."""

    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor


# Stored in bf16 but computed in fp32 by the released model: upcast exactly at load.
def _fp32_in_compute(args: ModelArgs, plan: ModelPlan) -> set[str]:
    names = {"head.weight"}
    for p in plan.backbone:
        if p.role == FULL and p.ratio > 1:
            names |= {f"layers.{p.layer}.attn.compressor.wkv.weight",
                      f"layers.{p.layer}.attn.compressor.wgate.weight"}
    if args.dspark_block_size and args.n_mtp_layers:
        last = f"mtp.{args.n_mtp_layers - 1}"
        names |= {f"{last}.markov_head.head.weight", f"{last}.confidence_head.proj.weight"}
    return names


@dataclass
class Model:
    args: ModelArgs
    plan: ModelPlan
    w: dict[str, torch.Tensor]  # official names; FP8/FP4/E8M0 as uint8 codes
    experts: dict[int, ExpertStack]  # by layer id (DSpark layers included)
    engram: EngramTables | None
    freqs: dict[bool, torch.Tensor] = field(default_factory=dict)  # compressed? -> rope freqs
    reference_index_k: bool = True  # see `select`: the released shared index-K pointer
    # Ledger switches (`ledger.py`), each undoing one approximation of the released model; the
    # defaults are the released behaviour. Python constants: under export they pick the code.
    full_reindex: bool = False  # Reindex layers sweep every entry, not the candidate pool
    per_layer_selection: bool = False  # Reuse layers compute their own top-k (see `select`)
    # One worker of a sharded model (`sharding.py`): `w` and `experts` hold this worker's
    # slices (and its rank, `shard.rank`), and the layers meet the other workers through
    # `shard.comm` where the plan says
    shard: WorkerShard | None = None

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: dict[str, torch.Tensor],
                     token_map: np.ndarray | None = None, *,
                     shard: WorkerShard | None = None) -> Model:
        """A model over in-memory weights under their official names: each layer's experts are
        stacked (copied) here. `from_checkpoint` loads them stacked instead. With `shard`,
        `weights` are that worker's (`sharding.worker_slices`: its slices, its experts)."""
        w = dict(weights)
        stacked = {}
        for name, members in expert_stacks(args, shard).items():
            stacked[name] = torch.stack([w.pop(m) for m in members])
        return cls._assemble(args, {**w, **stacked}, token_map, shard)

    @classmethod
    def _assemble(cls, args: ModelArgs, w: dict[str, torch.Tensor],
                  token_map: np.ndarray | None, shard: WorkerShard | None = None) -> Model:
        """The model over weights whose experts are stacked (`expert_stacks` names)."""
        plan = build_plan(args)
        for name in _fp32_in_compute(args, plan):
            if name in w:
                w[name] = w[name].float()
        experts = {}
        for layer in plan.layers:
            prefix = _prefix(args, layer.layer)
            stack = {}
            for k in ("w1", "w3", "w2"):
                stack[k] = w.pop(f"{prefix}.ffn.experts.{k}.weight")
                stack["s" + k[1]] = w.pop(f"{prefix}.ffn.experts.{k}.scale")
            if shard is not None:
                stack = {k: _with_null_expert(v) for k, v in stack.items()}
            experts[layer.layer] = ExpertStack(**stack)
        if shard is not None:
            w["shard.rank"] = torch.tensor([shard.worker], dtype=torch.int64)
        engram = None
        if args.engram_layer_ids:
            tmap = token_map if token_map is not None else load_token_map(args, None)
            engram = build_tables(args, tmap)
        return cls(args, plan, w, experts, engram, model_rope_freqs(args), shard=shard)

    @classmethod
    def host_half(cls, args: ModelArgs, token_map: np.ndarray | None = None) -> Model:
        """What the host half of the phases reads (RoPE tables, Engram hashing, shapes for the
        checks) and no weights (a `placeholder`'s): the controller of workers that hold them."""
        model = cls.placeholder(args)
        model.freqs = model_rope_freqs(args)
        if args.engram_layer_ids:
            model.engram = build_tables(args, token_map if token_map is not None
                                        else load_token_map(args, None))
        return model

    @classmethod
    def placeholder(cls, args: ModelArgs, shard: WorkerShard | None = None) -> Model:
        """A model whose weights have the checkpoint's shapes and dtypes but no storage (zero-
        stride views of one element): what capture and compilation need, at any size. With
        `shard`, that worker's shapes (its slices and experts)."""

        plan = build_plan(args)
        fp32 = _fp32_in_compute(args, plan)
        specs = full = param_spec(args)
        if shard is not None:
            cuts = worker_slices(shard_plan(args, shard.shards), shard.worker)
            specs = {n: sliced_spec(specs[n], cuts[n]) for n in specs if n in cuts}

        def ghost(shape, dtype):
            return torch.zeros((), dtype=dtype).expand(*shape)

        w = {name: ghost(spec.shape, torch.float32 if name in fp32 else LOADED_DTYPES[spec.dtype])
             for name, spec in specs.items() if ".ffn.experts." not in name}
        experts = {}
        for layer in plan.layers:
            prefix = _prefix(args, layer.layer)
            n_routed, _ = args.moe_config(layer.layer)
            held = range(n_routed) if shard is None else shard.experts(n_routed)
            stack = {}
            for k in ("w1", "w3", "w2"):
                spec = full[f"{prefix}.ffn.experts.0.{k}.weight"]
                sspec = full[f"{prefix}.ffn.experts.0.{k}.scale"]
                stack[k] = ghost((len(held) + _null_experts(shard), *spec.shape), torch.uint8)
                stack["s" + k[1]] = ghost((len(held) + _null_experts(shard), *sspec.shape),
                                          torch.uint8)
            experts[layer.layer] = ExpertStack(**stack)
        if shard is not None:
            w["shard.rank"] = torch.tensor([shard.worker], dtype=torch.int64)
        return cls(args, plan, w, experts, None, {}, shard=shard)

    @classmethod
    def from_checkpoint(cls, path: str | Path, args: ModelArgs | None = None, *,
                        device: str | torch.device = "cpu",
                        shard: WorkerShard | None = None) -> Model:
        """Load a checkpoint onto `device` with each tensor stored once: on the CPU aligned
        weights are views of the memory-mapped files; the expert stacks, the weights upcast to
        fp32 and everything on another device are read from the files into their place
        (`checkpoint.load_checkpoint`), so loading needs no second copy of any weight. The
        vision tower's tensors come too when the checkpoint has them. The Engram tables stay in
        host memory whatever `device` is (`engram.host_resident`): their rows are gathered
        there and copied to the device (`ops.engram_rows`).

        With `shard`, one worker of a sharded model: only the tensors it holds are read (its
        experts; its rows or columns of the split tensors, read straight from the files into
        an allocation of the slice's size), never the whole model."""

        args = args or checkpoint_config(path)
        plan = build_plan(args)
        cuts = None if shard is None else worker_slices(shard_plan(args, shard.shards),
                                                        shard.worker)
        weights = load_checkpoint(path, args, device=device, stacks=expert_stacks(args, shard),
                                  owned=_fp32_in_compute(args, plan), only=cuts,
                                  slices=None if cuts is None else
                                  {n: c for n, c in cuts.items() if c is not None},
                                  # a sharded worker's entries gather Engram on its device
                                  host=() if shard is not None else host_tables(args))
        vision = load_vision(path, args)  # None: the checkpoint has no vision tower
        if vision is not None:
            if shard is not None:
                raise ValueError("A sharded model has no vision tower yet; load the checkpoint "
                                 "without a shard to use images.")
            check_vision_args(args)
            weights.update({k: v.to(device) for k, v in vision.items()})
        return cls._assemble(args, weights,
                             load_token_map(args, path) if args.engram_layer_ids else None,
                             shard)

    @property
    def device(self) -> torch.device:
        """Where the weights are (and where a runtime cache for them is allocated)."""
        return self.w["embed.weight"].device

    @property
    def vision(self) -> bool:
        """Whether this model holds a vision tower (the checkpoint's `vision.*` tensors)."""
        return has_vision(self.w)

    def p(self, layer: int, name: str) -> torch.Tensor:
        return self.w[f"{_prefix(self.args, layer)}.{name}"]

    def switches(self) -> dict[str, bool]:
        """The behaviour fields, for rebuilding an equivalent Model (the captured graphs do)."""
        return {"reference_index_k": self.reference_index_k, "full_reindex": self.full_reindex,
                "per_layer_selection": self.per_layer_selection}


def model_rope_freqs(args: ModelArgs) -> dict[bool, torch.Tensor]:
    """RoPE frequencies by kind: compressed layers (YaRN) and window-only layers."""
    return {
        True: rope_freqs(args.rope_head_dim, args.original_seq_len, args.compress_rope_theta,
                         args.rope_factor, args.beta_fast, args.beta_slow),
        False: rope_freqs(args.rope_head_dim, 0, args.rope_theta, args.rope_factor,
                          args.beta_fast, args.beta_slow),
    }


def expert_stacks(args: ModelArgs, shard: WorkerShard | None = None) -> dict[str, list[str]]:
    """Each layer's routed-expert tensors, by the name of their stack: `<layer>.ffn.experts.w1.
    weight` holds `<layer>.ffn.experts.<e>.w1.weight` for e = 0..n_routed-1 (and so on for w2,
    w3 and the scales); with `shard`, only the experts that worker holds."""
    out = {}
    for layer in build_plan(args).layers:
        prefix = _prefix(args, layer.layer)
        n_routed, _ = args.moe_config(layer.layer)
        held = range(n_routed) if shard is None else shard.experts(n_routed)
        for k in ("w1", "w3", "w2"):
            for part in ("weight", "scale"):
                out[f"{prefix}.ffn.experts.{k}.{part}"] = [
                    f"{prefix}.ffn.experts.{e}.{k}.{part}" for e in held]
    return out


def _null_experts(shard: WorkerShard | None) -> int:
    """A worker's expert stack ends with one all-zero expert: the pairs routed to other
    workers' experts go there with weight 0, adding exactly +0 (the oracle's `y[rows] +=`
    keeps one of a row's repeats, all zero; the kernels' route ranks repeats in slot order).
    The compiled worker skips those pairs (`schedules.moe.make_moe_route(null_expert=True)`:
    no tiles, no GEMM work); the oracle computes them (zeros)."""
    return 0 if shard is None else 1


def _with_null_expert(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def _prefix(args: ModelArgs, layer: int) -> str:
    return f"layers.{layer}" if layer < args.n_layers else f"mtp.{layer - args.n_layers}"


def host_tables(args: ModelArgs) -> list[str]:
    """The checkpoint names of the Engram tables, which stay in host memory on any device
    (`engram.host_resident`)."""
    return [f"{_prefix(args, layer)}.{t}" for layer in args.engram_layer_ids for t in HOST_TABLES]


# ---- per-chunk context -------------------------------------------------------------------------


@dataclass
class ChunkTrace:
    """What the blocks of one forward record as they run: the phase's outputs besides its logits
    and the cache, read once the forward returns (`Chunk.trace`)."""

    work: dict[int, int] = field(default_factory=dict)  # token-layer work per layer
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # `record` blocks' outputs
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> top-k
    candidates: torch.Tensor | None = None  # the candidate source's block pool (b, s, B) int32
    candidate_layer: int | None = None  # the candidate source that chose them
    taps: list[torch.Tensor] = field(default_factory=list)  # DSpark tap inputs (b, s, d)
    # a verify pass: the compressors' fp32 (kv, score) rows per KV source (b, s, hd), kept to
    # cut the tails back (`Chunk.keep_tail_rows`)
    tail_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def keyed_selections(self) -> dict[int, torch.Tensor]:
        """The selections under the phase results' keys (`entries.selection_keys`): each index
        source by layer, and the candidate pool under -1 (the entries' `sel.-1` output, the
        scores' `cand_blocks`)."""
        out = {}
        for layer, sel in self.selections.items():  # -1 where the candidate source put it
            out[layer] = sel
            if layer == self.candidate_layer and self.candidates is not None:
                out[-1] = self.candidates
        return out


@dataclass
class Chunk:
    """The inputs the blocks of one forward share, the running state they pass each other
    (`selection`, `blocks`, `token_owner`), and the `trace` of what they output. Positions are
    tensors, one start per sequence, so a batch may mix sequences at different lengths and
    `torch.export` sees no Python ints that depend on the cache (only `length`, which is the
    token dim)."""

    start: torch.Tensor  # int64 (b,): position of the first new token, per sequence
    length: int  # s new tokens (a symbolic dim under export)
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # see `rope_window`
    hash_ids: torch.Tensor | None  # int64 (b, s, n_engram_layers, cols)
    window_floor: torch.Tensor | None = None  # int64 (b,): positions below are outside windows
    write_global: bool = True  # False: cached global entries are read, never rewritten
    update_tails: bool = True  # False: the compressors do not run at all (decoder replay)
    record: tuple[int, ...] = ()  # layers whose block outputs the trace keeps
    image: SpanRows | None = None  # image-span positions of this chunk and their embeddings
    # a verify pass (graph/speculative.py): every token keeps a decode step's semantics. The
    # index-K pointer per token (b, s), moved per token by the sources publishing at it; and
    # the compressors' fp32 rows kept in the trace to cut the tails back
    token_owner: torch.Tensor | None = None
    keep_tail_rows: bool = False
    # running state, block to block
    selection: torch.Tensor | None = None  # latest index source's top-k (b, s, k) int32
    blocks: torch.Tensor | None = None  # candidate pool (b, s, B) int32
    trace: ChunkTrace = field(default_factory=ChunkTrace)

    @property
    def end(self) -> torch.Tensor:
        return self.start + self.length  # (b,)

    @property
    def pos(self) -> torch.Tensor:
        return self.start.unsqueeze(1) + torch.arange(self.length)  # (b, s)

    @property
    def floor(self) -> torch.Tensor:
        if self.window_floor is None:
            return torch.zeros_like(self.start)
        return self.window_floor


def rope_margin(args: ModelArgs) -> int:
    """Rows of the per-chunk RoPE table on each side of the new tokens: compressed entries are
    rotated at their group's first position, which can lie up to ratio-1 before the chunk, and
    the last (incomplete) group slot up to 2*ratio after it."""
    return 2 * max([1, *args.compress_ratios]) + 2


def rope_window(model: Model, start: torch.Tensor, s: int) -> dict[bool, tuple]:
    """cos/sin (b, s + 2M, rd/2) fp32 for positions [start - M, start + s + M), per kind
    (compressed or not). Computed on the host with `torch.polar`, the released model's
    arithmetic (a compiled cos/sin would differ in the last bit)."""
    m = rope_margin(model.args)
    pos = (start.unsqueeze(1) - m + torch.arange(s + 2 * m)).clamp(min=0)
    return {kind: rope_table(model.freqs[kind], pos) for kind in (True, False)}


def token_rope(model: Model, chunk: Chunk, compressed: bool):
    """cos/sin of the new tokens' own positions, (b, s, rd/2)."""
    return _rope_at(model, chunk, chunk.pos, compressed)


def _rope_at(model: Model, chunk: Chunk, positions: torch.Tensor, compressed: bool = True):
    """cos/sin at positions near the chunk, (b, n, rd/2): a gather from the chunk's table (no
    slice with a symbolic end, which the compiler's shape arithmetic handles badly)."""
    m = rope_margin(model.args)
    cos, sin = chunk.rope[compressed]
    # in range by construction: tokens sit at m..m+s-1; an entry of ratio r <= m/2 - 1 is
    # rotated at a group start in [start - r + 1, start + s + r], i.e. rows 1..s + 2m - 1
    idx = (positions - chunk.start.unsqueeze(1) + m).clamp(min=0)
    idx = idx.unsqueeze(-1).expand(-1, -1, cos.size(-1))
    return cos.gather(1, idx), sin.gather(1, idx)


# ---- writes into cache tensors -------------------------------------------------------------------


def put_rows(dst: torch.Tensor, first: torch.Tensor, rows: torch.Tensor,
             ok: torch.Tensor) -> torch.Tensor:
    """dst[b, first[b] + g] = rows[b, g] where ok[b, g]; returns the updated tensor.

    Eagerly this writes in place. Under torch.export it is `ops.scatter_rows`, which the
    compiled entry runs in place on the caller's buffer: only the g new rows are written."""
    if not torch.compiler.is_exporting():
        bi, gi = ok.nonzero(as_tuple=True)
        dst[bi, first[bi] + gi] = rows[bi, gi].to(dst.dtype)
        return dst
    idx = torch.where(ok, first.unsqueeze(1) + torch.arange(rows.size(1)), -1)  # (b, g)
    return ops.scatter_rows(dst, idx, rows.to(dst.dtype))


@dataclass(frozen=True)
class NewEntries:
    """A chunk's new cache entries before their quantiser: `ops.rope_quant`'s arguments."""

    x: torch.Tensor  # bf16 (b, s, d)
    cos: torch.Tensor
    sin: torch.Tensor
    rd: int
    form: ops.EntryFormat
    weight: torch.Tensor | None  # the norm's (None: no norm)
    eps: float = 0.0

    def quantised(self) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rope_quant(self.x, self.cos, self.sin, self.rd, self.form, self.weight,
                              self.eps)

    def windowed(self, codes: torch.Tensor, scales: torch.Tensor, slot: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ring codes, ring scales with the entries in slots slot (b, s), -1: none; buf codes,
        buf scales: the ring as it was then the entries), as one op: compiled, one kernel."""
        return ops.rope_quant_window(codes, scales, slot, self.x, self.cos, self.sin, self.rd,
                                     self.form, self.weight, self.eps)

    def written(self, codes: torch.Tensor, scales: torch.Tensor,
                idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """codes / scales with the entries in rows idx (b, s) (-1: none), as one op: compiled,
        the quantiser writes them in place, no scatter kernels after it."""
        return ops.rope_quant_rows(codes, scales, idx, self.x, self.cos, self.sin, self.rd,
                                   self.form, self.weight, self.eps)


def put_entries(codes: torch.Tensor, scales: torch.Tensor, first: torch.Tensor,
                ok: torch.Tensor, new: NewEntries) -> tuple[torch.Tensor, torch.Tensor]:
    """`put_rows` of the quantised entries into a store's codes and scales: eagerly in place,
    under torch.export `NewEntries.written` (one kernel)."""
    if not torch.compiler.is_exporting():
        c, s = new.quantised()
        return put_rows(codes, first, c, ok), put_rows(scales, first, s, ok)
    idx = torch.where(ok, first.unsqueeze(1) + torch.arange(new.x.size(1)), -1)  # (b, g)
    return new.written(codes, scales, idx)


def live_rows(t: torch.Tensor, chunk: Chunk, ratio: int) -> torch.Tensor:
    """The rows of a global store any query of this chunk can see. Eagerly a slice (faster
    sweeps, same result: rows past a query's visible count are masked anyway); under export
    the whole store (its length is the context dim)."""
    if torch.compiler.is_exporting():
        return t
    return t[:, : max(int(chunk.end.max()) // ratio, 0)]


# ---- window --------------------------------------------------------------------------------------


def window_rows(start: torch.Tensor, s: int, window: int, floor: torch.Tensor) -> torch.Tensor:
    """Window positions each new query attends to, int64 (b, s, window), -1 = nothing there.

    A fresh prefill (start 0) lists [max(0, p-W+1) ...] valid-first, as the released prefill
    does; a continuation lists the last `window` positions oldest first, as the released decode
    does. The two orders matter: the attention kernel walks entries in blocks of 64, and trailing
    -1 entries change nothing. Positions below `floor` are cut (replay segments)."""
    p = start.unsqueeze(1) + torch.arange(s)  # (b, s)
    j = torch.arange(window)
    cont = p.unsqueeze(-1) - window + 1 + j  # (b, s, W)
    fresh = (p - window + 1).clamp(min=0).unsqueeze(-1) + j
    fresh = torch.where((j < s) & (fresh <= p.unsqueeze(-1)), fresh, -1)
    q = torch.where((start == 0).view(-1, 1, 1), fresh, cont)
    return torch.where(q < floor.view(-1, 1, 1), -1, q)


def window_inputs(ring: WindowRing, new: NewEntries, chunk: Chunk, window: int):
    """Write the chunk's entries into the ring; return (codes, scales, idx) for
    `sparse_attend`: a buffer of entries and each query's rows into it.

    One new token (decode): once written, the ring holds every position its window lists
    (p - W + 1 .. p, slot pos % W), so the kernel reads the ring itself, no copy (under export
    the entry is quantised straight into its slot, `NewEntries.written`). A longer chunk
    would overwrite positions its earlier queries still see, so they read a copy of the ring as
    it was (positions before the chunk) followed by the chunk's own entries. Both list the same
    entries in the same order."""
    rows = window_rows(chunk.start, chunk.length, window, chunk.floor)
    s = new.x.size(1)
    if isinstance(s, int) and s == 1:  # a static 1: a token dim captured dynamic takes the copy
        if torch.compiler.is_exporting():  # write_ring's slot of a single new position
            slot = torch.remainder(chunk.start, window).unsqueeze(1)  # (b, 1)
            ring.codes, ring.scales = new.written(ring.codes, ring.scales, slot)
        else:
            write_ring(ring, *new.quantised(), chunk.start, window)
        idx = torch.where(rows < 0, -1, rows % window)
        return ring.codes, ring.scales, idx.to(torch.int32)
    start = chunk.start.view(-1, 1, 1)
    idx = torch.where(rows < start, rows % window, window + rows - start)
    idx = torch.where(rows < 0, -1, idx)
    if torch.compiler.is_exporting():  # the copy, the entries and the ring's slots: one op
        slot = ring_slots(chunk.start, s, window)
        ring.codes, ring.scales, buf_c, buf_s = new.windowed(ring.codes, ring.scales, slot)
        return buf_c, buf_s, idx.to(torch.int32)
    codes, scales = new.quantised()
    buf_c = torch.cat([ring.codes, codes], dim=1)  # (b, W + s, d)
    buf_s = torch.cat([ring.scales, scales], dim=1)
    write_ring(ring, codes, scales, chunk.start, window)
    return buf_c, buf_s, idx.to(torch.int32)


def ring_slots(start: torch.Tensor, s: int, window: int) -> torch.Tensor:
    """(b, s) int64: the ring slot each of s new positions from start writes, -1 for all but
    the last `window` of them (each slot takes the newest position that maps to it)."""
    j = torch.arange(s)
    return torch.where(j >= s - window, torch.remainder(start.unsqueeze(1) + j, window), -1)


def write_ring(ring: WindowRing, codes: torch.Tensor, scales: torch.Tensor,
               start: torch.Tensor, window: int) -> None:
    """Slot j takes the newest new position p with p % window == j, if any. Under
    torch.export the new positions' slots are written in place (`ops.scatter_rows`)."""
    s = codes.size(1)
    if torch.compiler.is_exporting():
        slot = ring_slots(start, s, window)
        ring.codes = ops.scatter_rows(ring.codes, slot, codes)
        ring.scales = ops.scatter_rows(ring.scales, slot, scales)
        return
    last = (start + s - 1).unsqueeze(1)  # (b, 1)
    t = last - torch.remainder(last - torch.arange(window), window)  # (b, W)
    fresh = t >= start.unsqueeze(1)
    src = (t - start.unsqueeze(1)).clamp(0, s - 1)

    def take(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        vals = new.gather(1, src.unsqueeze(-1).expand(-1, -1, new.size(-1)))
        return torch.where(fresh.unsqueeze(-1), vals, old)

    ring.codes = take(codes, ring.codes)
    ring.scales = take(scales, ring.scales)


# ---- attention ---------------------------------------------------------------------------------


@dataclass
class Compressed:
    """A chunk's compressor output: group slots g = 0..G-1 are entries first+g; ok marks the
    ones completed in this chunk (those are new entries)."""

    latent: torch.Tensor  # bf16 (b, G, hd) pre-RoPE
    first: torch.Tensor  # int64 (b,)
    ok: torch.Tensor  # bool (b, G)
    ratio: int

    def positions(self) -> torch.Tensor:
        """An entry is rotated at the position of its group's first token, (b, G)."""
        return (self.first.unsqueeze(1) + torch.arange(self.latent.size(1))) * self.ratio


def compress(model: Model, layer: int, store: GlobalStore, x: torch.Tensor,
             chunk: Chunk) -> Compressed:
    """The KV source's entries for the groups this chunk touches. A partial group at the end
    waits in the store's fp32 tail (updated here); one at the start is completed from it."""
    m = store.ratio
    s = chunk.length
    if m == 1:
        latent = ops.rms_norm(bf16_linear(x, model.p(layer, "attn.compressor.wkv.weight")),
                              model.p(layer, "attn.compressor.norm.weight"), model.args.norm_eps)
        ok = torch.full_like(x[..., 0], True, dtype=torch.bool)
        return Compressed(latent, chunk.start, ok, 1)
    wkv, wgate = (model.p(layer, f"attn.compressor.{n}.weight") for n in ("wkv", "wgate"))
    if not chunk.keep_tail_rows or torch.compiler.is_exporting():
        # (compiled, every row runs the decode step's GEMV kernel: the same fp32 bits)
        kv = fp32_linear(x, wkv)  # (b, s, hd) fp32
        score = fp32_linear(x, wgate)
    else:  # an eager verify pass: per position, at a decode step's GEMM shape
        kv = torch.cat([fp32_linear(x[:, i:i + 1], wkv) for i in range(s)], dim=1)
        score = torch.cat([fp32_linear(x[:, i:i + 1], wgate) for i in range(s)], dim=1)
    if chunk.keep_tail_rows:  # a verify pass keeps them to cut the tails back
        chunk.trace.tail_rows[layer] = (kv, score)
    start, end = chunk.start.unsqueeze(1), chunk.end.unsqueeze(1)  # (b, 1)
    g0 = chunk.start // m  # (b,)
    n_slots = s // m + 2  # enough group slots for any start % m
    member = (g0.view(-1, 1, 1) + torch.arange(n_slots).view(1, -1, 1)) * m + torch.arange(m)
    bi = torch.arange(kv.size(0)).view(-1, 1, 1)  # member: (b, G, m) positions of every slot

    def gather_members(new: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        from_new = new[bi, (member - start.unsqueeze(-1)).clamp(0, s - 1)]  # (b, G, m, hd)
        from_tail = tail[bi, member % m]
        return torch.where((member < start.unsqueeze(-1)).unsqueeze(-1), from_tail, from_new)

    g_kv = gather_members(kv, store.tail_kv)
    g_score = gather_members(score, store.tail_score)
    # the new tail: the members of the partial group at `end`, if any
    t_pos = (chunk.end // m).unsqueeze(1) * m + torch.arange(m)  # (b, m)
    t_ok = (t_pos < end).unsqueeze(-1)
    t_src = (t_pos - start).clamp(0, s - 1).unsqueeze(-1).expand(-1, -1, kv.size(-1))
    old_kv, old_score = store.tail_kv, store.tail_score
    store.tail_kv = torch.where(t_ok, torch.where((t_pos < start).unsqueeze(-1), old_kv,
                                                  kv.gather(1, t_src)), 0.0)
    store.tail_score = torch.where(t_ok, torch.where((t_pos < start).unsqueeze(-1), old_score,
                                                     score.gather(1, t_src)), float("-inf"))
    pooled = (g_kv * g_score.softmax(dim=2)).sum(dim=2)  # (b, G, hd): softmax_pool, grouped
    latent = ops.rms_norm(pooled.to(BF16), model.p(layer, "attn.compressor.norm.weight"),
                          model.args.norm_eps)
    ok = (g0.unsqueeze(1) + torch.arange(n_slots) + 1) * m <= end  # group complete by `end`
    return Compressed(latent, g0, ok, m)


def publish_index_k(model: Model, layer: int, store: GlobalStore, c: Compressed,
                    chunk: Chunk) -> None:
    a = model.args
    cos, sin = _rope_at(model, chunk, c.positions())
    new = NewEntries(bf16_linear(c.latent, model.p(layer, "attn.indexer.wk.weight")), cos, sin,
                     a.rope_head_dim, ops.EntryFormat.MXFP4,
                     model.p(layer, "attn.indexer.k_norm.weight"), a.norm_eps)
    store.k_codes, store.k_scales = put_entries(store.k_codes, store.k_scales, c.first, c.ok,
                                                new)


def publish_main_kv(model: Model, store: GlobalStore, c: Compressed, chunk: Chunk,
                    kv_dtype: str) -> None:
    a = model.args
    cos, sin = _rope_at(model, chunk, c.positions())
    if kv_dtype == "bf16":
        latent = ops.rope(c.latent, cos, sin, a.rope_head_dim, False)
        store.kv_codes = put_rows(store.kv_codes, c.first, latent, c.ok)
        return
    new = NewEntries(c.latent, cos, sin, a.rope_head_dim, ops.EntryFormat.FP4_KV, None)
    store.kv_codes, store.kv_scales = put_entries(store.kv_codes, store.kv_scales, c.first,
                                                  c.ok, new)


@dataclass
class IndexKeys:
    """The index K an indexer reads: its source's store, and under the released shared pointer
    the other stores it may read instead (`alt_*`, with `pick` int64: 0 = own, i = alt i-1; (b,)
    per sequence, or (b, s) per token in a verify pass)."""

    codes: torch.Tensor  # (b, T, di/2)
    scales: torch.Tensor  # (b, T, di/32)
    alt_codes: list[torch.Tensor] = field(default_factory=list)
    alt_scales: list[torch.Tensor] = field(default_factory=list)
    pick: torch.Tensor | None = None

    def materialised(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys as one tensor pair (a copy when there are alternates)."""
        if not self.alt_codes:
            return self.codes, self.scales
        return ops.shared_index_k(self.codes, self.scales, self.alt_codes, self.alt_scales,
                                  self.pick)


def index_keys(model: Model, cache: ModelCache, store: GlobalStore, chunk: Chunk) -> IndexKeys:
    """The index K an indexer reads. The released model reads it through one shared pointer
    that only a publishing KV source moves: in a decode step where a ratio-2 group is still
    filling, its indexer scores the keys of the last source that did publish (the ratio-1
    source). `model.reference_index_k` keeps that behaviour, which the released outputs carry;
    off, each indexer reads its own source. The pointer is per sequence (`cache.index_owner`):
    it becomes `pick`, an argument of the sweep, never a copy of a store."""
    keys = IndexKeys(live_rows(store.k_codes, chunk, store.ratio),
                     live_rows(store.k_scales, chunk, store.ratio))
    if not model.reference_index_k:
        return keys
    # a verify pass moves the pointer per token: pick is then (b, s)
    owner_now = cache.index_owner if chunk.token_owner is None else chunk.token_owner
    pick = torch.zeros_like(owner_now)
    for owner, other in cache.stores.items():
        if other is store or other.k_codes is None or other.ratio > store.ratio:
            continue
        # the other source's store holds ratio/other.ratio times as many rows (capacities are
        # multiples of the largest ratio): its first T rows are the entries read
        keys.alt_codes.append(other.k_codes)
        keys.alt_scales.append(other.k_scales)
        pick = torch.where(owner_now == owner, len(keys.alt_codes), pick)
    keys.pick = pick if keys.alt_codes else None
    return keys


def select(model: Model, cache: ModelCache, layer: int, store: GlobalStore, x: torch.Tensor,
           qr: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The top-k entry ids per query of an index source, int32 (b, s, topk), -1 padded.

    Called for a Reuse layer (`model.per_layer_selection`), it is the top-k that layer's index
    source would pick if it sat here: the source's indexer weights (`wq_b`, `weights_proj`) on
    this layer's own `qr` and `x`, over the same index K, with the source's search (a full
    sweep after the candidate source, the pool after a Reindex layer); it does not publish a
    new candidate pool. Reuse layers have no indexer weights of their own to use instead.
    With `model.full_reindex`, the pool is ignored and every visible entry is swept."""
    a, p = model.args, model.plan.layers[layer]
    src = model.plan.layers[p.index_source]  # p itself for an index source
    cos, sin = token_rope(model, chunk, True)
    q = ops.fp8_linear(qr, model.p(src.layer, "attn.indexer.wq_b.weight"),
                       model.p(src.layer, "attn.indexer.wq_b.scale"))
    q = ops.rope(q.unflatten(-1, (a.index_n_heads, a.index_head_dim)), cos, sin,
                 a.rope_head_dim, False)
    q = ops.qdq_mxfp4(q)
    weights = bf16_linear(x, model.p(src.layer, "attn.indexer.weights_proj.weight")) * (
        a.index_head_dim**-0.5 * a.index_n_heads**-0.5)
    lens = (chunk.pos + 1) // store.ratio  # (b, s) entries visible to each query
    keys = index_keys(model, cache, store, chunk)
    full_sweep = not p.candidate_source and not (src.uses_candidates and not model.full_reindex)
    if full_sweep and keys.pick is not None and (keys.pick.dim() == 2
                                                 or torch.compiler.is_exporting()):
        # one sweep, each token over the store its pick names (a verify pass's pointer moves
        # per token; a decode or prefill chunk's is per sequence)
        pick = keys.pick if keys.pick.dim() == 2 else keys.pick.unsqueeze(1).expand(-1, q.size(1))
        return ops.indexer_topk_shared(q, keys.codes, keys.scales, keys.alt_codes,
                                       keys.alt_scales, pick, weights, lens, a.index_topk)
    if keys.pick is not None and keys.pick.dim() == 2:
        raise ValueError("A per-token index-K pointer is supported for full sweeps only.")
    # eager, and the candidate / pool sweeps (whose sources have no lower-ratio source to
    # share a pointer with in any preset): the keys as one tensor pair
    kc, ks = keys.materialised()
    if p.candidate_source:
        idx, chunk.blocks = ops.hier_topk(q, kc, ks, weights, lens, a.index_topk,
                                          a.candidate_topk_blocks, a.candidate_block_size)
    elif not full_sweep:
        idx = ops.pool_topk(q, kc, ks, weights, lens, chunk.blocks, a.index_topk,
                            a.candidate_block_size)
    else:
        idx = ops.indexer_topk(q, kc, ks, weights, lens, a.index_topk)
    return idx


def run_compressor(model: Model, cache: ModelCache, layer: int, x: torch.Tensor,
                   chunk: Chunk) -> Compressed | None:
    """A KV source's compressor; moves the index-K pointer of the sequences whose entries it
    completed. Entries are published by the caller (after the indexer ran, as the reference
    orders it), and only when the chunk writes global state."""
    p = model.plan.layers[layer]
    if p.role != FULL or not chunk.update_tails:
        return None
    store = cache.stores[layer]
    c = compress(model, layer, store, x, chunk)
    if p.owns_index_k:
        if chunk.write_global:
            publish_index_k(model, layer, store, c, chunk)
        cache.index_owner = torch.where(c.ok.any(dim=1), layer, cache.index_owner)
        if chunk.token_owner is not None:  # the tokens that complete a group publish
            done = torch.remainder(chunk.pos + 1, store.ratio) == 0  # (b, s)
            chunk.token_owner = torch.where(done, layer, chunk.token_owner)
    return c


def attend(model: Model, cache: ModelCache, layer: int, q: torch.Tensor, cos, sin, win,
           store: GlobalStore | None, idx: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """sparse_attend of the RoPE'd queries over (window buffer, global store), its output
    rotated back: what the grouped output projection reads. q (b, s, h, hd) unrotated; with FP4
    global entries one op (`sparse_attend_rope`: on a CPU, one kernel)."""
    a = model.args
    rd = a.rope_head_dim
    buf_c, buf_s, win_idx = win
    sink = model.p(layer, "attn.attn_sink")
    scale = a.head_dim**-0.5
    if store is not None and cache.kv_dtype != "fp4":
        o = ops.sparse_attend_bf16(ops.rope(q, cos, sin, rd, False), buf_c, buf_s, win_idx,
                                   live_rows(store.kv_codes, chunk, store.ratio), idx, sink,
                                   scale)
        return ops.rope(o, cos, sin, rd, True)
    if store is None:
        # no global store: one never-selected row and an all -1 selection (no zero-size
        # tensors, which compiled loop nests handle badly)
        kv_c = buf_c[:, :1, : a.head_dim // 2]
        kv_s = buf_c[:, :1, : a.head_dim // 16]
    else:
        kv_c = live_rows(store.kv_codes, chunk, store.ratio)
        kv_s = live_rows(store.kv_scales, chunk, store.ratio)
    return ops.sparse_attend_rope(q, cos, sin, rd, buf_c, buf_s, win_idx, kv_c, kv_s, idx, sink,
                                  scale)


def attention(model: Model, cache: ModelCache, layer: int, x: torch.Tensor, chunk: Chunk):
    a, p = model.args, model.plan.layers[layer]
    b, s, _ = x.shape
    rd = a.rope_head_dim
    cos, sin = token_rope(model, chunk, p.ratio > 0)
    wq_a, wkv, wq_b = ((model.p(layer, f"attn.{n}.weight"), model.p(layer, f"attn.{n}.scale"))
                       for n in ("wq_a", "wkv", "wq_b"))
    q_norm = model.p(layer, "attn.q_norm.weight")
    qr = None  # the normed q_lora: the indexers read it too
    if p.runs_indexer or (p.role == REUSE and model.per_layer_selection):
        # wq_a and wkv read the same x: one op (x quantised once)
        q_lora, kv = ops.fp8_linear_pair(x, *wq_a, *wkv)
        qr = ops.rms_norm(q_lora, q_norm, a.norm_eps)
        q = ops.fp8_linear(qr, *wq_b)
    else:  # wq_b alone reads q_lora: q = wq_b(norm(wq_a x)) and kv = wkv x, one op
        q, kv = ops.fp8_q_kv(x, *wq_a, *wkv, q_norm, a.norm_eps, *wq_b)
    # (b, s, h, hd): h = n_heads, or a worker's heads (its rows of wq_b); RoPE'd in `attend`
    q = q.unflatten(-1, (-1, a.head_dim))

    new = NewEntries(kv, cos, sin, rd, ops.EntryFormat.FP8,
                     model.p(layer, "attn.kv_norm.weight"), a.norm_eps)
    win = window_inputs(cache.windows[layer], new, chunk, a.window_size)  # writes the ring

    store, idx = None, torch.full_like(x[..., :1], -1, dtype=torch.int32)  # (b, s, 1): none
    if p.ratio:
        store = cache.stores[p.kv_source]
        c = run_compressor(model, cache, layer, x, chunk)
        if p.runs_indexer:
            chunk.selection = select(model, cache, layer, store, x, qr, chunk)
            chunk.trace.selections[layer] = chunk.selection
            if p.candidate_source:
                chunk.trace.candidates, chunk.trace.candidate_layer = chunk.blocks, layer
        idx = chunk.selection
        if p.role == REUSE and model.per_layer_selection:
            idx = chunk.trace.selections[layer] = select(model, cache, layer, store, x, qr, chunk)
        if c is not None and chunk.write_global:
            publish_main_kv(model, store, c, chunk, cache.kv_dtype)
    return output_proj(model, layer, attend(model, cache, layer, q, cos, sin, win, store, idx,
                                            chunk))


def output_proj(model: Model, layer: int, o: torch.Tensor) -> torch.Tensor:
    """The grouped wo_a and wo_b of the attention output (its RoPE already undone)."""
    a = model.args
    b, s = o.shape[:2]
    wo_a = model.p(layer, "attn.wo_a.weight")
    groups = wo_a.size(0) // a.o_lora_rank  # o_groups, or a worker's (its rows of wo_a)
    o = o.reshape(b, s, groups, -1)  # (b, s, g, h*hd/g)
    if a.wo_a_dtype == "fp8":  # the hub's FP8 form, dequantized inside (the same bf16 values)
        o = ops.fp8_grouped_linear(o, wo_a, model.p(layer, "attn.wo_a.scale"))
    else:
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a.view(groups, a.o_lora_rank, -1))
    return row_parallel(model, o.flatten(2), model.p(layer, "attn.wo_b.weight"),
                        model.p(layer, "attn.wo_b.scale"))


def row_parallel(model: Model, x: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor:
    """fp8_linear whose input columns may be split over workers (`wo_b`): a worker's fp32
    partial sum over its columns, all-reduced, then rounded to bf16 once, as one worker
    rounds. Only the order of the fp32 additions differs from one worker (K in N parts)."""
    if model.shard is None:
        return ops.fp8_linear(x, weight, scale)
    return model.shard.comm.all_reduce(ops.fp8_linear_f32(x, weight, scale)).to(BF16)


# ---- MoE -----------------------------------------------------------------------------------------


def moe(model: Model, layer: int, x: torch.Tensor,
        vl_mask: torch.Tensor | None = None) -> torch.Tensor:
    """vl_mask bool (b, s): image-span positions, whose experts are picked with `bias_vl`
    (the routing weights still come from the unbiased scores)."""
    a = model.args
    shape = x.shape
    x = x.reshape(-1, a.dim)
    _, k = a.moe_config(layer)
    logits = fp32_linear(x, model.p(layer, "ffn.gate.weight"))
    bias = model.p(layer, "ffn.gate.bias")  # (E,)
    if vl_mask is not None:
        bias = torch.where(vl_mask.reshape(-1, 1), model.p(layer, "ffn.gate.bias_vl"), bias)
    norm, scale = bool(a.norm_topk_prob), float(a.route_scale)
    if a.score_func == "softmax":
        weights, ids = ops.route_topk((logits / a.gate_temp).softmax(dim=-1), bias, k, norm,
                                      scale)
    elif a.score_func == "sigmoid":
        weights, ids = ops.route_topk((logits / a.gate_temp).sigmoid(), bias, k, norm, scale)
    else:  # sqrt(softplus): the score inside the top-k's op (one kernel)
        weights, ids = ops.route_topk_logits(logits, bias, k, norm, scale, float(a.gate_temp))
    ex = model.experts[layer]
    if model.shard is not None:  # expert parallel: this worker's experts, the rest to its null
        n_routed, _ = a.moe_config(layer)
        held = ex.w1.size(0) - 1  # the stack ends with the null expert
        first = shard_first(model, n_routed)  # (1,) this worker's first expert id
        mine = (ids >= first) & (ids < first + held)
        ids = torch.where(mine, ids - first, held)
        weights = torch.where(mine, weights, 0.0)
    if model.shard is None:  # routed (fp32) + shared (bf16), rounded to bf16 once: one op
        return ops.moe_experts_plus(x, weights, ids, ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2,
                                    a.swiglu_limit, shared_expert(model, layer, x)).view(shape)
    y = ops.moe_experts(x, weights, ids, ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2,
                        a.swiglu_limit)  # (n, d) fp32: this worker's experts' terms
    # one all-reduce for both partial sums; the shared one rounded once, as unsplit
    both = model.shard.comm.all_reduce(torch.stack([y, shared_expert(model, layer, x)]))
    y = both[0] + both[1].to(BF16)  # (n, d) fp32, as fp32 routed + bf16 shared unsplit
    return y.type_as(x).view(shape)


def shared_expert(model: Model, layer: int, x: torch.Tensor) -> torch.Tensor:
    """bf16 (n, d); a sharded worker's is its fp32 partial sum (w1 / w3 rows, w2 columns)."""
    w1, w3, w2 = ((model.p(layer, f"ffn.shared_experts.{n}.weight"),
                   model.p(layer, f"ffn.shared_experts.{n}.scale")) for n in ("w1", "w3", "w2"))
    g, u = ops.fp8_linear_pair(x, *w1, *w3)
    if model.shard is None:  # SwiGLU and w2 one op (one kernel in decode)
        return ops.swiglu_fp8_linear(g, u, model.args.swiglu_limit, *w2)
    h = ops.swiglu(g.float(), u.float(), model.args.swiglu_limit)
    return ops.fp8_linear_f32(h.to(BF16), *w2)


# ---- Engram and the block ------------------------------------------------------------------------


def engram(model: Model, layer: int, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
    """hash_ids (b, s, E, cols) int64 of every Engram layer, validated against the table sizes
    by the caller. The tables may live in host memory while h is on a GPU: their rows come to
    h's device."""
    a = model.args
    codes, scales = ops.engram_rows(hash_ids, a.engram_layer_ids.index(layer),
                                    model.p(layer, "engram.embed.weight"),
                                    model.p(layer, "engram.embed.scale"))
    if codes.device != h.device:  # (b, s, cols, ed), (b, s, cols, ed/32)
        codes, scales = codes.to(h.device), scales.to(h.device)
    values = ops.fp8_dequant(codes, scales).to(BF16)
    kv = ops.fp8_linear(values.flatten(-2), model.p(layer, "engram.wkv.weight"),
                        model.p(layer, "engram.wkv.scale"))
    key, value = kv.split([a.hc_mult * a.dim, a.dim], dim=-1)
    key = key.float().unflatten(-1, (a.hc_mult, a.dim))
    return engram_gate(h, key, value, model.p(layer, "engram.q_weight"),
                       model.p(layer, "engram.k_weight"), a.norm_eps)


def engram_at(model: Model, layer: int, h: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """A block's Engram over the chunk; image-span positions pass through (gate 0 there)."""
    out = engram(model, layer, h, chunk.hash_ids)  # (b, s, hc, d)
    if chunk.image is None:
        return out
    return torch.where(chunk.image.mask[:, :, None, None], h, out)


@dataclass(frozen=True)
class SublayerExit:
    """A block's FFN output not yet mixed back into the stream: `hc_post(f, h, post, comb)`,
    left for the next block's first kernel (`ops.hc_post_pre_mix`: the exit and the next
    attention's entry as one) or for `settle`."""

    f: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def settle(h: torch.Tensor, pending: SublayerExit | None) -> torch.Tensor:
    """The stream with a pending exit mixed in."""
    return h if pending is None else ops.hc_post(pending.f, h, pending.post, pending.comb)


def block(model: Model, cache: ModelCache, layer: int, h: torch.Tensor, pre: torch.Tensor,
          chunk: Chunk, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: attention then MoE, each between hc_pre and hc_post. The attention collapses
    with the previous block's FFN `pre` (single-pass lag); the FFN with this block's attention
    `pre`. Returns the new stream and this block's FFN `pre`."""
    h, pre, _ = block_step(model, cache, layer, h, pre, chunk, attn=attn)
    return h, pre


def block_step(model: Model, cache: ModelCache, layer: int, h: torch.Tensor, pre: torch.Tensor,
               chunk: Chunk, *, attn=None, pending: SublayerExit | None = None,
               defer: bool = False) -> tuple[torch.Tensor, torch.Tensor, SublayerExit | None]:
    """`block`, from a stream h that may still owe the previous block's exit (`pending`), and
    (`defer`) leaving its own FFN exit pending where nothing reads the stream in between: its
    hc_post then runs in the next block's first kernel. Returns (h, the FFN's pre, the exit
    left pending or None); the values are those of `block`, bit for bit (the fused op is the
    two in turn)."""
    a, p = model.args, model.plan.layers[layer]
    if pending is not None and (p.engram or p.dspark_tap):  # these read the stream itself
        h, pending = settle(h, pending), None
    if p.engram:
        h = engram_at(model, layer, h, chunk)
    if p.dspark_tap:
        chunk.trace.taps.append(h.mean(dim=2))
    mix = (a.hc_mult, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps)
    entry = (model.p(layer, "hc_attn_fn"), model.p(layer, "hc_attn_scale"),
             model.p(layer, "hc_attn_base"), pre, model.p(layer, "attn_norm.weight"), *mix)
    # x = rms_norm(hc_pre(h, pre)) with this sublayer's mixes of h: (b, s, d), (b, s, hc), ...
    if pending is None:
        x, attn_pre, post, comb = ops.hc_pre_mix(h, *entry)
    else:  # the previous block's FFN exit and this attention's entry, one op
        h, x, attn_pre, post, comb = ops.hc_post_pre_mix(pending.f, h, pending.post,
                                                         pending.comb, *entry)
    # the attention's hc_post and the FFN's hc_pre_mix, one op: h' and the FFN's entry
    h, x, ffn_pre, post, comb = ops.hc_post_pre_mix(
        (attn or attention)(model, cache, layer, x, chunk), h, post, comb,
        model.p(layer, "hc_ffn_fn"), model.p(layer, "hc_ffn_scale"),
        model.p(layer, "hc_ffn_base"), attn_pre, model.p(layer, "ffn_norm.weight"), *mix)
    vl = chunk.image.mask if chunk.image is not None and layer < a.n_layers else None
    f = moe(model, layer, x, vl)
    chunk.trace.work[layer] = chunk.trace.work.get(layer, 0) + chunk.length
    if defer and layer not in chunk.record:
        return h, ffn_pre, SublayerExit(f, post, comb)
    h = ops.hc_post(f, h, post, comb)  # (b, s, hc, d)
    if layer in chunk.record:
        chunk.trace.hidden[layer] = h
    return h, ffn_pre, None


def run_layers(model: Model, cache: ModelCache, h: torch.Tensor, pre: torch.Tensor,
               layers: range, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks in turn, each block's FFN exit fused into the next block's entry."""
    pending = None
    for layer in layers:
        h, pre, pending = block_step(model, cache, layer, h, pre, chunk, pending=pending,
                                     defer=True)
    return settle(h, pending), pre


def final_norm(model: Model, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """What the head reads: norm(hc_pre(h)) with the last block's FFN mix, bf16 (b, s, d)."""
    return ops.rms_norm(hc_pre(h, pre), model.w["norm.weight"], model.args.norm_eps)


def head(model: Model, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits (b, s, V). A sharded worker holds a slice of the vocabulary's rows: its
    logits are all-gathered (exact: only data moves)."""
    logits = torch.nn.functional.linear(x.float(), model.w["head.weight"])  # (b, s, V or V/N)
    if model.shard is None:
        return logits
    full = model.shard.comm.all_gather(logits.permute(2, 0, 1))  # (V, b, s), workers in order
    return full.permute(1, 2, 0)


def shard_first(model: Model, n: int) -> torch.Tensor:
    """This worker's first index of n items split in contiguous blocks over the workers
    (`sharding.expert_block`), int64 (1,). Computed from the rank the worker's weights hold
    (`shard.rank`), not from a Python int, so one compiled library serves every worker."""
    shards, rank = model.shard.shards, model.w["shard.rank"]
    if n % shards == 0:
        return rank * (n // shards)
    return (rank * n + shards - 1) // shards  # uneven expert blocks (one library per worker)


def embed_rows(model: Model, ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings (..., d) bf16. A sharded worker holds a slice of the vocabulary's rows:
    it looks up the ids in its slice, zeros elsewhere, and the workers' rows are all-reduced
    (exact: exactly one worker contributes a non-zero row)."""
    table = model.w["embed.weight"]
    if model.shard is None:
        return table[ids]
    first = shard_first(model, model.args.vocab_size)  # (1,) this worker's first row
    mine = (ids >= first) & (ids < first + table.size(0))
    local = table[torch.where(mine, ids - first, 0)]  # (..., d)
    return model.shard.comm.all_reduce(torch.where(mine.unsqueeze(-1), local, 0.0).to(BF16))
