"""`POST /tokenize`: the token ids a request's prompt becomes, without generating (as vLLM's
endpoint of the same name): a chat body (`messages`, with `tools`, `reasoning_effort`,
`chat_template_kwargs`) or a completion body (`prompt`), checked exactly as the generation
endpoints check it. The reply: `tokens`, `count`, `max_model_len`, and `prompt`, the ids
spelled back with every marker (so the rendered format can be read: the effort line, the tool
section, the DSML blocks).

`POST /detokenize` (vLLM's shape): `{"tokens": [ids]}` (or `ids`; `model`, if given, the served
one) -> `{"prompt": text}`, every marker spelled, so `/tokenize`'s `tokens` come back as its
`prompt`. An id outside the tokenizer is a 400 naming it."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import APIRouter, Request

from dsv41.runtime.serving.api_schema import detokenize_body, request_body, tokenize_body
from dsv41.runtime.serving.openai_api import ApiError, ErrorType, GenerationRequest, bad_request
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

    def detokenized(body) -> str:
        if not isinstance(body, Mapping):
            raise bad_request("The request body must be a JSON object.")
        if ("tokens" in body) == ("ids" in body):
            raise bad_request("/detokenize takes `tokens` (or `ids`): a list of token ids.")
        name = "tokens" if "tokens" in body else "ids"
        model = body.get("model")
        if model is not None and model != st.opts.model_name:
            raise ApiError(404, f"The model {model!r:.60} does not exist; this server serves "
                           f"{st.opts.model_name!r}.", type=ErrorType.NOT_FOUND, param="model",
                           code="model_not_found")
        ids = body[name]
        n = st.tokenizer.n_ids
        if not isinstance(ids, list):
            raise bad_request(f"{name} must be a list of token ids.", name)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
                raise bad_request(f"{name}[{i}] must be a token id from 0 to {n - 1}, not "
                                  f"{t!r:.60}.", name)
        return st.tokenizer.decode(ids, skip_special=False)

    @router.post("/detokenize",
                 openapi_extra=request_body(detokenize_body(st.opts.model_name)))
    async def detokenize(request: Request):
        st.check_key(request)
        text = await st.in_thread(detokenized, await st.json_body(request))
        return {"prompt": text}

    return router
