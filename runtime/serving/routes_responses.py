"""`POST /v1/responses`: OpenAI's Responses API over the chat endpoint's machinery. The body
becomes a chat body (responses_api.chat_body), parsed by `AppState.parse_chat`, submitted and
read by turn_reply, then written as a response object, or as server-sent events
(`response.created`, `response.in_progress`; per output item `response.output_item.added`,
`response.content_part.added`, its deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`,
`response.content_part.done`, `response.output_item.done`; then `response.completed`, or
`response.incomplete` when max_output_tokens cut the reply; an error after the stream began is
an `error` event, then `response.failed`). Each event carries its `sequence_number`.

Nothing is stored: `previous_response_id` is a 400 (responses_api.py). Errors are OpenAI's
shape, as on `/v1/chat/completions`; the key is the app's `Authorization: Bearer`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from dsv41.runtime.serving.api_schema import request_body, responses_body
from dsv41.runtime.serving.frontend import EventStream
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import GenerationRequest
from dsv41.runtime.serving.responses_api import ResponseWriter, chat_body, new_id
from dsv41.runtime.serving.turn_reply import answer


def responses_router(gen: Generation) -> APIRouter:
    router = APIRouter()
    st = gen.state
    model = st.opts.model_name

    def parse(body) -> GenerationRequest:
        return st.parse_chat(chat_body(body))

    def writer(body, stream: EventStream) -> ResponseWriter:
        # the body is echoed in the response object (its settings)
        return ResponseWriter(new_id("resp_"), int(time.time()), model, body)

    @router.post("/v1/responses", openapi_extra=request_body(responses_body(model)))
    async def responses(request: Request):
        return await answer(gen, request, "responses", st.check_key, parse, writer)

    return router
