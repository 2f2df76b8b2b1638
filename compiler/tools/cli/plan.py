"""`dsv41 plan`: the layer plan of a preset (or every preset), or with `--shards N` the sharding
plan over N workers (graph/plan.py, graph/sharding.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv41.compiler.tools.cli.common import args_from, count
from dsv41.graph.config import PRESETS
from dsv41.graph.plan import build_plan, format_plan


def add_parser(sub) -> None:
    sp = sub.add_parser("plan", help="print the layer plan")
    sp.add_argument("--preset", default="all", help="small | bench | full | long | all")
    sp.add_argument("--config", default=None)
    sp.add_argument("--shards", type=count, default=None,
                    help="the sharding plan over N workers (expert + tensor parallel) instead")
    sp.add_argument("--context", default="1M",
                    help="--shards: the one context the cache bytes are given at")
    sp.add_argument("--json", default=None, help="--shards: also write the plan as JSON")
    sp.set_defaults(func=run)


def run(ns) -> int:
    names = PRESETS if ns.preset == "all" else (ns.preset,)
    if ns.shards is not None:
        return shard_plan(ns, names)
    for name in names:
        args = args_from(argparse.Namespace(preset=name, config=ns.config))
        plan = build_plan(args)
        label = ns.config or name
        print(f"\n== layer plan: {label} (config {args.config_hash()[:12]}) ==")
        print(format_plan(plan))
        if ns.config:
            break
    return 0


def shard_plan(ns, names) -> int:
    # torch: graph.bill and graph.sharding import it (see the package docstring)
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.sharding import format_shard_plan, shard_plan_json
    from dsv41.graph.sharding import shard_plan as make_shard_plan

    if not ns.config and len(names) != 1:
        raise ValueError("--shards needs one --preset (or --config), not all of them.")
    (context,) = parse_contexts(ns.context)
    args = args_from(argparse.Namespace(preset=names[0], config=ns.config))
    plan = make_shard_plan(args, ns.shards)
    print(f"== shard plan: {ns.config or names[0]} (config {args.config_hash()[:12]}) ==")
    print(format_shard_plan(plan, context=context))
    if ns.json:
        Path(ns.json).write_text(json.dumps(shard_plan_json(plan, context=context), indent=1))
        print(f"json: {ns.json}")
    return 0
