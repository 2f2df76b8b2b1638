"""What the server's routers share, made once per `create_app`: the frontend, the tokenizer, the
options, the metrics, the API-key check and the bounded pool of handler threads. No global
state: each app has its own, and each router closes over it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import anyio
from fastapi import Request

from dsv41.runtime.serving.frontend import Frontend
from dsv41.runtime.serving.http_limits import HttpLimits, parse_json_body
from dsv41.runtime.serving.metrics import ServerMetrics
from dsv41.runtime.serving.openai_api import (
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from dsv41.runtime.serving.prompts import TextBudget
from dsv41.runtime.serving.structured import GrammarVocab
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
    # what a client may send and how long it may take (http_limits.py)
    limits: HttpLimits = HttpLimits()
    max_image_decodes: int = 2  # requests with images checked (decoded) at once

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
        if self.max_image_decodes < 1:
            raise ValueError(f"max_image_decodes must be at least 1, got "
                             f"{self.max_image_decodes}.")
        self.limits.validate()
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
    # (all requests' threads, requests with images' submits: their images are decoded there)
    limiter: list[anyio.CapacityLimiter] = field(default_factory=list)

    def limiters(self) -> list[anyio.CapacityLimiter]:
        if not self.limiter:
            self.limiter += [anyio.CapacityLimiter(self.opts.max_waiting),
                             anyio.CapacityLimiter(self.opts.max_image_decodes)]
        return self.limiter

    async def in_thread(self, fn, *args):
        """`fn(*args)` on a worker thread, at most `max_waiting` at once: the event loop never
        blocks on a stream or a tokenizer."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiters()[0])

    async def in_decode_thread(self, fn, *args):
        """`fn(*args)` on a worker thread, at most `max_image_decodes` at once (a submit that
        decodes images: each can take hundreds of MB while it is decoded)."""
        async with self.limiters()[1]:
            return await self.in_thread(fn, *args)

    async def json_body(self, request: Request):
        """The request's body as JSON (read whole by http_limits.BodyLimits); an ApiError 400
        when it is not JSON or nests deeper than the limit."""
        return parse_json_body(await request.body(), self.opts.limits.max_json_depth)

    @cached_property
    def token_texts(self) -> TokenTexts:
        """Each token id's text, for tool_choice's constraints: built on the first constrained
        request, once per app."""
        return TokenTexts.of(self.tokenizer)

    @cached_property
    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer as llguidance sees it, for response_format's constraints: built on the
        first structured request, once per app."""
        return GrammarVocab.of(self.tokenizer)

    @cached_property
    def text_budget(self) -> TextBudget:
        """How prompts are measured against the context before they are tokenized whole:
        built on the first request, once per app."""
        return TextBudget.of(self.tokenizer, self.opts.max_seq_len)

    def parse_chat(self, body) -> GenerationRequest:
        return parse_chat(body, self.tokenizer, model_name=self.opts.model_name,
                          vocab_size=self.opts.vocab_size,
                          image_token_id=self.opts.image_token_id,
                          texts=lambda: self.token_texts, budget=self.text_budget,
                          grammar=lambda: self.grammar_vocab)

    def parse_completion(self, body) -> GenerationRequest:
        return parse_completion(body, self.tokenizer, model_name=self.opts.model_name,
                                vocab_size=self.opts.vocab_size, budget=self.text_budget,
                                grammar=lambda: self.grammar_vocab)
