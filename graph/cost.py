"""Bytes and FLOPs of a phase from the layer plan, the checkpoint's tensor spec and the KV layout:
the rooflines `dsv41 bench` compares against. A decode step is one token through every block
(one sequence, no draft); a prefill is N tokens from a start position, exact (every block over
every token) or CED (the encoder blocks and the decoder's global KV over every token, the decoder
blocks over the last `window`), optionally in chunks (each chunk reads the weights again).

Counted reads:
- weights: every backbone tensor a call touches: routed experts only the share its tokens are
  sent to (T tokens: min(1, T x activated / routed) of the stack), embeddings and Engram tables
  only the rows they gather, the head all of it; DSpark layers are not counted (a plain decode
  step does not run them, a prefill only seeds their rings);
- KV: per query and layer its window ring (min(p + 1, W) FP8 entries), its selected FP4 main-KV
  entries (top-k, or all entries when fewer), and each indexer's sweep over MXFP4 index keys
  (every visible entry, or the candidate blocks for indexers restricted to the pool).
FLOPs: 2 per weight multiply-add (expert weights: the activated share), the attention's QK and
PV over the window plus the selected entries, and the indexers' relu(q.k) over the swept keys;
elementwise work (norms, mHC, RoPE, softmax) is left out, it is small next to these. The head
runs for the last position of each call (exact) or once (CED).

Precision-weighted FLOPs count operations as the article does: BF16 (and wider) 1, FP8 0.5,
FP4 0.25. FP8 weight GEMMs are FP8; routed experts and the MXFP4 indexer sweep are FP4; the
attention reads its FP4 / FP8 entries dequantized, so it is BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from dsv41.graph.checkpoint import E8M0, FP4, FP8, param_spec
from dsv41.graph.checkpoint.spec import RELEASE_FP8_SUFFIX
from dsv41.graph.config import ModelArgs
from dsv41.graph.layout import KVLayout
from dsv41.graph.plan import LOCAL, build_plan

PRECISION_WEIGHT = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}  # the article's counting


class PrefillMode(Enum):
    EXACT = "exact"
    CED = "ced"


@dataclass(frozen=True)
class StepCost:
    """One phase call's reads and operations. `context` is the first position (a decode step:
    the cached tokens); `tokens` the positions it processes."""

    context: int
    weight_bytes: int
    kv_bytes: int
    flops: int
    weighted_flops: float = 0.0  # BF16 1, FP8 0.5, FP4 0.25
    tokens: int = 1

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _precision(kind: str) -> str:
    return {FP8: "fp8", FP4: "fp4"}.get(kind, "bf16")


@dataclass
class _Tally:
    weight_bytes: int = 0
    kv_bytes: int = 0
    flops: int = 0
    weighted: float = 0.0

    def op(self, flops: int, precision: str) -> None:
        self.flops += flops
        self.weighted += flops * PRECISION_WEIGHT[precision]


def _weights(args: ModelArgs, tally: _Tally, tokens_through) -> None:
    """Weight reads and GEMM FLOPs; `tokens_through(name)` is (tokens, calls): the tokens the
    phase pushes through a tensor and the calls it takes (each reads the tensor again)."""
    for name, s in param_spec(args).items():
        if name.startswith("mtp."):
            continue
        t, calls = tokens_through(name)
        if t == 0:
            continue
        per_call = -(-t // calls)  # tokens of one (the largest) call
        num, den = 1, 1  # the fraction of the tensor one token reads
        if name == "embed.weight":
            den = s.shape[0]
        elif ".engram.embed." in name:
            num, den = args.engram_n_heads * (args.engram_max_ngram_size - 1), s.shape[0]
        elif ".ffn.experts." in name:
            den, num = args.moe_config(int(name.split(".")[1]))
        tally.weight_bytes += calls * (s.nbytes * min(den, per_call * num) // den)
        matmul = (len(s.logical_shape) == 2 and s.kind != E8M0 and "norm" not in name
                  and "embed" not in name)
        if matmul:  # an FP8 wo_a (`wo_a_dtype`) is stored as FP8 but multiplied in bf16
            tally.op(2 * s.logical_shape[0] * s.logical_shape[1] * num // den * t,
                     "bf16" if name.endswith(RELEASE_FP8_SUFFIX) else _precision(s.kind))


def _kv(args: ModelArgs, plan, tally: _Tally, layers, positions: np.ndarray) -> None:
    """Every query at `positions` (int64, its own position each) through each of `layers`."""
    if positions.size == 0:
        return
    layout = KVLayout.from_plan(plan)
    sources = {src.layer: src for src in layout.sources}
    w = int(np.minimum(positions + 1, args.window_size).sum())
    for layer in layers:
        p = plan.layers[layer]
        tally.kv_bytes += w * layout.window_entry_bytes
        attended = w
        if p.role != LOCAL:
            src = sources[p.kv_source]
            n = (positions + 1) // src.ratio
            sel = int(np.minimum(args.index_topk, n).sum())
            tally.kv_bytes += sel * src.main_kv_bytes
            attended += sel
            if p.runs_indexer:
                swept = n
                if p.uses_candidates:
                    swept = np.minimum(n, args.candidate_topk_blocks * args.candidate_block_size)
                swept = int(swept.sum())
                tally.kv_bytes += swept * src.index_k_bytes
                tally.op(2 * swept * args.index_n_heads * args.index_head_dim, "fp4")
        tally.op(2 * 2 * args.n_heads * args.head_dim * attended, "bf16")


def prefill_cost(args: ModelArgs, tokens: int, *, start: int = 0,
                 mode: PrefillMode = PrefillMode.CED, chunk_tokens: int | None = None
                 ) -> StepCost:
    """N = `tokens` new positions from `start`: exact (every block over every token) or CED
    (the encoder and the decoder's global KV over every token, the decoder over the last
    min(N, window)); with `chunk_tokens` the weights are read once per chunk."""
    if start < 0 or tokens < 1:
        raise ValueError(f"A prefill needs start >= 0 and at least one token, got start {start}, "
                         f"{tokens} tokens.")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}.")
    if not isinstance(mode, PrefillMode):
        raise ValueError(f"mode must be a PrefillMode, got {mode!r}.")
    plan = build_plan(args)
    calls = 1 if chunk_tokens is None else -(-tokens // chunk_tokens)
    positions = np.arange(start, start + tokens, dtype=np.int64)
    n, d = args.n_layers, plan.decoder_start
    if mode is PrefillMode.EXACT:
        enc_layers, dec_layers, dec_tokens, heads = range(n), range(0), 0, calls
    else:
        enc_layers, dec_layers = range(d), range(d, n)
        dec_tokens, heads = min(tokens, args.window_size), 1  # the decoder: one call
    global_kv = f"layers.{d}."  # the decoder's compressor (and Engram) runs over every token

    def tokens_through(name: str) -> tuple[int, int]:
        layer = _layer_of(name)
        if layer is None:
            return (heads, heads) if name.startswith(("head.", "norm.")) else (tokens, calls)
        if layer in enc_layers:
            return tokens, calls
        if name.startswith(global_kv) and (".attn.compressor." in name or ".engram." in name
                                           or name.endswith("attn_norm.weight")):
            return tokens, calls
        return dec_tokens, 1

    tally = _Tally()
    _weights(args, tally, tokens_through)
    _kv(args, plan, tally, enc_layers, positions)
    _kv(args, plan, tally, dec_layers, positions[tokens - dec_tokens:])
    return StepCost(start, tally.weight_bytes, tally.kv_bytes, tally.flops, tally.weighted,
                    tokens)


def decode_step_cost(args: ModelArgs, context: int) -> StepCost:
    """One token at position `context` through every block: an exact prefill of one token."""
    return decode_step_costs(args, (context,))[0]


def decode_step_costs(args: ModelArgs, contexts) -> tuple[StepCost, ...]:
    """`decode_step_cost` at each context, the weights (context-free) counted once."""
    contexts = tuple(contexts)
    if any(c < 0 for c in contexts):
        raise ValueError(f"contexts must be >= 0, got {contexts}.")
    plan = build_plan(args)
    weights = _Tally()
    _weights(args, weights, lambda name: (1, 1))
    out = []
    for c in contexts:
        t = _Tally(weights.weight_bytes, 0, weights.flops, weights.weighted)
        _kv(args, plan, t, range(args.n_layers), np.array([c], dtype=np.int64))
        out.append(StepCost(c, t.weight_bytes, t.kv_bytes, t.flops, t.weighted, 1))
    return tuple(out)
