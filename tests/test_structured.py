"""Structured outputs (runtime/serving/structured.py) at the token level, on the small preset's
byte-level BPE: 100 seeded requests sampled at temperature 1 from random logits through the
engine's own `Sampler`, over 20 generated schemas (nested objects, arrays, enums, numbers with
ranges, required fields), every reply parses and validates with `jsonschema` (only the grammar
can make that true); json_object gives an object; EOS is masked until the JSON is whole and is
then the only token; a speculative step's rollback; thinking mode; and every bad
`response_format` a 400 with its exact sentence."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from dsv41.graph.config import load_config
from dsv41.runtime.engine.sampling import ConstraintError, Sampler, SamplingParams
from dsv41.runtime.serving.openai_api import ApiError, parse_chat, parse_completion
from dsv41.runtime.serving.structured import GrammarVocab, ResponseFormat
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_choice import TokenTexts

MAX_STEPS = 400  # a reply longer than this is a failure of the schemas' bounds


@pytest.fixture(scope="module")
def tok(small_case) -> Tokenizer:
    return Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)


@pytest.fixture(scope="module")
def vocab(tok) -> GrammarVocab:
    return GrammarVocab.of(tok)


def schema_of(seed: int, max_props: int = 4) -> dict:
    """A random schema whose every instance is short (strings, arrays and digits bounded: a
    model, random weights included, may repeat a digit for ever where the schema allows it);
    `max_props`: the most properties an object has."""
    rng = random.Random(seed)

    def value(depth: int) -> dict:
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"]
                          if depth < 2 else ["string", "integer", "number", "boolean", "enum"])
        if kind == "string":
            return {"type": "string", "minLength": rng.randint(0, 2),
                    "maxLength": rng.randint(3, 8)}
        if kind == "integer":
            lo = rng.randint(-100, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        if kind == "number":
            lo = rng.randint(-10, 10)
            return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20),
                    "multipleOf": rng.choice([0.5, 0.25, 0.125])}  # digits bounded, exact
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(["red", "green", "blue", 3, None, True], rng.randint(1, 4))}
        if kind == "array":
            return {"type": "array", "items": value(depth + 1), "minItems": rng.randint(0, 1),
                    "maxItems": rng.randint(1, 3)}
        return obj(depth + 1)

    def obj(depth: int) -> dict:
        names = rng.sample(["id", "name", "city", "tags", "score", "ok", "kind", "meta"],
                           rng.randint(1, max_props))
        props = {k: value(depth) for k in names}
        return {"type": "object", "properties": props,
                "required": rng.sample(names, rng.randint(1, len(names))),
                "additionalProperties": False}

    return obj(0)


def sample(constraint, seed: int, prefix: tuple[int, ...] = ()) -> list[int]:
    """A temperature-1 reply from random logits (up to EOS), through the Sampler."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=constraint))
    gen = torch.Generator().manual_seed(seed)
    out = list(prefix)
    for _ in range(MAX_STEPS):
        t = sampler.sample(torch.randn(constraint.vocab_size, generator=gen) * 3,
                           generated=out).token_id
        if t == constraint.vocab.eos:
            return out
        out.append(t)
    raise AssertionError(f"no EOS within {MAX_STEPS} tokens: {out}")


def json_schema(schema, name: str = "answer", strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": strict}}


def test_100_sampled_replies_over_20_schemas_all_validate(tok, vocab):
    for i in range(20):
        schema = schema_of(i)
        fmt = ResponseFormat.parse(json_schema(schema))
        for seed in range(5):
            text = tok.decode(sample(fmt.constraint(vocab), 100 * i + seed))
            jsonschema.validate(json.loads(text), schema)  # raises on a bad reply


def test_json_object_is_any_object(tok, vocab):
    fmt = ResponseFormat.parse({"type": "json_object"})
    for seed in range(5):
        text = tok.decode(sample(fmt.constraint(vocab), seed))
        assert isinstance(json.loads(text), dict)


def test_eos_only_when_the_json_is_whole(tok, vocab):
    schema = {"type": "object", "properties": {"a": {"enum": [1]}}, "required": ["a"],
              "additionalProperties": False}
    c = ResponseFormat.parse(json_schema(schema)).constraint(vocab)
    s = c.start()
    ids = tok.encode('{"a": 1}')
    for t in ids:
        assert not c.allowed(s)[vocab.eos]
        assert c.allowed(s)[t]
        s = c.advance(s, t)
        assert s is not None
    assert c.allowed(s).nonzero().flatten().tolist() == [vocab.eos]  # only EOS once whole
    assert c.advance(c.start(), tok.encode("[")[0]) is None  # not an object: refused
    # a speculative step's rollback: states are values, the matcher follows the one asked for
    first = c.advance(c.start(), ids[0])
    assert c.advance(first, ids[1]) is not None
    assert c.allowed(c.start()).nonzero().flatten().tolist() == [tok.encode("{")[0]]
    assert c.allowed(first)[ids[1]] and not c.allowed(first)[vocab.eos]


def test_a_sampler_refuses_a_token_the_grammar_does_not_allow(tok, vocab):
    c = ResponseFormat.parse({"type": "json_object"}).constraint(vocab)
    sampler = Sampler(SamplingParams(temperature=0.0, constraint=c))
    with pytest.raises(ConstraintError, match="not allowed by the request's constraint"):
        sampler.sample(torch.zeros(512), generated=tok.encode("x"))


def test_thinking_mode_reasons_first_then_json(tok, vocab):
    texts = TokenTexts.of(tok)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    c = ResponseFormat.parse(json_schema(schema)).constraint(vocab, thinking=True,
                                                             texts=lambda: texts)
    think = tok.token_to_id("</think>")
    s = c.start()
    assert not c.allowed(s)[vocab.eos] and c.allowed(s)[think]
    for t in tok.encode_text("any </think"):  # free reasoning; never spelled in pieces
        s = c.advance(s, t)
    gt = tok.encode_text(">")[0]
    assert not c.allowed(s)[gt] and c.advance(s, gt) is None
    reply = sample(c, 7, prefix=(*tok.encode_text("hmm"), think))
    jsonschema.validate(json.loads(tok.decode(reply[reply.index(think) + 1:])), schema)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "xml"}, 'response_format.type must be "text", "json_object" or "json_schema", '
                      "not 'xml'."),
    ("json", 'response_format must be an object with a `type` of "text", "json_object" or '
             '"json_schema".'),
    ({"type": "json_schema"}, "response_format.json_schema must be an object with `name` and "
                              "`schema`."),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
     "response_format.json_schema.name must be 1 to 64 letters, digits, underscores or dashes, "
     "not 'a b'."),
    (json_schema({"type": "object"}, strict="yes"),
     "response_format.json_schema.strict must be true or false, not 'yes'."),
    (json_schema({"type": "objekt"}), "response_format.json_schema.schema is not a valid JSON "
                                      "Schema: 'objekt' is not valid under any of the given "
                                      "schemas"),
    (json_schema({"type": "object", "not": {"required": ["a"]}}),
     "response_format's schema uses a feature this server cannot enforce: Unimplemented keys: "
     '["not"]'),
    (json_schema({"type": "string", "pattern": "(?=a)b"}),
     "response_format's schema uses a feature this server cannot enforce: regex parse error: "
     "(?=a)b ^^^ error: look-around, including look-ahead and look-behind, is not supported"),
    (json_schema({"$ref": "#/$defs/missing"}),
     "response_format's schema uses a feature this server cannot enforce: Pointer "
     "'/$defs/missing' does not exist"),
])
def test_bad_response_formats_are_400s(tok, vocab, fmt, message):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": fmt}
    for parse, b in ((parse_chat, body), (parse_completion, {**body, "prompt": "hi"})):
        with pytest.raises(ApiError) as e:
            parse(b, tok, model_name="m", vocab_size=512, grammar=lambda: vocab)
        assert (e.value.status, e.value.message, e.value.param) == (400, message,
                                                                    "response_format")


def test_response_format_with_other_fields(tok, vocab):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}
    req = parse_chat(body, tok, model_name="m", vocab_size=512, grammar=lambda: vocab)
    assert req.params.constraint is not None and req.params.constraint.vocab_size == 512
    text = parse_chat({**body, "response_format": {"type": "text"}}, tok, model_name="m",
                      vocab_size=512, grammar=lambda: vocab)
    assert text.params.constraint is None
    with pytest.raises(ApiError) as e:
        parse_chat({**body, "ignore_eos": True}, tok, model_name="m", vocab_size=512,
                   grammar=lambda: vocab)
    assert (e.value.param, e.value.message) == (
        "ignore_eos", "ignore_eos cannot be combined with a JSON response_format: the reply "
                      "ends with EOS once its JSON is whole.")
