"""`dsv41 bill`: the KV bill, global bytes per token and local state (graph/bill.py)."""

from __future__ import annotations

import json
from pathlib import Path

from dsv41.compiler.tools.cli.common import args_from, model_opts, print_args


def add_parser(sub) -> None:
    sp = sub.add_parser("bill", help="the KV bill: global bytes per token and local state")
    model_opts(sp, "full")
    sp.add_argument("--context", default="128K,1M", help="e.g. 128K,1M (K=1e3, Ki=1024)")
    sp.add_argument("--kv-dtype", default="fp4", choices=("fp4", "bf16"))
    sp.add_argument("--chart", default=None, help="write a PNG chart here")
    sp.add_argument("--json", default=None, help="write the bill as JSON here")
    sp.set_defaults(func=run)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.graph.bill import bill_chart, bill_json, format_bill, make_bill, parse_contexts

    print_args("bill", ns)
    bill = make_bill(args_from(ns), contexts=parse_contexts(ns.context), kv_dtype=ns.kv_dtype)
    print(format_bill(bill))
    if ns.chart:
        print(f"chart: {bill_chart(bill, ns.chart)}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(bill_json(bill), indent=1))
        print(f"json: {ns.json}")
    return 0
