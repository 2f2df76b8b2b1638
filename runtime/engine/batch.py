"""Turns decoding together in one stacked cache (`DecodeBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from dsv41.graph.cache import (
    ModelCache,
    capacity_tokens,
    ensure_capacity,
    leading_rows,
    move_sequence,
    put_sequence,
    select_sequences,
    with_rows,
    write_back,
)
from dsv41.graph.phases_api import DEFAULT_PACING, PrefillPacing
from dsv41.runtime.engine.host import EngineHost
from dsv41.runtime.engine.images import TurnImage
from dsv41.runtime.engine.options import CacheFullError
from dsv41.runtime.engine.requests import TurnRequest
from dsv41.runtime.engine.sampling import sample_seed
from dsv41.runtime.engine.session import Session
from dsv41.runtime.engine.turn import Turn


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

    def __init__(self, engine: EngineHost, *, max_rows: int = 64):
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"A decode batch needs max_rows >= 1, got {max_rows!r}.")
        self.engine, self.max_rows = engine, max_rows
        self.cache: ModelCache | None = None
        self.members: list[tuple[Session, Turn]] = []  # row i's session and turn
        engine.track(self)

    def __len__(self) -> int:
        return len(self.members)

    def nbytes(self) -> int:
        return 0 if self.cache is None else sum(self.cache.nbytes().values())

    def row_of(self, session: Session) -> int:
        for row, (s, _) in enumerate(self.members):
            if s is session:
                return row
        raise ValueError(f"Session {session.id} has no row in this decode batch.")

    def _shape(self, tokens: int, joining: int = 1) -> tuple[int, int]:
        """(rows, capacity in tokens) of the stacked cache once `joining` turns of `tokens`
        join (one by one: rows double as each finds them full)."""
        page = self.engine.options.page_tokens
        want = -(-tokens // page) * page
        rows = 0 if self.cache is None else self.cache.batch
        cap = want if self.cache is None else max(capacity_tokens(self.cache), want)
        need = len(self.members) + joining
        while rows < need:
            rows = 1 if rows == 0 else min(self.max_rows, 2 * rows)
            if rows == self.max_rows:
                break
        return rows, cap

    def join_bytes(self, tokens: int, joining: int = 1) -> int:
        """The bytes the stacked cache grows by when `joining` turns of `tokens` positions
        join (the samples of one prompt: `start_samples`)."""
        rows, cap = self._shape(tokens, joining)
        return max(0, rows * self.engine.cache_bytes(cap) - self.nbytes())

    def start(self, session: Session, request: TurnRequest, *,
              pacing: PrefillPacing = DEFAULT_PACING,
              images: Sequence[TurnImage] = ()) -> Turn:
        """Begin a turn of `session` (restore, prefill, first token) and join it to the batch;
        a turn already done after its prefill ends at once (stored) and does not join.
        `images`: the turn's images, their spans laid out in `request` (`Engine.expand_images`)."""
        if len(self.members) >= self.max_rows:
            raise ValueError(f"The decode batch is full ({self.max_rows} rows).")
        turn = session.start_turn(request, pacing=pacing, images=images)
        if turn.done:
            session.finish(turn)
            return turn
        try:
            self.join(session, turn)
        except BaseException:
            session.finish(turn)
            raise
        return turn

    def start_samples(self, session: Session, request: TurnRequest, n: int, *,
                      pacing: PrefillPacing = DEFAULT_PACING,
                      images: Sequence[TurnImage] = ()) -> list[tuple[Session, Turn]]:
        """`n` samples of one prompt: `session`'s turn of `request` is prefilled once (sample
        0), then forked (`Session.fork`) into n - 1 new sessions, sample i's sampler seeded
        `sample_seed(seed, i)`; each sample's row is a copy of the prefilled rows (`join`'s
        `source`), so all n decode as ordinary rows of this batch. Only sample 0's session
        stores its turn in the tiers (the tiers see one history of the prompt). A sample done
        at its first token ends at once and does not join. Returns (session, turn) per sample,
        sample 0 first. On a failure every sample begun ends (sample 0 stored, as `start`)."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_rows:
            raise ValueError(f"A prompt's samples must number 1 to the batch's {self.max_rows} "
                             f"rows, not {n!r}.")
        if len(self.members) + n > self.max_rows:
            raise ValueError(f"The decode batch has {self.max_rows - len(self.members)} free "
                             f"rows; {n} samples need one each.")
        if n == 1:
            return [(session, self.start(session, request, pacing=pacing, images=images))]
        first = session.start_turn(request, pacing=pacing, images=images,
                                   keep_branch_logits=True)
        out = [(session, first)]
        try:
            for i in range(1, n):
                s, t = session.fork(first, sample_request(request, i))
                out.append((s, t))
                if t.done:
                    s.finish(t)
                else:
                    self.join(s, t, source=session.cache)
            first.branch_logits = None
            if not first.done:
                self.join(session, first)
        except BaseException:
            first.branch_logits = None
            for s, t in out:
                if any(m is s for m, _ in self.members):
                    self.leave(s)
                else:
                    s.finish(t)
                if s is not session:
                    s.close()  # a fork nobody was handed
            raise
        if first.done:
            session.finish(first)
        return out

    def join(self, session: Session, turn: Turn, *, source: ModelCache | None = None) -> int:
        """Copy the session's cache (or `source`, another session's cache of the same
        sequence: a fork) into the next row (CacheFullError, with nothing changed, when the
        grown batch would not fit the budget); returns the row."""
        e, src = self.engine, session.cache if source is None else source
        if turn.done or src is None or src.batch != 1:
            raise ValueError("Only a live, unfinished turn of one sequence joins a batch.")
        if len(self.members) >= self.max_rows:
            raise ValueError(f"The decode batch is full ({self.max_rows} rows).")
        rows, cap = self._shape(capacity_tokens(src))
        grow = rows * e.cache_bytes(cap) - self.nbytes()
        if grow > 0 and e.fits(grow):  # the runtime prefix tier's blocks make way first
            e.make_room(grow)
        used = e.runtime_bytes()
        if grow > 0 and used + grow > e.options.cache_budget_bytes:
            raise CacheFullError(
                f"The runtime cache needs {grow:,} more bytes for a decode batch of {rows} rows "
                f"of {cap} positions; {used:,} of its {e.options.cache_budget_bytes:,} are in "
                f"use.")
        if self.cache is None:
            self.cache = e.new_cache(rows, cap)
        else:
            if rows > self.cache.batch:
                self.cache = with_rows(self.cache, rows)
            ensure_capacity(self.cache, cap, exact=True)
        row = len(self.members)
        put_sequence(self.cache, row, src)
        session.cache = None  # the batch's row is what runs now
        self.members.append((session, turn))
        return row

    def step(self) -> list[tuple[Session, Turn]]:
        """One decode step of every live turn: each feeds its last sampled token and samples the
        next. Returns the members in row order (a done one leaves with `leave`)."""
        if not self.members:
            return []
        view = leading_rows(self.cache, len(self.members))  # (n, ...) over the batch's memory
        members = list(self.members)
        # with DSpark: one k for the batch, acceptance per row
        self.engine.step(view, [(s.history, t) for s, t in members])
        write_back(self.cache, view)
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
        s.finish(turn)

    def close(self) -> None:
        """Every turn still here leaves (and is stored); the batch is done."""
        while self.members:
            self.leave(self.members[-1][0])
        self.cache = None
        self.engine.untrack(self)

    def drop(self) -> None:
        """After a failed step: let every row go unstored (the sessions hold no cache; their
        next turn is planned from the tiers) and end the batch."""
        for s, _ in self.members:
            s.cache = None
        self.members.clear()
        self.cache = None
        self.engine.untrack(self)


def sample_request(request: TurnRequest, index: int) -> TurnRequest:
    """Sample `index`'s turn of a request of several samples: the same prompt and settings, its
    own seed stream (`sampling.sample_seed`; unseeded samples draw independent seeds)."""
    sampling = request.sampling
    if sampling is not None:
        sampling = replace(sampling, seed=sample_seed(sampling.seed, index))
    return replace(request, seed=sample_seed(request.seed, index), sampling=sampling)
