"""Issue 37's API through the `openai` client against the served app (the compiled shared-small
artifact, random weights, the small preset's byte-level BPE): the reasoning split, the effort
line as `/tokenize` shows it, and malformed tools as 400s. (Tool calls themselves need a
context longer than shared-small's 128 positions: the release's tool section alone is ~850 of
the BPE's tokens. `tests/test_tool_choice.py` checks the constraint token by token, and
`scripts/openai_client_check.py` runs seeded tool_choice requests against `dsv41 serve`.)"""

from __future__ import annotations

import httpx
import openai
import pytest
import test_serve

MODEL, NO_EOS = test_serve.MODEL, test_serve.NO_EOS
served, client = test_serve.served, test_serve.client  # the served app and its client (fixtures)
THINK = {"chat_template_kwargs": {"thinking": True}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tokenize_shows_the_effort_line(served):
    """`reasoning_effort` low / high / max / an integer changes the first system line in
    thinking mode; chat mode has none."""

    def prompt(**extra) -> str:
        r = httpx.post(served["url"] + "/tokenize", json={"messages": MSGS, **extra},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
        return body["prompt"]

    line = ("Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the "
            "reasoning)")
    assert line.format(75) in prompt(**THINK)
    assert line.format(50) in prompt(**THINK, reasoning_effort="low")
    assert line.format(100) in prompt(**THINK, reasoning_effort="max")
    assert line.format(33) in prompt(**THINK, reasoning_effort=33)
    assert "Reasoning Effort" not in prompt(reasoning_effort="low")
    assert prompt().startswith("<｜begin▁of▁sentence｜><｜User｜>")
    bad = httpx.post(served["url"] + "/tokenize",
                     json={"messages": MSGS, **THINK, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_reasoning_content_in_thinking_mode_only(served, client):
    """Thinking mode: the reply's text before `</think>` is `reasoning_content` (non-stream and
    stream, the same text); chat mode has none. Random weights rarely close the thought, so the
    reasoning is most of the reply."""
    kw = {"model": MODEL, "messages": MSGS, "max_tokens": 12, "temperature": 0}
    r = client.chat.completions.create(**kw, extra_body={**THINK, **NO_EOS})
    reasoning = r.choices[0].message.model_extra.get("reasoning_content")
    assert reasoning
    assert "</think>" not in reasoning and "</think>" not in (r.choices[0].message.content or "")
    pieces, content = [], ""
    for ch in client.chat.completions.create(**kw, stream=True,
                                             extra_body={**THINK, **NO_EOS}):
        for c in ch.choices:
            pieces.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            content += c.delta.content or ""
    assert "".join(pieces) == reasoning and content == (r.choices[0].message.content or "")
    plain = client.chat.completions.create(**kw, extra_body=NO_EOS)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
    for ch in client.chat.completions.create(**kw, stream=True, extra_body=NO_EOS):
        for c in ch.choices:
            assert "reasoning_content" not in (c.delta.model_extra or {})


@pytest.mark.parametrize("tool, why", [
    ({"type": "function", "function": {"parameters": {"type": "object"}}}, "name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}},
     "parameters"),
    ({"type": "retrieval"}, "function"),
])
def test_malformed_tools_are_400s(served, client, tool, why):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=[tool], max_tokens=2)
    assert e.value.body["param"] == "tools" and why in e.value.body["message"]
