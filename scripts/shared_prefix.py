"""N concurrent requests sharing one long prefix under the continuous batcher, with the runtime
prefix tier (issue 42's must-show) and without it (every prompt prefilled cold): how often the
prefix was prefilled, the other N-1 requests' TTFT p50 (from submit) and prefill p50 (from
admission to the first token) in both runs, and how many of them produced the same greedy
tokens as in the cold run.

    python scripts/shared_prefix.py --checkpoint CKPT [--artifact ART_DIR] [--prefix 4096] \\
        [--suffix 32] [--requests 8] [--max-tokens 8] [--page-tokens 256] [--json out.json]

Without --artifact the PyTorch graph of the checkpoint runs (slow on a CPU: use a small prefix
there). The shared run has an SSD store (a temporary folder) and `runtime_prefix=True`, as
`dsv41 serve` runs; the cold run has neither, so nothing is reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher


def _engine(args, **options) -> Engine:
    opts = {"page_tokens": args.page_tokens, **options}
    if args.artifact:
        return Engine.load(args.artifact, args.checkpoint, **opts)
    return Engine.from_model(
        Model.from_checkpoint(args.checkpoint),
        weights_hash=weights_fingerprint(args.checkpoint),
        **opts,
    )


def _warm(engine: Engine, prompt: list[int]) -> None:
    """One untimed request shorter than a page (no block of it is kept or stored), so that
    neither timed run pays the first call's setup (the first prefill of a fresh engine ran
    5-11% slower than the same prefill later)."""
    if len(prompt) >= engine.options.page_tokens:
        raise ValueError("The warm-up prompt must be shorter than one page.")
    _run(engine, [prompt], max_tokens=2)


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """The prompts submitted together to one batcher, stepped until every one finished."""
    b = Batcher(engine, max_running=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = dict(engine.token_counts)
    streams = [b.submit(p, params) for p in prompts]
    while b.step():
        pass
    tokens = [[ev.token_id for ev in s] for s in streams]
    timings = [s.timing for s in streams]
    st = b.stats()
    b.stop()
    return {
        "tokens": tokens,
        "tiers": [t.tier for t in timings],
        "reused": [t.reused_tokens for t in timings],
        "ttft_s": [t.first_token_s for t in timings],
        "prefill_s": [t.first_token_s - t.queued_s for t in timings],
        "tier_counts": dict(st.tiers),
        "prefilled": engine.token_counts["prefilled"] - before["prefilled"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default=None)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prefix", type=int, default=4096)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.requests < 2:
        raise SystemExit("--requests must be at least 2 (one prefills, the others reuse).")
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="dsv41-shared-prefix-") as tmp:
        shared = _engine(args, store_dir=Path(tmp) / "store", runtime_prefix=True)
        vocab = shared.model.args.vocab_size
        prefix = [int(x) for x in rng.integers(3, vocab, args.prefix)]
        prompts = [
            prefix + [int(x) for x in rng.integers(3, vocab, args.suffix)]
            for _ in range(args.requests)
        ]
        print(
            f"backend: {shared.backend}; {args.requests} requests, a {args.prefix}-token "
            f"prefix + {args.suffix} tokens each, {args.max_tokens} tokens out, pages of "
            f"{args.page_tokens}"
        )
        warm = [int(x) for x in rng.integers(3, vocab, min(64, args.page_tokens - 1))]
        with shared:
            _warm(shared, warm)
            a = _run(shared, prompts, args.max_tokens)
    with _engine(args) as cold:
        _warm(cold, warm)
        c = _run(cold, prompts, args.max_tokens)
    others = slice(1, None)
    out = {
        "backend": shared.backend,
        "requests": args.requests,
        "prefix_tokens": args.prefix,
        "shared_tiers": a["tier_counts"],
        "cold_tiers": c["tier_counts"],
        "prefix_prefills": sum(1 for t in a["tiers"] if t == "cold"),
        "runtime_prefix_tokens": sum(
            r for t, r in zip(a["tiers"], a["reused"], strict=True) if t == "runtime-prefix"
        ),
        "shared_prefilled_tokens": a["prefilled"],
        "cold_prefilled_tokens": c["prefilled"],
        "shared_ttft_p50_s": statistics.median(a["ttft_s"][others]),
        "cold_ttft_p50_s": statistics.median(c["ttft_s"][others]),
        "shared_prefill_p50_s": statistics.median(a["prefill_s"][others]),
        "cold_prefill_p50_s": statistics.median(c["prefill_s"][others]),
        "same_tokens_as_cold": sum(x == y for x, y in zip(a["tokens"], c["tokens"], strict=True)),
        "shared_leader_ttft_s": a["ttft_s"][0],
        "cold_leader_ttft_s": c["ttft_s"][0],
        "shared_ttft_s": a["ttft_s"],
        "cold_ttft_s": c["ttft_s"],
        "shared_prefill_s": a["prefill_s"],
        "cold_prefill_s": c["prefill_s"],
    }
    for k, v in out.items():
        if isinstance(v, list) and v and isinstance(v[0], float):
            v = "[" + ", ".join(f"{x:.2f}" for x in v) + "]"
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(
        f"summary: the prefix prefilled {out['prefix_prefills']} time(s) of {args.requests}; "
        f"the other {args.requests - 1}'s TTFT p50 {out['shared_ttft_p50_s'] * 1e3:.1f} ms vs "
        f"{out['cold_ttft_p50_s'] * 1e3:.1f} ms cold "
        f"({out['cold_ttft_p50_s'] / out['shared_ttft_p50_s']:.1f}x), prefill p50 "
        f"{out['shared_prefill_p50_s'] * 1e3:.1f} ms vs {out['cold_prefill_p50_s'] * 1e3:.1f} "
        f"ms ({out['cold_prefill_p50_s'] / out['shared_prefill_p50_s']:.1f}x); "
        f"{out['same_tokens_as_cold']}/{args.requests} outputs equal the cold run's"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
