"""Issue 41's `/v1/responses` (OpenAI Responses) through the official `openai` client: on the
served shared-small artifact (random weights, the small BPE; test_serve's fixtures) the prompt of
a Responses request is token for token the equivalent chat's, greedy output text is the chat
endpoint's, streaming and not, `text.format` json_schema validates, `max_output_tokens` makes an
`incomplete` response; `previous_response_id` and hosted tools are 400s. A function tool call
runs on a scripted frontend with the released tokenizer (see test_messages_api)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import test_serve
import test_serve_fuzz
import test_tool_calls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_messages_api import CHAT, WEATHER, FailingBatcher, serve_scripted
from test_tool_calls import CALLS, ScriptedBatcher

from dsv41.runtime.serving.openai_api import ApiError, parse_chat
from dsv41.runtime.serving.prompts import TextBudget
from dsv41.runtime.serving.release_format import render_tool_calls
from dsv41.runtime.serving.responses_api import chat_body

MODEL = test_serve.MODEL
served, client = test_serve.served, test_serve.client  # the served app and its client (fixtures)
deepseek = test_tool_calls.deepseek  # the released tokenizer (fixture)
tok, JSON = test_serve_fuzz.tok, test_serve_fuzz.JSON  # shared-small's tokenizer (fixture)
TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}
# CHAT (test_messages_api) as Responses input items
ITEMS = [
    {"role": "user", "content": "w3 W3w4"},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "w5 w6"}]},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "w7", "annotations": []}]},
    {"type": "function_call", "call_id": "toolu_1", "name": "get_weather",
     "arguments": '{"city": "w8"}'},
    {"type": "function_call_output", "call_id": "toolu_1", "output": "w9 w10"},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "w11"}]}]


@pytest.mark.parametrize("effort, thinking, level", [
    (None, False, None), ("minimal", False, None), ("low", True, "low"),
    ("medium", True, "high"), ("high", True, "max")])
def test_prompt_ids_equal_the_equivalent_chat(served, effort, thinking, level):
    body = {"model": MODEL, "instructions": "w1 w2", "input": ITEMS, "tools": [TOOL]}
    chat = {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}],
        "chat_template_kwargs": {"thinking": thinking}}
    if effort is not None:
        body["reasoning"] = {"effort": effort}
    if level is not None:
        chat["reasoning_effort"] = level
    tok = served["tok"]
    kw = {"model_name": MODEL, "vocab_size": served["args"].vocab_size}
    ids = parse_chat(chat_body(body), tok, **kw).prompt_ids
    assert ids == parse_chat(chat, tok, **kw).prompt_ids and len(ids) > 600


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT[:2], temperature=0, **kw)


def test_greedy_text_equals_chat_streaming_and_not(client):
    kw = {"model": MODEL, "instructions": "w1 w2", "input": "w3 W3w4", "temperature": 0,
          "max_output_tokens": 6}
    r = client.responses.create(**kw)
    c = _chat(client, max_tokens=6)
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens,
                                                             c.usage.completion_tokens)
    assert r.usage.input_tokens_details.cached_tokens == 0
    want = {"length": ("incomplete", "max_output_tokens"), "stop": ("completed", None)}[
        c.choices[0].finish_reason]
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == want
    assert r.id.startswith("resp_") and [o.type for o in r.output] == ["message"]
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * n,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_reasoning_items_equal_chats_reasoning(client):
    kw = {"model": MODEL, "instructions": "w1 w2", "input": "w3 W3w4", "temperature": 0,
          "max_output_tokens": 8, "reasoning": {"effort": "medium"}}
    r = client.responses.create(**kw)
    c = _chat(client, max_tokens=8, extra_body={"chat_template_kwargs": {"thinking": True}})
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert reasoning[0].content[0].text == c.choices[0].message.model_extra[
        "reasoning_content"]
    assert (r.output_text or None) == c.choices[0].message.content
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning[0].content[0].text
    assert events[-1].response.output[0].content[0].text == deltas


def test_text_format_json_schema_validates(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                      "maximum": 9},
                                                "c": {"enum": ["a", "b"]}},
              "required": ["n", "c"], "additionalProperties": False}
    for seed in range(2):
        r = client.responses.create(model=MODEL, input="w3", max_output_tokens=40,
                                    extra_body={"seed": seed},
                                    text={"format": {"type": "json_schema", "name": "x",
                                                     "schema": schema, "strict": True}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)


def test_one_tool_translation_for_both_apis():
    """The same tool given to either API is the same chat tool; a tools field that is not a
    list is the same 400 in both; each API's own refusal keeps its text."""
    from dsv41.runtime.serving import anthropic_api

    def messages(tools) -> dict:
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "w3"}]}
        return anthropic_api.chat_body({**body, "tools": tools})

    def responses(tools) -> dict:
        return chat_body({"model": MODEL, "input": "w3", "tools": tools})

    want = [{"type": "function", "function": {"name": "get_weather",
                                              "description": WEATHER["description"],
                                              "parameters": WEATHER["input_schema"]}}]
    assert messages([WEATHER])["tools"] == responses([TOOL])["tools"] == want
    assert messages(None)["tools"] == responses(None)["tools"] == []
    for translate, tools, message in (
            (messages, {"x": 1}, "tools must be a list of tools."),
            (responses, "x", "tools must be a list of tools."),
            (messages, [WEATHER, {"type": "web_search_20250305", "name": "w"}],
             "tools[1]: server tools ('web_search_20250305') are not supported by this server; "
             "give client tools (name, description, input_schema)."),
            (responses, [TOOL, {"type": "file_search"}],
             "tools[1]: 'file_search' tools are not supported by this server; only function "
             "tools are.")):
        with pytest.raises(ApiError) as e:
            translate(tools)
        assert (e.value.status, e.value.message, e.value.param) == (400, message, "tools")


def test_refused_fields_are_400s(client):
    cases = [({"previous_response_id": "resp_1"}, "previous_response_id",
              "previous_response_id is not supported: this server stores no responses; send "
              "the whole conversation as `input`."),
             ({"tools": [{"type": "web_search"}]}, "tools",
              "tools[0]: 'web_search' tools are not supported by this server; only function "
              "tools are."),
             ({"input": [{"type": "item_reference", "id": "x"}]}, "input",
              "input[0]: 'item_reference' items are not supported by this server (message, "
              "function_call, function_call_output and reasoning are).")]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": MODEL, "input": "w1", **extra})
        assert (e.value.body["param"], e.value.body["message"]) == (param, message)


def test_function_call_whole_and_streamed(deepseek):
    reply = "Checking.\n\n" + render_tool_calls(CALLS[:1])
    kw = {"model": "m", "input": "Weather in Paris?", "tools": [TOOL]}
    with serve_scripted(deepseek, ScriptedBatcher(deepseek, reply)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = oai.responses.create(**kw)
        msg, call = r.output
        assert (msg.type, r.output_text, r.status) == ("message", "Checking.", "completed")
        assert (call.type, call.name) == ("function_call", "get_weather")
        assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        events = list(oai.responses.create(**kw, stream=True))
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args == done[0].arguments == call.arguments
        final = events[-1].response
        assert events[-1].type == "response.completed"
        assert [o.type for o in final.output] == ["message", "function_call"]
        assert final.output[1].arguments == call.arguments


# ---- any body: a request or a 400 ---------------------------------------------------------------

PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file"])},
    optional={"text": JSON, "image_url": JSON})
ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output",
                              "reasoning", "item_reference", "x"])},
    optional={"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
              "content": st.text(max_size=8) | st.lists(PART, max_size=2) | JSON,
              **{k: JSON for k in ("call_id", "name", "arguments", "output", "summary")}})
FIELDS = ["instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
          "reasoning", "text", "store", "stream", "previous_response_id", "truncation",
          "parallel_tool_calls"]
BODY = st.one_of(JSON, st.builds(
    lambda items, d: {"model": MODEL, "input": items, **d},
    st.lists(ITEM, max_size=3) | JSON, st.dictionaries(st.sampled_from(FIELDS), JSON,
                                                       max_size=4)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY)
def test_any_json_maps_to_a_request_or_a_400(tok, body):
    """Whatever the body, the translation and the chat parse give a request or an ApiError
    (400, or 404 for another model), never another exception."""
    try:
        req = parse_chat(chat_body(body), tok, model_name=MODEL, vocab_size=512,
                         budget=TextBudget.of(tok, 128))
    except ApiError as e:
        assert e.status in (400, 404) and e.message
        return
    assert all(0 <= t < 512 for t in req.prompt_ids)


def test_an_engine_failure_mid_stream_is_an_error_then_failed(deepseek):
    body = {"model": "m", "input": "w", "stream": True}
    with serve_scripted(deepseek, FailingBatcher(deepseek, "")) as srv:
        raw = httpx.post(srv.url + "/v1/responses", json=body, timeout=60).text
    events = [json.loads(e.split("\n")[1][6:]) for e in raw.strip().split("\n\n")]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "error",
        "response.failed"]
    assert events[-2] == {"type": "error", "code": "server_error", "param": None,
                          "message": "The engine failed on this request: boom",
                          "sequence_number": 5}
    assert events[-1]["response"]["status"] == "failed"
