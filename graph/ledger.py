"""The ledger of costs: each approximation the released model makes, measured against the same
model with that one approximation undone, on the same weights and the same prompt.

The article lists what V4.1-Flash gives up for its savings: local state rebuilt approximately
(the decoder's at every prefill, the encoder's on a snapshot miss), main KV stored in FP4, four
upper indexers searching only the candidate pool, and thirty layers using a selection they did
not make. Each is a switch here (`SWITCHES`); a comparison runs both sides through the prompt,
then feeds the same continuation tokens one decode step at a time (teacher forcing), and scores
the next-token distribution at the prompt's last position and after each fed token, so effects
that only show once decoding reads the rebuilt state are counted too.

Per comparison: KL(exact || approx) of the next-token distributions (mean and max over the
scored positions), top-1 agreement, and the relative L2 distance of the logits (median, max).
For the two selection switches, also the overlap of the selections the affected layers used.

The two selection switches only differ from exact mode once a layer sees more entries than it
keeps (top-k 512; the candidate pool holds 2048 blocks of 8 = 16K entries at the released
sizes), i.e. at contexts an eager exact-mode prefill cannot reach on a CPU. For those,
`long_contexts` compares them over a given cache of N positions (`cache_at(N)`; `dsv41 ledger`
passes the bench's synthetic cache: format-valid entries of random values): both sides decode the
same seeded tokens from copies of that cache, and the scored positions are the decode steps only.

Not a switch: the 34 layers reading main KV they did not compute. Those layers have no
compressor weights of their own, so there is no exact counterpart to compare with.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv41.graph.cache import ModelCache, drop_local_state, new_cache, select_sequences
from dsv41.graph.model import Model
from dsv41.graph.phases import (
    ced_prefill,
    decode_step,
    prefill_exact,
    replay_prefill,
    resume_prefill,
)
from dsv41.graph.plan import REINDEX, REUSE


@dataclass(frozen=True)
class Switch:
    name: str
    approx: str  # what the released model does (the side being measured)
    exact: str  # what the switch computes instead (the reference side)


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("ced",
           "CED prefill: encoder over the prompt, decoder over its last `window` tokens only "
           "(decoder rings rebuilt from that segment), `phases.ced_prefill`",
           "exact mode: every block over every prompt token, `phases.prefill_exact`"),
    Switch("replay",
           "snapshot miss: rings and tails dropped (`cache.drop_local_state`), the last `window` "
           "prefix tokens replayed through the encoder, then the suffix; the decoder by bounded "
           "replay as in CED (`phases.replay_prefill`)",
           "the live cache continued exactly: `prefill_exact` of the prefix, then of the suffix"),
    Switch("fp4_kv",
           "main KV stored FP4 (E2M1 + E4M3 per 16)",
           "main KV stored bf16 (`new_cache(kv_dtype='bf16')`); index K stays MXFP4"),
    Switch("candidate_pool",
           "Reindex layers score only the candidate source's top blocks",
           "`Model.full_reindex`: Reindex layers (and, with per-layer selection, the Reuse layers "
           "after them) sweep every visible entry"),
    Switch("decoder_carry",
           "decoder carry-over (`EngineOptions.decoder_carry`): a second turn runs only its new "
           "tokens through the decoder (`ced_prefill` of the suffix on the live CED cache), so "
           "decoding reads decoder rings the first turn left; the record's `released_*` fields "
           "give the released design on the same turns: decoder bounded replay of the last "
           "`window` prompt tokens at every prefill (`phases.resume_prefill`). The second turn "
           "has `carry_suffix` new tokens (default half the window): a turn of a whole window "
           "or more rewrites every decoder ring entry decoding reads, so both designs (and a "
           "one-shot CED prefill) would give the same numbers",
           "the live cache continued exactly: `prefill_exact` of the first turn, then of the "
           "suffix"),
    Switch("shared_selection",
           "Reuse layers attend over the latest index source's top-k",
           "`Model.per_layer_selection`: each Reuse layer picks its own top-k with its index "
           "source's indexer weights on its own input, searching as that source does (full "
           "sweep after a Full layer, candidate pool after a Reindex layer)"),
)}

# The switches that act at decode time, so they can be measured over a cache not built from a
# prompt (`LedgerOptions.long_contexts`).
# Each selection switch's exact-mode model flag and the role of the layers it affects.
_SELECTION_SWITCHES = {"candidate_pool": ("full_reindex", REINDEX),
                       "shared_selection": ("per_layer_selection", REUSE)}
LONG_SWITCHES = tuple(_SELECTION_SWITCHES)


@dataclass(frozen=True)
class Trace:
    """One side of a comparison at one context length."""

    logits: torch.Tensor  # fp32 (1 + decode, V): after the prompt, then after each fed token
    selections: dict[int, torch.Tensor]  # layer -> int32 (1 + decode, topk), the scored rows
    seconds: float


@dataclass(frozen=True)
class Agreement:
    """How far the approximate side's next-token distributions are from the exact side's."""

    kl: np.ndarray  # float64 (n,): KL(exact || approx) per scored position, nats
    top1: np.ndarray  # bool (n,): same argmax
    rel_l2: np.ndarray  # float64 (n,): |approx - exact| / |exact| of the logits


@dataclass(frozen=True)
class LedgerRecord:
    switch: str
    context: int  # prompt tokens
    positions: int  # scored positions: the prompt's last, then one per decode step
    kl_mean: float
    kl_max: float
    top1: float  # fraction of scored positions with the same argmax
    rel_l2_median: float
    rel_l2_max: float
    sel_overlap: float | None  # selection switches: mean |exact & approx| / |exact| (else None)
    seconds: float  # compute of both sides; a side shared with another comparison (the
    # released exact-mode run) counts in each, so this is the cost of running it alone
    source: str = "prompt"  # "prompt": prefilled from seeded ids; "cache": a given cache
    # decoder_carry only: the released design (decoder replay at every prefill) against the same
    # exact side, so the carry-over's cost or benefit reads off one record (else None)
    released_kl_mean: float | None = None
    released_top1: float | None = None
    turn_tokens: int | None = None  # decoder_carry only: the second turn's new tokens


@dataclass(frozen=True)
class LedgerOptions:
    contexts: tuple[int, ...] = (64, 256, 900)
    decode: int = 8  # teacher-forced decode steps scored after the prompt
    switches: tuple[str, ...] = tuple(SWITCHES)
    suffix: int = 32  # replay: new tokens after the cached prefix (context = prefix + suffix)
    seed: int = 0  # the prompt's ids
    long_contexts: tuple[int, ...] = ()  # selection switches over a given cache of N positions
    # decoder_carry: the second turn's new tokens (None: half the decoder window, `carry_turn`)
    carry_suffix: int | None = None

    def __post_init__(self) -> None:
        bad = [s for s in self.switches if s not in SWITCHES]
        if bad or not self.switches:
            raise ValueError(f"Unknown or no switches {bad}; choose from {', '.join(SWITCHES)}.")
        if self.long_contexts and (self.decode < 1 or min(self.long_contexts) < 1):
            raise ValueError(f"Long contexts need >= 1 decode step and positive lengths, got "
                             f"decode {self.decode}, long contexts {list(self.long_contexts)}.")
        if self.long_contexts and not any(s in LONG_SWITCHES for s in self.switches):
            raise ValueError(f"Long contexts measure only {', '.join(LONG_SWITCHES)}; none of "
                             f"them is among the switches {list(self.switches)}.")
        if not self.contexts and not self.long_contexts:
            raise ValueError("Give at least one context or long context.")
        if self.contexts and min(self.contexts) < 2:
            raise ValueError(f"Contexts must be at least 2 tokens (a replay needs a prefix and "
                             f"a suffix), got {list(self.contexts)}.")
        if self.decode < 0:
            raise ValueError(f"The number of decode steps must be >= 0, got {self.decode}.")
        if self.suffix < 1:
            raise ValueError(f"The replay suffix must be >= 1 token, got {self.suffix}.")
        if self.carry_suffix is not None and self.carry_suffix < 1:
            raise ValueError(f"The carry-over turn must have >= 1 new token, got "
                             f"{self.carry_suffix}.")


@dataclass
class Ledger:
    options: LedgerOptions
    records: list[LedgerRecord] = field(default_factory=list)


# ---- metrics -------------------------------------------------------------------------------------


def compare_logits(exact: torch.Tensor, approx: torch.Tensor) -> Agreement:
    """Row-wise comparison of two (n, V) logit tensors. KL is computed in float64 and clamped
    at 0 (Gibbs: only rounding makes it negative), so identical inputs give exactly 0."""
    if exact.shape != approx.shape:
        raise ValueError(f"Logit shapes differ: exact {tuple(exact.shape)}, approx "
                         f"{tuple(approx.shape)}.")
    e, a = exact.double(), approx.double()
    le, la = torch.log_softmax(e, -1), torch.log_softmax(a, -1)
    kl = (le.exp() * (le - la)).sum(-1).clamp(min=0)
    rel = torch.linalg.vector_norm(a - e, dim=-1) / torch.linalg.vector_norm(e, dim=-1)
    return Agreement(kl.numpy(), (e.argmax(-1) == a.argmax(-1)).numpy(), rel.numpy())


def selection_overlap(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean over rows of |exact & approx| / |exact| for (n, k) -1 padded selections; 1 when the
    exact side selected nothing."""
    hits = []
    for e, a in zip(exact.tolist(), approx.tolist(), strict=True):
        se, sa = {i for i in e if i >= 0}, {i for i in a if i >= 0}
        hits.append(len(se & sa) / len(se) if se else 1.0)
    return float(np.mean(hits)) if hits else 1.0


def make_record(switch: str, context: int, exact: Trace, approx: Trace,
                sel_overlap: float | None = None, source: str = "prompt") -> LedgerRecord:
    g = compare_logits(exact.logits, approx.logits)
    return LedgerRecord(switch, context, len(g.kl), float(g.kl.mean()), float(g.kl.max()),
                        float(g.top1.mean()), float(np.median(g.rel_l2)), float(g.rel_l2.max()),
                        sel_overlap, exact.seconds + approx.seconds, source)


# ---- the two sides -------------------------------------------------------------------------------


def prompt_tokens(model: Model, n: int, seed: int = 0) -> np.ndarray:
    """n seeded ordinary ids (no BOS/EOS/PAD, no DSpark noise token), int64."""
    hi = model.args.vocab_size
    noise = model.args.dspark_noise_token_id
    if model.args.dspark_block_size and 3 < noise < hi:
        hi = noise
    return np.random.default_rng(seed).integers(3, hi, n).astype(np.int64)


def _cache(model: Model, n: int, kv_dtype: str = "fp4") -> ModelCache:
    pad = model.engram.pad_id if model.engram is not None else None
    return new_cache(model.plan, 1, n + 1, kv_dtype=kv_dtype, engram_pad=pad)


def _rows(res, out_logits: list, out_sel: dict) -> None:
    out_logits.append(res.logits[0, -1])
    for layer, sel in res.selections.items():
        out_sel.setdefault(layer, []).append(sel[0, -1])


def _decode(model: Model, cache: ModelCache, forced: torch.Tensor, first, t0: float) -> Trace:
    """`first` is the prompt phase's result (None: nothing before the decode steps is scored);
    then one decode step per forced token."""
    logits, sel = [], {}
    if first is not None:
        _rows(first, logits, sel)
    for i in range(forced.size(1)):
        _rows(decode_step(model, cache, forced[:, i : i + 1]), logits, sel)
    return Trace(torch.stack(logits), {k: torch.stack(v) for k, v in sel.items()},
                 time.perf_counter() - t0)


def run_trace(model: Model, tokens: np.ndarray, context: int, decode: int, *,
              phase: str = "exact", kv_dtype: str = "fp4") -> Trace:
    """Prompt tokens[:context] by `phase` (exact | ced), then tokens[context:context+decode]
    fed one decode step at a time."""
    t0 = time.perf_counter()
    toks = torch.from_numpy(tokens[: context + decode])[None]
    cache = _cache(model, context + decode, kv_dtype)
    run = {"exact": prefill_exact, "ced": ced_prefill}[phase]
    return _decode(model, cache, toks[:, context:], run(model, cache, toks[:, :context]), t0)


def run_cache_trace(model: Model, cache: ModelCache, forced: torch.Tensor) -> Trace:
    """forced (1, d) tokens decoded one step at a time from a copy of `cache` (left intact)."""
    t0 = time.perf_counter()
    return _decode(model, select_sequences(cache, [0]), forced, None, t0)


def run_replay_pair(model: Model, tokens: np.ndarray, context: int, decode: int,
                    suffix: int) -> tuple[Trace, Trace]:
    """(exact, approx) for a snapshot miss: the prefix tokens[:context - suffix] is prefilled
    exactly once; the exact side continues that live cache with the suffix, the approximate side
    drops its local state first and rebuilds it by bounded replay."""
    if not 1 <= suffix < context:
        raise ValueError(f"A replay needs a prefix and a suffix: suffix {suffix} must lie in "
                         f"1..{context - 1} for context {context}.")
    toks = torch.from_numpy(tokens[: context + decode])[None]
    prefix, new, forced = toks[:, : context - suffix], toks[:, context - suffix : context], \
        toks[:, context:]
    t0 = time.perf_counter()
    live = _cache(model, context + decode)
    prefill_exact(model, live, prefix)
    missed = select_sequences(live, [0])  # a copy
    t_prefix = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact = _decode(model, live, forced, prefill_exact(model, live, new), t0)
    t0 = time.perf_counter()
    drop_local_state(missed)
    approx = _decode(model, missed, forced, replay_prefill(model, missed, prefix, new), t0)
    return (dataclasses.replace(exact, seconds=exact.seconds + t_prefix), approx)


def run_carry_traces(model: Model, tokens: np.ndarray, context: int, decode: int,
                     suffix: int) -> tuple[Trace, Trace, Trace]:
    """(exact, carry, released) over two turns: tokens[:context - suffix], then the suffix, then
    the decode steps. Exact: `prefill_exact` of both turns. The first turn is one CED prefill
    for both approximate sides; carry then runs `ced_prefill` of the suffix on that cache (its
    decoder rings kept), released runs `resume_prefill` on a copy (rebuilt from the last
    `window` prompt tokens)."""
    if not 1 <= suffix < context:
        raise ValueError(f"Two turns need a first turn and a suffix: suffix {suffix} must lie "
                         f"in 1..{context - 1} for context {context}.")
    toks = torch.from_numpy(tokens[: context + decode])[None]
    first, new, forced = toks[:, : context - suffix], toks[:, context - suffix : context], \
        toks[:, context:]
    t0 = time.perf_counter()
    live = _cache(model, context + decode)
    prefill_exact(model, live, first)
    exact = _decode(model, live, forced, prefill_exact(model, live, new), t0)
    t0 = time.perf_counter()
    carried = _cache(model, context + decode)
    ced_prefill(model, carried, first)
    rebuilt = select_sequences(carried, [0])  # a copy
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry = _decode(model, carried, forced, ced_prefill(model, carried, new), t0)
    t0 = time.perf_counter()
    released = _decode(model, rebuilt, forced, resume_prefill(model, rebuilt, first, new), t0)
    return (exact, dataclasses.replace(carry, seconds=carry.seconds + t_first),
            dataclasses.replace(released, seconds=released.seconds + t_first))


def _overlap(model: Model, exact: Trace, approx: Trace, role: str) -> float:
    """Selections the layers of `role` used on each side (a Reuse layer without its own uses
    its index source's), compared layer by layer."""
    vals = []
    for p in model.plan.backbone:
        if p.role != role:
            continue
        e = exact.selections.get(p.layer, exact.selections.get(p.index_source))
        a = approx.selections.get(p.layer, approx.selections.get(p.index_source))
        if e is not None and a is not None:
            vals.append(selection_overlap(e, a))
    return float(np.mean(vals)) if vals else 1.0


# ---- the ledger ----------------------------------------------------------------------------------


def check_fits(model: Model, opts: LedgerOptions) -> None:
    top = model.args.max_seq_len
    longest = max((*opts.contexts, *opts.long_contexts))
    if longest + opts.decode > top:
        raise ValueError(f"Context {longest} plus {opts.decode} decode steps exceeds the "
                         f"model's max_seq_len of {top} tokens.")


def long_switches(opts: LedgerOptions) -> tuple[str, ...]:
    """The requested switches that `long_contexts` measures."""
    return tuple(s for s in opts.switches if s in LONG_SWITCHES)


def run_ledger(model: Model, opts: LedgerOptions, progress=None, cache_at=None) -> Ledger:
    """Every requested switch at every context length. The released exact-mode trace (exact side
    of `ced`, approximate side of the other three model switches) is run once per context.
    Then the selection switches at each long context, over `cache_at(n)` (a batch-1 cache of n
    processed positions). `progress(record)` is called after each comparison."""
    check_fits(model, opts)
    if opts.long_contexts and cache_at is None:
        raise ValueError("Long contexts need a cache factory (cache_at).")
    tokens = prompt_tokens(model, max(opts.contexts, default=0) + opts.decode, opts.seed)
    ledger = Ledger(opts)
    for n in opts.contexts:
        base = None

        def released(n: int = n) -> Trace:
            nonlocal base
            if base is None:
                base = run_trace(model, tokens, n, opts.decode)
            return base

        for name in opts.switches:
            ledger.records.append(measure(model, name, tokens, n, opts, released))
            if progress is not None:
                progress(ledger.records[-1])
    forced = torch.from_numpy(prompt_tokens(model, opts.decode, opts.seed))[None]
    for n in opts.long_contexts:
        cache = cache_at(n)
        base_trace = run_cache_trace(model, cache, forced)
        for name in long_switches(opts):
            ledger.records.append(measure_on_cache(model, name, cache, n, forced, base_trace))
            if progress is not None:
                progress(ledger.records[-1])
    return ledger


def carry_turn(model: Model, opts: LedgerOptions, n: int) -> int:
    """decoder_carry's second turn at context n: `opts.carry_suffix` new tokens, by default half
    the decoder window, where carry-over and the released replay differ (the turn's decode reads
    ring entries the first turn wrote under carry-over, rebuilt by the replay otherwise); at
    most n - 1 (the first turn keeps a token)."""
    k = opts.carry_suffix if opts.carry_suffix is not None else \
        max(1, model.args.window_size // 2)
    return min(k, n - 1)


def measure(model: Model, name: str, tokens: np.ndarray, n: int, opts: LedgerOptions,
            released=None) -> LedgerRecord:
    """One comparison. `released()` may return a cached exact-mode trace of this context."""
    d = opts.decode
    released = released or (lambda: run_trace(model, tokens, n, d))
    if name == "ced":
        return make_record(name, n, released(), run_trace(model, tokens, n, d, phase="ced"))
    if name == "replay":
        return make_record(name, n, *run_replay_pair(model, tokens, n, d, min(opts.suffix, n - 1)))
    if name == "decoder_carry":
        k = carry_turn(model, opts, n)
        exact, carry, replayed = run_carry_traces(model, tokens, n, d, k)
        rel = make_record(name, n, exact, replayed)
        return dataclasses.replace(make_record(name, n, exact, carry),
                                   released_kl_mean=rel.kl_mean, released_top1=rel.top1,
                                   turn_tokens=k)
    if name == "fp4_kv":
        return make_record(name, n, run_trace(model, tokens, n, d, kv_dtype="bf16"), released())
    if name in _SELECTION_SWITCHES:
        flag, role = _SELECTION_SWITCHES[name]
        exact = run_trace(dataclasses.replace(model, **{flag: True}), tokens, n, d)
        approx = released()
        return make_record(name, n, exact, approx, _overlap(model, exact, approx, role))
    raise ValueError(f"Unknown switch {name!r}; choose from {', '.join(SWITCHES)}.")


def measure_on_cache(model: Model, name: str, cache: ModelCache, n: int, forced: torch.Tensor,
                     released: Trace | None = None) -> LedgerRecord:
    """One selection switch over copies of `cache` (n processed positions); `released` may be
    the released model's trace over the same cache and tokens."""
    if name not in LONG_SWITCHES:
        raise ValueError(f"Switch {name!r} needs a prompt; over a given cache only "
                         f"{', '.join(LONG_SWITCHES)} can be measured.")
    flag, role = _SELECTION_SWITCHES[name]
    exact = run_cache_trace(dataclasses.replace(model, **{flag: True}), cache, forced)
    approx = released if released is not None else run_cache_trace(model, cache, forced)
    return make_record(name, n, exact, approx, _overlap(model, exact, approx, role), "cache")


# ---- output --------------------------------------------------------------------------------------


def format_ledger(ledger: Ledger) -> str:
    o = ledger.options
    head = (f"{'switch':<17} {'source':<6} {'context':>7} {'pos':>4} {'KL mean':>10} "
            f"{'KL max':>10} {'top-1':>6} {'relL2 med':>10} {'relL2 max':>10} {'sel ovl':>8} "
            f"{'time':>7}")
    rows = [head, "-" * len(head)]
    for r in ledger.records:
        ovl = "-" if r.sel_overlap is None else f"{r.sel_overlap:.3f}"
        rows.append(f"{r.switch:<17} {r.source:<6} {r.context:>7} {r.positions:>4} "
                    f"{r.kl_mean:>10.3g} {r.kl_max:>10.3g} {r.top1:>6.3f} "
                    f"{r.rel_l2_median:>10.3g} {r.rel_l2_max:>10.3g} {ovl:>8} {r.seconds:>6.1f}s")
    for r in ledger.records:
        if r.released_kl_mean is not None:
            rows.append(f"{r.switch} at {r.context} (a second turn of {r.turn_tokens} new "
                        f"tokens): carry-over KL mean {r.kl_mean:.3g}, top-1 {r.top1:.3f}; "
                        f"released (decoder replay at every prefill) KL mean "
                        f"{r.released_kl_mean:.3g}, top-1 {r.released_top1:.3f}")
    rows.append("")
    rows.append(f"KL(exact || approx) in nats over the prompt's last position + {o.decode} "
                f"teacher-forced decode steps; replay suffix {o.suffix} tokens; prompt seed "
                f"{o.seed}.\nsource cache: a given cache of `context` positions (synthetic "
                f"entries), scored over the {o.decode} decode steps only.\nsel ovl: mean "
                "|exact & approx| / |exact| of the selections the affected layers used; time: "
                "both sides, as if run alone.")
    return "\n".join(rows)


def ledger_json(ledger: Ledger) -> dict:
    return {
        "options": dataclasses.asdict(ledger.options),
        "switches": {k: dataclasses.asdict(v) for k, v in SWITCHES.items()
                     if k in ledger.options.switches},
        "records": [dataclasses.asdict(r) for r in ledger.records],
    }
