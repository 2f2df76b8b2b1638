"""How the model splits over N workers: which worker holds which bytes of every checkpoint tensor,
where the partial results meet, and what each worker keeps for the caches.

    plan = shard_plan(args, shards=8)
    plan.tensors["layers.3.ffn.experts.17.w1.weight"]   # TensorShard(split=EXPERT, owner=0)
    plan.worker_weight_bytes()                          # per worker, device memory
    print(format_shard_plan(plan, context=1 << 20))

The rules (one per tensor, by its official name):

- **Routed experts: expert parallel.** Expert e of a layer lives whole on worker
  e * N // n_routed (contiguous blocks of n_routed / N experts). Every worker routes every token
  (the gate is replicated), runs the chosen experts it holds, and the FFN's partial sums meet in
  one all-reduce (together with the shared expert's, below).
- **Tensor parallel where a layer is large.** `wq_b` and the attention sinks split by query heads
  (n_heads / N per worker); the grouped `wo_a` by its o-groups (o_groups / N); `wo_b` by its
  input columns (row parallel: a partial sum per worker, all-reduced). The shared expert splits
  its intermediate dimension (w1 / w3 by rows, w2 by columns; all-reduced with the routed
  experts). The head splits the vocabulary (an all-gather of the logits); the embedding too (each
  worker looks up the ids in its slice, zeros elsewhere, all-reduced).
- **Replicated:** everything small or shared by all heads: the latent projections (`wq_a`,
  `wkv`), norms, mHC mixes, the gate, the compressors, the indexers (their scores sum over index
  heads and would need a context-sized all-reduce per step), Engram's projections, DSpark's
  Markov and confidence heads.
- **Engram tables in host memory**: one memory-mapped copy per machine shared by its workers;
  each step gathers the rows its tokens hash to (no device bytes).
- **Caches: replicated.** Attention has one latent KV head that every query head reads (the
  main KV, index K, window rings and compressor tails are read by all heads), so each worker
  keeps the whole cache of its sequences: the caches are sharded with the heads that read them,
  and here that is all of them. At 890 bytes per token that is under 1 GB per worker at 1M.

Splits must be whole: heads, o-groups, intermediate and vocabulary rows divide by N, and by the
FP8 scale tiles (32) where a split cuts a quantised matrix; anything else is a `ValueError`
naming the dimension. Expert counts need not divide (some workers then hold one more).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from dsv41.graph.checkpoint import FP8_TILE, TensorSpec, param_spec
from dsv41.graph.collectives import Collectives
from dsv41.graph.config import ModelArgs
from dsv41.graph.layout import KVLayout
from dsv41.graph.plan import build_plan


class Split(Enum):
    REPLICATED = "replicated"  # every worker holds the whole tensor
    EXPERT = "expert"  # one worker holds it whole
    ROWS = "rows"  # dim 0 split evenly (column parallel: each worker its outputs)
    COLS = "cols"  # dim 1 split evenly (row parallel: partial sums, all-reduced)
    HOST = "host"  # host memory, one memory-mapped copy per machine


class Collective(Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class TensorShard:
    name: str
    spec: TensorSpec
    split: Split
    owner: int | None = None  # the worker of an EXPERT tensor

    def worker_bytes(self, worker: int, shards: int) -> int:
        """Device bytes of this tensor on `worker` (HOST tensors: none)."""
        if self.split is Split.HOST:
            return 0
        if self.split is Split.EXPERT:
            return self.spec.nbytes if worker == self.owner else 0
        if self.split is Split.REPLICATED:
            return self.spec.nbytes
        return self.spec.nbytes // shards  # ROWS / COLS: checked to divide evenly

    def slice(self, worker: int, shards: int) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the stored tensor that `worker` reads, or None when it reads
        the whole tensor (REPLICATED; EXPERT on its owner) or nothing (see worker_bytes)."""
        if self.split not in (Split.ROWS, Split.COLS):
            return None
        dim = 0 if self.split is Split.ROWS else 1
        size = self.spec.shape[dim] // shards
        return dim, worker * size, (worker + 1) * size


@dataclass(frozen=True)
class MeetingPoint:
    """Where the workers' partial results meet, once per layer that has it."""

    where: str  # e.g. "attention output (wo_b)"
    collective: Collective
    per_layer: bool  # once per layer (True) or once per step (False)


@dataclass(frozen=True)
class ShardPlan:
    args: ModelArgs
    shards: int
    tensors: Mapping[str, TensorShard]
    meetings: tuple[MeetingPoint, ...]

    def worker_weight_bytes(self) -> tuple[int, ...]:
        return tuple(sum(t.worker_bytes(w, self.shards) for t in self.tensors.values())
                     for w in range(self.shards))

    def host_bytes(self) -> int:
        """Per machine: the Engram tables, mapped once and shared by its workers."""
        return sum(t.spec.nbytes for t in self.tensors.values() if t.split is Split.HOST)

    def total_bytes(self) -> int:
        return sum(t.spec.nbytes for t in self.tensors.values())

    def worker_cache_bytes(self, context: int, kv_dtype: str = "fp4") -> int:
        """One sequence's cache at `context` tokens, held whole by every worker (see above)."""
        layout = KVLayout.from_plan(build_plan(self.args), kv_dtype=kv_dtype)
        return layout.global_bytes(context) + layout.local_bytes

    def collectives_per_step(self) -> dict[Collective, int]:
        """Collectives of one forward step of the backbone (DSpark layers not counted)."""
        out = dict.fromkeys(Collective, 0)
        for m in self.meetings:
            out[m.collective] += self.args.n_layers if m.per_layer else 1
        return out


# ---- the rules ---------------------------------------------------------------------------------

_EXPERT = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")
_BY_SUFFIX: tuple[tuple[str, Split], ...] = (
    ("attn.wq_b.weight", Split.ROWS), ("attn.wq_b.scale", Split.ROWS),
    ("attn.attn_sink", Split.ROWS),
    ("attn.wo_a.weight", Split.ROWS), ("attn.wo_a.scale", Split.ROWS),
    ("attn.wo_b.weight", Split.COLS), ("attn.wo_b.scale", Split.COLS),
    ("ffn.shared_experts.w1.weight", Split.ROWS), ("ffn.shared_experts.w1.scale", Split.ROWS),
    ("ffn.shared_experts.w3.weight", Split.ROWS), ("ffn.shared_experts.w3.scale", Split.ROWS),
    ("ffn.shared_experts.w2.weight", Split.COLS), ("ffn.shared_experts.w2.scale", Split.COLS),
    ("engram.embed.weight", Split.HOST), ("engram.embed.scale", Split.HOST),
)
_WHOLE_NAMES = {"embed.weight": Split.ROWS, "head.weight": Split.ROWS}

MEETINGS = (
    MeetingPoint("embedding (vocabulary slices)", Collective.ALL_REDUCE, per_layer=False),
    MeetingPoint("attention output (wo_b, row parallel)", Collective.ALL_REDUCE, per_layer=True),
    MeetingPoint("FFN output (local routed experts + shared expert slice)",
                 Collective.ALL_REDUCE, per_layer=True),
    MeetingPoint("logits (vocabulary slices of the head)", Collective.ALL_GATHER,
                 per_layer=False),
)


def _split_of(name: str) -> Split:
    if name in _WHOLE_NAMES:
        return _WHOLE_NAMES[name]
    for suffix, split in _BY_SUFFIX:
        if name.endswith(suffix):
            return split
    return Split.REPLICATED


def _check_divides(name: str, spec: TensorSpec, split: Split, shards: int) -> None:
    dim = 0 if split is Split.ROWS else 1
    size = spec.shape[dim]
    if size % shards:
        raise ValueError(f"{name}: its dimension {dim} ({size}) does not split over {shards} "
                         "workers; choose a worker count that divides it.")
    if spec.dtype == "F8_E4M3" and (size // shards) % FP8_TILE:
        raise ValueError(f"{name}: a slice of {size // shards} along dimension {dim} cuts its "
                         f"{FP8_TILE}x{FP8_TILE} FP8 scale tiles; choose another worker count.")
    if spec.dtype == "F8_E8M0" and spec.shape[dim] % shards:  # the tiles' scales follow them
        raise ValueError(f"{name}: {spec.shape[dim]} scale tiles do not split over {shards}.")


def shard_plan(args: ModelArgs, shards: int) -> ShardPlan:
    """The plan for `shards` workers (1: everything on one worker, nothing meets)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"The worker count must be a whole number >= 1, got {shards!r}.")
    for what, n in (("query heads", args.n_heads), ("o-groups", args.o_groups)):
        if n % shards:
            raise ValueError(f"The {n} {what} do not split over {shards} workers; choose a "
                             "worker count that divides them.")
    tensors = {}
    for name, spec in param_spec(args).items():
        m = _EXPERT.match(name)
        if m is not None:
            layer = int(name.split(".")[1]) + (args.n_layers if name.startswith("mtp.") else 0)
            n_routed, _ = args.moe_config(layer)
            owner = int(m.group(1)) * shards // n_routed
            tensors[name] = TensorShard(name, spec, Split.EXPERT, owner)
            continue
        split = _split_of(name)
        if shards > 1 and split in (Split.ROWS, Split.COLS):
            _check_divides(name, spec, split, shards)
        tensors[name] = TensorShard(name, spec, split)
    return ShardPlan(args, shards, tensors, MEETINGS if shards > 1 else ())


# ---- one worker's share ------------------------------------------------------------------------


def expert_block(worker: int, shards: int, n_routed: int) -> range:
    """The routed experts `worker` holds: e with e * shards // n_routed == worker (contiguous)."""
    return range(-(-worker * n_routed // shards), -(-(worker + 1) * n_routed // shards))


@dataclass(frozen=True)
class WorkerShard:
    """What a worker's model needs to know of the split: its rank, the worker count, and the
    collectives it meets the others through (`graph/collectives.py`)."""

    worker: int
    shards: int
    comm: Collectives = field(compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.worker < self.shards:
            raise ValueError(f"Worker {self.worker} is not one of {self.shards} workers.")

    def experts(self, n_routed: int) -> range:
        return expert_block(self.worker, self.shards, n_routed)


def worker_slices(plan: ShardPlan, worker: int) -> dict[str, tuple[int, int, int] | None]:
    """Every checkpoint tensor `worker` reads: name -> (dim, start, stop) of its slice, or None
    for the whole tensor (replicated, host, and its own experts). Other workers' experts are
    not listed."""
    if not 0 <= worker < plan.shards:
        raise ValueError(f"Worker {worker} is not one of the plan's {plan.shards} workers.")
    out = {}
    for name, t in plan.tensors.items():
        if t.split is Split.EXPERT and t.owner != worker:
            continue
        out[name] = t.slice(worker, plan.shards)
    return out


def sliced_spec(spec: TensorSpec, cut: tuple[int, int, int] | None) -> TensorSpec:
    """The spec of a worker's slice of a stored tensor."""
    if cut is None:
        return spec
    dim, start, stop = cut
    shape = list(spec.shape)
    shape[dim] = stop - start
    logical = list(spec.logical_shape)
    logical[dim] = (stop - start) * spec.logical_shape[dim] // spec.shape[dim]  # FP4: packed x2
    return replace(spec, shape=tuple(shape), logical_shape=tuple(logical))


# ---- the printout -----------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:9.3f} GB"


def format_shard_plan(plan: ShardPlan, *, context: int) -> str:
    weights = plan.worker_weight_bytes()
    cache = plan.worker_cache_bytes(context)
    by_split = {s: sum(t.spec.nbytes for t in plan.tensors.values() if t.split is s)
                for s in Split}
    lines = [f"shards: {plan.shards} workers; checkpoint {_gb(plan.total_bytes()).strip()}",
             "by placement (whole-model bytes):"]
    lines += [f"  {s.value:10s} {_gb(by_split[s])}" for s in Split if by_split[s]]
    lines.append(f"host memory per machine (Engram tables, mapped once): "
                 f"{_gb(plan.host_bytes()).strip()}")
    lines.append(f"per worker at {context:,} tokens (one sequence; the cache is whole on every "
                 "worker):")
    lines.append(f"  {'worker':>6s} {'weights':>12s} {'cache':>12s} {'total':>12s}")
    for w, b in enumerate(weights):
        lines.append(f"  {w:6d} {_gb(b)} {_gb(cache)} {_gb(b + cache)}")
    if plan.meetings:
        per = plan.collectives_per_step()
        lines.append("where partial results meet (per backbone step: "
                     + ", ".join(f"{n} {c.value}" for c, n in per.items() if n) + "):")
        lines += [f"  {m.where}: {m.collective.value}"
                  + (" per layer" if m.per_layer else " per step") for m in plan.meetings]
    spread = max(weights) / max(1, min(weights))
    lines.append(f"largest / smallest worker's weights: {spread:.3f}")
    return "\n".join(lines)


def shard_plan_json(plan: ShardPlan, *, context: int) -> dict:
    cache = plan.worker_cache_bytes(context)
    return {"shards": plan.shards, "context": context,
            "checkpoint_bytes": plan.total_bytes(), "host_bytes": plan.host_bytes(),
            "workers": [{"worker": w, "weight_bytes": b, "cache_bytes": cache}
                        for w, b in enumerate(plan.worker_weight_bytes())],
            "meetings": [{"where": m.where, "collective": m.collective.value,
                          "per_layer": m.per_layer} for m in plan.meetings],
            "splits": {name: t.split.value for name, t in plan.tensors.items()}}


def divisible_worker_counts(args: ModelArgs, limit: int = 64) -> list[int]:
    """Worker counts up to `limit` this config splits over."""
    out = []
    for n in range(1, limit + 1):
        try:
            shard_plan(args, n)
        except ValueError:
            continue
        out.append(n)
    return out

