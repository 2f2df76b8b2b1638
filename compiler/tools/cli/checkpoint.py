"""`dsv41 checkpoint`: a seeded checkpoint in the official layout (graph/checkpoint/): the
converted layout (`inference/convert.py`'s, the default) or the hub's (`--layout release`)."""

from __future__ import annotations

import time

from dsv41.compiler.tools.cli.common import (
    args_from,
    model_opts,
    natural,
    out_folder,
    print_args,
)


def add_parser(sub) -> None:
    sp = sub.add_parser("checkpoint", help="write a seeded checkpoint in the official layout")
    model_opts(sp)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=natural, default=0)
    sp.add_argument("--overwrite", action="store_true")
    sp.add_argument("--layout", choices=("converted", "release"), default="converted",
                    help="converted: convert.py's files (inference config.json; wo_a BF16, or FP8 "
                         "where the config's wo_a_dtype is fp8); "
                         "release: the hub's (FP8 wo_a + scale, index + shards, HF config.json)")
    sp.set_defaults(func=run)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.graph.checkpoint import write_seeded_checkpoint

    print_args("checkpoint", ns)
    t0 = time.time()
    out = write_seeded_checkpoint(args_from(ns), out_folder(ns.out), seed=ns.seed,
                                  progress=True, overwrite=ns.overwrite, layout=ns.layout)
    print(f"wrote {out} in {time.time() - t0:.1f} s")
    return 0
