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

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dsv41.runtime.serving.anthropic_api import MessageWriter, chat_body, error_body, new_id
from dsv41.runtime.serving.api_schema import messages_body, request_body
from dsv41.runtime.serving.frontend import EventStream
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import ApiError, ErrorType, GenerationRequest
from dsv41.runtime.serving.turn_reply import answer


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
        st.metrics.count_rejected(e.status)
        return JSONResponse(error_body(e), status_code=e.status)

    def parse(body) -> GenerationRequest:
        return st.parse_chat(chat_body(body))

    def writer(body, stream: EventStream) -> MessageWriter:
        return MessageWriter(new_id("msg_"), model, lambda: stream.timing.prompt_tokens)

    @router.post("/v1/messages", openapi_extra=request_body(messages_body(model)))
    async def messages(request: Request):
        try:
            return await answer(gen, request, "messages", check_key, parse, writer)
        except ApiError as e:
            return failed(e)

    @router.post("/v1/messages/count_tokens",
                 openapi_extra=request_body(messages_body(model, counting=True)))
    async def count_tokens(request: Request):
        try:
            st.metrics.count_request("messages_count_tokens")
            check_key(request)
            body = await st.json_body(request)
            req = await st.in_thread(lambda: st.parse_chat(chat_body(body, counting=True)))
            return {"input_tokens": len(req.prompt_ids)}
        except ApiError as e:
            return failed(e)

    return router
