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

import json
import time
from collections.abc import AsyncIterator, Mapping

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from dsv41.runtime.serving.api_schema import request_body, responses_body
from dsv41.runtime.serving.frontend import EventStream
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import ApiError, GenerationRequest
from dsv41.runtime.serving.responses_api import (
    StreamItems,
    chat_body,
    new_id,
    output_items,
    response_object,
)
from dsv41.runtime.serving.turn_reply import Piece, TurnEnd, pieces, start, whole


def responses_router(gen: Generation) -> APIRouter:
    router = APIRouter()
    st = gen.state
    model = st.opts.model_name

    async def events(req: GenerationRequest, stream: EventStream, deadline: float | None,
                     body: Mapping, resp_id: str, created: int) -> AsyncIterator[str]:
        seq = 0

        def sse(event: dict) -> str:
            nonlocal seq
            seq += 1
            event = {**event, "sequence_number": seq - 1}
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        def response(items: list[dict], end: TurnEnd | None) -> dict:
            return response_object(resp_id, created, model, body, output=items, end=end)

        yield sse({"type": "response.created", "response": response([], None)})
        yield sse({"type": "response.in_progress", "response": response([], None)})
        items = StreamItems()
        try:
            async for item in pieces(gen, req, stream, deadline):
                if isinstance(item, Piece):
                    for ev in items.piece(item):
                        yield sse(ev)
                    continue
                assert isinstance(item, TurnEnd)
                for ev in items.finish(item):
                    yield sse(ev)
                final = response(items.done, item)
                kind = "response.completed" if final["status"] == "completed" else \
                    "response.incomplete"
                yield sse({"type": kind, "response": final})
        except ApiError as e:
            st.metrics.rejected.inc(1, str(e.status))
            yield sse({"type": "error", "code": e.code or e.type.value, "message": e.message,
                       "param": e.param})
            failed = {**response(items.done, None), "status": "failed",
                      "error": {"code": e.code or e.type.value, "message": e.message}}
            yield sse({"type": "response.failed", "response": failed})

    def parse(body) -> GenerationRequest:
        return st.parse_chat(chat_body(body))

    @router.post("/v1/responses", openapi_extra=request_body(responses_body(model)))
    async def responses(request: Request):
        # the body is echoed in the response object (its settings)
        body, req, stream, deadline = await start(gen, request, "responses", st.check_key,
                                                  parse)
        resp_id, created = new_id("resp_"), int(time.time())
        if req.stream:
            return StreamingResponse(events(req, stream, deadline, body, resp_id, created),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(stream.cancel))
        reply = await whole(gen, req, stream, request, deadline)
        if reply is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(response_object(resp_id, created, model, body,
                                            output=output_items(reply), end=reply.end))

    return router
