"""Writes `graph/presets/small_stub_tokenizer.json`: the conformance stub vocabulary as a real
HF `tokenizers` file. The 512-id models' Engram map is derived from it (`graph/vocab.py`); their
text goes through the byte-level BPE of `scripts/train_small_bpe.py`.

The conformance pack (shared/conformance/README.md, "Engram compressed token map") defines the stub:
id 2k spells `w{k}` and id 2k+1 spells ` W{k}` (a leading space, a capital W), for k < 256. Both
normalise to `w{k}` under the released Engram rule, so the derived map is compressed(t) = t // 2
with 256 compressed ids: the `small` config's `engram_compressed_vocab_size`, and the map the
goldens' `engram_hash_ids` were computed with. Ids 0, 1, 2 keep their SPEC roles (BOS, EOS, PAD)
as special tokens, spelled by the stub. Run: python scripts/make_small_tokenizer.py
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

STUB_PAIRS = 256
OUT = Path(__file__).resolve().parents[1] / "graph" / "presets" / "small_stub_tokenizer.json"


def stub_spelling(token_id: int) -> str:
    k, upper = divmod(token_id, 2)
    return f" W{k}" if upper else f"w{k}"


def build() -> Tokenizer:
    vocab = {stub_spelling(t): t for t in range(2 * STUB_PAIRS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    # a stub word is `w<digits>` or ` W<digits>`; anything else is left as its own (unknown) piece
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"w[0-9]+| W[0-9]+"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # single_word: an added token never matches inside a longer stub word (`w1` is PAD, but
    # `w146` is id 292, not `w1` + an unspellable `46`); alone it is the same id either way
    tok.add_special_tokens([AddedToken(stub_spelling(t), special=True, normalized=False,
                                       single_word=True) for t in (0, 1, 2)])
    return tok


def main() -> None:
    tok = build()
    tok.save(str(OUT), pretty=True)
    print(f"wrote {OUT}: {tok.get_vocab_size(with_added_tokens=True)} ids")


if __name__ == "__main__":
    main()
