"""OpenAI's Responses API, in and out: a request body -> the equivalent chat body (which
openai_api.parse_chat parses: the same prompt, tools, sampling, reasoning and response_format as
`/v1/chat/completions`), and a reply -> a response object or its stream events.

    chat = chat_body(body)                    # ApiError on a bad request
    req = state.parse_chat(chat)              # GenerationRequest, as for a chat
    out = Output(); out.items_of(reply)       # output items; response_object(...) around them

The request, field by field: `model`; `input` (a string: one user message; or items: messages
of role user / system / developer / assistant with `input_text` / `output_text` (or `text`)
parts and `input_image` parts holding a data URL, `function_call` (an assistant's tool call,
consecutive ones one assistant turn), `function_call_output` (a tool message), `reasoning`
(its `content` reasoning_text, else its `summary` texts: the next assistant turn's
`reasoning_content`)); `instructions` (a system message first); `tools` (`type: function` with
`name`, `description`, `parameters`; `strict` read and unused: arguments are checked by the
tool constraint when one applies); `tool_choice` (`auto`, `none`, `required`, or
`{"type": "function", "name"}`); `parallel_tool_calls`; `max_output_tokens`; `temperature`;
`top_p`; `reasoning.effort` (`none` / `minimal`: chat mode; `low` the model's low (50),
`medium` its high (75, its default), `high` its max (100); a `reasoning` object without an
effort: thinking mode at the default; no `reasoning`: chat mode); `text.format` (`text`,
`json_object`, `json_schema` with `name`, `schema`, `strict`: chat's response_format,
structured.py); `stream`; `store` (accepted: nothing is stored, and the response says `store:
false`); `metadata` (echoed). `previous_response_id` and `conversation` are 400s (nothing is
stored: send the whole conversation as `input`), as are `background`, hosted tools, file inputs,
`item_reference` items, `truncation: auto` and `top_logprobs`; other fields are ignored, as
openai_api ignores unknown fields. A last item that is the assistant's (a prefill) is a 400.

The answer: output items `reasoning` (`content`: one `reasoning_text`), `message` (one
`output_text`) and `function_call` (`call_id`, `name`, `arguments`), in that order; `status`
`completed`, or `incomplete` with `incomplete_details.reason` `max_output_tokens`; `usage`
(`input_tokens`, `input_tokens_details.cached_tokens`, `output_tokens`,
`output_tokens_details.reasoning_tokens`, `total_tokens`, and openai_api.Usage's
`dsv41_prompt_cache`). Errors are OpenAI's shape, as on every OpenAI endpoint here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

from dsv41.runtime.serving.openai_api import ApiError, Usage, bad_request
from dsv41.runtime.serving.turn_reply import Piece, Reply, StopKind, TurnEnd, chat_tools

# reasoning.effort -> chat's reasoning_effort (None: chat mode, no thinking)
EFFORTS = {"none": None, "minimal": None, "low": "low", "medium": "high", "high": "max"}
REFUSED = {
    "previous_response_id": "previous_response_id is not supported: this server stores no "
                            "responses; send the whole conversation as `input`.",
    "conversation": "conversation is not supported: this server stores no conversations; "
                    "send the whole conversation as `input`.",
    "background": "background is not supported by this server.",
    "prompt": "prompt (a stored prompt template) is not supported by this server.",
    "top_logprobs": "top_logprobs is not supported on /v1/responses by this server.",
}
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _bad(where: str, what: str):
    return bad_request(f"{where}: {what}", "input" if where.startswith("input") else
                       where.split("[", 1)[0])


def _parts(content, where: str) -> list[dict]:
    """Chat content parts of a message's content."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(where, "content must be a string or a list of content parts.")
    out = []
    for j, p in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = p.get("type") if isinstance(p, Mapping) else None
        if kind in TEXT_PARTS and isinstance(p.get("text"), str):
            out.append({"type": "text", "text": p["text"]})
        elif kind == "input_image" and isinstance(p.get("image_url"), str):
            out.append({"type": "image_url", "image_url": {"url": p["image_url"]}})
        elif kind == "input_image":
            raise _bad(at, "an input_image needs an `image_url` (a data URL); file ids are "
                       "not supported by this server.")
        else:
            raise _bad(at, f"content parts must be input_text, output_text or input_image "
                       f"parts; {kind!r:.40} is not supported by this server.")
    return out


def _reasoning_text(item: Mapping, where: str) -> str:
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in parts):
            raise _bad(where, f"a reasoning item's {key} must be a list of parts with `text`.")
        if parts:
            return "\n\n".join(p["text"] for p in parts)
    return ""


def _messages(body: Mapping) -> list[dict]:
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string.", "instructions")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items.", "input")
    turn: dict | None = None  # the assistant turn being read

    def flush() -> None:
        nonlocal turn
        if turn is not None:
            out.append(turn)
            turn = None

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(where, "an item must be an object.")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            if turn is not None and (turn["content"] or "tool_calls" in turn):
                flush()
            turn = turn or {"role": "assistant", "content": []}
            turn["content"] = _parts(item.get("content"), where)
        elif kind == "message":
            if item.get("role") not in ("user", "system", "developer"):
                raise _bad(where, "a message's role must be user, system, developer or "
                           "assistant.")
            flush()
            out.append({"role": item["role"], "content": _parts(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, call_id)):
                raise _bad(where, "a function_call needs string `call_id`, `name` and "
                           "`arguments`.")
            turn = turn or {"role": "assistant", "content": []}
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(where, "a function_call_output needs its `call_id`.")
            flush()
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _parts(output, where)})
        elif kind == "reasoning":
            if turn is not None and (turn["content"] or "tool_calls" in turn):
                flush()
            turn = turn or {"role": "assistant", "content": []}
            text = _reasoning_text(item, where)
            turn["reasoning_content"] = "\n\n".join(
                t for t in (turn.get("reasoning_content", ""), text) if t)
        else:
            raise _bad(where, f"{kind!r:.40} items are not supported by this server (message, "
                       "function_call, function_call_output and reasoning are).")
    if turn is not None:
        raise bad_request("The last input item is the assistant's: continuing a reply "
                          "(prefill) is not supported by this server; end with a user "
                          "message or a function_call_output.", "input")
    return out


def _function(t, where: str) -> dict:
    """Chat's function object of a Responses function tool."""
    kind = t.get("type") if isinstance(t, Mapping) else None
    if kind != "function":
        raise bad_request(f"{where}: {kind!r:.40} tools are not supported by this server; "
                          "only function tools are.", "tools")
    return {k: t[k] for k in ("name", "description", "parameters") if k in t}


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"name\": ...}.", "tool_choice")


def _response_format(body: Mapping) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise bad_request("text must be an object (with a `format`).", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad_request("text.format must be an object with a `type`.", "text")
    if fmt.get("type") != "json_schema":
        return dict(fmt)  # text, json_object; anything else is response_format's 400
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _effort(body: Mapping) -> dict:
    """Chat's thinking switch and reasoning_effort for `reasoning`."""
    cfg = body.get("reasoning")
    if cfg is None:
        return {}
    if not isinstance(cfg, Mapping):
        raise bad_request("reasoning must be an object (with an `effort`).", "reasoning")
    effort = cfg.get("effort")
    if effort is None:
        return {"chat_template_kwargs": {"thinking": True}}
    if effort not in EFFORTS:
        raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}, not "
                          f"{effort!r:.40}.", "reasoning")
    if EFFORTS[effort] is None:
        return {}
    return {"chat_template_kwargs": {"thinking": True}, "reasoning_effort": EFFORTS[effort]}


def chat_body(body) -> dict:
    """The chat body (parse_chat's input) of a Responses body."""
    if not isinstance(body, Mapping):
        raise bad_request("The request body must be a JSON object.")
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise bad_request(why, name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation \"auto\" is not supported by this server: a prompt longer "
                          "than the context is a 400.", "truncation")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("store must be true or false.", "store")
    chat: dict = {"model": body.get("model"), "messages": _messages(body),
                  "tools": chat_tools(body.get("tools"), _function),
                  **_effort(body)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("stream", "stream"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _response_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


# ---- the answer ---------------------------------------------------------------------------------


def usage_body(end: TurnEnd) -> dict:
    u: Usage = end.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "dsv41_prompt_cache": u.body()["dsv41_prompt_cache"]}


def response_object(resp_id: str, created: int, model: str, body: Mapping, *,
                    output: list[dict], end: TurnEnd | None) -> dict:
    """The response (`end` None: still in progress), echoing the request's settings."""
    status = "in_progress" if end is None else \
        "incomplete" if end.kind is StopKind.LENGTH else "completed"
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": resp_id, "object": "response", "created_at": created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model,
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": body.get("reasoning"),
            "store": False, "temperature": body.get("temperature", 1.0),
            "text": {"format": fmt}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0),
            "truncation": "disabled", "metadata": body.get("metadata") or {},
            "usage": None if end is None else usage_body(end)}


def _message(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning(item_id: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(reply: Reply) -> list[dict]:
    """A whole reply's output items."""
    status = "incomplete" if reply.end.kind is StopKind.LENGTH else "completed"
    out = []
    if reply.reasoning:
        out.append(_reasoning(new_id("rs_"), reply.reasoning))
    if reply.text:
        out.append(_message(new_id("msg_"), reply.text, status))
    out += [_call(new_id("fc_"), new_id("call_"), c.name, c.arguments, "completed")
            for c in reply.calls]
    return out


class StreamItems:
    """The output items of a streamed response: the open one, the events that add, fill and
    finish them, and the finished items (the final response's `output`)."""

    def __init__(self):
        self.done: list[dict] = []
        self.open: dict | None = None  # {"kind", "id", "text", and a call's "call_id", "name"}
        self.status = "completed"

    def _added(self, item: dict) -> dict:
        return {"type": "response.output_item.added", "output_index": len(self.done),
                "item": item}

    def start(self, kind: str, **extra) -> list[dict]:
        out = self.close()
        prefix = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind]
        self.open = {"kind": kind, "id": new_id(prefix), "text": "", **extra}
        at = {"item_id": self.open["id"], "output_index": len(self.done)}
        if kind == "reasoning":
            return out + [self._added(_reasoning(self.open["id"], None)),
                          {"type": "response.content_part.added", **at, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": ""}}]
        if kind == "message":
            return out + [self._added({**_message(self.open["id"], "", "in_progress"),
                                       "content": []}),
                          {"type": "response.content_part.added", **at, "content_index": 0,
                           "part": _text_part("")}]
        return out + [self._added(_call(self.open["id"], extra["call_id"], extra["name"], "",
                                        "in_progress"))]

    def close(self) -> list[dict]:
        o = self.open
        if o is None:
            return []
        self.open = None
        at = {"item_id": o["id"], "output_index": len(self.done)}
        if o["kind"] == "reasoning":
            item = _reasoning(o["id"], o["text"])
            out = [{"type": "response.reasoning_text.done", **at, "content_index": 0,
                    "text": o["text"]},
                   {"type": "response.content_part.done", **at, "content_index": 0,
                    "part": {"type": "reasoning_text", "text": o["text"]}}]
        elif o["kind"] == "message":
            item = _message(o["id"], o["text"], self.status)
            out = [{"type": "response.output_text.done", **at, "content_index": 0,
                    "text": o["text"], "logprobs": []},
                   {"type": "response.content_part.done", **at, "content_index": 0,
                    "part": _text_part(o["text"])}]
        else:
            item = _call(o["id"], o["call_id"], o["name"], o["text"], "completed")
            out = [{"type": "response.function_call_arguments.done", **at,
                    "name": o["name"], "arguments": o["text"]}]
        out.append({"type": "response.output_item.done", "output_index": len(self.done),
                    "item": item})
        self.done.append(item)
        return out

    def _delta(self, kind: str, text: str) -> dict:
        o = self.open
        o["text"] += text
        at = {"item_id": o["id"], "output_index": len(self.done)}
        if kind == "reasoning":
            return {"type": "response.reasoning_text.delta", **at, "content_index": 0,
                    "delta": text}
        if kind == "message":
            return {"type": "response.output_text.delta", **at, "content_index": 0,
                    "delta": text, "logprobs": []}
        return {"type": "response.function_call_arguments.delta", **at, "delta": text}

    def piece(self, p: Piece) -> list[dict]:
        out: list[dict] = []
        for kind, text in (("reasoning", p.reasoning), ("message", p.text)):
            if text:
                if self.open is None or self.open["kind"] != kind:
                    out += self.start(kind)
                out.append(self._delta(kind, text))
        for d in p.calls:
            if d.name is not None:
                out += self.start("function_call", call_id=new_id("call_"), name=d.name)
            if d.arguments:
                out.append(self._delta("function_call", d.arguments))
        return out

    def finish(self, end: TurnEnd) -> list[dict]:
        self.status = "incomplete" if end.kind is StopKind.LENGTH else "completed"
        return self.close()


class ResponseWriter:
    """A response's shapes (turn_reply.TurnWriter): the whole response object, or its stream's
    events, each with its `sequence_number`: `response.created`, `response.in_progress`, the
    output items' (StreamItems), then `response.completed` or `response.incomplete`; an error
    after the stream began is an `error` event, then `response.failed`."""

    def __init__(self, resp_id: str, created: int, model: str, body: Mapping):
        self.resp_id, self.created, self.model, self.body = resp_id, created, model, body
        self.items = StreamItems()
        self.seq = 0  # the next event's sequence_number

    def response(self, output: list[dict], end: TurnEnd | None) -> dict:
        return response_object(self.resp_id, self.created, self.model, self.body,
                               output=output, end=end)

    def answer(self, reply: Reply) -> dict:
        return self.response(output_items(reply), reply.end)

    def sse(self, event: dict) -> str:
        event = {**event, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def opening(self) -> list[dict]:
        return [{"type": "response.created", "response": self.response([], None)},
                {"type": "response.in_progress", "response": self.response([], None)}]

    def piece(self, p: Piece) -> list[dict]:
        return self.items.piece(p)

    def end(self, end: TurnEnd) -> list[dict]:
        out = self.items.finish(end)
        final = self.response(self.items.done, end)
        kind = "response.completed" if final["status"] == "completed" else \
            "response.incomplete"
        return out + [{"type": kind, "response": final}]

    def failed(self, e: ApiError) -> list[dict]:
        code = e.code or e.type.value
        failed = {**self.response(self.items.done, None), "status": "failed",
                  "error": {"code": code, "message": e.message}}
        return [{"type": "error", "code": code, "message": e.message, "param": e.param},
                {"type": "response.failed", "response": failed}]
