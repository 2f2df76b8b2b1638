"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the
chat endpoint's machinery. The body becomes a chat body (anthropic_api.chat_body), parsed by
`AppState.parse_chat`, submitted and read by turn_reply, then written in Anthropic's shapes:
a message, or server-sent events (`message_start`, `ping`, per content block
`content_block_start`, `content_block_delta` (`thinking_delta`, `text_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` with the stop reason and the
usage, `message_stop`; an error after the stream began is an `event: error`).

The key (when the server has one) may come as `x-api-key` (Anthropic's header) or as
`Authorization: Bearer`. Every error is Anthropic's `{"type": "error", "error": {...}}`."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsv41.runtime.serving.anthropic_api import (
    STOP_REASONS,
    chat_body,
    error_body,
    message_body,
    message_start,
    new_id,
    sse,
    usage_body,
)
from dsv41.runtime.serving.api_schema import messages_body, request_body
from dsv41.runtime.serving.frontend import EventStream
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import ApiError, ErrorType, GenerationRequest
from dsv41.runtime.serving.turn_reply import Piece, TurnEnd, pieces, start, whole


class _Blocks:
    """The content blocks of a streamed message: which one is open, and the events that open,
    fill and close them."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def start(self, block: dict) -> list[dict]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [{"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def piece(self, p: Piece) -> list[dict]:
        out: list[dict] = []
        if p.reasoning:
            if self.open != "thinking":
                out += self.start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta", "thinking": p.reasoning}))
        if p.text:
            if self.open != "text":
                out += self.start({"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": p.text}))
        for d in p.calls:
            if d.name is not None:
                out += self.start({"type": "tool_use", "id": new_id("toolu_"), "name": d.name,
                                   "input": {}})
            if d.arguments:
                out.append(self.delta({"type": "input_json_delta",
                                       "partial_json": d.arguments}))
        return out


def messages_router(gen: Generation) -> APIRouter:
    router = APIRouter()
    st = gen.state
    model = st.opts.model_name

    def check_key(request: Request) -> None:
        """Anthropic's `x-api-key`, else the app's `Authorization: Bearer` check."""
        given = request.headers.get("x-api-key")
        if st.opts.api_key is None or given is None:
            return st.check_key(request)
        if not hmac.compare_digest(given.encode(), st.opts.api_key.encode()):
            raise ApiError(401, "The API key is not valid: send `x-api-key: <key>` with the "
                           "key the server was started with.", type=ErrorType.AUTHENTICATION)

    def failed(e: ApiError) -> JSONResponse:
        st.metrics.rejected.inc(1, str(e.status))
        return JSONResponse(error_body(e), status_code=e.status)

    def parse(body) -> GenerationRequest:
        return st.parse_chat(chat_body(body))

    async def events(req: GenerationRequest, stream: EventStream, deadline: float | None,
                     msg_id: str) -> AsyncIterator[str]:
        yield sse(message_start(msg_id, model, stream.timing.prompt_tokens))
        yield sse({"type": "ping"})
        blocks = _Blocks()
        try:
            async for item in pieces(gen, req, stream, deadline):
                if isinstance(item, Piece):
                    for ev in blocks.piece(item):
                        yield sse(ev)
                    continue
                assert isinstance(item, TurnEnd)
                for ev in blocks.close():
                    yield sse(ev)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": STOP_REASONS[item.kind],
                                     "stop_sequence": item.stop_sequence},
                           "usage": usage_body(item.usage)})
                yield sse({"type": "message_stop"})
        except ApiError as e:
            st.metrics.rejected.inc(1, str(e.status))
            yield sse(error_body(e))

    @router.post("/v1/messages", openapi_extra=request_body(messages_body(model)))
    async def messages(request: Request):
        try:
            _, req, stream, deadline = await start(gen, request, "messages", check_key,
                                                   parse)
            msg_id = new_id("msg_")
            if req.stream:
                return StreamingResponse(events(req, stream, deadline, msg_id),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"},
                                         background=BackgroundTask(stream.cancel))
            reply = await whole(gen, req, stream, request, deadline)
            if reply is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            return JSONResponse(message_body(msg_id, model, reply))
        except ApiError as e:
            return failed(e)

    @router.post("/v1/messages/count_tokens",
                 openapi_extra=request_body(messages_body(model, counting=True)))
    async def count_tokens(request: Request):
        try:
            st.metrics.requests.inc(1, "messages_count_tokens")
            check_key(request)
            body = await st.json_body(request)
            req = await st.in_thread(lambda: st.parse_chat(chat_body(body, counting=True)))
            return {"input_tokens": len(req.prompt_ids)}
        except ApiError as e:
            return failed(e)

    return router
