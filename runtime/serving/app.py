"""`dsv41 serve`: an OpenAI-compatible HTTP server over the continuous batcher.

    app = create_app(batcher, tokenizer, ServerOptions(model_name="small", vocab_size=512))
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or ServerThread(app).start()

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (JSON, or server-sent events with
`stream: true`: one `data: {chunk}` per token, then a chunk with the finish reason, with
`stream_options.include_usage` a last chunk with the usage, then `data: [DONE]`), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus text, runtime/metrics.py). Requests are
parsed by runtime/openai_api.py; the server only moves events from a batcher `Stream` to the
client.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body
(malformed JSON, a bad field, a prompt too long for max_seq_len: the batcher's RequestError
message as it is), 401 for a missing or wrong API key (when one is set; /health and /metrics
stay open), 404 for an unknown model or path, 429 when the batcher's queue is full, 504 when a
non-streaming request outlives the per-request timeout (a stream gets an error event, then
`[DONE]`), 500 when the engine failed on the request.

Cancellation: a client that goes away cancels its stream (`Stream.cancel()`; the sequence
leaves the batch at the next step), as does the timeout; both are counted in /metrics
(`dsv41_requests_finished_total{reason="cancelled"|"timeout"}`). The handlers never block the
event loop: they wait for events on worker threads (`poll_s` at a time, so a disconnect or the
deadline is seen within `poll_s`).

No global state: everything a handler uses is in `create_app`'s closure.
"""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41.runtime.serving.batcher import Batcher, FinishReason, QueueFull, Stream, TokenEvent
from dsv41.runtime.serving.metrics import FinishTiming, ServerMetrics
from dsv41.runtime.serving.openai_api import (
    ApiError,
    Endpoint,
    ErrorType,
    GenerationRequest,
    TokenOut,
    Usage,
    chunk_body,
    logprobs_body,
    parse_chat,
    parse_completion,
    response_body,
    usage_chunk,
)
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import ToolCallFilter, parse_tool_calls


@dataclass(frozen=True)
class ServerOptions:
    model_name: str  # the one model id served (`model` must name it)
    vocab_size: int
    max_seq_len: int
    api_key: str | None = None  # None: no authentication
    request_timeout_s: float | None = 600.0  # None: no per-request timeout
    poll_s: float = 0.25  # how often a waiting handler looks at the client and the deadline
    max_waiting: int = 128  # handler threads waiting on streams at once (a bound, not a queue)
    # the model's image placeholder id when it has a vision tower (chats then take image_url
    # parts); None: text only
    image_token_id: int | None = None

    def validate(self) -> ServerOptions:
        if not self.model_name:
            raise ValueError("The served model needs a name.")
        if self.api_key is not None and not self.api_key:
            raise ValueError("The API key must not be empty (leave it out for no key).")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"The request timeout must be positive seconds, got "
                             f"{self.request_timeout_s}.")
        if not self.poll_s > 0 or self.max_waiting < 1:
            raise ValueError("poll_s must be positive and max_waiting at least 1.")
        return self


class _Ended(Exception):
    """The request ended without a finish event: the client left or the deadline passed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason  # "cancelled" | "timeout"


@dataclass
class _Collected:
    text: str
    tokens: list[TokenOut]
    finish: TokenEvent | None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _finish_error(ev: TokenEvent) -> ApiError | None:
    """The error a final event stands for, if it is not a normal end."""
    if ev.finish is FinishReason.ERROR:
        return ApiError(500, f"The engine failed on this request: {ev.error or 'no message'}",
                        type=ErrorType.SERVER)
    if ev.finish is FinishReason.CANCELLED:
        return ApiError(503, "The request was cancelled by the server (it is stopping).",
                        type=ErrorType.SERVER)
    return None


def create_app(batcher: Batcher, tokenizer: Tokenizer, options: ServerOptions,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The ASGI app. The batcher must be running (`Batcher.start()`); the app never stops it."""
    opts = options.validate()
    metrics = metrics or ServerMetrics()
    created = int(time.time())
    limiter: list[anyio.CapacityLimiter] = []  # made in the event loop, on first use
    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: ApiError) -> JSONResponse:
        metrics.rejected.inc(1, str(e.status))
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        kind = ErrorType.NOT_FOUND if e.status_code == 404 else ErrorType.INVALID_REQUEST
        return error(ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}.",
                              type=kind))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return error(ApiError(400, f"Invalid request: {e.errors()!r:.300}"))

    def check_key(request: Request) -> None:
        if opts.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {opts.api_key}".encode()):
            what = "No API key was given" if not given else "The API key is not valid"
            raise ApiError(401, f"{what}: send `Authorization: Bearer <key>` with the key the "
                           "server was started with.", type=ErrorType.AUTHENTICATION,
                           code="invalid_api_key")

    async def in_thread(fn, *args):
        if not limiter:
            limiter.append(anyio.CapacityLimiter(opts.max_waiting))
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter[0])

    def submit(req: GenerationRequest) -> Stream:
        try:
            return batcher.submit(list(req.prompt_ids), req.params, req.images)
        except QueueFull as e:
            raise ApiError(429, f"The server's queue is full ({e}); retry later.",
                           type=ErrorType.RATE_LIMIT, code="rate_limit_exceeded") from None
        except ValueError as e:  # RequestError: ids, lengths, params; the message is the 400's
            raise ApiError(400, str(e)) from None

    def record(stream: Stream, reason: str) -> None:
        t = stream.timing
        metrics.observe_finish(reason, FinishTiming(t.queued_s, t.first_token_s, t.per_token_s,
                                                    t.completion_tokens))

    async def events(stream: Stream, request: Request | None,
                     deadline: float | None) -> AsyncIterator[TokenEvent]:
        """The stream's events; raises _Ended (after cancelling it) when the client leaves
        (checked here when `request` is given: non-streaming) or the deadline passes."""
        while True:
            ev = await in_thread(stream.get, opts.poll_s)
            if ev is not None:
                yield ev
                if ev.finish is not None:
                    return
                continue
            if request is not None and await request.is_disconnected():
                stream.cancel()
                raise _Ended("cancelled")
            if deadline is not None and time.monotonic() > deadline:
                stream.cancel()
                raise _Ended("timeout")

    def token_out(ev: TokenEvent) -> TokenOut | None:
        if ev.token_id is None:
            return None
        return TokenOut(ev.token_id, ev.text, ev.logprob, ev.top)

    def usage(req: GenerationRequest, stream: Stream, n_tokens: int) -> Usage:
        t = stream.timing  # its prompt as queued: each image placeholder counts as its span
        return Usage(t.prompt_tokens, n_tokens, t.reused_tokens)

    async def collect(req: GenerationRequest, stream: Stream, request: Request,
                      deadline: float | None) -> JSONResponse:
        parts, tokens, last = [], [], None
        reason, ended = "cancelled", None
        try:
            async for ev in events(stream, request, deadline):
                parts.append(ev.text)
                t = token_out(ev)
                if t is not None:
                    tokens.append(t)
                last = ev
            reason = last.finish.value
        except _Ended as e:
            reason = ended = e.reason
        finally:
            stream.cancel()  # a no-op once finished; frees the slot if the handler is torn down
            record(stream, reason)
        if ended == "timeout":
            raise ApiError(504, f"The request did not finish within the server's request "
                           f"timeout of {opts.request_timeout_s:g} s.", type=ErrorType.TIMEOUT)
        if ended == "cancelled":
            return Response(status_code=499)  # the client is gone; nobody reads this
        err = _finish_error(last)
        if err is not None:
            raise err
        text, calls = "".join(parts), ()
        if req.tool_format is not None and last.finish.value == "stop":
            reply = parse_tool_calls(text, req.tool_format)
            text, calls = reply.content, reply.calls
        body = response_body(req, opts.model_name, text, last.finish.value,
                             logprobs_body(tokenizer, req.logprobs, tokens),
                             usage(req, stream, len(tokens)), tool_calls=calls)
        return JSONResponse(body)

    async def sse(req: GenerationRequest, stream: Stream,
                  deadline: float | None) -> AsyncIterator[str]:
        model = opts.model_name
        n_tokens, offset = 0, 0
        reason = "cancelled"  # unless a finish event or the deadline says otherwise
        # with tools, what may be a tool-call block is held back until the reply ends
        held = None if req.tool_format is None else ToolCallFilter(req.tool_format)
        try:
            if req.endpoint is Endpoint.CHAT:
                yield _sse(chunk_body(req, model, text="", role=True))
            async for ev in events(stream, None, deadline):
                t = token_out(ev)
                if t is not None:
                    n_tokens += 1
                lp = logprobs_body(tokenizer, req.logprobs, [t] if t else [], offset)
                offset += len(ev.text)
                text = ev.text if held is None else held.feed(ev.text)
                if text or lp is not None:
                    yield _sse(chunk_body(req, model, text=text, logprobs=lp))
                if ev.finish is not None:
                    reason = ev.finish.value
                    err = _finish_error(ev)
                    if err is not None:
                        metrics.rejected.inc(1, str(err.status))
                        yield _sse(err.body())
                    else:
                        finish = reason
                        if held is not None:
                            reply = held.finish()
                            if reply.content:
                                yield _sse(chunk_body(req, model, text=reply.content))
                            if reply.calls and reason == "stop":
                                finish = "tool_calls"
                                yield _sse(chunk_body(req, model, text=None,
                                                      tool_calls=reply.calls))
                        yield _sse(chunk_body(req, model, text=None if req.endpoint is
                                              Endpoint.CHAT else "", finish_reason=finish))
                        if req.include_usage:
                            yield _sse(usage_chunk(req, model, usage(req, stream, n_tokens)))
            yield "data: [DONE]\n\n"
        except _Ended as e:
            reason = e.reason
            err = ApiError(504, f"The request did not finish within the server's request "
                           f"timeout of {opts.request_timeout_s:g} s.", type=ErrorType.TIMEOUT)
            metrics.rejected.inc(1, "504")
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the response task is cancelled)
            stream.cancel()
            record(stream, reason)

    async def generate(request: Request, endpoint: Endpoint):
        metrics.requests.inc(1, endpoint.value)
        check_key(request)
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"The request body is not valid JSON: {e}.") from None
        if endpoint is Endpoint.CHAT:
            req = await in_thread(lambda: parse_chat(
                body, tokenizer, model_name=opts.model_name, vocab_size=opts.vocab_size,
                image_token_id=opts.image_token_id))
        else:
            req = await in_thread(lambda: parse_completion(
                body, tokenizer, model_name=opts.model_name, vocab_size=opts.vocab_size))
        stream = await in_thread(submit, req)
        deadline = None if opts.request_timeout_s is None else \
            time.monotonic() + opts.request_timeout_s
        if req.stream:
            # the background cancel covers a client gone before the first chunk was sent
            return StreamingResponse(sse(req, stream, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(stream.cancel))
        return await collect(req, stream, request, deadline)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, Endpoint.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, Endpoint.COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request):
        metrics.requests.inc(1, "models")
        check_key(request)
        return {"object": "list", "data": [
            {"id": opts.model_name, "object": "model", "created": created, "owned_by": "dsv41",
             "max_model_len": opts.max_seq_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text():
        text = metrics.render(batcher.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on a background thread (tests, `dsv41 bench serve`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="dsv41-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"The server did not start on {self.url}.")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
