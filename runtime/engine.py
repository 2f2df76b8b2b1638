"""The embedded engine: sessions, turns, the runtime cache and the SSD / DRAM tiers.

    engine = Engine.load(artifact_dir, checkpoint_dir, store_dir="kv-store")
    session = engine.session()
    for token in session.send(prompt_ids, max_new_tokens=200, stop=(eos,)):
        ...
    session.close()
    engine.stats()

A turn plans itself from what the tiers hold for the session's history (the tokens its cache has
processed):

| state | what runs |
|---|---|
| live (the runtime cache still holds the session) | the new tokens only |
| snapshot hit (DRAM pool; exact mode also SSD) | SSD prefix blocks + snapshot; the new tokens |
| prefix hit, snapshot miss | encoder bounded replay: the last `window` cached tokens + the rest |
| cold | CED prefill (exact mode: exact prefill) |

then decode. Prefills other than exact ones are CED prefills, so the decoder bounded replay runs at
every prefill. At the end of a turn the complete prefix blocks go to the SSD store and the rest of
the state to the snapshot pool; with an SSD store the runtime cache then lets the session go.

The runtime cache is each live session's `ModelCache`, its global stores allocated in whole pages
of `page_tokens` positions (contiguous per session, so compiled gathers read them directly; a
turn grows them once, to the pages it needs). Bytes are counted from the live tensors.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsv41.graph.cache import ModelCache, ensure_capacity, new_cache
from dsv41.graph.checkpoint import weights_fingerprint
from dsv41.graph.model import Model
from dsv41.graph.phases import DEFAULT_CHUNK_TOKENS, chunk_spans

from .state import (
    block_arrays,
    check_block_tokens,
    index_owner_at,
    restore_blocks,
    restore_snapshot,
    snapshot_arrays,
)

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
    pool_budget_bytes: int = 1 << 30  # DRAM snapshot pool
    pool_ttl_s: float = 600.0
    store_clock: Callable[[], float] = time.time
    pool_clock: Callable[[], float] = time.monotonic
    threads: int | None = None  # TVM's CPU pool (None: TVM_NUM_THREADS, else torch's count)
    # every prefill runs in chunks of at most this many tokens: transient memory O(chunk x
    # entries) instead of O(N x entries)
    prefill_chunk_tokens: int = DEFAULT_CHUNK_TOKENS


@dataclass
class TurnRecord:
    session: int
    turn: int
    tier: str  # live | snapshot | snapshot-ssd | prefix | cold
    prefilled: int  # new tokens that entered the cache
    replayed: int  # cached tokens run through the encoder again (snapshot miss)
    decoder_replayed: int  # tokens through the decoder's bounded replay
    decoded: int
    token_layers: int  # work of the prefill (tokens x blocks)
    cached_blocks: int  # SSD prefix blocks the turn started from
    seconds: dict[str, float] = field(default_factory=dict)
    logits: list[np.ndarray] = field(default_factory=list)  # when asked for: prefill, then steps


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


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


class Engine:
    def __init__(self, model: Model, phases, *, weights_hash: str, options: EngineOptions,
                 backend: str):
        from .kv_store import KVStore, model_fingerprint
        from .snapshot_pool import SnapshotPool

        self.model, self.phases, self.options, self.backend = model, phases, options, backend
        # salts every key: the config, the weights and the record format
        self._salt = model_fingerprint(model.args.config_hash(), weights_hash, FORMAT_VERSION)
        self._pad = model.engram.pad_id if model.engram is not None else None
        check_block_tokens([src.ratio for src in model.plan.kv_sources], options.page_tokens)
        chunk_spans(1, options.prefill_chunk_tokens)  # a bad chunk size is refused up front
        self.store = None
        if options.store_dir is not None:
            self.store = KVStore(Path(options.store_dir), capacity_bytes=options.
                                 store_capacity_bytes, min_lifetime_s=options.store_min_lifetime_s,
                                 clock=options.store_clock, fingerprint=self._salt)
        self.pool = SnapshotPool(budget_bytes=options.pool_budget_bytes, ttl_s=options.pool_ttl_s,
                                 clock=options.pool_clock)
        self.sessions: dict[int, Session] = {}
        self._stacked: ModelCache | None = None  # send_many's batch while it decodes
        self._next_id = 1
        self.tier_counts = {t: 0 for t in ("live", "snapshot", "snapshot-ssd", "prefix", "cold")}
        self.token_counts = {"prefilled": 0, "replayed": 0, "decoder_replayed": 0, "decoded": 0}

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def load(cls, artifact_dir: str | Path, checkpoint_dir: str | Path, **options) -> Engine:
        """A compiled artifact (verified against its manifest) and the checkpoint's weights."""
        from .artifact import Artifact
        from .compiled import CompiledPhases

        opts = EngineOptions(**options)
        art = Artifact.load(artifact_dir)
        model = Model.from_checkpoint(checkpoint_dir, art.args)
        return cls(model, CompiledPhases(art, model, threads=opts.threads),
                   weights_hash=weights_fingerprint(checkpoint_dir),
                   options=opts, backend=f"artifact {Path(artifact_dir)}")

    @classmethod
    def from_model(cls, model: Model, *, weights_hash: str, **options) -> Engine:
        """The PyTorch graph's own phases (the oracle backend; no artifact)."""
        from dsv41.graph import phases

        return cls(model, phases, weights_hash=weights_hash, options=EngineOptions(**options),
                   backend="PyTorch graph")

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, transcript: Sequence[int] = ()) -> Session:
        """A new conversation, or one resumed from its transcript (every token sent and
        generated so far; the tiers are looked up for it at the first turn)."""
        s = Session(self, self._next_id)
        if len(transcript):
            ids = s._check_ids(transcript)
            s.history, s.pending = ids[:-1], ids[-1]
        self.sessions[s.id] = s
        self._next_id += 1
        return s

    def stats(self) -> EngineStats:
        live = [s.cache for s in self.sessions.values() if s.cache is not None]
        by_kind = {"window": 0, "main_kv": 0, "index_k": 0, "tails": 0}
        for c in live:
            for k, v in c.nbytes().items():
                by_kind[k] += v
        return EngineStats(
            sessions_live=len(live), runtime_bytes=by_kind,
            runtime_tokens=sum(int(c.pos[0]) for c in live),
            runtime_budget=self.options.cache_budget_bytes, tiers=dict(self.tier_counts),
            tokens=dict(self.token_counts),
            store=None if self.store is None else self.store.stats(), pool=self.pool.stats())

    def runtime_bytes(self) -> int:
        live = [s.cache for s in self.sessions.values() if s.cache is not None]
        if self._stacked is not None:
            live.append(self._stacked)
        return sum(sum(c.nbytes().values()) for c in live)

    # ---- keys -----------------------------------------------------------------------------------

    def block_keys(self, tokens: Sequence[int]) -> list[str]:
        from .kv_store import block_keys

        return block_keys(tokens, self.options.page_tokens, self._salt)

    def history_key(self, tokens: Sequence[int], kind: str) -> str:
        return hashlib.sha256(self._salt + b"/" + kind.encode() + b"/" + _tokens_bytes(tokens)) \
            .hexdigest()

    # ---- the runtime cache ----------------------------------------------------------------------

    def _fresh_cache(self) -> ModelCache:
        return new_cache(self.model.plan, 1, self.options.page_tokens, engram_pad=self._pad)

    def reserve(self, cache: ModelCache, tokens: int) -> None:
        """Grow a live cache to the pages `tokens` positions need, within the byte budget; on
        refusal nothing changes."""
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
        if used + extra > self.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {extra:,} more bytes for {want} positions; "
                f"{used:,} of its {self.options.cache_budget_bytes:,} are in use.")
        ensure_capacity(cache, want, exact=True)

    # ---- batched decode -------------------------------------------------------------------------

    def send_many(self, requests: Sequence[tuple[Session, Sequence[int], dict]]) -> list[list[int]]:
        """One turn for each of several sessions: their prefills one by one, then their decode
        steps together in one batch (sequences at different lengths). Returns each session's
        tokens."""
        from dsv41.graph.cache import select_sequences, stack_caches

        if len({id(s) for s, _, _ in requests}) != len(requests):
            raise ValueError("A session may appear once in send_many.")
        turns = [s._begin(ids, **kw) for s, ids, kw in requests]
        active = [i for i, t in enumerate(turns) if not t.done]
        t0 = time.perf_counter()
        while active:
            stacked = stack_caches([requests[i][0].cache for i in active])
            for i in active:  # the stacked copy is what runs; the per-session ones are stale
                requests[i][0].cache = None
            self._stacked = stacked
            while True:
                toks = torch.tensor([[turns[i].next_token] for i in active])
                res = self.phases.decode_step(self.model, stacked, toks)
                for row, i in enumerate(active):
                    requests[i][0].history.append(turns[i].next_token)
                    turns[i].fed(res.logits[row, -1])
                finished = [row for row, i in enumerate(active) if turns[i].done]
                if finished:
                    break
            for row, i in enumerate(active):
                requests[i][0].cache = select_sequences(stacked, [row])
            self._stacked = None
            active = [i for row, i in enumerate(active) if row not in finished]
        per = (time.perf_counter() - t0) / max(1, len(requests))
        for (s, _, _), t in zip(requests, turns, strict=True):
            t.record.seconds["decode"] = per
            s._end(t)
        return [list(t.tokens) for t in turns]


@dataclass
class _Turn:
    """One turn in flight: sampling state and what it has produced."""

    record: TurnRecord
    max_new: int
    stop: frozenset[int]
    temperature: float
    generator: torch.Generator
    keep_logits: bool
    tokens: list[int] = field(default_factory=list)
    next_token: int = -1
    done: bool = False

    def sample(self, logits: torch.Tensor) -> None:
        """Choose the next token from fp32 logits (vocab,)."""
        if self.keep_logits:
            self.record.logits.append(logits.float().numpy().copy())
        if self.temperature <= 0:
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
        self._snapshot: str | None = None  # the pool key of this session's last snapshot

    @property
    def transcript(self) -> list[int]:
        return self.history + ([] if self.pending is None else [self.pending])

    # ---- the public turn ------------------------------------------------------------------------

    def send(self, token_ids: Sequence[int], *, max_new_tokens: int = 256,
             stop: Sequence[int] = (), temperature: float = 0.0, seed: int | None = None,
             keep_logits: bool = False) -> Iterator[int]:
        """Prefill the new tokens and yield up to `max_new_tokens` decoded tokens (stopping
        after a token in `stop`). The turn's record is `session.turns[-1]`."""
        if self._gen is not None:
            self._gen.close()  # an abandoned turn ends (and is stored) before the next starts
        turn = self._begin(token_ids, max_new_tokens=max_new_tokens, stop=stop,
                           temperature=temperature, seed=seed, keep_logits=keep_logits)
        self._gen = self._decode(turn)
        return self._gen

    def close(self) -> None:
        """End the session: its turn state is stored (as at every turn end) and its runtime
        cache released."""
        if self._gen is not None:
            self._gen.close()
        self.cache = None
        self.closed = True
        self.engine.sessions.pop(self.id, None)

    # ---- turn steps -----------------------------------------------------------------------------

    def _check_ids(self, token_ids) -> list[int]:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("send() takes a non-empty 1-D sequence of integer token ids.")
        v = self.engine.model.args.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"Token ids must lie in [0, {v}); got {int(ids.min())}.."
                             f"{int(ids.max())}.")
        return [int(x) for x in ids]

    def _begin(self, token_ids, *, max_new_tokens: int = 256, stop: Sequence[int] = (),
               temperature: float = 0.0, seed: int | None = None,
               keep_logits: bool = False) -> _Turn:
        if self.closed:
            raise ValueError(f"Session {self.id} is closed.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}.")
        new = self._check_ids(token_ids)
        e = self.engine
        fresh = ([] if self.pending is None else [self.pending]) + new
        total = len(self.history) + len(fresh) + max_new_tokens
        if total > e.model.args.max_seq_len:
            raise ValueError(f"The turn would reach {total} positions; the model's max_seq_len "
                             f"is {e.model.args.max_seq_len}.")
        gen = torch.Generator().manual_seed(0 if seed is None else int(seed))
        rec = TurnRecord(self.id, len(self.turns) + 1, "", 0, 0, 0, 0, 0, 0)
        turn = _Turn(rec, max_new_tokens, frozenset(int(s) for s in stop), float(temperature),
                     gen, keep_logits)
        t = time.perf_counter()
        cache, tier, nblocks = self._restore()
        rec.seconds["restore"] = time.perf_counter() - t
        rec.tier, rec.cached_blocks = tier, nblocks
        t = time.perf_counter()
        try:
            e.reserve(cache, len(self.history) + len(fresh) + max_new_tokens + 1)
            self.cache = cache
            res = self._prefill(cache, tier, nblocks, fresh, rec)
        except Exception:
            self.cache = None  # the history stays in the tiers (or the session starts cold)
            raise
        rec.seconds["prefill"] = time.perf_counter() - t
        self.history += fresh
        self.pending = None
        e.tier_counts[tier] += 1
        turn.sample(res.logits[0, -1])
        return turn

    def _restore(self) -> tuple[ModelCache, str, int]:
        """The cache this turn starts from, and the tier that gave it."""
        e = self.engine
        if self.cache is not None:
            return self.cache, "live", 0
        if not self.history:
            return e._fresh_cache(), "cold", 0
        if e.store is None:
            raise RuntimeError("A released session needs the SSD store.")
        b = e.options.page_tokens
        keys = e.block_keys(self.history)
        snap = e.pool.get(e.history_key(self.history, "snapshot"))
        tier = "snapshot"
        arrays = None if snap is None else snap.arrays
        if arrays is None and e.options.exact:
            arrays, tier = e.store.get(e.history_key(self.history, "state")), "snapshot-ssd"
        if arrays is not None:
            done = int(arrays["pos"][0]) // b
            blocks = self._blocks(keys[:done])
            if int(arrays["pos"][0]) == len(self.history) and len(blocks) == done:
                cache = e._fresh_cache()
                restore_blocks(cache, blocks, b)
                restore_snapshot(cache, arrays, b)
                self.stored_blocks = done
                return cache, tier, done
        if not e.options.exact:
            blocks = self._blocks(keys[: e.store.lookup_prefix(keys)])
            if blocks:
                cache = e._fresh_cache()
                restore_blocks(cache, blocks, b)
                cache.index_owner = torch.tensor([index_owner_at(e.model.plan,
                                                                 len(blocks) * b)])
                self.stored_blocks = len(blocks)
                return cache, "prefix", len(blocks)
        self.stored_blocks = 0
        return e._fresh_cache(), "cold", 0

    def _blocks(self, keys: list[str]) -> list[dict]:
        out = []
        for k in keys:
            arrays = self.engine.store.get(k)
            if arrays is None:  # missing, or bad and now deleted: the prefix ends here
                break
            out.append(arrays)
        return out

    def _prefill(self, cache: ModelCache, tier: str, nblocks: int, fresh: list[int],
                 rec: TurnRecord):
        e, ph, m = self.engine, self.engine.phases, self.engine.model
        a = m.args
        new = torch.tensor([fresh])
        if tier == "prefix":
            cut = nblocks * e.options.page_tokens
            prefix = torch.tensor([self.history[:cut]])
            suffix = torch.tensor([self.history[cut:] + fresh])
            res = ph.replay_prefill(m, cache, prefix, suffix,
                                    chunk_tokens=e.options.prefill_chunk_tokens)
            rec.replayed = min(a.window_size, cut)
            rec.prefilled = suffix.size(1)
            rec.decoder_replayed = min(a.window_size, rec.replayed + rec.prefilled)
        elif tier == "cold":
            full = torch.tensor([self.history + fresh])
            res = self._run(cache, full)
            rec.prefilled = full.size(1)
            rec.decoder_replayed = 0 if e.options.exact else min(a.window_size, full.size(1))
        else:
            res = self._run(cache, new)
            rec.prefilled = len(fresh)
            rec.decoder_replayed = 0 if e.options.exact else min(a.window_size, len(fresh))
        rec.token_layers = res.token_layers
        for k in ("prefilled", "replayed", "decoder_replayed"):
            e.token_counts[k] += getattr(rec, k)
        return res

    def _run(self, cache: ModelCache, tokens: torch.Tensor):
        e = self.engine
        chunk = e.options.prefill_chunk_tokens
        if e.options.exact:
            return e.phases.prefill_exact(e.model, cache, tokens, chunk_tokens=chunk)
        return e.phases.ced_prefill(e.model, cache, tokens, chunk_tokens=chunk)

    def _decode(self, turn: _Turn) -> Iterator[int]:
        e = self.engine
        t = time.perf_counter()
        try:
            while True:
                yield turn.next_token
                if turn.done:
                    break
                res = e.phases.decode_step(e.model, self.cache, torch.tensor([[turn.next_token]]))
                self.history.append(turn.next_token)
                turn.fed(res.logits[0, -1])
        finally:
            turn.record.seconds["decode"] = time.perf_counter() - t
            self._end(turn)

    def _end(self, turn: _Turn) -> None:
        """The last sampled token is pending (every earlier one was fed and is history). The
        state goes to the tiers, and with an SSD store the runtime cache lets the session go."""
        e = self.engine
        self.pending = turn.tokens[-1]
        e.token_counts["decoded"] += turn.record.decoded
        t = time.perf_counter()
        if e.store is not None:
            self._offload()
            self.cache = None
        turn.record.seconds["offload"] = time.perf_counter() - t
        self.turns.append(turn.record)
        self._gen = None

    def _offload(self) -> None:
        e, b = self.engine, self.engine.options.page_tokens
        if len(self.history) != int(self.cache.pos[0]):
            raise AssertionError("history and cache position disagree")
        keys = e.block_keys(self.history)
        for i in range(self.stored_blocks, len(keys)):
            if not e.store.put(keys[i], block_arrays(self.cache, i, b)):
                break  # refused (the store is full of young entries): later blocks wait too
            self.stored_blocks = i + 1
        arrays = snapshot_arrays(self.cache, b)
        key = e.history_key(self.history, "snapshot")
        e.pool.put(key, arrays, {"session": self.id, "tokens": len(self.history)})
        if self._snapshot not in (None, key):
            e.pool.drop(self._snapshot)  # this session has moved past its previous turn
        self._snapshot = key
        if e.options.exact:
            e.store.put(e.history_key(self.history, "state"), arrays)
