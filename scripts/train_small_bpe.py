"""Writes `graph/presets/small_bpe.json`: the `small` preset's text tokenizer, a byte-level BPE of
512 ids that spells any UTF-8 text, trained on `scripts/small_bpe_corpus.txt` (the repository's
README and docs, English). Run: python scripts/train_small_bpe.py [--check]

The layout follows DeepSeek's released vocabulary where it has a fixed id, and the small
configs' ids elsewhere:

    0, 1, 2     BOS, EOS, PAD (SPEC section 1), spelled as in DeepSeek's file, special
    3 .. 258    the 256 bytes in byte order (GPT-2's byte-to-character alphabet, as DeepSeek's)
    259 .. 504  246 merges, in the order the trainer learnt them
    505 .. 509  `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, `｜DSML｜`: V4.1's chat
                format's markers, added tokens flagged as in the release (non-special)
    510         `<｜deepseek_image｜>`: `shared-vision-small`'s image_token_id
    511         `<｜System｜>`: the small configs' `dspark_noise_token_id`, as the release's
                noise id 128799 is its `<｜System｜>` (special, as the release flags it)

Pre-tokenizer and decoder are DeepSeek's (digits in runs of up to 3, CJK runs, its word regex,
then bytes), the BPE has no unknown token: every string is bytes, so every string is spelled
and decodes back to itself. The trainer (HF `tokenizers`, deterministic for one corpus and one
version) only supplies the merges; ids are laid out here, so the file is byte-identical on
every run (`--check` compares it with the shipped one; tests/test_small_bpe.py does too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "scripts" / "small_bpe_corpus.txt"
OUT = ROOT / "graph" / "presets" / "small_bpe.json"

VOCAB = 512
SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")  # ids 0, 1, 2
BYTES_AT = len(SPECIAL)  # byte b is id 3 + b
# (spelling, special, normalized) from id 505 on, flags as DeepSeek's file has them
MARKERS = (("<｜User｜>", False, True), ("<｜Assistant｜>", False, True),
           ("<think>", False, True), ("</think>", False, True), ("｜DSML｜", False, True),
           ("<｜deepseek_image｜>", False, False), ("<｜System｜>", True, False))
N_MERGES = VOCAB - len(SPECIAL) - 256 - len(MARKERS)  # 246

# DeepSeek-V4's pre-tokenizer (its tokenizer.json), so the format's words split as it splits them
_WORDS = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"""
          r"""[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (HF `ByteLevel`'s), indexed by byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex("[一-龥\u3040-ゟ゠-ヿ]+"), behavior="isolated"),
        pre_tokenizers.Split(Regex(_WORDS), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_merges(corpus: str) -> list[tuple[str, str]]:
    """The first N_MERGES merges the BPE trainer learns from `corpus`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=256 + N_MERGES, initial_alphabet=byte_alphabet(),
                                  show_progress=False, min_frequency=2)
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]
    assert len(pairs) == N_MERGES, f"the corpus gave {len(pairs)} merges, not {N_MERGES}"
    return pairs


def build(corpus: str) -> Tokenizer:
    merges = train_merges(corpus)
    vocab = {s: i for i, s in enumerate(SPECIAL)}
    vocab |= {c: BYTES_AT + b for b, c in enumerate(byte_alphabet())}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == VOCAB - len(MARKERS), "a merge repeats a token"
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=sp, normalized=n) for s, sp, n in MARKERS])
    for i, (s, _, _) in enumerate(MARKERS):
        assert tok.token_to_id(s) == VOCAB - len(MARKERS) + i, f"{s} is not at its id"
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the shipped file instead of writing it")
    ns = ap.parse_args()
    text = build(CORPUS.read_text(encoding="utf-8")).to_str(pretty=True) + "\n"
    if ns.check:
        same = OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'identical' if same else 'DIFFERS from the regenerated file'}")
        sys.exit(0 if same else 1)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {VOCAB} ids ({N_MERGES} merges)")


if __name__ == "__main__":
    main()
