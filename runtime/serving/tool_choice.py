"""`tool_choice` and `parallel_tool_calls`: the request's tools checked, and the logits constraints
that make a reply call them (or never call them).

    tools = tool_specs(body["tools"])                    # ValueError naming the bad tool
    choice = ToolChoice.parse(body.get("tool_choice"), tools, parallel=True)
    texts = TokenTexts.of(tok)                           # once per tokenizer
    params = replace(params, constraint=choice.constraint(texts, thinking=False))

`none`: the reply never starts a DSML block (`AvoidText` masks every token that would complete
`<｜DSML｜ calls>`), and nothing is read as a call. `auto`: no constraint. `required` and a named
function: `DsmlConstraint` masks the logits token by token so the reply is one DSML block (several
invokes when `parallel_tool_calls`), then EOS, in the release's own layout (tool_calls.py parses
it; release_format.py renders it):

    <｜DSML｜ calls>\\n<｜DSML｜ invoke name="NAME">\\n
    <｜DSML｜ parameter name="KEY" string="true|false">VALUE</｜DSML｜ parameter>  (\\n between)
    \\n</｜DSML｜ invoke>\\n</｜DSML｜ calls>

NAME is an allowed tool; KEY one of its schema's `properties`, each at most once, the `required`
ones all before the invoke closes. VALUE by the property's schema: `enum` one of its values;
`string` free text (string="true"; it may not spell `</｜DSML｜` except in its closing tag);
`boolean`, `null`, `integer`, `number` their JSON; anything else (objects, arrays, unions, no
type) any JSON value in `json.dumps`'s layout (", " and ": ", no other whitespace; no raw `｜` in a
JSON string, `\\uff5c` spells it). In thinking mode the block comes after the reasoning's
`</think>` (the reasoning is free).

The grammar is a character automaton over immutable states (`DsmlGrammar.step`); a token is
allowed when every character of its text (`Tokenizer.decode([id])`) steps. Masks are memoised per
state. The constraint keeps the calls well formed while they are generated; it does not bound
their length (a free string ends when the model closes it), so a reply cut by max_tokens is text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.exceptions import best_match

from dsv41.runtime.serving.release_format import (
    CLOSE_CALLS,
    CLOSE_INVOKE,
    CLOSE_PARAM,
    DSML,
    OPEN_CALLS,
    OPEN_INVOKE,
    OPEN_PARAM,
    THINK_CLOSE,
    ToolCall,
)
from dsv41.runtime.serving.structured import GrammarConstraint, GrammarVocab
from dsv41.runtime.serving.token_texts import AvoidText, CharConstraint, TokenTexts
from dsv41.runtime.serving.tool_grammar import (
    FORBIDDEN,
    BlockMode,
    block_grammar,
    check_grammar,
)

__all__ = ["AvoidText", "ChoiceKind", "DsmlConstraint", "TokenTexts", "ToolChoice", "ToolSpec",
           "tool_specs"]  # AvoidText, TokenTexts: token_texts.py's, kept importable from here


# ---- the tools ----------------------------------------------------------------------------------


class ValueKind(Enum):
    STRING = "string"  # free text, string="true"
    JSON = "json"  # any JSON value, string="false"
    INTEGER = "integer"
    NUMBER = "number"
    BOOLEAN = "boolean"
    NULL = "null"
    ENUM = "enum"


@dataclass(frozen=True)
class ParamSpec:
    name: str
    kinds: tuple[ValueKind, ...]  # the value forms allowed (two for a schema without a type)
    enum: tuple = ()  # ENUM: the allowed values


@dataclass(frozen=True)
class ToolSpec:
    name: str
    params: tuple[ParamSpec, ...]  # in the schema's order
    required: frozenset[str]
    schema: str = '{"type": "object", "properties": {}}'  # `parameters` as JSON text
    strict: bool = False  # `function.strict`: under `auto` its calls are grammar-constrained
    index: int = 0  # its place in the request's `tools`

    @property
    def parameters(self) -> dict:
        return json.loads(self.schema)


_TYPES = {"string": ValueKind.STRING, "integer": ValueKind.INTEGER, "number": ValueKind.NUMBER,
          "boolean": ValueKind.BOOLEAN, "null": ValueKind.NULL}


def _param(name: str, schema, where: str) -> ParamSpec:
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}.properties.{name} must be a JSON Schema object.")
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}.properties.{name}.enum must be a non-empty list.")
        if any(isinstance(v, str) and FORBIDDEN in v for v in values):
            raise ValueError(f"{where}.properties.{name}.enum holds a string with "
                             f"{FORBIDDEN}; a DSML value cannot spell it.")
        return ParamSpec(name, (ValueKind.ENUM,), tuple(values))
    t = schema.get("type")
    if isinstance(t, str) and t in _TYPES:
        return ParamSpec(name, (_TYPES[t],))
    if t is None:
        return ParamSpec(name, (ValueKind.STRING, ValueKind.JSON))
    return ParamSpec(name, (ValueKind.JSON,))  # object, array, a list of types


def _check_name(name, what: str) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in '"<>\n') or \
            DSML in name:
        raise ValueError(f"{what} must be a non-empty string without quotes, angle brackets, "
                         f"newlines or {DSML}, not {name!r:.60}.")
    return name


def tool_specs(tools) -> tuple[ToolSpec, ...]:
    """Each tool of a request checked: `{"type": "function", "function": {"name", "parameters"}}`
    with `parameters` a valid JSON Schema (Draft 2020-12) of an object. ValueError names the
    first bad one and why."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of tools.")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or \
                not isinstance(t.get("function"), Mapping):
            raise ValueError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}.")
        fn = t["function"]
        name = _check_name(fn.get("name"), f"{where}.function.name")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        where = f"{where}.function.parameters"
        if not isinstance(schema, Mapping):
            raise ValueError(f"{where} must be a JSON Schema object.")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            raise ValueError(f"{where} is not a valid JSON Schema: {e.message}") from None
        if schema.get("type", "object") != "object":
            raise ValueError(f"{where} must describe an object (type \"object\"), not "
                             f"{schema.get('type')!r}.")
        props = schema.get("properties", {})
        params = tuple(_param(_check_name(k, f"{where}.properties key"), v, where)
                       for k, v in props.items())
        required = frozenset(schema.get("required", ()))
        missing = sorted(required - set(props))
        if missing:
            raise ValueError(f"{where}.required names {missing[0]!r}, which is not one of its "
                             f"properties.")
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise ValueError(f"tools[{i}].function.strict must be true or false, not "
                             f"{strict!r:.60}.")
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
        except ValueError:
            raise ValueError(f"{where} holds a number JSON cannot spell (NaN or infinity).") \
                from None
        out.append(ToolSpec(name, params, required, text, strict, i))
    return tuple(out)


# ---- the DSML grammar ---------------------------------------------------------------------------

CLOSE_GUARD = len(f"</{DSML}")  # past this much of CLOSE_PARAM, a free string must finish it

_DIGITS = "0123456789"


def _number_step(n: str, ch: str, integer: bool) -> str | None:
    """JSON's number grammar: the state after `ch` (start, minus, zero, int, dot, frac, e,
    esign, exp), or None."""
    if n in ("start", "minus"):
        if ch == "-" and n == "start":
            return "minus"
        return "zero" if ch == "0" else "int" if ch in _DIGITS else None
    if n in ("zero", "int"):
        if ch in _DIGITS and n == "int":
            return "int"
        if integer:
            return None
        return "dot" if ch == "." else "e" if ch in "eE" else None
    if n in ("dot", "frac"):
        return "frac" if ch in _DIGITS else ("e" if ch in "eE" and n == "frac" else None)
    if n == "e":
        return "esign" if ch in "+-" else "exp" if ch in _DIGITS else None
    if n in ("esign", "exp"):
        return "exp" if ch in _DIGITS else None
    raise AssertionError(f"unknown number state {n}")


_NUMBER_ENDS = ("zero", "int", "frac", "exp")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class DsmlConstraint(CharConstraint):
    """tool_choice `required` or a named function: the reply is one DSML block of the allowed
    tools (see the module docstring). States are nested tuples:

    ("lits", ((literal, next), ...), i)   one of the literals, i characters matched so far
    ("str", k, next)                      a free string value; k of CLOSE_PARAM matched
    ("json", mode, data, stack, next)     a JSON value; `next` once it is whole
    ("num", n, integer, stack, next)      inside a JSON number
    ("think", k, next)                    the reasoning; k of `</think>` matched
    ("done",)                             the block is closed: EOS only
    labels ("invoke", n), ("params", tool, used, n, first) are expanded by `_enter`."""

    def __init__(self, texts: TokenTexts, tools: Sequence[ToolSpec], *, parallel: bool,
                 thinking: bool = False):
        if not tools:
            raise ValueError("A tool call is required but no tool is allowed.")
        super().__init__(texts)
        self.tools = {t.name: t for t in tools}
        self.parallel = parallel
        self.thinking = thinking

    # states ---------------------------------------------------------------------------------

    def start(self):
        block = self._lits(((OPEN_CALLS, ("invoke", 0)),))
        return ("think", 0, block) if self.thinking else block

    @staticmethod
    def _lits(alts) -> tuple:
        return ("lits", tuple(alts), 0)

    def _enter(self, state):
        """A label's first consuming state."""
        kind = state[0]
        if kind == "invoke":
            n = state[1]
            lead = "\n" if n else ""
            return self._lits((f'{lead}{OPEN_INVOKE}{name}">\n',
                               ("params", name, frozenset(), n, True)) for name in self.tools)
        if kind == "params":
            _, name, used, n, first = state
            tool, lead = self.tools[name], "" if first else "\n"
            alts = []
            for p in tool.params:
                if p.name in used:
                    continue
                after = ("params", name, used | {p.name}, n, False)
                head = f'{lead}{OPEN_PARAM}{p.name}" string='
                for kind_ in p.kinds:
                    if kind_ is ValueKind.ENUM:  # each value whole: a string as is
                        alts += [(f'{head}"true">{v}{CLOSE_PARAM}' if isinstance(v, str) else
                                  f'{head}"false">{_json(v)}{CLOSE_PARAM}', after)
                                 for v in p.enum]
                        continue
                    flag = "true" if kind_ is ValueKind.STRING else "false"
                    alts.append((f'{head}"{flag}">', ("value", kind_, after)))
            if tool.required <= used:
                alts.append((CLOSE_INVOKE, ("after_invoke", n + 1)))
            return self._lits(alts)
        if kind == "after_invoke":
            n = state[1]
            alts = [(CLOSE_CALLS, ("done",))]
            if self.parallel:
                alts += [(f'\n{OPEN_INVOKE}{name}">\n', ("params", name, frozenset(), n, True))
                         for name in self.tools]
            return self._lits(alts)
        if kind == "value":
            _, vk, after = state
            close = self._lits(((CLOSE_PARAM, after),))
            if vk is ValueKind.STRING:
                return ("str", 0, after)
            if vk is ValueKind.BOOLEAN:
                return self._lits((("true", close), ("false", close)))
            if vk is ValueKind.NULL:
                return self._lits((("null", close),))
            if vk in (ValueKind.INTEGER, ValueKind.NUMBER):
                return ("num", "start", vk is ValueKind.INTEGER, (), close)
            return ("json", "value", None, (), close)
        return state

    def final(self, state) -> bool:
        return state == ("done",)

    def step(self, state, ch: str):
        state = self._enter(state)
        kind = state[0]
        if kind == "lits":
            _, alts, i = state
            live = [(lit, nxt) for lit, nxt in alts if i < len(lit) and lit[i] == ch]
            if not live:
                return None
            whole = [nxt for lit, nxt in live if len(lit) == i + 1]
            if whole:  # the literals of one state are prefix-free: this one is chosen
                return whole[0]
            return ("lits", tuple(live), i + 1)
        if kind == "str":
            _, k, after = state
            if ch == CLOSE_PARAM[k]:
                return after if k + 1 == len(CLOSE_PARAM) else ("str", k + 1, after)
            if k >= CLOSE_GUARD:
                return None
            return ("str", 1 if ch == "<" else 0, after)
        if kind == "think":
            _, k, after = state
            if ch == THINK_CLOSE[k]:
                return after if k + 1 == len(THINK_CLOSE) else ("think", k + 1, after)
            return ("think", 1 if ch == "<" else 0, after)
        if kind == "num":
            _, n, integer, stack, nxt = state
            m = _number_step(n, ch, integer)
            if m is not None:
                return ("num", m, integer, stack, nxt)
            if n not in _NUMBER_ENDS:
                return None
            return self.step(self._json_done(stack, nxt), ch)
        if kind == "json":
            return self._json_step(state, ch)
        return None  # done, eos

    # JSON in json.dumps's layout ------------------------------------------------------------

    def _json_done(self, stack: tuple, nxt):
        """After a whole value: the container's separator, or `nxt` at the top level."""
        if not stack:
            return nxt
        return ("json", "sep", 0, stack, nxt)

    def _json_step(self, state, ch: str):
        _, mode, data, stack, nxt = state
        if mode == "value":
            if ch == '"':
                return ("json", "str", (False, 0), stack, nxt)
            if ch == "{":
                return ("json", "obj0", None, stack + ("o",), nxt)
            if ch == "[":
                return ("json", "arr0", None, stack + ("a",), nxt)
            if ch == "-" or ch in _DIGITS:
                return self.step(("num", "start", False, stack, nxt), ch)
            for word in ("true", "false", "null"):
                if ch == word[0]:
                    return ("json", "word", word[1:], stack, nxt)
            return None
        if mode == "word":
            if ch != data[0]:
                return None
            return ("json", "word", data[1:], stack, nxt) if len(data) > 1 else \
                self._json_done(stack, nxt)
        if mode == "str":
            is_key, esc = data
            if esc == 1:  # after a backslash
                if ch in '"\\/bfnrt':
                    return ("json", "str", (is_key, 0), stack, nxt)
                return ("json", "str", (is_key, 5), stack, nxt) if ch == "u" else None
            if esc > 1:  # the \uXXXX digits still to come: esc - 1
                if ch not in "0123456789abcdefABCDEF":
                    return None
                return ("json", "str", (is_key, esc - 1 if esc > 2 else 0), stack, nxt)
            if ch == "\\":
                return ("json", "str", (is_key, 1), stack, nxt)
            if ch == '"':
                return ("json", "colon", 0, stack, nxt) if is_key else \
                    self._json_done(stack, nxt)
            if ch < " " or ch == "｜":
                return None
            return state
        if mode == "colon":  # ": " after a key
            if ch != ": "[data]:
                return None
            return ("json", "colon", 1, stack, nxt) if data == 0 else \
                ("json", "value", None, stack, nxt)
        if mode == "obj0":
            if ch == "}":
                return self._json_done(stack[:-1], nxt)
            return ("json", "str", (True, 0), stack, nxt) if ch == '"' else None
        if mode == "arr0":
            if ch == "]":
                return self._json_done(stack[:-1], nxt)
            return self._json_step(("json", "value", None, stack, nxt), ch)
        if mode == "sep":  # after a value inside a container: ", " then more, or its close
            top = stack[-1]
            if data == 0 and ch == ("}" if top == "o" else "]"):
                return self._json_done(stack[:-1], nxt)
            if ch != ", "[data]:
                return None
            if data == 0:
                return ("json", "sep", 1, stack, nxt)
            return ("json", "key", None, stack, nxt) if top == "o" else \
                ("json", "value", None, stack, nxt)
        if mode == "key":
            return ("json", "str", (True, 0), stack, nxt) if ch == '"' else None
        raise AssertionError(f"unknown JSON mode {mode}")


# ---- tool_choice --------------------------------------------------------------------------------


class ChoiceKind(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolChoice:
    kind: ChoiceKind
    tools: tuple[ToolSpec, ...]  # the tools a call may name (NAMED: that one)
    parallel: bool  # parallel_tool_calls: more than one invoke in a reply

    @classmethod
    def parse(cls, value, tools: Sequence[ToolSpec], *, parallel: bool = True) -> ToolChoice:
        """OpenAI's `tool_choice` (default `auto` with tools, `none` without); ValueError with
        the reason for anything else."""
        if value is None:
            value = "auto" if tools else "none"
        if isinstance(value, str):
            try:
                kind = ChoiceKind(value)
            except ValueError:
                kind = None
            if kind is None or kind is ChoiceKind.NAMED:
                raise ValueError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                 f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                 f"not {value!r:.60}.")
            if kind is ChoiceKind.REQUIRED and not tools:
                raise ValueError("tool_choice \"required\" needs tools.")
            return cls(kind, tuple(tools), parallel)
        fn = value.get("function") if isinstance(value, Mapping) else None
        if not isinstance(value, Mapping) or value.get("type") != "function" or \
                not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError("tool_choice must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
        named = [t for t in tools if t.name == fn["name"]]
        if not named:
            raise ValueError(f"tool_choice names {fn['name']!r:.60}, which is not one of the "
                             f"request's tools.")
        return cls(ChoiceKind.NAMED, tuple(named), parallel)

    @property
    def reads_calls(self) -> bool:
        return self.kind is not ChoiceKind.NONE and bool(self.tools)

    @property
    def strict_auto(self) -> bool:
        """`auto` with a `strict: true` tool: a call, once started, is grammar-constrained."""
        return self.kind is ChoiceKind.AUTO and any(t.strict for t in self.tools)

    def grammar(self, lltok) -> str | None:
        """The llguidance grammar of the calls (None: `none`, or `auto` without a strict tool);
        ValueError naming the tool and the schema feature llguidance cannot enforce."""
        if self.kind is ChoiceKind.NONE or (self.kind is ChoiceKind.AUTO and
                                            not self.strict_auto):
            return None
        auto = self.kind is ChoiceKind.AUTO
        tools = []
        for t in self.tools:
            try:
                tools.append((t.name, t.parameters, t.strict or not auto))
            except ValueError as e:
                raise ValueError(f"tools[{t.index}].function.parameters.{e}") from None
        try:
            grammar = block_grammar(tools, parallel=self.parallel,
                                    mode=BlockMode.AUTO if auto else BlockMode.REQUIRED)
        except ValueError as e:
            bad = next(t for t in self.tools if _fails(t, lltok) is not None)
            raise ValueError(f"tools[{bad.index}].function.parameters.{e}") from None
        try:
            check_grammar(grammar, lltok)
        except ValueError:
            bad = next((t for t in self.tools if (t.strict or not auto)
                        and _fails(t, lltok) is not None), self.tools[0])
            why = _fails(bad, lltok) or "the tools' grammar"
            raise ValueError(f"tools[{bad.index}].function.parameters uses a feature this "
                             f"server cannot enforce: {why}") from None
        return grammar

    def constraint(self, texts: TokenTexts, *, thinking: bool, vocab: GrammarVocab | None = None):
        """The request's LogitsConstraint (None: free). With `vocab` (the tokenizer as
        llguidance sees it) the calls follow the tools' schemas (tool_grammar.py), and `auto`
        with a strict tool is a lazy grammar; without it (a vocabulary llguidance cannot read)
        the DSML automaton checks names, keys and scalar types, and `auto` is free."""
        if self.kind is ChoiceKind.NONE:
            return texts.avoid_calls
        if vocab is None:
            if self.kind is ChoiceKind.AUTO:
                return None
            return DsmlConstraint(texts, self.tools, parallel=self.parallel, thinking=thinking)
        grammar = self.grammar(vocab.lltok)
        if grammar is None:
            return None
        return GrammarConstraint(vocab, grammar, texts.avoid_think_close if thinking else None)

    def check_call(self, call: ToolCall) -> str | None:
        """Why a parsed call's arguments do not satisfy its tool's schema (None: they do, or the
        call was grammar-constrained); for `auto` replies whose tools are not strict."""
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            return f"{call.name!r:.60} is not one of the request's tools."
        if self.kind in (ChoiceKind.REQUIRED, ChoiceKind.NAMED) or tool.strict:
            return None
        try:
            args = json.loads(call.arguments)
        except ValueError as e:
            return f"arguments are not valid JSON ({e})."
        err = best_match(Draft202012Validator(tool.parameters).iter_errors(args))
        if err is None:
            return None
        where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        return f"arguments{where}: {err.message}"


def _fails(tool: ToolSpec, lltok) -> str | None:
    """llguidance's reason for not enforcing one tool's grammar (None: it can)."""
    try:
        check_grammar(block_grammar([(tool.name, tool.parameters, True)], parallel=False,
                                    mode=BlockMode.REQUIRED), lltok)
    except ValueError as e:
        return str(e)
    return None
