"""A session: one conversation over the engine, turn by turn. A turn plans its start with the
engine's `TurnPlanner` (the tiers' order is the planner's alone), prefills from there, decodes,
and at its end hands its state to the planner's offload."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np
import torch

from dsv41.graph.cache import ModelCache
from dsv41.graph.phases import resume_tail
from dsv41.graph.phases_api import DEFAULT_PACING, PrefillPacing
from dsv41.graph.speculative import cut_back
from dsv41.runtime.engine.host import EngineHost
from dsv41.runtime.engine.images import (
    SessionImage,
    TurnImage,
    check_spans,
    encode_turn,
    key_tokens,
    sequence_images,
)
from dsv41.runtime.engine.planner import TurnPlan
from dsv41.runtime.engine.records import Tier, TurnRecord
from dsv41.runtime.engine.requests import RequestError, TurnLimits, TurnRequest, check_turn
from dsv41.runtime.engine.sampling import Sampler, SamplingParams
from dsv41.runtime.engine.state import runtime_state_arrays
from dsv41.runtime.engine.turn import SpecStep, Turn, TurnFailed


class Session:
    """One conversation. `history` is what its cache has processed; the last sampled token is
    `pending` (fed at the start of the next turn)."""

    def __init__(self, engine: EngineHost, sid: int):
        self.engine, self.id = engine, sid
        self.history: list[int] = []
        self.pending: int | None = None
        self.cache: ModelCache | None = None
        self.stored_blocks = 0  # SSD blocks known to hold this history's prefix
        self.turns: list[TurnRecord] = []
        self.closed = False
        self._gen = None
        self._open: Turn | None = None  # the turn `_gen` plays
        self.snapshot_key: str | None = None  # the pool key of this session's last snapshot
        self.images: list[SessionImage] = []  # the images of `history`, in order
        self.uid = uuid.uuid4().hex  # names the session's hold on its pool snapshot
        # False: a fork of another session's turn (`fork`): its turns go to no tier, so the
        # tiers see one history of the prompt (the session it forked from stores its own)
        self.stores = True

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
        req = self.request(token_ids, max_new_tokens=max_new_tokens, stop=stop,
                           temperature=temperature, seed=seed, keep_logits=keep_logits,
                           sampling=sampling)
        self.finish_open_turn()  # an abandoned turn ends (and is stored) before the next starts
        turn = self.start_turn(req, images=turn_images)
        self._gen, self._open = self._decode(turn), turn
        return self._gen

    def close(self) -> None:
        """End the session: its turn state is stored (as at every turn end) and its runtime
        cache released."""
        self.finish_open_turn()
        self.cache = None
        self.closed = True
        self.engine.forget(self)

    def begin(self, request: TurnRequest, *, pacing: PrefillPacing = DEFAULT_PACING,
              images: Sequence[TurnImage] = ()) -> Turn:
        """An EPD prefill worker's turn (`request` from runtime.requests.check_turn): the
        prefill and the first token, the cache left live for `runtime_state`; `finish` ends it
        (stored in the tiers). Its decode runs elsewhere (`Engine.adopt`). `images`: the
        turn's images, their spans laid out in `request` (encoded by a vision stage or not)."""
        if self.closed:
            raise RequestError(f"Session {self.id} is closed.")
        self.finish_open_turn()
        return self.start_turn(request, pacing=pacing, images=images)

    def runtime_state(self) -> dict[str, np.ndarray]:
        """The live cache's whole state (every complete block, every ring, tail and pointer:
        runtime.state.runtime_state_arrays), what a decode worker restores."""
        if self.cache is None or self.cache.batch != 1:
            raise ValueError(f"Session {self.id} holds no live cache of one sequence.")
        return runtime_state_arrays(self.cache, self.engine.options.page_tokens)

    def finish(self, turn: Turn) -> None:
        """End a turn `begin` (or `start_turn`) returned: its state goes to the tiers as at any
        turn's end."""
        if not turn.ended:
            self._end(turn)

    def finish_open_turn(self) -> None:
        """End the turn `send` returned: a started generator ends in its `finally`; one never
        iterated is ended here (its sampled token stays pending, never lost)."""
        if self._gen is not None:
            self._gen.close()
        if self._gen is not None:  # never started: close() ran nothing
            self._end(self._open)

    def request(self, token_ids, **options) -> TurnRequest:
        """Every argument of a turn checked (runtime/requests.py) before any work; RequestError
        if not."""
        if self.closed:
            raise RequestError(f"Session {self.id} is closed.")
        self.engine.check_open()
        a = self.engine.model.args
        # an unfinished turn's last token becomes pending when it ends (before this one begins)
        open_token = self._gen is not None and bool(self._open.tokens)
        cached = len(self.history) + (self.pending is not None or open_token)
        return check_turn(token_ids, TurnLimits(a.vocab_size, a.max_seq_len, cached), **options)

    # ---- turn steps -----------------------------------------------------------------------------

    def _positions(self, req: TurnRequest) -> int:
        """The cache positions the turn needs (the last sampled token is never fed)."""
        return len(self.history) + (self.pending is not None) + len(req.token_ids) \
            + req.max_new_tokens + 1

    def start_turn(self, req: TurnRequest, *, positions: int = 0,
                   pacing: PrefillPacing = DEFAULT_PACING, images: Sequence[TurnImage] = (),
                   keep_branch_logits: bool = False) -> Turn:
        """Restore, prefill and sample the first token of a turn (a decode batch's start: the
        caller has ended any open turn). positions: reserve at least this many; 0: the turn's
        own. images: the turn's new images (their spans already laid out in `req.token_ids`).
        keep_branch_logits: the prefill's last logits stay on the turn (`Turn.branch_logits`)
        for the samples that `fork` from it."""
        e = self.engine
        fresh = ([] if self.pending is None else [self.pending]) + list(req.token_ids)
        seen = self.images + encode_turn(e.model, len(self.history) + (self.pending is not None),
                                         images, encode=e.encode_image)
        if e.model.vision:  # every image id of the sequence stands in a span it has an image for
            check_spans(self.history + fresh, seen, e.model.args.image_token_id, 0)
        max_new_tokens = req.max_new_tokens
        positions = max(positions, self._positions(req))
        e.admit(self, positions)
        rec = TurnRecord(session=self.id, turn=len(self.turns) + 1, tier=Tier.COLD, prefilled=0,
                         replayed=0, decoder_replayed=0, decoded=0, token_layers=0,
                         cached_blocks=0)  # tier and counts set as the turn runs
        tokens = self.history + fresh  # the whole sequence this turn's cache must hold
        turn = _new_turn(req, rec, tokens)
        t = time.perf_counter()
        start = e.planner.restore(key_tokens(tokens, seen), live=self.cache,
                                  live_tokens=len(self.history), resumed=bool(self.history))
        if start.tier is not Tier.LIVE:
            self.stored_blocks = len(start.keys) if start.stored_blocks is None \
                else start.stored_blocks
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
        if start.tier is Tier.RUNTIME_PREFIX:
            e.token_counts["runtime_prefix"] += start.cached
        e.planner.keep_prompt_blocks(self.cache, key_tokens(tokens, seen))
        self.history, self.images = tokens, seen
        self.pending = None
        e.tier_counts[start.tier] += 1
        if max_new_tokens:
            turn.sample(res.logits[0, -1])
            if keep_branch_logits:
                turn.branch_logits = res.logits[0, -1]
        else:  # prefill only: nothing sampled, nothing pending
            turn.done = True
        return turn

    def fork(self, turn: Turn, req: TurnRequest) -> tuple[Session, Turn]:
        """Another sample of the prompt `turn` (this session's, just prefilled with
        `keep_branch_logits`) began: a new session of the same history, which stores nothing
        (`stores`), and its turn of `req` (the same prompt, its own sampler: its own seed) with
        its first token sampled from the same prefill logits. The new session holds no cache:
        a decode batch copies this session's rows into one of its own (`DecodeBatch.join`'s
        `source`), so the prompt is prefilled once."""
        if turn.branch_logits is None or turn.ended:
            raise ValueError("Only a turn just prefilled with keep_branch_logits forks.")
        if tuple(req.token_ids) != tuple(self.history[len(self.history) - len(req.token_ids):]):
            raise ValueError("A fork samples the same prompt as the turn it forks from.")
        s = self.engine.session()
        s.stores = False
        s.history, s.images, s.stored_blocks = list(self.history), list(self.images), 0
        src = turn.record
        rec = TurnRecord(session=s.id, turn=1, tier=src.tier, prefilled=0, replayed=0,
                         decoder_replayed=0, decoded=0, token_layers=0,
                         cached_blocks=src.cached_blocks, reused_keys=list(src.reused_keys),
                         reused_tokens=src.reused_tokens, forked_from=self.id)
        forked = _new_turn(req, rec, self.history)
        if req.max_new_tokens:
            forked.sample(turn.branch_logits)
        else:
            forked.done = True
        return s, forked

    def _prefill(self, start: TurnPlan, tokens: list[int], rec: TurnRecord,
                 pacing: PrefillPacing, images: Sequence[SessionImage] = ()):
        e, ph, m = self.engine, self.engine.phases, self.engine.model
        w = m.args.window_size
        cache, cut = start.cache, start.cached
        pacing = replace(pacing, chunk_tokens=pacing.chunk_tokens
                         or e.options.prefill_chunk_tokens)
        rows = {}
        spans = sequence_images(m, images)  # (an artifact's send checked it takes images)
        if spans is not None and e.options.exact:  # the new tokens' rows
            rows["image"] = spans.rows(0 if start.tier is Tier.COLD else cut, len(tokens))
        elif spans is not None:  # CED: each phase segment takes its rows by position
            rows["images"] = spans
        if start.tier in (Tier.PREFIX, Tier.RUNTIME_PREFIX):  # blocks alone, either tier
            res = ph.replay_prefill(m, cache, torch.tensor([tokens[:cut]]),
                                    torch.tensor([tokens[cut:]]), pacing=pacing, **rows)
            rec.replayed = min(w, cut)
            rec.prefilled = len(tokens) - cut
            rec.decoder_replayed = min(w, rec.replayed + rec.prefilled)
        elif start.tier is Tier.COLD:
            res = self._run(cache, torch.tensor([tokens]), pacing, rows)
            rec.prefilled = len(tokens)
            rec.decoder_replayed = 0 if e.options.exact else min(w, len(tokens))
        else:  # live or snapshot: the cache holds tokens[:cut] with their local state
            new = torch.tensor([tokens[cut:]])
            rec.prefilled = new.size(1)
            if e.options.exact or e.options.decoder_carry:
                res = self._run(cache, new, pacing, rows)
                rec.decoder_replayed = 0 if e.options.exact else min(w, new.size(1))
            else:
                rec.replayed = resume_tail(m, cache, new.size(1))
                res = ph.resume_prefill(m, cache, torch.tensor([tokens[:cut]]), new,
                                        pacing=pacing, **rows)
                rec.decoder_replayed = min(w, rec.replayed + rec.prefilled)
        rec.token_layers = res.token_layers
        for k in ("prefilled", "replayed", "decoder_replayed"):
            e.token_counts[k] += getattr(rec, k)
        return res

    def _run(self, cache: ModelCache, tokens: torch.Tensor, pacing: PrefillPacing, rows: dict):
        """A cold (or carried-over) prefill; `rows`: the image rows it takes, if any."""
        e = self.engine
        if e.options.exact:
            return e.phases.prefill_exact(e.model, cache, tokens, pacing=pacing, **rows)
        return e.phases.ced_prefill(e.model, cache, tokens, pacing=pacing, **rows)

    def _decode(self, turn: Turn) -> Iterator[int]:
        if turn.ended:  # ended before it was read (by the next send, or close): nothing to do
            return
        t = time.perf_counter()
        sent, last = 0, None
        try:
            while sent < len(turn.tokens):  # none when max_new_tokens is 0
                while sent < len(turn.tokens):  # a speculative step may bring several
                    if turn.failure is not None and sent == len(turn.tokens) - 1:
                        raise TurnFailed(turn.failure)  # its last token stands for no token
                    sent += 1  # counted before the yield: a caller leaving there has read it
                    yield turn.tokens[sent - 1]
                if turn.done:
                    break
                last = self.engine.step(self.cache, [(self.history, turn)])[0]
        finally:
            unread = len(turn.tokens) - sent
            if unread and sent and last is not None and last.verified is not None:
                self._cut_unread(turn, last, unread)
            turn.record.seconds["decode"] = time.perf_counter() - t
            self._end(turn)

    def _cut_unread(self, turn: Turn, last: SpecStep, unread: int) -> None:
        """The caller left with tokens of the last speculative step unread: the turn ends at
        the last token it read (pending), the cache cut back to the tokens before it."""
        cut_back(self.engine.model, self.cache, last.verified, [last.fed - unread])
        del self.history[len(self.history) - unread:]
        turn.record.unaccept(last.accepted, min(last.accepted, last.fed - unread))
        turn.unread(unread)

    def _end(self, turn: Turn) -> None:
        """The last sampled token is pending (every earlier one was fed and is history). The
        state goes to the tiers, and with an SSD store the runtime cache lets the session go."""
        e = self.engine
        self.pending = turn.tokens[-1] if turn.tokens else None
        e.token_counts["decoded"] += turn.record.decoded
        t = time.perf_counter()
        if turn.failure is not None:
            # its last token stands for no token, and the state that gave logits no token can
            # be chosen from is not stored: the session's next turn is planned from the tiers
            # as they were before this one (nothing of it served to another request)
            self.pending, self.cache = None, None
        elif e.planner.offloads and not self.stores:
            self.cache = None  # a fork: the session it forked from stores the prompt's history
        elif e.planner.offloads:
            done = e.planner.offload(self.cache, self.history, self.images, session=self.id,
                                     holder=self.uid, stored_blocks=self.stored_blocks,
                                     previous=self.snapshot_key)
            self.stored_blocks, self.snapshot_key = done.stored_blocks, done.snapshot
            self.cache = None
        turn.record.seconds["offload"] = time.perf_counter() - t
        self.turns.append(turn.record)
        self._gen = None
        turn.ended = True


def _new_turn(req: TurnRequest, rec: TurnRecord, tokens: Sequence[int]) -> Turn:
    """A turn of `req` whose cache holds (or will hold) `tokens` before its first sample."""
    gen = torch.Generator().manual_seed(0 if req.seed is None else req.seed)
    sampler = None if req.sampling is None else Sampler(req.sampling)
    return Turn(rec, req.max_new_tokens, req.stop, req.temperature, gen, req.keep_logits,
                sampler, tuple(tokens) if sampler is not None else ())
