"""The generation endpoints' common half (`/v1/chat/completions`, `/v1/completions`): a parsed
request submitted to the frontend, then its `EventStream` moved to the client, as one JSON
response or as server-sent events (one `data: {chunk}` per token, a chunk with the finish
reason, with `stream_options.include_usage` a chunk with the usage, then `data: [DONE]`).

A client that goes away cancels its stream, as does the per-request timeout (504; a stream gets
an error event, then `[DONE]`); both are counted in /metrics. The handlers wait for events on
worker threads (`poll_s` at a time, so a disconnect or the deadline is seen within `poll_s`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsv41.runtime.serving.frontend import EventStream, FinishReason, QueueFull, TokenEvent
from dsv41.runtime.serving.metrics import FinishTiming
from dsv41.runtime.serving.openai_api import (
    ApiError,
    Endpoint,
    ErrorType,
    GenerationRequest,
    PromptCache,
    TokenOut,
    Usage,
    call_deltas_body,
    chunk_body,
    logprobs_body,
    response_body,
    usage_chunk,
)
from dsv41.runtime.serving.state import AppState
from dsv41.runtime.serving.tool_calls import (
    ReasoningFilter,
    ToolCallStream,
    parse_tool_calls,
    split_reasoning,
)


class Ended(Exception):
    """The request ended without a finish event: the client left or the deadline passed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason  # "cancelled" | "timeout"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def finish_error(ev: TokenEvent) -> ApiError | None:
    """The error a final event stands for, if it is not a normal end."""
    if ev.finish is FinishReason.ERROR:
        return ApiError(500, f"The engine failed on this request: {ev.error or 'no message'}",
                        type=ErrorType.SERVER)
    if ev.finish is FinishReason.UNAVAILABLE:
        return ApiError(503, f"The server lost this request on its way: {ev.error or 'no message'}",
                        type=ErrorType.SERVER)
    if ev.finish is FinishReason.CANCELLED:
        return ApiError(503, "The request was cancelled by the server (it is stopping).",
                        type=ErrorType.SERVER)
    return None


def _token_out(ev: TokenEvent) -> TokenOut | None:
    if ev.token_id is None:
        return None
    return TokenOut(ev.token_id, ev.text, ev.logprob, ev.top)


def stream_usage(stream: EventStream, n_tokens: int) -> Usage:
    t = stream.timing  # its prompt as queued: each image placeholder counts as its span
    return Usage(t.prompt_tokens, n_tokens, t.reused_tokens,
                 PromptCache(t.tier, t.replayed_tokens, t.decoder_replayed_tokens), t.speculative)


class Generation:
    """One app's generation handler over its `AppState`."""

    def __init__(self, state: AppState):
        self.state = state

    def submit(self, req: GenerationRequest) -> EventStream:
        try:
            return self.state.frontend.submit(list(req.prompt_ids), req.params, req.images)
        except QueueFull as e:
            raise ApiError(429, f"The server's queue is full ({e}); retry later.",
                           type=ErrorType.RATE_LIMIT, code="rate_limit_exceeded") from None
        except ValueError as e:  # RequestError: ids, lengths, params; the message is the 400's
            raise ApiError(400, str(e)) from None

    def record(self, stream: EventStream, reason: str) -> None:
        t = stream.timing
        self.state.metrics.observe_finish(reason, FinishTiming(
            t.queued_s, t.first_token_s, t.per_token_s, t.completion_tokens, t.prompt_tokens))

    def timeout_error(self) -> ApiError:
        return ApiError(504, f"The request did not finish within the server's request timeout "
                        f"of {self.state.opts.request_timeout_s:g} s.", type=ErrorType.TIMEOUT)

    async def events(self, stream: EventStream, request: Request | None,
                     deadline: float | None) -> AsyncIterator[TokenEvent]:
        """The stream's events; raises Ended (after cancelling it) when the client leaves
        (checked here when `request` is given: non-streaming) or the deadline passes."""
        while True:
            ev = await self.state.in_thread(stream.get, self.state.opts.poll_s)
            if ev is not None:
                yield ev
                if ev.finish is not None:
                    return
                continue
            if request is not None and await request.is_disconnected():
                stream.cancel()
                raise Ended("cancelled")
            if deadline is not None and time.monotonic() > deadline:
                stream.cancel()
                raise Ended("timeout")

    async def collect(self, req: GenerationRequest, stream: EventStream, request: Request,
                      deadline: float | None) -> Response:
        parts, tokens, last = [], [], None
        reason, ended = "cancelled", None
        try:
            async for ev in self.events(stream, request, deadline):
                parts.append(ev.text)
                t = _token_out(ev)
                if t is not None:
                    tokens.append(t)
                last = ev
            reason = last.finish.value
        except Ended as e:
            reason = ended = e.reason
        finally:
            stream.cancel()  # a no-op once finished; frees the slot if the handler is torn down
            self.record(stream, reason)
        if ended == "timeout":
            raise self.timeout_error()
        if ended == "cancelled":
            return Response(status_code=499)  # the client is gone; nobody reads this
        err = finish_error(last)
        if err is not None:
            raise err
        text, calls, reasoning = "".join(parts), (), None
        if req.thinking:
            reasoning, text = split_reasoning(text)
        if req.reads_tool_calls and last.finish.value == "stop":
            reply = parse_tool_calls(text)
            text, calls = reply.content, reply.calls[:None if req.parallel_tool_calls else 1]
        body = response_body(req, self.state.opts.model_name, text, last.finish.value,
                             logprobs_body(self.state.tokenizer, req.logprobs, tokens),
                             stream_usage(stream, len(tokens)), tool_calls=calls,
                             reasoning=reasoning)
        return JSONResponse(body)

    async def sse(self, req: GenerationRequest, stream: EventStream,
                  deadline: float | None) -> AsyncIterator[str]:
        model, tokenizer, metrics = self.state.opts.model_name, self.state.tokenizer, \
            self.state.metrics
        n_tokens, offset = 0, 0
        reason = "cancelled"  # unless a finish event or the deadline says otherwise
        # thinking: the reasoning split off; with tools, a DSML block streamed call by call
        think = ReasoningFilter() if req.thinking else None
        calls = ToolCallStream(req.parallel_tool_calls) if req.reads_tool_calls else None
        call_ids: dict[int, str] = {}

        def pieces(text: str):
            """The chunks' (reasoning, content, call deltas) of a piece of the reply."""
            reasoning, content = think.feed(text) if think is not None else (None, text)
            deltas = []
            if calls is not None and content:
                content, deltas = calls.feed(content)
            return reasoning or None, content, call_deltas_body(deltas, call_ids)

        try:
            if req.endpoint is Endpoint.CHAT:
                yield _sse(chunk_body(req, model, text="", role=True))
            async for ev in self.events(stream, None, deadline):
                t = _token_out(ev)
                if t is not None:
                    n_tokens += 1
                lp = logprobs_body(tokenizer, req.logprobs, [t] if t else [], offset)
                offset += len(ev.text)
                reasoning, text, deltas = pieces(ev.text)
                if reasoning or text or deltas or lp is not None:
                    quiet = req.endpoint is Endpoint.CHAT and not text and (reasoning or deltas)
                    yield _sse(chunk_body(req, model, text=None if quiet else text, logprobs=lp,
                                          reasoning=reasoning, call_deltas=deltas))
                if ev.finish is not None:
                    reason = ev.finish.value
                    err = finish_error(ev)
                    if err is not None:
                        metrics.count_rejected(err.status)
                        yield _sse(err.body())
                    else:
                        finish = reason
                        if think is not None and not think.closed:
                            rest = think.flush()
                            if rest:
                                yield _sse(chunk_body(req, model, text=None, reasoning=rest))
                        if calls is not None:
                            rest = calls.finish()
                            if rest:
                                yield _sse(chunk_body(req, model, text=rest))
                            if calls.calls and calls.closed and reason == "stop":
                                finish = "tool_calls"
                        yield _sse(chunk_body(req, model, text=None if req.endpoint is
                                              Endpoint.CHAT else "", finish_reason=finish))
                        if req.include_usage:
                            yield _sse(usage_chunk(req, model, stream_usage(stream, n_tokens)))
            yield "data: [DONE]\n\n"
        except Ended as e:
            reason = e.reason
            metrics.count_rejected(504)
            yield _sse(self.timeout_error().body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the response task is cancelled)
            stream.cancel()
            self.record(stream, reason)

    async def generate(self, request: Request, endpoint: Endpoint,
                       parse: Callable[[object], GenerationRequest]) -> Response:
        """Count, authenticate, parse (`parse(body)` on a worker thread: it tokenizes), submit,
        then answer in JSON or as a stream."""
        st = self.state
        st.metrics.count_request(endpoint.value)
        st.check_key(request)
        req = await st.in_thread(parse, await st.json_body(request))
        submit = st.in_decode_thread if req.images else st.in_thread
        stream = await submit(self.submit, req)
        deadline = None if st.opts.request_timeout_s is None else \
            time.monotonic() + st.opts.request_timeout_s
        if req.stream:
            # the background cancel covers a client gone before the first chunk was sent
            return StreamingResponse(self.sse(req, stream, deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(stream.cancel))
        return await self.collect(req, stream, request, deadline)
