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
the measured seconds of a draft plus a verify of k at the current batch size (moving averages
per (batch, k), kept up to date from the engine's own timings). A k never measured counts as
costing what the largest measured smaller k costs (optimistic, so it is tried once and then
known); before anything is measured the policy picks 0.
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


@dataclass
class SpecPolicy:
    """Verify-length choice from the confidence head and measured costs (see the module
    docstring). `observe` records a step's seconds; `choose` picks k."""

    max_draft: int
    alpha: float = 0.2  # weight of a new measurement in the moving average
    verify_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch, k) -> s
    draft_s: dict[int, float] = field(default_factory=dict)  # batch -> s

    def __post_init__(self) -> None:
        if not isinstance(self.max_draft, int) or self.max_draft < 0:
            raise ValueError(f"max_draft must be a whole number >= 0, got {self.max_draft!r}.")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in (0, 1], got {self.alpha!r}.")

    @staticmethod
    def _avg(table: dict, key, seconds: float, alpha: float) -> None:
        if not seconds >= 0.0:
            raise ValueError(f"A measured time must be >= 0 seconds, got {seconds!r}.")
        old = table.get(key)
        table[key] = seconds if old is None else (1 - alpha) * old + alpha * seconds

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        """A verify of k drafts (k = 0: a decode step) took `seconds` at this batch size."""
        self._avg(self.verify_s, (batch, k), seconds, self.alpha)

    def observe_draft(self, batch: int, seconds: float) -> None:
        self._avg(self.draft_s, batch, seconds, self.alpha)

    def cost(self, batch: int, k: int) -> float | None:
        """Seconds of a step with k drafts (draft pass included), None if nothing is known."""
        known = [j for j in range(k, -1, -1) if (batch, j) in self.verify_s]
        if not known:
            return None
        verify = self.verify_s[(batch, known[0])]
        if k == 0:
            return verify if known[0] == 0 else None
        draft = self.draft_s.get(batch, 0.0)
        return verify + draft

    def rate(self, batch: int, k: int, acceptance: Sequence[float]) -> float | None:
        """Predicted tokens per second with k drafts."""
        c = self.cost(batch, k)
        if c is None:
            return None
        return expected_tokens(acceptance, k) / max(c, 1e-12)

    def worth_drafting(self, batch: int) -> bool:
        """Whether some k > 0 could beat a plain step even if every draft token were accepted
        (else the draft pass itself is skipped)."""
        if self.max_draft == 0 or self.cost(batch, 0) is None:
            return False
        sure = [1.0] * self.max_draft
        base = self.rate(batch, 0, sure)
        return any((r := self.rate(batch, k, sure)) is not None and r > base
                   for k in range(1, self.max_draft + 1))

    def choose(self, batch: int, acceptance: Sequence[float]) -> int:
        """The k in 0..min(max_draft, len(acceptance)) with the most predicted tokens/s."""
        if self.cost(batch, 0) is None:
            return 0  # measure a plain step first
        best, best_rate = 0, self.rate(batch, 0, acceptance)
        for k in range(1, min(self.max_draft, len(acceptance)) + 1):
            r = self.rate(batch, k, acceptance)
            if r is not None and r > best_rate:
                best, best_rate = k, r
        return best
