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
from .model import Chunk, Model, final_norm, head, run_layers


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


def collapse(model: Model, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return rms_norm(hc_pre(h, pre), model.w["norm.weight"], model.args.norm_eps)
