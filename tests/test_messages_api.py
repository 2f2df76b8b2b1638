"""Issue 41's `/v1/messages` (Anthropic Messages) through the official `anthropic` client: on the
served shared-small artifact (random weights, the small BPE; test_serve's fixtures) the prompt
of a Messages request is token for token the equivalent chat's, and greedy replies (a system
prompt, a tool_result turn, thinking, streaming) are the chat endpoint's text; count_tokens,
stop_sequences, the key headers and Anthropic's error shape. Tool use itself runs on a scripted
frontend with the released tokenizer (shared-small's 128 positions cannot hold the release's
tool section, and random weights never call a tool): tool_use blocks, `stop_reason` tool_use,
streamed `input_json_delta`s, and an engine failure as an `event: error`."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
import test_serve
import test_serve_fuzz
import test_tool_calls
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tool_calls import CALLS, ScriptedBatcher, ScriptedStream

from dsv41.graph.config import preset
from dsv41.runtime.serving.anthropic_api import chat_body
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.frontend import FinishReason, TokenEvent
from dsv41.runtime.serving.openai_api import ApiError, parse_chat
from dsv41.runtime.serving.prompts import TextBudget
from dsv41.runtime.serving.release_format import render_tool_calls

MODEL, KEY = test_serve.MODEL, test_serve.KEY
served, client = test_serve.served, test_serve.client  # the served app and its client (fixtures)
deepseek = test_tool_calls.deepseek  # the released tokenizer (fixture)
tok, JSON = test_serve_fuzz.tok, test_serve_fuzz.JSON  # shared-small's tokenizer (fixture)
GREEDY = {"temperature": 0}  # (the anthropic SDK 2.x has no sampling arguments: the body's)
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# one conversation in both APIs: a system prompt, a tool call and its result, then a question
CONVERSATION = [
    {"role": "user", "content": "w3 W3w4"},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "w5 w6", "signature": ""},
        {"type": "text", "text": "w7"},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "w8"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "w9 w10"},
        {"type": "text", "text": "w11"}]}]
CHAT = [
    {"role": "system", "content": "w1 w2"},
    {"role": "user", "content": "w3 W3w4"},
    {"role": "assistant", "content": "w7", "reasoning_content": "w5 w6",
     "tool_calls": [{"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "w8"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "w9 w10"},
    {"role": "user", "content": "w11"}]


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served["url"], api_key="unused", max_retries=0,
                               timeout=600)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tools", [False, True])
def test_prompt_ids_equal_the_equivalent_chat(served, thinking, tools):
    """Exact token ids: system, thinking, tool_use, tool_result, tools (no context budget here:
    the release's tool section is longer than shared-small's context)."""
    body = {"model": MODEL, "max_tokens": 9, "system": [{"type": "text", "text": "w1 w2"}],
            "messages": CONVERSATION}
    chat = {"model": MODEL, "messages": CHAT,
            "chat_template_kwargs": {"thinking": thinking}}
    if thinking:
        body["thinking"] = {"type": "enabled", "budget_tokens": 4}
    if tools:
        body["tools"] = [WEATHER]
        chat["tools"] = [{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}]
    tok = served["tok"]
    kw = {"model_name": MODEL, "vocab_size": served["args"].vocab_size}
    ids = parse_chat(chat_body(body), tok, **kw).prompt_ids
    assert ids == parse_chat(chat, tok, **kw).prompt_ids
    assert len(ids) > (600 if tools else 20)


def test_tool_choice_and_sampling_fields_translate():
    body = {"model": MODEL, "max_tokens": 7, "messages": [{"role": "user", "content": "w1"}],
            "tools": [WEATHER], "stop_sequences": ["w2"], "temperature": 0.5, "top_k": 3,
            "tool_choice": {"type": "tool", "name": "get_weather",
                            "disable_parallel_tool_use": True}, "metadata": {"user_id": "u"}}
    chat = chat_body(body)
    assert {k: v for k, v in chat.items() if k not in ("messages", "tools")} == {
        "model": MODEL, "max_tokens": 7, "stop": ["w2"], "temperature": 0.5, "top_k": 3,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False, "chat_template_kwargs": {"thinking": False}}
    assert chat_body({**body, "tool_choice": {"type": "any"}})["tool_choice"] == "required"
    assert chat_body({**body, "tool_choice": {"type": "none"}})["tool_choice"] == "none"


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_system_prompt_greedy_equals_chat_and_streams_the_same(served, client, claude):
    r = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, system="w1 w2",
                               messages=[{"role": "user", "content": "w3 W3w4"}])
    c = _chat(client, CHAT[:2], max_tokens=6)
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == c.choices[0].message.content
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        c.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.cache_read_input_tokens) == (
        c.usage.prompt_tokens, c.usage.completion_tokens, 0)
    assert r.id.startswith("msg_") and r.model == MODEL and r.role == "assistant"
    with claude.messages.stream(model=MODEL, max_tokens=6, extra_body=GREEDY, system="w1 w2",
                                messages=[{"role": "user", "content": "w3 W3w4"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == r.content[0].text and final.stop_reason == r.stop_reason
    assert final.usage.input_tokens == r.usage.input_tokens
    assert final.usage.output_tokens == r.usage.output_tokens
    raw = httpx.post(served["url"] + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True, "system": "w1 w2",
        "messages": [{"role": "user", "content": "w3 W3w4"}]}).text
    names = [line[7:] for line in raw.split("\n") if line.startswith("event: ")]
    n = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start",
                     *["content_block_delta"] * n, "content_block_stop", "message_delta",
                     "message_stop"] and n >= 1
    assert "text" in kinds and kinds[-1] == "message_stop"


# a tool call and its result short enough for shared-small's 128 positions (the DSML block
# alone is ~50 of the small BPE's tokens; thinking mode's effort line another ~50)
SHORT = [{"role": "user", "content": "w3"},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                            "input": {}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                       "content": "w9"}]}]
SHORT_CHAT = [{"role": "user", "content": "w3"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "t1", "content": "w9"}]


def test_tool_result_turn_greedy_equals_chat(client, claude):
    r = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=SHORT)
    c = _chat(client, SHORT_CHAT, max_tokens=8)
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens == 70


def test_thinking_greedy_equals_chats_reasoning(client, claude):
    think = {"type": "enabled", "budget_tokens": 4}
    kw = {"model": MODEL, "max_tokens": 8, "extra_body": GREEDY, "system": "w1 w2",
          "messages": [{"role": "user", "content": "w3 W3w4"}], "thinking": think}
    r = claude.messages.create(**kw)
    c = _chat(client, CHAT[:2], max_tokens=8,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = c.choices[0].message
    blocks = {b.type: b for b in r.content}
    assert blocks["thinking"].thinking == msg.model_extra["reasoning_content"]
    assert (blocks["text"].text if "text" in blocks else None) == msg.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]


def test_stop_sequences(claude):
    kw = {"model": MODEL, "max_tokens": 10, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": "w3 W3w4"}]}
    text = claude.messages.create(**kw).content[0].text
    stop = text[4:7]
    assert len(stop) == 3 and text.find(stop) >= 1
    r = claude.messages.create(**kw, stop_sequences=["zzzz", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == text[:text.find(stop)]
    with claude.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_equals_tokenize(served, claude):
    n = claude.messages.count_tokens(model=MODEL, messages=SHORT).input_tokens
    tok = httpx.post(served["url"] + "/tokenize", json={"messages": SHORT_CHAT},
                     timeout=60).json()
    assert n == tok["count"] == 70


def test_errors_are_anthropics_shape_and_x_api_key(served):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "w1"}]}
    url = served["url"] + "/v1/messages"

    def error(url, body, **kw):
        r = httpx.post(url, json=body, timeout=60, **kw)
        return r.status_code, r.json()

    no_max = {k: v for k, v in body.items() if k != "max_tokens"}
    assert error(url, no_max) == (400, {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "max_tokens is required: the most tokens the reply may have."}})
    assert error(url, {**body, "model": "x"}) == (404, {"type": "error", "error": {
        "type": "not_found_error",
        "message": f"The model 'x' does not exist; this server serves '{MODEL}'."}})
    assert error(url, {**body, "mcp_servers": [{"url": "u"}]}) == (400, {"type": "error",
        "error": {"type": "invalid_request_error",
                  "message": "mcp_servers is not supported by this server."}})
    bad_block = {**body, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {}}]}]}
    assert error(url, bad_block)[1]["error"]["message"] == (
        "messages[0].content[0]: 'document' blocks are not supported by this server in user "
        "messages (text, image and tool_result are).")
    keyed = served["keyed"] + "/v1/messages"
    assert error(keyed, body, headers={"x-api-key": "wrong"})[0] == 401
    assert error(keyed, body)[1]["error"]["type"] == "authentication_error"
    ok = anthropic.Anthropic(base_url=served["keyed"], api_key=KEY, max_retries=0)
    assert ok.messages.create(**body).usage.output_tokens >= 1  # x-api-key
    bearer = httpx.post(keyed, json=body, timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    count = httpx.post(served["keyed"] + "/v1/messages/count_tokens", timeout=60,
                       json=no_max, headers={"x-api-key": KEY})
    assert count.json() == {"input_tokens": 6}


@pytest.mark.parametrize("path, body, first", [
    ("/v1/messages", {"max_tokens": 100, "messages": [{"role": "user", "content": "w3 W3w4"}]},
     "event: content_block_delta"),
    ("/v1/responses", {"max_output_tokens": 100, "input": "w3 W3w4"},
     "event: response.output_text.delta")])
def test_a_client_gone_cancels_its_stream(served, path, body, first):
    """Leaving a stream after its first delta frees the slot (seen in /metrics) and counts
    the request cancelled: the greedy reply would run 100 tokens."""
    before = test_serve.metrics(served)
    body = {"model": MODEL, **body, "temperature": 0, "stream": True}
    with httpx.stream("POST", served["url"] + path, json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line == first:
                assert test_serve.metrics(served)["dsv41_running_sequences"] == 1
                break  # leaving the block closes the connection
    test_serve.wait_for(lambda: test_serve.metrics(served)["dsv41_running_sequences"] == 0,
                        "the slot's release")
    after = test_serve.metrics(served)
    key = 'dsv41_requests_finished_total{reason="cancelled"}'
    assert after[key] == before[key] + 1
    assert after["dsv41_completion_tokens_total"] - before["dsv41_completion_tokens_total"] < 100


# ---- tool use, on a scripted frontend with the released tokenizer ------------------------------


def serve_scripted(tok, batcher):
    args = preset("full")
    return ServerThread(create_app(batcher, tok, ServerOptions(
        model_name="m", vocab_size=args.vocab_size, max_seq_len=args.max_seq_len)))


def test_tool_use_blocks_whole_and_streamed(deepseek):
    reply = "Let me see</think>Checking.\n\n" + render_tool_calls(CALLS[:1])
    kw = {"model": "m", "max_tokens": 200, "tools": [WEATHER],
          "thinking": {"type": "enabled", "budget_tokens": 100},
          "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    with serve_scripted(deepseek, ScriptedBatcher(deepseek, reply)) as srv:
        claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        r = claude.messages.create(**kw)
        assert r.stop_reason == "tool_use" and r.stop_sequence is None
        thinking, text, call = r.content
        assert (thinking.type, thinking.thinking) == ("thinking", "Let me see")
        assert (text.type, text.text) == ("text", "Checking.")
        assert (call.type, call.name, call.input) == ("tool_use", "get_weather",
                                                      {"city": "Paris", "days": 3})
        assert call.id.startswith("toolu_")
        with claude.messages.stream(**kw) as s:
            events = list(s)
            final = s.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[2].input == call.input and final.stop_reason == "tool_use"
        partial = "".join(e.delta.partial_json for e in events if e.type ==
                          "content_block_delta" and e.delta.type == "input_json_delta")
        assert json.loads(partial) == {"city": "Paris", "days": 3}
        starts = [e.content_block.type for e in events if e.type == "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]


class FailingBatcher(ScriptedBatcher):
    """One token, then the engine fails."""

    def submit(self, prompt_ids, params, images=()):
        t = self.tok.encode("Hi")[0]
        return ScriptedStream([TokenEvent(t, "Hi", None, (), None),
                               TokenEvent(None, "", None, (), FinishReason.ERROR, "boom")])


def test_an_engine_failure_mid_stream_is_an_error_event(deepseek):
    body = {"model": "m", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "w"}]}
    with serve_scripted(deepseek, FailingBatcher(deepseek, "")) as srv:
        raw = httpx.post(srv.url + "/v1/messages", json=body, timeout=60).text
        r = httpx.post(srv.url + "/v1/messages", json={**body, "stream": False}, timeout=60)
    last = raw.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    assert json.loads(last[1][6:]) == {"type": "error", "error": {
        "type": "api_error", "message": "The engine failed on this request: boom"}}
    assert "event: content_block_delta" in raw and "message_stop" not in raw
    assert (r.status_code, r.json()["error"]["type"]) == (500, "api_error")


# ---- any body: a request or a 400 ---------------------------------------------------------------

BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking",
                              "document", "x"])},
    optional={k: JSON for k in ("text", "id", "name", "input", "tool_use_id", "content",
                                "thinking", "source", "is_error")})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"])},
                                optional={"content": st.text(max_size=8)
                                          | st.lists(BLOCK, max_size=3) | JSON})
FIELDS = ["max_tokens", "system", "tools", "tool_choice", "thinking", "stop_sequences",
          "metadata", "temperature", "top_k", "stream", "mcp_servers", "output_config"]
BODY = st.one_of(JSON, st.builds(
    lambda ms, d: {"model": MODEL, "max_tokens": 4, "messages": ms, **d},
    st.lists(MESSAGE, max_size=3) | JSON, st.dictionaries(st.sampled_from(FIELDS), JSON,
                                                          max_size=4)))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, counting=st.booleans())
def test_any_json_maps_to_a_request_or_a_400(tok, body, counting):
    """Whatever the body, the translation and the chat parse give a request or an ApiError
    (400, or 404 for another model), never another exception."""
    try:
        req = parse_chat(chat_body(body, counting=counting), tok, model_name=MODEL,
                         vocab_size=512, budget=TextBudget.of(tok, 128))
    except ApiError as e:
        assert e.status in (400, 404) and e.message
        return
    assert all(0 <= t < 512 for t in req.prompt_ids)
