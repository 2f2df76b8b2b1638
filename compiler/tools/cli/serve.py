"""`dsv41 serve`: an OpenAI-compatible HTTP server with continuous batching
(runtime/serving/assembly.py); also the engine and batcher options `chat` and `bench serve` share
(`serving_args`, `serving_options`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from dsv41.compiler.tools.cli.common import (
    count,
    gibibytes,
    natural,
    positive_seconds,
    print_args,
    seconds,
)

if TYPE_CHECKING:
    from dsv41.runtime.serving.assembly import ServeOptions, ServingOptions


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def check_redis(url: str | None, *, timeout_s: float = 5.0) -> None:
    """A --redis-url (one server, or several seeds of one Redis Cluster, comma-separated) must
    answer a PING (one seed at least) before anything is loaded: a ValueError naming the
    (password-masked) URL and why, instead of a traceback once the model is up."""
    if url is None:
        return
    import redis  # the client alone (no torch)

    from dsv41.runtime.tiers.redis_pool import masked_url

    clients = []
    try:
        for seed in url.split(","):
            try:
                clients.append(redis.Redis.from_url(seed, socket_connect_timeout=timeout_s,
                                                    socket_timeout=timeout_s))
            except ValueError as e:
                raise ValueError(f"--redis-url {masked_url(url)} is not a Redis URL "
                                 f"({e}).") from None
        errors = []
        for client in clients:
            try:
                client.ping()
                return
            except redis.RedisError as e:
                errors.append(str(e))
        raise ValueError(f"--redis-url {masked_url(url)}: no Redis server answers there "
                         f"({'; '.join(errors)}).") from None
    finally:
        for client in clients:
            client.close()


def serving_args(sp, *, server: bool, persistent_store: bool = False) -> None:
    """The engine and batcher options of `serve`, `chat` and `bench serve` (`persistent_store`:
    without --store, the user's cache folder's store rather than a temporary one)."""
    sp.add_argument("--artifact", default=None, help="a compiled artifact folder")
    sp.add_argument("--backend", default="artifact",
                    help="artifact (compiled; compiles what is missing) | torch")
    sp.add_argument("--checkpoint", default=None, help="a checkpoint folder (wins over --preset)")
    sp.add_argument("--preset", default="small", help="seeded checkpoint of this preset")
    sp.add_argument("--seed", type=natural, default=0, help="the seeded checkpoint's seed")
    sp.add_argument("--store", default=None,
                    help="the SSD store's folder: new or empty, or a store to continue, which "
                         "other engines may share (default: " + (
                             "$XDG_CACHE_HOME/dsv41/store/<model>, else ~/.cache/..., kept" if
                             persistent_store else "a fresh temporary store, removed at the end")
                    + ")")
    sp.add_argument("--store-capacity-gib", type=gibibytes, default=None,
                    help="the SSD store's cap in GiB (default: 64; entries younger than 72 h are "
                         "never evicted, so a full store refuses writes)")
    sp.add_argument("--runtime-prefix", choices=("on", "off"), default="on",
                    help="the runtime-cache prefix tier: prompt blocks of running and recent "
                         "requests reused by new ones with the same prefix (default on)")
    sp.add_argument("--page-tokens", type=count, default=64,
                    help="runtime-cache page and SSD block, in positions")
    sp.add_argument("--target", default="cpu", help="the artifact's target")
    sp.add_argument("--out", default="artifacts", help="where artifacts live")
    sp.add_argument("--model-name", default=None,
                    help="the served model's id (default: the preset, or the checkpoint folder)")
    sp.add_argument("--max-running", type=count, default=16, help="sequences decoded together")
    sp.add_argument("--max-queue", type=count, default=64,
                    help="requests waiting for a slot (beyond: 429)" if server else
                    "requests waiting for a slot")
    sp.add_argument("--prefill-chunk", type=count, default=None,
                    help="prefill tokens per batcher step (default: the batcher's)")
    sp.add_argument("--redis-url", default=None,
                    help="the DRAM snapshot pool on this Redis server or Redis Cluster (one "
                         "node's URL, or several, comma-separated: seeds of one cluster), shared "
                         "by every process that names it (default: an in-process pool)")
    speculation_args(sp)


SPECULATIVE = ("auto", "on", "off")  # runtime.engine.options.SpecMode's strings


def speculation_args(sp) -> None:
    """DSpark speculation: `serve`, `chat`, `bench serve` and `run`."""
    sp.add_argument("--speculative", default="auto", choices=SPECULATIVE,
                    help="DSpark speculative decoding: auto (while it pays; off without DSpark "
                         "layers), on (every step; the artifact needs the draft and verify "
                         "entries, which the on-demand compile adds), off")
    sp.add_argument("--max-draft", type=count, default=None,
                    help="draft tokens a request verifies per step at most (default: the "
                         "DSpark block)")


def add_parser(sub) -> None:
    sp = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    serving_args(sp, server=True, persistent_store=True)
    sp.add_argument("--host", default="127.0.0.1", help="the address to bind (default: local)")
    sp.add_argument("--port", type=count, default=8000)
    sp.add_argument("--api-key", default=None,
                    help="require `Authorization: Bearer KEY` on /v1 (default: no key)")
    sp.add_argument("--request-timeout", type=seconds, default=600.0,
                    help="seconds a request may run before it is cancelled (0: none)")
    sp.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                    help="uvicorn's log level")
    sp.add_argument("--role", default="all", choices=("all", "vision", "prefill", "decode"),
                    help="all (one process) | vision | prefill | decode: one EPD stage, its queues "
                         "and hand-offs on --redis-url (runtime/epd.py)")
    sp.add_argument("--prefill-requests", type=count, default=4,
                    help="--role prefill: requests read and prefilled together, one chunk each "
                         "in turn (1: one at a time)")
    limit_args(sp)
    sp.set_defaults(func=run, options=options)


def limit_args(sp) -> None:
    """What a client may send and how long it may take (runtime/serving/http_limits.py)."""
    sp.add_argument("--max-body-mib", type=count, default=32,
                    help="a request body's size in MiB (beyond: 413; room for one image)")
    sp.add_argument("--max-json-depth", type=count, default=64,
                    help="arrays and objects nested in a body (beyond: 400)")
    sp.add_argument("--header-timeout", type=positive_seconds, default=10.0,
                    help="seconds for a request's head (beyond: 408, connection closed)")
    sp.add_argument("--body-timeout", type=positive_seconds, default=60.0,
                    help="seconds for a body's last byte after its head (beyond: 408)")
    sp.add_argument("--max-connections", type=count, default=1024,
                    help="connections open at once (keep it under the open-file limit)")


def http_limits(ns):
    """`serve`'s limit flags as runtime.serving.http_limits.HttpLimits."""
    # heavy: the serving package (fastapi, uvicorn); dsv41 --help loads no verb's work
    from dsv41.runtime.serving.http_limits import HttpLimits

    return HttpLimits(max_body_bytes=ns.max_body_mib << 20, max_json_depth=ns.max_json_depth,
                      header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
                      max_connections=ns.max_connections).validate()


def serving_options(ns, *, persistent_store: bool = False) -> ServingOptions:
    """The engine and batcher options `serve`, `chat` and `bench serve` share."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.runtime.serving.assembly import ServingOptions

    path = lambda v: None if v is None else Path(v)  # noqa: E731
    return ServingOptions(
        artifact=path(ns.artifact), backend=ns.backend, checkpoint=path(ns.checkpoint),
        preset=ns.preset, seed=ns.seed, store=path(ns.store), persistent_store=persistent_store,
        store_capacity_bytes=ns.store_capacity_gib, page_tokens=ns.page_tokens,
        target=ns.target, out=Path(ns.out), model_name=ns.model_name,
        max_running=ns.max_running, max_queue=ns.max_queue, prefill_chunk=ns.prefill_chunk,
        redis_url=ns.redis_url, speculative=ns.speculative, max_draft=ns.max_draft,
        runtime_prefix=ns.runtime_prefix == "on")


def options(ns) -> ServeOptions:
    """`dsv41 serve` -> serving.ServeOptions."""
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.runtime.serving.assembly import ServeOptions

    return ServeOptions(serving_options(ns, persistent_store=True), host=ns.host, port=ns.port,
                        api_key=ns.api_key,
                        request_timeout_s=None if ns.request_timeout <= 0 else ns.request_timeout,
                        log_level=ns.log_level, role=ns.role,
                        prefill_requests=ns.prefill_requests, limits=http_limits(ns)).validate()


def run(ns) -> int:
    # heavy: torch; dsv41 --help loads no verb's work
    from dsv41.compiler.tools.assets import COMPILING
    from dsv41.runtime.serving.assembly import masked_url, serve

    print_args("serve", argparse.Namespace(**{
        **vars(ns), "api_key": "***" if ns.api_key else None,
        "redis_url": masked_url(ns.redis_url)}))
    opts = options(ns)  # every option checked, then the Redis server, then the model loads
    check_redis(ns.redis_url)
    return serve(opts, COMPILING)
