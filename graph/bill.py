"""The KV bill: what a sequence costs to remember, per token and per context, in bytes.

Every dsv41 number here is read from `layout.KVLayout`, the object the caches allocate with, so
the printed bill cannot drift from the live bytes (SPEC section 5: the bill must be reproduced
from allocations, not only from a formula). The earlier DeepSeek generations are the only
hand-written figures, and each carries its arithmetic from the published config so a reader can
check the product instead of trusting a constant.

Context lengths are exact integers everywhere. The article's "1M tokens" is 1,000,000 tokens
(0.89 GB = 890 B x 10^6); dsv41's maximum context is 1,048,576 = 2^20. `parse_contexts` keeps the
two apart: plain K/M are decimal, Ki/Mi are binary, and `context_label` prints the same suffixes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from dsv41.graph.config import PRESETS, ModelArgs, preset
from dsv41.graph.cost import decode_step_costs
from dsv41.graph.layout import KVLayout, SourceLayout, encoder_snapshot
from dsv41.graph.plan import build_plan

DEFAULT_CONTEXTS = (131_072, 1_048_576)
GB = 10**9
GIB = 2**30
MB = 10**6

# suffix -> multiplier; decimal for the article's K/M, binary only when spelled Ki/Mi. The order
# is the labelling preference: the larger unit first, decimal before binary (128,000 is 128K).
_SUFFIXES = (("m", 10**6), ("mi", 2**20), ("k", 10**3), ("ki", 2**10))
_CONTEXT_RE = re.compile(r"(\d+)\s*(ki|k|mi|m)?", re.IGNORECASE)

CHART_SIZE_IN = (8.0, 4.5)
CHART_DPI = 100


# --------------------------------------------------------------------------------------------
# Earlier generations: published configs, with the arithmetic kept as data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryPart:
    """One stored vector of an entry, as the product of its config factors (so it can be
    printed as arithmetic and checked, not only quoted)."""

    what: str
    factors: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.factors)

    def arithmetic(self) -> str:
        return " x ".join(f"{f:,}" for f in self.factors)


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one compression ratio and entry format: the unit the article's formula
    `layers x (1/m) x bytes per entry` multiplies."""

    layers: int
    ratio: int  # tokens per entry
    parts: tuple[EntryPart, ...]

    @property
    def entry_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def bytes_per_token(self) -> float:
        return self.layers * self.entry_bytes / self.ratio

    def bytes_at(self, context: int) -> int:
        """Complete entries only, the same convention as `KVLayout.global_bytes`."""
        return self.layers * (context // self.ratio) * self.entry_bytes

    def arithmetic(self) -> str:
        parts = " + ".join(p.arithmetic() for p in self.parts)
        entry = f"({parts})" if len(self.parts) > 1 or len(self.parts[0].factors) > 1 else parts
        text = f"{self.layers} x {entry}"
        return text if self.ratio == 1 else f"{text} / {self.ratio}"


@dataclass(frozen=True)
class Generation:
    """An earlier DeepSeek model's global KV per token, from its published configuration."""

    name: str
    released: str
    note: str  # what the factors are
    groups: tuple[LayerGroup, ...]

    @property
    def bytes_per_token(self) -> float:
        return sum(g.bytes_per_token for g in self.groups)

    def bytes_at(self, context: int) -> int:
        return sum(g.bytes_at(context) for g in self.groups)

    def arithmetic(self) -> str:
        return _sum_line([g.arithmetic() for g in self.groups],
                         [g.bytes_per_token for g in self.groups])


_BF16 = 2

GENERATIONS: tuple[Generation, ...] = (
    Generation(
        name="DeepSeek LLM 67B",
        released="Nov 2023",
        note="dense GQA: layers x (KV heads x head dim x K,V x bf16 bytes)",
        groups=(LayerGroup(95, 1, (EntryPart("K and V", (8, 128, 2, _BF16)),)),),
    ),
    Generation(
        name="DeepSeek-V3",
        released="Dec 2024",
        note="MLA: layers x (512 latent x bf16 bytes + 64 RoPE key x bf16 bytes)",
        groups=(LayerGroup(61, 1, (EntryPart("latent", (512, _BF16)),
                                   EntryPart("RoPE key", (64, _BF16)))),),
    ),
    Generation(
        name="DeepSeek-V4-Flash",
        released="2026",
        note="21 CSA layers at m=4 (584 B entry + 68 B MXFP4 index key) "
             "+ 20 HCA layers at m=128 (584 B entry, no indexer)",
        groups=(
            LayerGroup(21, 4, (EntryPart("main KV", (584,)), EntryPart("index K", (68,)))),
            LayerGroup(20, 128, (EntryPart("main KV", (584,)),)),
        ),
    ),
)


# --------------------------------------------------------------------------------------------
# Bill records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceRow:
    """One KV source layer's line of the bill; every field is copied from its `SourceLayout`."""

    layer: int
    ratio: int
    main_kv_bytes: int  # per entry
    index_k_bytes: int  # per entry; 0 when no indexer reads this source
    entry_bytes: int
    bytes_per_token: float
    readers: tuple[int, ...]  # layers that read this source's main KV


@dataclass(frozen=True)
class LocalState:
    """Per-sequence state that does not grow with the context."""

    backbone_layers: int
    dspark_layers: int
    window: int
    window_entry_bytes: int
    backbone_window_bytes: int
    dspark_window_bytes: int
    tail_bytes: int  # compressor partial groups (fp32 kv + score) of the m>1 sources

    @property
    def total_bytes(self) -> int:
        return self.backbone_window_bytes + self.dspark_window_bytes + self.tail_bytes


@dataclass(frozen=True)
class ContextTotal:
    """Bytes held for one sequence at `context` tokens."""

    context: int
    global_bytes: int  # complete entries only; a partial group waits in the tail
    local_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.global_bytes + self.local_bytes


@dataclass(frozen=True)
class GenerationRow:
    """A generation set beside this bill: its bytes at each of the bill's contexts and how many
    times dsv41's global bytes per token it needs."""

    name: str
    released: str
    note: str
    arithmetic: str
    bytes_per_token: float
    bytes_at: tuple[int, ...]  # aligned with Bill.contexts
    ratio_to_dsv41: float


@dataclass(frozen=True)
class EncoderSnapshot:
    """The DRAM snapshot of one sequence (`layout.encoder_snapshot`): encoder rings, compressor
    tails and the small pointers; the decoder's rings are rebuilt by bounded replay."""

    ring_layers: int
    rings_bytes: int
    tail_bytes: int
    pointer_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class DecodeFlops:
    """One decode step's FLOPs at a context (`cost.decode_step_cost`): plain, and weighted as
    the article counts them (BF16 1, FP8 0.5, FP4 0.25)."""

    context: int
    flops: int
    weighted_flops: float


@dataclass(frozen=True)
class Bill:
    """One config's KV bill. Records, not a live layout, so it can be printed, charted and
    dumped to JSON without rebuilding the plan; every dsv41 number was read from `KVLayout`."""

    label: str
    kv_dtype: str
    contexts: tuple[int, ...]
    sources: tuple[SourceRow, ...]
    entries_per_token: float
    global_bytes_per_token: float
    global_arithmetic: str
    local: LocalState
    totals: tuple[ContextTotal, ...]
    generations: tuple[GenerationRow, ...]
    encoder_snapshot: EncoderSnapshot | None = None
    decode_flops: tuple[DecodeFlops, ...] = ()  # aligned with contexts


# --------------------------------------------------------------------------------------------
# Building the bill
# --------------------------------------------------------------------------------------------


def make_bill(args: ModelArgs, contexts: Sequence[int] = DEFAULT_CONTEXTS,
              kv_dtype: str = "fp4") -> Bill:
    """The bill of `args` at each context, read from the same `KVLayout` the caches use."""
    contexts = _check_contexts(contexts)
    plan = build_plan(args)
    layout = KVLayout.from_plan(plan, kv_dtype=kv_dtype)
    snap = encoder_snapshot(plan)
    bpt = layout.global_bytes_per_token
    local = _local_state(layout)
    return Bill(
        label=_label(args),
        kv_dtype=kv_dtype,
        contexts=contexts,
        sources=tuple(_source_row(s) for s in layout.sources),
        entries_per_token=float(sum(Fraction(1, s.ratio) for s in layout.sources)),
        global_bytes_per_token=bpt,
        global_arithmetic=_layout_arithmetic(layout.sources),
        local=local,
        totals=tuple(ContextTotal(c, layout.global_bytes(c), local.total_bytes)
                     for c in contexts),
        generations=tuple(_generation_row(g, contexts, bpt) for g in GENERATIONS),
        encoder_snapshot=EncoderSnapshot(len(snap.ring_layers), snap.rings_bytes,
                                         snap.tail_bytes, snap.pointer_bytes, snap.total_bytes),
        decode_flops=tuple(DecodeFlops(c.context, c.flops, c.weighted_flops)
                           for c in decode_step_costs(args, contexts)),
    )


def _check_contexts(contexts: Sequence[int]) -> tuple[int, ...]:
    """Contexts are token counts: bools, floats and non-positive values are caller mistakes."""
    out = tuple(contexts)
    if not out:
        raise ValueError("The bill needs at least one context length.")
    for c in out:
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ValueError(f"Context lengths must be positive integers, got {c!r}.")
    return out


def _label(args: ModelArgs) -> str:
    """Name the config by its preset when it is one, else by its hash, so a printed bill says
    which model it describes."""
    for name in PRESETS:
        if args == preset(name):
            return f"dsv41 (preset {name})"
    return f"dsv41 (config {args.config_hash()[:12]})"


def _source_row(s: SourceLayout) -> SourceRow:
    return SourceRow(layer=s.layer, ratio=s.ratio, main_kv_bytes=s.main_kv_bytes,
                     index_k_bytes=s.index_k_bytes, entry_bytes=s.entry_bytes,
                     bytes_per_token=s.bytes_per_token, readers=s.consumers)


def _local_state(layout: KVLayout) -> LocalState:
    return LocalState(
        backbone_layers=layout.backbone_layers,
        dspark_layers=len(layout.window_layers) - layout.backbone_layers,
        window=layout.window,
        window_entry_bytes=layout.window_entry_bytes,
        backbone_window_bytes=layout.backbone_window_bytes,
        dspark_window_bytes=layout.dspark_window_bytes,
        tail_bytes=layout.tail_bytes,
    )


def _layout_arithmetic(sources: Iterable[SourceLayout]) -> str:
    """The article's `layers x (bytes per entry) / m` line, grouped from the layout's sources
    (in order of first appearance), so the printed sum is the layout's own."""
    groups: dict[tuple[int, int, int], int] = {}
    for s in sources:
        key = (s.ratio, s.main_kv_bytes, s.index_k_bytes)
        groups[key] = groups.get(key, 0) + 1
    terms, values = [], []
    for (ratio, main, index), n in groups.items():
        entry = f"({main} + {index})" if index else f"{main}"
        terms.append(f"{n} x {entry} / {ratio}")
        values.append(n * (main + index) / ratio)
    return _sum_line(terms, values)


def _sum_line(terms: Sequence[str], values: Sequence[float]) -> str:
    """`a + b = x + y = total`, dropping the middle step when there is one term."""
    total = _num(sum(values))
    if len(terms) == 1:
        return f"{terms[0]} = {total}"
    return f"{' + '.join(terms)} = {' + '.join(_num(v) for v in values)} = {total}"


def _generation_row(g: Generation, contexts: tuple[int, ...], dsv41_bpt: float) -> GenerationRow:
    ratio = g.bytes_per_token / dsv41_bpt if dsv41_bpt else math.inf
    return GenerationRow(name=g.name, released=g.released, note=g.note,
                         arithmetic=g.arithmetic(), bytes_per_token=g.bytes_per_token,
                         bytes_at=tuple(g.bytes_at(c) for c in contexts), ratio_to_dsv41=ratio)


# --------------------------------------------------------------------------------------------
# Context lengths: parsing and labels
# --------------------------------------------------------------------------------------------


def parse_contexts(text: str) -> tuple[int, ...]:
    """Parse `128K,1M` style lists. K = 1,000 and M = 1,000,000 (the article's "0.89 GB at 1M");
    Ki = 1,024 and Mi = 1,048,576 (dsv41's maximum context is 1Mi). Suffixes ignore case."""
    items = text.split(",")
    if not text.strip():
        raise ValueError("The context list is empty; give lengths such as '128K,1M'.")
    return tuple(_parse_context(item) for item in items)


def _parse_context(item: str) -> int:
    match = _CONTEXT_RE.fullmatch(item.strip())
    if match is None:
        raise ValueError(f"Context length {item.strip()!r} is not a positive integer with an "
                         "optional K, Ki, M or Mi suffix.")
    digits, suffix = match.groups()
    value = int(digits) * _multiplier(suffix)
    if value <= 0:
        raise ValueError(f"Context length {item.strip()!r} must be positive.")
    return value


def _multiplier(suffix: str | None) -> int:
    if suffix is None:
        return 1
    return dict(_SUFFIXES)[suffix.lower()]


def context_label(context: int) -> str:
    """`1,048,576 tokens (1Mi)`, `1,000,000 tokens (1M)`: exact count plus the suffix that
    `parse_contexts` reads back to the same integer."""
    for suffix, mult in _SUFFIXES:
        if context >= mult and context % mult == 0:
            short = suffix[0].upper() + suffix[1:]
            return f"{context:,} tokens ({context // mult}{short})"
    return f"{context:,} tokens"


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def format_bill(bill: Bill) -> str:
    """The bill as plain text: sources, local state, totals, and the generations ledger."""
    sections = (_format_header(bill), _format_sources(bill), _format_local(bill.local),
                _format_snapshot(bill), _format_totals(bill), _format_decode_flops(bill),
                _format_generations(bill))
    return "\n\n".join(sections) + "\n"


def _format_header(bill: Bill) -> str:
    bpt = bill.global_bytes_per_token
    return "\n".join((
        f"KV bill: {bill.label}, main KV {bill.kv_dtype}, from graph.layout.KVLayout",
        f"global KV: {_num(bpt)} B/token ({_num(bill.entries_per_token)} entries/token) = "
        f"{_gb(bpt * 10**6)} GB per 1M (1,000,000) tokens, the article's convention",
    ))


def _format_sources(bill: Bill) -> str:
    head = (f"  {'layer':>5} {'m':>3} {'main KV B':>9} {'index K B':>9} {'entry B':>7} "
            f"{'B/token':>8}  read by")
    rows = ["Global KV sources (B per entry; complete entries only)", head]
    for s in bill.sources:
        rows.append(f"  {s.layer:>5} {s.ratio:>3} {s.main_kv_bytes:>9} {s.index_k_bytes:>9} "
                    f"{s.entry_bytes:>7} {_num(s.bytes_per_token):>8}  "
                    f"{_ranges(s.readers)} ({len(s.readers)} layers)")
    rows.append(f"  total: {bill.global_arithmetic} B/token")
    return "\n".join(rows)


def _format_local(local: LocalState) -> str:
    per = f"x {local.window} x {local.window_entry_bytes} B"
    lines = (
        ("backbone windows", f"{local.backbone_layers} layers {per}", local.backbone_window_bytes),
        ("DSpark windows", f"{local.dspark_layers} layers {per}", local.dspark_window_bytes),
        ("compressor tails", "fp32 kv + score of each m>1 source's partial group",
         local.tail_bytes),
    )
    rows = ["Local state per sequence (bounded: does not grow with the context)"]
    for name, how, nbytes in lines:
        rows.append(f"  {name:<17} {nbytes:>13,} B  {nbytes / MB:>8.3f} MB  {how}")
    rows.append(f"  {'total':<17} {local.total_bytes:>13,} B  {local.total_bytes / MB:>8.3f} MB")
    return "\n".join(rows)


def _format_snapshot(bill: Bill) -> str:
    e = bill.encoder_snapshot
    return (f"encoder snapshot (DRAM pool, per sequence) {e.total_bytes:>11,} B  "
            f"{e.total_bytes / MB:>8.3f} MB  {e.ring_layers} encoder rings {e.rings_bytes:,} B + "
            f"compressor tails {e.tail_bytes:,} B + pointers {e.pointer_bytes} B (pos, index "
            "owner, Engram lookback); no decoder or DSpark ring; between page boundaries also "
            "the global entries of the page not yet whole (they reach the SSD store with it)")


def _format_decode_flops(bill: Bill) -> str:
    rows = ["Decode FLOPs per token (graph.cost; weighted as the article counts: BF16 1, FP8 0.5, "
            "FP4 0.25)",
            f"  {'context':<26} {'GFLOP':>10} {'weighted GFLOP':>15}"]
    for f in bill.decode_flops:
        rows.append(f"  {context_label(f.context):<26} {f.flops / 1e9:>10.3f} "
                    f"{f.weighted_flops / 1e9:>15.3f}")
    if len(bill.decode_flops) > 1:
        a, b = bill.decode_flops[0], bill.decode_flops[-1]
        rows.append(f"  {_short(b.context)} / {_short(a.context)}: x{b.flops / a.flops:.3f} "
                    f"plain, x{b.weighted_flops / a.weighted_flops:.3f} weighted (the article: "
                    "\"rise by about a quarter\" from 4K to 1M, weighted)")
    return "\n".join(rows)


def _format_totals(bill: Bill) -> str:
    rows = ["Per sequence at each context (GB = 1e9 B, GiB = 2^30 B)",
            f"  {'context':<26} {'global KV B':>15} {'GB':>9} {'GiB':>9} "
            f"{'+ local B':>11} {'total GB':>9}"]
    for t in bill.totals:
        rows.append(f"  {context_label(t.context):<26} {t.global_bytes:>15,} "
                    f"{_gb(t.global_bytes):>9} {t.global_bytes / GIB:>9.3g} "
                    f"{t.local_bytes:>11,} {_gb(t.total_bytes):>9}")
    return "\n".join(rows)


def _format_generations(bill: Bill) -> str:
    ctx_heads = " ".join(f"{'GB @' + _short(c):>11}" for c in bill.contexts)
    rows = ["Global KV per token across DeepSeek generations (the ledger)",
            f"  {'model':<26} {'released':<9} {'B/token':>10} {ctx_heads} {'x dsv41':>8}"]
    for g in bill.generations:
        at = " ".join(f"{_gb(b):>11}" for b in g.bytes_at)
        rows.append(f"  {g.name:<26} {g.released:<9} {_num(g.bytes_per_token):>10} {at} "
                    f"{g.ratio_to_dsv41:>7.{_ratio_digits(g.ratio_to_dsv41)}f}x")
        rows.append(f"      {g.arithmetic} B/token  [{g.note}]")
    at = " ".join(f"{_gb(t.global_bytes):>11}" for t in bill.totals)
    rows.append(f"  {bill.label:<26} {'':<9} {_num(bill.global_bytes_per_token):>10} {at} "
                f"{1:>7.2f}x")
    rows.append(f"      {bill.global_arithmetic} B/token  [from graph.layout.KVLayout]")
    return "\n".join(rows)


def _ratio_digits(ratio: float) -> int:
    """Large ratios read as whole multiples (437x); small ones need decimals (3.95x)."""
    return 0 if ratio >= 100 else 2


def _short(context: int) -> str:
    label = context_label(context)
    return label[label.index("(") + 1 : -1] if "(" in label else f"{context:,}"


def _num(value: float) -> str:
    """Integers with thousands separators; fractions to at most two decimals."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def _gb(nbytes: float) -> str:
    """Three significant digits below 100 GB (0.89, 3.51), whole GB above (389)."""
    value = nbytes / GB
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ranges(layers: Sequence[int]) -> str:
    """`2-7` for a consecutive run, comma-separated runs otherwise."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs) or "-"


# --------------------------------------------------------------------------------------------
# Machine-readable form and chart
# --------------------------------------------------------------------------------------------


def bill_json(bill: Bill) -> dict[str, Any]:
    """Plain JSON types only (lists, ints, floats, strings), derived totals included."""
    return {
        "label": bill.label,
        "kv_dtype": bill.kv_dtype,
        "contexts": list(bill.contexts),
        "global_bytes_per_token": bill.global_bytes_per_token,
        "entries_per_token": bill.entries_per_token,
        "global_arithmetic": bill.global_arithmetic,
        "sources": [_source_json(s) for s in bill.sources],
        "local": _local_json(bill.local),
        "totals": [{"context": t.context, "global_bytes": t.global_bytes,
                    "local_bytes": t.local_bytes, "total_bytes": t.total_bytes}
                   for t in bill.totals],
        "generations": [_generation_json(g) for g in bill.generations],
        "encoder_snapshot": asdict(bill.encoder_snapshot),
        "decode_flops": [asdict(f) for f in bill.decode_flops],
    }


def _source_json(s: SourceRow) -> dict[str, Any]:
    return {"layer": s.layer, "ratio": s.ratio, "main_kv_bytes": s.main_kv_bytes,
            "index_k_bytes": s.index_k_bytes, "entry_bytes": s.entry_bytes,
            "bytes_per_token": s.bytes_per_token, "readers": list(s.readers)}


def _local_json(local: LocalState) -> dict[str, Any]:
    return {"backbone_layers": local.backbone_layers, "dspark_layers": local.dspark_layers,
            "window": local.window, "window_entry_bytes": local.window_entry_bytes,
            "backbone_window_bytes": local.backbone_window_bytes,
            "dspark_window_bytes": local.dspark_window_bytes, "tail_bytes": local.tail_bytes,
            "total_bytes": local.total_bytes}


def _generation_json(g: GenerationRow) -> dict[str, Any]:
    return {"name": g.name, "released": g.released, "note": g.note,
            "arithmetic": g.arithmetic, "bytes_per_token": g.bytes_per_token,
            "bytes_at": list(g.bytes_at), "ratio_to_dsv41": g.ratio_to_dsv41}


def bill_chart(bill: Bill, path: str | Path) -> Path:
    """Bytes per token across the generations and dsv41 as a log-scale bar chart (PNG).

    Uses a bare `Figure` on the Agg canvas rather than pyplot, so no display, no global figure
    registry and no backend switch leak into the caller's process."""
    # heavy: matplotlib (~0.6 s), only for bill --chart
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [f"{g.name}\n{g.released}" for g in bill.generations] + [bill.label]
    values = [g.bytes_per_token for g in bill.generations] + [bill.global_bytes_per_token]
    ratios = [g.ratio_to_dsv41 for g in bill.generations] + [1.0]
    fig = Figure(figsize=CHART_SIZE_IN, dpi=CHART_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(values)), values, color=["#8c8c8c"] * (len(values) - 1) + ["#1f77b4"])
    ax.set_yscale("log")
    ax.set_ylim(min(values) / 3, max(values) * 6)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("global KV bytes per token (log)")
    ax.set_title(f"KV cache bytes per token across DeepSeek generations ({bill.kv_dtype} main KV)")
    for bar, value, ratio in zip(bars, values, ratios, strict=True):
        ax.annotate(f"{_num(value)} B\n{ratio:.{_ratio_digits(ratio)}f}x",
                    (bar.get_x() + bar.get_width() / 2, value), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=CHART_DPI)
    return out


__all__ = [
    "Bill", "SourceRow", "LocalState", "ContextTotal", "GenerationRow", "Generation",
    "LayerGroup", "EntryPart", "GENERATIONS", "DEFAULT_CONTEXTS", "make_bill", "format_bill",
    "parse_contexts", "context_label", "bill_json", "bill_chart",
]
