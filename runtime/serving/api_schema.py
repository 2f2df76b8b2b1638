"""The request bodies of the server's POST endpoints as JSON Schemas, for its OpenAPI document
(`GET /openapi.json`): what a client (or a fuzzer, tests/test_serve_fuzz.py) learns of the
fields openai_api.py reads. They describe the bodies; they do not check them: the handlers
parse every body themselves (openai_api.parse_chat / parse_completion), so a body outside
these schemas is a 400 naming its bad field, never a pydantic error.

    openapi_extra=request_body(chat_body(model_name))   # on the route
"""

from __future__ import annotations

from dsv41.runtime.engine.sampling import MAX_LOGPROBS, MAX_SAMPLES

_NUMBER = {"type": "number"}
_BOOL = {"type": "boolean"}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
_IMAGE_PART = {"type": "object", "required": ["type", "image_url"],
               "properties": {"type": {"enum": ["image_url"]},
                              "image_url": {"type": "object", "required": ["url"],
                                            "properties": {"url": {"type": "string"}}}}}
_TOOL_CALL = {"type": "object", "required": ["type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"},
                          {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}}]},
    "reasoning_content": {"type": "string"},
    "tool_calls": {"type": "array", "items": _TOOL_CALL},
    "tool_call_id": {"type": "string"}, "name": {"type": "string"}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
_RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"enum": ["json_schema"]},
        "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "schema": {"type": "object"}, "strict": _BOOL}}}}]}


def _sampling(model_name: str) -> dict:
    """The fields chat and completions share."""
    return {
        "model": {"type": "string", "enum": [model_name]},
        "stream": _BOOL,
        "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER,
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "seed": {"type": "integer"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop": _STOP,
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": _BOOL,
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES},
        "response_format": _RESPONSE_FORMAT,
    }


def chat_body(model_name: str) -> dict:
    """`POST /v1/chat/completions`."""
    return {"type": "object", "required": ["model", "messages"], "properties": {
        **_sampling(model_name),
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": _BOOL,
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"enum": ["function"]},
                "function": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string"}}}}}]},
        "parallel_tool_calls": _BOOL,
        "reasoning_effort": {"anyOf": [{"enum": ["low", "high", "max"]},
                                       {"type": "integer", "minimum": 1, "maximum": 100}]},
        "chat_template_kwargs": {"type": "object", "properties": {"thinking": _BOOL}},
    }}


def _prompt() -> dict:
    return {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "minItems": 1,
                       "items": {"type": "integer", "minimum": 0}}]}


def completion_body(model_name: str) -> dict:
    """`POST /v1/completions`."""
    return {"type": "object", "required": ["model", "prompt"], "properties": {
        **_sampling(model_name), "prompt": _prompt(),
        "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_SAMPLES},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}}}


def tokenize_body(model_name: str) -> dict:
    """`POST /tokenize`: a chat's fields or a completion's prompt."""
    chat = chat_body(model_name)["properties"]
    return {"anyOf": [
        {"type": "object", "required": ["messages"],
         "properties": {k: chat[k] for k in ("model", "messages", "tools",
                                             "reasoning_effort", "chat_template_kwargs")}},
        {"type": "object", "required": ["prompt"],
         "properties": {"model": chat["model"], "prompt": _prompt()}}]}


def detokenize_body(model_name: str) -> dict:
    """`POST /detokenize`: token ids (`tokens`, vLLM's name, or `ids`)."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    model = {"type": "string", "enum": [model_name]}
    return {"anyOf": [
        {"type": "object", "required": ["tokens"], "properties": {"model": model,
                                                                 "tokens": ids}},
        {"type": "object", "required": ["ids"], "properties": {"model": model, "ids": ids}}]}


def request_body(schema: dict) -> dict:
    """A route's `openapi_extra`: its JSON body."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


# ---- Anthropic Messages and OpenAI Responses (anthropic_api.py, responses_api.py) -------------

_OBJECT = {"type": "object"}
_BLOCKS = {"anyOf": [{"type": "string"}, {"type": "array", "items": _OBJECT}]}


def messages_body(model_name: str, *, counting: bool = False) -> dict:
    """`POST /v1/messages` (`counting`: `/v1/messages/count_tokens`, no max_tokens)."""
    props = {
        "model": {"type": "string", "enum": [model_name]},
        "system": _BLOCKS,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "properties": {
                "role": {"enum": ["user", "assistant"]}, "content": _BLOCKS}}},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["name", "input_schema"], "properties": {
                "name": {"type": "string"}, "description": {"type": "string"},
                "input_schema": _OBJECT}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": _BOOL}},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": {"type": "integer", "minimum": 1}}},
    }
    if not counting:
        props |= {"max_tokens": {"type": "integer", "minimum": 1},
                  "stop_sequences": {"type": "array", "items": {"type": "string"}},
                  "temperature": {"type": "number", "minimum": 0},
                  "top_p": {"type": "number", "minimum": 0, "maximum": 1},
                  "top_k": {"type": "integer", "minimum": 0},
                  "metadata": _OBJECT, "stream": _BOOL}
    required = ["model", "messages"] + ([] if counting else ["max_tokens"])
    return {"type": "object", "required": required, "properties": props}


def responses_body(model_name: str) -> dict:
    """`POST /v1/responses`."""
    return {"type": "object", "required": ["model", "input"], "properties": {
        "model": {"type": "string", "enum": [model_name]},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _OBJECT}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"enum": ["function"]}, "name": {"type": "string"},
                "description": {"type": "string"}, "parameters": _OBJECT, "strict": _BOOL}}},
        "tool_choice": {"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"enum": ["function"]}, "name": {"type": "string"}}}]},
        "parallel_tool_calls": _BOOL,
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": ["none", "minimal", "low", "medium", "high"]}}},
        "text": {"type": "object", "properties": {"format": _OBJECT}},
        "store": _BOOL, "stream": _BOOL, "metadata": _OBJECT}}
