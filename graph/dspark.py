"""DSpark: the draft head (`mtp.*`), forward only.

Three window-only blocks draft `dspark_block_size` tokens in one pass. Their window entries come
from `main_x = main_norm(main_proj(taps))`, the mean-over-copies inputs of the target layers, one
per backbone position (`seed`); the draft queries are `[accepted, noise x (B-1)]` at positions
p+1..p+B, and every draft query sees the whole window plus every draft entry (no causal mask
inside the block). A rank-r Markov head adds a logit bias from the previous draft token, and a
confidence head scores each draft position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.graph import ops
from dsv41.graph.cache import ModelCache
from dsv41.graph.layers import hc_pre, identity_pre, rms_norm
from dsv41.graph.model import (
    Chunk,
    Model,
    block,
    embed_rows,
    head,
    output_proj,
    token_rope,
    write_ring,
)


@dataclass
class Draft:
    ids: torch.Tensor  # int64 (b, B+1): [accepted, draft_1..draft_B]
    logits: torch.Tensor  # fp32 (b, B, vocab), Markov bias included
    confidence: torch.Tensor  # fp32 (b, B)


def _main_x(model: Model, main_hidden: torch.Tensor) -> torch.Tensor:
    """(b, s, n_taps*d) -> (b, s, d), stage 0's projection, shared by every stage."""
    first = model.args.n_layers
    x = ops.fp8_linear(main_hidden, model.p(first, "main_proj.weight"),
                       model.p(first, "main_proj.scale"))
    return rms_norm(x, model.p(first, "main_norm.weight"), model.args.norm_eps)


def _main_kv(model: Model, layer: int, main_x: torch.Tensor, cos, sin):
    a = model.args
    kv = rms_norm(ops.fp8_linear(main_x, model.p(layer, "attn.wkv.weight"),
                                 model.p(layer, "attn.wkv.scale")),
                  model.p(layer, "attn.kv_norm.weight"), a.norm_eps)
    return ops.quant_fp8(ops.rope(kv, cos, sin, a.rope_head_dim, False).float())


def seed(model: Model, cache: ModelCache, main_hidden: torch.Tensor, chunk: Chunk) -> None:
    """Write the DSpark rings for the chunk's backbone positions (prefill, CED replay and every
    decode step; the reference does the same inside forward_spec)."""
    main_x = _main_x(model, main_hidden)
    cos, sin = token_rope(model, chunk, False)
    for p in model.plan.dspark:
        codes, scales = _main_kv(model, p.layer, main_x, cos, sin)
        write_ring(cache.windows[p.layer], codes, scales, chunk.start, model.args.window_size)


def _draft_attention(model: Model, cache: ModelCache, layer: int, x: torch.Tensor,
                     chunk: Chunk) -> torch.Tensor:
    """Draft queries over the ring (slot order, the first min(W, p+1) slots) and all draft
    entries."""
    a = model.args
    b, n, _ = x.shape
    win = a.window_size
    cos, sin = token_rope(model, chunk, False)
    qr = rms_norm(ops.fp8_linear(x, model.p(layer, "attn.wq_a.weight"),
                                 model.p(layer, "attn.wq_a.scale")),
                  model.p(layer, "attn.q_norm.weight"), a.norm_eps)
    q = ops.fp8_linear(qr, model.p(layer, "attn.wq_b.weight"), model.p(layer, "attn.wq_b.scale"))
    # (b, n, h, hd): h = n_heads, or a sharded worker's heads (its rows of wq_b)
    q = ops.rope(q.unflatten(-1, (-1, a.head_dim)), cos, sin, a.rope_head_dim, False)
    kv = rms_norm(ops.fp8_linear(x, model.p(layer, "attn.wkv.weight"),
                                 model.p(layer, "attn.wkv.scale")),
                  model.p(layer, "attn.kv_norm.weight"), a.norm_eps)
    codes, scales = ops.quant_fp8(ops.rope(kv, cos, sin, a.rope_head_dim, False).float())
    ring = cache.windows[layer]
    buf_c = torch.cat([ring.codes, codes], dim=1)  # (b, W + B, d)
    buf_s = torch.cat([ring.scales, scales], dim=1)
    filled = chunk.start.unsqueeze(1)  # = p + 1 positions are in the ring
    slots = torch.arange(win).unsqueeze(0)
    ring_idx = torch.where(slots < filled, slots, -1)  # (b, W)
    drafts = win + torch.arange(n) + torch.zeros_like(filled)  # (b, B): rows after the ring
    idx = torch.cat([ring_idx, drafts], dim=1)
    idx = idx.unsqueeze(1).expand(-1, n, -1).to(torch.int32).contiguous()
    sink = model.p(layer, "attn.attn_sink")
    empty_c = buf_c[:, :1, : a.head_dim // 2]  # no global store: one never-selected row
    empty_s = buf_c[:, :1, : a.head_dim // 16]
    none = torch.full_like(x[..., :1], -1, dtype=torch.int32)  # (b, B, 1): nothing selected
    o = ops.sparse_attend(q, buf_c, buf_s, idx, empty_c, empty_s, none, sink,
                          a.head_dim**-0.5)
    return output_proj(model, layer, ops.rope(o, cos, sin, a.rope_head_dim, True))


def draft(model: Model, cache: ModelCache, token: torch.Tensor, chunk: Chunk) -> Draft:
    """Draft B tokens after `token` (b,), the greedy successor of position p; `chunk` covers
    the draft positions p+1..p+B (start = p + 1). The rings must already hold position p
    (`seed` ran for this step)."""
    a = model.args
    n = a.dspark_block_size
    ids = torch.where(torch.arange(n) == 0, token.unsqueeze(1), a.dspark_noise_token_id)
    h = embed_rows(model, ids).unsqueeze(2).repeat(1, 1, a.hc_mult, 1)  # (b, B, hc, d)
    pre = identity_pre(h)
    for p in model.plan.dspark:
        h, pre = block(model, cache, p.layer, h, pre, chunk, attn=_draft_attention)
    last = model.plan.dspark[-1].layer
    x = hc_pre(h, pre)  # (b, B, d)
    logits = head(model, rms_norm(x, model.p(last, "norm.weight"), a.norm_eps))
    out, rows, embeds = [token], [], []
    for i in range(n):
        e = model.p(last, "markov_head.embed.weight")[out[i]]  # (b, r) bf16
        row = logits[:, i] + torch.nn.functional.linear(
            e.float(), model.p(last, "markov_head.head.weight"))  # (b, vocab) fp32
        rows.append(row)
        embeds.append(e)
        out.append(row.argmax(dim=-1))
    feats = torch.cat([x, torch.stack(embeds, dim=1)], dim=-1).float()
    conf = torch.nn.functional.linear(feats, model.p(last, "confidence_head.proj.weight"))
    return Draft(torch.stack(out, dim=1), torch.stack(rows, dim=1), conf.squeeze(-1))
