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

from dsv41.runtime.serving.release_format import (
    CALLS_TAG,
    DSML,
    INVOKE_TAG,
    PARAM_TAG,
    ToolCall,
)


@dataclass(frozen=True)
class ToolCallReply:
    content: str  # the reply's text outside the block ("" when it is only calls)
    calls: tuple[ToolCall, ...]  # empty when the reply calls no tool


BLOCK_OPEN = f"<{DSML}{CALLS_TAG}>"


def _patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    block, invoke, param = (re.escape(t) for t in (CALLS_TAG, INVOKE_TAG, PARAM_TAG))
    d = re.escape(DSML)
    whole = re.compile(rf"<{d}{block}>\n(?P<body>.*?)\n</{d}{block}>", re.S)
    one_invoke = re.compile(rf'<{d}{invoke} name="(?P<name>[^"]+)">\n(?P<params>.*?)'
                            rf"\n?</{d}{invoke}>", re.S)
    one_param = re.compile(rf'<{d}{param} name="(?P<key>[^"]+)" string="(?P<str>true|false)">'
                           rf"(?P<value>.*?)</{d}{param}>", re.S)
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
            value = p.group("value")
            if p.group("str") == "false":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    return ()
            args[p.group("key")] = value
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
            cut = len(self._held) - self._partial_open()
            cut = len(self._held[:cut].rstrip())  # whitespace may precede a block
        out, self._held = self._held[:cut], self._held[cut:]
        self._streamed += out
        return out

    def _partial_open(self) -> int:
        """Length of the longest end of the held text that begins the block's opening tag."""
        for k in range(min(len(self._open) - 1, len(self._held)), 0, -1):
            if self._held.endswith(self._open[:k]):
                return k
        return 0

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
