"""One turn in flight (its sampling state and what it has produced) and the decode step of a
group of turns: a plain step, or DSpark's draft-verify-accept step (gpt-fast's shape: draft,
verify the k drafts the policy picks, keep each row's accepted run, cut the cache back)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsv41.graph.cache import ModelCache, capacity_tokens
from dsv41.graph.model import Model
from dsv41.graph.phases_api import Phases
from dsv41.graph.speculative import Verified, cut_back, verify_step
from dsv41.runtime.engine.records import TurnRecord
from dsv41.runtime.engine.sampling import SampledToken, Sampler, check_logits
from dsv41.runtime.engine.speculative import SpecPolicy, accept_draft_token, acceptance_probs

log = logging.getLogger(__name__)

# a row of a decode step: the history its fed tokens join, and its turn
Row = tuple[list[int], "Turn"]


class TurnFailed(RuntimeError):
    """Raised to a turn's reader (`Session.send`) where the turn failed (`Turn.failure`): its
    next token could not be chosen. The tokens before it were real; nothing stands for it."""


def sampling_failure(error: Exception) -> str:
    """The message a turn fails with when its next token cannot be chosen: the sampler's own
    sentence for what it refuses (SamplingError, ConstraintError, both ValueErrors), else the
    error named (a constraint's bug, torch refusing a distribution)."""
    if isinstance(error, ValueError):
        return str(error)
    log.warning("a turn's sampling failed", exc_info=error)  # a bug (a constraint's, ours)
    return f"Sampling this request's next token failed ({type(error).__name__}: {error})."


@dataclass
class Turn:
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
    ended: bool = False  # the session ended it: stored, its last token pending
    # why this turn alone failed (no token could be chosen: non-finite logits or distribution,
    # its constraint's dead end or error); it ended done
    failure: str | None = None
    # the prefill's last logits, kept while other samples of the prompt fork from this turn
    # (`Session.fork`; `DecodeBatch.start_samples` lets them go)
    branch_logits: torch.Tensor | None = field(default=None, repr=False)

    def sample(self, logits: torch.Tensor) -> None:
        """Choose the next token from fp32 logits (vocab,). A failure to choose one (logits or
        a distribution that is not finite, the constraint's dead end or its own error) fails
        this turn alone (`failure`), never the batch it decodes in."""
        if self.keep_logits:
            self.record.logits.append(logits.float().numpy().copy())
        try:
            tok = self._choose(logits)
        except Exception as e:  # noqa: BLE001 -- any error of this row's sampling is its own
            return self._fail(sampling_failure(e))
        self.tokens.append(tok)
        self.next_token = tok
        if len(self.tokens) >= self.max_new or tok in self.stop:
            self.done = True

    def _choose(self, logits: torch.Tensor) -> int:
        if self.sampler is not None:
            chosen = self.sampler.sample(logits, generated=self.tokens, prompt=self.prompt)
            self.sampled.append(chosen)
            return chosen.token_id
        check_logits(logits)
        if self.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

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
        try:
            tok, accepted = self._choose_draft(logits, draft_token)
        except Exception as e:  # noqa: BLE001 -- as in `sample`: this row fails alone
            self._fail(sampling_failure(e))
            return False
        self.tokens.append(tok)
        self.next_token = tok
        if len(self.tokens) >= self.max_new or tok in self.stop:
            self.done = True
        return accepted

    def _choose_draft(self, logits: torch.Tensor, draft_token: int) -> tuple[int, bool]:
        if self.sampler is not None:
            chosen, accepted = self.sampler.sample_draft(logits, draft_token,
                                                         generated=self.tokens,
                                                         prompt=self.prompt)
            self.sampled.append(chosen)
            return chosen.token_id, accepted
        check_logits(logits)
        if self.temperature <= 0:
            tok = int(logits.argmax())
            return tok, tok == draft_token
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        got = accept_draft_token(probs, draft_token, generator=self.generator)
        return got.token, got.accepted

    def _fail(self, reason: str) -> None:
        """This turn alone fails (the batch goes on): it ends on a stop id (EOS when it is one)
        with `failure` set, so its caller reports an error, never the token."""
        self.failure = reason
        tok = min(self.stop) if self.stop else 0
        self.sampled.append(SampledToken(tok, None, ()))
        self.tokens.append(tok)
        self.next_token = tok
        self.done = True

    def unread(self, n: int) -> None:
        """Forget the last n tokens (sampled, never read by the caller)."""
        del self.tokens[len(self.tokens) - n:]
        del self.sampled[max(0, len(self.sampled) - n):]
        if self.keep_logits:
            del self.record.logits[len(self.record.logits) - n:]
        self.record.decoded -= n
        self.next_token = self.tokens[-1]


@dataclass(frozen=True)
class SpecStep:
    """A decode step of one row, kept so the caller's unread tokens can be cut back."""

    verified: Verified | None  # None: a plain decode step (nothing to cut back)
    row: int
    fed: int  # verified tokens kept
    accepted: int  # draft tokens among the chosen ones


@dataclass(frozen=True)
class Stepper:
    """What a decode step runs with: the engine's phases and model, and DSpark's policy (None:
    plain decode steps) with the clock it measures step costs by."""

    phases: Phases
    model: Model
    policy: SpecPolicy | None
    clock: Callable[[], float]

    def step(self, cache: ModelCache, rows: Sequence[Row]) -> list[SpecStep]:
        """One decode step of every row (row i of `cache`): each feeds its turn's last sampled
        token (its history grows by what was fed) and samples the next."""
        if self.policy is not None:
            return self.speculative(cache, rows)
        return self.plain(cache, rows)

    def plain(self, cache: ModelCache, rows: Sequence[Row]) -> list[SpecStep]:
        toks = torch.tensor([[t.next_token] for _, t in rows])  # (n, 1)
        res = self.phases.decode_step(self.model, cache, toks)
        for row, (history, t) in enumerate(rows):
            history.append(t.next_token)
            t.fed(res.logits[row, -1])
        return [SpecStep(None, row, 1, 0) for row in range(len(rows))]

    def speculative(self, cache: ModelCache, rows: Sequence[Row]) -> list[SpecStep]:
        """A draft pass, a k per row (`SpecPolicy.choose_rows`: its own confidence, 0
        included), one verify of every row to the largest k (the positions past a row's own k
        verified and discarded: its tokens are those it would get alone), per-row acceptance,
        and the cache cut back to each row's kept tokens. Never judges past a turn's max_new,
        never writes past the cache's capacity."""
        pol, clock, b, m = self.policy, self.clock, len(rows), self.model
        now = torch.tensor([t.next_token for _, t in rows])  # (b,)
        # drafts each row can still use: what it has left to produce, less the bonus token
        caps = [t.max_new - len(t.tokens) - 1 for _, t in rows]
        # and every row is verified to the largest k: within capacity and max_seq_len
        room = min(capacity_tokens(cache), m.args.max_seq_len) - int(cache.pos.max()) - 1
        ks, draft = [0] * b, None
        if max(caps) > 0 and room > 0 and pol.worth_drafting(b):
            t0 = clock()
            draft = self.phases.draft_after(m, cache, now)
            pol.observe_draft(b, clock() - t0, acceptance_probs(draft.confidence.mean(dim=0)))
            for _, t in rows:
                t.record.drafted += draft.ids.size(1) - 1
            scores = [acceptance_probs(c) for c in draft.confidence]
            ks = pol.choose_rows(b, scores, [min(c, room) for c in caps])
        k = max(ks)
        # the policy is told what the whole step costs by the path it takes (the host's
        # sampling, acceptance and cut-back included), the draft pass apart
        t0 = clock()
        if k == 0:
            steps = self.plain(cache, rows)
            pol.observe_verify(b, 0, clock() - t0)
            pol.observe_tokens(b, len(steps))
            return steps
        toks = torch.cat([now.unsqueeze(1), draft.ids[:, 1:1 + k]], dim=1)  # (b, 1 + k)
        # a compiled artifact's own verify (one call of its `verify` entry), else decode steps
        own = getattr(self.phases, "verify_step", None)
        v = own(m, cache, toks) if own is not None else \
            verify_step(m, cache, toks, step=self.phases.decode_step)
        steps, judged = [], []  # judged: draft tokens the rule kept or rejected (not cut by done)
        for row, ((history, t), kr) in enumerate(zip(rows, ks, strict=True)):
            fed = accepted = rejected = 0
            for i in range(kr + 1):
                history.append(int(toks[row, i]))
                fed += 1
                if i == kr:
                    t.fed(v.logits[row, i])
                    break
                if not t.fed_draft(v.logits[row, i], int(toks[row, i + 1])):
                    rejected = 1
                    break
                accepted += 1
                if t.done:
                    break
            t.record.count_verify(kr, accepted)
            steps.append(SpecStep(v, row, fed, accepted))
            judged.append(accepted + rejected)
        cut_back(m, cache, v, [st.fed for st in steps])
        pol.observe_verify(b, k, clock() - t0)
        for st, n in zip(steps, judged, strict=True):
            pol.observe_accepted(b, n, st.accepted)
        pol.observe_tokens(b, sum(st.fed for st in steps))
        return steps
