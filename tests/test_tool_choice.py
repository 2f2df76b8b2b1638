"""tool_choice's logits constraints (runtime/serving/tool_choice.py) at the token level: 50 seeded
requests sampled at temperature 1 from random logits through the engine's own `Sampler` always
give a well-formed call of an allowed tool (`required`, a named function, one call or several),
`none` never spells the block; the DSML automaton on exact strings; tool schemas checked; one
request's dead-end constraint fails it alone in the batcher.

The vocabulary is a made-up one (`TokenTexts` built by hand: every character the format needs,
multi-character pieces that cut across the tags, EOS, a banned special token), since the small
preset's stub tokenizer cannot spell the DSML block; the constraint reads only token texts."""

from __future__ import annotations

import json
import string

import pytest
import torch

from dsv41.runtime.engine.sampling import ConstraintError, Sampler, SamplingParams
from dsv41.runtime.serving.release_format import DSML
from dsv41.runtime.serving.tool_calls import parse_tool_calls
from dsv41.runtime.serving.tool_choice import (
    AvoidText,
    ChoiceKind,
    DsmlConstraint,
    TokenTexts,
    ToolChoice,
    tool_specs,
)

EOS, BOS = 1, 0
PIECES = [f"<{DSML}", f"</{DSML}", DSML, " calls>", " invoke", " parameter", ' name="', '">',
          '" string="', "true", "false", "\n<", "\n</", "get_weather", "get_", "weather", "city",
          "days", "paris", "tokyo", "unit", "lookup", "query", "tags", ", ", ": ", "null",
          "Hello", " world", "｜", "12", "-3.5e2"]


def _texts() -> TokenTexts:
    chars = sorted(set(string.ascii_letters + string.digits + string.punctuation + " \n"
                       + "｜é"))
    texts = ["<BOS>", "<EOS>"] + chars + PIECES
    return TokenTexts(tuple(texts), EOS, frozenset({BOS}))


TEXTS = _texts()

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["paris", "tokyo"]},
                       "days": {"type": "integer"},
                       "unit": {"enum": ["c", "f", 3, None]},
                       "metric": {"type": "boolean"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"exact": {"type": "null"},
                                         "score": {"type": "number"}}}}},
]


def _sample(constraint, seed: int, max_tokens: int = 4000) -> tuple[str, list[int]]:
    """One request: random logits each step (the seed's), the engine's Sampler at
    temperature 1, until EOS."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, constraint=constraint))
    g = torch.Generator().manual_seed(10_000 + seed)
    out: list[int] = []
    while len(out) < max_tokens:
        logits = torch.randn(TEXTS.vocab_size, generator=g) * 3
        tok = sampler.sample(logits, generated=out).token_id
        out.append(tok)
        if tok == EOS:
            break
    return "".join(TEXTS.texts[t] for t in out if t != EOS), out


@pytest.mark.parametrize("choice,parallel,names", [
    ("required", False, {"get_weather", "lookup"}),
    ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}),
    ("required", True, {"get_weather", "lookup"}),
])
def test_required_and_named_always_call(choice, parallel, names):
    specs = tool_specs(TOOLS)
    c = ToolChoice.parse(choice, specs, parallel=parallel).constraint(TEXTS, thinking=False)
    counts = {"calls": 0, "replies": 0}
    for seed in range(50):
        text, ids = _sample(c, seed)
        assert ids[-1] == EOS, f"seed {seed} did not finish: {text!r}"
        reply = parse_tool_calls(text)
        assert reply.calls and reply.content == "", f"seed {seed}: {text!r}"
        if not parallel:
            assert len(reply.calls) == 1
        for call in reply.calls:
            assert call.name in names
            args = json.loads(call.arguments)
            if call.name == "get_weather":
                assert args["city"] in ("paris", "tokyo") and isinstance(args["days"], int)
                assert set(args) <= {"city", "days", "unit", "metric"}
                assert args.get("unit", "c") in ("c", "f", 3, None)
            else:
                assert set(args) <= {"exact", "score"}
        counts["replies"] += 1
        counts["calls"] += len(reply.calls)
    assert counts["replies"] == 50 and counts["calls"] >= 50


def test_none_never_spells_the_block():
    c = ToolChoice.parse("none", tool_specs(TOOLS)).constraint(TEXTS, thinking=False)
    assert isinstance(c, AvoidText)
    for seed in range(50):
        text, _ = _sample(c, seed, max_tokens=200)
        assert f"<{DSML} calls>" not in text
        assert not parse_tool_calls(text).calls
    # the block's opening is one step from done: only the piece that would finish it is masked
    state = c.walk(c.start(), f"<{DSML} calls")
    mask = c.allowed(state)
    assert not mask[TEXTS.texts.index(">")] and mask[TEXTS.texts.index("a")]


def test_dsml_automaton_on_exact_strings():
    specs = tool_specs(TOOLS)
    c = DsmlConstraint(TEXTS, specs, parallel=True)
    ok = (f'<{DSML} calls>\n<{DSML} invoke name="lookup">\n'
          f'<{DSML} parameter name="score" string="false">-3.5e2</{DSML} parameter>'
          f"\n</{DSML} invoke>\n"
          f'<{DSML} invoke name="get_weather">\n'
          f'<{DSML} parameter name="days" string="false">12</{DSML} parameter>\n'
          f'<{DSML} parameter name="city" string="true">tokyo</{DSML} parameter>'
          f"\n</{DSML} invoke>\n</{DSML} calls>")
    end = c.walk(c.start(), ok)
    assert c.final(end)
    assert [x.name for x in parse_tool_calls(ok).calls] == ["lookup", "get_weather"]
    bad = [
        ok.replace('name="lookup"', 'name="lookups"'),  # not a tool
        ok.replace(">12<", ">1.5<"),  # days is an integer
        ok.replace(">tokyo<", ">rome<"),  # not in the enum
        ok.replace(f'<{DSML} parameter name="days" string="false">12</{DSML} parameter>\n',
                   ""),  # a required parameter missing
        ok.replace("-3.5e2", "-3.5e"),  # not a number
    ]
    for b in bad:
        assert c.walk(c.start(), b) is None or not c.final(c.walk(c.start(), b)), b
    one = DsmlConstraint(TEXTS, specs[1:], parallel=False)
    assert one.walk(one.start(), ok) is None  # one call only, and only `lookup`


def test_free_strings_and_json_values():
    tools = tool_specs([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "tags": {"type": "array"},
                                         "any": {}}}}}])
    c = DsmlConstraint(TEXTS, tools, parallel=False)
    head = f'<{DSML} calls>\n<{DSML} invoke name="f">\n'

    def param(key, flag, value):
        return f'<{DSML} parameter name="{key}" string="{flag}">{value}</{DSML} parameter>'

    tail = f"\n</{DSML} invoke>\n</{DSML} calls>"
    good = [param("q", "true", "a <b> </c> é"),
            param("tags", "false", '[1, "x", {"k": [true, null]}, {}, []]'),
            param("any", "true", "text"), param("any", "false", '{"a": "\\u00e9\\n"}')]
    for g in good:
        assert c.final(c.walk(c.start(), head + g + tail)), g
        assert parse_tool_calls(head + g + tail).calls
    for b in [param("q", "true", f"x</{DSML} invoke>"),  # would cut the block short
              param("tags", "false", "[1,2]"),  # not json.dumps's layout
              param("tags", "false", '["｜"]'),  # a raw DSML bar inside JSON
              param("q", "false", '"x"')]:  # a string parameter is string="true"
        w = c.walk(c.start(), head + b + tail)
        assert w is None or not c.final(w), b


def test_thinking_reasons_first():
    c = DsmlConstraint(TEXTS, tool_specs(TOOLS[1:]), parallel=False, thinking=True)
    text = (f"hmm <think> </thin x</think><{DSML} calls>\n<{DSML} invoke name=\"lookup\">\n"
            f"\n</{DSML} invoke>\n</{DSML} calls>")
    assert c.final(c.walk(c.start(), text))


@pytest.mark.parametrize("tools,match", [
    ("nope", "must be a list"),
    ([{"type": "function"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"parameters": {}}}], "name must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
     "not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}], "not one of its properties"),
    ([{"type": "function", "function": {"name": 'a"b'}}], "without quotes"),
])
def test_bad_tools(tools, match):
    with pytest.raises(ValueError, match=match):
        tool_specs(tools)


def test_tool_choice_values():
    specs = tool_specs(TOOLS)
    assert ToolChoice.parse(None, specs).kind is ChoiceKind.AUTO
    assert ToolChoice.parse(None, ()).kind is ChoiceKind.NONE
    assert ToolChoice.parse("auto", specs).constraint(TEXTS, thinking=False) is None
    for bad, match in [("always", "tool_choice must be"), ({"type": "function"}, "must be"),
                       ({"type": "function", "function": {"name": "nope"}}, "not one of")]:
        with pytest.raises(ValueError, match=match):
            ToolChoice.parse(bad, specs)
    with pytest.raises(ValueError, match="needs tools"):
        ToolChoice.parse("required", ())


def test_a_dead_end_is_a_constraint_error_and_rolls_back():
    """A vocabulary that cannot spell the block: ConstraintError (the turn fails alone); a
    sampler's states follow the output it is given (speculative tokens forgotten)."""
    poor = TokenTexts(("<BOS>", "<EOS>", "a", "b"), EOS, frozenset({BOS}))
    c = DsmlConstraint(poor, tool_specs(TOOLS), parallel=False)
    s = Sampler(SamplingParams(temperature=1.0, seed=0, constraint=c))
    with pytest.raises(ConstraintError):
        s.sample(torch.zeros(4))
    c = DsmlConstraint(TEXTS, tool_specs(TOOLS), parallel=False)
    s = Sampler(SamplingParams(temperature=0.0, constraint=c))
    lt = TEXTS.texts.index("<")
    assert s.sample(torch.zeros(TEXTS.vocab_size), generated=[]).token_id in (
        lt, TEXTS.texts.index(f"<{DSML}"))
    ids = [TEXTS.texts.index(f"<{DSML}"), TEXTS.texts.index(" calls>")]
    s.constraint_state(ids)
    assert s.constraint_state(ids[:1]) == c.walk(c.start(), f"<{DSML}")
    with pytest.raises(ConstraintError):
        s.constraint_state([TEXTS.texts.index("a")])


class _DeadEnd:
    """A constraint that allows token 7, then nothing."""

    vocab_size = 512

    def start(self):
        return 0

    def allowed(self, state):
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[7] = state == 0
        return mask

    def advance(self, state, token):
        return 1 if state == 0 and token == 7 else None


def test_a_dead_end_fails_its_request_alone(small_model):
    """In the batcher on shared-small's graph: the constrained request runs into a dead end
    and finishes `error`; its neighbour's seeded tokens are those it gets alone."""
    from dsv41.runtime.engine import Engine
    from dsv41.runtime.serving.batcher import Batcher, FinishReason

    def run(with_dead_end: bool):
        engine = Engine.from_model(small_model, weights_hash="w" * 64, page_tokens=8,
                                   prefill_chunk_tokens=8)
        b = Batcher(engine, max_running=4)
        dead = b.submit([5, 6, 7], SamplingParams(temperature=1.0, seed=1, max_tokens=6,
                                                  ignore_eos=True, constraint=_DeadEnd())) \
            if with_dead_end else None
        ok = b.submit([9, 10, 11, 12], SamplingParams(temperature=1.0, seed=2, max_tokens=6,
                                                      ignore_eos=True))
        while b.step():
            pass
        return (list(dead) if dead else None), list(ok)

    dead, ok = run(True)
    assert [e.token_id for e in dead[:-1]] == [7]
    assert dead[-1].finish is FinishReason.ERROR and "allows no token" in dead[-1].error
    assert ok[-1].finish is FinishReason.LENGTH
    assert [e.token_id for e in ok] == [e.token_id for e in run(False)[1]]
