"""Choosing the next token from logits, and stopping on text.

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, stop=("\\n\\n",)).validate(vocab)
    sampler = Sampler(params)
    tok = sampler.sample(logits, generated=out_ids, prompt=prompt_ids)  # one row of fp32 logits
    matcher = StopMatcher(params.stop)
    r = matcher.feed(text_delta)  # r.text to emit, r.stopped

The order of the logit processing is the one vLLM and HF apply: penalties on the raw logits
(repetition over prompt and output, HF/CTRL rule: a seen token's positive logit divided by the
penalty, a negative one multiplied; presence and frequency over the output, OpenAI rule:
`l -= presence * [count > 0] + frequency * count`), then temperature, then top-k, min-p (a token
below `min_p` times the top probability is dropped) and top-p (the smallest set of most likely
tokens whose mass reaches `top_p`), then one draw. Temperature 0 is greedy: the argmax of the
penalised logits, the lowest id on an exact tie. Logprobs are those of the model's own
distribution (log-softmax of the logits as given), so they do not move with the sampling knobs.
Every knob has a range that keeps this arithmetic finite (`SamplingParams.validate`); logits
holding NaN or +inf, or a distribution that comes out non-finite all the same, are a
`SamplingError` (the request fails alone), never a token.

A request may carry a `LogitsConstraint` (`SamplingParams.constraint`): after the penalties, the
tokens it does not allow in the request's current state are set to -inf, before temperature and
the truncations (vLLM's and SGLang's order for grammar masks). Its states are values, derived from
the request's own output ids (`Sampler` keeps one per output token), so a speculative step's
unread tokens roll it back for free and one constraint object can serve many requests.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dsv41.runtime.engine.speculative import accept_draft_token

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_STOP_STRINGS = 16
# repetition_penalty's range: a seen logit is divided (positive) or multiplied (negative) by it,
# so a bounded factor keeps every float32 logit finite after it (and the ratio between two
# tokens' odds within 100x either way of 1; vLLM and HF only ask for > 0, which lets 5e-324
# turn a logit into inf and the distribution into NaN)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A real number that compares exactly: any int (never converted to a float, so 10**400
    is simply out of every range), or a finite float."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, int) or math.isfinite(v)


@runtime_checkable
class LogitsConstraint(Protocol):
    """Which tokens may come next, as a function of a state that the sampled tokens advance.

    States are immutable values; `allowed` may memoise on them. A state from which no token is
    allowed (`allowed` all False) is a dead end: the request fails alone (`ConstraintError`)."""

    vocab_size: int  # the mask's length: ids at or past it are never allowed

    def start(self) -> Hashable:
        """The state before the first output token."""

    def allowed(self, state: Hashable) -> torch.Tensor:
        """A bool mask (vocab_size,): True for the tokens allowed in `state`."""

    def advance(self, state: Hashable, token: int) -> Hashable | None:
        """The state after `token`; None when `token` is not allowed in `state`."""


class ConstraintError(ValueError):
    """A request's constraint allows no token (or was handed one it does not allow)."""


class SamplingError(ValueError):
    """A request's logits or sampling distribution are not finite: nothing can be sampled (the
    request fails alone)."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. `validate` is the single check; its messages are full
    sentences a server can return as 400s."""

    temperature: float = 1.0  # 0 = greedy; at most 2 (OpenAI's range)
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off, else keep the k most likely
    min_p: float = 0.0  # [0, 1]; 0 = off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # [0.01, 100] (REPETITION_PENALTY_RANGE); 1 = off
    seed: int | None = None  # None: a fresh seed per Sampler
    max_tokens: int | None = None  # None: until a stop or the context limit
    stop: tuple[str, ...] = ()  # matched on the text, across token boundaries
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS is a stop unless this is set
    logprobs: int | None = None  # None: none; N: the sampled token's and the top N (0..20)
    # the tokens allowed next (tool_choice's DSML grammar); None: any token
    constraint: LogitsConstraint | None = None

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """This object, or a ValueError naming the first bad field."""
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be a number from 0 to 2, not {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number above 0 and at most 1, not {self.top_p!r}.")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0 (0 turns it off), "
                             f"not {self.top_k!r}.")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number from 0 to 1, not {self.min_p!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number from -2 to 2, not {v!r}.")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be a number from {lo:g} to {hi:g} (1 "
                             f"turns it off), not {self.repetition_penalty!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a whole number from 0 to 2**63 - 1, "
                             f"not {self.seed!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a whole number >= 1, not {self.max_tokens!r}.")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a tuple of strings, not {self.stop!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, "
                             f"not {len(self.stop)}.")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (whole numbers >= 0), "
                             f"not {self.stop_token_ids!r}.")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids holds {bad[0]}, outside the model's "
                                 f"{vocab_size} token ids.")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, not {self.ignore_eos!r}.")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be a whole number from 0 to {MAX_LOGPROBS}, "
                             f"not {self.logprobs!r}.")
        if self.constraint is not None:
            c = self.constraint
            if not isinstance(c, LogitsConstraint) or not _is_int(getattr(c, "vocab_size", None)):
                raise ValueError(f"constraint must be a LogitsConstraint (vocab_size, start, "
                                 f"allowed, advance), not {type(c).__name__}.")
            if vocab_size is not None and c.vocab_size > vocab_size:
                raise ValueError(f"The constraint's {c.vocab_size} token ids do not fit the "
                                 f"model's {vocab_size}.")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_id: int) -> frozenset[int]:
        """The ids that end generation: `stop_token_ids`, and EOS unless `ignore_eos`."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.add(eos_id)
        return frozenset(ids)


MAX_SAMPLES = 16  # the most samples of one prompt (`n`, `best_of`) a request may ask for


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded `seed` (n samples of one prompt): sample 0
    keeps the request's own seed (so it draws what the same request with n = 1 draws), each
    other sample a seed derived from (seed, index) by BLAKE2b, deterministic and in SamplingParams'
    range. None stays None: every sample's Sampler then draws a fresh seed of its own."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"dsv41-sample:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest) >> 1


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, under the model's distribution


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # the chosen token's; None unless params.logprobs is set
    top: tuple[TokenLogprob, ...]  # the `params.logprobs` most likely, most likely first


def _ids(ids, v: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= v):
        raise ValueError(f"The {name} ids must lie in 0..{v - 1}, the logits' vocabulary.")
    return t


def check_logits(logits: torch.Tensor, what: str = "The model's logits") -> None:
    """SamplingError unless one row of logits can be sampled from: no NaN, no +inf (either
    makes the distribution NaN, and argmax would pick it), and at least one finite value (-inf
    is a token that cannot come)."""
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        raise SamplingError(f"{what} hold NaN or +inf values: no token can be sampled from "
                            f"them.")
    if not bool(torch.isfinite(logits).any()):
        raise SamplingError(f"{what} have no finite value to sample from.")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                    prompt: Sequence[int] = ()) -> torch.Tensor:
    """Penalised float64 logits (see the module docstring); a new tensor. The ids are only read
    by the penalties that are on (a long prompt costs nothing without a repetition penalty)."""
    out = logits.to(torch.float64).clone()
    v = out.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(v, dtype=torch.bool)
        seen[_ids(prompt, v, "prompt")] = True
        seen[_ids(generated, v, "generated")] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.bincount(_ids(generated, v, "generated"), minlength=v).to(torch.float64)
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return out


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float64 distribution one draw is made from, after temperature and the truncations;
    `logits` already penalised, params not greedy. The logits are shifted to a maximum of 0
    before the temperature divides them, so any temperature above 0 gives finite values (a
    tiny one makes it the argmax, not inf / inf); SamplingError if the distribution is not
    finite all the same (logits holding NaN or +inf)."""
    scaled = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = torch.where(scaled >= kth, scaled, -math.inf)  # ties at the k-th are kept
    probs = torch.softmax(scaled, dim=0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < params.top_p * sorted_p.sum()  # the first token is always kept
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, 0.0)
    total = probs.sum()
    if not bool(torch.isfinite(probs).all()) or not total > 0:
        raise SamplingError("The request's sampling distribution came out non-finite (NaN or "
                            "inf probabilities): no token can be drawn from it.")
    return probs / total


class Sampler:
    """One request's sampler: its own generator, so a seeded request draws the same tokens
    whatever else shares the batch."""

    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8)) >> 1
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        c = params.constraint
        # states[i]: the constraint's state after the first i output tokens (fed[:i])
        self._states = [] if c is None else [c.start()]
        self._fed: list[int] = []

    def constraint_state(self, generated: Sequence[int]) -> Hashable:
        """The constraint's state after `generated` (the request's output so far): the states
        past it are forgotten (tokens a speculative step did not keep), the missing ones
        advanced over."""
        c, n = self.params.constraint, len(generated)
        keep = 0
        while keep < min(n, len(self._fed)) and self._fed[keep] == generated[keep]:
            keep += 1
        del self._fed[keep:], self._states[keep + 1:]
        for tok in generated[keep:]:
            nxt = c.advance(self._states[-1], int(tok))
            if nxt is None:
                raise ConstraintError(f"The output token {int(tok)} is not allowed by the "
                                      f"request's constraint.")
            self._states.append(nxt)
            self._fed.append(int(tok))
        return self._states[n]

    def _masked(self, penalised: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """`penalised` with the tokens the constraint does not allow now set to -inf."""
        c = self.params.constraint
        if c is None:
            return penalised
        mask = c.allowed(self.constraint_state(generated))
        v = penalised.shape[0]
        assert mask.dtype == torch.bool and mask.shape == (c.vocab_size,), \
            f"a constraint's mask must be bool ({c.vocab_size},), not {mask.dtype} {mask.shape}"
        ok = torch.zeros(v, dtype=torch.bool)
        ok[:min(v, c.vocab_size)] = mask[:v]
        ok &= torch.isfinite(penalised)
        if not ok.any():
            raise ConstraintError("The request's constraint allows no token here (its grammar "
                                  "cannot go on with this tokenizer's tokens).")
        return penalised.masked_fill(~ok, -math.inf)

    def sample(self, logits: torch.Tensor, generated: Sequence[int] = (),
               prompt: Sequence[int] = ()) -> SampledToken:
        """The next token from one row of logits (fp32 [vocab], any device); `generated`: this
        request's output ids so far, `prompt`: its prompt ids (repetition penalty only)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.numel() == 0:
            raise ValueError("Sampler.sample takes one row of logits, a non-empty 1-D tensor.")
        raw, penalised = self._prepared(logits, generated, prompt)
        if self.params.greedy:
            token = int(torch.argmax(penalised))  # the first maximum: lowest id on a tie
        else:
            probs = sampling_probs(penalised, self.params)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        return self._result(raw, token)

    def sample_draft(self, logits: torch.Tensor, draft_token: int, generated: Sequence[int] = (),
                     prompt: Sequence[int] = ()) -> tuple[SampledToken, bool]:
        """The token at a verified draft position: greedy keeps the draft token iff it is the
        argmax (the token is the argmax either way); otherwise the speculative rejection rule
        against DSpark's greedy draft (runtime/speculative.py), so the token is distributed as
        `sample` would draw it. Returns (token, whether it is the draft token)."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or logits.numel() == 0:
            raise ValueError("Sampler.sample_draft takes one row of logits, a non-empty 1-D "
                             "tensor.")
        raw, penalised = self._prepared(logits, generated, prompt)
        if self.params.greedy:
            token = int(torch.argmax(penalised))
            return self._result(raw, token), token == draft_token
        got = accept_draft_token(sampling_probs(penalised, self.params), draft_token,
                                 generator=self.generator)
        return self._result(raw, got.token), got.accepted

    def _prepared(self, logits: torch.Tensor, generated: Sequence[int],
                  prompt: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw fp32 logits on the host, penalised float64 logits, the constraint's mask
        applied)."""
        v = logits.shape[0]
        _ids(generated, v, "generated")  # O(output) per step, in torch
        raw = logits.detach().to("cpu", torch.float32)
        check_logits(raw)
        penalised = apply_penalties(raw, self.params, generated, prompt)
        check_logits(penalised, "The penalised logits")
        return raw, self._masked(penalised, generated)

    def _result(self, raw: torch.Tensor, token: int) -> SampledToken:
        p = self.params
        if p.logprobs is None:
            return SampledToken(token, None, ())
        logp = torch.log_softmax(raw.to(torch.float64), dim=0)
        top = ()
        if p.logprobs:
            vals, ids = torch.topk(logp, min(p.logprobs, raw.shape[0]))
            top = tuple(TokenLogprob(int(i), float(x)) for x, i in zip(vals, ids, strict=True))
        return SampledToken(token, float(logp[token]), top)


@dataclass(frozen=True)
class StopCheck:
    text: str  # the text that may be emitted now
    stopped: bool  # a stop string matched: emit `text`, then end the request
    stop: str | None  # the stop string that matched


class StopMatcher:
    """Stop strings matched on the generated text as it streams, across token boundaries. Text
    that could still be the start of a stop string is held back until it is decided; the stop
    string itself is never emitted (OpenAI's behaviour)."""

    def __init__(self, stops: Sequence[str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings.")
        self.stops = tuple(stops)
        self._held = ""
        self.done = False

    def feed(self, delta: str) -> StopCheck:
        if self.done:
            raise ValueError("StopMatcher.feed after a stop string matched.")
        text = self._held + delta
        # the stop string completed first (its first occurrence ends earliest), the longest of
        # those ending there: what a stream cut anywhere sees first, so the answer never depends
        # on how the text arrived ("b" inside "aba": "ab" | "a" and "aba" both stop at "b")
        hits = [(text.find(s) + len(s), -len(s), s) for s in self.stops if s in text]
        if hits:
            end, neg, stop = min(hits)
            self._held = ""
            self.done = True
            return StopCheck(text[:end + neg], True, stop)
        hold = 0
        for s in self.stops:  # the longest tail of the text that begins some stop string
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if s.startswith(text[-n:]):
                    hold = n
                    break
        self._held = text[len(text) - hold:]
        return StopCheck(text[:len(text) - hold], False, None)

    def flush(self) -> str:
        """At the end without a stop string (EOS, a stop id, max_tokens): the held-back text."""
        out, self._held = self._held, ""
        return out
