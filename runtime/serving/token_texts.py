"""Token texts and character-automaton logits constraints: each token id's text (`TokenTexts`,
built once per tokenizer), a `CharConstraint` that masks the tokens whose characters an automaton
does not step through, and `AvoidText` (any reply that never spells one text: tool_choice `none`'s
constraint, and the reasoning under a grammar that must not spell `</think>` in pieces)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property

import torch

from dsv41.runtime.serving.release_format import OPEN_CALLS, THINK_CLOSE
from dsv41.runtime.serving.tokenizer import Tokenizer

MAX_MEMO = 4096  # masks kept per constraint object


# ---- the token texts ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TokenTexts:
    """Each token id's text (`decode([id])`, special tokens spelled), for the constraints; built
    once per tokenizer (a few seconds on the released 129,280 ids)."""

    texts: tuple[str, ...]
    eos: int
    banned: frozenset[int]  # special tokens other than EOS: never allowed under a constraint

    @classmethod
    def of(cls, tok: Tokenizer) -> TokenTexts:
        texts = tuple(tok.decode([i], skip_special=False) for i in range(tok.n_ids))
        eos = tok.special.eos
        return cls(
            texts, eos, frozenset(i for i in range(tok.n_ids) if tok.is_special(i) and i != eos)
        )

    @property
    def vocab_size(self) -> int:
        return len(self.texts)

    @cached_property
    def avoid_calls(self) -> AvoidText:
        """tool_choice none's constraint, one per vocabulary (so its masks are shared)."""
        return AvoidText(self, OPEN_CALLS.rstrip("\n"))

    @cached_property
    def avoid_think_close(self) -> AvoidText:
        """Reasoning under response_format: `</think>` never spelled by smaller tokens (the
        structured constraint allows its own token), one per vocabulary."""
        return AvoidText(self, THINK_CLOSE)


class CharConstraint:
    """A LogitsConstraint from a character automaton: `step(state, ch) -> state | None`,
    `final(state)` (EOS allowed; a final state takes no character). Masks memoised per state;
    tokens grouped by first character so a state that takes few characters checks few tokens."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.vocab_size = texts.vocab_size
        self._memo: dict[Hashable, torch.Tensor] = {}
        by_first: dict[str, list[int]] = {}
        for i, s in enumerate(texts.texts):
            if s and i not in texts.banned and i != texts.eos:
                by_first.setdefault(s[0], []).append(i)
        self._by_first = by_first

    def step(self, state, ch: str):
        raise NotImplementedError

    def final(self, state) -> bool:
        raise NotImplementedError

    def walk(self, state, text: str):
        for ch in text:
            state = self.step(state, ch)
            if state is None:
                return None
        return state

    def advance(self, state, token: int):
        if token == self.texts.eos:
            return ("eos",) if self.final(state) else None
        if (
            not 0 <= token < self.vocab_size
            or token in self.texts.banned
            or not self.texts.texts[token]
        ):
            return None
        return self.walk(state, self.texts.texts[token])

    def allowed(self, state) -> torch.Tensor:
        mask = self._memo.get(state)
        if mask is not None:
            return mask
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if state != ("eos",):
            if self.final(state):
                mask[self.texts.eos] = True
            for first, ids in self._by_first.items():
                after = self.step(state, first)
                if after is None:
                    continue
                for i in ids:
                    if self.walk(after, self.texts.texts[i][1:]) is not None:
                        mask[i] = True
        if len(self._memo) < MAX_MEMO:
            self._memo[state] = mask
        return mask


class AvoidText(CharConstraint):
    """Any reply that never spells `text` (tool_choice none: the DSML block's opening tag).
    State: how much of `text` the output's end matches."""

    def __init__(self, texts: TokenTexts, text: str):
        assert text and text[0] not in text[1:], "AvoidText's naive restart needs a unique start"
        super().__init__(texts)
        self.text = text

    def start(self):
        return 0

    def step(self, k: int, ch: str):
        if ch == self.text[k]:
            return None if k + 1 == len(self.text) else k + 1
        return 1 if ch == self.text[0] else 0

    def final(self, k) -> bool:
        return True
