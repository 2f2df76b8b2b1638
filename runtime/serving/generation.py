"""The generation endpoints' common half (`/v1/chat/completions`, `/v1/completions`): a parsed
request submitted to the frontend, then its `EventStream` moved to the client, as one JSON
response or as server-sent events (one `data: {chunk}` per token, a chunk with the finish
reason, with `stream_options.include_usage` a chunk with the usage, then `data: [DONE]`).

A request of n samples (`n`, completions' `best_of`) is submitted once (`SampleFrontend`: the
prompt prefilled once, its rows forked) and its events, each carrying its choice's `index`, are
moved to the client as n choices: streamed chunks carry each choice's `index`, the usage counts
the prompt once and the completion tokens of every sample; with best_of > n the n samples of
highest mean token logprob are returned, best first.

A client that goes away cancels its stream, as does the per-request timeout (504; a stream gets
an error event, then `[DONE]`); both are counted in /metrics. The handlers wait for events on
worker threads (`poll_s` at a time, so a disconnect or the deadline is seen within `poll_s`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsv41.runtime.serving.frontend import (
    EventStream,
    FinishReason,
    QueueFull,
    SampleFrontend,
    TokenEvent,
)
from dsv41.runtime.serving.metrics import FinishTiming
from dsv41.runtime.serving.openai_api import (
    ApiError,
    Endpoint,
    ErrorType,
    GenerationRequest,
    PromptCache,
    TokenOut,
    Usage,
    argument_error,
    call_deltas_body,
    choice_body,
    choices_body,
    chunk_body,
    logprobs_body,
    usage_chunk,
)
from dsv41.runtime.serving.release_format import ToolCall
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


@dataclass
class _Choice:
    """What one sample of a request produced (collected for the JSON answer)."""

    parts: list[str] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    last: TokenEvent | None = None  # its final event

    def mean_logprob(self) -> float:
        """best_of's rank: the mean of its tokens' logprobs (-inf without tokens)."""
        got = [t.logprob for t in self.tokens if t.logprob is not None]
        return sum(got) / len(got) if got else -math.inf


def best_of(choices: Sequence[_Choice], n: int) -> list[_Choice]:
    """The n choices of highest mean token logprob, best first (the lower index on a tie)."""
    order = sorted(range(len(choices)), key=lambda i: -choices[i].mean_logprob())
    return [choices[i] for i in order[:n]]


class Generation:
    """One app's generation handler over its `AppState`."""

    def __init__(self, state: AppState):
        self.state = state

    def submit(self, req: GenerationRequest) -> EventStream:
        frontend = self.state.frontend
        try:
            if req.samples == 1:
                return frontend.submit(list(req.prompt_ids), req.params, req.images)
            if not isinstance(frontend, SampleFrontend):
                raise ApiError(400, f"This server's frontend serves one sample per request; "
                               f"n and best_of must be 1, not {req.samples}.", param="n")
            return frontend.submit_samples(list(req.prompt_ids), req.params, req.samples,
                                           req.images)
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
                     deadline: float | None, samples: int = 1) -> AsyncIterator[TokenEvent]:
        """The stream's events, until the final events of its `samples`; raises Ended (after
        cancelling it) when the client leaves (checked here when `request` is given:
        non-streaming) or the deadline passes."""
        open_ = samples
        while True:
            ev = await self.state.in_thread(stream.get, self.state.opts.poll_s)
            if ev is not None:
                yield ev
                if ev.finish is not None:
                    open_ -= 1
                    if not open_:
                        return
                continue
            if request is not None and await request.is_disconnected():
                stream.cancel()
                raise Ended("cancelled")
            if deadline is not None and time.monotonic() > deadline:
                stream.cancel()
                raise Ended("timeout")

    async def read_all(self, stream: EventStream, request: Request, deadline: float | None,
                       samples: int, feed: Callable[[TokenEvent], None]
                       ) -> list[TokenEvent] | None:
        """Every event of the stream's `samples` through `feed`, then the final event of each
        (by its index), or None when the client went away; ApiError for the timeout or a
        sample's finish error. The request is recorded in /metrics once, whatever happens."""
        finals: list[TokenEvent | None] = [None] * samples
        reason, ended = "cancelled", None
        try:
            async for ev in self.events(stream, request, deadline, samples):
                feed(ev)
                finals[ev.index] = ev
            reason = finals[0].finish.value
        except Ended as e:
            reason = ended = e.reason
        finally:
            stream.cancel()  # a no-op once finished; frees the slot if the handler is torn down
            self.record(stream, reason)
        if ended == "timeout":
            raise self.timeout_error()
        if ended == "cancelled":
            return None
        for ev in finals:
            err = finish_error(ev)
            if err is not None:
                raise err
        return finals

    async def collect(self, req: GenerationRequest, stream: EventStream, request: Request,
                      deadline: float | None) -> Response:
        got = [_Choice() for _ in range(req.samples)]

        def feed(ev: TokenEvent) -> None:
            c = got[ev.index]
            c.parts.append(ev.text)
            t = _token_out(ev)
            if t is not None:
                c.tokens.append(t)
            c.last = ev

        if await self.read_all(stream, request, deadline, req.samples, feed) is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        chosen = best_of(got, req.n) if req.samples > req.n else got
        choices = [self._choice(req, c, i) for i, c in enumerate(chosen)]
        usage = stream_usage(stream, sum(len(c.tokens) for c in got))
        return JSONResponse(choices_body(req, self.state.opts.model_name, choices, usage))

    def _choice(self, req: GenerationRequest, c: _Choice, index: int) -> dict:
        """One choice of the JSON answer from what its sample produced."""
        finish = c.last.finish.value
        text, calls, reasoning = "".join(c.parts), (), None
        if req.thinking:
            reasoning, text = split_reasoning(text)
        if req.reads_tool_calls and finish == "stop":
            reply = parse_tool_calls(text)
            text, calls = reply.content, reply.calls[:None if req.parallel_tool_calls else 1]
        return choice_body(req, text, finish,
                           logprobs_body(self.state.tokenizer, req.logprobs, c.tokens),
                           tool_calls=calls, reasoning=reasoning, index=index)

    async def sse(self, req: GenerationRequest, stream: EventStream,
                  deadline: float | None) -> AsyncIterator[str]:
        model, metrics = self.state.opts.model_name, self.state.metrics
        n_tokens, open_ = 0, req.samples
        reason = "cancelled"  # unless a finish event or the deadline says otherwise
        choices = [_StreamedChoice(req, model, self.state.tokenizer, i)
                   for i in range(req.samples)]
        try:
            if req.endpoint is Endpoint.CHAT:
                for i in range(req.samples):
                    yield _sse(chunk_body(req, model, text="", role=True, index=i))
            async for ev in self.events(stream, None, deadline, req.samples):
                if ev.token_id is not None:
                    n_tokens += 1
                for chunk in choices[ev.index].chunks(ev):
                    yield _sse(chunk)
                if ev.finish is not None:
                    open_ -= 1
                    reason = ev.finish.value if ev.index == 0 else reason
                    err = finish_error(ev)
                    if err is not None:
                        metrics.count_rejected(err.status)
                        yield _sse(err.body())
                    elif req.include_usage and not open_:
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


class _StreamedChoice:
    """One choice of a streamed answer: its reply's pieces as chunks (`index`: its choice's).
    Thinking: the reasoning split off; with tools, a DSML block streamed call by call."""

    def __init__(self, req: GenerationRequest, model: str, tokenizer, index: int):
        self.req, self.model, self.tokenizer, self.index = req, model, tokenizer, index
        self.think = ReasoningFilter() if req.thinking else None
        self.calls = ToolCallStream(req.parallel_tool_calls) if req.reads_tool_calls else None
        self.call_ids: dict[int, str] = {}
        self.streamed: dict[int, list[str]] = {}  # each call's name and argument pieces so far
        self.offset = 0  # completions logprobs' text_offset

    def _chunk(self, **kw) -> dict:
        return chunk_body(self.req, self.model, index=self.index, **kw)

    def _pieces(self, text: str):
        """The chunks' (reasoning, content, call deltas) of a piece of the reply."""
        reasoning, content = self.think.feed(text) if self.think is not None else (None, text)
        deltas = []
        if self.calls is not None and content:
            content, deltas = self.calls.feed(content)
            for d in deltas:
                self.streamed.setdefault(d.index, [d.name or ""]).append(d.arguments)
        return reasoning or None, content, call_deltas_body(deltas, self.call_ids)

    def argument_errors(self) -> list[dict]:
        """After the block: `delta.tool_calls` entries naming the calls whose arguments miss
        their tool's schema (`dsv41_argument_error`, by the call's index)."""
        out = []
        for i, (name, *pieces) in sorted(self.streamed.items()):
            err = argument_error(ToolCall(name, "".join(pieces)), self.req.tool_choice)
            if err:
                out.append({"index": i, **err})
        return out

    def chunks(self, ev: TokenEvent) -> list[dict]:
        """The chunks of one event of this choice: its piece of the reply, and at its finish
        (a normal one: an error is the caller's) what the filters held and the finish reason."""
        req, out = self.req, []
        t = _token_out(ev)
        lp = logprobs_body(self.tokenizer, req.logprobs, [t] if t else [], self.offset)
        self.offset += len(ev.text)
        reasoning, text, deltas = self._pieces(ev.text)
        if reasoning or text or deltas or lp is not None:
            quiet = req.endpoint is Endpoint.CHAT and not text and (reasoning or deltas)
            out.append(self._chunk(text=None if quiet else text, logprobs=lp,
                                   reasoning=reasoning, call_deltas=deltas))
        if ev.finish is None or finish_error(ev) is not None:
            return out
        finish = ev.finish.value
        if self.think is not None and not self.think.closed:
            rest = self.think.flush()
            if rest:
                out.append(self._chunk(text=None, reasoning=rest))
        if self.calls is not None:
            rest = self.calls.finish()
            if rest:
                out.append(self._chunk(text=rest))
            if self.calls.calls and self.calls.closed and finish == "stop":
                finish = "tool_calls"
                errors = self.argument_errors()
                if errors:
                    out.append(self._chunk(text=None, call_deltas=errors))
        out.append(self._chunk(text=None if req.endpoint is Endpoint.CHAT else "",
                               finish_reason=finish))
        return out
