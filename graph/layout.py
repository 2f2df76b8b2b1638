"""The KV layout: what each layer stores, in bytes, derived from the layer plan and the formats.

One object serves both `dsv41 bill` and every allocation (graph caches, runtime pages), so the
printed bill and the live bytes cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.graph import formats as fmt
from dsv41.graph.plan import ModelPlan


@dataclass(frozen=True, slots=True)
class SourceLayout:
    layer: int  # the KV source layer
    ratio: int  # tokens per entry
    main_kv_bytes: int  # per entry: FP4 latent (288 B at d=512) or bf16 (2*d)
    index_k_bytes: int  # per entry: MXFP4 key (68 B at 128) or 0 if nobody indexes this source
    consumers: tuple[int, ...]  # layers reading this source's main KV

    @property
    def entry_bytes(self) -> int:
        return self.main_kv_bytes + self.index_k_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.entry_bytes / self.ratio

    def entries(self, context: int) -> int:
        """Complete entries at a context length (a partial group waits in the tail)."""
        return context // self.ratio


@dataclass(frozen=True)
class KVLayout:
    kv_dtype: str
    sources: tuple[SourceLayout, ...]
    window_layers: tuple[int, ...]  # every layer keeps its own ring (backbone + DSpark)
    backbone_layers: int
    window: int
    window_entry_bytes: int  # FP8 entry: 528 B at d=512
    tail_bytes: int  # fp32 partial-group kv + score of all ratio>1 sources

    @classmethod
    def from_plan(cls, plan: ModelPlan, *, kv_dtype: str = "fp4") -> KVLayout:
        a = plan.args
        if kv_dtype == "fp4":
            main = fmt.fp4_kv_entry_bytes(a.head_dim)
        elif kv_dtype == "bf16":
            main = 2 * a.head_dim
        else:
            raise ValueError(f"kv_dtype must be 'fp4' or 'bf16', got {kv_dtype!r}.")
        index = fmt.mxfp4_entry_bytes(a.index_head_dim)
        sources = []
        for p in plan.kv_sources:
            consumers = tuple(q.layer for q in plan.backbone if q.kv_source == p.layer)
            sources.append(SourceLayout(p.layer, p.ratio, main,
                                        index if p.owns_index_k else 0, consumers))
        tails = sum(2 * s.ratio * a.head_dim * 4 for s in sources if s.ratio > 1)
        return cls(kv_dtype=kv_dtype, sources=tuple(sources),
                   window_layers=tuple(p.layer for p in plan.layers),
                   backbone_layers=a.n_layers, window=a.window_size,
                   window_entry_bytes=fmt.fp8_entry_bytes(a.head_dim), tail_bytes=tails)

    @property
    def global_bytes_per_token(self) -> float:
        return sum(s.bytes_per_token for s in self.sources)

    def global_bytes(self, context: int) -> int:
        return sum(s.entries(context) * s.entry_bytes for s in self.sources)

    @property
    def ring_bytes(self) -> int:
        return self.window * self.window_entry_bytes

    @property
    def backbone_window_bytes(self) -> int:
        """Local state per sequence: every backbone layer's ring (bounded, context-free)."""
        return self.backbone_layers * self.ring_bytes

    @property
    def dspark_window_bytes(self) -> int:
        return (len(self.window_layers) - self.backbone_layers) * self.ring_bytes

    @property
    def local_bytes(self) -> int:
        return self.backbone_window_bytes + self.dspark_window_bytes + self.tail_bytes


# ---- the encoder snapshot (the DRAM pool's record) -----------------------------------------------

POINTER_BYTES = 8  # each small pointer is one int64 per sequence


@dataclass(frozen=True)
class EncoderSnapshotLayout:
    """What the minute-scale DRAM snapshot of one sequence holds when the decoder's local state
    is rebuilt by bounded replay at every prefill (SPEC section 6, the article): the encoder
    layers' window rings, every m>1 source's compressor tail, and the small pointers (position,
    index-K owner, the Engram lookback's `max_ngram - 1` token ids). No decoder or DSpark ring,
    no global entry (those are in the SSD blocks)."""

    ring_layers: tuple[int, ...]  # the encoder layers, each with its own ring
    ring_bytes: int  # one ring: window x FP8 entry (codes + E8M0 scales)
    tail_bytes: int  # fp32 kv + score of each m>1 source's partial group
    pointer_bytes: int  # pos + index owner + Engram lookback, int64 each

    @property
    def rings_bytes(self) -> int:
        return len(self.ring_layers) * self.ring_bytes

    @property
    def total_bytes(self) -> int:
        return self.rings_bytes + self.tail_bytes + self.pointer_bytes


def encoder_snapshot(plan: ModelPlan) -> EncoderSnapshotLayout:
    a = plan.args
    layout = KVLayout.from_plan(plan)
    lookback = a.engram_max_ngram_size - 1 if a.engram_layer_ids else 0
    return EncoderSnapshotLayout(ring_layers=plan.encoder_layers, ring_bytes=layout.ring_bytes,
                                 tail_bytes=layout.tail_bytes,
                                 pointer_bytes=POINTER_BYTES * (2 + lookback))


def encoder_snapshot_bytes(plan: ModelPlan) -> int:
    """Bytes of one sequence's encoder snapshot (independent of the context)."""
    return encoder_snapshot(plan).total_bytes
