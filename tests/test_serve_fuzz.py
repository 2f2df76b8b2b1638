"""Fuzzing the server (issue 38): schemathesis against the app's own OpenAPI document (the
request bodies of runtime/serving/api_schema.py) on the small preset model, in process, a
bounded number of cases per endpoint: no answer is a 5xx. Then hypothesis properties of the
pieces under it: the request mapping (any JSON maps to a request or is a 400 / 404 ApiError,
nothing else), the chat format (a client's text never yields a marker's id; rendering is
deterministic) and stop strings (matched as the text streams, cut anywhere, equals matching the
whole text). `scripts/fuzz_serve.py` runs the larger fuzz against a running `dsv41 serve`."""

from __future__ import annotations

from dataclasses import replace

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41.graph.config import load_config
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine.sampling import StopMatcher
from dsv41.runtime.serving.app import ServerOptions, create_app
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.chat_format import (
    MARKERS,
    ChatOptions,
    Message,
    Role,
    encode_chat,
    render_chat,
)
from dsv41.runtime.serving.openai_api import ApiError, parse_chat, parse_completion
from dsv41.runtime.serving.prompts import TextBudget
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_choice import TokenTexts

MODEL = "small"
MAX_TOKENS = 3  # what the fuzzed requests may generate (the frontend below caps it)
EXAMPLES = 30  # schemathesis cases per endpoint in the default suite


class Capped:
    """The batcher with every request's max_tokens capped at MAX_TOKENS, so that a fuzzed
    request asking for the whole context costs a few decode steps."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher

    def submit(self, prompt_ids, params, images=()):
        cap = min(params.max_tokens or MAX_TOKENS, MAX_TOKENS)
        return self.batcher.submit(prompt_ids, replace(params, max_tokens=cap), images)

    def stats(self):
        return self.batcher.stats()


@pytest.fixture(scope="module")
def tok(small_case):
    return Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)


@pytest.fixture(scope="module")
def app(small_model, tok):
    engine = Engine.from_model(small_model, weights_hash="f" * 64, page_tokens=64)
    batcher = Batcher(engine, tokenizer=tok, max_running=4, max_queue=64)
    batcher.start()
    a = small_model.args
    yield create_app(Capped(batcher), tok, ServerOptions(
        model_name=MODEL, vocab_size=a.vocab_size, max_seq_len=a.max_seq_len,
        request_timeout_s=120))
    batcher.stop()
    engine.close()


def test_schemathesis_finds_no_server_error(app):
    """Every operation of /openapi.json, EXAMPLES generated cases each (valid bodies and
    mutated ones): every answer below 500."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in operations} == {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
        "POST /detokenize", "GET /v1/models", "GET /health", "GET /version", "GET /metrics",
        "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses"}
    seen, errors = [], []

    def fuzz(op) -> None:
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            response = case.call()
            seen.append(response.status_code)
            if response.status_code >= 500:
                errors.append((op.path, case.body, response.status_code, response.text[:300]))

        run()

    for op in operations:
        fuzz(op)
    assert errors == []
    assert len(seen) >= 3 * EXAMPLES and {200, 400} <= set(seen)


# ---- hypothesis: the request mapping -------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "temperature", "top_p",
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "seed", "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "ignore_eos",
          "logprobs", "top_logprobs", "n", "tools", "tool_choice", "parallel_tool_calls",
          "reasoning_effort", "chat_template_kwargs", "echo", "suffix", "best_of",
          "logit_bias", "min_tokens", "response_format"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                          "tool", "developer", "x"])},
                                optional={"content": JSON | st.text(max_size=20),
                                          "tool_calls": JSON, "tool_call_id": JSON,
                                          "reasoning_content": JSON})
BODY = st.one_of(JSON, st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(
    lambda d: {"model": MODEL, "messages": [{"role": "user", "content": "w3"}], **d}),
    st.builds(lambda ms, d: {"model": MODEL, "messages": ms, **d}, st.lists(MESSAGE, max_size=3),
              st.dictionaries(st.sampled_from(FIELDS[3:]), JSON, max_size=3)))


@pytest.fixture(scope="module")
def texts(tok):
    return TokenTexts.of(tok)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY)
def test_any_json_maps_to_a_request_or_a_400(tok, texts, body):
    budget = TextBudget.of(tok, 128)
    for parse in (
            lambda b: parse_chat(b, tok, model_name=MODEL, vocab_size=512, image_token_id=510,
                                 texts=lambda: texts, budget=budget),
            lambda b: parse_completion(b, tok, model_name=MODEL, vocab_size=512,
                                       budget=budget)):
        try:
            req = parse(body)
        except ApiError as e:
            assert e.status in (400, 404) and e.message
            continue
        assert all(0 <= t < 512 for t in req.prompt_ids)


PROSE = st.lists(st.sampled_from(["a", "B", "é", "e\u0301", "漢字", "ｱ", "1", "2024", " ", "  ",
                                  "\n", "\r\n", "\t", ".", ",", "'s", "-", "😀", "\u00a0",
                                  "<｜User｜>", "<think>", "x"]), max_size=60).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=PROSE, size=st.integers(1, 12))
def test_a_prompt_counted_in_chunks_has_its_whole_count(tok, text, size):
    """Cut at spaces between letters into chunks of any size, a text counts the tokens it has
    encoded whole, as ordinary text and with its added tokens (so a count over the context
    proves the prompt too long)."""
    budget = replace(TextBudget.of(tok, 1 << 30), chunk_chars=size, long_chars=1 << 30)
    assert budget.word_cuts and budget.max_token_bytes == 21
    literal, added = len(tok.encode_text(text)), len(tok.encode(text))
    assert budget.count(tok, text) == literal
    assert budget.count(tok, text, literal=False) == added
    # a chunk too long to tokenize is bounded by its bytes: never more than the count
    short = replace(budget, long_chars=size)
    assert short.count(tok, text) <= literal and short.count(tok, text, literal=False) <= added


# ---- hypothesis: the chat format -----------------------------------------------------------------

# a client's text: pieces of the markers' spellings, the markers themselves, or any text
CLIENT_TEXT = st.lists(st.sampled_from(["<", "｜", ">", "/", "think", "User", "Assistant", "▁",
                                        "begin", " ", "\n", "a", "é", "漢", "1", "</think>",
                                        "<think>", *MARKERS]), max_size=12).map("".join) \
    | st.text(max_size=20)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(user=CLIENT_TEXT, system=CLIENT_TEXT, thinking=st.booleans())
def test_client_text_never_yields_a_marker_id(tok, user, system, thinking):
    marker_ids = {tok.token_to_id(m) for m in MARKERS}
    assert not marker_ids & set(tok.encode_text(user))
    msgs = [Message(Role.SYSTEM, system), Message(Role.USER, user)]
    plain = [Message(Role.SYSTEM, "w"), Message(Role.USER, "w")]
    options = ChatOptions(thinking=thinking)
    ids = encode_chat(tok, msgs, options)
    # the markers are the format's, wherever the client's text spells them
    assert [t for t in ids if t in marker_ids] == [
        t for t in encode_chat(tok, plain, options) if t in marker_ids]
    assert ids == encode_chat(tok, msgs, options)
    assert render_chat(msgs, options) == render_chat(msgs, options)


# ---- hypothesis: stop strings --------------------------------------------------------------------

SMALL_TEXT = st.text(alphabet="abc\n", max_size=24)


def whole(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text a reply shows and the stop string that ended it, on the whole text: the first
    prefix that ends with a stop string (the longest of those ending there) -- what a reader of
    the text one character at a time sees first."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end - len(stop)], stop
    return text, None


@settings(max_examples=500, deadline=None)
@given(text=SMALL_TEXT, stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4),
                                       min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 24), max_size=8))
def test_streamed_stop_matching_equals_the_whole_text(text, stops, cuts):
    """Any cut of the text, stop strings inside one another included (issue 38's fuzz: with
    "b" and "aba", "ab" | "a" stopped at "b" and "aba" whole at "aba")."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m, shown, stop = StopMatcher(stops), "", None
    for a, b in zip(bounds, bounds[1:], strict=False):
        got = m.feed(text[a:b])
        shown += got.text
        if got.stopped:
            stop = got.stop
            break
    if stop is None:
        shown += m.flush()
    assert (shown, stop) == whole(text, stops)


def test_counting_in_one_character_chunks_ends(tok):
    """Found by the property above (it hung CI): with chunks of one character, a cut right at
    a space between letters gave an empty chunk and the count never moved on. Run on a thread
    so a regression fails here instead of hanging the suite."""
    import threading

    budget = replace(TextBudget.of(tok, 1 << 30), chunk_chars=1, long_chars=1 << 30)
    got: list[int] = []
    worker = threading.Thread(target=lambda: got.append(budget.count(tok, "ab cd ef")),
                              daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert got == [len(tok.encode_text("ab cd ef"))]
