"""The DSML tool-call block as an llguidance Lark grammar whose parameter values follow their
properties' JSON Schemas (tool_choice.py builds one per request; structured.py's
`GrammarConstraint` applies it).

    grammar = block_grammar(tools, parallel=True, mode=BlockMode.REQUIRED)
    check_grammar(grammar, vocab)               # ValueError naming what llguidance cannot enforce

The block is the release's layout, byte for byte (tool_calls.py parses it, release_format.py
renders it):

    <｜DSML｜ calls>\\n<｜DSML｜ invoke name="NAME">\\n
    <｜DSML｜ parameter name="KEY" string="true|false">VALUE</｜DSML｜ parameter>  (\\n between)
    \\n</｜DSML｜ invoke>\\n</｜DSML｜ calls>

An invoke's parameters come in the schema's `properties` order, each at most once, the
`required` ones always (the order llguidance's own JSON objects keep). A value, by its
property's schema:

- `enum` / `const`: one of the values whole (a string as is with string="true", anything else
  its JSON with string="false");
- a plain string (`type: "string"`, maybe `minLength` / `maxLength`): the text as is
  (string="true"); a string with `pattern` or `format`: its JSON string (string="false"), which
  llguidance checks against the pattern or format;
- anything else (numbers with ranges, objects with required fields, arrays with item schemas,
  unions, no type): `%json{schema}` in `json.dumps`'s layout (", " and ": ", no other
  whitespace), string="false"; an untyped schema or a type list with "string" may also be a
  plain string as is.

No value may spell `</｜DSML｜` (it would close the block early for tool_calls.py's reader): raw
strings exclude it by regex, and inside JSON every string schema without its own `pattern`,
`format`, `enum` or `const` gets the same exclusion as an anchored pattern (a user pattern that
allows it is the one gap: such a reply is read back as text, never as a wrong call).

`BlockMode.AUTO` (tool_choice `auto` with a `strict: true` tool): a lazy grammar: free text
until the model writes `<｜DSML｜ calls>` (the opening matched by a lazy lexeme), then the same
block; a tool without `strict` gets loose parameters there (its own keys, any values), and its
arguments are checked after generation (`ToolChoice.check_call`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from enum import Enum

import llguidance

from dsv41.runtime.serving.release_format import (
    CLOSE_CALLS,
    CLOSE_INVOKE,
    CLOSE_PARAM,
    DSML,
    OPEN_CALLS,
    OPEN_INVOKE,
    OPEN_PARAM,
)

# llguidance's JSON options: json.dumps's separators, no other whitespace (structured.py's)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORBIDDEN = f"</{DSML}"  # what no value may spell


def _avoiding(text: str) -> str:
    """A regex of the strings that never contain `text` (its first character unique in it):
    runs of partial matches each broken by a character that does not continue them."""
    assert text[0] not in text[1:], "the construction needs a unique first character"
    first = text[0]
    parts = [text[1:k] for k in range(1, len(text))]  # what may follow `first` in a partial
    partial = "(?:" + "|".join(_esc(p) for p in parts if p) + ")?"
    breaks = "|".join(f"{_esc(p)}[^{_esc(text[len(p) + 1])}{_esc(first)}]" for p in parts)
    pre = f"(?:{_esc(first)}{partial})"
    return f"(?:[^{_esc(first)}]|{pre}*{_esc(first)}(?:{breaks}))*{pre}*"


def _esc(s: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}-" else c for c in s)


NO_CLOSE = _avoiding(FORBIDDEN)  # a string without `</｜DSML｜`
RAW_KEYS = frozenset(
    {
        "type",
        "minLength",
        "maxLength",
        "description",
        "title",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
STRING_KEYS = ("pattern", "format", "enum", "const")  # a string schema that keeps its own rule


class BlockMode(Enum):
    REQUIRED = "required"  # the reply is one block (tool_choice required or a named function)
    AUTO = "auto"  # free text, or text then one block (a strict tool offered under auto)


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _regex(body: str) -> str:
    return "/" + body.replace("/", "\\/") + "/"


def _types(schema: Mapping) -> set[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return {t} if isinstance(t, str) else set(t)


def guard_strings(schema, defs: Mapping | None = None):
    """`schema` with every string subschema that has no pattern, format, enum or const made to
    exclude `</｜DSML｜` (an anchored pattern); `defs`: the tool's `$defs`, carried along."""
    if isinstance(schema, list):
        return [guard_strings(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[k] = {n: guard_strings(s) for n, s in v.items()} if isinstance(v, Mapping) else v
        elif k in (
            "items",
            "additionalProperties",
            "prefixItems",
            "anyOf",
            "oneOf",
            "allOf",
            "not",
            "contains",
            "if",
            "then",
            "else",
            "propertyNames",
            "unevaluatedProperties",
            "unevaluatedItems",
            "additionalItems",
        ):
            out[k] = guard_strings(v)
        else:
            out[k] = v
    types = _types(schema)
    if (
        (types is None or "string" in types)
        and not any(k in schema for k in STRING_KEYS)
        and "$ref" not in schema
    ):
        out["pattern"] = f"^{NO_CLOSE}$"
    if defs:
        for key in ("$defs", "definitions"):
            if key in defs and key not in out:
                out[key] = guard_strings(defs[key])
    return out


def _json_value(schema: Mapping, root: Mapping) -> str:
    s = guard_strings(schema, root)
    s["x-guidance"] = JSON_OPTIONS
    return "%json " + json.dumps(s, ensure_ascii=False)


END_PARAM = CLOSE_PARAM + "\n"  # a parameter's closing tag and the newline after it
END_INVOKE = CLOSE_INVOKE[1:] + "\n"  # after a parameter's newline: the invoke's closing tag


def _raw_string(schema: Mapping) -> str:
    """A terminal: the text as is (no `</｜DSML｜`, within its length bounds), then the
    parameter's closing tag (one lexeme, matched lazily: it ends at the first closing tag)."""
    body = _regex(NO_CLOSE)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if lo or hi is not None:
        body = f"({body} & /(?s:.{{{lo},{'' if hi is None else hi}}})/)"
    return f"{body} {_lit(END_PARAM)}"


def value_alternatives(name: str, schema, root: Mapping) -> list[tuple[str, str, bool]]:
    """(string flag, Lark expression, raw) of each form a parameter's value may take; `raw`:
    the expression is a terminal that ends with the closing tag (else the rule adds it).
    ValueError: a value that cannot be spelled."""
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise ValueError(f"properties.{name} must be a JSON Schema object.")
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        out = []
        for v in values:
            if isinstance(v, str) and FORBIDDEN in v:
                raise ValueError(
                    f"properties.{name} has the value {v!r:.60}, which spells "
                    f"{FORBIDDEN}; a DSML value cannot."
                )
            flag, text = (
                ("true", v) if isinstance(v, str) else ("false", json.dumps(v, ensure_ascii=False))
            )
            out.append((flag, _lit(text + END_PARAM), True))  # whole: no lexeme a prefix
        return out
    types = _types(schema)
    plain = set(schema) <= RAW_KEYS
    if types == {"string"} and plain:
        return [("true", _raw_string(schema), True)]
    out = []
    if (types is None and not schema) or (types and "string" in types and plain):
        out.append(("true", _raw_string(schema), True))
    out.append(("false", _json_value(schema, root), False))
    return out


def _param_rules(rule: str, key: str, schema, root: Mapping) -> list[str]:
    """The Lark rules of one parameter (`rule`: its name) and its values."""
    alts, rules = [], []
    for j, (flag, expr, raw) in enumerate(value_alternatives(key, schema, root)):
        head = _lit(f'{OPEN_PARAM}{key}" string="{flag}">')
        if raw:
            alts.append(f"{head} {rule}_raw{j}")
            rules += [
                f"{rule}_raw{j}[lazy]: {rule.upper()}_RAW{j}",
                f"{rule.upper()}_RAW{j}: {expr}",
            ]
        else:
            alts.append(f"{head} {rule}_v{j} {_lit(END_PARAM)}")
            rules.append(f"{rule}_v{j}: {expr}")
    return [f"{rule}: " + " | ".join(alts), *rules]


def _params_rule(rule: str, params: Sequence[str], required: Sequence[bool]) -> str:
    """At least one parameter, in order, each optional one may be left out (each ends with its
    own newline, so no separator is a lexeme of its own)."""
    alts = []
    for j, p in enumerate(params):
        if any(required[:j]):
            break
        rest = " ".join(
            q + ("" if r else "?") for q, r in zip(params[j + 1 :], required[j + 1 :], strict=True)
        )
        alts.append(f"{p} {rest}".strip())
    return f"{rule}: " + " | ".join(alts)


def _loose_param_rules(rule: str, keys: Sequence[str]) -> list[str]:
    """A non-strict tool's parameters under a lazy grammar: its own keys, any values."""
    names = " | ".join(_lit(k) for k in keys)
    raw, js = _lit('" string="true">'), _lit('" string="false">')
    return [
        f"{rule}: {rule}_one+",
        f"{rule}_one: {_lit(OPEN_PARAM)} ({names}) ({raw} {rule}_raw | {rule}_json)",
        f"{rule}_raw[lazy]: {rule.upper()}_RAW",
        f"{rule.upper()}_RAW: {_raw_string({})}",
        f"{rule}_json: {js} {_json_value({}, {})} {_lit(END_PARAM)}",
    ]


def tool_rules(rule: str, name: str, schema: Mapping, *, loose: bool = False) -> list[str]:
    """The Lark rules of one tool's invoke (`rule`: its name); ValueError: a value that cannot
    be spelled."""
    props = schema.get("properties", {})
    required = set(schema.get("required", ()))
    keys = list(props)
    lines: list[str] = []
    if keys and loose:
        lines += _loose_param_rules(f"{rule}_ps", keys)
    elif keys:
        names = []
        for j, key in enumerate(keys):
            lines += _param_rules(f"{rule}_p{j}", key, props[key], schema)
            names.append(f"{rule}_p{j}")
        lines.append(_params_rule(f"{rule}_ps", names, [k in required for k in keys]))
    alts = [f"{rule}_ps {_lit(END_INVOKE)}"] if keys else []
    if loose or not required:
        alts.append(_lit(CLOSE_INVOKE + "\n"))  # no parameters: a blank line
    head = _lit(f'{OPEN_INVOKE}{name}">\n')
    return [f"{rule}: {head} ({' | '.join(alts)})", *lines]


def block_grammar(
    tools: Sequence[tuple[str, Mapping, bool]], *, parallel: bool, mode: BlockMode
) -> str:
    """The Lark grammar of a reply's DSML block over `tools` ((name, parameters schema,
    constrained)); `mode`: the whole reply is the block, or free text that may start one."""
    assert tools, "a block needs a tool"
    lines = ["%llguidance {}"]
    invokes = []
    for i, (name, schema, constrained) in enumerate(tools):
        lines += tool_rules(f"t{i}", name, schema, loose=not constrained)
        invokes.append(f"t{i}")
    lines += [
        f"invoke: {' | '.join(invokes)}",
        f"calls: invoke{'+' if parallel else ''} {_lit(CLOSE_CALLS[1:])}",
    ]
    if mode is BlockMode.REQUIRED:
        lines.insert(1, f"start: {_lit(OPEN_CALLS)} calls")
    else:
        opening = OPEN_CALLS.rstrip("\n")
        lines[1:1] = [
            "start: FREE | head calls",
            f"FREE: /(?s:.*)/ & ~{_regex(f'(?s:.*){_esc(opening)}(?s:.*)')}",
            f"head[lazy]: {_regex(f'(?s:.*){_esc(OPEN_CALLS)}')}",
        ]
    return "\n".join(lines) + "\n"


def check_grammar(grammar: str, lltok: llguidance.LLTokenizer) -> None:
    """ValueError with llguidance's reason when it cannot enforce the grammar (an unimplemented
    schema keyword, a regex feature, a bad `$ref`)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if failed:  # the reason, without llguidance's excerpt of the grammar
        why = messages[0].split("failed to compile JSON schema: ", 1)[-1]
        lines = []
        for line in why.splitlines():
            if re.match(r"\s*\d+ \|", line):
                break
            lines.append(line)
        raise ValueError(" ".join(" ".join(lines).split()))
