"""Tool calls read back out of replies (runtime/serving/tool_calls.py): the V4.1 DSML block
release_format renders parses to the same calls (namespaced names included); malformed or cut
blocks stay text; streaming holds back exactly the block and the whitespace before it; the server
answers them as OpenAI's `tool_calls` (non-streaming and streamed), on a scripted batcher with the
released vocabulary's tokenizer."""

from __future__ import annotations

import json
import queue

import httpx
import pytest

from dsv41.graph.config import preset
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.frontend import FinishReason, RequestTiming, TokenEvent
from dsv41.runtime.serving.release_format import DSML, ToolCall, render_tool_calls
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import ToolCallFilter, parse_tool_calls

CALLS = (ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3})),
         ToolCall("web::search",
                  json.dumps({"q": "a \"quoted\"\nline", "filters": {"lang": ["fr"]}})))


def test_rendered_calls_parse_back():
    text = "Let me check.\n\n" + render_tool_calls(CALLS)
    assert f'<{DSML} invoke name="web::search">' in text  # V4.1's tags: a leading space
    reply = parse_tool_calls(text)
    assert reply.content == "Let me check."
    assert [c.name for c in reply.calls] == ["get_weather", "web::search"]
    assert [json.loads(c.arguments) for c in reply.calls] == [json.loads(c.arguments)
                                                              for c in CALLS]
    only = parse_tool_calls(render_tool_calls(CALLS[:1]))
    assert only.content == "" and len(only.calls) == 1


@pytest.mark.parametrize("broken", [
    lambda b: b[:-5],  # cut by max_tokens: no closing tag
    lambda b: b.replace('string="false">3<', 'string="false">3x<'),  # not JSON
    lambda b: b.replace(f"<{DSML} invoke name", f"junk\n<{DSML} invoke name", 1),  # stray text
    lambda b: b.replace(f'<{DSML} invoke name="get_weather">', "<invoke>"),  # no invoke at all
])
def test_a_malformed_block_stays_text(broken):
    text = "Sure.\n\n" + broken(render_tool_calls(CALLS[:1]))
    reply = parse_tool_calls(text)
    assert reply.calls == () and reply.content == text


def test_v4s_tags_are_not_calls():
    v4 = render_tool_calls(CALLS).replace(f"{DSML} calls", f"{DSML}tool_calls").replace(
        f"{DSML} ", DSML)
    assert f"<{DSML}tool_calls>\n<{DSML}invoke" in v4
    assert parse_tool_calls(v4).calls == ()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streaming_holds_back_exactly_the_block(step):
    block = render_tool_calls(CALLS)
    text = "Checking <the> weather.\n\n" + block
    f = ToolCallFilter()
    out = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step))
    assert out == "Checking <the> weather." and f.streamed == out
    reply = f.finish()
    assert reply.content == "" and reply.calls and \
        [c.name for c in reply.calls] == ["get_weather", "web::search"]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streaming_text_without_a_block_is_all_streamed(step):
    text = f"a < b and <｜DS but no block\n\n<{DSML} cal"  # ends in a partial opening tag
    f = ToolCallFilter()
    out = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step))
    assert text.startswith(out) and len(out) < len(text)
    reply = f.finish()
    assert reply.calls == () and out + reply.content == text


# ---- the server, on a scripted batcher ---------------------------------------------------------


class ScriptedStream:
    """What the server reads from a batcher's stream: events, cancel, timing."""

    def __init__(self, events):
        self._events = queue.Queue()
        for e in events:
            self._events.put(e)
        self.cancelled = False

    def get(self, timeout=None):
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self):
        self.cancelled = True

    @property
    def timing(self):
        return RequestTiming(0.0, 0.01, (), 1, 1, "cold", 0)


class ScriptedBatcher:
    """Replies with `text`, one event per token of the released tokenizer."""

    def __init__(self, tok: Tokenizer, text: str):
        self.tok, self.text = tok, text

    def submit(self, prompt_ids, params, images=()):
        assert not images, "these tests send text only"
        ids = self.tok.encode(self.text)
        events = [TokenEvent(t, self.tok.decode([t]), None, (), None) for t in ids[:-1]]
        events.append(TokenEvent(ids[-1], self.tok.decode([ids[-1]]), None, (),
                                 FinishReason.STOP))
        return ScriptedStream(events)

    def stats(self):
        raise AssertionError("not asked in these tests")


@pytest.fixture(scope="module")
def deepseek():
    return Tokenizer.for_model(preset("full"))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _serve(tok, text):
    args = preset("full")
    app = create_app(ScriptedBatcher(tok, text), tok, ServerOptions(
        model_name="m", vocab_size=args.vocab_size, max_seq_len=args.max_seq_len))
    return ServerThread(app)


def test_server_answers_tool_calls(deepseek):
    reply = "Checking.\n\n" + render_tool_calls(CALLS[:1])
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "max_tokens": 200}
    with _serve(deepseek, reply) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking."
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}

        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions",
                          json={**body, "stream": True}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == "Checking."
        # streamed piece by piece: index, id and name first, then the arguments' pieces
        first, *rest = [tc for d in deltas for tc in d.get("tool_calls", ())]
        assert first["index"] == 0 and first["function"]["name"] == "get_weather"
        assert first["id"].startswith("call_") and rest and all(
            tc["index"] == 0 and "id" not in tc for tc in rest)
        arguments = first["function"]["arguments"] + "".join(
            tc["function"]["arguments"] for tc in rest)
        assert json.loads(arguments) == {"city": "Paris", "days": 3}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

        # without tools in the request, the same reply is text, as generated
        plain = {k: v for k, v in body.items() if k != "tools"}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=plain, timeout=60).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["message"]["content"] == reply
        assert "tool_calls" not in r["choices"][0]["message"]


def test_an_unconstrained_call_missing_its_schema_says_why(deepseek):
    """`auto` with a tool that is not strict: the reply's call is returned as generated, and
    one whose arguments miss the tool's schema carries `dsv41_argument_error` (whole and
    streamed: a last `tool_calls` entry of its index before the finish); a call that satisfies
    the schema carries none."""
    reply = "Checking.\n\n" + render_tool_calls(CALLS[:1])  # {"city": "Paris", "days": 3}
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "days": {"type": "integer", "maximum": 2}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": tools, "max_tokens": 200}
    why = "arguments.days: 3 is greater than the maximum of 2"
    with _serve(deepseek, reply) as srv:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert call["dsv41_argument_error"] == why
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions",
                          json={**body, "stream": True}, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        entries = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", ())]
        assert entries[-1] == {"index": 0, "dsv41_argument_error": why}
        assert sum("dsv41_argument_error" in tc for tc in entries) == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        ok = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            **schema, "properties": {**schema["properties"], "days": {"type": "integer"}}}}}]
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "tools": ok},
                       timeout=60).json()
        (call,) = r["choices"][0]["message"]["tool_calls"]
        assert "dsv41_argument_error" not in call
