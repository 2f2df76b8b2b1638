"""`dsv41 serve`: an OpenAI-compatible HTTP server over a frontend (the continuous batcher, or
the EPD gateway: runtime/serving/frontend.py).

    app = create_app(batcher, tokenizer, ServerOptions(model_name="small", vocab_size=512))
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or ServerThread(app).start()

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (JSON, or server-sent events with
`stream: true`: one `data: {chunk}` per token, then a chunk with the finish reason, with
`stream_options.include_usage` a last chunk with the usage, then `data: [DONE]`), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus text through prometheus_client,
runtime/serving/metrics.py: vLLM's series names where vLLM has one), one router
per family (routes_chat, routes_completions, routes_models, routes_health, routes_tokenize:
`POST /tokenize`, a prompt's ids and spelling; the two generation families share
generation.py; routes_messages: Anthropic's `POST /v1/messages` and its count_tokens, and
routes_responses: OpenAI's `POST /v1/responses`, both translated into chat requests and read by
turn_reply.py). Requests are parsed by openai_api.py; the server only moves
events from a frontend's `EventStream` to the client. This module is the app around them: the
errors' shape, the API key, the routers joined.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad body
(malformed JSON, a bad field, a prompt too long for max_seq_len: the batcher's RequestError
message as it is), 401 for a missing or wrong API key (when one is set; /health and /metrics
stay open), 404 for an unknown model or path, 429 when the batcher's queue is full, 504 when a
non-streaming request outlives the per-request timeout (a stream gets an error event, then
`[DONE]`), 500 when the engine failed on the request; 413 for a body over the size limit, 408
for a head or body that arrives too slowly, 400 for JSON nested past the depth limit
(http_limits.py: `ServerOptions.limits`, enforced by the app's `BodyLimits` middleware and, for
the head timeout and the connection cap, by the uvicorn configuration of `run_server` and
`ServerThread`). `GET /openapi.json` describes the endpoints and their bodies (api_schema.py).

Cancellation: a client that goes away cancels its stream (`Stream.cancel()`; the sequence
leaves the batch at the next step), as does the timeout; both are counted in /metrics
(`dsv41:requests_finished_total{reason="cancelled"|"timeout"}`). The handlers never block the
event loop: they wait for events on worker threads (`poll_s` at a time, so a disconnect or the
deadline is seen within `poll_s`).

No global state: everything a handler uses is in `create_app`'s `AppState` (state.py).
"""

from __future__ import annotations

import hmac
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41.runtime.serving.frontend import Frontend
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.http_limits import BodyLimits, HttpLimits, server_config
from dsv41.runtime.serving.metrics import ServerMetrics
from dsv41.runtime.serving.openai_api import ApiError, ErrorType
from dsv41.runtime.serving.routes_chat import chat_router
from dsv41.runtime.serving.routes_completions import completions_router
from dsv41.runtime.serving.routes_health import health_router
from dsv41.runtime.serving.routes_messages import messages_router
from dsv41.runtime.serving.routes_models import models_router
from dsv41.runtime.serving.routes_responses import responses_router
from dsv41.runtime.serving.routes_tokenize import tokenize_router
from dsv41.runtime.serving.state import AppState, ServerOptions
from dsv41.runtime.serving.tokenizer import Tokenizer

__all__ = ["HttpLimits", "ServerOptions", "ServerThread", "create_app", "free_port",
           "run_server"]


def create_app(frontend: Frontend, tokenizer: Tokenizer, options: ServerOptions,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The ASGI app. The frontend must be running (`Batcher.start()`; a gateway runs from its
    construction); the app never stops it."""
    opts = options.validate()
    metrics = metrics or ServerMetrics(opts.model_name)
    if metrics.model_name != opts.model_name:
        raise ValueError(f"The metrics label the model {metrics.model_name!r}, the server serves "
                         f"{opts.model_name!r}; give ServerMetrics the served model's name.")
    metrics.watch(frontend.stats)
    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    # every body read whole within the size and time limits before a handler sees it
    app.add_middleware(BodyLimits, limits=opts.limits,
                       on_reject=metrics.count_rejected)

    def error(e: ApiError) -> JSONResponse:
        metrics.count_rejected(e.status)
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
        """Called by the /v1 handlers after they count the request (a 401 is counted too)."""
        if opts.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {opts.api_key}".encode()):
            what = "No API key was given" if not given else "The API key is not valid"
            raise ApiError(401, f"{what}: send `Authorization: Bearer <key>` with the key the "
                           "server was started with.", type=ErrorType.AUTHENTICATION,
                           code="invalid_api_key")

    state = AppState(frontend, tokenizer, opts, metrics, check_key)
    gen = Generation(state)
    for router in (chat_router(gen), completions_router(gen), models_router(state),
                   health_router(state), tokenize_router(state), messages_router(gen),
                   responses_router(gen)):
        app.include_router(router)
    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_server(app, host: str, port: int, limits: HttpLimits, *,
               log_level: str = "info") -> None:
    """uvicorn serving `app` under `limits` (its head timeout and connection cap; the body's
    limits are the app's) until it is stopped (Ctrl-C / SIGINT ends it normally): `dsv41 serve`.
    Exits with status 3 when it could not start (the port taken), as `uvicorn.run` does."""
    server = uvicorn.Server(server_config(app, host, port, limits, log_level=log_level))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(3)


class ServerThread:
    """uvicorn serving `app` on a background thread (tests, `dsv41 bench serve`), under
    `limits` (the head timeout and connection cap; give the app's `ServerOptions.limits`)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None,
                 limits: HttpLimits | None = None):
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(server_config(app, host, self.port, limits or HttpLimits(),
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
