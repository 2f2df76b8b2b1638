"""Every public argument of a turn, checked in one place before any work is done.

`check_turn` turns the arguments of `Session.send` (or one `send_many` request) into a
`TurnRequest` or raises `RequestError`, whose message is a full sentence a server returns as a
400 as it is. Nothing here touches a cache, a tier or the model: a refused request has changed
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np

from dsv41.graph.config import EOS_ID
from dsv41.runtime.engine.sampling import SamplingParams

SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes [0, 2**64)
TURN_OPTIONS = ("max_new_tokens", "stop", "temperature", "seed", "keep_logits", "sampling")


class RequestError(ValueError):
    """A request argument is invalid (a client error: the message is the 400's body)."""


@dataclass(frozen=True)
class TurnRequest:
    token_ids: tuple[int, ...]  # the new tokens, each in [0, vocab_size)
    max_new_tokens: int  # >= 0 (0: prefill only, nothing sampled)
    stop: frozenset[int]
    temperature: float  # finite, >= 0 (0: greedy)
    seed: int | None  # None or in [0, 2**64)
    keep_logits: bool
    # the full sampler (runtime/sampling.py) instead of temperature / seed; None: those
    sampling: SamplingParams | None = None


@dataclass(frozen=True)
class TurnLimits:
    vocab_size: int
    max_seq_len: int
    cached: int  # positions the session holds before this turn, its pending token included


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def check_token_ids(token_ids, *, vocab_size: int, what: str = "send()") -> tuple[int, ...]:
    """A non-empty 1-D sequence of integer ids, each in [0, vocab_size)."""
    if isinstance(token_ids, str | bytes | Mapping):
        raise RequestError(f"{what} takes a non-empty 1-D sequence of integer token ids, got "
                           f"{type(token_ids).__name__}.")
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as e:
        raise RequestError(f"{what} takes a non-empty 1-D sequence of integer token ids "
                           f"({e}).") from e
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"{what} takes a non-empty 1-D sequence of integer token ids.")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise RequestError(f"Token ids must lie in [0, {vocab_size}); got {lo}..{hi}.")
    return tuple(int(x) for x in ids)


def check_options(options) -> dict:
    """The keyword options of one request: a mapping with only known names."""
    if not isinstance(options, Mapping):
        raise RequestError(f"A request's options must be a mapping of {', '.join(TURN_OPTIONS)}"
                           f", got {type(options).__name__}.")
    unknown = sorted(str(k) for k in options if k not in TURN_OPTIONS)
    if unknown:
        raise RequestError(f"Unknown request option(s) {', '.join(unknown)}; known: "
                           f"{', '.join(TURN_OPTIONS)}.")
    return dict(options)


def check_sampling(sampling, *, vocab_size: int, temperature, seed) -> SamplingParams | None:
    """`sampling` validated (`SamplingParams.validate`), and not given together with the plain
    temperature / seed options it replaces."""
    if sampling is None:
        return None
    if not isinstance(sampling, SamplingParams):
        raise RequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}.")
    try:
        sampling.validate(vocab_size)
    except ValueError as e:
        raise RequestError(str(e)) from e
    if temperature != 0.0 or seed is not None:
        raise RequestError("Give temperature and seed inside sampling (SamplingParams), not "
                           "as separate options as well.")
    if sampling.stop:
        raise RequestError("Stop strings are matched on text: the engine's turn takes stop "
                           "ids only; runtime.batcher.Batcher with a tokenizer matches them.")
    return sampling


def check_turn(token_ids, limits: TurnLimits, *, max_new_tokens=256, stop=(),
               temperature=0.0, seed=None, keep_logits=False, sampling=None) -> TurnRequest:
    """Every argument of a turn, or RequestError naming the first bad one. With `sampling`,
    its `max_tokens` (when set) replaces `max_new_tokens`, and its stop ids (EOS unless
    `ignore_eos`) join `stop`."""
    ids = check_token_ids(token_ids, vocab_size=limits.vocab_size)
    params = check_sampling(sampling, vocab_size=limits.vocab_size, temperature=temperature,
                            seed=seed)
    if params is not None and params.max_tokens is not None:
        max_new_tokens = params.max_tokens
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}.")
    max_new = int(max_new_tokens)
    if isinstance(temperature, bool | np.bool_) or not isinstance(temperature, int | float |
                                                                  np.integer | np.floating):
        raise RequestError(f"temperature must be a number, got {temperature!r}.")
    if not math.isfinite(float(temperature)) or temperature < 0:
        raise RequestError(f"temperature must be finite and >= 0, got {temperature!r}.")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise RequestError(f"seed must be None or an integer in [0, 2**64), got {seed!r}.")
    if isinstance(stop, str | bytes) or not isinstance(stop, Sequence | Set | np.ndarray):
        raise RequestError(f"stop must be a sequence of token ids, got {stop!r}.")
    stop_ids = list(stop.tolist() if isinstance(stop, np.ndarray) else stop)
    bad = [s for s in stop_ids if not _is_int(s) or not 0 <= s < limits.vocab_size]
    if bad:
        raise RequestError(f"stop ids must be integers in [0, {limits.vocab_size}), got "
                           f"{bad[0]!r}.")
    if not isinstance(keep_logits, bool | np.bool_):
        raise RequestError(f"keep_logits must be True or False, got {keep_logits!r}.")
    total = limits.cached + len(ids) + max_new
    if total > limits.max_seq_len:
        raise RequestError(f"The turn would reach {total} positions; the model's max_seq_len "
                           f"is {limits.max_seq_len}.")
    stops = frozenset(int(s) for s in stop_ids)
    if params is not None:
        stops |= params.stop_ids(EOS_ID)
    return TurnRequest(ids, max_new, stops, float(temperature),
                       None if seed is None else int(seed), bool(keep_logits), params)


def check_transcript(transcript, *, vocab_size: int, max_seq_len: int) -> tuple[int, ...]:
    """The tokens of a resumed conversation (empty: a new one)."""
    if isinstance(transcript, Sequence | np.ndarray) and len(transcript) == 0:
        return ()
    ids = check_token_ids(transcript, vocab_size=vocab_size, what="session(transcript=)")
    if len(ids) > max_seq_len:
        raise RequestError(f"The transcript holds {len(ids)} tokens; the model's max_seq_len "
                           f"is {max_seq_len}.")
    return ids
