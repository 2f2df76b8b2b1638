"""Tool calls in the model's replies: V4.1's DSML block (release_format renders it into prompts)
read back out of generated text, whole or while it streams.

    parsed = parse_tool_calls(text)                  # ToolCallReply(content, calls)
    f = ToolCallFilter()
    out = f.feed(delta)                              # text safe to stream as content now
    parsed = f.finish()                              # the held rest: content and the calls

A reply that calls tools is `content` + a blank line + one block (the tag names carry a leading
space; a name may be `namespace::name`):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="f">
    <｜DSML｜ parameter name="k" string="true">a string, as is</｜DSML｜ parameter>
    <｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

Each invoke becomes a `ToolCall` whose arguments are the JSON object of its parameters
(string="false" values parsed as JSON). A block that is not whole and well formed (cut by
max_tokens, a parameter value that is not JSON, text between the tags) calls nothing: the reply
stays text, exactly as generated, so nothing the model wrote is lost or invented.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from dsv41.runtime.serving.release_format import (
    CALLS_TAG,
    CLOSE_CALLS,
    CLOSE_INVOKE,
    DSML,
    INVOKE_TAG,
    OPEN_CALLS,
    OPEN_INVOKE,
    OPEN_PARAM,
    PARAM_TAG,
    THINK_CLOSE,
    ToolCall,
)


@dataclass(frozen=True)
class ToolCallReply:
    content: str  # the reply's text outside the block ("" when it is only calls)
    calls: tuple[ToolCall, ...]  # empty when the reply calls no tool


BLOCK_OPEN = OPEN_CALLS.rstrip("\n")  # the opening tag alone


# one parameter of an invoke: its key, whether the value is a plain string, the value
PARAM_TEXT = (rf'<{re.escape(DSML)}{re.escape(PARAM_TAG)} name="(?P<key>[^"]+)" '
              rf'string="(?P<str>true|false)">(?P<value>.*?)</{re.escape(DSML)}'
              rf"{re.escape(PARAM_TAG)}>")


def param_value(m: re.Match) -> object:
    """A matched parameter's value: the string as it is, else its JSON (ValueError when it is
    not JSON)."""
    value = m.group("value")
    return value if m.group("str") == "true" else json.loads(value)


def _patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    block, invoke = (re.escape(t) for t in (CALLS_TAG, INVOKE_TAG))
    d = re.escape(DSML)
    whole = re.compile(rf"<{d}{block}>\n(?P<body>.*?)\n</{d}{block}>", re.S)
    one_invoke = re.compile(rf'<{d}{invoke} name="(?P<name>[^"]+)">\n(?P<params>.*?)'
                            rf"\n?</{d}{invoke}>", re.S)
    one_param = re.compile(PARAM_TEXT, re.S)
    return whole, one_invoke, one_param


WHOLE, ONE_INVOKE, ONE_PARAM = _patterns()


def _calls(body: str, one_invoke: re.Pattern, one_param: re.Pattern) -> tuple[ToolCall, ...]:
    """The invokes of a block's body; () when anything in it is not an invoke or a parameter."""
    calls, at = [], 0
    for m in one_invoke.finditer(body):
        if body[at:m.start()].strip():
            return ()
        args, p_at = {}, 0
        params = m.group("params")
        for p in one_param.finditer(params):
            if params[p_at:p.start()].strip():
                return ()
            try:
                args[p.group("key")] = param_value(p)
            except json.JSONDecodeError:
                return ()
            p_at = p.end()
        if params[p_at:].strip():
            return ()
        calls.append(ToolCall(m.group("name"), json.dumps(args, ensure_ascii=False)))
        at = m.end()
    if body[at:].strip() or not calls:
        return ()
    return tuple(calls)


def parse_tool_calls(text: str) -> ToolCallReply:
    """The reply's content and calls; a reply without one whole, well-formed block is all
    content."""
    m = WHOLE.search(text)
    if m is None:
        return ToolCallReply(text, ())
    calls = _calls(m.group("body"), ONE_INVOKE, ONE_PARAM)
    if not calls:
        return ToolCallReply(text, ())
    before, after = text[:m.start()].rstrip(), text[m.end():].strip()
    return ToolCallReply(before + "\n\n" + after if before and after else before or after, calls)


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and is shorter than it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallFilter:
    """Streams a reply's content while holding back what may be the start of a tool-call block
    (and the whitespace before it); `finish` parses what was held."""

    def __init__(self):
        self._open = BLOCK_OPEN
        self._held = ""  # text not yet streamed
        self._in_block = False  # the block's opening tag was seen
        self._streamed = ""  # the content streamed so far

    def feed(self, text: str) -> str:
        """The part of `text` (with what was held) that is content for certain."""
        self._held += text
        if self._in_block:
            return ""
        at = self._held.find(self._open)
        if at >= 0:
            self._in_block = True
            cut = len(self._held[:at].rstrip())
        else:
            cut = len(self._held) - _partial(self._held, self._open)
            cut = len(self._held[:cut].rstrip())  # whitespace may precede a block
        out, self._held = self._held[:cut], self._held[cut:]
        self._streamed += out
        return out

    @property
    def in_block(self) -> bool:
        """The block's opening tag was seen (what follows is held, not streamed)."""
        return self._in_block

    def take_held(self) -> str:
        """The held text, handed over (the filter holds nothing after)."""
        held, self._held = self._held, ""
        return held

    def finish(self) -> ToolCallReply:
        """What was held: the calls (and any content after the block), or, when the held text
        is no whole block, that text as content."""
        held, self._held = self._held, ""
        parsed = parse_tool_calls(held)
        if not parsed.calls:
            return ToolCallReply(held, ())
        return parsed

    @property
    def streamed(self) -> str:
        return self._streamed


# ---- reasoning and streamed calls ---------------------------------------------------------------


def split_reasoning(text: str) -> tuple[str, str]:
    """A thinking-mode reply's (reasoning, content): the text before the first `</think>` and
    the text after it; all reasoning when it never closed (cut by max_tokens)."""
    at = text.find(THINK_CLOSE)
    if at < 0:
        return text, ""
    return text[:at], text[at + len(THINK_CLOSE):]


class ReasoningFilter:
    """`split_reasoning` while the reply streams: each piece of text splits into the reasoning
    and the content it holds for certain; a possible start of `</think>` is held back, and the
    marker itself is in neither."""

    def __init__(self):
        self._held = ""
        self.closed = False  # `</think>` was seen: the rest is content

    def feed(self, text: str) -> tuple[str, str]:
        if self.closed:
            return "", text
        self._held += text
        at = self._held.find(THINK_CLOSE)
        if at >= 0:
            self.closed = True
            held, self._held = self._held, ""
            return held[:at], held[at + len(THINK_CLOSE):]
        cut = len(self._held) - _partial(self._held, THINK_CLOSE)
        out, self._held = self._held[:cut], self._held[cut:]
        return out, ""

    def flush(self) -> str:
        """At the end: the held reasoning (an unfinished `</think>` is text)."""
        out, self._held = self._held, ""
        return out


@dataclass(frozen=True)
class CallDelta:
    """One piece of a streamed tool call (OpenAI's `delta.tool_calls[i]`): the first of a call
    carries its `name`, the rest pieces of its `arguments` JSON, in order."""

    index: int
    name: str | None  # the first piece only
    arguments: str


class Element(Enum):
    """The elements of a DSML block, in the order a streamed block is read."""

    OPEN = "open"  # the block's opening tag
    INVOKE = "invoke"  # a call's opening tag, with its name
    PARAM = "param"  # one whole parameter
    END_INVOKE = "end_invoke"
    END = "end"  # the block's closing tag


def _stream_patterns() -> MappingProxyType[Element, re.Pattern]:
    block, invoke = (re.escape(t) for t in (CALLS_TAG, INVOKE_TAG))
    d = re.escape(DSML)
    return MappingProxyType({
        Element.OPEN: re.compile(rf"<{d}{block}>\n"),
        Element.INVOKE: re.compile(rf'\n?<{d}{invoke} name="(?P<name>[^"]+)">\n'),
        Element.PARAM: re.compile(rf"\n?{PARAM_TEXT}", re.S),
        Element.END_INVOKE: re.compile(rf"\n?</{d}{invoke}>"),
        Element.END: re.compile(rf"\n?</{d}{block}>"),
    })


STREAM = _stream_patterns()
# what may come next, by where the reader is
NEXT = MappingProxyType({Element.OPEN: (Element.OPEN,),
                         Element.INVOKE: (Element.INVOKE, Element.END),
                         Element.PARAM: (Element.PARAM, Element.END_INVOKE)})


class ToolCallStream:
    """A reply's content and its tool calls while it streams: content until a DSML block opens
    (what may be its start held back, as `ToolCallFilter` does), then each call as it is
    written: its name once its invoke tag is whole, its arguments one whole parameter at a time
    (`{"k": v` then `, "k2": v2` ... then `}`: the pieces join to `json.dumps` of the arguments,
    as `parse_tool_calls` gives them). With `parallel` off only the first call is streamed.

    A block that breaks off (max_tokens, a parameter that is not JSON, text between the tags)
    stops the calls there: `finish` returns the unread rest as content, so nothing the model
    wrote is lost; the calls already streamed stand."""

    def __init__(self, parallel: bool = True):
        self._filter = ToolCallFilter()
        self.parallel = parallel
        self._buf = ""  # the block's text, from its opening tag
        self._pos = 0  # how much of it is read
        self._where = Element.OPEN  # what comes next: open, invoke (or end), param (or end_invoke)
        self._args = 0  # parameters of the open call so far
        self.calls = 0  # calls read
        self.closed = False  # the block's closing tag was read
        self.broken = False  # text that is not the block's next element

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content for certain, call pieces) of this piece of the reply."""
        if not self._filter.in_block:
            content = self._filter.feed(text)
            if not self._filter.in_block:
                return content, []
            self._buf = self._filter.take_held().lstrip()
            return content, self._read()
        self._buf += text
        return "", self._read()

    def _emit(self) -> bool:
        return self.parallel or self.calls == 1

    def _read(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        while not (self.closed or self.broken):
            rest = self._buf[self._pos:]
            nexts = NEXT[self._where]
            m = kind = None
            for kind in nexts:
                m = STREAM[kind].match(self._buf, self._pos)
                if m is not None:
                    break
            if m is None:
                # broken once the rest can no longer begin any expected element
                self.broken = bool(rest) and not any(
                    _could_begin(rest, kind) for kind in nexts)
                return out
            self._pos = m.end()
            if kind == Element.OPEN:
                self._where = Element.INVOKE
            elif kind == Element.INVOKE:
                self.calls += 1
                self._where, self._args = Element.PARAM, 0
                if self._emit():
                    out.append(CallDelta(self.calls - 1, m.group("name"), ""))
            elif kind == Element.PARAM:
                try:
                    value = param_value(m)
                except json.JSONDecodeError:
                    self._pos = m.start()
                    self.broken = True
                    return out
                piece = ("{" if not self._args else ", ") + json.dumps(m.group("key")) + \
                    ": " + json.dumps(value, ensure_ascii=False)
                self._args += 1
                if self._emit():
                    out.append(CallDelta(self.calls - 1, None, piece))
            elif kind == Element.END_INVOKE:
                self._where = Element.INVOKE
                if self._emit():
                    out.append(CallDelta(self.calls - 1, None, "}" if self._args else "{}"))
            else:
                self.closed = True
        return out

    def finish(self) -> str:
        """At the end: the content not yet streamed (text after a closed block, an unread or
        broken rest, or the whole held text when no call was read)."""
        if not self._filter.in_block:
            return self._filter.finish().content
        if not self.calls:
            return self._buf
        rest = self._buf[self._pos:]
        return rest.strip() if self.closed else rest


def _could_begin(rest: str, kind: Element) -> bool:
    """Whether `rest` may still grow into the element `kind` (its fixed start so far)."""
    starts = {Element.OPEN: [OPEN_CALLS],
              Element.INVOKE: [OPEN_INVOKE, "\n" + OPEN_INVOKE],
              Element.PARAM: [OPEN_PARAM, "\n" + OPEN_PARAM],
              Element.END_INVOKE: [CLOSE_INVOKE[1:], CLOSE_INVOKE],
              Element.END: [CLOSE_CALLS[1:], CLOSE_CALLS]}[kind]
    return any(s.startswith(rest) or rest.startswith(s) for s in starts)
