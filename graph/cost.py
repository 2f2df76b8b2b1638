"""Bytes and FLOPs of one decode step (one token, one sequence, no draft), from the layer plan,
the checkpoint's tensor spec and the KV layout: the roofline `dsv41 bench` compares against.

Counted reads:
- weights: every backbone tensor a token touches (routed experts: only the `n_activated` of
  `n_routed` a token is sent to; embeddings and Engram tables: the rows it gathers; the head:
  all of it); DSpark layers are not run by a plain decode step;
- KV: each layer's window ring (W FP8 entries), its selected FP4 main-KV entries (top-k, or all
  entries when fewer), and each indexer's sweep over MXFP4 index keys (all entries, or the
  candidate blocks for indexers restricted to the candidate pool).
FLOPs: 2 per weight multiply-add (expert weights: the activated share), the attention's QK and
PV over the window plus the selected entries, and the indexers' relu(q.k) over the swept keys.
Elementwise work (norms, mHC, RoPE, softmax) is left out: it is small next to these.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import param_spec
from .config import ModelArgs
from .layout import KVLayout
from .plan import LOCAL, build_plan


@dataclass(frozen=True)
class StepCost:
    context: int
    weight_bytes: int
    kv_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_step_cost(args: ModelArgs, context: int) -> StepCost:
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}.")
    plan = build_plan(args)
    spec = param_spec(args)
    layout = KVLayout.from_plan(plan)
    weight_bytes = flops = 0
    for name, s in spec.items():
        if name.startswith("mtp."):
            continue
        share_num, share_den = 1, 1  # the fraction of the tensor one token reads
        if name == "embed.weight":
            share_den = s.shape[0]
        elif ".engram.embed." in name:
            share_num = args.engram_n_heads * (args.engram_max_ngram_size - 1)
            share_den = s.shape[0]
        elif ".ffn.experts." in name:
            share_den, share_num = args.moe_config(int(name.split(".")[1]))
        weight_bytes += s.nbytes * share_num // share_den
        matmul = (len(s.logical_shape) == 2 and s.kind != "e8m0_scale" and "norm" not in name
                  and "embed" not in name)
        if matmul:
            flops += 2 * s.logical_shape[0] * s.logical_shape[1] * share_num // share_den
    kv = 0
    w = min(context + 1, args.window_size)
    sources = {src.layer: src for src in layout.sources}
    for p in plan.backbone:
        kv += w * layout.window_entry_bytes
        attended = w
        if p.role != LOCAL:
            src = sources[p.kv_source]
            n = (context + 1) // src.ratio
            sel = min(args.index_topk, n)
            kv += sel * src.main_kv_bytes
            attended += sel
            if p.runs_indexer:
                swept = n
                if p.uses_candidates:
                    swept = min(n, args.candidate_topk_blocks * args.candidate_block_size)
                kv += swept * src.index_k_bytes
                flops += 2 * swept * args.index_n_heads * args.index_head_dim
        flops += 2 * 2 * args.n_heads * args.head_dim * attended
    return StepCost(context, weight_bytes, kv, flops)
