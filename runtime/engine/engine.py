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

import hashlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.cache import (
    ModelCache,
    capacity_tokens,
    ensure_capacity,
    leading_rows,
    move_sequence,
    new_cache,
    put_sequence,
    select_sequences,
    with_rows,
    write_back,
)
from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.image_processor import PreparedImage
from dsv41.graph.model import Model
from dsv41.graph.phases import DEFAULT_CHUNK_TOKENS, Pause, chunk_spans, resume_tail
from dsv41.graph.phases_api import GraphPhases, Phases
from dsv41.graph.speculative import Verified, cut_back, verify_step
from dsv41.runtime.backends.onednn import bound_onednn_caches
from dsv41.runtime.engine.images import (
    SessionImage,
    TurnImage,
    check_spans,
    encode_turn,
    expand_placeholders,
    key_tokens,
    sequence_images,
)
from dsv41.runtime.engine.requests import (
    RequestError,
    TurnLimits,
    TurnRequest,
    check_options,
    check_token_ids,
    check_transcript,
    check_turn,
)
from dsv41.runtime.engine.salt import KeySalt
from dsv41.runtime.engine.sampling import SampledToken, Sampler, SamplingParams
from dsv41.runtime.engine.speculative import SpecPolicy, accept_draft_token, acceptance_probs
from dsv41.runtime.engine.state import (
    block_arrays,
    check_block_tokens,
    index_owner_at,
    restore_blocks,
    restore_runtime_state,
    restore_snapshot,
    runtime_state_arrays,
    snapshot_arrays,
    snapshot_ring_layers,
)
from dsv41.runtime.engine.transfer import Transfers

FORMAT_VERSION = 1  # of the tier records (part of every key)


class CacheFullError(RuntimeError):
    """The runtime cache's byte budget cannot hold a session's next turn."""


@dataclass(frozen=True)
class EngineOptions:
    exact: bool = False  # exact phases throughout (no CED, no bounded replay)
    page_tokens: int = 256  # runtime-cache page and SSD block, in positions
    cache_budget_bytes: int = 4 << 30  # runtime cache (all live sessions)
    store_dir: str | Path | None = None  # SSD global-KV store (None: sessions stay live)
    store_capacity_bytes: int = 64 << 30
    store_min_lifetime_s: float = 72 * 3600.0
    pool_budget_bytes: int | None = None  # DRAM snapshot pool (None: 10% of host memory)
    pool_ttl_s: float = 600.0
    pool_sweep_s: float = 1.0  # expired snapshots are freed by the first pool call after this
    # keep the decoder and DSpark rings in the snapshot and run only the new tokens through the
    # decoder (the carry-over of before issue 17); default False: decoder bounded replay of the
    # last `window` tokens at every prefill, as the article describes. Salts every state key.
    decoder_carry: bool = False
    store_clock: Callable[[], float] = time.time
    pool_clock: Callable[[], float] = time.monotonic
    # the DRAM snapshot pool on this Redis server (runtime/redis_pool.py; shared by every engine
    # of the model that names it), instead of the in-process one; pool_budget_bytes is then its
    # maxmemory (None: keep the server's), pool_ttl_s its keys' expiry
    redis_url: str | None = None
    threads: int | None = None  # TVM's CPU pool (None: TVM_NUM_THREADS, else torch's count)
    # every prefill runs in chunks of at most this many tokens: transient memory O(chunk x
    # entries) instead of O(N x entries)
    prefill_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # DSpark speculative decoding (runtime/speculative.py): draft, verify up to `max_draft`
    # tokens per step, k chosen by `Engine.spec_policy` from the confidence head and the
    # measured step costs (`spec_clock`); greedy output and sampled distributions unchanged
    speculative: bool = False
    max_draft: int = 5
    spec_clock: Callable[[], float] = time.perf_counter
    # an artifact's host-resident Engram rows gathered ahead on a background thread while the
    # entry's first blocks run (False: when the entry reaches the layer; the same rows)
    engram_prefetch: bool = True


@dataclass(frozen=True)
class PrefillPacing:
    """How a turn's prefill runs its chunks: their size (None: the engine's
    `prefill_chunk_tokens`), and what runs between two of them (the batcher's decode step of
    the running batch; it may raise to abandon the prefill, whose cache is then dropped)."""

    chunk_tokens: int | None = None
    between_chunks: Pause | None = None


class Tier(StrEnum):
    """What served a turn's start (a str: compares and prints as its value)."""

    LIVE = "live"  # the session's own cache, still in the runtime cache
    SNAPSHOT = "snapshot"  # SSD blocks + a DRAM-pool snapshot (encoder state)
    SNAPSHOT_SSD = "snapshot-ssd"  # exact mode: SSD blocks + an SSD state record
    PREFIX = "prefix"  # SSD blocks only: encoder bounded replay from their end
    COLD = "cold"  # nothing: the whole prompt prefilled
    HANDOFF = "handoff"  # an EPD prefill worker's runtime state (Engine.adopt)

    def __repr__(self) -> str:  # in printed dicts and lists, as the plain string it stands for
        return repr(self.value)


class StateKind(StrEnum):
    """The tier records of a session's state after a prefix (each salts its own keys)."""

    SNAPSHOT = "snapshot"  # the DRAM pool's snapshot of the local state (encoder rings, tails)
    STATE = "state"  # exact mode: the SSD record of the whole runtime state

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass
class TurnRecord:
    session: int
    turn: int
    tier: Tier
    prefilled: int  # new tokens that entered the cache
    replayed: int  # cached tokens run through the encoder again (snapshot miss)
    decoder_replayed: int  # tokens through the decoder's bounded replay
    decoded: int
    token_layers: int  # work of the prefill (tokens x blocks)
    cached_blocks: int  # SSD prefix blocks the turn started from (reused: len(reused_keys))
    seconds: dict[str, float] = field(default_factory=dict)
    logits: list[np.ndarray] = field(default_factory=list)  # when asked for: prefill, then steps
    reused_keys: list[str] = field(default_factory=list)  # the SSD blocks read, in order
    reused_tokens: int = 0  # leading tokens the turn did not prefill (blocks + snapshot, or live)
    drafted: int = 0  # draft tokens DSpark proposed (a whole block per draft pass)
    verified: int = 0  # draft tokens the backbone checked (the k of every verify)
    accepted: int = 0  # draft tokens kept


@dataclass
class EngineStats:
    sessions_live: int
    runtime_bytes: dict[str, int]  # live allocations by kind (window, main_kv, index_k, tails)
    runtime_tokens: int  # positions the live caches hold
    runtime_budget: int
    tiers: dict[str, int]  # turns served per tier
    tokens: dict[str, int]  # prefilled, replayed, decoder_replayed, decoded
    store: object | None  # KVStoreStats
    pool: object | None  # SnapshotPoolStats
    writer: object | None = None  # BlockWriterStats


class Engine:
    def __init__(self, model: Model, phases: Phases, *, weights_hash: str, options: EngineOptions,
                 backend: str, backend_id: str = "graph",
                 on_close: Callable[[], None] | None = None):
        from dsv41.runtime.tiers.dram_pool import SnapshotPool
        from dsv41.runtime.tiers.ssd_store import BlockWriter, KVStore

        bound_onednn_caches()  # before this process's first bf16 matmul (runtime/onednn.py)
        self.model, self.options, self.backend = model, options, backend
        self.phases: Phases = phases
        self._on_close = on_close  # what the engine's backend frees at close (disco workers)
        self._pad = model.engram.pad_id if model.engram is not None else None
        check_block_tokens([src.ratio for src in model.plan.kv_sources], options.page_tokens)
        # what a snapshot holds (its layout salts every key through KeySalt's exact and
        # decoder_carry: other layouts never match)
        carry = options.exact or options.decoder_carry
        self._ring_layers = snapshot_ring_layers(model.plan, all_rings=carry)
        # salts every key: everything that changes what a stored record means (runtime/salt.py)
        self.key_salt = KeySalt(
            config_hash=model.args.config_hash(), weights_hash=weights_hash,
            record_format=FORMAT_VERSION, page_tokens=options.page_tokens, exact=options.exact,
            decoder_carry=bool(options.decoder_carry),
            switches=tuple(sorted(model.switches().items())), backend=backend_id)
        self._salt = self.key_salt.fingerprint()
        one_page = self._fresh_cache()
        self._first_page = sum(one_page.nbytes().values())  # everything, with its first page
        self._page_bytes = sum(t.nbytes for st in one_page.stores.values()
                               for t in (st.kv_codes, st.kv_scales, st.k_codes, st.k_scales)
                               if t is not None)  # each further page
        self.closed = False
        if self._first_page > options.cache_budget_bytes:
            raise ValueError(f"cache_budget_bytes={options.cache_budget_bytes:,} cannot hold one "
                             f"session's first page ({self._first_page:,} bytes with pages of "
                             f"{options.page_tokens} positions); raise it or lower page_tokens.")
        chunk_spans(1, options.prefill_chunk_tokens)  # a bad chunk size is refused up front
        if options.redis_url is not None:
            from dsv41.runtime.tiers.redis_pool import RedisSnapshotPool

            self.pool = RedisSnapshotPool(options.redis_url, fingerprint=self._salt,
                                          budget_bytes=options.pool_budget_bytes,
                                          ttl_s=options.pool_ttl_s)
        else:
            self.pool = SnapshotPool(budget_bytes=options.pool_budget_bytes,
                                     ttl_s=options.pool_ttl_s, clock=options.pool_clock,
                                     sweep_interval_s=options.pool_sweep_s)
        self.spec_policy = self._spec_policy(options)
        self.store = self.blocks = None
        if options.store_dir is not None:
            self.store = KVStore(Path(options.store_dir), capacity_bytes=options.
                                 store_capacity_bytes, min_lifetime_s=options.store_min_lifetime_s,
                                 clock=options.store_clock, fingerprint=self._salt)
            self.blocks = BlockWriter(self.store)  # every block read and write goes through it
        self.sessions: dict[int, Session] = {}
        self._batches: list[DecodeBatch] = []  # decode batches with live rows (send_many, batcher)
        self._next_id = 1
        self.tier_counts = {t.value: 0 for t in Tier}
        self.token_counts = {"prefilled": 0, "replayed": 0, "decoder_replayed": 0, "decoded": 0}

    def _spec_policy(self, options: EngineOptions) -> SpecPolicy | None:
        if not options.speculative:
            return None
        a = self.model.args
        if not self.model.plan.dspark:
            raise ValueError("speculative=True needs a model with DSpark layers; this one has "
                             "none.")
        top = min(a.dspark_block_size, a.window_size - 1)
        if isinstance(options.max_draft, bool) or not isinstance(options.max_draft, int) \
                or not 0 <= options.max_draft <= top:
            raise ValueError(f"max_draft must be a whole number from 0 to {top} (the DSpark "
                             f"block), got {options.max_draft!r}.")
        return SpecPolicy(options.max_draft)

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
        from dsv41.runtime.backends.artifact import (
            Artifact,
            ArtifactError,
            check_checkpoint_config,
            engine_entries,
        )
        from dsv41.runtime.backends.compiled import CompiledPhases
        from dsv41.runtime.backends.sharded import ShardedArtifact, is_sharded, read_sharded
        from dsv41.runtime.engine.salt import artifact_backend

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
                       on_close=art.shutdown if sharded else None)
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
        self._check_open()
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
        self.pool.close()
        if self._on_close is not None and not self.closed:
            self._on_close()
        self.closed = True

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RequestError("The engine is closed.")

    def stats(self) -> EngineStats:
        live = [s.cache for s in self.sessions.values() if s.cache is not None]
        by_kind = {"window": 0, "main_kv": 0, "index_k": 0, "tails": 0}
        for c in live + [b.cache for b in self._batches if b.cache is not None]:
            for k, v in c.nbytes().items():
                by_kind[k] += v
        return EngineStats(
            sessions_live=len(live) + sum(len(b) for b in self._batches), runtime_bytes=by_kind,
            runtime_tokens=sum(int(c.pos[0]) for c in live)
            + sum(int(b.cache.pos[: len(b)].sum()) for b in self._batches if len(b)),
            runtime_budget=self.options.cache_budget_bytes, tiers=dict(self.tier_counts),
            tokens=dict(self.token_counts),
            store=None if self.blocks is None else self.blocks.store_stats(),
            pool=self.pool.stats(),
            writer=None if self.blocks is None else self.blocks.stats())

    def flush(self) -> None:
        """Wait until every queued SSD block is written."""
        if self.blocks is not None:
            self.blocks.drain()

    def runtime_bytes(self) -> int:
        live = [s.cache for s in self.sessions.values() if s.cache is not None]
        return sum(sum(c.nbytes().values()) for c in live) + sum(b.nbytes() for b in self._batches)

    # ---- keys -----------------------------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int]) -> list[str]:
        from dsv41.runtime.tiers.ssd_store import block_keys

        return block_keys(tokens, self.options.page_tokens, self._salt)

    def history_key(self, tokens: Sequence[int], kind: StateKind) -> str:
        """The key of a tier record of the state after `tokens`."""
        b = self.options.page_tokens
        n = len(tokens) // b
        keys = self.block_keys(tokens[: n * b])
        return self.state_keys(tokens, keys, kind, len(tokens), len(tokens))[0][1]

    def state_keys(self, tokens: Sequence[int], keys: Sequence[str], kind: StateKind, lo: int,
                   hi: int) -> list[tuple[int, str]]:
        """(L, key of the state after tokens[:L]) for L in lo..hi, all within one block: chained
        on the key of the last complete block before L (`keys`: the block keys of `tokens`),
        then the tokens after it, salted with the model and the snapshot's layout. So a lookup
        of every position in a block hashes at most one block of tokens."""
        b = self.options.page_tokens
        n = lo // b
        if not 0 <= lo <= hi < (n + 1) * b or hi > len(tokens) or len(keys) < n:
            raise ValueError(f"State positions {lo}..{hi} must lie in one block of {b} within "
                             f"the {len(tokens)} tokens.")
        prev = bytes.fromhex(keys[n - 1]) if n else bytes(32)
        h = hashlib.sha256(self._salt + b"/" + kind.encode() + b"/" + n.to_bytes(8, "little")
                           + prev)
        tail = np.asarray(tokens[n * b: hi], dtype="<i8")
        out = []
        for length in range(n * b, hi + 1):
            if length > n * b:
                h.update(tail[length - 1 - n * b].tobytes())
            if length >= lo:
                out.append((length, h.copy().hexdigest()))
        return out

    # ---- the runtime cache ----------------------------------------------------------------------

    def _fresh_cache(self) -> ModelCache:
        return new_cache(self.model.plan, 1, self.options.page_tokens, engram_pad=self._pad,
                         device=self.model.device)

    def cache_bytes(self, tokens: int) -> int:
        """The bytes of one session's cache grown to hold `tokens` positions (whole pages)."""
        pages = max(1, -(-tokens // self.options.page_tokens))
        return self._first_page + (pages - 1) * self._page_bytes

    def admit(self, session: Session, tokens: int) -> None:
        """Refuse (CacheFullError) a turn whose cache of `tokens` positions would not fit in the
        budget, before anything is restored or allocated."""
        if session.cache is not None:
            return  # live: `reserve` counts its growth
        need, used = self.cache_bytes(tokens), self.runtime_bytes()
        if used + need > self.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {need:,} more bytes for {tokens} positions; "
                f"{used:,} of its {self.options.cache_budget_bytes:,} are in use.")

    def reserve(self, cache: ModelCache, tokens: int) -> None:
        """Grow a cache to the pages `tokens` positions need, within the byte budget (a cache
        that no session holds yet counts whole); on refusal nothing changes."""
        page = self.options.page_tokens
        want = -(-tokens // page) * page
        have = min(st.capacity * st.ratio for st in cache.stores.values()) \
            if cache.stores else want
        if want <= have:
            return
        extra = sum(t.nbytes // t.size(1) * (want // st.ratio - t.size(1))
                    for st in cache.stores.values()
                    for t in (st.kv_codes, st.kv_scales, st.k_codes, st.k_scales)
                    if t is not None and t.size(1))
        used = self.runtime_bytes()
        held = any(b.cache is cache for b in self._batches) or any(
            s.cache is cache for s in self.sessions.values())
        if not held:
            extra += sum(cache.nbytes().values())
        if used + extra > self.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {extra:,} more bytes for {want} positions; "
                f"{used:,} of its {self.options.cache_budget_bytes:,} are in use.")
        ensure_capacity(cache, want, exact=True)

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
            out.append(s._request(ids, **check_options(kw)))
        return out

    def send_many(self, requests: Sequence[tuple[Session, Sequence[int], dict]]) -> list[list[int]]:
        """One turn for each of several sessions: their prefills one by one, then their decode
        steps together in one `DecodeBatch` (sequences at different lengths; a finished one
        leaves at once, the others go on). Returns each session's tokens."""
        checked = self._check_requests(requests)  # all of them, before any prefill
        for s, _, _ in requests:
            s._finish_open_turn()  # a turn `send` left unfinished ends (and is stored) first
        batch = DecodeBatch(self)
        turns: list[_Turn] = []
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
              images: Sequence[TurnImage] = ()) -> tuple[Session, _Turn]:
        """A new session whose cache is a prefill worker's handed-off runtime state of `tokens`
        (`Session.runtime_state`), and its open turn with the first token already sampled
        (`first`; `generator_state`: the sampler's generator after it). Join the turn to a
        `DecodeBatch`; its end stores it in the tiers like any turn. ValueError when the state
        does not fit this engine's cache. `images`: the prompt's images (spans at their
        offsets in `tokens`), which the tiers' keys name."""
        self._check_open()
        seen = encode_turn(self.model, 0, images, encode=self.encode_image)
        if self.model.vision:
            check_spans(list(tokens), seen, self.model.args.image_token_id, 0)
        if request.sampling is None:
            raise RequestError("A handed-off turn carries its SamplingParams.")
        s = self.session()
        positions = len(tokens) + request.max_new_tokens + 1
        try:
            self.admit(s, positions)
            cache = self._fresh_cache()
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
        turn = _Turn(rec, request.max_new_tokens, request.stop, request.temperature,
                     torch.Generator(), False, sampler, tuple(tokens))
        turn.tokens, turn.sampled, turn.next_token = [first.token_id], [first], first.token_id
        turn.done = len(turn.tokens) >= turn.max_new or first.token_id in turn.stop
        return s, turn


@dataclass(frozen=True)
class _Start:
    """Where a turn starts: the cache, the tier that gave it, how many leading tokens of the
    turn's sequence it holds, and the SSD blocks read for it."""

    cache: ModelCache
    tier: Tier
    cached: int
    keys: tuple[str, ...]


@dataclass
class _Turn:
    """One turn in flight: sampling state and what it has produced."""

    record: TurnRecord
    max_new: int
    stop: frozenset[int]
    temperature: float
    generator: torch.Generator
    keep_logits: bool
    sampler: Sampler | None = None  # the full sampler (SamplingParams); None: temperature
    prompt: tuple[int, ...] = ()  # what the repetition penalty reads (the sequence before)
    tokens: list[int] = field(default_factory=list)
    sampled: list[SampledToken] = field(default_factory=list)  # with a sampler: per token
    next_token: int = -1
    done: bool = False
    ended: bool = False  # Session._end ran: stored, its last token pending

    def sample(self, logits: torch.Tensor) -> None:
        """Choose the next token from fp32 logits (vocab,)."""
        if self.keep_logits:
            self.record.logits.append(logits.float().numpy().copy())
        if self.sampler is not None:
            chosen = self.sampler.sample(logits, generated=self.tokens, prompt=self.prompt)
            self.sampled.append(chosen)
            tok = chosen.token_id
        elif self.temperature <= 0:
            tok = int(logits.argmax())
        else:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=self.generator))
        self.tokens.append(tok)
        self.next_token = tok
        if len(self.tokens) >= self.max_new or tok in self.stop:
            self.done = True

    def fed(self, logits: torch.Tensor) -> None:
        self.record.decoded += 1
        self.sample(logits)

    def fed_draft(self, logits: torch.Tensor, draft_token: int) -> bool:
        """`fed` at a verified position whose draft token is `draft_token`: the token is chosen
        by the speculative rule (the same distribution as `sample`); True if it is the draft
        token."""
        self.record.decoded += 1
        if self.keep_logits:
            self.record.logits.append(logits.float().numpy().copy())
        if self.sampler is not None:
            chosen, accepted = self.sampler.sample_draft(logits, draft_token,
                                                         generated=self.tokens,
                                                         prompt=self.prompt)
            self.sampled.append(chosen)
            tok = chosen.token_id
        elif self.temperature <= 0:
            tok = int(logits.argmax())
            accepted = tok == draft_token
        else:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1)
            got = accept_draft_token(probs, draft_token, generator=self.generator)
            tok, accepted = got.token, got.accepted
        self.tokens.append(tok)
        self.next_token = tok
        if len(self.tokens) >= self.max_new or tok in self.stop:
            self.done = True
        return accepted

    def unread(self, n: int) -> None:
        """Forget the last n tokens (sampled, never read by the caller)."""
        del self.tokens[len(self.tokens) - n:]
        del self.sampled[max(0, len(self.sampled) - n):]
        if self.keep_logits:
            del self.record.logits[len(self.record.logits) - n:]
        self.record.decoded -= n
        self.next_token = self.tokens[-1]


@dataclass
class _SpecStep:
    """A speculative step of one row, kept so the caller's unread tokens can be cut back."""

    verified: Verified | None  # None: a plain decode step
    row: int
    fed: int  # verified tokens kept
    accepted: int  # draft tokens among the chosen ones


def _speculative_step(e: Engine, cache: ModelCache,
                      members: list[tuple[Session, _Turn]]) -> list[_SpecStep]:
    """One step of every row with DSpark: a draft pass, a verify of the k drafts the policy
    picks (one k for the batch, k = 0: a plain decode step), per-row acceptance, and the cache
    cut back to each row's kept tokens. Never runs past a turn's max_new (so never past the
    positions it reserved)."""
    pol, clock, b = e.spec_policy, e.options.spec_clock, len(members)
    now = torch.tensor([t.next_token for _, t in members])  # (b,)
    room = min(t.max_new - len(t.tokens) for _, t in members)  # tokens still to produce
    k, draft = 0, None
    if room > 1 and pol.worth_drafting(b):
        t0 = clock()
        draft = e.phases.draft_after(e.model, cache, now)
        acc = acceptance_probs(draft.confidence.mean(dim=0))
        pol.observe_draft(b, clock() - t0, acc)
        for _, t in members:
            t.record.drafted += draft.ids.size(1) - 1
        k = min(pol.choose(b, acc), room - 1)
    # the policy is told what the whole step costs by the path it takes (the host's sampling,
    # acceptance and cut-back included), the draft pass apart
    t0 = clock()
    if k == 0:
        res = e.phases.decode_step(e.model, cache, now.unsqueeze(1))
        for row, (s, t) in enumerate(members):
            s.history.append(t.next_token)
            t.fed(res.logits[row, -1])
        pol.observe_verify(b, 0, clock() - t0)
        return [_SpecStep(None, row, 1, 0) for row in range(b)]
    toks = torch.cat([now.unsqueeze(1), draft.ids[:, 1:1 + k]], dim=1)  # (b, 1 + k)
    # a compiled artifact's own verify (one call of its `verify` entry), else decode steps
    own = getattr(e.phases, "verify_step", None)
    v = own(e.model, cache, toks) if own is not None else \
        verify_step(e.model, cache, toks, step=e.phases.decode_step)
    steps, judged = [], []  # judged: draft tokens the rule kept or rejected (not cut by done)
    for row, (s, t) in enumerate(members):
        t.record.verified += k
        fed = accepted = rejected = 0
        for i in range(k + 1):
            s.history.append(int(toks[row, i]))
            fed += 1
            if i == k:
                t.fed(v.logits[row, i])
                break
            if not t.fed_draft(v.logits[row, i], int(toks[row, i + 1])):
                rejected = 1
                break
            accepted += 1
            if t.done:
                break
        t.record.accepted += accepted
        steps.append(_SpecStep(v, row, fed, accepted))
        judged.append(accepted + rejected)
    cut_back(e.model, cache, v, [st.fed for st in steps])
    pol.observe_verify(b, k, clock() - t0)
    for st, n in zip(steps, judged, strict=True):
        pol.observe_accepted(b, n, st.accepted)
    return steps


class Session:
    """One conversation. `history` is what its cache has processed; the last sampled token is
    `pending` (fed at the start of the next turn)."""

    def __init__(self, engine: Engine, sid: int):
        self.engine, self.id = engine, sid
        self.history: list[int] = []
        self.pending: int | None = None
        self.cache: ModelCache | None = None
        self.stored_blocks = 0  # SSD blocks known to hold this history's prefix
        self.turns: list[TurnRecord] = []
        self.closed = False
        self._gen = None
        self._open: _Turn | None = None  # the turn `_gen` plays
        self._snapshot: str | None = None  # the pool key of this session's last snapshot
        self.images: list[SessionImage] = []  # the images of `history`, in order
        self.uid = uuid.uuid4().hex  # names the session in its snapshot key

    @property
    def transcript(self) -> list[int]:
        return self.history + ([] if self.pending is None else [self.pending])

    # ---- the public turn ------------------------------------------------------------------------

    def send(self, token_ids: Sequence[int], *, max_new_tokens: int = 256,
             stop: Sequence[int] = (), temperature: float = 0.0, seed: int | None = None,
             keep_logits: bool = False, sampling: SamplingParams | None = None,
             images: Sequence = ()) -> Iterator[int]:
        """Prefill the new tokens and yield up to `max_new_tokens` decoded tokens (stopping
        after a token in `stop`). `sampling` replaces temperature / seed with the full sampler
        (its max_tokens, when set, replaces max_new_tokens; its stop ids and EOS join `stop`).
        `images` (PIL images, bytes, paths, base64 or data URLs): one per `image_token_id`
        placeholder in `token_ids`, in any turn; the runtime lays out each span
        (`runtime/images.py`). The turn's record is `session.turns[-1]`."""
        token_ids, turn_images = self.engine.expand_images(token_ids, images)
        req = self._request(token_ids, max_new_tokens=max_new_tokens, stop=stop,
                            temperature=temperature, seed=seed, keep_logits=keep_logits,
                            sampling=sampling)
        self._finish_open_turn()  # an abandoned turn ends (and is stored) before the next starts
        turn = self._begin(req, images=turn_images)
        self._gen, self._open = self._decode(turn), turn
        return self._gen

    def close(self) -> None:
        """End the session: its turn state is stored (as at every turn end) and its runtime
        cache released."""
        self._finish_open_turn()
        self.cache = None
        self.closed = True
        self.engine.sessions.pop(self.id, None)

    def begin(self, request: TurnRequest, *, pacing: PrefillPacing = PrefillPacing(),
              images: Sequence[TurnImage] = ()) -> _Turn:
        """An EPD prefill worker's turn (`request` from runtime.requests.check_turn): the
        prefill and the first token, the cache left live for `runtime_state`; `finish` ends it
        (stored in the tiers). Its decode runs elsewhere (`Engine.adopt`). `images`: the
        turn's images, their spans laid out in `request` (encoded by a vision stage or not)."""
        if self.closed:
            raise RequestError(f"Session {self.id} is closed.")
        self._finish_open_turn()
        return self._begin(request, pacing=pacing, images=images)

    def runtime_state(self) -> dict[str, np.ndarray]:
        """The live cache's whole state (every complete block, every ring, tail and pointer:
        runtime.state.runtime_state_arrays), what a decode worker restores."""
        if self.cache is None or self.cache.batch != 1:
            raise ValueError(f"Session {self.id} holds no live cache of one sequence.")
        return runtime_state_arrays(self.cache, self.engine.options.page_tokens)

    def finish(self, turn: _Turn) -> None:
        """End a turn `begin` returned: its state goes to the tiers as at any turn's end."""
        if not turn.ended:
            self._end(turn)

    def _finish_open_turn(self) -> None:
        """End the turn `send` returned: a started generator ends in its `finally`; one never
        iterated is ended here (its sampled token stays pending, never lost)."""
        if self._gen is not None:
            self._gen.close()
        if self._gen is not None:  # never started: close() ran nothing
            self._end(self._open)

    # ---- turn steps -----------------------------------------------------------------------------

    def _request(self, token_ids, **options) -> TurnRequest:
        """Every argument checked (runtime/requests.py) before any work; RequestError if not."""
        if self.closed:
            raise RequestError(f"Session {self.id} is closed.")
        self.engine._check_open()
        a = self.engine.model.args
        # an unfinished turn's last token becomes pending when it ends (before this one begins)
        open_token = self._gen is not None and bool(self._open.tokens)
        cached = len(self.history) + (self.pending is not None or open_token)
        return check_turn(token_ids, TurnLimits(a.vocab_size, a.max_seq_len, cached), **options)

    def _positions(self, req: TurnRequest) -> int:
        """The cache positions the turn needs (the last sampled token is never fed)."""
        return len(self.history) + (self.pending is not None) + len(req.token_ids) \
            + req.max_new_tokens + 1

    def _begin(self, req: TurnRequest, *, positions: int = 0,
               pacing: PrefillPacing = PrefillPacing(), images: Sequence[TurnImage] = ()
               ) -> _Turn:
        """positions: reserve at least this many; 0: the turn's own. images: the turn's new
        images (their spans already laid out in `req.token_ids`)."""
        e = self.engine
        fresh = ([] if self.pending is None else [self.pending]) + list(req.token_ids)
        seen = self.images + encode_turn(e.model, len(self.history) + (self.pending is not None),
                                         images, encode=e.encode_image)
        if e.model.vision:  # every image id of the sequence stands in a span it has an image for
            check_spans(self.history + fresh, seen, e.model.args.image_token_id, 0)
        max_new_tokens = req.max_new_tokens
        positions = max(positions, self._positions(req))
        e.admit(self, positions)
        gen = torch.Generator().manual_seed(0 if req.seed is None else req.seed)
        rec = TurnRecord(session=self.id, turn=len(self.turns) + 1, tier=Tier.COLD, prefilled=0,
                         replayed=0, decoder_replayed=0, decoded=0, token_layers=0,
                         cached_blocks=0)  # tier and counts set as the turn runs
        tokens = self.history + fresh  # the whole sequence this turn's cache must hold
        sampler = None if req.sampling is None else Sampler(req.sampling)
        turn = _Turn(rec, max_new_tokens, req.stop, req.temperature, gen, req.keep_logits,
                     sampler, tuple(tokens) if sampler is not None else ())
        t = time.perf_counter()
        start = self._restore(tokens, key_tokens(tokens, seen))
        rec.seconds["restore"] = time.perf_counter() - t
        rec.tier, rec.cached_blocks = start.tier, len(start.keys)
        rec.reused_keys, rec.reused_tokens = list(start.keys), start.cached
        t = time.perf_counter()
        try:
            e.reserve(start.cache, positions)
            self.cache = start.cache
            res = self._prefill(start, tokens, rec, pacing, seen)
        except Exception:
            self.cache = None  # the history stays in the tiers (or the session starts cold)
            raise
        rec.seconds["prefill"] = time.perf_counter() - t
        self.history, self.images = tokens, seen
        self.pending = None
        e.tier_counts[start.tier] += 1
        if max_new_tokens:
            turn.sample(res.logits[0, -1])
        else:  # prefill only: nothing sampled, nothing pending
            turn.done = True
        return turn

    def _restore(self, tokens: list[int], keyed: Sequence[int] | None = None) -> _Start:
        """The cache this turn starts from, and the tier that gave it. Any session's records
        serve: the longest run of stored blocks of `tokens[:-1]` (the last token always runs:
        its logits start the turn), then the latest snapshot within the block after them.
        `keyed`: the tokens the keys hash (image spans named by content, `images.key_tokens`)."""
        e = self.engine
        tokens = tokens if keyed is None else keyed
        if self.cache is not None:
            return _Start(self.cache, Tier.LIVE, len(self.history), ())
        if e.store is None:
            if self.history:
                raise RuntimeError("A released session needs the SSD store.")
            return _Start(e._fresh_cache(), Tier.COLD, 0, ())
        b = e.options.page_tokens
        keys = e.block_keys(tokens[:-1])
        n = e.blocks.lookup_prefix(keys)
        found = self._find_state(tokens, keys, n)
        if found is not None:
            length, arrays, tier = found
            blocks = self._blocks(keys[: length // b])
            if len(blocks) == length // b:
                cache = e._fresh_cache()
                io = Transfers(e.model.device)  # one batch of copies, waited for on the device
                restore_blocks(cache, blocks, b, io)
                restore_snapshot(cache, arrays, b, e._ring_layers, io)
                io.ready_for_compute()
                self.stored_blocks = len(blocks)
                return _Start(cache, tier, length, tuple(keys[: len(blocks)]))
        if not e.options.exact:
            blocks = self._blocks(keys[: e.blocks.lookup_prefix(keys)])
            if blocks:
                cache = e._fresh_cache()
                restore_blocks(cache, blocks, b)
                cache.index_owner = torch.tensor([index_owner_at(e.model.plan,
                                                                 len(blocks) * b)],
                                                 device=e.model.device)
                self.stored_blocks = len(blocks)
                return _Start(cache, Tier.PREFIX, len(blocks) * b, tuple(keys[: len(blocks)]))
        self.stored_blocks = 0
        return _Start(e._fresh_cache(), Tier.COLD, 0, ())

    def _find_state(self, tokens: list[int], keys: list[str],
                    n: int) -> tuple[int, dict, Tier] | None:
        """(L, arrays, tier) of the longest snapshot of tokens[:L], L in the block after the n
        stored ones (and below len(tokens)): the DRAM pool first, then (exact mode) the SSD
        state records."""
        e = self.engine
        b = e.options.page_tokens
        lo, hi = max(1, n * b), min(len(tokens) - 1, (n + 1) * b - 1)
        if hi < lo:
            return None
        snaps = e.state_keys(tokens, keys, StateKind.SNAPSHOT, lo, hi)
        states = e.state_keys(tokens, keys, StateKind.STATE, lo, hi) if e.options.exact else []
        for (length, snap_key), (_, state_key) in zip(reversed(snaps),
                                                      reversed(states or snaps), strict=True):
            if e.pool.contains(snap_key):
                snap = e.pool.get(snap_key)
                if snap is not None:
                    return length, snap.arrays, Tier.SNAPSHOT
            if states and e.blocks.contains(state_key):
                arrays = e.blocks.get(state_key)
                if arrays is not None:
                    return length, arrays, Tier.SNAPSHOT_SSD
        return None

    def _blocks(self, keys: list[str]) -> list[dict]:
        out = []
        for k in keys:
            arrays = self.engine.blocks.get(k)
            if arrays is None:  # missing, or bad and now deleted: the prefix ends here
                break
            out.append(arrays)
        return out

    def _prefill(self, start: _Start, tokens: list[int], rec: TurnRecord,
                 pacing: PrefillPacing, images: Sequence[SessionImage] = ()):
        e, ph, m = self.engine, self.engine.phases, self.engine.model
        w = m.args.window_size
        cache, cut = start.cache, start.cached
        chunks = {"chunk_tokens": pacing.chunk_tokens or e.options.prefill_chunk_tokens,
                  "between_chunks": pacing.between_chunks}
        spans = sequence_images(m, images)  # (an artifact's send checked it takes images)
        if spans is not None and e.options.exact:  # the new tokens' rows
            chunks["image"] = spans.rows(0 if start.tier is Tier.COLD else cut, len(tokens))
        elif spans is not None:  # CED: each phase segment takes its rows by position
            chunks["images"] = spans
        if start.tier is Tier.PREFIX:
            res = ph.replay_prefill(m, cache, torch.tensor([tokens[:cut]]),
                                    torch.tensor([tokens[cut:]]), **chunks)
            rec.replayed = min(w, cut)
            rec.prefilled = len(tokens) - cut
            rec.decoder_replayed = min(w, rec.replayed + rec.prefilled)
        elif start.tier is Tier.COLD:
            res = self._run(cache, torch.tensor([tokens]), chunks)
            rec.prefilled = len(tokens)
            rec.decoder_replayed = 0 if e.options.exact else min(w, len(tokens))
        else:  # live or snapshot: the cache holds tokens[:cut] with their local state
            new = torch.tensor([tokens[cut:]])
            rec.prefilled = new.size(1)
            if e.options.exact or e.options.decoder_carry:
                res = self._run(cache, new, chunks)
                rec.decoder_replayed = 0 if e.options.exact else min(w, new.size(1))
            else:
                rec.replayed = resume_tail(m, cache, new.size(1))
                res = ph.resume_prefill(m, cache, torch.tensor([tokens[:cut]]), new, **chunks)
                rec.decoder_replayed = min(w, rec.replayed + rec.prefilled)
        rec.token_layers = res.token_layers
        for k in ("prefilled", "replayed", "decoder_replayed"):
            e.token_counts[k] += getattr(rec, k)
        return res

    def _run(self, cache: ModelCache, tokens: torch.Tensor, chunks: dict):
        """A cold (or carried-over) prefill; `chunks`: chunk_tokens and between_chunks."""
        e = self.engine
        if e.options.exact:
            return e.phases.prefill_exact(e.model, cache, tokens, **chunks)
        return e.phases.ced_prefill(e.model, cache, tokens, **chunks)

    def _decode(self, turn: _Turn) -> Iterator[int]:
        if turn.ended:  # ended before it was read (by the next send, or close): nothing to do
            return
        e = self.engine
        t = time.perf_counter()
        sent, last = 0, None
        try:
            while sent < len(turn.tokens):  # none when max_new_tokens is 0
                while sent < len(turn.tokens):  # a speculative step may bring several
                    sent += 1  # counted before the yield: a caller leaving there has read it
                    yield turn.tokens[sent - 1]
                if turn.done:
                    break
                if e.spec_policy is not None:
                    last = _speculative_step(e, self.cache, [(self, turn)])[0]
                    continue
                res = e.phases.decode_step(e.model, self.cache, torch.tensor([[turn.next_token]]))
                self.history.append(turn.next_token)
                turn.fed(res.logits[0, -1])
        finally:
            unread = len(turn.tokens) - sent
            if unread and sent and last is not None and last.verified is not None:
                self._cut_unread(turn, last, unread)
            turn.record.seconds["decode"] = time.perf_counter() - t
            self._end(turn)

    def _cut_unread(self, turn: _Turn, last: _SpecStep, unread: int) -> None:
        """The caller left with tokens of the last speculative step unread: the turn ends at
        the last token it read (pending), the cache cut back to the tokens before it."""
        cut_back(self.engine.model, self.cache, last.verified, [last.fed - unread])
        del self.history[len(self.history) - unread:]
        turn.record.accepted -= max(0, last.accepted - (last.fed - unread))
        turn.unread(unread)

    def _end(self, turn: _Turn) -> None:
        """The last sampled token is pending (every earlier one was fed and is history). The
        state goes to the tiers, and with an SSD store the runtime cache lets the session go."""
        e = self.engine
        self.pending = turn.tokens[-1] if turn.tokens else None
        e.token_counts["decoded"] += turn.record.decoded
        t = time.perf_counter()
        if e.store is not None:
            self._offload()
            self.cache = None
        turn.record.seconds["offload"] = time.perf_counter() - t
        self.turns.append(turn.record)
        self._gen = None
        turn.ended = True

    def _offload(self) -> None:
        """The new complete blocks to the SSD writer's queue (written in the background: a
        refused one is found missing by the next turn's walk, which then writes it again), the
        snapshot to the pool (exact mode: also to the SSD store)."""
        e, b = self.engine, self.engine.options.page_tokens
        if len(self.history) != int(self.cache.pos[0]):
            raise AssertionError("history and cache position disagree")
        keyed = key_tokens(self.history, self.images)
        keys = e.block_keys(keyed)
        io = Transfers(e.model.device)  # every copy of the turn's end, then one wait
        new = [(keys[i], block_arrays(self.cache, i, b, io))
               for i in range(self.stored_blocks, len(keys))]
        arrays = snapshot_arrays(self.cache, b, e._ring_layers, io)
        io.ready_for_host()
        for key, block in new:
            e.blocks.submit(key, block)
        self.stored_blocks = len(keys)
        key = e.history_key(keyed, StateKind.SNAPSHOT)
        e.pool.put(key, arrays, {"session": self.id, "tokens": len(self.history)})
        if self._snapshot not in (None, key) and not any(
                s._snapshot == self._snapshot for s in e.sessions.values() if s is not self):
            # this session has moved past its previous turn, and no other session of this
            # engine stands at that state (two sessions with one history share one snapshot)
            e.pool.drop(self._snapshot)
        self._snapshot = key
        if e.options.exact:
            e.blocks.submit(e.history_key(keyed, StateKind.STATE), arrays)


class DecodeBatch:
    """Turns decoding together in one stacked cache, a row (slot) per turn.

    Rows [0, n) are the live turns. A joining turn's cache is copied into row n once (the
    session then holds none); a leaving one is copied out to its session (which ends the turn:
    stored in the tiers like any turn) and the last row is moved into its slot: one row copied,
    nothing re-stacked. The decode step runs on rows [0, n) alone (`leading_rows`: views of the
    batch's memory, what a phase replaces is copied back). The stacked cache is allocated at the
    first join and grows only when a joining turn needs it: rows by doubling (up to
    `max_rows`), capacity to the pages of the longest turn (each turn reserves its whole length
    at its start, so a decode step never grows it); it is freed when the last turn leaves. Its
    bytes count against the engine's runtime budget (`Engine.runtime_bytes`)."""

    def __init__(self, engine: Engine, *, max_rows: int = 64):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"A decode batch needs max_rows >= 1, got {max_rows!r}.")
        self.engine, self.max_rows = engine, max_rows
        self.cache: ModelCache | None = None
        self.members: list[tuple[Session, _Turn]] = []  # row i's session and turn
        engine._batches.append(self)

    def __len__(self) -> int:
        return len(self.members)

    def nbytes(self) -> int:
        return 0 if self.cache is None else sum(self.cache.nbytes().values())

    def row_of(self, session: Session) -> int:
        for row, (s, _) in enumerate(self.members):
            if s is session:
                return row
        raise ValueError(f"Session {session.id} has no row in this decode batch.")

    def _shape(self, tokens: int) -> tuple[int, int]:
        """(rows, capacity in tokens) of the stacked cache once a turn of `tokens` joins."""
        page = self.engine.options.page_tokens
        want = -(-tokens // page) * page
        if self.cache is None:
            return 1, want
        rows = self.cache.batch
        if len(self.members) == rows:
            rows = min(self.max_rows, 2 * rows)
        return rows, max(capacity_tokens(self.cache), want)

    def join_bytes(self, tokens: int) -> int:
        """The bytes the stacked cache grows by when a turn of `tokens` positions joins."""
        rows, cap = self._shape(tokens)
        return max(0, rows * self.engine.cache_bytes(cap) - self.nbytes())

    def start(self, session: Session, request: TurnRequest, *,
              pacing: PrefillPacing = PrefillPacing(),
              images: Sequence[TurnImage] = ()) -> _Turn:
        """Begin a turn of `session` (restore, prefill, first token) and join it to the batch;
        a turn already done after its prefill ends at once (stored) and does not join.
        `images`: the turn's images, their spans laid out in `request` (`Engine.expand_images`)."""
        if len(self.members) >= self.max_rows:
            raise ValueError(f"The decode batch is full ({self.max_rows} rows).")
        turn = session._begin(request, pacing=pacing, images=images)
        if turn.done:
            session._end(turn)
            return turn
        try:
            self.join(session, turn)
        except BaseException:
            session._end(turn)
            raise
        return turn

    def join(self, session: Session, turn: _Turn) -> int:
        """Copy the session's cache into the next row (CacheFullError, with nothing changed, when
        the grown batch would not fit the budget); returns the row."""
        e, src = self.engine, session.cache
        if turn.done or src is None or src.batch != 1:
            raise ValueError("Only a live, unfinished turn of one sequence joins a batch.")
        if len(self.members) >= self.max_rows:
            raise ValueError(f"The decode batch is full ({self.max_rows} rows).")
        rows, cap = self._shape(capacity_tokens(src))
        grow = rows * e.cache_bytes(cap) - self.nbytes()
        used = e.runtime_bytes()
        if grow > 0 and used + grow > e.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {grow:,} more bytes for a decode batch of {rows} rows "
                f"of {cap} positions; {used:,} of its {e.options.cache_budget_bytes:,} are in "
                f"use.")
        if self.cache is None:
            self.cache = new_cache(e.model.plan, rows, cap, engram_pad=e._pad,
                                   device=e.model.device)
        else:
            if rows > self.cache.batch:
                self.cache = with_rows(self.cache, rows)
            ensure_capacity(self.cache, cap, exact=True)
        row = len(self.members)
        put_sequence(self.cache, row, src)
        session.cache = None  # the batch's row is what runs now
        self.members.append((session, turn))
        return row

    def step(self) -> list[tuple[Session, _Turn]]:
        """One decode step of every live turn: each feeds its last sampled token and samples the
        next. Returns the members in row order (a done one leaves with `leave`)."""
        if not self.members:
            return []
        e = self.engine
        view = leading_rows(self.cache, len(self.members))  # (n, ...) over the batch's memory
        members = list(self.members)
        if e.spec_policy is not None:  # one k for the batch, acceptance per row
            _speculative_step(e, view, members)
            write_back(self.cache, view)
            return members
        toks = torch.tensor([[t.next_token] for _, t in self.members])  # (n, 1)
        res = e.phases.decode_step(e.model, view, toks)
        write_back(self.cache, view)
        for row, (s, t) in enumerate(members):
            s.history.append(t.next_token)
            t.fed(res.logits[row, -1])
        return members

    def leave(self, session: Session) -> None:
        """The session's turn leaves (done or not): its row is copied out to the session, the
        last row moves into its slot, and the turn ends (stored in the tiers)."""
        row = self.row_of(session)
        s, turn = self.members[row]
        s.cache = select_sequences(self.cache, [row])
        last = len(self.members) - 1
        if row != last:
            move_sequence(self.cache, last, row)
            self.members[row] = self.members[last]
        self.members.pop()
        if not self.members:
            self.cache = None
        s._end(turn)

    def close(self) -> None:
        """Every turn still here leaves (and is stored); the batch is done."""
        while self.members:
            self.leave(self.members[-1][0])
        self.cache = None
        if self in self.engine._batches:
            self.engine._batches.remove(self)

    def drop(self) -> None:
        """After a failed step: let every row go unstored (the sessions hold no cache; their
        next turn is planned from the tiers) and end the batch."""
        for s, _ in self.members:
            s.cache = None
        self.members.clear()
        self.cache = None
        if self in self.engine._batches:
            self.engine._batches.remove(self)
