"""Tool-call arguments that follow their schemas (runtime/serving/tool_grammar.py through
tool_choice.py's `ToolChoice.constraint`), on the small preset's byte-level BPE: 40 seeded
requests sampled at temperature 1 from random logits through the engine's own `Sampler`, over 10
generated tool schemas (nested objects, arrays, enums, numbers with ranges, required fields),
with tool_choice `required` and a named function: every call parses and its arguments validate
with `jsonschema` (only the grammar can make that true); thinking mode; `auto` with a strict tool
(free text, or a block whose calls validate once it opens); a batch of requests with different
grammars in the batcher on shared-small's random weights, the free one token for token its solo
run; after-the-fact validation of non-strict `auto` calls; unsupported features as 400s naming
them, through `parse_chat` and the official `openai` client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from test_structured import schema_of

from dsv41.graph.config import load_config
from dsv41.runtime.engine.sampling import Sampler, SamplingParams
from dsv41.runtime.serving.openai_api import ApiError, parse_chat
from dsv41.runtime.serving.release_format import OPEN_CALLS, ToolCall
from dsv41.runtime.serving.structured import GrammarVocab
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import parse_tool_calls
from dsv41.runtime.serving.tool_choice import TokenTexts, ToolChoice, tool_specs

MAX_STEPS = 1500  # a reply longer than this is a failure of the schemas' bounds


@pytest.fixture(scope="module")
def tok(small_case) -> Tokenizer:
    return Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)


@pytest.fixture(scope="module")
def vocab(tok) -> GrammarVocab:
    return GrammarVocab.of(tok)


@pytest.fixture(scope="module")
def texts(tok) -> TokenTexts:
    return TokenTexts.of(tok)


def tool(name: str, schema: dict, strict: bool = False) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema, "strict": strict}}


def sample(constraint, eos: int, seed: int, prefix: tuple[int, ...] = ()) -> list[int]:
    """A temperature-1 reply from random logits (up to EOS), through the Sampler."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=constraint))
    gen = torch.Generator().manual_seed(seed)
    out = list(prefix)
    for _ in range(MAX_STEPS):
        t = sampler.sample(
            torch.randn(constraint.vocab_size, generator=gen) * 3, generated=out
        ).token_id
        if t == eos:
            return out
        out.append(t)
    raise AssertionError(f"no EOS within {MAX_STEPS} tokens")


def check_calls(text: str, schemas: dict[str, dict]) -> int:
    """The reply is only calls, each of a given tool with valid arguments; their count."""
    reply = parse_tool_calls(text)
    assert reply.calls and reply.content == "", text
    for call in reply.calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    return len(reply.calls)


def test_40_sampled_calls_over_10_schemas_validate(tok, vocab, texts):
    """tool_choice required (two tools, parallel calls) and named (one call): every call of
    every reply parses and validates."""
    n_calls = 0
    for i in range(10):
        schemas = {f"f{i}": schema_of(i, max_props=3), f"g{i}": schema_of(100 + i, max_props=3)}
        specs = tool_specs([tool(k, v) for k, v in schemas.items()])
        for seed, (choice, parallel) in enumerate(
            [
                ("required", True),
                ("required", False),
                ({"type": "function", "function": {"name": f"g{i}"}}, False),
                ({"type": "function", "function": {"name": f"f{i}"}}, True),
            ]
        ):
            c = ToolChoice.parse(choice, specs, parallel=parallel).constraint(
                texts, thinking=False, vocab=vocab
            )
            text = tok.decode(sample(c, vocab.eos, 100 * i + seed))
            n = check_calls(text, schemas)
            assert parallel or n == 1
            if isinstance(choice, dict):
                assert {c.name for c in parse_tool_calls(text).calls} == {
                    choice["function"]["name"]
                }
            n_calls += n
    assert n_calls >= 40


def test_the_block_is_exact(tok, vocab, texts):
    """The release's layout byte for byte: properties in schema order, a required one always,
    a plain string as is, an enum string as is, other values as JSON; wrong values refused."""
    schema = {
        "type": "object",
        "properties": {
            "q": {"type": "string", "maxLength": 4},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
            "e": {"enum": ["a<b", 3]},
            "o": {
                "type": "object",
                "properties": {"k": {"type": "array", "items": {"type": "boolean"}}},
                "required": ["k"],
            },
        },
        "required": ["n"],
    }
    c = ToolChoice.parse("required", tool_specs([tool("f", schema)]), parallel=False).constraint(
        texts, thinking=False, vocab=vocab
    )

    def p(k, flag, v):
        return f'<｜DSML｜ parameter name="{k}" string="{flag}">{v}</｜DSML｜ parameter>'

    def accepts(params: list[str]) -> bool:
        block = (
            f'{OPEN_CALLS}<｜DSML｜ invoke name="f">\n'
            + "\n".join(params)
            + "\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
        )
        s = c.start()
        for t in tok.encode(block):
            s = c.advance(s, t)
            if s is None:
                return False
        return bool(c.allowed(s)[vocab.eos])

    good = [
        p("q", "true", 'a "b'),
        p("n", "false", "3"),
        p("e", "true", "a<b"),
        p("o", "false", '{"k": [true, false]}'),
    ]
    assert accepts(good) and accepts(good[1:2]) and accepts([good[0], good[1], good[3]])
    assert (
        parse_tool_calls(
            f'{OPEN_CALLS}<｜DSML｜ invoke name="f">\n'
            + "\n".join(good)
            + "\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
        )
        .calls[0]
        .arguments
        == '{"q": "a \\"b", "n": 3, "e": "a<b", "o": {"k": [true, false]}}'
    )
    for bad in (
        [good[0], good[2]],  # the required n missing
        [good[1], good[0]],  # out of the schema's order
        [p("q", "true", "abcde"), good[1]],  # longer than maxLength
        [p("n", "false", "10")],  # above the maximum
        [good[1], p("e", "false", "4")],  # not in the enum
        [good[1], p("o", "false", '{"k": [1]}')],  # an item of the wrong type
        [good[1], p("o", "false", "{}")],  # a nested required field missing
        [p("q", "true", "x</｜DSML｜"), good[1]],
    ):  # would close the block early
        assert not accepts(bad), bad


def test_thinking_reasons_first(tok, vocab, texts):
    schema = schema_of(3, max_props=2)
    c = ToolChoice.parse("required", tool_specs([tool("f", schema)])).constraint(
        texts, thinking=True, vocab=vocab
    )
    think = tok.token_to_id("</think>")
    assert not c.allowed(c.start())[vocab.eos]
    reply = sample(c, vocab.eos, 5, prefix=(*tok.encode_text("hmm"), think))
    check_calls(tok.decode(reply[reply.index(think) + 1 :]), {"f": schema})


def test_strict_auto_is_free_until_the_block_opens(tok, vocab, texts):
    """`auto` with a strict tool: any text (EOS allowed from the start), and once the block
    opens its calls validate; a non-strict tool's call is loose there (its keys, any values)
    and checked afterwards by `check_call`."""
    strict = schema_of(7, max_props=2)
    loose = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    specs = tool_specs([tool("s", strict, strict=True), tool("l", loose)])
    choice = ToolChoice.parse("auto", specs)
    assert choice.strict_auto
    c = choice.constraint(texts, thinking=False, vocab=vocab)
    assert c.allowed(c.start())[vocab.eos]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1, constraint=c))
    gen, out = torch.Generator().manual_seed(1), list(tok.encode("Hello <"))
    for _ in range(40):  # free text
        logits = torch.randn(vocab.vocab_size, generator=gen) * 3
        logits[vocab.eos] = -1e9  # the text goes on (the mask still allows EOS)
        out.append(sampler.sample(logits, generated=out).token_id)  # every token allowed
    whole = list(tok.encode("Hello <b> </｜DSML｜ x> done."))
    assert c.allowed(sampler.constraint_state(whole))[vocab.eos]
    only = ToolChoice.parse("auto", tool_specs([tool("s", strict, strict=True)])).constraint(
        texts, thinking=False, vocab=vocab
    )  # (a loose free string may run on: not sampled)
    for seed in range(4):
        reply = tok.decode(
            sample(only, vocab.eos, seed, prefix=tuple(tok.encode(f"Checking.\n\n{OPEN_CALLS}")))
        )
        calls = parse_tool_calls(reply)
        assert calls.content == "Checking." and calls.calls, reply
        for call in calls.calls:
            if call.name == "s":
                jsonschema.validate(json.loads(call.arguments), strict)
                assert choice.check_call(call) is None
    assert (
        ToolChoice.parse("auto", tool_specs([tool("l", loose)])).constraint(
            texts, thinking=False, vocab=vocab
        )
        is None
    )  # no strict tool: free
    assert choice.check_call(ToolCall("l", '{"x": 2}')) is None
    assert (
        choice.check_call(ToolCall("l", '{"x": "2"}')) == "arguments.x: '2' is not of "
        "type 'integer'"
    )
    assert choice.check_call(ToolCall("l", "{}")) == "arguments: 'x' is a required property"
    assert choice.check_call(ToolCall("m", "{}")) == "'m' is not one of the request's tools."


@pytest.mark.slow  # shared-small's eager engine: about 6 minutes on 2 cores
def test_a_batch_of_different_grammars(small_model, tok, vocab, texts):
    """In the batcher on shared-small's random weights: two requests with different tool
    grammars and one free request at once; each constrained reply is one valid call, the free
    one the same tokens as alone."""
    from dsv41.runtime.engine import Engine
    from dsv41.runtime.serving.batcher import Batcher

    schemas = {
        "a": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
        },
        "b": {"type": "object", "properties": {"e": {"enum": ["x", 2]}}, "required": ["e"]},
    }

    def params(name: str | None, seed: int) -> SamplingParams:
        if name is None:
            return SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        c = ToolChoice.parse(
            {"type": "function", "function": {"name": name}},
            tool_specs([tool(name, schemas[name])]),
            parallel=False,
        ).constraint(texts, thinking=False, vocab=vocab)
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, constraint=c)

    def run(names):
        engine = Engine.from_model(
            small_model, weights_hash="w" * 64, page_tokens=8, prefill_chunk_tokens=8
        )
        b = Batcher(engine, max_running=4)
        streams = [b.submit([5 + i, 6, 7], params(n, 10 + i)) for i, n in enumerate(names)]
        while b.step():
            pass
        return [[e.token_id for e in s if e.token_id is not None] for s in streams]

    a, bb, free = run(["a", "b", None])
    for ids, name in ((a, "a"), (bb, "b")):
        assert ids[-1] == vocab.eos
        assert check_calls(tok.decode(ids[:-1]), schemas) == 1
        assert parse_tool_calls(tok.decode(ids[:-1])).calls[0].name == name
    assert free == run([None, None, None])[2] and len(free) == 8


NOT = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (
            [tool("f", {"type": "object"}), tool("g", NOT)],
            "required",
            "tools[1].function.parameters uses a feature this server cannot enforce: Unimplemented "
            'keys: ["not"]',
        ),
        (
            [tool("g", NOT, strict=True)],
            "auto",
            "tools[0].function.parameters uses a feature this server cannot enforce: Unimplemented "
            'keys: ["not"]',
        ),
        (
            [
                tool(
                    "f",
                    {
                        "type": "object",
                        "properties": {"p": {"type": "string", "pattern": "(?=a)b"}},
                    },
                )
            ],
            "required",
            "tools[0].function.parameters uses a feature this server cannot enforce: regex parse "
            "error: (?=a)b ^^^ error: look-around, including look-ahead and look-behind, is not "
            "supported",
        ),
        (
            [tool("f", {"type": "object", "properties": {"p": {"const": "</｜DSML｜ x"}}})],
            "required",
            "tools[0].function.parameters.properties.p has the value '</｜DSML｜ x', "
            "which spells </｜DSML｜; a DSML value cannot.",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            "auto",
            "tools[0].function.strict must be true or false, not 'yes'.",
        ),
    ],
)
def test_unsupported_schema_features_are_400s(tok, vocab, tools, choice, message):
    body = {"model": "m", "messages": MSGS, "tools": tools, "tool_choice": choice}
    with pytest.raises(ApiError) as e:
        parse_chat(body, tok, model_name="m", vocab_size=512, grammar=lambda: vocab)
    assert (e.value.status, e.value.message, e.value.param) == (400, message, "tools")
    # the same tools without `not` under auto and no strict: nothing to enforce, no 400
    parse_chat(
        {**body, "tools": [tool("g", NOT)], "tool_choice": "auto"},
        tok,
        model_name="m",
        vocab_size=512,
        grammar=lambda: vocab,
    )


def test_openai_client_gets_the_400(small_model, small_case, tok):
    """Through the official client against the app (an eager engine on shared-small)."""
    from dsv41.runtime.engine import Engine
    from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
    from dsv41.runtime.serving.batcher import Batcher

    args = load_config(small_case.checkpoint)
    engine = Engine.from_model(
        small_model, weights_hash="w" * 64, page_tokens=8, prefill_chunk_tokens=8
    )
    batcher = Batcher(engine, tokenizer=tok, max_running=2, max_queue=2)
    opts = ServerOptions(
        model_name="small", vocab_size=args.vocab_size, max_seq_len=args.max_seq_len
    )
    with ServerThread(create_app(batcher, tok, opts)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="small", messages=MSGS, tools=[tool("g", NOT)], tool_choice="required"
            )
    assert e.value.body["param"] == "tools"
    assert e.value.body["message"] == (
        "tools[0].function.parameters uses a feature this "
        'server cannot enforce: Unimplemented keys: ["not"]'
    )
