"""`dsv41 chat`: a terminal chat on the embedded engine, reading stdin
(runtime/serving/assembly.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsv41.compiler.tools.cli.common import count, natural, print_args, probability, seconds
from dsv41.compiler.tools.cli.serve import check_redis, serving_args, serving_options

if TYPE_CHECKING:
    from dsv41.runtime.serving.assembly import ChatOptions


def add_parser(sub) -> None:
    sp = sub.add_parser("chat", help="a terminal chat on the embedded engine (reads stdin)")
    serving_args(sp, server=False)
    sp.add_argument("--system", default=None, help="a system message")
    sp.add_argument("--thinking", action="store_true", help="thinking mode")
    sp.add_argument("--max-tokens", type=count, default=64, help="tokens per reply at most")
    sp.add_argument("--temperature", type=seconds, default=0.0, help="0: greedy")
    sp.add_argument("--top-p", type=probability, default=1.0)
    sp.add_argument("--seed-sampling", type=natural, default=None, help="the sampler's seed")
    sp.set_defaults(func=run, options=options)


def options(ns) -> ChatOptions:
    """`dsv41 chat` -> serving.ChatOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.runtime.serving.assembly import ChatOptions

    return ChatOptions(serving_options(ns), system=ns.system, thinking=ns.thinking,
                       max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                       seed_sampling=ns.seed_sampling)


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.assets import COMPILING
    from dsv41.runtime.serving.assembly import chat

    print_args("chat", ns)
    opts = options(ns)
    check_redis(ns.redis_url)  # before the model loads
    return chat(opts, COMPILING)
