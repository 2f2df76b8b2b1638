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

from . import formats as fmt
from . import ops
from .cache import GlobalStore, ModelCache, ensure_capacity
from .config import ModelArgs
from .engram import EngramTables, build_tables, load_token_map
from .layers import (
    BF16,
    apply_rope,
    bf16_linear,
    engram_gate,
    fp32_linear,
    hc_mixes,
    hc_post,
    hc_pre,
    rms_norm,
    rope_freqs,
    rope_table,
    softmax_pool,
)
from .plan import FULL, ModelPlan, build_plan


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

    @classmethod
    def from_weights(cls, args: ModelArgs, weights: dict[str, torch.Tensor],
                     token_map: np.ndarray | None = None) -> Model:
        plan = build_plan(args)
        w = dict(weights)
        for name in _fp32_in_compute(args, plan):
            if name in w:
                w[name] = w[name].float()
        experts = {}
        for layer in plan.layers:
            prefix = _prefix(args, layer.layer)
            n_routed, _ = args.moe_config(layer.layer)
            stack = {}
            for k in ("w1", "w3", "w2"):
                stack[k] = torch.stack([w.pop(f"{prefix}.ffn.experts.{e}.{k}.weight")
                                        for e in range(n_routed)])
                stack["s" + k[1]] = torch.stack([w.pop(f"{prefix}.ffn.experts.{e}.{k}.scale")
                                                 for e in range(n_routed)])
            experts[layer.layer] = ExpertStack(**stack)
        engram = None
        if args.engram_layer_ids:
            tmap = token_map if token_map is not None else load_token_map(args, None)
            engram = build_tables(args, tmap)
        freqs = {
            True: rope_freqs(args.rope_head_dim, args.original_seq_len, args.compress_rope_theta,
                             args.rope_factor, args.beta_fast, args.beta_slow),
            False: rope_freqs(args.rope_head_dim, 0, args.rope_theta, args.rope_factor,
                              args.beta_fast, args.beta_slow),
        }
        return cls(args, plan, w, experts, engram, freqs)

    @classmethod
    def from_checkpoint(cls, path: str | Path, args: ModelArgs | None = None) -> Model:
        from .checkpoint import checkpoint_config, load_checkpoint

        args = args or checkpoint_config(path)
        return cls.from_weights(args, load_checkpoint(path, args),
                                load_token_map(args, path) if args.engram_layer_ids else None)

    def p(self, layer: int, name: str) -> torch.Tensor:
        return self.w[f"{_prefix(self.args, layer)}.{name}"]


def _prefix(args: ModelArgs, layer: int) -> str:
    return f"layers.{layer}" if layer < args.n_layers else f"mtp.{layer - args.n_layers}"


# ---- per-chunk context -------------------------------------------------------------------------


@dataclass
class Chunk:
    """What the blocks of one forward share: positions, Engram rows, published selections."""

    start: int  # P0
    length: int  # s
    hash_ids: torch.Tensor | None  # int64 (b, s, n_engram_layers, cols)
    window_floor: int = 0  # positions below this are outside every window (replay segments)
    selection: torch.Tensor | None = None  # latest index source's top-k (b, s, k) int32
    blocks: torch.Tensor | None = None  # candidate pool (b, s, B) int32
    taps: list[torch.Tensor] = field(default_factory=list)  # DSpark tap inputs
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> top-k
    work: dict[int, int] = field(default_factory=dict)  # token-layer work per layer
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # recorded block outputs
    record: tuple[int, ...] = ()
    write_global: bool = True  # False: cached global entries are read, never rewritten
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + self.length


def _rope_for(model: Model, chunk: Chunk, compressed: bool):
    if compressed not in chunk.rope:
        pos = torch.arange(chunk.start, chunk.end).unsqueeze(0)
        chunk.rope[compressed] = rope_table(model.freqs[compressed], pos)
    return chunk.rope[compressed]


# ---- window --------------------------------------------------------------------------------------


def window_rows(start: int, s: int, window: int, floor: int = 0) -> torch.Tensor:
    """Window positions each new query attends to, int64 (s, W), -1 = nothing there.

    A fresh prefill (start 0) lists [max(0, p-W+1) ...] valid-first, width min(s, window), as
    the released prefill does; a continuation lists the last `window` positions oldest first,
    as the released decode does. Positions below `floor` are cut (replay segments)."""
    p = torch.arange(start, start + s).unsqueeze(1)
    if start == 0:
        width = min(s, window)
        q = (p - window + 1).clamp(min=0) + torch.arange(width)
        q = torch.where(q > p, -1, q)
    else:
        q = p - window + 1 + torch.arange(window)
    return torch.where(q < floor, -1, q)


def window_inputs(ring, codes: torch.Tensor, scales: torch.Tensor, chunk: Chunk, window: int):
    """(codes, scales, idx) for `sparse_attend`: the ring (positions before the chunk, unless it
    is a fresh prefill) followed by the chunk's own entries, and each query's rows into it."""
    rows = window_rows(chunk.start, chunk.length, window, chunk.window_floor)
    b = codes.size(0)
    if chunk.start == 0:
        buf_c, buf_s, idx = codes, scales, rows
    else:
        buf_c = torch.cat([ring.codes, codes], dim=1)
        buf_s = torch.cat([ring.scales, scales], dim=1)
        idx = torch.where(rows < chunk.start, rows % window, window + rows - chunk.start)
        idx = torch.where(rows < 0, -1, idx)
    return buf_c, buf_s, idx.to(torch.int32).unsqueeze(0).expand(b, -1, -1).contiguous()


def write_ring(ring, codes: torch.Tensor, scales: torch.Tensor, start: int, window: int) -> None:
    n = min(codes.size(1), window)
    pos = torch.arange(start + codes.size(1) - n, start + codes.size(1))
    ring.codes[:, pos % window] = codes[:, -n:]
    ring.scales[:, pos % window] = scales[:, -n:]


# ---- attention ---------------------------------------------------------------------------------


def compress(model: Model, layer: int, store: GlobalStore, x: torch.Tensor, chunk: Chunk):
    """The KV source's new complete entries, pre-RoPE bf16 (b, n, hd), and the first entry id;
    None when no group completed. A partial group waits in the store's fp32 tail."""
    m = store.ratio
    if m == 1:
        latent = rms_norm(bf16_linear(x, model.p(layer, "attn.compressor.wkv.weight")),
                          model.p(layer, "attn.compressor.norm.weight"), model.args.norm_eps)
        return latent, chunk.start
    r = chunk.start % m
    kv = fp32_linear(x, model.p(layer, "attn.compressor.wkv.weight"))  # (b, s, hd) fp32
    score = fp32_linear(x, model.p(layer, "attn.compressor.wgate.weight"))
    kv = torch.cat([store.tail_kv[:, :r], kv], dim=1)
    score = torch.cat([store.tail_score[:, :r], score], dim=1)
    n, rem = divmod(r + chunk.length, m)
    store.tail_kv[:, :rem] = kv[:, n * m :]
    store.tail_score[:, :rem] = score[:, n * m :]
    if n == 0:
        return None, 0
    pooled = softmax_pool(kv[:, : n * m], score[:, : n * m], m)
    latent = rms_norm(pooled.to(BF16), model.p(layer, "attn.compressor.norm.weight"),
                      model.args.norm_eps)
    return latent, (chunk.start - r) // m


def publish_index_k(model: Model, layer: int, store: GlobalStore, latent: torch.Tensor,
                    first: int) -> None:
    a = model.args
    k = rms_norm(bf16_linear(latent, model.p(layer, "attn.indexer.wk.weight")),
                 model.p(layer, "attn.indexer.k_norm.weight"), a.norm_eps)
    cos, sin = rope_table(model.freqs[True], _entry_positions(first, k.size(1), store.ratio))
    codes, scales = fmt.torch_quant_mxfp4(apply_rope(k, cos, sin, a.rope_head_dim).float())
    store.k_codes[:, first : first + k.size(1)] = codes
    store.k_scales[:, first : first + k.size(1)] = scales


def publish_main_kv(model: Model, store: GlobalStore, latent: torch.Tensor, first: int,
                    kv_dtype: str) -> None:
    a = model.args
    cos, sin = rope_table(model.freqs[True], _entry_positions(first, latent.size(1), store.ratio))
    latent = apply_rope(latent, cos, sin, a.rope_head_dim)
    n = latent.size(1)
    if kv_dtype == "bf16":
        store.kv_codes[:, first : first + n] = latent
        return
    codes, scales = fmt.torch_quant_fp4_kv(latent.float())
    store.kv_codes[:, first : first + n] = codes
    store.kv_scales[:, first : first + n] = scales


def _entry_positions(first: int, n: int, m: int) -> torch.Tensor:
    """An entry is rotated at the position of its group's first token."""
    return (torch.arange(first, first + n) * m).unsqueeze(0)


def select(model: Model, cache: ModelCache, layer: int, store: GlobalStore, x: torch.Tensor,
           qr: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """This index source's top-k positions per query, int32 (b, s, min(topk, visible)).

    The released model reads index K through one shared pointer that only a publishing KV source
    moves: in a decode step where a ratio-2 group is still filling, its indexer scores the keys
    of the last source that did publish (the ratio-1 source). `model.reference_index_k` keeps
    that behaviour, which the released outputs carry; off, each indexer reads its own source."""
    a, p = model.args, model.plan.layers[layer]
    b, s = x.shape[:2]
    n_vis = chunk.end // store.ratio
    if n_vis == 0:
        return torch.empty(b, s, 0, dtype=torch.int32)
    cos, sin = _rope_for(model, chunk, True)
    q = ops.fp8_linear(qr, model.p(layer, "attn.indexer.wq_b.weight"),
                       model.p(layer, "attn.indexer.wq_b.scale"))
    q = apply_rope(q.unflatten(-1, (a.index_n_heads, a.index_head_dim)), cos, sin,
                   a.rope_head_dim)
    q = fmt.torch_qdq_mxfp4(q)
    weights = bf16_linear(x, model.p(layer, "attn.indexer.weights_proj.weight")) * (
        a.index_head_dim**-0.5 * a.index_n_heads**-0.5)
    lens = ((torch.arange(chunk.start, chunk.end) + 1) // store.ratio).expand(b, s)
    keys = store
    if model.reference_index_k and cache.index_k_layer >= 0:
        keys = cache.stores[cache.index_k_layer]
    kc, ks = keys.k_codes[:, :n_vis], keys.k_scales[:, :n_vis]
    if p.candidate_source:
        idx, chunk.blocks = ops.hier_topk(q, kc, ks, weights, lens, a.index_topk,
                                          a.candidate_topk_blocks, a.candidate_block_size)
    elif p.uses_candidates:
        idx = ops.pool_topk(q, kc, ks, weights, lens, chunk.blocks, a.index_topk,
                            a.candidate_block_size)
    else:
        idx = ops.indexer_topk(q, kc, ks, weights, lens, a.index_topk)
    return idx[..., : min(a.index_topk, n_vis)]


def attention(model: Model, cache: ModelCache, layer: int, x: torch.Tensor, chunk: Chunk):
    a, p = model.args, model.plan.layers[layer]
    b, s, _ = x.shape
    rd = a.rope_head_dim
    cos, sin = _rope_for(model, chunk, p.ratio > 0)
    qr = rms_norm(ops.fp8_linear(x, model.p(layer, "attn.wq_a.weight"),
                                 model.p(layer, "attn.wq_a.scale")),
                  model.p(layer, "attn.q_norm.weight"), a.norm_eps)
    q = ops.fp8_linear(qr, model.p(layer, "attn.wq_b.weight"), model.p(layer, "attn.wq_b.scale"))
    q = apply_rope(q.unflatten(-1, (a.n_heads, a.head_dim)), cos, sin, rd)  # (b, s, h, hd)

    kv = rms_norm(ops.fp8_linear(x, model.p(layer, "attn.wkv.weight"),
                                 model.p(layer, "attn.wkv.scale")),
                  model.p(layer, "attn.kv_norm.weight"), a.norm_eps)
    win_codes, win_scales = fmt.torch_quant_fp8(apply_rope(kv, cos, sin, rd).float())
    ring = cache.windows[layer]
    buf_c, buf_s, win_idx = window_inputs(ring, win_codes, win_scales, chunk, a.window_size)
    write_ring(ring, win_codes, win_scales, chunk.start, a.window_size)

    store, idx = None, torch.empty(b, s, 0, dtype=torch.int32)
    if p.ratio:
        store = cache.stores[p.kv_source]
        latent = None
        if p.role == FULL and chunk.write_global:
            latent, first = compress(model, layer, store, x, chunk)
            if latent is not None and p.owns_index_k:
                publish_index_k(model, layer, store, latent, first)
                cache.index_k_layer = layer
        if p.runs_indexer:
            chunk.selection = select(model, cache, layer, store, x, qr, chunk)
            chunk.selections[layer] = chunk.selection
            if p.candidate_source:
                chunk.selections[-1] = chunk.blocks
        idx = chunk.selection
        if latent is not None:
            publish_main_kv(model, store, latent, first, cache.kv_dtype)
    n_vis = chunk.end // p.ratio if p.ratio else 0
    sink = model.p(layer, "attn.attn_sink")
    scale = a.head_dim**-0.5
    if store is None or cache.kv_dtype == "fp4":
        kv_c = store.kv_codes[:, :n_vis] if store else torch.zeros(b, 0, a.head_dim // 2,
                                                                   dtype=torch.uint8)
        kv_s = store.kv_scales[:, :n_vis] if store else torch.zeros(b, 0, a.head_dim // 16,
                                                                    dtype=torch.uint8)
        o = ops.sparse_attend(q, buf_c, buf_s, win_idx, kv_c, kv_s, idx, sink, scale)
    else:
        o = ops.sparse_attend_bf16(q, buf_c, buf_s, win_idx, store.kv_codes[:, :n_vis], idx,
                                   sink, scale)
    o = apply_rope(o, cos, sin, rd, inverse=True)
    o = o.view(b, s, a.o_groups, -1)  # (b, s, g, h*hd/g)
    wo_a = model.p(layer, "attn.wo_a.weight").view(a.o_groups, a.o_lora_rank, -1)
    o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
    return ops.fp8_linear(o.flatten(2), model.p(layer, "attn.wo_b.weight"),
                          model.p(layer, "attn.wo_b.scale"))


# ---- MoE -----------------------------------------------------------------------------------------


def moe(model: Model, layer: int, x: torch.Tensor) -> torch.Tensor:
    a = model.args
    shape = x.shape
    x = x.reshape(-1, a.dim)
    _, k = a.moe_config(layer)
    scores = fp32_linear(x, model.p(layer, "ffn.gate.weight")) / a.gate_temp
    if a.score_func == "softmax":
        scores = scores.softmax(dim=-1)
    elif a.score_func == "sigmoid":
        scores = scores.sigmoid()
    else:
        scores = torch.nn.functional.softplus(scores).sqrt()
    _, ids = ops.stable_topk(scores + model.p(layer, "ffn.gate.bias"), k)
    weights = scores.gather(1, ids)
    if a.norm_topk_prob and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * a.route_scale
    ex = model.experts[layer]
    y = ops.moe_experts(x, weights, ids, ex.w1, ex.s1, ex.w3, ex.s3, ex.w2, ex.s2,
                        a.swiglu_limit)
    y = y + shared_expert(model, layer, x)
    return y.type_as(x).view(shape)


def shared_expert(model: Model, layer: int, x: torch.Tensor) -> torch.Tensor:
    def lin(name: str, v: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(v, model.p(layer, f"ffn.shared_experts.{name}.weight"),
                              model.p(layer, f"ffn.shared_experts.{name}.scale"))

    h = ops.swiglu(lin("w1", x).float(), lin("w3", x).float(), model.args.swiglu_limit)
    return lin("w2", h.to(BF16))


# ---- Engram and the block ------------------------------------------------------------------------


def engram(model: Model, layer: int, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """ids (b, s, cols) int64, validated against the table size by the caller."""
    a = model.args
    codes = model.p(layer, "engram.embed.weight")[ids]  # (b, s, cols, ed)
    scales = model.p(layer, "engram.embed.scale")[ids]  # (b, s, cols, ed/32)
    values = (fmt.torch_e4m3_decode(codes).unflatten(-1, (-1, 32))
              * fmt.torch_e8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(BF16)
    kv = ops.fp8_linear(values.flatten(-2), model.p(layer, "engram.wkv.weight"),
                        model.p(layer, "engram.wkv.scale"))
    key, value = kv.split([a.hc_mult * a.dim, a.dim], dim=-1)
    key = key.float().unflatten(-1, (a.hc_mult, a.dim))
    return engram_gate(h, key, value, model.p(layer, "engram.q_weight"),
                       model.p(layer, "engram.k_weight"), a.norm_eps)


def block(model: Model, cache: ModelCache, layer: int, h: torch.Tensor, pre: torch.Tensor,
          chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: attention then MoE, each between hc_pre and hc_post. The attention collapses
    with the previous block's FFN `pre` (single-pass lag); the FFN with this block's attention
    `pre`. Returns the new stream and this block's FFN `pre`."""
    a, p = model.args, model.plan.layers[layer]
    if p.engram:
        slot = a.engram_layer_ids.index(layer)
        h = engram(model, layer, h, chunk.hash_ids[:, :, slot])
    if p.dspark_tap:
        chunk.taps.append(h.mean(dim=2))
    mix = (a.hc_mult, a.hc_sinkhorn_iters, a.norm_eps, a.hc_eps)
    attn_pre, post, comb = hc_mixes(h, model.p(layer, "hc_attn_fn"),
                                    model.p(layer, "hc_attn_scale"),
                                    model.p(layer, "hc_attn_base"), *mix)
    x = rms_norm(hc_pre(h, pre), model.p(layer, "attn_norm.weight"), a.norm_eps)
    h = hc_post(attention(model, cache, layer, x, chunk), h, post, comb)
    ffn_pre, post, comb = hc_mixes(h, model.p(layer, "hc_ffn_fn"), model.p(layer, "hc_ffn_scale"),
                                   model.p(layer, "hc_ffn_base"), *mix)
    x = rms_norm(hc_pre(h, attn_pre), model.p(layer, "ffn_norm.weight"), a.norm_eps)
    h = hc_post(moe(model, layer, x), h, post, comb)
    chunk.work[layer] = chunk.work.get(layer, 0) + chunk.length
    if layer in chunk.record:
        chunk.hidden[layer] = h
    return h, ffn_pre


def run_layers(model: Model, cache: ModelCache, h: torch.Tensor, pre: torch.Tensor,
               layers: range, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    ensure_capacity(cache, chunk.end)
    for layer in layers:
        h, pre = block(model, cache, layer, h, pre, chunk)
    return h, pre


def final_norm(model: Model, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """What the head reads: norm(hc_pre(h)) with the last block's FFN mix, bf16 (b, s, d)."""
    return rms_norm(hc_pre(h, pre), model.w["norm.weight"], model.args.norm_eps)


def head(model: Model, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits."""
    return torch.nn.functional.linear(x.float(), model.w["head.weight"])
