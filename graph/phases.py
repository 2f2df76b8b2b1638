"""Phase functions: pure functions of (model, cache, tokens) that advance the cache.

Each runs over a batch of sequences that share one cached length, and reports the token-layer
work it did (tokens x blocks), which is what CED saves:

- `prefill_exact`: every block over every new token, at any start position (a cached sequence
  continues; the released reference only starts at 0).
- `decode_step`: one token through every block.
- `encoder_prefill` + `decoder_replay` (CED): the encoder over all new tokens and the decoder's
  global KV from the encoder's output, then only the last `window` tokens through the decoder.
- `encoder_replay`: a prefix hit without its window snapshot: the last `window` cached tokens
  plus the suffix through the encoder, reading cached global entries and never rewriting them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import ModelCache
from .engram import as_tensor, engram_hash, engram_history_after
from .layers import hc_pre, identity_pre, rms_norm
from .model import (
    Chunk,
    Model,
    compress,
    engram,
    final_norm,
    head,
    publish_index_k,
    publish_main_kv,
    run_layers,
)


@dataclass
class PhaseResult:
    logits: torch.Tensor  # fp32 (b, s, vocab) or (b, 1, vocab)
    work: dict[int, int]  # tokens processed per block
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # recorded block outputs
    final_hidden: torch.Tensor | None = None  # (b, s, d) what the head reads
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # layer (-1: blocks)

    @property
    def token_layers(self) -> int:
        return sum(self.work.values())


def check_tokens(model: Model, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids are validated here, before any gather sees them."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(np.asarray(tokens))
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.dim() != 2 or tokens.size(1) == 0:
        raise ValueError("Tokens must be a non-empty (batch, seq) array, got "
                         f"{tuple(tokens.shape)}.")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise ValueError(f"Token ids must be integers, got {tokens.dtype}.")
    tokens = tokens.long()
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= model.args.vocab_size:
        raise ValueError(f"Token ids must lie in 0..{model.args.vocab_size - 1}; got {lo}..{hi}.")
    return tokens


def _chunk(model: Model, cache: ModelCache, tokens: torch.Tensor, record=()) -> Chunk:
    if tokens.size(0) != cache.batch:
        raise ValueError(f"Batch of {tokens.size(0)} sequences does not match the cache's "
                         f"{cache.batch}.")
    ids = None
    if model.engram is not None:
        np_tokens = tokens.numpy()
        ids = as_tensor(engram_hash(model.engram, cache.engram_history, np_tokens))
        cache.engram_history = engram_history_after(model.engram, cache.engram_history, np_tokens)
    return Chunk(start=cache.pos, length=tokens.size(1), hash_ids=ids, record=tuple(record))


def embed(model: Model, tokens: torch.Tensor) -> torch.Tensor:
    h = model.w["embed.weight"][tokens]  # (b, s, d) bf16
    return h.unsqueeze(2).repeat(1, 1, model.args.hc_mult, 1)  # (b, s, hc, d)


def prefill_exact(model: Model, cache: ModelCache, tokens, *, all_logits: bool = False,
                  record: tuple[int, ...] = ()) -> PhaseResult:
    """Every block over every new token, continuing from `cache.pos`."""
    tokens = check_tokens(model, tokens)
    chunk = _chunk(model, cache, tokens, record)
    h = embed(model, tokens)
    pre = identity_pre(h.size(0), h.size(1), model.args.hc_mult)
    h, pre = run_layers(model, cache, h, pre, range(model.args.n_layers), chunk)
    x = final_norm(model, h, pre)
    cache.pos = chunk.end
    logits = head(model, x if all_logits else x[:, -1:])
    return PhaseResult(logits, chunk.work, chunk.hidden, x, chunk.selections)


def decode_step(model: Model, cache: ModelCache, tokens) -> PhaseResult:
    """One new token per sequence through every block."""
    tokens = check_tokens(model, tokens)
    if tokens.size(1) != 1:
        raise ValueError(f"decode_step takes one token per sequence, got {tokens.size(1)}.")
    return prefill_exact(model, cache, tokens)



# ---- CED: the Causal Encoder-Decoder pair -------------------------------------------------------


@dataclass
class EncoderOutput:
    """The encoder's stream after the last encoder block, for the positions a replay needs."""

    h: torch.Tensor  # (b, s, hc, d)
    pre: torch.Tensor  # (b, s, hc) the last encoder block's FFN mix
    hash_ids: torch.Tensor | None  # Engram rows of the same positions
    start: int  # position of h[:, 0]
    work: dict[int, int]
    hidden: dict[int, torch.Tensor]  # recorded encoder block outputs
    selections: dict[int, torch.Tensor]  # encoder index sources' top-k


def encoder_prefill(model: Model, cache: ModelCache, tokens,
                    record: tuple[int, ...] = ()) -> EncoderOutput:
    """The encoder blocks over every new token, then the decoder's global KV (the first decoder
    block's compressor and index K) from the encoder's output, without running the decoder."""
    tokens = check_tokens(model, tokens)
    chunk = _chunk(model, cache, tokens, record)
    h = embed(model, tokens)
    pre = identity_pre(h.size(0), h.size(1), model.args.hc_mult)
    h, pre = run_layers(model, cache, h, pre, range(model.plan.decoder_start), chunk)
    if model.plan.decoder_start < model.args.n_layers:
        decoder_global_kv(model, cache, h, pre, chunk)
    cache.pos = chunk.end
    return EncoderOutput(h, pre, chunk.hash_ids, chunk.start, chunk.work, chunk.hidden,
                         chunk.selections)


def decoder_global_kv(model: Model, cache: ModelCache, h: torch.Tensor, pre: torch.Tensor,
                      chunk: Chunk) -> None:
    """Block D's attention input is the encoder output collapsed with block D-1's FFN mix, so
    its compressor (the decoder's only KV source) runs here for every new token."""
    layer = model.plan.decoder_start
    p = model.plan.layers[layer]
    if p.engram:
        slot = model.args.engram_layer_ids.index(layer)
        h = engram(model, layer, h, chunk.hash_ids[:, :, slot])
    x = rms_norm(hc_pre(h, pre), model.p(layer, "attn_norm.weight"), model.args.norm_eps)
    store = cache.stores[layer]
    latent, first = compress(model, layer, store, x, chunk)
    if latent is None:
        return
    if p.owns_index_k:
        publish_index_k(model, layer, store, latent, first)
        cache.index_k_layer = layer
    publish_main_kv(model, store, latent, first, cache.kv_dtype)


def decoder_replay(model: Model, cache: ModelCache, enc: EncoderOutput, *,
                   all_logits: bool = False, record: tuple[int, ...] = ()) -> PhaseResult:
    """The last `window` encoded tokens through the decoder blocks, each query's window cut to
    the replay segment (a query at i sees [max(s0, i - window + 1), i]). The decoder's global
    entries were written by `encoder_prefill` and are only read here."""
    n = min(enc.h.size(1), model.args.window_size)
    start = enc.start + enc.h.size(1) - n
    chunk = Chunk(start=start, length=n,
                  hash_ids=None if enc.hash_ids is None else enc.hash_ids[:, -n:],
                  window_floor=start, record=tuple(record), write_global=False)
    h, pre = run_layers(model, cache, enc.h[:, -n:], enc.pre[:, -n:],
                        range(model.plan.decoder_start, model.args.n_layers), chunk)
    x = final_norm(model, h, pre)
    logits = head(model, x if all_logits else x[:, -1:])
    return PhaseResult(logits, chunk.work, chunk.hidden, x, chunk.selections)


def ced_prefill(model: Model, cache: ModelCache, tokens, *, all_logits: bool = False,
                record: tuple[int, ...] = ()) -> PhaseResult:
    """CED prefill: `n_encoder * N + n_decoder * min(N, window)` token-layers instead of
    `n_layers * N`. Logits exist only for the replayed (last `window`) positions."""
    enc = encoder_prefill(model, cache, tokens, record)
    res = decoder_replay(model, cache, enc, all_logits=all_logits, record=record)
    res.work = {**enc.work, **res.work}
    res.hidden = {**enc.hidden, **res.hidden}
    res.selections = {**enc.selections, **res.selections}
    return res
