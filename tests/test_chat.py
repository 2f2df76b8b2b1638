"""The DeepSeek-V4 chat format and streaming detokenisation. All exact (strings and ids)."""

from __future__ import annotations

import pytest

from dsv41.graph.config import preset
from dsv41.runtime.serving.chat_format import (
    ChatOptions,
    IncrementalDecoder,
    Message,
    Role,
    ToolCall,
    encode_chat,
    messages_from_openai,
    render_chat,
)
from dsv41.runtime.serving.tokenizer import Tokenizer

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def deepseek():
    return Tokenizer.for_model(preset("full"))


@pytest.fixture(scope="module")
def stub():
    return Tokenizer.for_model(preset("small"))


CONVO = messages_from_openai([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
])


def test_chat_mode():
    assert render_chat(CONVO) == (
        f"{B}Be brief.{U}hello{A}</think>Hello! I am DeepSeek.{E}{U}1+1=?{A}</think>")


def test_thinking_mode_drops_earlier_reasoning():
    assert render_chat(CONVO, ChatOptions(thinking=True)) == (
        f"{B}Be brief.{U}hello{A}</think>Hello! I am DeepSeek.{E}{U}1+1=?{A}<think>")


def test_thinking_mode_keeps_reasoning_when_asked():
    assert render_chat(CONVO, ChatOptions(thinking=True, drop_thinking=False)) == (
        f"{B}Be brief.{U}hello{A}<think>thinking...</think>Hello! I am DeepSeek.{E}"
        f"{U}1+1=?{A}<think>")


def test_tool_call_and_results():
    msgs = messages_from_openai([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "22C"},
    ])
    assert msgs[1].tool_calls == (ToolCall("weather", '{"city": "Paris", "days": 2}'),)
    d = "｜DSML｜"
    assert render_chat(msgs, ChatOptions(add_bos=False)) == (
        f"{U}Weather in Paris?{A}</think>"
        f"\n\n<{d}tool_calls>\n<{d}invoke name=\"weather\">\n"
        f"<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n"
        f"<{d}parameter name=\"days\" string=\"false\">2</{d}parameter>\n"
        f"</{d}invoke>\n</{d}tool_calls>{E}"
        f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>22C</tool_result>{A}</think>")


def test_tools_go_into_the_system_prompt():
    tools = ({"type": "function", "function": {"name": "weather", "parameters": {}}},)
    text = render_chat(CONVO, ChatOptions(tools=tools, thinking=True))
    assert text.startswith(f"{B}Be brief.\n\n## Tools\n\n")
    assert '{"name": "weather", "parameters": {}}' in text
    # tools turn dropping off: earlier reasoning stays
    assert f"{A}<think>thinking...</think>Hello!" in text
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        render_chat(CONVO, ChatOptions(tools=({"type": "function"},)))


def test_encode_chat_uses_the_marker_ids(deepseek):
    opts = ChatOptions(thinking=True)
    ids = encode_chat(deepseek, CONVO, opts)
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]  # ... <｜Assistant｜><think>
    assert ids.count(128803) == 2 and ids.count(1) == 1
    assert deepseek.decode(ids, skip_special=False) == render_chat(CONVO, opts)


def test_stub_vocabulary_has_no_chat(stub):
    with pytest.raises(ValueError, match="has no DeepSeek chat marker tokens"):
        encode_chat(stub, CONVO)


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\] has role 'wizard'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "an image_url part must be"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "must be text or image_url parts"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}],
     "only user messages may hold image parts"),
    ([{"role": "user", "content": "a \ufffc b"}], "stands for an image part"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
     "must be an assistant's"),
])
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        messages_from_openai(messages)


def test_bad_chats():
    with pytest.raises(ValueError, match="at least one user message"):
        render_chat((Message(Role.SYSTEM, "x"),))
    bad = (Message(Role.USER, "x"), Message(Role.ASSISTANT, "", tool_calls=(ToolCall("f", "{"),)))
    with pytest.raises(ValueError, match="are not JSON"):
        render_chat(bad)


def test_developer_is_a_user_turn_and_text_parts_join():
    m = messages_from_openai([{"role": "developer", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert render_chat(m, ChatOptions(add_bos=False)) == f"{U}a\n\nb{A}</think>"


@pytest.mark.parametrize("text", ["naïve 🦜 ok", "𠜎𠜎 x", "Ω≈ç√∫ 日本語"])
def test_incremental_decoder_never_splits_a_character(deepseek, text):
    ids = deepseek.encode(text)
    dec = IncrementalDecoder(deepseek)
    deltas = [dec.feed(t) for t in ids]
    deltas.append(dec.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_holds_a_split_emoji(deepseek):
    ids = deepseek.encode("naïve 🦜 ok")
    assert ids == [2720, 91223, 7351, 102, 253, 9109]  # the parrot is three byte tokens
    dec = IncrementalDecoder(deepseek)
    assert [dec.feed(t) for t in ids] == ["na", "ïve", "", "", " 🦜", " ok"]


def test_incremental_decoder_special_tokens_and_flush(deepseek):
    dec = IncrementalDecoder(deepseek)
    assert dec.feed(deepseek.encode("Hi")[0]) == "Hi"
    assert dec.feed(1) == ""  # EOS: special, skipped
    for t in deepseek.encode("🦜")[:2]:
        assert dec.feed(t) == ""
    assert dec.flush() == "\ufffd"  # the end of the stream inside a character
    raw = IncrementalDecoder(deepseek, skip_special=False)
    assert raw.feed(1) == E


def test_incremental_decoder_on_the_stub(stub):
    dec = IncrementalDecoder(stub)
    assert [dec.feed(t) for t in (0, 6, 7, 510, 1)] == ["", "w3", " W3", "w255", ""]


def test_v41_format():
    from dsv41.runtime.serving.chat_format import ChatFormat

    msgs = messages_from_openai([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "system", "content": "Now answer."},
    ])
    d = "｜DSML｜"
    assert render_chat(msgs, fmt=ChatFormat.V4_1) == (
        f"{B}<｜System｜>Be brief.{U}hi{A}</think>"
        f"\n\n<{d} calls>\n<{d} invoke name=\"f\">\n"
        f"<{d} parameter name=\"x\" string=\"false\">1</{d} parameter>\n"
        f"</{d} invoke>\n</{d} calls>{E}"
        f"<｜System｜>Now answer.{A}</think>")  # a later system message is answered
    # V4: no system marker, and a trailing system message is not a turn to answer
    assert render_chat(msgs).endswith(f"{E}Now answer.")


def test_format_follows_the_tokenizer(deepseek):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from dsv41.runtime.serving.chat_format import ChatFormat, chat_format_for

    assert chat_format_for(deepseek) is ChatFormat.V4
    backend = HFTokenizer.from_file(str(deepseek.file.path))
    backend.add_special_tokens([AddedToken("<｜System｜>", special=True, normalized=False)])
    v41 = Tokenizer(backend, deepseek.file, deepseek.special)
    assert chat_format_for(v41) is ChatFormat.V4_1
    assert encode_chat(v41, CONVO)[:2] == [0, 129280]
