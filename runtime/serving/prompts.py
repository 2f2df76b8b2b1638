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
"""

from __future__ import annotations

from collections.abc import Sequence
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
from dsv41.runtime.serving.tokenizer import Tokenizer


class PromptFormat(Enum):
    CHAT = "deepseek-chat"  # DeepSeek-V4.1's chat format (release_format, chat_format)
    PLAIN = "plain"  # no chat markers in the vocabulary: BOS + the messages' texts


def prompt_format(tok: Tokenizer) -> PromptFormat:
    if all(tok.token_to_id(m) is not None for m in MARKERS):
        return PromptFormat.CHAT
    return PromptFormat.PLAIN


def chat_prompt_ids(tok: Tokenizer, messages: Sequence[Message],
                    options: ChatOptions | None = None, *,
                    image_token_id: int | None = None) -> list[int]:
    """The prompt ids of a chat, ending where the assistant writes, each image part as
    `image_token_id` (None: a model without images); ValueError when the messages cannot be
    spelled."""
    options = options or ChatOptions()
    if prompt_format(tok) is PromptFormat.CHAT:
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
    return ids + encode_with_images(tok, text, image_token_id)


def completion_prompt_ids(tok: Tokenizer, prompt, *, vocab_size: int) -> list[int]:
    """A completion prompt: a string (BOS + its ids), or token ids as they are (a list of ints,
    or a list holding one string or one list of ints: OpenAI's one-prompt forms)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty.")
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
