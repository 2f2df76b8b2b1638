"""`POST /v1/chat/completions`: OpenAI's chat (messages, tools, images when the model has a
vision tower), parsed by openai_api.parse_chat and answered by the generation handler."""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter, Request

from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.openai_api import Endpoint, parse_chat
from dsv41.runtime.serving.tool_choice import TokenTexts


def chat_router(gen: Generation) -> APIRouter:
    router = APIRouter()
    st = gen.state
    texts = cache(lambda: TokenTexts.of(st.tokenizer))  # on the first constrained request

    def parse(body):
        return parse_chat(body, st.tokenizer, model_name=st.opts.model_name,
                          vocab_size=st.opts.vocab_size, image_token_id=st.opts.image_token_id,
                          texts=texts)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await gen.generate(request, Endpoint.CHAT, parse)

    return router
