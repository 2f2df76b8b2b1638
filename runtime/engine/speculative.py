"""Speculative decoding's two runtime halves: accepting a draft, and choosing its length.

Acceptance (`accept_draft_token`): the standard speculative rejection rule. A draft token d
drawn from q is kept with probability min(1, p(d) / q(d)), p the backbone's distribution at
that position (after the request's penalties, temperature and truncations); on rejection the
token is drawn from the normalised residual max(0, p - q). The token that comes out is then
distributed exactly as p. DSpark drafts greedily, so q is the point mass on d (kept with
probability p(d); the residual is p without d). Greedy decoding is the case p = point mass on
the argmax: a draft token is kept iff it is the argmax.

Length (`SpecPolicy`): DSpark's confidence head scores each draft position; read as the
probability a_i that draft token i is accepted once the ones before it were, the expected
tokens a verify of k drafts yields are 1 + sum_{j<=k} prod_{i<=j} a_i. The policy picks the
k in 0..max_draft (0: no speculation, a plain decode step) that maximises those tokens over
the measured seconds of the step at the current batch size: for k > 0 the draft pass plus
the rest of a speculative step (the verify by the path the engine takes, the acceptance, the
cut-back), for k = 0 a plain decode step, no draft (moving averages per (batch, k), from the
engine's own timings of whole steps). What keeps the costs true:
- the first `warmup` measurements of each (batch, k) and of the draft pass are left out (the
  first call of an entry at a shape pays allocation and page-ins; a k so far measured only
  cold counts as not measured);
- a plain step runs at least every `refresh` steps, so the baseline follows the context
  (it would go stale while the policy speculates);
- the policy drafts only when some k > 0 would pay at the acceptance measured so far (the
  lower of the kept fraction per position and the confidence head's average: a draft `choose`
  would not verify, or whose tokens are rejected, is a wasted pass), and otherwise probes: a
  draft every `refresh` steps whose rows choose k by their confidence heads alone, so the kept
  fraction is measured again, and at most one k beyond the largest measured at the batch size
  (each k is tried once, as optimistic as the rule below, but one at a time). A probe that
  yields fewer tokens per second than a plain step doubles the wait before the next one (up to
  `refresh` x `max_probe_wait`); one that pays resets it. Outside probes a row's k follows
  the lower of its head's scores and the kept fraction measured per position (a head that
  promises more than is kept does not buy verifies that lose).
A k never measured counts as costing what the largest measured smaller k costs (optimistic,
so it is tried and then known); before a plain step is measured the policy picks 0.

A length per request (`choose_rows`): each row of a batch gets its own k, from its own
confidence-head scores and the measured cost of a step of k at the batch size, within what its
turn has left to produce. The engine verifies every row to the largest k (the verify entry
takes one length per call) and judges each row's own k drafts only, so a row's tokens are
those it would get alone. `floor` = 1 (`speculative=on`): drafting at every step, k >= 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Acceptance:
    token: int  # the token that comes out at this position
    accepted: bool  # it is the draft token


def accept_draft_token(probs: torch.Tensor, draft_token: int,
                       draft_probs: torch.Tensor | None = None, *,
                       generator: torch.Generator | None = None) -> Acceptance:
    """One draft position under the rejection rule. probs: the backbone's distribution
    (vocab,); draft_probs: the draft's distribution q (None: the point mass on draft_token,
    DSpark's greedy draft). Uses at most two draws from `generator`."""
    p = probs.to(torch.float64)
    v = p.numel()
    if p.dim() != 1 or v == 0 or not 0 <= draft_token < v:
        raise ValueError(f"accept_draft_token takes a distribution over the vocabulary and a "
                         f"draft token in 0..{v - 1}; got shape {tuple(p.shape)} and "
                         f"{draft_token}.")
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[draft_token] = 1.0
    else:
        q = draft_probs.to(torch.float64)
        if q.shape != p.shape:
            raise ValueError("The draft distribution must have the backbone's shape.")
    qd, pd = float(q[draft_token]), float(p[draft_token])
    if qd <= 0.0:
        raise ValueError(f"The draft token {draft_token} has probability 0 under its own "
                         f"draft distribution.")
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    if u < min(1.0, pd / qd):
        return Acceptance(draft_token, True)
    residual = (p - q).clamp(min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q up to rounding: rejection had probability ~0; p itself
        residual, total = p, float(p.sum())
    token = int(torch.multinomial(residual / total, 1, generator=generator))
    return Acceptance(token, False)


def acceptance_probs(confidence: torch.Tensor) -> list[float]:
    """The confidence head's scores (B,) as per-position conditional acceptance
    probabilities (a sigmoid)."""
    return torch.sigmoid(confidence.float()).tolist()


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """Tokens a verify of k drafts yields: the bonus token and the expected accepted prefix."""
    if not 0 <= k <= len(acceptance):
        raise ValueError(f"k must lie in 0..{len(acceptance)}, got {k}.")
    out, run = 1.0, 1.0
    for a in acceptance[:k]:
        if not 0.0 <= a <= 1.0 or math.isnan(a):
            raise ValueError(f"Acceptance probabilities lie in [0, 1], got {a}.")
        run *= a
        out += run
    return out


# the engine's `SpecPolicy.min_gain`: a k > 0 must promise 5% more tokens/s than a plain step
ENGINE_MIN_GAIN = 1.05


@dataclass
class SpecPolicy:
    """Verify-length choice from the confidence head and measured costs (see the module
    docstring). The engine reports every step it takes: `observe_draft` (the draft pass),
    `observe_verify` (the rest of the step: k = 0 a plain decode step, k > 0 the verify call,
    the acceptance and the cut-back, by whatever path the engine runs: the compiled `verify`
    entry or decode steps) and `observe_accepted` (how far each row's draft was right);
    `worth_drafting` decides whether to draft at all, `choose` picks k."""

    max_draft: int
    alpha: float = 0.2  # weight of a new measurement in the moving average
    refresh: int = 16  # speculating, a plain step (drafting or not: a draft) every `refresh`
    warmup: int = 1  # first measurements of each (batch, k) and draft batch left out
    floor: int = 0  # the least k (1: speculate at every step, `speculative=on`)
    # a k > 0 over a plain step only where its predicted tokens/s beat the plain step's by
    # this factor: both come from moving averages of timings on a machine whose speed wanders
    # (`dsv41 bench spec`, bench preset on a 2-vCPU Xeon VM, injected acceptance 0.3: k = 1
    # predicted 3% above plain lost 10%, the plain step's average reading 16% above the plain
    # engine's own steps), and a gain within that noise is not worth its risk
    min_gain: float = 1.0
    verify_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch, k) -> s
    draft_s: dict[int, float] = field(default_factory=dict)  # batch -> s
    accepted: dict[int, list[float]] = field(default_factory=dict)  # batch -> per position
    confidence: dict[int, list[float]] = field(default_factory=dict)  # batch -> per position
    samples: dict[tuple, int] = field(default_factory=dict)  # measurements per key
    steps: dict[int, int] = field(default_factory=dict)  # batch -> steps observed
    last_plain: dict[int, int] = field(default_factory=dict)  # batch -> step of the last k = 0
    last_draft: dict[int, int] = field(default_factory=dict)  # batch -> step of the last draft
    # a draft pass whose step verified nothing (every row chose k = 0) was wasted: the next
    # drafts wait `backoff` steps, doubling while they keep being wasted (up to `refresh`)
    backoff: dict[int, int] = field(default_factory=dict)  # batch -> steps to wait
    quiet_until: dict[int, int] = field(default_factory=dict)  # batch -> last step not drafting
    # probes (drafts whose rows follow their heads alone): batch -> steps between probes, which
    # doubles while probes lose against a plain step (up to refresh * max_probe_wait)
    max_probe_wait: int = 16
    probe_wait: dict[int, int] = field(default_factory=dict)
    probe_step: dict[int, int] = field(default_factory=dict)  # batch -> step of the last probe
    step_s: dict[int, float] = field(default_factory=dict)  # batch -> last step's raw seconds
    draft_raw_s: dict[int, float] = field(default_factory=dict)  # batch -> last draft's seconds

    def __post_init__(self) -> None:
        if not isinstance(self.max_draft, int) or self.max_draft < 0:
            raise ValueError(f"max_draft must be a whole number >= 0, got {self.max_draft!r}.")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {self.alpha!r}.")
        if not isinstance(self.refresh, int) or self.refresh < 1:
            raise ValueError(f"refresh must be a whole number >= 1, got {self.refresh!r}.")
        if not isinstance(self.max_probe_wait, int) or self.max_probe_wait < 1:
            raise ValueError(f"max_probe_wait must be a whole number >= 1, got "
                             f"{self.max_probe_wait!r}.")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a whole number >= 0, got {self.warmup!r}.")
        if not self.min_gain >= 1.0 or math.isinf(self.min_gain):
            raise ValueError(f"min_gain must be a finite factor >= 1, got {self.min_gain!r}.")
        if self.floor not in (0, 1) or self.floor > self.max_draft:
            raise ValueError(f"floor must be 0 or 1 (and at most max_draft), got "
                             f"{self.floor!r}.")

    def _avg(self, table: dict, key, seconds: float, name: str) -> None:
        """The moving average, after the first `warmup` measurements of the key."""
        if not seconds >= 0.0:
            raise ValueError(f"A measured time must be >= 0 seconds, got {seconds!r}.")
        n = self.samples.get((name, key), 0)
        self.samples[(name, key)] = n + 1
        if n < self.warmup:
            return
        old = table.get(key)
        table[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        """A step of k drafts took `seconds` at this batch size, the draft pass not included
        (k = 0: a plain decode step); one call per step."""
        if not 0 <= k <= self.max_draft:
            raise ValueError(f"k must lie in 0..{self.max_draft}, got {k}.")
        self._avg(self.verify_s, (batch, k), seconds, "verify")
        self.step_s[batch] = seconds
        step = self.steps.get(batch, 0) + 1
        self.steps[batch] = step
        if k == 0:
            self.last_plain[batch] = step
        if self.last_draft.get(batch) == step:  # this step drafted
            if k == 0:  # for nothing: wait before the next draft, longer each time in a row
                wait = min(max(1, 2 * self.backoff.get(batch, 0)), self.refresh)
                self.backoff[batch] = wait
                self.quiet_until[batch] = step + wait
            else:
                self.backoff[batch] = 0

    def observe_draft(self, batch: int, seconds: float,
                      acceptance: Sequence[float] | None = None) -> None:
        """A draft pass took `seconds` at this batch size (before the step's `observe_verify`);
        `acceptance`: what its confidence head said (`acceptance_probs`)."""
        self._avg(self.draft_s, batch, seconds, "draft")
        self.draft_raw_s[batch] = seconds
        self.last_draft[batch] = self.steps.get(batch, 0) + 1
        if acceptance is not None:
            c = self.confidence.setdefault(batch, [1.0] * self.max_draft)
            for i, a in enumerate(acceptance[:self.max_draft]):
                if not 0.0 <= a <= 1.0:
                    raise ValueError(f"Acceptance probabilities lie in [0, 1], got {a}.")
                c[i] = (1 - self.alpha) * c[i] + self.alpha * a

    def observe_accepted(self, batch: int, k: int, accepted: int) -> None:
        """A row of a verify had k of its draft tokens judged and kept `accepted` of them:
        positions 1..accepted were accepted, position accepted+1 (if <= k) rejected (positions
        after it, or cut by the turn's end, say nothing)."""
        if not 0 <= accepted <= k <= self.max_draft:
            raise ValueError(f"accepted must lie in 0..k and k in 0..{self.max_draft}, got "
                             f"{accepted} of {k}.")
        a = self.accepted.setdefault(batch, [1.0] * self.max_draft)
        for i in range(min(accepted + 1, k)):
            a[i] = (1 - self.alpha) * a[i] + self.alpha * (1.0 if i < accepted else 0.0)

    def observe_tokens(self, batch: int, tokens: int) -> None:
        """The step just observed (`observe_verify`) produced `tokens` over its rows. After a
        probe: fewer tokens per second (the draft pass included) than a plain step doubles
        the wait before the next probe, more resets it."""
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a whole number >= 0, got {tokens!r}.")
        step = self.steps.get(batch, 0)
        if self.probe_step.get(batch) != step or self.last_draft.get(batch) != step:
            return
        plain = self.verify_s.get((batch, 0))
        seconds = self.step_s.get(batch, 0.0) + self.draft_raw_s.get(batch, 0.0)
        if plain is None or seconds <= 0.0:
            return
        wait = self.probe_wait.get(batch, self.refresh)
        if tokens / seconds < batch / plain:
            self.probe_wait[batch] = min(2 * wait, self.refresh * self.max_probe_wait)
        else:
            self.probe_wait[batch] = self.refresh

    def _probing(self, batch: int) -> bool:
        """Whether the step about to run at this batch size drafted as a probe."""
        return self.probe_step.get(batch) == self.steps.get(batch, 0) + 1

    def _probe_cap(self, batch: int, cap: int | None) -> int | None:
        """At a probe, at most one k beyond the largest measured at this batch size (an
        unmeasured k counts as cheap as the largest measured one below it: trying every k at
        once would verify batch x (1 + k) rows for each); elsewhere `cap` as given."""
        if not self._probing(batch):
            return cap
        known = max([k for b, k in self.verify_s if b == batch] + [0])
        return known + 1 if cap is None else min(cap, known + 1)

    def _likely(self, batch: int, scores: Sequence[float]) -> list[float]:
        """Per position the lower of `scores` and the fraction kept so far (1 where unknown);
        at a probe the scores alone."""
        if self._probing(batch):
            return list(scores)
        kept = self.accepted.get(batch, [1.0] * self.max_draft)
        return [min(a, c) for a, c in zip(scores, kept, strict=False)]

    def cost(self, batch: int, k: int) -> float | None:
        """Seconds of a step with k drafts (draft pass included), None if nothing is known. An
        unmeasured k costs at least the largest measured one below it at this batch size, and
        at least this batch size's plain step times the verify-to-plain ratio of k at the
        nearest batch size that measured both (`_scaled`): a first probe at batch 8 then does
        not verify 8 rows of drafts a head scores at 0.3 on the cost of a plain step."""
        known = [j for j in range(k, -1, -1) if (batch, j) in self.verify_s]
        if not known:
            return None
        verify = self.verify_s[(batch, known[0])]
        if k == 0:
            return verify if known[0] == 0 else None
        if known[0] != k:
            verify = max(verify, self._scaled(batch, k) or 0.0)
        draft = self.draft_s.get(batch, 0.0)
        return verify + draft

    def _scaled(self, batch: int, k: int) -> float | None:
        """This batch size's plain step times the ratio of a step of k drafts to a plain one at
        the nearest other batch size that measured both (None without one)."""
        plain = self.verify_s.get((batch, 0))
        others = [b for b, j in self.verify_s
                  if j == k and b != batch and self.verify_s.get((b, 0), 0.0) > 0.0]
        if plain is None or not others:
            return None
        near = min(others, key=lambda b: (abs(b - batch), b))
        return plain * self.verify_s[(near, k)] / self.verify_s[(near, 0)]

    def rate(self, batch: int, k: int, acceptance: Sequence[float]) -> float | None:
        """Predicted tokens per second with k drafts."""
        c = self.cost(batch, k)
        if c is None:
            return None
        return expected_tokens(acceptance, k) / max(c, 1e-12)

    def _best(self, batch: int, acceptance: Sequence[float], cap: int | None = None,
              floor: int = 0) -> int:
        """The k in floor..top (top: max_draft, the scores, `cap`) with the most predicted
        tokens per second, a k > 0 over k = 0 only by `min_gain` (an unknown rate never wins;
        floor when none is known)."""
        top = min(self.max_draft, len(acceptance), self.max_draft if cap is None else cap)
        best = min(floor, max(top, 0))
        best_rate = self.rate(batch, best, acceptance)
        for k in range(best + 1, top + 1):
            r = self.rate(batch, k, acceptance)
            bar = best_rate if best_rate is None or best else best_rate * self.min_gain
            if r is not None and (bar is None or r > bar):
                best, best_rate = k, r
        return best

    def worth_drafting(self, batch: int) -> bool:
        """Whether to draft at this step: not before a plain step is measured, and not when a
        plain step is due (its cost is re-measured every `refresh` steps, so the baseline
        follows the context); else when some k > 0 beats a plain step at the acceptance
        so far (per position the lower of the measured acceptance and the confidence head's
        average: drafting pays only if `choose` will verify and the drafts are kept; 1 where
        nothing is known yet), and every `refresh` steps regardless (both re-measured). A draft
        that every row declined (k = 0) costs a draft pass for nothing: the next draft then
        waits 1, 2, 4, ... steps (up to `refresh`) while that repeats. A draft drawn only by
        the last rule is a probe (`probe_wait` steps apart, `observe_tokens`)."""
        if self.floor:
            return True
        if self.max_draft == 0 or self.cost(batch, 0) is None:
            return False
        step = self.steps.get(batch, 0) + 1  # the step about to run
        if step - self.last_plain.get(batch, 0) > self.refresh:
            return False
        if step <= self.quiet_until.get(batch, 0):  # the last drafts were wasted
            return False
        sure = [1.0] * self.max_draft
        likely = [min(a, c) for a, c in zip(self.accepted.get(batch, sure),
                                            self.confidence.get(batch, sure), strict=True)]
        if self._best(batch, likely) > 0:
            return True
        if step - self.last_draft.get(batch, 0) > self.probe_wait.get(batch, self.refresh):
            self.probe_step[batch] = step
            return True
        return False

    def choose(self, batch: int, acceptance: Sequence[float]) -> int:
        """The k in floor..min(max_draft, len(acceptance)) with the most predicted tokens/s."""
        if self.cost(batch, 0) is None and not self.floor:
            return 0  # measure a plain step first
        return self._best(batch, self._likely(batch, acceptance),
                          self._probe_cap(batch, None), self.floor)

    def choose_rows(self, batch: int, acceptances: Sequence[Sequence[float]],
                    caps: Sequence[int]) -> list[int]:
        """A k per row of a batch: `choose` on the row's own scores (`acceptance_probs` of
        its confidence head, capped by the kept fraction outside a probe), within `caps` (the
        drafts its turn can still use: what it has left to produce, less the bonus token)."""
        if len(acceptances) != len(caps) or len(caps) != batch:
            raise ValueError(f"choose_rows takes scores and a cap for each of the {batch} "
                             f"rows, got {len(acceptances)} and {len(caps)}.")
        if self.cost(batch, 0) is None and not self.floor:
            return [0] * batch  # measure a plain step first
        return [self._best(batch, self._likely(batch, a), self._probe_cap(batch, max(c, 0)),
                           self.floor)
                for a, c in zip(acceptances, caps, strict=True)]


class FixedLength(SpecPolicy):
    """Drafts at every step and verifies k drafts, whatever the measured costs say (for
    measuring acceptance, and for tests that need speculation at every step)."""

    def __init__(self, k: int):
        super().__init__(k)
        self.k = k

    def worth_drafting(self, batch: int) -> bool:
        return True

    def choose(self, batch: int, acceptance) -> int:
        return self.k

    def choose_rows(self, batch: int, acceptances, caps) -> list[int]:
        return [max(0, min(self.k, c)) for c in caps]
