"""`POST /v1/completions`: OpenAI's legacy text completion (a prompt as text or token ids),
parsed by openai_api.parse_completion (`AppState.parse_completion`) and answered by the
generation handler."""

from __future__ import annotations

from fastapi import APIRouter, Request

from dsv41.runtime.serving.api_schema import completion_body, request_body
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import Endpoint


def completions_router(gen: Generation) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions",
                 openapi_extra=request_body(completion_body(gen.state.opts.model_name)))
    async def completions(request: Request):
        return await gen.generate(request, Endpoint.COMPLETIONS, gen.state.parse_completion)

    return router
