"""`dsv41 run`: the agent-loop demo, a long context then short turns
(runtime/engine/agent_loop.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dsv41.compiler.tools.cli.common import count, natural, print_args
from dsv41.compiler.tools.cli.serve import speculation_args


def add_parser(sub) -> None:
    sp = sub.add_parser("run", help="the agent-loop demo: long context, then short turns")
    sp.add_argument("--preset", default="small")
    sp.add_argument("--checkpoint", default=None)
    sp.add_argument("--seed", type=natural, default=0)
    sp.add_argument("--context", type=count, default=512)
    sp.add_argument("--turns", type=count, default=3)
    sp.add_argument("--suffix", type=count, default=32, help="new tokens per turn")
    sp.add_argument("--decode", type=count, default=16, help="tokens decoded per turn")
    sp.add_argument("--exact", action="store_true", help="exact phases throughout (no CED)")
    sp.add_argument("--restart-between-turns", action="store_true",
                    help="a new engine per turn: only the SSD store carries over")
    sp.add_argument("--backend", default="artifact", help="artifact (compiled) | torch")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue with "
                         "--keep-store (default: a fresh temporary store, removed at the end)")
    sp.add_argument("--page-tokens", type=count, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--keep-store", action="store_true",
                    help="continue from the --store folder's contents (without it that folder "
                         "must be new or empty; dsv41 run never deletes a folder)")
    speculation_args(sp)
    sp.set_defaults(func=run)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.assets import ensure_artifact, ensure_checkpoint
    from dsv41.graph.checkpoint import checkpoint_config
    from dsv41.runtime.backends.artifact import CED_ENTRIES, EXACT_ENTRIES
    from dsv41.runtime.engine.agent_loop import AgentLoopConfig, run_agent_loop
    from dsv41.runtime.engine.spec_setup import compiled_entries

    print_args("run", ns)
    ckpt = Path(ns.checkpoint) if ns.checkpoint else ensure_checkpoint(ns.preset, ns.seed)
    cfg = AgentLoopConfig(
        checkpoint=ckpt, artifact=None, store_dir=None if ns.store is None else Path(ns.store),
        context=ns.context, turns=ns.turns, suffix=ns.suffix, decode=ns.decode, exact=ns.exact,
        restart_between_turns=ns.restart_between_turns, keep_store=ns.keep_store,
        page_tokens=ns.page_tokens, seed=ns.seed, speculative=ns.speculative,
        max_draft=ns.max_draft)
    cfg.validate()  # arguments and the store folder, before anything is compiled
    artifact = None
    if ns.backend == "artifact":
        entries = compiled_entries(EXACT_ENTRIES if ns.exact else CED_ENTRIES, cfg.speculative,
                                   checkpoint_config(ckpt))
        artifact = ensure_artifact(ckpt, ns.preset, ns.target, entries, Path(ns.out))
    elif ns.backend != "torch":
        raise ValueError(f"--backend must be artifact or torch, got {ns.backend!r}.")
    run_agent_loop(replace(cfg, artifact=artifact))
    return 0
