"""The embedded engine: sessions, turns, the runtime cache and the SSD / DRAM tiers.

    engine = Engine.load(artifact_dir, checkpoint_dir, store_dir="kv-store")
    session = engine.session()
    for token in session.send(prompt_ids, max_new_tokens=200, stop=(eos,)):
        ...
    session.close()
    engine.stats()

A turn plans itself from what the tiers hold for its token sequence (the session's history, the
pending token and the new ones; any session's blocks and snapshots serve it, since keys name
tokens, not sessions):

| state | what runs |
|---|---|
| live (the runtime cache still holds the session) | the new tokens |
| snapshot hit (DRAM pool; exact mode also SSD) | blocks + snapshot restored; the tokens after |
| prefix hit, snapshot miss | encoder bounded replay: the last `window` block tokens + the rest |
| cold | CED prefill (exact mode: exact prefill) |

The blocks are the longest stored run of the sequence's complete blocks (a walk over chained
keys), and the snapshot the latest one within the block after them.

then decode. Every non-exact prefill ends with decoder bounded replay over the last
min(window, N) tokens of the sequence (`phases.resume_prefill` when the cache held its local
state: the cached tokens the new ones do not cover are replayed through the encoder for their
outputs), so decoding never reads a decoder ring entry from before that segment; the snapshot
holds the encoder's rings only. `EngineOptions.decoder_carry` keeps the decoder (and DSpark)
rings in the snapshot and replays only the new tokens instead. At the end of a turn the complete
blocks go to the SSD store through a background writer (`kv_store.BlockWriter`: a block still
queued is served from the queue; `Engine.close()` drains it) and the rest of the state to the
snapshot pool; with an SSD store the runtime cache then lets the session go.

The runtime cache is each live session's `ModelCache`, its global stores allocated in whole pages
of `page_tokens` positions (contiguous per session, so compiled gathers read them directly; a
turn grows them once, to the pages it needs). Bytes are counted from the live tensors.
"""


from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.cache import ModelCache
from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.image_processor import PreparedImage
from dsv41.graph.model import Model
from dsv41.graph.phases import chunk_spans
from dsv41.graph.phases_api import GraphPhases, Phases
from dsv41.runtime.backends.artifact import (
    Artifact,
    ArtifactError,
    check_checkpoint_config,
    engine_entries,
)
from dsv41.runtime.backends.compiled import CompiledPhases
from dsv41.runtime.backends.onednn import bound_onednn_caches
from dsv41.runtime.backends.sharded import ShardedArtifact, is_sharded, read_sharded
from dsv41.runtime.backends.threads import lower_helper_priority
from dsv41.runtime.engine.batch import DecodeBatch
from dsv41.runtime.engine.budget import CacheBudget
from dsv41.runtime.engine.images import TurnImage, check_spans, encode_turn, expand_placeholders
from dsv41.runtime.engine.keys import TierKeys
from dsv41.runtime.engine.options import FORMAT_VERSION, EngineOptions
from dsv41.runtime.engine.planner import TurnPlanner
from dsv41.runtime.engine.records import EngineStats, StateKind, Tier, TurnRecord
from dsv41.runtime.engine.requests import (
    RequestError,
    TurnRequest,
    check_options,
    check_token_ids,
    check_transcript,
)
from dsv41.runtime.engine.salt import KeySalt, artifact_backend
from dsv41.runtime.engine.sampling import SampledToken, Sampler
from dsv41.runtime.engine.session import Session
from dsv41.runtime.engine.spec_setup import check_spec_entries, spec_policy
from dsv41.runtime.engine.speculative import SpecPolicy
from dsv41.runtime.engine.state import (
    check_block_tokens,
    restore_runtime_state,
    snapshot_ring_layers,
)
from dsv41.runtime.engine.turn import Row, SpecStep, Stepper, Turn
from dsv41.runtime.tiers.base import StorageTier
from dsv41.runtime.tiers.block_writer import BlockWriter
from dsv41.runtime.tiers.dram_pool import SnapshotPool
from dsv41.runtime.tiers.redis_pool import RedisSnapshotPool
from dsv41.runtime.tiers.runtime_blocks import RuntimeBlocks
from dsv41.runtime.tiers.ssd_store import KVStore


class Engine:
    def __init__(self, model: Model, phases: Phases, *, weights_hash: str, options: EngineOptions,
                 backend: str, backend_id: str = "graph",
                 on_close: Callable[[], None] | None = None, spec_entries: bool = True):
        bound_onednn_caches()  # before this process's first bf16 matmul (runtime/onednn.py)
        self.model, self._options, self.backend = model, options, backend
        self._on_close = on_close  # what the engine's backend frees at close (disco workers)
        check_block_tokens([src.ratio for src in model.plan.kv_sources], options.page_tokens)
        # salts every key: everything that changes what a stored record means (runtime/salt.py)
        self.key_salt = KeySalt(
            config_hash=model.args.config_hash(), weights_hash=weights_hash,
            record_format=FORMAT_VERSION, page_tokens=options.page_tokens, exact=options.exact,
            decoder_carry=bool(options.decoder_carry),
            switches=tuple(sorted(model.switches().items())), backend=backend_id)
        self.keys = TierKeys(self.key_salt.fingerprint(), options.page_tokens)
        self.sessions: dict[int, Session] = {}
        self._batches: list[DecodeBatch] = []  # decode batches with live rows (send_many, batcher)
        self.budget = CacheBudget(model, options, self._live_caches)
        self.closed = False
        chunk_spans(1, options.prefill_chunk_tokens)  # a bad chunk size is refused up front
        self.pool: StorageTier
        if options.redis_url is not None:
            self.pool = RedisSnapshotPool(options.redis_url, fingerprint=self.keys.salt,
                                          budget_bytes=options.pool_budget_bytes,
                                          ttl_s=options.pool_ttl_s)
        else:
            self.pool = SnapshotPool(budget_bytes=options.pool_budget_bytes,
                                     ttl_s=options.pool_ttl_s, clock=options.pool_clock,
                                     sweep_interval_s=options.pool_sweep_s)
        # `spec_entries`: whether the backend has DSpark's entries (`check_spec_entries`)
        self.stepper = Stepper(phases, model, spec_policy(model, options, entries_ok=spec_entries),
                               options.spec_clock)
        self.store = self.blocks = None
        if options.store_dir is not None:
            self.store = KVStore(Path(options.store_dir), capacity_bytes=options.
                                 store_capacity_bytes, min_lifetime_s=options.store_min_lifetime_s,
                                 clock=options.store_clock, fingerprint=self.keys.salt)
            # every block read and write goes through it; its thread yields cores to a step
            self.blocks = BlockWriter(self.store, on_start=lower_helper_priority)
        # what a snapshot holds (its layout salts every key through KeySalt's exact and
        # decoder_carry: other layouts never match)
        rings = snapshot_ring_layers(model.plan, all_rings=options.exact or options.decoder_carry)
        # the runtime prefix tier: prompt blocks in the room the live caches leave in the budget
        self.runtime_blocks = RuntimeBlocks(self.budget.block_room) \
            if options.runtime_prefix else None
        self.budget.blocks = self.runtime_blocks
        self.planner = TurnPlanner(model, options, self.keys, self.pool, self.blocks,
                                   self.new_cache, rings, self.runtime_blocks)
        self._next_id = 1
        self.tier_counts = {t.value: 0 for t in Tier}
        # runtime_prefix: prompt tokens served from the runtime prefix tier
        self.token_counts = {"prefilled": 0, "replayed": 0, "decoder_replayed": 0, "decoded": 0,
                             "runtime_prefix": 0}

    @property
    def options(self) -> EngineOptions:
        return self._options

    @options.setter
    def options(self, options: EngineOptions) -> None:
        """New options reach the parts that read them (the budget, the planner)."""
        self._options = self.budget.options = self.planner.options = options

    @property
    def phases(self) -> Phases:
        """The compiled (or graph) phases every prefill and decode step runs."""
        return self.stepper.phases

    @phases.setter
    def phases(self, phases: Phases) -> None:
        """Replaced phases reach the decode steps."""
        self.stepper = replace(self.stepper, phases=phases)

    @property
    def spec_policy(self) -> SpecPolicy | None:
        """DSpark's length policy, the one the decode steps run with (None: plain decode)."""
        return self.stepper.policy

    @spec_policy.setter
    def spec_policy(self, policy: SpecPolicy | None) -> None:
        """A replaced policy reaches the decode steps."""
        self.stepper = replace(self.stepper, policy=policy)

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def load(cls, artifact_dir: str | Path, checkpoint_dir: str | Path, *,
             device: str | None = None, shards: int | None = None, **options) -> Engine:
        """A compiled artifact (verified against its manifest) and the checkpoint's weights, run
        on `device` (`cpu`, `cuda:N`; default: the artifact's target kind): weights, runtime
        cache and the compiled entries live there. A sharded artifact (`dsv41 compile --shards
        N`, known by its manifest) runs on its N disco workers, each holding its own share of
        the weights (runtime/sharded.py); the caches and tiers stay here. `shards`, when given,
        is the worker count expected (an ArtifactError when the artifact has another)."""
        opts = EngineOptions(**options)
        sharded = is_sharded(artifact_dir)
        if sharded:
            art = read_sharded(artifact_dir, shards=shards, device=device)
        elif shards not in (None, 1):
            raise ArtifactError(f"{artifact_dir} is a one-worker artifact; {shards!r} workers "
                                "were asked for (compile it with `dsv41 compile --shards N`).")
        else:
            art = Artifact.load(artifact_dir, device=device)
            art.set_engram_prefetch(opts.engram_prefetch)
        entries = engine_entries(art, exact=opts.exact)  # refused before any weight is read
        speculates = check_spec_entries(art, Path(checkpoint_dir), opts)  # so is `on` without
        check_checkpoint_config(art, checkpoint_dir)
        if sharded:
            art = ShardedArtifact.start(art, checkpoint_dir)  # the workers read their weights
            model = art.host_model(checkpoint_dir)
        else:
            model = Model.from_checkpoint(checkpoint_dir, art.args, device=art.device.torch)
        try:
            return cls(model, CompiledPhases(art, model, threads=opts.threads),
                       weights_hash=weights_fingerprint(checkpoint_dir),
                       options=opts, backend=f"artifact {Path(artifact_dir)}",
                       backend_id=artifact_backend(art.manifest, entries),
                       on_close=art.shutdown if sharded else None, spec_entries=speculates)
        except Exception:
            if sharded:
                art.shutdown()  # the workers end with the engine that was not made
            raise

    @classmethod
    def from_model(cls, model: Model, *, weights_hash: str, **options) -> Engine:
        """The PyTorch graph's own phases (the oracle backend; no artifact)."""
        return cls(model, GraphPhases(), weights_hash=weights_hash,
                   options=EngineOptions(**options), backend="PyTorch graph")

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, transcript: Sequence[int] = ()) -> Session:
        """A new conversation, or one resumed from its transcript (every token sent and
        generated so far; the tiers are looked up for it at the first turn)."""
        self.check_open()
        a = self.model.args
        ids = check_transcript(transcript, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len)
        if ids and self.store is None:
            raise RequestError("Resuming a transcript needs an SSD store (store_dir): without "
                               "one, nothing outside a live session holds its history.")
        s = Session(self, self._next_id)
        if ids:
            s.history, s.pending = list(ids[:-1]), ids[-1]
        self.sessions[s.id] = s
        self._next_id += 1
        return s

    def close(self) -> None:
        """End every session (each turn in flight is stored), drain and stop the SSD writer, and
        let the store's folder go (another engine or process may open it). The engine serves
        nothing after."""
        for b in list(self._batches):
            b.close()  # every turn still decoding ends (and is stored)
        for s in list(self.sessions.values()):
            s.close()
        if self.blocks is not None:
            self.blocks.close()
        if self.store is not None:
            self.store.close()
        if self.runtime_blocks is not None:
            self.runtime_blocks.close()
        self.pool.close()
        if self._on_close is not None and not self.closed:
            self._on_close()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_open(self) -> None:
        """RequestError once the engine is closed."""
        if self.closed:
            raise RequestError("The engine is closed.")

    def forget(self, session: Session) -> None:
        """A closed session leaves the engine's table."""
        self.sessions.pop(session.id, None)

    def track(self, batch: DecodeBatch) -> None:
        """A decode batch whose rows count against the runtime budget (until `untrack`)."""
        self._batches.append(batch)

    def untrack(self, batch: DecodeBatch) -> None:
        if batch in self._batches:
            self._batches.remove(batch)

    def stats(self) -> EngineStats:
        live = [s.cache for s in self.sessions.values() if s.cache is not None]
        by_kind = {"window": 0, "main_kv": 0, "index_k": 0, "tails": 0}
        for c in live + [b.cache for b in self._batches if b.cache is not None]:
            for k, v in c.nbytes().items():
                by_kind[k] += v
        if self.runtime_blocks is not None:  # the prefix tier's blocks (main KV and index K)
            by_kind["prefix_blocks"] = self.runtime_blocks.nbytes()
        return EngineStats(
            sessions_live=len(live) + sum(len(b) for b in self._batches), runtime_bytes=by_kind,
            runtime_tokens=sum(int(c.pos[0]) for c in live)
            + sum(int(b.cache.pos[: len(b)].sum()) for b in self._batches if len(b)),
            runtime_budget=self.options.cache_budget_bytes, tiers=dict(self.tier_counts),
            tokens=dict(self.token_counts),
            store=None if self.blocks is None else self.blocks.store_stats(),
            pool=self.pool.stats(),
            writer=None if self.blocks is None else self.blocks.stats(),
            runtime_blocks=None if self.runtime_blocks is None else self.runtime_blocks.stats())

    def flush(self) -> None:
        """Wait until every queued SSD block is written."""
        if self.blocks is not None:
            self.blocks.drain()

    # ---- keys (`keys.TierKeys`) -----------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int]) -> list[str]:
        return self.keys.block_keys(tokens)

    def history_key(self, tokens: Sequence[int], kind: StateKind) -> str:
        """The key of a tier record of the state after `tokens`."""
        return self.keys.history_key(tokens, kind)

    def state_keys(self, tokens: Sequence[int], keys: Sequence[str], kind: StateKind, lo: int,
                   hi: int) -> list[tuple[int, str]]:
        """`TierKeys.state_keys`: the keys of the states after tokens[:L], L in lo..hi."""
        return self.keys.state_keys(tokens, keys, kind, lo, hi)

    # ---- the runtime cache (`budget.CacheBudget`) -----------------------------------------------

    def _live_caches(self) -> list[ModelCache]:
        return [s.cache for s in self.sessions.values() if s.cache is not None] \
            + [b.cache for b in self._batches if b.cache is not None]

    def new_cache(self, rows: int = 1, tokens: int | None = None) -> ModelCache:
        """An empty cache of `rows` sequences, `tokens` positions each (default: one page)."""
        return self.budget.new_cache(rows, tokens)

    def runtime_bytes(self) -> int:
        """The live caches' bytes and the runtime prefix tier's."""
        return self.budget.runtime_bytes()

    def fits(self, extra: int) -> bool:
        """Whether `extra` more bytes of live cache fit the budget (the runtime prefix tier's
        blocks evicted if need be)."""
        return self.budget.fits(extra)

    def make_room(self, extra: int) -> None:
        """Evict the runtime prefix tier's least recently used blocks until `extra` more bytes
        of live cache fit (or the tier is empty)."""
        self.budget.make_room(extra)

    def cache_bytes(self, tokens: int) -> int:
        """The bytes of one session's cache grown to hold `tokens` positions (whole pages)."""
        return self.budget.cache_bytes(tokens)

    def admit(self, session: Session, tokens: int) -> None:
        """Refuse (CacheFullError) a turn whose cache of `tokens` positions would not fit in the
        budget, before anything is restored or allocated."""
        if session.cache is None:  # live: `reserve` counts its growth
            self.budget.admit(tokens)

    def reserve(self, cache: ModelCache, tokens: int) -> None:
        """Grow a cache to the pages `tokens` positions need, within the byte budget (a cache
        that no session holds yet counts whole); on refusal nothing changes."""
        self.budget.reserve(cache, tokens)

    def step(self, cache: ModelCache, rows: Sequence[Row]) -> list[SpecStep]:
        """One decode step of the rows of `cache` (`turn.Stepper`: DSpark's when speculative)."""
        return self.stepper.step(cache, rows)

    # ---- images ---------------------------------------------------------------------------------

    def expand_images(self, token_ids: Sequence[int],
                      images: Sequence = ()) -> tuple[Sequence[int], list[TurnImage]]:
        """A turn's ids with each `image_token_id` placeholder replaced by its image's span, and
        the images (decoded, preprocessed: RequestError on a bad one) where the spans stand;
        the ids as they are for a model without a tower and no images. An artifact engine
        needs the `vision` entry and backbone entries that take span rows
        (`CompiledPhases.check_images`)."""
        if not images and not self.model.vision:
            return token_ids, []
        if images:
            check = getattr(self.phases, "check_images", None)
            if check is None:
                raise RequestError(f"This engine's backend ({self.backend}) takes no images; "
                                   "use the graph backend or a compiled artifact with the "
                                   "`vision` entry.")
            try:
                check(self.model)
            except ValueError as e:
                raise RequestError(str(e)) from e
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise RequestError("Images are given as a list, one per image placeholder.")
        ids = check_token_ids(token_ids, vocab_size=self.model.args.vocab_size)
        return expand_placeholders(self.model, ids, images)

    def encode_image(self, image: PreparedImage) -> torch.Tensor:
        """One image's aligned rows bf16 (L, d): the graph's tower, or the artifact's `vision`
        entry."""
        return self.phases.encode_image(self.model, image)

    # ---- batched decode -------------------------------------------------------------------------

    def _check_requests(self, requests) -> list[TurnRequest]:
        if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
            raise RequestError("send_many takes a sequence of (session, token_ids, options).")
        out, seen = [], set()
        for n, item in enumerate(requests):
            if not isinstance(item, tuple | list) or len(item) != 3:
                raise RequestError(f"Request {n} must be (session, token_ids, options).")
            s, ids, kw = item
            if not isinstance(s, Session) or s.engine is not self:
                raise RequestError(f"Request {n}: the session belongs to another engine (other "
                                   "weights, other tiers); use that engine's send_many.")
            if id(s) in seen:
                raise RequestError("A session may appear once in send_many.")
            seen.add(id(s))
            out.append(s.request(ids, **check_options(kw)))
        return out

    def send_many(self, requests: Sequence[tuple[Session, Sequence[int], dict]]) -> list[list[int]]:
        """One turn for each of several sessions: their prefills one by one, then their decode
        steps together in one `DecodeBatch` (sequences at different lengths; a finished one
        leaves at once, the others go on). Returns each session's tokens."""
        checked = self._check_requests(requests)  # all of them, before any prefill
        for s, _, _ in requests:
            s.finish_open_turn()  # a turn `send` left unfinished ends (and is stored) first
        batch = DecodeBatch(self)
        turns: list[Turn] = []
        try:
            for (s, _, _), req in zip(requests, checked, strict=True):
                turns.append(batch.start(s, req))
        except BaseException:  # the turns already begun end as usual: nothing is lost
            batch.close()
            raise
        t0 = time.perf_counter()
        try:
            while len(batch):
                for s, t in batch.step():
                    if t.done:
                        t.record.seconds["decode"] = time.perf_counter() - t0
                        batch.leave(s)
        except BaseException:
            batch.drop()  # a failed step left the rows in no known state: nothing is stored
            raise
        batch.close()
        return [list(t.tokens) for t in turns]

    # ---- EPD: a turn prefilled by another process (runtime/epd.py) ---------------------------

    def adopt(self, tokens: Sequence[int], state: dict[str, np.ndarray], request: TurnRequest,
              first: SampledToken, generator_state: bytes | None = None,
              images: Sequence[TurnImage] = ()) -> tuple[Session, Turn]:
        """A new session whose cache is a prefill worker's handed-off runtime state of `tokens`
        (`Session.runtime_state`), and its open turn with the first token already sampled
        (`first`; `generator_state`: the sampler's generator after it). Join the turn to a
        `DecodeBatch`; its end stores it in the tiers like any turn. ValueError when the state
        does not fit this engine's cache. `images`: the prompt's images (spans at their
        offsets in `tokens`), which the tiers' keys name."""
        self.check_open()
        seen = encode_turn(self.model, 0, images, encode=self.encode_image)
        if self.model.vision:
            check_spans(list(tokens), seen, self.model.args.image_token_id, 0)
        if request.sampling is None:
            raise RequestError("A handed-off turn carries its SamplingParams.")
        s = self.session()
        positions = len(tokens) + request.max_new_tokens + 1
        try:
            self.admit(s, positions)
            cache = self.new_cache()
            restore_runtime_state(cache, state, self.options.page_tokens)
            if int(cache.pos[0]) != len(tokens):
                raise ValueError(f"The handed-off state holds {int(cache.pos[0])} positions, "
                                 f"its tokens {len(tokens)}.")
            self.reserve(cache, positions)
        except BaseException:
            s.close()
            raise
        s.cache, s.history, s.images = cache, list(tokens), seen
        sampler = Sampler(request.sampling)
        if generator_state is not None:
            sampler.generator.set_state(torch.frombuffer(bytearray(generator_state),
                                                         dtype=torch.uint8))
        rec = TurnRecord(session=s.id, turn=1, tier=Tier.HANDOFF, prefilled=0, replayed=0,
                         decoder_replayed=0, decoded=0, token_layers=0, cached_blocks=0)
        turn = Turn(rec, request.max_new_tokens, request.stop, request.temperature,
                     torch.Generator(), False, sampler, tuple(tokens))
        turn.tokens, turn.sampled, turn.next_token = [first.token_id], [first], first.token_id
        turn.done = len(turn.tokens) >= turn.max_new or first.token_id in turn.stop
        return s, turn
