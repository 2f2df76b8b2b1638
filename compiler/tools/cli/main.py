"""`dsv41`: the one parser tree of every verb (each verb module's `add_parser`) and `main`."""

from __future__ import annotations

import argparse
import sys

from dsv41.compiler.tools.cli import (
    bench,
    bill,
    bundle,
    chat,
    checkpoint,
    ledger,
    plan,
    run,
    score,
    selftest,
    serve,
    tune,
)
from dsv41.compiler.tools.cli import compile as compile_  # the verb, not the builtin
from dsv41.compiler.tools.cli.bench import with_default_bench_verb
from dsv41.runtime.backends.disco import is_sharded_dir, load_disco
from dsv41.runtime.backends.onednn import bound_onednn_caches

VERBS = (plan, bill, checkpoint, score, compile_, bundle, selftest, bench, run, ledger, tune,
         serve, chat)  # in the order `dsv41 --help` lists them


def build_parser() -> argparse.ArgumentParser:
    """The one parser of every verb and sub-verb."""
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash deployment tools")
    sub = p.add_subparsers(dest="verb", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return p


def load_disco_first(ns) -> bool:
    """A command given a sharded artifact (`--artifact DIR`) runs it on disco workers, whose
    runtime libraries must be loaded before anything imports tvm: load them first thing.
    Whether it did."""
    art = getattr(ns, "artifact", None)
    if isinstance(art, str) and is_sharded_dir(art):
        load_disco()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    argv = with_default_bench_verb(list(sys.argv[1:] if argv is None else argv))
    ns = build_parser().parse_args(argv)
    try:
        load_disco_first(ns)
        bound_onednn_caches()  # before any torch work of any command (runtime/onednn.py)
        return ns.func(ns)
    except ValueError as e:  # bad input: a sentence, argparse's exit code
        print(f"dsv41 {getattr(ns, 'error_prog', ns.verb)}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the environment refused (a permission, a full disk): one line
        print(f"dsv41 {getattr(ns, 'error_prog', ns.verb)}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
