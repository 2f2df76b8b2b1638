"""`POST /v1/chat/completions`: OpenAI's chat (messages, tools, images when the model has a
vision tower), parsed by openai_api.parse_chat (`AppState.parse_chat`) and answered by the
generation handler."""

from __future__ import annotations

from fastapi import APIRouter, Request

from dsv41.runtime.serving.api_schema import chat_body, request_body
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import Endpoint


def chat_router(gen: Generation) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions",
                 openapi_extra=request_body(chat_body(gen.state.opts.model_name)))
    async def chat_completions(request: Request):
        return await gen.generate(request, Endpoint.CHAT, gen.state.parse_chat)

    return router
