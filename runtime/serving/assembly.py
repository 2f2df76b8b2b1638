"""What `dsv41 serve`, `dsv41 chat` and `dsv41 bench serve` run on: the engine (an artifact, or
the PyTorch graph) with its tokenizer, the batcher in front of it, and the two front ends (the
OpenAI-compatible HTTP server, one process or one EPD stage; the terminal chat).

A checkpoint or an artifact the options do not name comes from an `ArtifactSource`: the CLI
passes the compiler's (compiler/tools/assets.py: a seeded checkpoint written, the missing
entries compiled); a deployment without the compiler names both folders and passes none.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import redis

from dsv41.graph.checkpoint import checkpoint_config, weights_fingerprint
from dsv41.graph.entries import CED_ENTRIES
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.options import SPEC_MODES, SpecMode
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.engine.spec_setup import compiled_entries
from dsv41.runtime.serving.app import ServerOptions, create_app, run_server
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.epd import Role
from dsv41.runtime.serving.epd_gateway import EpdGateway
from dsv41.runtime.serving.epd_prefill import MAX_PREFILL_REQUESTS, PrefillWorker
from dsv41.runtime.serving.epd_stages import DecodeWorker, EpdServerMetrics, VisionWorker
from dsv41.runtime.serving.http_limits import HttpLimits
from dsv41.runtime.serving.terminal_chat import ChatSettings, run_chat
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.tiers.redis_pool import masked_url as mask
from dsv41.runtime.tiers.ssd_store import FORMAT_VERSION, STORE_KIND
from dsv41.runtime.tiers.store_folder import check_folder


class ServingBackend(StrEnum):
    """What the engine runs (the strings are `--backend`'s)."""

    ARTIFACT = "artifact"  # a compiled artifact
    TORCH = "torch"  # the PyTorch graph (no compiled entries)


BACKENDS = tuple(ServingBackend)
ROLES = tuple(Role)  # all (one process) | vision | prefill | decode (one EPD stage)


class ArtifactSource(Protocol):
    """Where what the options leave out comes from. compiler/tools/assets.py's `COMPILING`
    writes a preset's seeded checkpoint and compiles an artifact's missing entries; the runtime
    itself never compiles (it imports nothing of the compiler)."""

    def checkpoint(self, preset: str, seed: int) -> Path:
        """The seeded checkpoint folder of `preset` (written when missing)."""

    def artifact(self, checkpoint: Path, name: str, target: str, entries: tuple[str, ...],
                 out: Path) -> Path:
        """The artifact folder of `checkpoint`'s config under `out`, with `entries`."""


@dataclass(frozen=True)
class ServingOptions:
    """The engine and batcher options of `serve`, `chat` and `bench serve`."""

    artifact: Path | None = None  # a compiled artifact folder (default: compiled when missing)
    backend: ServingBackend = ServingBackend.ARTIFACT
    checkpoint: Path | None = None  # default: the preset's seeded checkpoint
    preset: str = "small"
    seed: int = 0  # the seeded checkpoint's seed
    store: Path | None = None  # the SSD store (default: `persistent_store`'s choice)
    # no `store`: the user's cache folder (`default_store_folder`; `dsv41 serve`) when True,
    # else a fresh temporary store removed at the end (`chat`, `bench serve`)
    persistent_store: bool = False
    store_capacity_bytes: int | None = None  # the SSD store's cap (default: EngineOptions')
    page_tokens: int = 64
    target: str = "cpu"
    out: Path = Path("artifacts")  # where artifacts live
    model_name: str | None = None  # default: the preset, or the checkpoint folder's name
    max_running: int = 16
    max_queue: int = 64
    prefill_chunk: int | None = None  # default: the batcher's
    redis_url: str | None = None  # the shared DRAM snapshot pool (default: in-process)
    # DSpark speculation (`EngineOptions.speculative`; auto is off without DSpark layers) and
    # the most draft tokens a row verifies per step (None: the DSpark block)
    speculative: SpecMode = SpecMode.AUTO
    max_draft: int | None = None
    # the runtime-cache prefix tier (`EngineOptions.runtime_prefix`): concurrent requests with
    # one prefix prefill it once
    runtime_prefix: bool = True

    def __post_init__(self):  # the CLI's strings as the enums (a bad one is validate()'s)
        if self.backend in BACKENDS:
            object.__setattr__(self, "backend", ServingBackend(self.backend))
        if self.speculative in SPEC_MODES:
            object.__setattr__(self, "speculative", SpecMode(self.speculative))

    def validate(self) -> ServingOptions:
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be artifact or torch, got {self.backend!r}.")
        if self.artifact and self.backend == ServingBackend.TORCH:
            raise ValueError("--artifact and --backend torch exclude each other.")
        if self.page_tokens < 1:
            raise ValueError(f"--page-tokens must be positive, got {self.page_tokens}.")
        cap = self.store_capacity_bytes
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"The SSD store's capacity must be a positive number of bytes, got "
                             f"{cap!r}.")
        if self.speculative not in SPEC_MODES:
            raise ValueError(f"--speculative must be auto, on or off, got "
                             f"{self.speculative!r}.")
        if self.max_draft is not None and self.speculative == SpecMode.OFF:
            raise ValueError("--max-draft and --speculative off exclude each other.")
        return self


@dataclass
class ServingEngine:
    """The engine, its tokenizer and the served model's name; `close()` ends the engine and
    removes the temporary store it made."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    backend: str  # described for the banner: "PyTorch graph" or "artifact <folder>"
    temp_store: tempfile.TemporaryDirectory | None = None  # when no store was given
    store: Path | None = None  # the SSD store's folder (for the banner)

    closed: bool = False

    def close(self) -> None:  # idempotent
        if self.closed:
            return
        self.closed = True
        self.engine.close()
        if self.temp_store is not None:
            self.temp_store.cleanup()


def _no_source(what: str):
    raise ValueError(f"No {what} was given and nothing here can make one (the compiler is not "
                     f"part of the runtime): name it, or run through `dsv41`, which compiles "
                     f"what is missing.")


def serving_engine(opts: ServingOptions, source: ArtifactSource | None = None) -> ServingEngine:
    """The engine as `dsv41 run` builds it: the artifact folder, or the artifact for the
    checkpoint (from `source`: compiling what is missing), or the PyTorch graph; the checkpoint
    folder or the preset's seeded one (from `source`); the store folder (a new or empty folder,
    or a store to continue, which other engines may share), the user's cache folder's store of
    the model (`persistent_store`) or a fresh temporary store removed at the end."""
    opts.validate()
    if opts.store is not None:
        check_folder(opts.store, kind=STORE_KIND, version=FORMAT_VERSION)
    ckpt = opts.checkpoint or (source.checkpoint(opts.preset, opts.seed) if source else
                               _no_source("checkpoint (--checkpoint)"))
    store = opts.store
    if store is None and opts.persistent_store:
        store = default_store_folder(ckpt)
        check_folder(store, kind=STORE_KIND, version=FORMAT_VERSION)
    args = checkpoint_config(ckpt)
    tok = Tokenizer.for_model(args, ckpt)  # refused here when it does not fit the model
    name = opts.model_name or (ckpt.name if opts.checkpoint else opts.preset)
    temp = None
    if store is None:
        temp = tempfile.TemporaryDirectory(prefix="dsv41-serve-store-")
        store = Path(temp.name) / "store"
    kw = {"store_dir": store, "page_tokens": opts.page_tokens, "redis_url": opts.redis_url,
          "speculative": opts.speculative, "max_draft": opts.max_draft,
          "runtime_prefix": opts.runtime_prefix}
    if opts.store_capacity_bytes is not None:
        kw["store_capacity_bytes"] = opts.store_capacity_bytes
    try:
        if opts.backend == ServingBackend.TORCH:
            engine = Engine.from_model(Model.from_checkpoint(ckpt),
                                       weights_hash=weights_fingerprint(ckpt), **kw)
            backend = "PyTorch graph"
        else:
            art = opts.artifact or (
                source.artifact(ckpt, opts.preset, opts.target,
                                compiled_entries(CED_ENTRIES, opts.speculative, args), opts.out)
                if source else _no_source("artifact (--artifact)"))
            engine = Engine.load(art, ckpt, **kw)
            backend = f"artifact {art}"
    except BaseException:
        if temp is not None:
            temp.cleanup()
        raise
    return ServingEngine(engine, tok, name, backend, temp, None if temp else store)


def default_store_folder(checkpoint: Path, env: Mapping[str, str] = os.environ) -> Path:
    """`dsv41 serve`'s SSD store when none is named: `<cache>/dsv41/store/<model>`, `<cache>`
    being $XDG_CACHE_HOME (when set to an absolute path) or ~/.cache, `<model>` the first 16 hex
    of the checkpoint's weights fingerprint. Every serve of the model on this machine shares it
    and a restart finds its blocks; engines of other options keep their own entries in it."""
    cache = env.get("XDG_CACHE_HOME", "")
    root = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return root / "dsv41" / "store" / weights_fingerprint(checkpoint)[:16]


def make_batcher(opts: ServingOptions, se: ServingEngine,
                 chunk_tokens: int | None = None) -> Batcher:
    """The batcher over `se` (prefill chunks of `chunk_tokens`, else the options', else the
    engine's); on a bad option the engine is closed before the error goes up."""
    try:
        for flag in ("max_running", "max_queue"):
            if getattr(opts, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(opts, flag)}.")
        return Batcher(se.engine, tokenizer=se.tokenizer, max_running=opts.max_running,
                       max_queue=opts.max_queue,
                       prefill_chunk_tokens=chunk_tokens or opts.prefill_chunk)
    except BaseException:
        se.close()
        raise


def masked_url(url: str | None) -> str | None:
    """A Redis URL without its password (None stays None)."""
    return None if url is None else mask(url)


# ---- `dsv41 serve` ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeOptions:
    serving: ServingOptions = ServingOptions(persistent_store=True)  # serve keeps its store
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # require `Authorization: Bearer KEY` on /v1
    request_timeout_s: float | None = 600.0  # None: no timeout
    log_level: str = "info"  # uvicorn's
    role: Role = Role.ALL  # one process, or one EPD stage
    prefill_requests: int = 4  # --role prefill: requests prefilled together (chunk-interleaved)
    limits: HttpLimits = HttpLimits()  # body size and time, head time, connections, JSON depth

    def __post_init__(self):  # the CLI's strings as the enum (a bad one is validate()'s)
        if self.role in ROLES:
            object.__setattr__(self, "role", Role(self.role))

    def validate(self) -> ServeOptions:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}.")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty (leave it out for no key).")
        if self.role not in ROLES:
            raise ValueError(f"--role must be all, vision, prefill or decode, got "
                             f"{self.role!r}.")
        if isinstance(self.prefill_requests, bool) or not isinstance(self.prefill_requests, int) \
                or not 1 <= self.prefill_requests <= MAX_PREFILL_REQUESTS:
            raise ValueError(f"--prefill-requests must be a whole number from 1 to "
                             f"{MAX_PREFILL_REQUESTS}, got {self.prefill_requests!r}.")
        if self.role != Role.ALL and not self.serving.redis_url:
            raise ValueError(f"--role {self.role} needs --redis-url: the stages meet on a Redis "
                             "server (queues, hand-offs, the snapshot pool).")
        if self.role != Role.ALL and "," in self.serving.redis_url:
            raise ValueError(f"--role {self.role} needs one Redis server in --redis-url: the "
                             "stages' queues and hand-offs are not spread over a cluster (give "
                             "one server's URL).")
        return self


def serve(opts: ServeOptions, source: ArtifactSource | None = None) -> int:
    """The OpenAI-compatible server until it is stopped; one process, or one EPD stage."""
    opts.validate()
    se = serving_engine(opts.serving, source)
    args = se.engine.model.args
    server = ServerOptions(model_name=se.model_name, vocab_size=args.vocab_size,
                           max_seq_len=args.max_seq_len, api_key=opts.api_key,
                           request_timeout_s=opts.request_timeout_s, limits=opts.limits,
                           image_token_id=args.image_token_id if se.engine.model.vision else None)
    if opts.role != Role.ALL:
        return _serve_stage(opts, se, server)
    batcher = make_batcher(opts.serving, se)
    batcher.start()
    print(f"serving {se.model_name!r} ({se.backend}; tokenizer {se.tokenizer.file.path.name}, "
          f"{se.tokenizer.file.source.value}) on http://{opts.host}:{opts.port}/v1"
          f"{' with an API key' if opts.api_key else ''}; SSD store "
          f"{se.store or 'temporary'}", flush=True)
    try:
        run_server(create_app(batcher, se.tokenizer, server), opts.host, opts.port,
                   server.limits, log_level=opts.log_level)
    finally:
        batcher.stop()
        st = batcher.stats()
        se.close()
    print(f"summary: {st.finished} requests finished, {st.cancelled} cancelled, "
          f"{st.prompt_tokens} prompt and {st.completion_tokens} completion tokens")
    return 0


def _serve_stage(opts: ServeOptions, se: ServingEngine, server: ServerOptions) -> int:
    """`serve --role vision|prefill|decode`: the stage's worker on its engine, and the OpenAI
    server in front of the queues (any worker takes requests); /metrics adds the stage's
    series."""
    try:
        client = redis.Redis.from_url(opts.serving.redis_url)
        if opts.role == Role.VISION:
            if not se.engine.model.vision:
                raise ValueError("--role vision needs a checkpoint with a vision tower.")
            worker = VisionWorker(se.engine, client)
        elif opts.role == Role.PREFILL:
            worker = PrefillWorker(se.engine, client, prefill_requests=opts.prefill_requests)
        else:
            worker = DecodeWorker(se.engine, client, max_running=opts.serving.max_running)
        gateway = EpdGateway(client, se.engine.key_salt.fingerprint(),
                             vocab_size=server.vocab_size, max_seq_len=server.max_seq_len,
                             tokenizer=se.tokenizer, max_queue=opts.serving.max_queue,
                             model=se.engine.model)
    except BaseException:
        se.close()
        raise
    worker.start()
    print(f"serving {se.model_name!r} ({se.backend}) as the {opts.role} stage over "
          f"{masked_url(opts.serving.redis_url)} on http://{opts.host}:{opts.port}/v1",
          flush=True)
    try:
        metrics = EpdServerMetrics(worker, server.model_name)
        run_server(create_app(gateway, se.tokenizer, server, metrics=metrics),
                   opts.host, opts.port, server.limits, log_level=opts.log_level)
    finally:
        worker.stop()
        gateway.close()
        n = worker.counters
        se.close()
    print(f"summary: {opts.role} stage finished {n.requests} requests, {n.tokens} tokens, "
          f"{n.errors} errors, {n.handoffs_rejected} hand-offs rejected")
    return 0


# ---- `dsv41 chat` -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatOptions:
    serving: ServingOptions = ServingOptions()
    system: str | None = None  # a system message
    thinking: bool = False
    max_tokens: int = 64  # per reply
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed_sampling: int | None = None  # the sampler's seed


def chat(opts: ChatOptions, source: ArtifactSource | None = None, *, stdin=None,
         stdout=None) -> int:
    """A terminal chat on the embedded engine (stdin / stdout by default)."""
    params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p,
                            seed=opts.seed_sampling, max_tokens=opts.max_tokens).validate()
    se = serving_engine(opts.serving, source)
    batcher = make_batcher(opts.serving, se)
    batcher.start()
    print(f"chat with {se.model_name!r} ({se.backend}); /reset clears the history, /exit ends",
          flush=True)
    try:
        summary = run_chat(batcher, se.tokenizer, ChatSettings(params, opts.system, opts.thinking),
                           stdin or sys.stdin, stdout or sys.stdout)
    finally:
        batcher.stop()
        se.close()
    print(f"summary: {summary.turns} replies, {summary.completion_tokens} tokens, prompts of "
          f"{', '.join(str(n) for n in summary.prompt_tokens) or 'none'} tokens")
    return 0
