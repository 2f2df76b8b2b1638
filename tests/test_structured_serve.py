"""Issue 41's structured outputs, usage fields and small endpoints through the official `openai`
client against the served app (the compiled shared-small artifact, random weights, the small
preset's byte-level BPE): `json_schema` (strict) and `json_object` replies that parse and
validate whatever the weights, streaming and not; a batch of three requests with different
grammars and none, the unconstrained one token for token its solo run; an unsupported schema
feature as a 400 naming it; the usage's cache fields exact (DeepSeek's spelling and the tier
breakdown); `/detokenize` round-tripping `/tokenize`; `/version`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

import httpx
import jsonschema
import openai
import pytest
import test_serve

from dsv41.runtime.serving.openai_api import PromptCache, Usage

MODEL, NO_EOS = test_serve.MODEL, test_serve.NO_EOS
served, client = test_serve.served, test_serve.client  # the served app and its client (fixtures)
MSGS = [{"role": "user", "content": "w3 as JSON"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"enum": ["paris", "tokyo"]},
                                              "lat": {"type": "number", "minimum": -90,
                                                      "maximum": 90}},
             "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "home"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}


def test_json_schema_replies_validate(served, client):
    """Sampled replies (temperature 1, seeded) parse and validate: only the grammar can make
    that true on random weights; a streamed reply is the same text."""
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, seed=seed, max_tokens=100,
                                           response_format=FORMAT)
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model=MODEL, messages=MSGS, seed=seed, max_tokens=100, response_format=FORMAT,
            stream=True) if ch.choices)
        assert text == c.message.content
    obj = client.completions.create(model=MODEL, prompt="w3", seed=1, max_tokens=100,
                                    temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_max_tokens_cuts_a_json_reply_with_finish_length(served, client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, temperature=0,
                                       response_format=FORMAT)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content.startswith('{"')


def test_a_batch_of_three_grammars_and_none(served, client):
    """Three requests at once: json_schema, json_object and none; each valid, the free one the
    same tokens as alone."""
    free = {"model": MODEL, "prompt": "w3 W3w4", "max_tokens": 8, "temperature": 0,
            "logprobs": 0, "extra_body": NO_EOS}

    def run(kind: str):
        if kind == "schema":
            return client.chat.completions.create(model=MODEL, messages=MSGS, seed=5,
                                                  max_tokens=100, response_format=FORMAT)
        if kind == "object":
            return client.chat.completions.create(model=MODEL, messages=MSGS, seed=6,
                                                  max_tokens=100,
                                                  response_format={"type": "json_object"})
        return client.completions.create(**free)

    alone = run("free").choices[0].logprobs.tokens
    with ThreadPoolExecutor(3) as pool:
        schema, obj, both = pool.map(run, ["schema", "object", "free"])
    jsonschema.validate(json.loads(schema.choices[0].message.content), PERSON)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert both.choices[0].logprobs.tokens == alone and len(alone) == 8


def test_an_unsupported_schema_feature_is_a_400_naming_it(served, client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, response_format=bad)
    assert e.value.body["param"] == "response_format"
    assert e.value.body["message"] == ("response_format's schema uses a feature this server "
                                       'cannot enforce: Unimplemented keys: ["not"]')


def test_usage_cache_fields_exact(served, client):
    """Every request of this module is served cold (one page is the whole context): no hit,
    every prompt token a miss, the tier `cold`; the decoder's bounded replay covers the
    prompt's last `window_size` tokens (CED), none in exact mode."""
    ids = test_serve.prompt_ids(3)
    exact = served["batcher"].engine.options.exact
    replay = 0 if exact else min(served["args"].window_size, len(ids))
    want = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 0},
            "prompt_cache_hit_tokens": 0, "prompt_cache_miss_tokens": 12,
            "dsv41_prompt_cache": {"tier": "cold", "runtime_cache_tokens": 0,
                                   "dram_pool_tokens": 0, "ssd_store_tokens": 0,
                                   "replayed_tokens": 0, "decoder_replayed_tokens": replay}}
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, **NO_EOS}
    r = httpx.post(served["url"] + "/v1/completions", json=body, timeout=60)
    assert r.json()["usage"] == want
    lines = httpx.post(served["url"] + "/v1/completions", timeout=60, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text.split("\n\n")
    assert json.loads(lines[-3].removeprefix("data: "))["usage"] == want
    chat = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2,
                                          temperature=0, extra_body=NO_EOS)
    extra = chat.usage.model_extra
    assert (extra["prompt_cache_hit_tokens"], extra["prompt_cache_miss_tokens"]) == (
        0, chat.usage.prompt_tokens)


@pytest.mark.parametrize("tier, field", [
    ("live", "runtime_cache_tokens"), ("handoff", "runtime_cache_tokens"),
    ("snapshot", "dram_pool_tokens"), ("snapshot-ssd", "ssd_store_tokens"),
    ("prefix", "ssd_store_tokens")])
def test_usage_counts_a_hit_at_its_tier(tier, field):
    body = Usage(100, 5, 64, PromptCache(tier, 16, 32)).body()
    assert (body["prompt_cache_hit_tokens"], body["prompt_cache_miss_tokens"]) == (64, 36)
    assert body["prompt_tokens_details"] == {"cached_tokens": 64}
    cache = body["dsv41_prompt_cache"]
    assert cache == {"tier": tier, "runtime_cache_tokens": 0, "dram_pool_tokens": 0,
                     "ssd_store_tokens": 0, "replayed_tokens": 16,
                     "decoder_replayed_tokens": 32, field: 64}


def test_detokenize_round_trips_tokenize(served):
    url = served["url"]
    tok = httpx.post(url + "/tokenize", json={"messages": MSGS}, timeout=60).json()
    for key in ("tokens", "ids"):
        r = httpx.post(url + "/detokenize", json={key: tok["tokens"]}, timeout=60)
        assert r.status_code == 200 and r.json() == {"prompt": tok["prompt"]}
    assert tok["prompt"].startswith("<｜begin▁of▁sentence｜><｜User｜>w3 as JSON")
    for body, status, message in [
        ({"tokens": [5, 512]}, 400, "tokens[1] must be a token id from 0 to 511, not 512."),
        ({"ids": [True]}, 400, "ids[0] must be a token id from 0 to 511, not True."),
        ({"tokens": [1], "ids": [1]}, 400,
         "/detokenize takes `tokens` (or `ids`): a list of token ids."),
        ({"tokens": "1"}, 400, "tokens must be a list of token ids."),
        ({"tokens": [1], "model": "other"}, 404,
         "The model 'other' does not exist; this server serves 'shared-small'."),
    ]:
        r = httpx.post(url + "/detokenize", json=body, timeout=60)
        assert (r.status_code, r.json()["error"]["message"]) == (status, message)


def test_version(served):
    r = httpx.get(served["url"] + "/version", timeout=60)
    assert r.json() == {"version": version("dsv41"), "model": MODEL,
                        "llguidance": version("llguidance")}


@pytest.mark.slow
def test_100_seeded_requests_over_20_schemas_validate(served, client):
    """The issue's check through the client: 100 sampled requests (temperature 1, seeded) over
    test_structured's 20 generated schemas, every reply parsed and validated."""
    from test_structured import schema_of

    for i in range(20):
        schema = schema_of(i, max_props=2)  # a reply fits shared-small's 128 positions
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                      "strict": True}}
        for seed in range(5):
            r = client.chat.completions.create(model=MODEL, messages=MSGS, seed=100 * i + seed,
                                               response_format=fmt)
            assert r.choices[0].finish_reason == "stop", (i, seed, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
