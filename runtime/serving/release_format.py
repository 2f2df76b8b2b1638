"""DeepSeek-V4.1's chat prompt, byte for byte as its release renders it: typed messages in, a
sequence of typed segments out (format markers, the format's own words, a client's text, images).

    options = ChatOptions(thinking=True, effort=ReasoningEffort.parse("max"))
    segs = render_segments(messages, options)      # Segment(kind, text), in prompt order
    text = render_chat(messages, options)          # the segments joined: the release's string

The reference is `encoding/encoding.py` of deepseek-ai/DeepSeek-V4.1-Flash (revision dba1be0a,
pinned by `shared/conformance/chat/README.md`, whose cases `tests/test_chat_conformance.py`
checks). Written here from its rules, in the order the release applies them:

1. Refusal: `<｜deepseek_image｜>` typed in any message's text or reasoning is a ValueError (an
   image is an image part, never a spelling).
2. Tools: the section goes on messages[0] when it is a system message, else on an empty system
   message inserted at index 0; it follows the system text after a blank line. The section is
   the release's `TOOLS_TEMPLATE` with one `json.dumps(function, ensure_ascii=False)` per line
   (key order kept).
3. Turns: a tool message becomes a `<tool_result>...</tool_result>` block of a user turn;
   consecutive user and tool messages are one turn, their blocks joined by a blank line. The
   tool results of a turn are sorted into the order of the calls of the last assistant message
   that made calls (by `tool_call_id`; an unknown id sorts first, ties keep their order).
4. Rendering, turn i (`last` = the last user turn or system turn after index 0):
   - BOS first. Turn 0 opens with `<｜System｜>` when it is a system message or, in thinking
     mode, to carry the effort line `Reasoning Effort: N (range 1-100, the higher the value, the
     more thorough the reasoning)` + blank line (N: low 50, high 75, max 100, or an integer
     1-100; default high). Never in chat mode.
   - a later system message: `<｜System｜>` + text; a user turn: `<｜User｜>` + blocks;
   - an assistant message: [reasoning + `</think>`] + text + [blank line + DSML calls] + EOS.
     The reasoning part is rendered in thinking mode only, and only for turns after `last`
     unless the request has tools (or `drop_thinking` is off): then every assistant turn keeps
     it;
   - after a user turn or a later system message that no assistant message follows:
     `<｜Assistant｜>` + `<think>` (thinking mode, the turn at or after `last`, or nothing
     dropped) else `</think>`.
5. Content parts, images included, are joined by a blank line (`chat_format` joins them when it
   reads the OpenAI message; an image stands as IMAGE_SLOT in the content there).

Segments keep the client's text apart from the format: `SegmentKind.TEXT` is encoded as ordinary
text whatever it spells (`<｜User｜>` typed by a user is never the marker's id), MARKER as the
marker's id, FORMAT (the template's words, DSML tags) as the release's tokenizer reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
IMAGE = "<｜deepseek_image｜>"  # the release's image placeholder (one image token)
MARKERS = (BOS, EOS, SYSTEM, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, DSML)
IMAGE_SLOT = "\ufffc"  # where an image part stands in a Message's content (OBJECT REPLACEMENT)

# the DSML tag names (V4.1: a leading space; V4 had `tool_calls` / `invoke` / `parameter`)
CALLS_TAG, INVOKE_TAG, PARAM_TAG = " calls", " invoke", " parameter"
# the block's tags as the release writes them (one per line; the closing ones after a newline)
OPEN_CALLS = f"<{DSML}{CALLS_TAG}>\n"
CLOSE_CALLS = f"\n</{DSML}{CALLS_TAG}>"
OPEN_INVOKE = f'<{DSML}{INVOKE_TAG} name="'
CLOSE_INVOKE = f"\n</{DSML}{INVOKE_TAG}>"
OPEN_PARAM = f'<{DSML}{PARAM_TAG} name="'
CLOSE_PARAM = f"</{DSML}{PARAM_TAG}>"

EFFORT_LINE = ("Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough "
               "the reasoning)\n\n")

TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "<{DSML}{CALLS_TAG}>" block like the following:

<{DSML}{CALLS_TAG}>
<{DSML}{INVOKE_TAG} name="$TOOL_NAME">
<{DSML}{PARAM_TAG} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE\
</{DSML}{PARAM_TAG}>
...
</{DSML}{INVOKE_TAG}>
<{DSML}{INVOKE_TAG} name="$TOOL_NAME2">
...
</{DSML}{INVOKE_TAG}>
</{DSML}{CALLS_TAG}>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_OPEN}), you MUST output your complete reasoning \
inside {THINK_OPEN}...{THINK_CLOSE} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_CLOSE} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class Role(Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True)
class ToolCall:
    name: str  # may be `namespace::name`
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""  # OpenAI's call id: the tool results of the next turn are sorted by it


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""  # the parts joined by a blank line, IMAGE_SLOT for each image part
    reasoning: str = ""  # an assistant turn's reasoning (OpenAI-style `reasoning_content`)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""  # a tool result's call id
    images: tuple[str, ...] = ()  # the URLs of the IMAGE_SLOTs in `content`, in order


class EffortLevel(Enum):
    """The release's named efforts and their budgets (the pre-release table of SGLang's copy,
    25/50/75/100 with an `xhigh`, is not the release's)."""

    LOW = "low"
    HIGH = "high"
    MAX = "max"

    @property
    def budget(self) -> int:
        return {EffortLevel.LOW: 50, EffortLevel.HIGH: 75, EffortLevel.MAX: 100}[self]


@dataclass(frozen=True)
class ReasoningEffort:
    """The budget of the thinking-mode effort line, 1 to 100."""

    budget: int = EffortLevel.HIGH.budget  # the release's default: high

    def __post_init__(self):
        assert 1 <= self.budget <= 100, f"an effort budget is 1-100, not {self.budget}"

    @classmethod
    def parse(cls, value) -> ReasoningEffort:
        """`low` / `high` / `max` or an integer 1-100 (as the release takes it); ValueError
        naming the choices otherwise."""
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 100:
            return cls(value)
        if isinstance(value, str) and value in {e.value for e in EffortLevel}:
            return cls(EffortLevel(value).budget)
        raise ValueError(f"reasoning_effort must be 'low' (50), 'high' (75), 'max' (100) or a "
                         f"whole number from 1 to 100, not {value!r:.40}.")


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = False  # thinking mode: the assistant turn opens with <think>
    effort: ReasoningEffort = ReasoningEffort()  # the effort line (thinking mode only)
    drop_thinking: bool = True  # earlier turns' reasoning left out (the release's default)
    add_bos: bool = True
    tools: tuple[dict, ...] = ()  # OpenAI `tools` entries ({"type": "function", "function": ...})


class SegmentKind(Enum):
    MARKER = "marker"  # one of MARKERS: its special id
    FORMAT = "format"  # the format's own words (template, DSML tags): as the tokenizer reads them
    TEXT = "text"  # a client's text: ordinary text, whatever it spells
    IMAGE = "image"  # one image part: the image token


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    text: str  # as the prompt string spells it (an image: IMAGE)


def _marker(m: str) -> Segment:
    return Segment(SegmentKind.MARKER, m)


def _fmt(text: str) -> Segment:
    return Segment(SegmentKind.FORMAT, text)


def _text(text: str) -> Iterator[Segment]:
    """A client's text, each IMAGE_SLOT an image segment."""
    for n, piece in enumerate(text.split(IMAGE_SLOT)):
        if n:
            yield Segment(SegmentKind.IMAGE, IMAGE)
        if piece:
            yield Segment(SegmentKind.TEXT, piece)


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _functions(tools: Sequence[dict]) -> list[dict]:
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             "{'name', 'description', 'parameters'}}.")
        fns.append(fn)
    return fns


def tools_segments(tools: Sequence[dict]) -> list[Segment]:
    """The tool section: TOOLS_TEMPLATE with one JSON schema (the client's) per line."""
    head, tail = TOOLS_TEMPLATE.split("{schemas}")
    out = [_fmt(head)]
    for n, fn in enumerate(_functions(tools)):
        out += [_fmt("\n")] * bool(n) + [Segment(SegmentKind.TEXT, _json(fn))]
    return out + [_fmt(tail)]


def render_tools(tools: Sequence[dict]) -> str:
    return "".join(s.text for s in tools_segments(tools))


def _call_arguments(call: ToolCall) -> dict:
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"The arguments of tool call {call.name!r} are not JSON: "
                         f"{call.arguments!r:.80}.") from None
    if not isinstance(args, dict):
        raise ValueError(f"The arguments of tool call {call.name!r} must be a JSON object.")
    return args


def tool_calls_segments(calls: Sequence[ToolCall]) -> list[Segment]:
    """The DSML block: one invoke per call, one parameter per argument (a string as is, any
    other value as JSON), one tag per line."""
    out = [_fmt(OPEN_CALLS)]
    for n, c in enumerate(calls):
        out += [_fmt("\n")] * bool(n)
        out += [_fmt(OPEN_INVOKE), Segment(SegmentKind.TEXT, c.name),
                _fmt('">\n')]
        for k, (key, v) in enumerate(_call_arguments(c).items()):
            is_str = isinstance(v, str)
            out += [_fmt("\n")] * bool(k)
            out += [_fmt(OPEN_PARAM), Segment(SegmentKind.TEXT, key),
                    _fmt(f'" string="{"true" if is_str else "false"}">'),
                    Segment(SegmentKind.TEXT, v if is_str else _json(v)),
                    _fmt(CLOSE_PARAM)]
        out.append(_fmt(CLOSE_INVOKE))
    return out + [_fmt(CLOSE_CALLS)]


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    return "".join(s.text for s in tool_calls_segments(calls))


@dataclass(frozen=True)
class _Block:
    """One part of a user turn: a user message's text, or a tool result."""

    text: str
    result_of: str | None = None  # a tool result's call id (None: a user message's text)


@dataclass
class _Turn:
    """A message after tool results are merged into user turns."""

    message: Message
    blocks: list[_Block]  # a user turn's parts
    tools: bool = False  # the tool section follows this system message


def _check_no_placeholder(messages: Sequence[Message]) -> None:
    for i, m in enumerate(messages):
        for field, text in (("content", m.content), ("reasoning_content", m.reasoning)):
            if IMAGE in text:
                raise ValueError(f"messages[{i}].{field} spells the image placeholder {IMAGE}; "
                                 "send each image as an image_url content part.")


def _turns(messages: Sequence[Message], tools: bool) -> list[_Turn]:
    turns: list[_Turn] = []
    if tools and not (messages and messages[0].role is Role.SYSTEM):
        turns.append(_Turn(Message(Role.SYSTEM), [], tools=True))
    for i, m in enumerate(messages):
        if m.role in (Role.USER, Role.TOOL):
            block = _Block(m.content, m.tool_call_id if m.role is Role.TOOL else None)
            if turns and turns[-1].message.role is Role.USER:
                turns[-1].blocks.append(block)
            else:
                turns.append(_Turn(Message(Role.USER), [block]))
        else:
            turns.append(_Turn(m, [], tools=tools and i == 0 and m.role is Role.SYSTEM))
    return turns


def _sort_results(turns: list[_Turn]) -> None:
    """Each user turn's tool results into the call order of the last assistant that called."""
    order: dict[str, int] = {}
    for t in turns:
        if t.message.role is Role.ASSISTANT and t.message.tool_calls:
            order = {c.id: n for n, c in enumerate(t.message.tool_calls) if c.id}
        elif t.message.role is Role.USER and order:
            slots = [n for n, b in enumerate(t.blocks) if b.result_of is not None]
            if len(slots) > 1:
                ranked = sorted((t.blocks[n] for n in slots),
                                key=lambda b: order.get(b.result_of, 0))
                for n, b in zip(slots, ranked, strict=True):
                    t.blocks[n] = b


def render_segments(messages: Sequence[Message],
                    options: ChatOptions = ChatOptions()) -> list[Segment]:
    """The prompt as segments, ending where the model writes (or with the EOS of a closing
    assistant message)."""
    _check_no_placeholder(messages)
    turns = _turns(messages, bool(options.tools))
    _sort_results(turns)
    drop = options.drop_thinking and not options.tools

    def asks(i: int) -> bool:  # a turn the assistant answers
        role = turns[i].message.role
        return role is Role.USER or (role is Role.SYSTEM and i > 0)

    last = max((i for i in range(len(turns)) if asks(i)), default=-1)
    if last < 0 and not any(t.message.role is Role.ASSISTANT for t in turns):
        raise ValueError("A chat needs at least one user message.")
    out = [_marker(BOS)] if options.add_bos else []
    for i, t in enumerate(turns):
        m = t.message
        if i == 0 and (options.thinking or m.role is Role.SYSTEM):
            out.append(_marker(SYSTEM))
            if options.thinking:
                out.append(_fmt(EFFORT_LINE.format(budget=options.effort.budget)))
        if m.role is Role.SYSTEM:
            out += [_marker(SYSTEM)] * (i > 0)
            out += _text(m.content)
            if t.tools:
                out += [_fmt("\n\n"), *tools_segments(options.tools)]
        elif m.role is Role.USER:
            out.append(_marker(USER))
            for n, b in enumerate(t.blocks):
                out += [_fmt("\n\n")] * bool(n)
                if b.result_of is None:
                    out += _text(b.text)
                else:
                    out += [_fmt("<tool_result>"), *_text(b.text), _fmt("</tool_result>")]
        else:  # assistant
            if options.thinking and (not drop or i > last):
                out += [*_text(m.reasoning), _marker(THINK_CLOSE)]
            out += _text(m.content)
            if m.tool_calls:
                out += [_fmt("\n\n"), *tool_calls_segments(m.tool_calls)]
            out.append(_marker(EOS))
        nxt = turns[i + 1].message.role if i + 1 < len(turns) else None
        if asks(i) and nxt in (None, Role.ASSISTANT):
            opens = options.thinking and (not drop or i >= last)
            out += [_marker(ASSISTANT), _marker(THINK_OPEN if opens else THINK_CLOSE)]
    return out


def render_chat(messages: Sequence[Message], options: ChatOptions = ChatOptions()) -> str:
    """The release's prompt string for `messages` (each image part as `<｜deepseek_image｜>`)."""
    return "".join(s.text for s in render_segments(messages, options))
