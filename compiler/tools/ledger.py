"""`dsv41 ledger`: the approximations ledger of `graph/ledger.py` on a checkpoint, with a progress
bar, the bench's synthetic caches for the long contexts (`bench.synthetic`), the table and
the JSON."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from dsv41.compiler.tools.assets import ensure_checkpoint
from dsv41.compiler.tools.bench.measure import write_json
from dsv41.compiler.tools.bench.synthetic import synthetic_cache
from dsv41.graph.ledger import (
    LedgerOptions,
    format_ledger,
    ledger_json,
    long_switches,
    run_ledger,
)
from dsv41.graph.model import Model


@dataclass(frozen=True)
class LedgerCommandOptions:
    ledger: LedgerOptions = field(default_factory=LedgerOptions)
    checkpoint: Path | None = None  # default: the preset's seeded checkpoint
    preset: str = "small"
    json: Path | None = None


def run_command(opts: LedgerCommandOptions, *,
                default_checkpoint: Callable[[str, int], Path] = ensure_checkpoint) -> int:
    """Every comparison, then the table (and JSON). `default_checkpoint(preset, seed)`: the
    checkpoint without `opts.checkpoint`."""
    lo = opts.ledger
    ckpt = opts.checkpoint or default_checkpoint(opts.preset, lo.seed)
    t0 = time.time()
    model = Model.from_checkpoint(ckpt)
    print(f"checkpoint: {ckpt}")
    total = len(lo.contexts) * len(lo.switches) + len(lo.long_contexts) * len(long_switches(lo))
    bar = tqdm(total=total, desc="ledger", unit="cmp")

    def progress(rec) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{rec.switch} @ {rec.context} ({rec.source}): KL {rec.kl_mean:.3g}")

    def cache_at(n: int):
        return synthetic_cache(model, n, seed=lo.seed)

    ledger = run_ledger(model, lo, progress=progress, cache_at=cache_at)
    bar.close()
    print(format_ledger(ledger))
    if opts.json:
        write_json(opts.json, ledger_json(ledger))
        print(f"json: {opts.json}")
    print(f"{len(ledger.records)} comparisons in {time.time() - t0:.1f} s")
    return 0
