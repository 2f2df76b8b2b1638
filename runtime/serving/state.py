"""What the server's routers share, made once per `create_app`: the frontend, the tokenizer, the
options, the metrics, the API-key check and the bounded pool of handler threads. No global
state: each app has its own, and each router closes over it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import anyio
from fastapi import Request

from dsv41.runtime.serving.frontend import Frontend
from dsv41.runtime.serving.metrics import ServerMetrics
from dsv41.runtime.serving.openai_api import (
    ApiError,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_choice import TokenTexts


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


@dataclass
class AppState:
    frontend: Frontend
    tokenizer: Tokenizer
    opts: ServerOptions  # validated
    metrics: ServerMetrics
    check_key: Callable[[Request], None]  # raises ApiError 401 (app.py's; open without a key)
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' `created`
    # made in the event loop, on first use (anyio needs a running loop)
    limiter: list[anyio.CapacityLimiter] = field(default_factory=list)

    async def in_thread(self, fn, *args):
        """`fn(*args)` on a worker thread, at most `max_waiting` at once: the event loop never
        blocks on a stream or a tokenizer."""
        if not self.limiter:
            self.limiter.append(anyio.CapacityLimiter(self.opts.max_waiting))
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter[0])

    async def json_body(self, request: Request):
        """The request's body as JSON (an ApiError 400 when it is not)."""
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"The request body is not valid JSON: {e}.") from None

    @cached_property
    def token_texts(self) -> TokenTexts:
        """Each token id's text, for tool_choice's constraints: built on the first constrained
        request, once per app."""
        return TokenTexts.of(self.tokenizer)

    def parse_chat(self, body) -> GenerationRequest:
        return parse_chat(body, self.tokenizer, model_name=self.opts.model_name,
                          vocab_size=self.opts.vocab_size,
                          image_token_id=self.opts.image_token_id,
                          texts=lambda: self.token_texts)

    def parse_completion(self, body) -> GenerationRequest:
        return parse_completion(body, self.tokenizer, model_name=self.opts.model_name,
                                vocab_size=self.opts.vocab_size)
