"""`dsv41 <verb>`: each verb parses and validates, prints its arguments, then calls one API
function and ends with a short summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_CHECKPOINTS = Path("artifacts") / "checkpoints"


def _args_from(ns):
    from dsv41.graph.config import resolve_args

    return resolve_args(getattr(ns, "preset", None), getattr(ns, "config", None))


def _print_args(verb: str, ns) -> None:
    shown = {k: v for k, v in vars(ns).items() if k != "func"}
    print(f"dsv41 {verb} " + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in shown.items()))


def cmd_plan(ns) -> int:
    from dsv41.graph.config import PRESETS
    from dsv41.graph.plan import build_plan, format_plan

    names = PRESETS if ns.preset == "all" else (ns.preset,)
    for name in names:
        args = _args_from(argparse.Namespace(preset=name, config=ns.config))
        plan = build_plan(args)
        label = ns.config or name
        print(f"\n== layer plan: {label} (config {args.config_hash()[:12]}) ==")
        print(format_plan(plan))
        if ns.config:
            break
    return 0


def cmd_bill(ns) -> int:
    from dsv41.graph.bill import bill_chart, bill_json, format_bill, make_bill, parse_contexts

    _print_args("bill", ns)
    bill = make_bill(_args_from(ns), contexts=parse_contexts(ns.context), kv_dtype=ns.kv_dtype)
    print(format_bill(bill))
    if ns.chart:
        print(f"chart: {bill_chart(bill, ns.chart)}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(bill_json(bill), indent=1))
        print(f"json: {ns.json}")
    return 0


def ensure_checkpoint(preset_name: str, seed: int = 0) -> Path:
    """The seeded checkpoint for a preset, written once under artifacts/checkpoints/."""
    from dsv41.graph.checkpoint import write_seeded_checkpoint
    from dsv41.graph.config import preset

    out = DEFAULT_CHECKPOINTS / f"{preset_name}-seed{seed}"
    if not (out / "config.json").exists():
        print(f"writing a seeded {preset_name} checkpoint to {out} ...")
        write_seeded_checkpoint(preset(preset_name), out, seed=seed, progress=True)
    return out


def cmd_checkpoint(ns) -> int:
    from dsv41.graph.checkpoint import write_seeded_checkpoint

    _print_args("checkpoint", ns)
    t0 = time.time()
    out = write_seeded_checkpoint(_args_from(ns), ns.out, seed=ns.seed, progress=True,
                                  overwrite=ns.overwrite)
    print(f"wrote {out} in {time.time() - t0:.1f} s")
    return 0


def cmd_score(ns) -> int:
    import numpy as np
    from tqdm import tqdm

    from dsv41.graph.model import Model
    from dsv41.graph.score import GraphBackend, read_tokens, score

    _print_args("score", ns)
    tokens = read_tokens(ns.tokens)
    if ns.backend != "torch":
        raise ValueError(f"--backend {ns.backend!r}: only 'torch' (the PyTorch graph) is "
                         "available until compiled artifacts land.")
    hidden = tuple(int(x) for x in ns.hidden_states.split(",")) if ns.hidden_states else ()
    t0 = time.time()
    model = Model.from_checkpoint(ns.checkpoint)
    for h in hidden:
        if not 0 <= h < model.args.n_layers:
            raise ValueError(f"--hidden-states {h} is not a block of 0..{model.args.n_layers - 1}.")
    res = score(GraphBackend(model, kv_dtype=ns.kv_dtype), tokens, prefill=ns.prefill,
                mode=ns.mode, hidden_layers=hidden, progress=tqdm)
    res.to_npz(ns.out, tokens)
    finite = np.isfinite(res.logits).all(-1).sum()
    print(f"scored {len(tokens)} tokens ({res.prefill} prefilled, mode {ns.mode}) in "
          f"{time.time() - t0:.1f} s: {finite} logit rows, perplexity "
          f"{res.perplexity(tokens):.4f}, {res.token_layers} token-layers -> {ns.out}")
    return 0


def cmd_run(ns) -> int:
    from dsv41.runtime.agent_loop import AgentLoopConfig, run_agent_loop

    _print_args("run", ns)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    run_agent_loop(AgentLoopConfig(checkpoint=ckpt, context=ns.context, turns=ns.turns,
                                   suffix=ns.suffix, decode=ns.decode, exact=ns.exact,
                                   seed=ns.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment tools")
    sub = p.add_subparsers(dest="verb", required=True)

    def model_opts(sp, default="small"):
        sp.add_argument("--preset", default=default, help="small | bench | full")
        sp.add_argument("--config", default=None, help="a config.json (inference or HF form)")

    sp = sub.add_parser("plan", help="print the layer plan")
    sp.add_argument("--preset", default="all", help="small | bench | full | all")
    sp.add_argument("--config", default=None)
    sp.set_defaults(func=cmd_plan)

    sp = sub.add_parser("bill", help="the KV bill: global bytes per token and local state")
    model_opts(sp, "full")
    sp.add_argument("--context", default="128K,1M", help="e.g. 128K,1M (K=1e3, Ki=1024)")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--chart", default=None, help="write a PNG chart here")
    sp.add_argument("--json", default=None, help="write the bill as JSON here")
    sp.set_defaults(func=cmd_bill)

    sp = sub.add_parser("checkpoint", help="write a seeded checkpoint in the official layout")
    model_opts(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--overwrite", action="store_true")
    sp.set_defaults(func=cmd_checkpoint)

    sp = sub.add_parser("score", help="teacher-forced logits of a token sequence")
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--tokens", required=True, help=".npy or whitespace-separated ids")
    sp.add_argument("--prefill", type=int, default=None, help="tokens prefilled at position 0")
    sp.add_argument("--mode", default="exact", choices=("exact", "ced"))
    sp.add_argument("--backend", default="torch")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--hidden-states", default="", help="e.g. 0,1,2,3")
    sp.add_argument("--out", required=True)
    sp.set_defaults(func=cmd_score)

    sp = sub.add_parser("run", help="the agent-loop demo: long context, then short turns")
    sp.add_argument("--preset", default="small")
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--context", type=int, default=512)
    sp.add_argument("--turns", type=int, default=3)
    sp.add_argument("--suffix", type=int, default=32, help="new tokens per turn")
    sp.add_argument("--decode", type=int, default=16, help="tokens decoded per turn")
    sp.add_argument("--exact", action="store_true", help="exact phases throughout (no CED)")
    sp.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"dsv41 {ns.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
