"""One chat turn's reply as the Anthropic Messages and OpenAI Responses endpoints read it.

Both endpoints translate their request into a chat body that `AppState.parse_chat` parses (the
same prompt, sampling, tool and reasoning machinery as `/v1/chat/completions`), submit it to the
same frontend through `Generation.submit`, then read its events here, whole or piece by piece,
and write them in their own shape:

    return await answer(gen, request, "messages", check_key, parse, writer_of)

`answer` counts, checks the key, parses and submits (`start`), then writes the reply with the
endpoint's `TurnWriter`: whole (`whole`: a Reply, or None when the client left) as one JSON
answer, or piece by piece (`pieces`: Pieces, then one TurnEnd) as server-sent events, through
one event pump (`sse_events`) for both endpoints. `chat_tools` is the request half they share:
their tool lists as chat's function tools.

The reply is split as the chat endpoint splits it: in thinking mode the text before `</think>` is
reasoning (tool_calls.split_reasoning, ReasoningFilter while streaming); with tools a DSML block
is read as calls (parse_tool_calls, ToolCallStream), so a greedy reply's text is the chat
endpoint's. How it ended is a `StopKind`: EOS, a stop string (which one: the text the batcher
held back), max_tokens, or tool calls. Errors are ApiErrors (a finish error, the timeout); the
request is recorded in /metrics exactly once, as the chat endpoint records it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsv41.runtime.serving.frontend import EventStream, FinishReason, TokenEvent
from dsv41.runtime.serving.generation import Ended, Generation, finish_error, stream_usage
from dsv41.runtime.serving.openai_api import ApiError, GenerationRequest, Usage, bad_request
from dsv41.runtime.serving.release_format import ToolCall
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import (
    CallDelta,
    ReasoningFilter,
    ToolCallStream,
    parse_tool_calls,
    split_reasoning,
)


class StopKind(Enum):
    END = "end"  # EOS (or a stop id): the model ended its turn
    STOP_STRING = "stop_string"  # one of the request's stop strings (never in the text)
    LENGTH = "length"  # max_tokens, or the model's max_seq_len
    TOOL_CALLS = "tool_calls"  # the reply closed a block of tool calls


@dataclass(frozen=True)
class TurnEnd:
    kind: StopKind
    stop_sequence: str | None  # STOP_STRING: the stop string that matched
    usage: Usage
    reasoning_tokens: int  # generated tokens up to the one that closed the reasoning


@dataclass(frozen=True)
class Reply:
    reasoning: str | None  # thinking mode: the text before `</think>` (None in chat mode)
    text: str
    calls: tuple[ToolCall, ...]
    end: TurnEnd


@dataclass(frozen=True)
class Piece:
    """What one event of a streamed reply adds (any of them may be empty)."""

    reasoning: str
    text: str
    calls: tuple[CallDelta, ...]


def matched_stop(tok: Tokenizer, ids: list[int], emitted: str,
                 stops: tuple[str, ...]) -> str | None:
    """The stop string a turn ended on: the one the batcher's StopMatcher completed first in
    the text after what it emitted (the ids decoded as the batcher decodes them)."""
    rest = tok.decode(ids)[len(emitted):]
    hits = [(rest.find(s) + len(s), -len(s), s) for s in stops if s in rest]
    return min(hits)[2] if hits else None


class _Ending:
    """What a turn's end is made of, gathered while its events are read."""

    def __init__(self, req: GenerationRequest, tok: Tokenizer):
        self.req, self.tok = req, tok
        self.ids: list[int] = []
        self.emitted: list[str] = []
        self.think = ReasoningFilter() if req.thinking else None
        self.reasoning_tokens = 0

    def feed(self, token_id: int | None, text: str) -> tuple[str, str]:
        """The (reasoning, content) of an event's text."""
        self.emitted.append(text)
        if token_id is not None:
            self.ids.append(token_id)
        if self.think is None:
            return "", text
        thinking = not self.think.closed
        out = self.think.feed(text)
        self.reasoning_tokens += thinking and token_id is not None
        return out

    def end(self, finish: FinishReason, stream: EventStream, calls: bool) -> TurnEnd:
        usage = stream_usage(stream, len(self.ids))
        stop = None
        if finish is FinishReason.LENGTH:
            kind = StopKind.LENGTH
        elif calls:
            kind = StopKind.TOOL_CALLS
        elif self.req.params.stop and (not self.ids or self.ids[-1] != self.tok.special.eos):
            stop = matched_stop(self.tok, self.ids, "".join(self.emitted),
                                self.req.params.stop)
            kind = StopKind.END if stop is None else StopKind.STOP_STRING
        else:
            kind = StopKind.END
        return TurnEnd(kind, stop, usage, self.reasoning_tokens)


async def start(gen: Generation, request: Request, label: str,
                check_key: Callable[[Request], None],
                parse: Callable[[object], GenerationRequest]
                ) -> tuple[object, GenerationRequest, EventStream, float | None]:
    """Count the request under `label`, check its key, parse its body (`parse` on a worker
    thread: it tokenizes) and submit it, as `Generation.generate` does: (the body's JSON, the
    request, its stream, its deadline)."""
    st = gen.state
    st.metrics.count_request(label)
    check_key(request)
    body = await st.json_body(request)
    req = await st.in_thread(parse, body)
    submit = st.in_decode_thread if req.images else st.in_thread
    stream = await submit(gen.submit, req)
    deadline = None if st.opts.request_timeout_s is None else \
        time.monotonic() + st.opts.request_timeout_s
    return body, req, stream, deadline


async def whole(gen: Generation, req: GenerationRequest, stream: EventStream,
                request: Request, deadline: float | None) -> Reply | None:
    """The whole reply (None when the client went away); ApiError for a finish error or the
    timeout. Split as the chat endpoint's non-streaming answer is."""
    ending = _Ending(req, gen.state.tokenizer)
    parts: list[str] = []

    def feed(ev: TokenEvent) -> None:
        ending.feed(ev.token_id, ev.text)
        parts.append(ev.text)

    finals = await gen.read_all(stream, request, deadline, 1, feed)
    if finals is None:
        return None
    last = finals[0]
    text, calls, reasoning = "".join(parts), (), None
    if req.thinking:
        reasoning, text = split_reasoning(text)
    if req.reads_tool_calls and last.finish is FinishReason.STOP:
        parsed = parse_tool_calls(text)
        text, calls = parsed.content, parsed.calls[:None if req.parallel_tool_calls else 1]
    return Reply(reasoning, text, calls, ending.end(last.finish, stream, bool(calls)))


async def pieces(gen: Generation, req: GenerationRequest, stream: EventStream,
                 deadline: float | None) -> AsyncIterator[Piece | TurnEnd]:
    """The reply piece by piece (one Piece per event, then the rest held back, then a
    TurnEnd); ApiError for a finish error or the timeout. Split as the chat endpoint's stream
    is. Closing the iterator early (the client left) cancels the request."""
    ending = _Ending(req, gen.state.tokenizer)
    calls = ToolCallStream(req.parallel_tool_calls) if req.reads_tool_calls else None
    reason = "cancelled"  # unless a finish event or the deadline says otherwise

    def split(token_id: int | None, text: str) -> Piece:
        reasoning, content = ending.feed(token_id, text)
        deltas: list[CallDelta] = []
        if calls is not None and content:
            content, deltas = calls.feed(content)
        return Piece(reasoning, content, tuple(deltas))

    try:
        try:
            async for ev in gen.events(stream, None, deadline):
                yield split(ev.token_id, ev.text)
                if ev.finish is None:
                    continue
                reason = ev.finish.value
                err = finish_error(ev)
                if err is not None:
                    raise err
                rest = ending.think.flush() if ending.think and not ending.think.closed else ""
                tail = calls.finish() if calls is not None else ""
                yield Piece(rest, tail, ())
                called = calls is not None and bool(calls.calls) and calls.closed and \
                    ev.finish is FinishReason.STOP
                yield ending.end(ev.finish, stream, called)
        except Ended as e:
            reason = e.reason
            raise gen.timeout_error() from None
    finally:  # also when the client went away (the response task is cancelled)
        stream.cancel()
        gen.record(stream, reason)


class TurnWriter(Protocol):
    """One endpoint's shapes of one request's reply (made after the request is submitted: it
    may hold the reply's id and, for a stream, what its events have said so far)."""

    def answer(self, reply: Reply) -> dict:
        """The whole reply's JSON answer."""

    def opening(self) -> list[dict]:
        """The events a stream opens with (read when the stream starts)."""

    def piece(self, p: Piece) -> list[dict]:
        """The events of one piece of the reply."""

    def end(self, end: TurnEnd) -> list[dict]:
        """The events that close the reply."""

    def failed(self, e: ApiError) -> list[dict]:
        """The events of an error after the stream began (a finish error, the timeout)."""

    def sse(self, event: dict) -> str:
        """One event as a server-sent event."""


async def sse_events(gen: Generation, req: GenerationRequest, stream: EventStream,
                     deadline: float | None, writer: TurnWriter) -> AsyncIterator[str]:
    """The reply as `writer`'s server-sent events: its opening, each piece's, the end's; an
    error after the stream began is counted in /metrics and written as `writer.failed`."""
    for ev in writer.opening():
        yield writer.sse(ev)
    try:
        async for item in pieces(gen, req, stream, deadline):
            for ev in writer.piece(item) if isinstance(item, Piece) else writer.end(item):
                yield writer.sse(ev)
    except ApiError as e:
        gen.state.metrics.count_rejected(e.status)
        for ev in writer.failed(e):
            yield writer.sse(ev)


async def answer(gen: Generation, request: Request, label: str,
                 check_key: Callable[[Request], None],
                 parse: Callable[[object], GenerationRequest],
                 writer_of: Callable[[object, EventStream], TurnWriter]) -> Response:
    """Start the request (`start`), then answer with `writer_of(body, stream)`'s shapes: one
    JSON answer, or its server-sent events (499 when the client left before a JSON answer)."""
    body, req, stream, deadline = await start(gen, request, label, check_key, parse)
    writer = writer_of(body, stream)
    if req.stream:
        # the background cancel covers a client gone before the first event was sent
        return StreamingResponse(sse_events(gen, req, stream, deadline, writer),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(stream.cancel))
    reply = await whole(gen, req, stream, request, deadline)
    if reply is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(writer.answer(reply))


def chat_tools(tools, function: Callable[[object, str], dict]) -> list[dict]:
    """Chat's function tools of an endpoint's `tools` (None: none): each tool's chat
    `function` object as `function(tool, where)` makes it (an ApiError for one it cannot
    serve; `where`: `tools[i]`)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of tools.", "tools")
    return [{"type": "function", "function": function(t, f"tools[{i}]")}
            for i, t in enumerate(tools)]
