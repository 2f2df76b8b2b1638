"""The OpenAI request parsing, response bodies, plain prompts and metrics text: exact values, no
engine (the HTTP server end to end is tests/test_serve.py)."""

from __future__ import annotations

import pytest

from dsv41.graph.config import preset
from dsv41.graph.vocab import SMALL_STUB_JSON, TokenizerSource
from dsv41.runtime.engine.sampling import TokenLogprob
from dsv41.runtime.serving.chat_format import ChatOptions, Message, Role, ToolCall
from dsv41.runtime.serving.metrics import (
    FinishTiming,
    RateWindow,
    ServerMetrics,
    parse_metrics,
)
from dsv41.runtime.serving.openai_api import (
    ApiError,
    Endpoint,
    LogprobsForm,
    TokenOut,
    chunk_body,
    logprobs_body,
    parse_chat,
    parse_completion,
)
from dsv41.runtime.serving.prompts import (
    PromptFormat,
    chat_prompt_ids,
    completion_prompt_ids,
    prompt_format,
)
from dsv41.runtime.serving.tokenizer import Tokenizer

MODEL = "small"


@pytest.fixture(scope="module")
def stub():
    """The conformance stub vocabulary (`w{k}` / ` W{k}`, no chat markers): a vocabulary
    without DeepSeek's markers, so prompts are PLAIN."""
    return Tokenizer.from_file(SMALL_STUB_JSON, preset("small"), TokenizerSource.SMALL_STUB)


def chat(stub, **body):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "w3 W3"}],
                       **body}, stub, model_name=MODEL, vocab_size=512)


def completion(stub, **body):
    return parse_completion({"model": MODEL, "prompt": "w3 W3", **body}, stub,
                            model_name=MODEL, vocab_size=512)


def test_plain_prompts_on_the_stub(stub):
    assert prompt_format(stub) is PromptFormat.PLAIN
    msgs = [Message(Role.SYSTEM, "w1"), Message(Role.USER, " W2w3"),
            Message(Role.ASSISTANT, " W4"), Message(Role.USER, "w5")]
    # BOS (id 0), then the texts joined: w1 W2 w3 W4 w5
    assert chat_prompt_ids(stub, msgs) == [0, 2, 5, 6, 9, 10]
    assert chat_prompt_ids(stub, msgs, ChatOptions(add_bos=False)) == [2, 5, 6, 9, 10]
    with pytest.raises(ValueError, match="at least one user message"):
        chat_prompt_ids(stub, [Message(Role.SYSTEM, "w1")])
    with pytest.raises(ValueError, match="tool calls and tool results cannot be spelled"):
        chat_prompt_ids(stub, [Message(Role.USER, "w1"),
                               Message(Role.ASSISTANT, "", tool_calls=(ToolCall("f", "{}"),))])
    with pytest.raises(ValueError, match="cannot spell this text"):
        chat_prompt_ids(stub, [Message(Role.USER, "hello")])
    assert completion_prompt_ids(stub, "w3 W3", vocab_size=512) == [0, 6, 7]
    assert completion_prompt_ids(stub, [9, 8, 7], vocab_size=512) == [9, 8, 7]
    assert completion_prompt_ids(stub, [[9, 8]], vocab_size=512) == [9, 8]
    for bad, msg in (([512], "outside the model's 512 ids"), ("", "must not be empty"),
                     (["w1", "w2"], "several prompts"), ([], "non-empty string"),
                     ([True], "non-empty string"), (None, "non-empty string")):
        with pytest.raises(ValueError, match=msg):
            completion_prompt_ids(stub, bad, vocab_size=512)


def test_chat_fields_map_onto_sampling_params(stub):
    req = chat(stub, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, presence_penalty=0.5,
               frequency_penalty=-0.5, repetition_penalty=1.2, seed=7, max_completion_tokens=9,
               max_tokens=3, stop="w9", logprobs=True, top_logprobs=2, stream=True,
               stream_options={"include_usage": True}, user="ignored")
    p = req.params
    assert req.endpoint is Endpoint.CHAT and req.prompt_ids == (0, 6, 7)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 0, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.max_tokens, p.stop, p.logprobs) == (7, 9, ("w9",), 2)
    assert req.stream and req.include_usage and req.logprobs is LogprobsForm.CHAT
    assert req.id.startswith("chatcmpl-")
    d = chat(stub).params
    assert (d.temperature, d.max_tokens, d.logprobs, d.stop) == (1.0, None, None, ())
    assert chat(stub, logprobs=True).params.logprobs == 0


def test_completion_fields(stub):
    req = completion(stub, logprobs=3, stop=["w1", " W2"], stop_token_ids=[5],
                     ignore_eos=True)
    p = req.params
    assert req.prompt_ids == (0, 6, 7) and req.logprobs is LogprobsForm.COMPLETIONS
    assert (p.max_tokens, p.logprobs, p.stop, p.stop_token_ids, p.ignore_eos) == (
        16, 3, ("w1", " W2"), (5,), True)  # 16: OpenAI's completions default
    assert not req.stream and completion(stub).logprobs is LogprobsForm.NONE


@pytest.mark.parametrize("body, status, param, match", [
    ({"model": "gpt-4"}, 404, "model", "does not exist; this server serves 'small'"),
    ({"model": None}, 400, "model", "model is required"),
    ({"max_tokens": -1}, 400, "max_tokens", "max_tokens must be a whole number >= 1"),
    ({"max_tokens": 0}, 400, "max_tokens", "max_tokens must be a whole number >= 1"),
    ({"n": 17}, 400, "n", "n must be a whole number from 1 to 16, not 17."),
    ({"n": True}, 400, "n", "n must be a whole number from 1 to 16, not True."),
    ({"best_of": 2}, 400, "best_of", "best_of is a /v1/completions field"),
    ({"temperature": 3}, 400, "temperature", "temperature must be a number from 0 to 2"),
    ({"temperature": "hot"}, 400, "temperature", "temperature must be a number"),
    ({"top_p": 0}, 400, "top_p", "top_p must be a number above 0"),
    ({"seed": -1}, 400, "seed", "seed must be a whole number"),
    ({"stop": 5}, 400, "stop", "stop must be a string or a list"),
    ({"stop": [""]}, 400, "stop", "stop strings must not be empty"),
    ({"stop_token_ids": [600]}, 400, "stop_token_ids", "outside the model's 512 token ids"),
    ({"stream": "yes"}, 400, "stream", "stream must be true or false"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed with stream: true"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "from 0 to 20"),
    ({"logprobs": 1}, 400, "logprobs", "logprobs must be true or false"),
    ({"echo": True}, 400, "echo", "echo is not supported"),
    ({"logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ({"response_format": {"type": "xml"}}, 400, "response_format",
     'response_format.type must be "text", "json_object" or "json_schema", not \'xml\'.'),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, 400, "ignore_eos",
     "ignore_eos cannot be combined with a JSON response_format"),
    ({"messages": []}, 400, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "w1"}]}, 400, "messages", "has role 'robot'"),
    ({"messages": [{"role": "user", "content": "hello"}]}, 400, "messages",
     "cannot spell this text"),
])
def test_bad_chat_requests(stub, body, status, param, match):
    with pytest.raises(ApiError) as e:
        chat(stub, **body)
    assert (e.value.status, e.value.param) == (status, param)
    assert match in e.value.message
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if status == 404:
        assert (err["type"], err["code"]) == ("not_found_error", "model_not_found")


def test_bad_completion_requests(stub):
    for body, param, match in (({"prompt": [1, 600]}, "prompt", "outside the model's 512"),
                               ({"logprobs": 21}, "logprobs", "from 0 to 20"),
                               ({"logprobs": True}, "logprobs", "a whole number"),
                               ({"suffix": "w1"}, "suffix", "not supported"),
                               ({"n": 3, "best_of": 2}, "best_of",
                                r"best_of \(2\) must be at least n \(3\)"),
                               ({"best_of": 3, "stream": True}, "best_of",
                                "best_of cannot be streamed"),
                               ({"best_of": 0}, "best_of", "from 1 to 16, not 0")):
        with pytest.raises(ApiError, match=match) as e:
            completion(stub, **body)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(ApiError, match="JSON object"):
        parse_completion([1, 2], stub, model_name=MODEL, vocab_size=512)


def test_logprobs_and_chunk_bodies(stub):
    toks = [TokenOut(6, "w3", -0.5, (TokenLogprob(6, -0.5), TokenLogprob(7, -1.5))),
            TokenOut(7, " W3", -0.25, (TokenLogprob(7, -0.25),))]
    c = logprobs_body(stub, LogprobsForm.CHAT, toks)["content"]
    assert [e["token"] for e in c] == ["w3", " W3"] and c[1]["bytes"] == [32, 87, 51]
    assert [x["token"] for x in c[0]["top_logprobs"]] == ["w3", " W3"]
    assert logprobs_body(stub, LogprobsForm.COMPLETIONS, toks, text_offset=4) == {
        "tokens": ["w3", " W3"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"w3": -0.5, " W3": -1.5}, {" W3": -0.25}], "text_offset": [4, 6]}
    assert logprobs_body(stub, LogprobsForm.NONE, toks) is None
    req = chat(stub, stream=True)
    first = chunk_body(req, MODEL, text="", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk_body(req, MODEL, text=None, finish_reason="stop")
    assert last["choices"][0]["delta"] == {} and last["object"] == "chat.completion.chunk"


def test_rate_window():
    now = [100.0]
    r = RateWindow(10.0, clock=lambda: now[0])
    r.add(30)
    now[0] = 105.0
    r.add(20)
    assert r.rate() == 5.0
    now[0] = 112.0  # the first amount left the window
    assert r.rate() == 2.0


def test_server_metrics_render():
    """Request-level series from observe_finish, the frontend's from its stats at the scrape;
    the text parsed by prometheus_client (parse_metrics), model_name left out of the keys."""
    from dsv41.runtime.serving.frontend import BatcherStats

    m = ServerMetrics("m", clock=lambda: 0.0)
    m.observe_finish("stop", FinishTiming(0.5, 0.75, (0.01, 0.02), 3, 12))
    m.observe_finish("cancelled", FinishTiming(0.1, None, (), 0, 4))
    m.count_rejected(429)
    with pytest.raises(ValueError, match="Unknown finish reason"):
        m.observe_finish("gone", FinishTiming(0, None, (), 0))
    stats = BatcherStats(queued=2, running=5, finished=7, cancelled=1, prompt_tokens=40,
                         completion_tokens=30, tiers={"cold": 3, "prefix": 2},
                         tier_tokens={"cold": 0, "prefix": 16}, cache_bytes=25,
                         cache_budget_bytes=100)
    m.watch(lambda: stats)
    with pytest.raises(ValueError, match="already watch a frontend"):
        m.watch(lambda: stats)
    got = parse_metrics(m.render())
    assert "model_name=" in m.render().decode()
    assert got["vllm:num_requests_waiting"] == 2 and got["vllm:num_requests_running"] == 5
    assert got["vllm:kv_cache_usage_perc"] == 0.25
    assert got["vllm:prompt_tokens_total"] == 40 and got["vllm:generation_tokens_total"] == 30
    assert got["vllm:prefix_cache_queries_total"] == 40
    assert got["vllm:prefix_cache_hits_total"] == 16
    assert got['dsv41:tier_hits_total{tier="prefix"}'] == 2
    assert got['dsv41:tier_hit_tokens_total{tier="prefix"}'] == 16
    assert got['dsv41:prompt_cache_hit_tokens_total{cache="ssd_store"}'] == 16
    assert got['dsv41:requests_finished_total{reason="cancelled"}'] == 1
    assert got['dsv41:requests_finished_total{reason="timeout"}'] == 0
    assert got['vllm:request_success_total{finished_reason="abort"}'] == 1
    assert got['vllm:request_success_total{finished_reason="stop"}'] == 1
    assert got['dsv41:requests_rejected_total{code="429"}'] == 1
    assert got["vllm:time_to_first_token_seconds_count"] == 1
    assert got['vllm:inter_token_latency_seconds_bucket{le="0.01"}'] == 1
    assert got["vllm:inter_token_latency_seconds_count"] == 2
    assert got["vllm:time_per_output_token_seconds_count"] == 2
    assert got["vllm:request_time_per_output_token_seconds_sum"] == 0.015
    assert got["vllm:e2e_request_latency_seconds_sum"] == 0.78 + 0.1  # last token; no token
    assert got["vllm:request_prompt_tokens_sum"] == 16
    assert got["dsv41:generation_tokens_per_second"] == 0.3  # 3 tokens over the 10 s window
    assert not any(k.startswith(("vllm:spec", "dsv41:ssd", "dsv41:snapshot")) for k in got)
    with pytest.raises(ValueError, match="model's name"):
        ServerMetrics("")


def test_chat_reads_thinking_and_reasoning_effort(stub):
    from dsv41.runtime.serving.openai_api import chat_prompt

    base = {"messages": [{"role": "user", "content": "w3"}]}
    assert chat_prompt(base).options == ChatOptions()  # chat mode, effort high (75)
    opts = chat_prompt({**base, "reasoning_effort": "max",
                        "chat_template_kwargs": {"thinking": True}}).options
    assert opts.thinking and opts.effort.budget == 100
    assert chat_prompt({**base, "reasoning_effort": 30}).options.effort.budget == 30
    for bad in ("medium", 0, "75"):
        with pytest.raises(ApiError, match="reasoning_effort must be") as e:
            chat(stub, reasoning_effort=bad)
        assert e.value.status == 400 and e.value.param == "reasoning_effort"
    with pytest.raises(ApiError, match="thinking must be true or false"):
        chat(stub, chat_template_kwargs={"thinking": "yes"})
