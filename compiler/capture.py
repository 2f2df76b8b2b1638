"""Capture: the phase graphs of `dsv41.graph` as torch.export programs with symbolic token,
context and batch dims.

Each entry is the pure-tensor half of a phase function (`forward_all`, `encode_layers`,
`decode_layers`, `dspark.draft`, `speculative.verify_forward`); the host half (token and id
validation, Engram hashing, RoPE tables, capacity) stays in Python and becomes the runtime's
job. The cache is passed in as a flat list of tensors and the updated tensors are returned in
the same order: TVM's importer drops torch.export's input mutations, so every cache write is an
explicit output. Weights are module parameters, so they stay parameters of the compiled function
and are never baked in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.export import Dim

from dsv41.graph import dspark, speculative
from dsv41.graph.cache import ModelCache, new_cache
from dsv41.graph.checkpoint import RETURNED_DTYPES, vision_spec
from dsv41.graph.entries import (
    ENTRIES,
    SELECTING,
    VISION_ENTRY,
    cache_names,
    cache_tensor,
    cache_tensors,
    cache_view,
    selection_keys,
    tail_row_layers,
    takes_spans,
)
from dsv41.graph.model import Chunk, ExpertStack, Model, rope_margin
from dsv41.graph.phases import decode_layers, encode_layers, forward_all
from dsv41.graph.vision import tower, unpacked_rows

# ---- the entry module -------------------------------------------------------------------------


def _param_name(name: str) -> str:
    return name.replace(".", "__")


class PhaseGraph(torch.nn.Module):
    """One entry of the artifact. Weights are parameters under their official names (dots
    become double underscores); the stacked routed experts are `experts__<layer>__w1` etc."""

    def __init__(self, model: Model, entry: str, template: ModelCache):
        super().__init__()
        if entry not in ENTRIES:
            raise ValueError(f"Unknown entry {entry!r}; entries: {', '.join(ENTRIES)}.")
        if template.kv_dtype != "fp4":
            raise ValueError("Only the FP4 cache is compiled; bf16 KV is a graph-only ledger "
                             "switch.")
        self.args, self.plan, self.entry, self.template = model.args, model.plan, entry, template
        self.switches = model.switches()  # Python constants: they choose the traced code
        self.shard = model.shard  # a sharded worker's graph: its collectives are export ops
        self.spans = takes_spans(model.args, entry)
        weights = dict(model.w)
        if self.spans:  # the gates' `bias_vl`, which the span positions route with
            weights.update({n: w for n, w in _vision_ghosts(model.args).items()
                            if n.endswith(".ffn.gate.bias_vl") and n not in weights})
        self.weight_names = sorted(weights)
        for name in self.weight_names:
            self.register_parameter(_param_name(name),
                                    torch.nn.Parameter(weights[name], requires_grad=False))
        for layer, ex in model.experts.items():
            for k in ("w1", "s1", "w3", "s3", "w2", "s2"):
                self.register_parameter(f"experts__{layer}__{k}",
                                        torch.nn.Parameter(getattr(ex, k), requires_grad=False))

    def _model(self) -> Model:
        w = {name: getattr(self, _param_name(name)) for name in self.weight_names}
        experts = {layer: ExpertStack(**{k: getattr(self, f"experts__{layer}__{k}")
                                         for k in ("w1", "s1", "w3", "s3", "w2", "s2")})
                   for layer in sorted({p.layer for p in self.plan.layers})}
        return Model(self.args, self.plan, w, experts, None, {}, shard=self.shard,
                     **self.switches)

    def new_chunk(self, start, floor, s, ropes, hash_ids, **flags) -> Chunk:
        return Chunk(start=start, length=s, rope={True: (ropes[0], ropes[1]),
                                                  False: (ropes[2], ropes[3])},
                     hash_ids=hash_ids, window_floor=floor, **flags)

    def forward(self, x, start, floor, cos_c, sin_c, cos_u, sin_u, hash_ids, *cache_in):
        """x: tokens (b, s) int64, or for `decoder` the encoder stream (h, pre) as a pair, or
        for `verify` (tokens, each token's index-K pointer before it), both (b, n) int64;
        for the entries that prefill a model with a vision tower (`entries.takes_spans`), x
        ends with the chunk's span rows (span_index (b, s) int64, span_rows (n + 1, d) bf16:
        `vision.packed_rows`); start/floor (b,) int64; RoPE tables (b, s + 2M, rd/2); hash_ids
        (b, s, E, cols) int64 (an empty (b, s, 0, 0) when the model has no Engram); then the
        cache tensors."""
        model = self._model()
        image = None
        if self.spans:
            *x, span_index, span_rows = x
            x = tuple(x) if len(x) > 1 else x[0]
            image = unpacked_rows(span_index, span_rows)
        cache = cache_view(self.template, cache_in, start)
        ropes = (cos_c, sin_c, cos_u, sin_u)
        ids = hash_ids if model.args.engram_layer_ids else None
        if self.entry == "draft":
            n = self.args.dspark_block_size
            chunk = self.new_chunk(start, None, n, ropes, None)
            d = dspark.draft(model, cache, x, chunk)
            return d.ids, d.logits, d.confidence
        if self.entry == "verify":  # one pass over the sampled token and a draft prefix
            tokens, owner = x
            chunk = self.new_chunk(start, floor, tokens.size(1), ropes, ids, token_owner=owner,
                                   keep_tail_rows=True)
            logits = speculative.verify_forward(model, cache, tokens, chunk)
            rows = chunk.trace.tail_rows
            tails = [t for lay in tail_row_layers(self.template) for t in rows[lay]]
            return (logits, *tails, *cache_tensors(cache))
        if self.entry == "decoder":
            h, pre = x
            chunk = self.new_chunk(start, floor, h.size(1), ropes, ids, write_global=False,
                                   update_tails=False, image=image)
            logits, _, _ = decode_layers(model, cache, h, pre, chunk, all_logits=True)
            return (logits, *cache_tensors(cache))
        chunk = self.new_chunk(start, floor, x.size(1), ropes, ids,
                               write_global=self.entry != "encoder_replay", image=image)
        if self.entry in ("encoder", "encoder_replay"):
            h, pre = encode_layers(model, cache, x, chunk)
            return (h, pre, *cache_tensors(cache))
        logits, _, _ = forward_all(model, cache, x, chunk, all_logits=self.entry == "prefill_all")
        sel = [chunk.trace.keyed_selections()[k] for k in selection_keys(self.plan)] \
            if self.entry in SELECTING else []
        return (logits, *sel, *cache_tensors(cache))


# ---- example inputs and dynamic shapes -------------------------------------------------------


def _verify_max(args) -> int:
    """The verify entry's token bound (`speculative.verify_tokens`), which needs a DSpark block
    (a pass of one token is a decode step, and torch.export would specialise a dim of 1)."""
    n = speculative.verify_tokens(args)
    if n < 2:
        raise ValueError("The verify entry needs a model with a DSpark block (dspark_block_size "
                         ">= 1) and a window of at least 2 tokens.")
    return n


@dataclass(frozen=True)
class CaptureShapes:
    batch: int = 2  # not 1: torch.export specialises size-1 dims
    tokens: int = 7  # example token count (prefill / encoder entries)
    context: int = 64  # example context capacity in tokens
    max_tokens: int = 1 << 20
    max_context: int = 1 << 21
    max_batch: int = 64


def example_inputs(model: Model, entry: str, shapes: CaptureShapes):
    """Example inputs for `entry` and the cache template they imply."""
    a = model.args
    b = shapes.batch
    s = {"decode": 1, "draft": a.dspark_block_size,
         "decoder": min(shapes.tokens, a.window_size),
         "verify": min(shapes.tokens, _verify_max(a))}.get(entry, shapes.tokens)
    template = new_cache(model.plan, b, shapes.context)
    m = rope_margin(a)
    half = a.rope_head_dim // 2
    ropes = [torch.zeros(b, s + 2 * m, half) for _ in range(4)]
    n_eng = len(a.engram_layer_ids)
    cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads if n_eng else 0
    hash_ids = torch.zeros(b, s, n_eng, cols, dtype=torch.int64)
    start = torch.full((b,), 3, dtype=torch.int64)
    floor = torch.zeros(b, dtype=torch.int64)
    if entry == "draft":
        x = torch.zeros(b, dtype=torch.int64)
    elif entry == "decoder":
        x = (torch.zeros(b, s, a.hc_mult, a.dim, dtype=torch.bfloat16),
             torch.zeros(b, s, a.hc_mult, dtype=torch.float32))
    elif entry == "verify":
        x = (torch.zeros(b, s, dtype=torch.int64), torch.zeros(b, s, dtype=torch.int64))
    else:
        x = torch.zeros(b, s, dtype=torch.int64)
    if takes_spans(a, entry):  # two span rows and the zero row (not 1: it would specialise)
        x = (*(x if isinstance(x, tuple) else (x,)), torch.zeros(b, s, dtype=torch.int64),
             torch.zeros(3, a.dim, dtype=torch.bfloat16))
    return (x, start, floor, *ropes, hash_ids, *cache_tensors(template)), template


def dynamic_shapes(model: Model, entry: str, template: ModelCache, shapes: CaptureShapes):
    """Symbolic dims: batch, tokens (not for decode/draft), and the context (store rows)."""
    a = model.args
    batch = Dim("batch", min=1, max=shapes.max_batch)
    m = rope_margin(a)
    top = max(st.ratio for st in template.stores.values()) if template.stores else 1
    ctx = Dim("ctx", min=1, max=shapes.max_context // top)
    if entry in ("decode", "draft"):
        tok = None
    elif entry == "decoder":
        tok = Dim("tokens", min=1, max=a.window_size)
    elif entry == "verify":
        tok = Dim("tokens", min=1, max=_verify_max(a))
    else:
        tok = Dim("tokens", min=1, max=shapes.max_tokens)

    def tok_dims(extra: dict | None = None) -> dict:
        d = {0: batch}
        if tok is not None:
            d[1] = tok
        return {**d, **(extra or {})}

    rope = {0: batch, 1: tok + 2 * m} if tok is not None else {0: batch}
    if entry == "draft":
        x = {0: batch}
    elif entry in ("decoder", "verify"):
        x = (tok_dims(), tok_dims())
    else:
        x = tok_dims()
    if takes_spans(a, entry):  # span_index (b, s), span_rows (n + 1, d)
        rows = Dim("span_rows", min=1, max=shapes.max_tokens + 1)
        x = (*(x if isinstance(x, tuple) else (x,)), tok_dims(), {0: rows})
    cache = []
    for name in cache_names(template):
        t = cache_tensor(template, name)
        d = {0: batch}
        if name.startswith("store.") and not name.endswith(("tail_kv", "tail_score")):
            ratio = template.stores[int(name.split(".")[1])].ratio
            d[1] = ctx * (top // ratio) if top // ratio > 1 else ctx
        cache.append(d if t.dim() > 0 else None)
    return {"x": x, "start": {0: batch}, "floor": {0: batch}, "cos_c": rope, "sin_c": rope,
            "cos_u": rope, "sin_u": rope, "hash_ids": tok_dims(), "cache_in": tuple(cache)}


@dataclass(frozen=True)
class StaticBounds:
    """Upper bounds for an entry's symbolic batch and context dims, from which Relax plans every
    intermediate once (a fixed plan instead of per-call allocations sized by the context). The
    runtime refuses a call beyond them."""

    batch: int
    context_tokens: int  # a multiple of the largest ratio

    def to_dict(self) -> dict[str, int]:
        return {"batch": self.batch, "context_tokens": self.context_tokens}


STATIC_ENTRIES = ("decode",)  # one token a sequence: nothing else is sized by a symbolic dim


def static_bounds(args, entry: str,
                  shapes: CaptureShapes = CaptureShapes()) -> StaticBounds | None:
    """The bounds a single-token entry is planned for: the capture's own batch and context
    ranges (callers size caches freely within them; a cache grown by doubling past max_seq_len
    is one). The plan reserves the storage at these bounds once; only what a call touches is
    ever paged in. None for entries whose token dim is symbolic (prefill: its buffers are sized
    by the chunk)."""
    del args  # the bounds are the capture's, whatever the model
    if entry not in STATIC_ENTRIES:
        return None
    return StaticBounds(batch=shapes.max_batch, context_tokens=shapes.max_context)


def dim_symbols(ep, template: ModelCache) -> dict[str, str]:
    """The names torch.export gave the batch and context dims (the importer names its TIR vars
    after them): batch from `start`, context from a store of the largest ratio."""
    nodes = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    vals = [n.meta["val"] for n in nodes if n.name in user]
    names = cache_names(template)
    top = max([1, *(st.ratio for st in template.stores.values())])
    out = {"batch": str(vals[1].shape[0])}  # (x, start, ...): start is (b,)
    for name, val in zip(names, vals[len(vals) - len(names):], strict=True):
        if name.startswith("store.") and name.endswith(".kv_codes"):
            if template.stores[int(name.split(".")[1])].ratio == top:
                out["ctx"] = str(val.shape[1])
                break
    return out


def _vision_ghosts(args) -> dict[str, torch.Tensor]:
    """Storage-less placeholders of `checkpoint.vision_spec`'s tensors (shapes and dtypes)."""

    return {name: torch.zeros((), dtype=RETURNED_DTYPES[spec.dtype]).expand(*spec.shape)
            for name, spec in vision_spec(args).items()}


# ---- the vision entry ----------------------------------------------------------------------------


class VisionGraph(torch.nn.Module):
    """The `vision` entry: (patches, RoPE tables, cell indices) -> aligned rows (`vision.tower`),
    the tower's weights as parameters under their official names (dots as double underscores);
    storage-less placeholders of `checkpoint.vision_spec`'s shapes and dtypes."""

    def __init__(self, args):
        super().__init__()
        if args.vision_n_layers <= 0:
            raise ValueError("The vision entry needs a model with a vision tower; this config's "
                             "vision_n_layers is 0.")
        self.args = args
        self.weight_names = sorted(n for n in vision_spec(args)
                                   if n.startswith(("vision.", "aligner.")))
        specs = vision_spec(args)
        for name in self.weight_names:
            ghost = torch.zeros((), dtype=RETURNED_DTYPES[specs[name].dtype])
            self.register_parameter(_param_name(name), torch.nn.Parameter(
                ghost.expand(*specs[name].shape), requires_grad=False))

    def forward(self, patches, cos, sin, cells):
        """patches bf16 (N, 3, p, p); cos / sin fp32 (N, hd/2); cells int64 (L, r^2) in
        [0, N] (validated by the caller: the gather does not bound-check)."""
        w = {name: getattr(self, _param_name(name)) for name in self.weight_names}
        return (tower(w, self.args, patches, cos, sin, cells),)


def capture_vision(args, shapes: CaptureShapes = CaptureShapes()):
    """torch.export the vision entry with symbolic patch and token counts (examples: a 3 x 6
    patch grid, two aligned tokens). Returns (ExportedProgram, None): it takes no cache."""
    module = VisionGraph(args)
    p, r = args.vision_patch_size, args.vision_downsample_ratio
    half = args.vision_dim // args.vision_n_heads // 2
    n, cells = 18, 2
    inputs = (torch.zeros(n, 3, p, p, dtype=torch.bfloat16), torch.zeros(n, half),
              torch.zeros(n, half), torch.zeros(cells, r * r, dtype=torch.int64))
    patches = Dim("patches", min=1, max=shapes.max_tokens)
    tokens = Dim("cells", min=1, max=shapes.max_tokens)
    dyn = {"patches": {0: patches}, "cos": {0: patches}, "sin": {0: patches},
           "cells": {0: tokens}}
    with torch.no_grad():
        ep = torch.export.export(module, inputs, dynamic_shapes=dyn, strict=False)
    return ep, None


def capture(model: Model, entry: str, shapes: CaptureShapes = CaptureShapes()):
    """torch.export one entry. Returns (ExportedProgram, cache template; None for vision)."""
    if entry == VISION_ENTRY:
        return capture_vision(model.args, shapes)
    inputs, template = example_inputs(model, entry, shapes)
    module = PhaseGraph(model, entry, template)
    dyn = dynamic_shapes(model, entry, template, shapes)
    with torch.no_grad():
        ep = torch.export.export(module, inputs, dynamic_shapes=dyn, strict=False)
    return ep, template
