"""`dsv41 score`: teacher-forced logits of a token sequence (compiler/tools/scoring.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dsv41.compiler.tools.cli.common import count, print_args

if TYPE_CHECKING:
    from dsv41.compiler.tools.scoring import ScoreOptions


def add_parser(sub) -> None:
    sp = sub.add_parser("score", help="teacher-forced logits of a token sequence")
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--tokens", required=True, help=".npy or whitespace-separated ids")
    sp.add_argument("--prefill", type=count, default=None, help="tokens prefilled at position 0")
    sp.add_argument("--mode", default="exact", choices=("exact", "ced"))
    sp.add_argument("--backend", default="torch")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--hidden-states", default="", help="e.g. 0,1,2,3")
    sp.add_argument("--images", default="",
                    help="comma-separated image files whose spans the prompt holds, in order")
    sp.add_argument("--out", required=True)
    sp.set_defaults(func=run, options=options)


def options(ns) -> ScoreOptions:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.scoring import ScoreOptions

    return ScoreOptions(
        checkpoint=Path(ns.checkpoint), tokens=Path(ns.tokens), out=Path(ns.out),
        prefill=ns.prefill, mode=ns.mode, backend=ns.backend, kv_dtype=ns.kv_dtype,
        hidden_states=tuple(int(x) for x in ns.hidden_states.split(",")) if ns.hidden_states
        else (), images=tuple(Path(p) for p in ns.images.split(",")) if ns.images else ())


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.scoring import score_command

    print_args("score", ns)
    return score_command(options(ns))
