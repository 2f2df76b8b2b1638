"""DeepSeek-V4.1's chat prompt against the release's own encoder: every case of
`shared/conformance/chat` (the request as a client sends it, the prompt string `encoding.py` of
the release renders for it) through the OpenAI layer's reading of the request
(`openai_api.chat_prompt`) and `release_format.render_chat`, byte for byte; a case the release
refuses (`expected.prompt: null`) must be refused. The token ids are checked against the
derived ids where the case has no marker-like text (a client's text is never a marker's id)."""

from __future__ import annotations

import json

import pytest
from conftest import CONFORMANCE

CHAT = CONFORMANCE / "chat"
CASES = sorted(CHAT.glob("chat-*.json")) if CHAT.is_dir() else []


def _case(path):
    return json.loads(path.read_text(encoding="utf-8"))


def _render(request: dict) -> str:
    from dsv41.runtime.serving.openai_api import chat_prompt
    from dsv41.runtime.serving.release_format import render_chat

    chat = chat_prompt(request)
    return render_chat(chat.messages, chat.options)


def test_the_pack_is_here():
    if not CHAT.is_dir():
        pytest.skip(f"the chat conformance pack {CHAT} is not present")
    assert len(CASES) >= 15


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_prompt_string_is_the_release_s(path):
    from dsv41.runtime.serving.openai_api import ApiError

    case = _case(path)
    expected = case["expected"]["prompt"]
    if expected is None:
        with pytest.raises((ValueError, ApiError)):
            _render(case["request"])
        return
    got = _render(case["request"])
    assert got == expected
    assert len(got) == case["expected"]["prompt_chars"]


@pytest.fixture(scope="module")
def deepseek():
    from dsv41.graph.config import preset
    from dsv41.runtime.serving.tokenizer import Tokenizer

    return Tokenizer.for_model(preset("full"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_prompt_ids_are_the_derived_ones(path, deepseek):
    from dsv41.graph.config import preset
    from dsv41.runtime.serving.chat_format import MARKERS, encode_chat
    from dsv41.runtime.serving.openai_api import chat_prompt

    case = _case(path)
    if case["expected"]["prompt"] is None:
        pytest.skip("a refused request has no ids")
    chat = chat_prompt(case["request"])
    ids = encode_chat(deepseek, chat.messages, chat.options,
                      image_token_id=preset("full").image_token_id)
    typed = "".join(m.content + m.reasoning for m in chat.messages)
    if any(s in typed for s in MARKERS):  # the derived ids read the text's markers as markers
        assert ids != case["expected"]["token_ids_derived"]
        assert deepseek.decode(ids, skip_special=False) == case["expected"]["prompt"]
    else:
        assert ids == case["expected"]["token_ids_derived"]
