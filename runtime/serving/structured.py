"""Structured outputs: `response_format` `json_object` / `json_schema` as a logits constraint,
by grammar-constrained decoding with llguidance.

    vocab = GrammarVocab.of(tok)                                 # once per tokenizer (~1 s full)
    fmt = ResponseFormat.parse(body.get("response_format"))      # ValueError: the 400's sentence
    constraint = fmt.constraint(vocab)                           # None for "text"
    params = replace(params, constraint=constraint)              # Sampler masks the logits

Why llguidance (not xgrammar, which vLLM and SGLang default to, nor outlines-core): it is a 3 MB
wheel with no Python dependencies, while xgrammar pulls in triton and transformers on Linux x86_64
(hundreds of MB) and depends on apache-tvm-ffi, which this project pins exactly for TVM; llguidance
is one of vLLM's own structured-output backends (`guided_decoding_backend="guidance"`), computes
a token mask in well under a millisecond, and names what it cannot enforce when the grammar is
compiled (`Unimplemented keys: ["not"]`), which becomes a 400.

The tokenizer bridge: llguidance reads the model's tokenizer.json (the one `Tokenizer` loaded,
V4.1's renamed tokens included), maps each id to its bytes (byte-level BPE: the small preset's and
DeepSeek's), keeps special tokens out of any text the grammar matches, and takes EOS as the end.

The JSON is compact with a space after `,` and `:` (`json.dumps`'s layout, as the DSML tool
constraint): no free whitespace, so a sampled reply cannot wander in blanks. A reply stops at EOS
once the grammar accepts (before, EOS is masked; after the value is whole, only EOS is allowed);
max_tokens cuts it like any reply (finish_reason `length`). In thinking mode the reasoning comes
first, free except that it cannot end the reply, and the JSON starts after the `</think>` token
(a `</think>` spelled by smaller tokens is masked, so the reasoning closes the one way the
reply is split).

`GrammarConstraint` is one request's matcher behind `LogitsConstraint`: its states are node ids
of a trie of the token sequences it was asked about, and the matcher is rolled back and forward
to the node asked for (a speculative step's unread tokens, or two samples sharing the object,
both work; one step forward is one `consume_token`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from enum import Enum

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch
from jsonschema import Draft202012Validator, SchemaError

from dsv41.runtime.serving.release_format import THINK_CLOSE
from dsv41.runtime.serving.token_texts import AvoidText, TokenTexts
from dsv41.runtime.serving.tokenizer import Tokenizer

# llguidance's JSON options: json.dumps's separators, no other whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
JSON_OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON object


@dataclass(frozen=True, eq=False)
class GrammarVocab:
    """A tokenizer as llguidance sees it, built once per tokenizer (about a second on the
    released 129,280 ids, milliseconds on the small BPE)."""

    lltok: llguidance.LLTokenizer
    vocab_size: int  # the tokenizer's ids (the masks' length)
    eos: int
    think_close: int | None  # the `</think>` token's id (None: the tokenizer has none)

    @classmethod
    def of(cls, tok: Tokenizer) -> GrammarVocab:
        lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.n_ids,
                                       eos_token=tok.special.eos)
        return cls(lltok, tok.n_ids, tok.special.eos, tok.token_to_id(THINK_CLOSE))


class FormatKind(Enum):
    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"


@dataclass(frozen=True)
class ResponseFormat:
    """A request's `response_format`, checked: its kind and the grammar that enforces it."""

    kind: FormatKind
    schema: Mapping | None = None  # the JSON Schema the reply must satisfy (None: text)
    name: str | None = None  # json_schema.name
    strict: bool = False  # json_schema.strict (the schema is enforced either way)

    @classmethod
    def parse(cls, value) -> ResponseFormat:
        """OpenAI's `response_format` (None: text). ValueError with the reason for a bad one;
        the schema's grammar is checked by `grammar`."""
        if value is None:
            return cls(FormatKind.TEXT)
        if not isinstance(value, Mapping):
            raise ValueError("response_format must be an object with a `type` of \"text\", "
                             "\"json_object\" or \"json_schema\".")
        try:
            kind = FormatKind(value.get("type"))
        except ValueError:
            raise ValueError(f"response_format.type must be \"text\", \"json_object\" or "
                             f"\"json_schema\", not {value.get('type')!r:.60}.") from None
        if kind is FormatKind.TEXT:
            return cls(kind)
        if kind is FormatKind.JSON_OBJECT:
            return cls(kind, JSON_OBJECT_SCHEMA)
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with `name` and "
                             "`schema`.")
        name = spec.get("name")
        if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
            raise ValueError(f"response_format.json_schema.name must be 1 to 64 letters, digits, "
                             f"underscores or dashes, not {name!r:.60}.")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"response_format.json_schema.strict must be true or false, not "
                             f"{strict!r:.60}.")
        schema = spec.get("schema")
        if not isinstance(schema, Mapping):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object.")
        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            raise ValueError(f"response_format.json_schema.schema is not a valid JSON Schema: "
                             f"{e.message}") from None
        return cls(kind, schema, name, bool(strict))

    def grammar(self, vocab: GrammarVocab) -> str | None:
        """The llguidance grammar of the schema (None: text); ValueError naming what the grammar
        engine cannot enforce (an unimplemented keyword, a regex feature, a bad `$ref`)."""
        if self.schema is None:
            return None
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(self.schema),
                                                                    overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:  # a schema JSON cannot spell (NaN, a huge int)
            raise ValueError(f"response_format's schema cannot be read: {e}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                               vocab.lltok)
        if failed:
            why = " ".join(messages[0].split())
            raise ValueError(f"response_format's schema uses a feature this server cannot "
                             f"enforce: {why}")
        return grammar

    def constraint(self, vocab: GrammarVocab, *, thinking: bool = False,
                   texts: Callable[[], TokenTexts] | None = None) -> GrammarConstraint | None:
        """The request's LogitsConstraint (None: text). `thinking`: the reasoning comes first
        (`texts`: the tokenizer's token texts, built once by the caller)."""
        grammar = self.grammar(vocab)
        if grammar is None:
            return None
        think = None
        if thinking:
            if vocab.think_close is None or texts is None:
                raise ValueError("response_format in thinking mode needs a tokenizer with a "
                                 f"{THINK_CLOSE} token.")
            think = texts().avoid_think_close
        return GrammarConstraint(vocab, grammar, think)


class GrammarConstraint:
    """One request's llguidance matcher as a `LogitsConstraint` (see the module docstring).

    States: ("think", k) while reasoning (`k` of `</think>` spelled at the text's end), then
    node ids of the trie of output tokens after `</think>` (0: none yet)."""

    def __init__(self, vocab: GrammarVocab, grammar: str, think: AvoidText | None = None):
        self.vocab = vocab
        self.vocab_size = vocab.vocab_size
        self.think = think
        self.matcher = llguidance.LLMatcher(vocab.lltok, grammar, log_level=0)
        assert not self.matcher.is_error(), self.matcher.get_error()
        self._nodes: list[tuple[int, int, int]] = [(-1, -1, 0)]  # node: (parent, token, depth)
        self._children: dict[tuple[int, int], int] = {}
        self._path = [0]  # the nodes from the root to the matcher's state
        self._bits = llnp.allocate_token_bitmask(1, vocab.vocab_size)
        self._memo: tuple[Hashable, torch.Tensor] | None = None  # the last state's mask
        self._lock = threading.Lock()

    def start(self) -> Hashable:
        return ("think", 0) if self.think is not None else 0

    def _goto(self, node: int) -> None:
        """Roll the matcher back to the deepest node the path shares with `node`, then forward
        along `node`'s tokens."""
        down = []
        while not (self._nodes[node][2] < len(self._path) and
                   self._path[self._nodes[node][2]] == node):
            down.append(node)
            node = self._nodes[node][0]
        depth = self._nodes[node][2]
        if depth + 1 < len(self._path):
            assert self.matcher.rollback(len(self._path) - 1 - depth), self.matcher.get_error()
            del self._path[depth + 1:]
        for n in reversed(down):
            assert self.matcher.consume_token(self._nodes[n][1]), self.matcher.get_error()
            self._path.append(n)

    def allowed(self, state: Hashable) -> torch.Tensor:
        with self._lock:
            if self._memo is not None and self._memo[0] == state:
                return self._memo[1]
            if isinstance(state, tuple):  # reasoning: anything but EOS and a spelled </think>
                mask = self.think.allowed(state[1]).clone()
                mask[self.vocab.think_close] = True
                mask[self.vocab.eos] = False
            else:
                self._goto(state)
                llnp.fill_next_token_bitmask(self.matcher, self._bits)
                bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
                mask = torch.from_numpy(bits[:self.vocab_size].astype(bool))
            self._memo = (state, mask)
            return mask

    def advance(self, state: Hashable, token: int) -> Hashable | None:
        with self._lock:
            if isinstance(state, tuple):
                if token == self.vocab.think_close:
                    return 0
                if token == self.vocab.eos:
                    return None
                k = self.think.advance(state[1], token)
                return None if k is None else ("think", k)
            child = self._children.get((state, token))
            if child is not None:
                return child
            if not 0 <= token < self.vocab_size:
                return None
            self._goto(state)
            if self.matcher.validate_tokens([token]) != 1:
                return None
            child = len(self._nodes)
            self._nodes.append((state, token, self._nodes[state][2] + 1))
            self._children[(state, token)] = child
            return child
