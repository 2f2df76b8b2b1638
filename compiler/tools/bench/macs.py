"""The multiply-adds of one decode row, from the model's config: the floor of what each extra
row of a verify pass adds to a decode step (issue 39).

A verify of 1 + k rows reads the weights once, but every row still multiplies them: each row's
projections, experts, attention (QK and PV over the entries its layer attends) and head are
dot products of their own. On a CPU those multiply-adds cannot run faster than the machine's
best matrix rate for the dtypes they use, so

    verify(1 + k) >= decode + k x row MACs / best MAC rate

whatever the kernels do. Counted here: the dense dot products only (the weight GEMVs at one
token, the routed and shared experts a token activates, attention over window + top-k entries
in every layer with an index, the window alone in a local layer, the head). Not counted, so
the floor stays a lower bound: the index sweeps, the compressor, mHC, norms, RoPE, softmax,
the quantisation of activations and any elementwise work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv41.graph.plan import LOCAL, ModelPlan


@dataclass(frozen=True)
class RowMacs:
    """Multiply-adds of one token of one decode row, over the backbone's layers."""

    projections: int  # attention's linears: wq_a, wq_b, wkv, the grouped wo_a, wo_b
    experts: int  # the activated routed experts and the shared ones (gate, up, down)
    attention: int  # QK and PV over every layer's attended entries
    head: int  # the output head

    @property
    def total(self) -> int:
        return self.projections + self.experts + self.attention + self.head

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def row_macs(plan: ModelPlan) -> RowMacs:
    """The dense multiply-adds of one decode row of `plan`'s backbone (see the module doc)."""
    a = plan.args
    hd = a.head_dim
    per_layer_proj = (a.dim * a.q_lora_rank + a.q_lora_rank * a.n_heads * hd + a.dim * hd
                      + a.n_heads * hd * a.o_lora_rank + a.o_groups * a.o_lora_rank * a.dim)
    projections = experts = attention = 0
    for p in plan.backbone:
        projections += per_layer_proj
        _, activated = a.moe_config(p.layer)
        experts += (activated + a.n_shared_experts) * 3 * a.dim * a.moe_inter_dim
        entries = a.window_size + (0 if p.role == LOCAL else a.index_topk)
        attention += 2 * a.n_heads * entries * hd
    return RowMacs(projections=projections, experts=experts, attention=attention,
                   head=a.dim * a.vocab_size)


def verify_floor_steps(k: int, *, decode_s: float, macs: RowMacs, macs_per_s: float) -> float:
    """The least a verify of 1 + k rows can cost, in decode steps of `decode_s` seconds: the
    decode step itself plus k rows' multiply-adds at `macs_per_s`."""
    if decode_s <= 0 or macs_per_s <= 0 or k < 0:
        raise ValueError(f"A verify floor needs decode_s > 0, macs_per_s > 0 and k >= 0; got "
                         f"decode_s={decode_s}, macs_per_s={macs_per_s}, k={k}.")
    return 1.0 + k * macs.total / macs_per_s / decode_s
