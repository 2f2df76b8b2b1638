"""Prompt ids for a chat or a completion, whatever the tokenizer can spell.

    fmt = prompt_format(tok)                       # CHAT when it has DeepSeek's chat markers
    ids = chat_prompt_ids(tok, messages, ChatOptions())
    ids = completion_prompt_ids(tok, "Hello")      # BOS + the text's ids

A tokenizer with DeepSeek's chat markers (the released vocabulary, the `small` preset's
byte-level BPE, a checkpoint's own tokenizer.json) gets the model's chat format
(`chat_format.encode_chat`). A vocabulary without them (a checkpoint's own, or the conformance
stub `w{k}` / ` W{k}`) makes a chat `PromptFormat.PLAIN`: BOS, then the messages' texts in
order with nothing between them (encoded as ordinary text; an image part without the blank lines
the chat format puts around it). Roles leave no trace there, so tool calls and tool results,
which the format spells with markers, are refused rather than silently dropped.

A prompt's text is measured against the context before it is tokenized whole (`TextBudget`:
tokenizing tens of MB at once takes GBs): it is counted chunk by chunk, stopping as soon as the
count proves it longer than the context. The count is exact for DeepSeek's pre-tokenizer (the
shipped tokenizers' and the release's), whose pieces never straddle a space between two
letters, so cutting there changes no id; a chunk with no such space is bounded by its bytes
over the vocabulary's longest token (each byte-level token covers at most that many).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from dsv41.runtime.serving.chat_format import (
    IMAGE_SLOT,
    MARKERS,
    ChatOptions,
    Message,
    Role,
    encode_chat,
    encode_with_images,
)
from dsv41.runtime.serving.release_format import SegmentKind, render_segments
from dsv41.runtime.serving.tokenizer import Tokenizer

# DeepSeek's pre-tokenizer (the shipped small BPE's, DeepSeek-V4's, the release's): three regex
# splits, then byte-level; none of its pieces holds a space between two letters
_DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}", "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
    "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_WORD_SPACE = re.compile(r"(?<=[^\W\d_]) (?=[^\W\d_])")  # a space between two letters
CHUNK_CHARS = 1 << 15  # text tokenized at once while a prompt is measured


def _splits(tok: Tokenizer) -> tuple[str, ...] | None:
    """The regexes of a tokenizer's split-then-byte-level pre-tokenizer (None: another kind)."""
    if tok.backend.normalizer is not None and json.loads(
            tok.backend.normalizer.__getstate__()).get("normalizers") != []:
        return None
    pre = tok.backend.pre_tokenizer
    spec = json.loads(pre.__getstate__()) if pre is not None else {}
    steps = spec.get("pretokenizers", [])
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("use_regex"):
        return None
    if any(s.get("type") != "Split" or s.get("behavior") != "Isolated" or s.get("invert")
           for s in steps[:-1]):
        return None
    return tuple(s["pattern"].get("Regex", "").replace("\\r", "\r").replace("\\n", "\n")
                 for s in steps[:-1])


@dataclass(frozen=True)
class TextBudget:
    """How many tokens a prompt may have (`max_tokens`), and how a tokenizer's text is
    measured against it: `word_cuts` when cutting at a space between letters changes no id,
    `max_token_bytes` the vocabulary's longest token in bytes (None: not byte-level, no bound
    from bytes)."""

    max_tokens: int
    word_cuts: bool
    max_token_bytes: int | None
    chunk_chars: int = CHUNK_CHARS  # text tokenized at once while it is counted
    # a chunk longer than this (no space between letters to cut it at) is bounded by its
    # bytes over max_token_bytes, not tokenized
    long_chars: int = CHUNK_CHARS

    @classmethod
    def of(cls, tok: Tokenizer, max_seq_len: int) -> TextBudget:
        """The budget of a prompt that leaves one position to generate (built once per app:
        it reads the vocabulary)."""
        splits = _splits(tok)
        longest = None
        if splits is not None:
            longest = max(len(t) for t in tok.backend.get_vocab(with_added_tokens=False))
        return cls(max_seq_len - 1, splits == _DEEPSEEK_SPLITS, longest)

    def count(self, tok: Tokenizer, text: str, *, literal: bool = True) -> int:
        """A lower bound of `text`'s token count, exact up to `max_tokens` + 1 where the
        tokenizer's pieces allow (`word_cuts`), and no larger than the count (so a count over
        `max_tokens` proves the text too long). `literal`: as `encode_text` spells it;
        otherwise as `encode` does (added tokens' spellings are their ids)."""
        if not (self.word_cuts and self.max_token_bytes):
            return 0
        pieces = [text] if literal else tok.split_added_tokens(text)
        n = 0
        for piece in pieces:
            if isinstance(piece, int):
                n += 1
                continue
            for chunk in _chunks(piece, self.chunk_chars):
                if len(chunk) > self.long_chars:  # one piece of many letters: bounded by its bytes
                    n += math.ceil(len(chunk.encode("utf-8", "surrogatepass"))
                                   / self.max_token_bytes)
                else:
                    n += len(tok.encode_text(chunk))
                if n > self.max_tokens:
                    return n
        return n

    def fits(self, chars: int) -> bool:
        """Whether text of `chars` characters fits whatever it holds (a byte-level token covers
        at least one byte, a character at most 4): then it need not be counted."""
        return 4 * chars <= self.max_tokens

    def check(self, n: int, what: str) -> None:
        if n > self.max_tokens:
            raise ValueError(f"{what} is longer than the model's context: it has more than "
                             f"{self.max_tokens} tokens, and the model's max_seq_len is "
                             f"{self.max_tokens + 1} (one position is left to generate).")


def _chunks(text: str, size: int):
    """`text` cut at spaces between letters into chunks of about `size` characters (one is
    longer only where no such space is)."""
    at = 0
    while len(text) - at > size:
        # from one character on at least, so every chunk holds one (a space right at `at`
        # would cut an empty chunk and never move on)
        m = _WORD_SPACE.search(text, at + max(1, size // 2), at + size + 1)
        if m is None:
            m = _WORD_SPACE.search(text, at + size + 1)
        end = len(text) if m is None else m.start()
        yield text[at:end]
        at = end
    if at < len(text):
        yield text[at:]


class PromptFormat(Enum):
    CHAT = "deepseek-chat"  # DeepSeek-V4.1's chat format (release_format, chat_format)
    PLAIN = "plain"  # no chat markers in the vocabulary: BOS + the messages' texts


def prompt_format(tok: Tokenizer) -> PromptFormat:
    if all(tok.token_to_id(m) is not None for m in MARKERS):
        return PromptFormat.CHAT
    return PromptFormat.PLAIN


def _chat_count(tok: Tokenizer, messages: Sequence[Message], options: ChatOptions,
                budget: TextBudget) -> int:
    """`budget.count` of a chat in the chat format: its runs of text as `encode_chat` cuts
    them, each marker and image one id (stopping once over the budget)."""
    segments = render_segments(messages, options)
    if budget.fits(sum(len(seg.text) for seg in segments)):
        return 0
    n, run = 0, ""
    for seg in [*segments, None]:
        pieces: list[int | str] = [-1]
        if seg is not None and seg.kind is SegmentKind.FORMAT:
            pieces = tok.split_added_tokens(seg.text)
        elif seg is not None and seg.kind is SegmentKind.TEXT:
            pieces = [seg.text]
        for p in pieces:
            if isinstance(p, str):
                run += p
                continue
            n += budget.count(tok, run) + (seg is not None)
            run = ""
            if n > budget.max_tokens:
                return n
    return n


def chat_prompt_ids(tok: Tokenizer, messages: Sequence[Message],
                    options: ChatOptions | None = None, *,
                    image_token_id: int | None = None,
                    budget: TextBudget | None = None) -> list[int]:
    """The prompt ids of a chat, ending where the assistant writes, each image part as
    `image_token_id` (None: a model without images); ValueError when the messages cannot be
    spelled, or (with a `budget`) when they are longer than the context, found before they
    are tokenized whole."""
    options = options or ChatOptions()
    if prompt_format(tok) is PromptFormat.CHAT:
        if budget is not None:
            budget.check(_chat_count(tok, messages, options, budget), "The chat")
        return encode_chat(tok, messages, options, image_token_id=image_token_id)
    if not any(m.role is Role.USER for m in messages):
        raise ValueError("A chat needs at least one user message.")
    for i, m in enumerate(messages):
        if m.role is Role.TOOL or m.tool_calls:
            raise ValueError(f"messages[{i}]: the tokenizer {tok.file.path.name} has no chat "
                             "markers, so tool calls and tool results cannot be spelled.")
    if options.tools:
        raise ValueError(f"The tokenizer {tok.file.path.name} has no chat markers, so tools "
                         "cannot be offered.")
    ids = [tok.special.bos] if options.add_bos else []
    text = "".join(m.content for m in messages)
    # the stub spells no whitespace: an image part stands without the blank lines around it
    text = text.replace("\n\n" + IMAGE_SLOT, IMAGE_SLOT).replace(IMAGE_SLOT + "\n\n", IMAGE_SLOT)
    if budget is not None and not budget.fits(len(text)):
        budget.check(len(ids) + sum(budget.count(tok, t) for t in text.split(IMAGE_SLOT)),
                     "The chat")
    return ids + encode_with_images(tok, text, image_token_id)


def completion_prompt_ids(tok: Tokenizer, prompt, *, vocab_size: int,
                          budget: TextBudget | None = None) -> list[int]:
    """A completion prompt: a string (BOS + its ids; with a `budget`, one longer than the
    context is refused before it is tokenized whole), or token ids as they are (a list of
    ints, or a list holding one string or one list of ints: OpenAI's one-prompt forms)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty.")
        if budget is not None and not budget.fits(len(prompt)):
            budget.check(1 + budget.count(tok, prompt, literal=False), "The prompt")
        return [tok.special.bos] + tok.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt holds the token id {bad[0]}, outside the model's "
                             f"{vocab_size} ids.")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str | list) for p in prompt):
        raise ValueError("prompt holds several prompts; this server takes one prompt per "
                         "request.")
    raise ValueError("prompt must be a non-empty string or a non-empty list of token ids.")
