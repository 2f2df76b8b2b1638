"""`dsv41 selftest`: the device check (compiler/tools/selftest.py, whose parser the bundle's
gpu_check.py shares; torch-free until it runs)."""

from __future__ import annotations

from dsv41.compiler.tools.cli.common import count, positive_seconds
from dsv41.compiler.tools.selftest import (
    DESCRIPTION,
    SelftestOptions,
    add_arguments,
    options_from,
    run_command,
)


def add_parser(sub) -> None:
    sp = sub.add_parser("selftest", description=DESCRIPTION,
                        help="the device check: conformance, gpu kernel tests, decode roofline")
    add_arguments(sp, count=count, seconds=positive_seconds)
    sp.set_defaults(func=run, options=options)


def options(ns) -> SelftestOptions:
    """`dsv41 selftest` -> selftest.SelftestOptions."""
    return options_from(ns)


def run(ns) -> int:
    return run_command(options(ns))
