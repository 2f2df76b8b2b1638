"""`POST /tokenize`: the token ids a request's prompt becomes, without generating (as vLLM's
endpoint of the same name): a chat body (`messages`, with `tools`, `reasoning_effort`,
`chat_template_kwargs`) or a completion body (`prompt`), checked exactly as the generation
endpoints check it. The reply: `tokens`, `count`, `max_model_len`, and `prompt`, the ids
spelled back with every marker (so the rendered format can be read: the effort line, the tool
section, the DSML blocks)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import APIRouter, Request

from dsv41.runtime.serving.api_schema import request_body, tokenize_body
from dsv41.runtime.serving.openai_api import GenerationRequest, bad_request
from dsv41.runtime.serving.state import AppState


def tokenize_router(st: AppState) -> APIRouter:
    router = APIRouter()

    def parse(body) -> GenerationRequest:
        if not isinstance(body, Mapping):
            raise bad_request("The request body must be a JSON object.")
        if ("messages" in body) == ("prompt" in body):
            raise bad_request("/tokenize takes either `messages` (a chat) or `prompt` (a "
                              "completion).")
        body = {"model": st.opts.model_name, **body}  # the served model unless named
        return st.parse_chat(body) if "messages" in body else st.parse_completion(body)

    @router.post("/tokenize", openapi_extra=request_body(tokenize_body(st.opts.model_name)))
    async def tokenize(request: Request):
        st.check_key(request)
        req = await st.in_thread(parse, await st.json_body(request))
        ids = list(req.prompt_ids)
        text = None if st.tokenizer is None else st.tokenizer.decode(ids, skip_special=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": st.opts.max_seq_len,
                "prompt": text}

    return router
