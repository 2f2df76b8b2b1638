"""Reasoning and tool calls in the chat API's answers: `reasoning_content` split off at `</think>`
(message field; `delta.reasoning_content` chunks, the marker never in either field, whatever
the chunk boundaries), tool calls streamed piece by piece (`delta.tool_calls[i]`: index, id and
name first, then argument pieces joining to the non-streamed arguments), no DSML markup in
`content`; tool / tool_choice fields parsed into 400s. The replies are scripted events through
the generation handler (a fake stream: no engine), cut at every possible boundary."""

from __future__ import annotations

import asyncio
import json

import pytest

from dsv41.graph.config import preset
from dsv41.graph.vocab import SMALL_STUB_JSON, TokenizerSource
from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.frontend import FinishReason, RequestTiming, TokenEvent
from dsv41.runtime.serving.generation import Generation
from dsv41.runtime.serving.metrics import ServerMetrics
from dsv41.runtime.serving.openai_api import (
    ApiError,
    Endpoint,
    GenerationRequest,
    LogprobsForm,
    parse_chat,
)
from dsv41.runtime.serving.release_format import DSML
from dsv41.runtime.serving.state import AppState, ServerOptions
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import (
    ReasoningFilter,
    ToolCallStream,
    parse_tool_calls,
    split_reasoning,
)
from dsv41.runtime.serving.tool_choice import AvoidText, DsmlConstraint, TokenTexts

MODEL = "small"
BLOCK = (f'<{DSML} calls>\n<{DSML} invoke name="get_weather">\n'
         f'<{DSML} parameter name="city" string="true">Paris "</｜x</{DSML} parameter>\n'
         f'<{DSML} parameter name="days" string="false">3</{DSML} parameter>'
         f"\n</{DSML} invoke>\n"
         f'<{DSML} invoke name="now">\n\n</{DSML} invoke>\n</{DSML} calls>')
REPLY = "Let me think </thin about it.</think>Checking.\n\n" + BLOCK


@pytest.fixture(scope="module")
def stub():
    """The conformance stub vocabulary (no chat markers: prompts are plain)."""
    return Tokenizer.from_file(SMALL_STUB_JSON, preset("small"), TokenizerSource.SMALL_STUB)


class _Script:
    """An EventStream of scripted text pieces, the last one finishing."""

    def __init__(self, pieces, finish=FinishReason.STOP):
        self.events = [TokenEvent(3 + i, p, None, (), finish if i == len(pieces) - 1 else None)
                       for i, p in enumerate(pieces)]

    def get(self, timeout=None):
        return self.events.pop(0) if self.events else None

    def cancel(self):
        pass

    @property
    def timing(self):
        return RequestTiming(0.0, 0.0, (), 4, 0, "cold", 0)


def _gen(stub) -> Generation:
    opts = ServerOptions(model_name=MODEL, vocab_size=512, max_seq_len=128)
    return Generation(AppState(None, stub, opts, ServerMetrics(MODEL), lambda r: None))


def _req(stream: bool, *, thinking=True, tools=True, parallel=True) -> GenerationRequest:
    return GenerationRequest(Endpoint.CHAT, (0,), SamplingParams(), stream, False,
                             LogprobsForm.NONE, reads_tool_calls=tools,
                             parallel_tool_calls=parallel, thinking=thinking)


def _cuts(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def _collect(stub, req, pieces, finish=FinishReason.STOP) -> dict:
    resp = asyncio.run(_gen(stub).collect(req, _Script(pieces, finish), None, None))
    return json.loads(resp.body)


def _stream(stub, req, pieces, finish=FinishReason.STOP) -> list[dict]:
    async def run():
        return [x async for x in _gen(stub).sse(req, _Script(pieces, finish), None)]
    out = asyncio.run(run())
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(x[len("data: "):]) for x in out[:-1]]


def _joined(chunks: list[dict]) -> dict:
    """The streamed deltas put together as a client does."""
    reasoning, content, calls = "", "", {}
    for c in chunks:
        d = c["choices"][0]["delta"]
        reasoning += d.get("reasoning_content", "")
        content += d.get("content") or ""
        for t in d.get("tool_calls", []):
            if "id" in t:
                assert t["index"] not in calls and t["function"]["name"]
                calls[t["index"]] = {"id": t["id"], "name": t["function"]["name"],
                                     "arguments": t["function"]["arguments"]}
            else:
                calls[t["index"]]["arguments"] += t["function"]["arguments"]
    return {"reasoning": reasoning, "content": content, "calls": calls,
            "finish": chunks[-1]["choices"][0]["finish_reason"]}


def test_non_stream_reasoning_content_and_calls(stub):
    body = _collect(stub, _req(False), _cuts(REPLY, 7))
    msg, choice = body["choices"][0]["message"], body["choices"][0]
    assert msg["reasoning_content"] == "Let me think </thin about it."
    assert msg["content"] == "Checking."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {
        "city": 'Paris "</｜x', "days": 3}
    assert choice["finish_reason"] == "tool_calls"
    one = _collect(stub, _req(False, parallel=False), [REPLY])["choices"][0]["message"]
    assert len(one["tool_calls"]) == 1
    chat = _collect(stub, _req(False, thinking=False, tools=False), ["Hi", " there"])
    assert "reasoning_content" not in chat["choices"][0]["message"]
    assert chat["choices"][0]["message"]["content"] == "Hi there"
    cut = _collect(stub, _req(False), ["still thinking </th"], FinishReason.LENGTH)
    msg = cut["choices"][0]["message"]
    assert msg["reasoning_content"] == "still thinking </th" and msg["content"] is None


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 1000])
def test_stream_matches_non_stream_at_any_cut(stub, n):
    whole = _collect(stub, _req(False), [REPLY])["choices"][0]
    got = _joined(_stream(stub, _req(True), _cuts(REPLY, n)))
    assert got["reasoning"] == whole["message"]["reasoning_content"]
    assert got["content"] == whole["message"]["content"] == "Checking."
    assert [c["name"] for c in got["calls"].values()] == ["get_weather", "now"]
    assert [c["arguments"] for c in got["calls"].values()] == [
        c["function"]["arguments"] for c in whole["message"]["tool_calls"]]
    assert got["finish"] == "tool_calls"
    # neither field ever carries a marker or a piece of one
    for c in _stream(stub, _req(True), _cuts(REPLY, n)):
        d = c["choices"][0]["delta"]
        for field in ("reasoning_content", "content"):
            assert "</think>" not in d.get(field, "") and DSML not in (d.get(field) or "")


def test_calls_stream_before_the_reply_ends(stub):
    """The first call's name and arguments come out while the second call is still written."""
    cut = REPLY.index(f'<{DSML} invoke name="now">') + 5
    s = ToolCallStream()
    _, early = s.feed(split_reasoning(REPLY[:cut])[1])
    assert [d.name for d in early if d.name] == ["get_weather"]
    assert "".join(d.arguments for d in early) == json.dumps(
        {"city": 'Paris "</｜x', "days": 3}, ensure_ascii=False)


def test_broken_and_unclosed_blocks_keep_the_text(stub):
    bad = "Hi\n\n" + BLOCK.replace(">3<", ">three<")
    got = _joined(_stream(stub, _req(True, thinking=False), _cuts(bad, 4)))
    assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
    assert got["content"].startswith("Hi") and "three" in got["content"]
    assert got["finish"] == "stop"
    text = "No block <｜DSML｜ call but text"
    got = _joined(_stream(stub, _req(True, thinking=False), _cuts(text, 3)))
    assert got["content"] == text and not got["calls"]
    assert parse_tool_calls(text).calls == ()


def test_reasoning_filter_holds_a_partial_marker():
    f = ReasoningFilter()
    assert f.feed("a <") == ("a ", "")
    assert f.feed("/thi") == ("", "")
    assert f.feed("nk>b") == ("", "b") and f.closed
    g = ReasoningFilter()
    assert g.feed("x</th") == ("x", "") and g.flush() == "</th"


def _chat(stub, **body):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "w3 W3"}],
                       **body}, stub, model_name=MODEL, vocab_size=512)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}


@pytest.mark.parametrize("body,param,match", [
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "tools",
     "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "JSON Schema object"),
    ({"tools": [TOOL], "tool_choice": "any"}, "tool_choice", "tool_choice must be"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "not one of"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_bad_tool_fields_are_400s(stub, body, param, match):
    with pytest.raises(ApiError) as e:
        _chat(stub, **body)
    assert e.value.status == 400 and e.value.param == param
    assert match in e.value.message


def test_tool_choice_sets_the_constraint():
    """On the released vocabulary (the chat format): required / named constrain to the DSML
    grammar and read calls; none masks the block's opening and reads nothing; auto is free.
    The constraint spells the block with the vocabulary's own `｜DSML｜` token."""
    tok = Tokenizer.for_model(preset("full"))
    texts = TokenTexts.of(tok)

    def chat(**body):
        return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                           "tools": [TOOL], **body}, tok, model_name=MODEL,
                          vocab_size=preset("full").vocab_size, texts=lambda: texts)

    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        req = chat(tool_choice=choice, parallel_tool_calls=False)
        c = req.params.constraint
        assert isinstance(c, DsmlConstraint) and req.reads_tool_calls
        assert not req.parallel_tool_calls
        ids = tok.encode(f'<{DSML} calls>\n<{DSML} invoke name="f">\n')
        state = c.start()
        for t in ids:
            assert c.allowed(state)[t], tok.decode([t], skip_special=False)
            state = c.advance(state, t)
        assert not c.allowed(state)[tok.encode("Hello")[0]]
    req = chat(tool_choice="none")
    assert isinstance(req.params.constraint, AvoidText) and not req.reads_tool_calls
    req = chat(tool_choice="auto", chat_template_kwargs={"thinking": True})
    assert req.params.constraint is None and req.reads_tool_calls and req.thinking


def test_the_stub_offers_no_tools(stub):
    """The stub renders plain prompts: tools cannot be offered at all (400)."""
    with pytest.raises(ApiError, match="tools cannot be offered"):
        _chat(stub, tools=[TOOL], tool_choice="required")


def test_the_small_presets_own_tokenizer_offers_tools():
    """The small preset's default vocabulary (the byte-level BPE with the chat markers) takes
    tools: `required` attaches the DSML constraint, which lets the block's opening through."""
    tok = Tokenizer.for_model(preset("small"))
    req = _chat(tok, tools=[TOOL], tool_choice="required")
    c = req.params.constraint
    assert isinstance(c, DsmlConstraint) and req.reads_tool_calls
    state = c.start()
    for t in tok.encode(f"<{DSML} calls>\n"):
        assert c.allowed(state)[t], tok.decode([t], skip_special=False)
        state = c.advance(state, t)
