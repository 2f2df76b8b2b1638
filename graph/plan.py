"""The layer plan: every layer's role under CSA2 + CED, derived from any valid `ModelArgs`.

Roles (SPEC section 2):
- `local`:   compress ratio 0, sliding window only.
- `full`:    a KV source: compresses its own main KV; as an index source it also owns index K and
             runs the indexer sweep over every visible entry (its own top-k).
- `reindex`: an index source that is not a KV source: reads its KV source's main KV and index K,
             computes its own index Q, and scores only the candidate pool.
- `reuse`:   reads the latest KV source's main KV and the latest index source's selection.

The encoder is every layer before the last KV source; the decoder starts at it, because that
layer's compressor input is the encoder's output (block L's attention collapses with block L-1's
FFN mix), so the decoder's global KV can be built without running the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv41.graph.config import ModelArgs

LOCAL, FULL, REINDEX, REUSE = "local", "full", "reindex", "reuse"


@dataclass(frozen=True, slots=True)
class LayerPlan:
    layer: int
    ratio: int  # compress ratio m (0 = window only)
    role: str  # local | full | reindex | reuse
    stage: str  # encoder | decoder | dspark
    kv_source: int  # layer whose main KV (and index K) this layer reads; -1 for local
    index_source: int  # layer whose selection this layer uses; -1 for local
    runs_indexer: bool  # computes index Q and a top-k of its own
    owns_index_k: bool  # writes index K (a KV source that is also an index source)
    candidate_source: bool  # publishes the candidate block pool
    uses_candidates: bool  # masks its scores to the candidate pool
    engram: bool  # Engram is applied to the stream before this block
    dspark_tap: bool  # DSpark reads this block's input (mean over copies)

    @property
    def is_kv_source(self) -> bool:
        return self.role == FULL


@dataclass(frozen=True)
class ModelPlan:
    args: ModelArgs
    layers: tuple[LayerPlan, ...]  # backbone then DSpark layers
    decoder_start: int  # first decoder layer (== n_layers when nothing is compressed)

    @property
    def backbone(self) -> tuple[LayerPlan, ...]:
        return self.layers[: self.args.n_layers]

    @property
    def dspark(self) -> tuple[LayerPlan, ...]:
        return self.layers[self.args.n_layers :]

    @property
    def kv_sources(self) -> tuple[LayerPlan, ...]:
        return tuple(p for p in self.backbone if p.is_kv_source)

    @property
    def encoder_layers(self) -> tuple[int, ...]:
        return tuple(range(self.decoder_start))

    @property
    def decoder_layers(self) -> tuple[int, ...]:
        return tuple(range(self.decoder_start, self.args.n_layers))

    def index_k_owner(self, kv_source: int) -> bool:
        return self.layers[kv_source].owns_index_k


def build_plan(args: ModelArgs) -> ModelPlan:
    """Derive and validate every layer's role. Raises ValueError naming the offending layer."""
    n = args.n_layers
    kv_set, idx_set = set(args.kv_source_layers), set(args.index_source_layers)
    cand = args.candidate_source_layer
    for name, ids in (("kv_source_layers", args.kv_source_layers),
                      ("index_source_layers", args.index_source_layers)):
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"ModelArgs.{name} {list(ids)} must be strictly increasing.")
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"ModelArgs.{name} names layer {i}, outside the backbone "
                                 f"0..{n - 1}.")
            if args.compress_ratios[i] == 0:
                raise ValueError(f"Layer {i} is in {name} but has compress ratio 0 (window only).")
    if cand >= 0:
        if cand not in idx_set or cand not in kv_set:
            raise ValueError(f"Candidate source layer {cand} must be both a KV source and an "
                             "index source.")
    decoder_start = max(kv_set) if kv_set else n

    layers: list[LayerPlan] = []
    latest_kv, latest_idx = -1, -1
    for i in range(n):
        m = args.compress_ratios[i]
        if i in kv_set:
            latest_kv = i
        if i in idx_set:
            latest_idx = i
        engram = i in args.engram_layer_ids
        tap = bool(args.dspark_block_size) and i in args.dspark_target_layer_ids
        stage = "encoder" if i < decoder_start else "decoder"
        if m == 0:
            layers.append(LayerPlan(i, 0, LOCAL, stage, -1, -1, False, False, False, False,
                                    engram, tap))
            continue
        if latest_kv < 0:
            raise ValueError(f"Layer {i} (ratio {m}) reads global KV, but no KV source comes at or "
                             "before it: a consumer before its source.")
        if args.compress_ratios[latest_kv] != m:
            raise ValueError(f"Layer {i} has ratio {m} but its KV source, layer {latest_kv}, has "
                             f"ratio {args.compress_ratios[latest_kv]}.")
        if latest_idx < 0:
            raise ValueError(f"Layer {i} (ratio {m}) needs a selection, but no index source comes "
                             "at or before it: a consumer before its source.")
        if args.compress_ratios[latest_idx] != m:
            raise ValueError(f"Layer {i} has ratio {m} but its index source, layer {latest_idx}, "
                             f"has ratio {args.compress_ratios[latest_idx]}.")
        if latest_idx < latest_kv and i in kv_set:
            # a KV source that does not index would hand its consumers stale positions
            raise ValueError(f"Layer {i} is a KV source but not an index source; its consumers "
                             f"would use layer {latest_idx}'s selection over another cache.")
        is_kv, is_idx = i in kv_set, i in idx_set
        if is_kv:
            role = FULL
        elif is_idx:
            role = REINDEX
            if not 0 <= cand < i:
                raise ValueError(f"Layer {i} is a Reindex layer (index source, not a KV source) "
                                 "but no candidate source comes before it.")
            if layers[cand].kv_source != latest_kv:
                raise ValueError(f"Reindex layer {i} reads KV source {latest_kv}, but its "
                                 f"candidate source {cand} scored KV source "
                                 f"{layers[cand].kv_source}.")
        else:
            role = REUSE
        layers.append(LayerPlan(
            layer=i, ratio=m, role=role, stage=stage, kv_source=latest_kv,
            index_source=latest_idx, runs_indexer=is_idx, owns_index_k=is_kv and is_idx,
            candidate_source=i == cand, uses_candidates=is_idx and 0 <= cand < i,
            engram=engram, dspark_tap=tap,
        ))
    if args.dspark_block_size:
        for j in range(args.n_mtp_layers):
            layers.append(LayerPlan(n + j, 0, LOCAL, "dspark", -1, -1, False, False, False,
                                    False, False, False))
    return ModelPlan(args=args, layers=tuple(layers), decoder_start=decoder_start)


def format_plan(plan: ModelPlan) -> str:
    """The plan as a fixed-width table, one row per layer."""
    head = (f"{'layer':>5} {'stage':<8} {'m':>3} {'role':<8} {'main KV':>7} {'index K':>7} "
            f"{'select':>6} {'indexer':<18} {'extras'}")
    rows = [head, "-" * len(head)]
    for p in plan.layers:
        if p.role == LOCAL:
            kv = ik = sel = "-"
            indexer = "-"
        else:
            kv = str(p.kv_source)
            ik = str(p.kv_source) if plan.layers[p.kv_source].owns_index_k else "-"
            sel = str(p.index_source)
            if p.candidate_source:
                indexer = "sweep + candidates"
            elif p.uses_candidates:
                indexer = "pool-masked"
            elif p.runs_indexer:
                indexer = "sweep"
            else:
                indexer = "reuse"
        extras = []
        if p.engram:
            extras.append("engram")
        if p.dspark_tap:
            extras.append("dspark-tap")
        if p.stage == "dspark":
            extras.append(f"mtp.{p.layer - plan.args.n_layers}")
        rows.append(f"{p.layer:>5} {p.stage:<8} {p.ratio:>3} {p.role:<8} {kv:>7} {ik:>7} "
                    f"{sel:>6} {indexer:<18} {' '.join(extras)}")
    a = plan.args
    rows.append("")
    rows.append(f"encoder layers 0-{plan.decoder_start - 1}, decoder layers "
                f"{plan.decoder_start}-{a.n_layers - 1}; KV sources "
                f"{[p.layer for p in plan.kv_sources]}; candidate source "
                f"{a.candidate_source_layer}; Engram {list(a.engram_layer_ids)}; DSpark taps "
                f"{list(a.dspark_target_layer_ids) if a.dspark_block_size else []}")
    return "\n".join(rows)
