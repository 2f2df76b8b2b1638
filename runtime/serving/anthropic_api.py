"""Anthropic's Messages API, in and out: a request body -> the equivalent chat body (which
openai_api.parse_chat parses: the same prompt, tools, sampling and reasoning as
`/v1/chat/completions`), and a reply -> Anthropic's message, stream events and errors.

    chat = chat_body(body)                       # ApiError on a bad request
    req = state.parse_chat(chat)                 # GenerationRequest, as for a chat
    message_body(msg_id, model, reply)           # the non-streaming answer

The request, field by field: `model`, `max_tokens` (required, as Anthropic requires it; not on
count_tokens), `system` (a string or text blocks: a system message), `messages` (user and
assistant; a string or blocks), `stop_sequences` (chat's `stop`), `temperature`, `top_p`,
`top_k`, `stream`, `metadata` (read for its shape, otherwise unused), `tools` (`name`,
`description`, `input_schema`: chat's function tools), `tool_choice` (`auto`, `any` (chat's
`required`), `tool` (a named function), `none`; `disable_parallel_tool_use` is chat's
`parallel_tool_calls: false`), `thinking` (`enabled` with `budget_tokens`, or `adaptive`:
thinking mode at the default effort; `disabled`: chat mode; `budget_tokens` must be below
`max_tokens` and does not cut the reasoning, only `max_tokens` does).

Blocks: a user's `text`, `image` (a base64 source: an image part for a model with a vision
tower) and `tool_result` (a tool message; its `is_error` flag is read and not rendered: the
release's format has no mark for it); an assistant's `text`, `thinking` (its
`reasoning_content`), `tool_use` (a tool call, `input` as its JSON arguments). Text blocks of a
message are joined by a blank line, as chat content parts are. `cache_control` is accepted and
unused (prompt caching here is automatic). Fields this server cannot honour (documents, URL
image sources, `redacted_thinking`, server tools, `mcp_servers`, `container`, `output_format`,
`output_config.format`,
an assistant message last: prefilling a reply) are 400s naming them; other fields are ignored,
as openai_api ignores unknown fields.

The answer: content blocks `thinking` (its `signature` empty: nothing here signs reasoning),
`text`, `tool_use`; `stop_reason` `end_turn` | `max_tokens` | `stop_sequence` (with
`stop_sequence`) | `tool_use`; `usage` with `input_tokens` (the prompt tokens not read from
the cache, Anthropic's meaning), `cache_read_input_tokens` (those read from it),
`cache_creation_input_tokens` (0), `output_tokens`, and `dsv41_prompt_cache` (openai_api.Usage's
tier breakdown). Errors: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping

from dsv41.runtime.serving.openai_api import ApiError, ErrorType, Usage, bad_request
from dsv41.runtime.serving.turn_reply import Piece, Reply, StopKind, TurnEnd, chat_tools

# ApiError's types as Anthropic names them (by HTTP status where Anthropic has its own name)
ERROR_TYPES = {ErrorType.INVALID_REQUEST: "invalid_request_error",
               ErrorType.AUTHENTICATION: "authentication_error",
               ErrorType.NOT_FOUND: "not_found_error", ErrorType.RATE_LIMIT: "rate_limit_error",
               ErrorType.TIMEOUT: "timeout_error", ErrorType.SERVER: "api_error"}
STATUS_TYPES = {413: "request_too_large", 503: "overloaded_error"}

STOP_REASONS = {StopKind.END: "end_turn", StopKind.STOP_STRING: "stop_sequence",
                StopKind.LENGTH: "max_tokens", StopKind.TOOL_CALLS: "tool_use"}

UNSUPPORTED = ("mcp_servers", "container", "output_format")


def error_body(e: ApiError) -> dict:
    kind = STATUS_TYPES.get(e.status) or ERROR_TYPES[e.type]
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _where(where: str, what: str) -> ApiError:
    return bad_request(f"{where}: {what}", where.split("[", 1)[0].split(".", 1)[0])


def _text_of(block: Mapping, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _where(where, "a text block needs a string `text`.")
    return text


def _block_type(block, where: str) -> str:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise _where(where, "a content block must be an object with a `type`.")
    return block["type"]


def _image_part(block: Mapping, where: str) -> dict:
    src = block.get("source")
    if not isinstance(src, Mapping) or src.get("type") != "base64":
        kind = src.get("type") if isinstance(src, Mapping) else None
        raise _where(where, f"image source type {kind!r} is not supported by this server; "
                     "send the image as {'type': 'base64', 'media_type', 'data'}.")
    media, data = src.get("media_type"), src.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise _where(where, "a base64 image source needs string `media_type` and `data`.")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _where(where, "content must be a string or a list of content blocks.")
    return content


def _tool_result(block: Mapping, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _where(where, "a tool_result block needs its `tool_use_id`.")
    if not isinstance(block.get("is_error", False), bool):
        raise _where(where, "is_error must be true or false.")
    content = block.get("content", "")
    parts = []
    for j, b in enumerate(_blocks(content, where)):
        kind = _block_type(b, f"{where}.content[{j}]")
        if kind != "text":
            raise _where(f"{where}.content[{j}]", f"a tool_result holds text blocks here, not "
                         f"{kind!r}.")
        parts.append({"type": "text", "text": _text_of(b, f"{where}.content[{j}]")})
    return {"role": "tool", "tool_call_id": call_id, "content": parts}


def _user(content, where: str) -> list[dict]:
    """A user message's blocks: each tool_result a tool message, each run of text and image
    blocks a user message (the release's format joins them into one turn)."""
    out: list[dict] = []
    parts: list[dict] = []
    for j, b in enumerate(_blocks(content, where)):
        at = f"{where}.content[{j}]"
        kind = _block_type(b, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(b, at)})
        elif kind == "image":
            parts.append(_image_part(b, at))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(b, at))
        else:
            raise _where(at, f"{kind!r} blocks are not supported by this server in user "
                         "messages (text, image and tool_result are).")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(content, where: str) -> dict:
    parts, reasoning, calls = [], [], []
    for j, b in enumerate(_blocks(content, where)):
        at = f"{where}.content[{j}]"
        kind = _block_type(b, at)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(b, at)})
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise _where(at, "a thinking block needs a string `thinking`.")
            reasoning.append(b["thinking"])
        elif kind == "tool_use":
            name, args, call_id = b.get("name"), b.get("input", {}), b.get("id")
            if not isinstance(name, str) or not isinstance(args, Mapping) or \
                    not isinstance(call_id, str):
                raise _where(at, "a tool_use block needs a string `id` and `name` and an "
                             "object `input`.")
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise _where(at, f"{kind!r} blocks are not supported by this server in assistant "
                         "messages (text, thinking and tool_use are).")
    msg: dict = {"role": "assistant", "content": parts}
    if reasoning:
        msg["reasoning_content"] = "\n\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: Mapping) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, str):
            out.append({"role": "system", "content": system})
        elif isinstance(system, list):
            parts = []
            for j, b in enumerate(system):
                if _block_type(b, f"system[{j}]") != "text":
                    raise _where(f"system[{j}]", "system blocks must be text blocks.")
                parts.append({"type": "text", "text": _text_of(b, f"system[{j}]")})
            out.append({"role": "system", "content": parts})
        else:
            raise bad_request("system must be a string or a list of text blocks.", "system")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of user and assistant messages.",
                          "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise _where(where, "a message must be an object with role \"user\" or "
                         "\"assistant\" and its content.")
        if m["role"] == "user":
            out += _user(m.get("content"), where)
        else:
            out.append(_assistant(m.get("content"), where))
    if messages[-1]["role"] == "assistant":
        raise bad_request("The last message is an assistant message: continuing a reply "
                          "(prefill) is not supported by this server; end with a user "
                          "message.", "messages")
    return out


def _function(t, where: str) -> dict:
    """Chat's function object of an Anthropic client tool."""
    if not isinstance(t, Mapping):
        raise _where(where, "a tool must be an object with `name` and `input_schema`.")
    if t.get("type", "custom") != "custom":
        raise _where(where, f"server tools ({t.get('type')!r:.60}) are not supported by "
                     "this server; give client tools (name, description, input_schema).")
    # OpenAI's key order (the release renders each function's JSON as it is ordered)
    fn = {"name": t.get("name")}
    if "description" in t:
        fn["description"] = t["description"]
    fn["parameters"] = t.get("input_schema")
    if not isinstance(fn["parameters"], Mapping):
        raise _where(where, "a tool needs an `input_schema` (a JSON Schema object).")
    return fn


def _tool_choice(body: Mapping) -> dict:
    """Chat's tool_choice and parallel_tool_calls fields for Anthropic's tool_choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return {}
    if not isinstance(choice, Mapping):
        raise bad_request("tool_choice must be an object with a `type`.", "tool_choice")
    kind = choice.get("type")
    forms = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type \"tool\" needs the tool's `name`.",
                              "tool_choice")
        out = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in forms:
        out = {"tool_choice": forms[kind]}
    else:
        raise bad_request(f"tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\", "
                          f"not {kind!r:.60}.", "tool_choice")
    off = choice.get("disable_parallel_tool_use", False)
    if not isinstance(off, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false.",
                          "tool_choice")
    if off:
        out["parallel_tool_calls"] = False
    return out


def _thinking(body: Mapping, max_tokens) -> bool:
    cfg = body.get("thinking")
    if cfg is None:
        return False
    kind = cfg.get("type") if isinstance(cfg, Mapping) else None
    if kind in ("disabled", "adaptive"):
        return kind == "adaptive"
    if kind != "enabled":
        raise bad_request("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                          "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}.", "thinking")
    budget = cfg.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request(f"thinking.budget_tokens must be a positive whole number, not "
                          f"{budget!r:.60}.", "thinking")
    if isinstance(max_tokens, int) and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                          f"({max_tokens}).", "thinking")
    return True


def chat_body(body, *, counting: bool = False) -> dict:
    """The chat body (parse_chat's input) of a Messages body; `counting`: a count_tokens body
    (no max_tokens, no sampling)."""
    if not isinstance(body, Mapping):
        raise bad_request("The request body must be a JSON object.")
    for name in UNSUPPORTED:
        if body.get(name):
            raise bad_request(f"{name} is not supported by this server.", name)
    config = body.get("output_config")
    if isinstance(config, Mapping) and config.get("format") is not None:
        raise bad_request("output_config.format is not supported by this server.",
                          "output_config")
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise bad_request("max_tokens is required: the most tokens the reply may have.",
                          "max_tokens")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, Mapping):
        raise bad_request("metadata must be an object.", "metadata")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and
                                  all(isinstance(s, str) for s in stops)):
        raise bad_request("stop_sequences must be a list of strings.", "stop_sequences")
    chat: dict = {"model": body.get("model"), "messages": _messages(body),
                  "tools": chat_tools(body.get("tools"), _function), **_tool_choice(body),
                  "chat_template_kwargs": {"thinking": _thinking(body, max_tokens)}}
    if counting:
        return chat
    chat["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if stops:
        chat["stop"] = stops
    return chat


# ---- the answer ---------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def usage_body(usage: Usage) -> dict:
    hit = usage.cached_tokens
    return {"input_tokens": usage.prompt_tokens - hit, "cache_read_input_tokens": hit,
            "cache_creation_input_tokens": 0, "output_tokens": usage.completion_tokens,
            "dsv41_prompt_cache": usage.body()["dsv41_prompt_cache"]}


def message_body(msg_id: str, model: str, reply: Reply) -> dict:
    content: list[dict] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.text:
        content.append({"type": "text", "text": reply.text})
    for call in reply.calls:
        content.append({"type": "tool_use", "id": new_id("toolu_"), "name": call.name,
                        "input": json.loads(call.arguments)})
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": STOP_REASONS[reply.end.kind],
            "stop_sequence": reply.end.stop_sequence, "usage": usage_body(reply.end.usage)}


def sse(event: dict) -> str:
    """One server-sent event: its `event:` line is the event's type."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def message_start(msg_id: str, model: str, prompt_tokens: int) -> dict:
    return {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0, "output_tokens": 0}}}


class MessageWriter:
    """A message's shapes (turn_reply.TurnWriter): the whole message, or its stream's events:
    `message_start`, `ping`, per content block `content_block_start`, its deltas and
    `content_block_stop`, then `message_delta` and `message_stop`; an error, Anthropic's."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: Callable[[], int]):
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens
        self.index = -1  # the open block's, or the last one's
        self.open: str | None = None  # "thinking" | "text" | "tool_use"

    def answer(self, reply: Reply) -> dict:
        return message_body(self.msg_id, self.model, reply)

    def sse(self, event: dict) -> str:
        return sse(event)

    def opening(self) -> list[dict]:
        return [message_start(self.msg_id, self.model, self.prompt_tokens()), {"type": "ping"}]

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

    def end(self, end: TurnEnd) -> list[dict]:
        return self.close() + [
            {"type": "message_delta",
             "delta": {"stop_reason": STOP_REASONS[end.kind], "stop_sequence": end.stop_sequence},
             "usage": usage_body(end.usage)},
            {"type": "message_stop"}]

    def failed(self, e: ApiError) -> list[dict]:
        return [error_body(e)]
