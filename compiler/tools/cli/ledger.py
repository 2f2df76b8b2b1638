"""`dsv41 ledger`: each approximation's cost against exact mode (compiler/tools/ledger.py over
graph/ledger.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dsv41.compiler.tools.bench.measure import parse_tokens
from dsv41.compiler.tools.cli.common import count, natural, print_args

if TYPE_CHECKING:
    from dsv41.compiler.tools.ledger import LedgerCommandOptions


def add_parser(sub) -> None:
    sp = sub.add_parser("ledger", help="each approximation's cost against exact mode")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--seed", type=natural, default=0, help="seeded checkpoint and prompt ids")
    sp.add_argument("--contexts", default="64,256,900",
                    help="prompt lengths, e.g. 64,256,900 ('' for none)")
    sp.add_argument("--long-contexts", default="",
                    help="candidate_pool and shared_selection also over the bench's synthetic "
                         "cache of these many positions, decode steps scored (e.g. 32K,64K; "
                         "K = 1024)")
    sp.add_argument("--decode", type=natural, default=8,
                    help="teacher-forced steps scored after it")
    sp.add_argument("--suffix", type=count, default=32, help="replay: new tokens after the prefix")
    sp.add_argument("--carry-suffix", type=count, default=None,
                    help="decoder_carry: the second turn's new tokens (default: half the decoder "
                         "window; a whole window or more makes carry-over equal the replay)")
    sp.add_argument("--switches", default="",
                    help="comma-separated subset of ced,replay,fp4_kv,candidate_pool,"
                         "decoder_carry,shared_selection (default all)")
    sp.add_argument("--json", default=None, help="write the records as JSON here")
    sp.set_defaults(func=run, options=options)


def options(ns) -> LedgerCommandOptions:
    """`dsv41 ledger` -> ledger.LedgerCommandOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.ledger import LedgerCommandOptions
    from dsv41.graph.bill import parse_contexts
    from dsv41.graph.ledger import SWITCHES, LedgerOptions

    switches = tuple(s.strip() for s in ns.switches.split(",")) if ns.switches else \
        tuple(SWITCHES)
    ledger = LedgerOptions(
        contexts=parse_contexts(ns.contexts) if ns.contexts.strip() else (), decode=ns.decode,
        switches=switches, suffix=ns.suffix, seed=ns.seed, carry_suffix=ns.carry_suffix,
        long_contexts=parse_tokens(ns.long_contexts) if ns.long_contexts else ())
    return LedgerCommandOptions(ledger, checkpoint=Path(ns.checkpoint) if ns.checkpoint else None,
                                preset=ns.preset, json=Path(ns.json) if ns.json else None)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.ledger import run_command

    print_args("ledger", ns)
    return run_command(options(ns))
