"""The tokenizer and the Engram map derived from it by the released rule.

Exact tests: token ids and compressed ids are integers. The released count for the real
DeepSeek-V4 tokenizer is 99,092 (`engram_compressed_vocab_size` of `full`)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from dsv41.graph.config import load_config, preset
from dsv41.graph.engram import (
    build_tables,
    compress_token_texts,
    derive_token_map,
    empty_history,
    engram_hash,
    load_token_map,
    stub_token_map,
)
from dsv41.graph.vocab import (
    DEEPSEEK_V4_VOCAB,
    SMALL_BPE_JSON,
    SMALL_STUB_JSON,
    TokenizerSource,
    deepseek_v4_tokenizer_json,
    find_tokenizer_file,
)
from dsv41.runtime.serving.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def deepseek():
    return Tokenizer.for_model(preset("full"))


@pytest.fixture(scope="module")
def stub():
    """The conformance stub vocabulary: the 512-id models' Engram map derives from it."""
    return Tokenizer.from_file(SMALL_STUB_JSON, preset("small"), TokenizerSource.SMALL_STUB)


def test_compress_rule_cases():
    texts = ["a", " A", "é", "E", " ", "\n\n", "\t", "\ufffd", "\ufffd", "\u0301", "Ⅻ", "xii",
             " the\u00a0", "the"]
    raw = ["a", "ĠA", "Ã©", "E", "Ġ", "ĊĊ", "ĉ", "Ġæ", "å", "Ì\u0081", "Ⅻ", "xii", "x", "the"]
    m = compress_token_texts(texts, raw)
    c = m.token_map.tolist()
    assert c[0] == c[1] == 0  # case and surrounding space fold away
    assert c[2] == c[3] == 1  # accents are stripped after NFD
    assert c[4] == c[5] == c[6] == 2  # a lone whitespace run keeps one space (the sentinel)
    assert c[7] != c[8] and c[7] == 3 and c[8] == 4  # partial UTF-8: keyed by the raw entry
    assert c[9] == 5  # normalises to nothing: keyed by its own text
    assert c[10] == c[11] == 6  # NFKC: the Roman numeral twelve is "XII"
    assert c[12] == c[13] == 7  # NFKC turns the no-break space into a space, which is stripped
    assert m.n_compressed == 8


def test_compress_rule_needs_matching_lengths():
    with pytest.raises(ValueError, match="one raw token per text"):
        compress_token_texts(["a"], [])


def test_small_tokenizer_is_the_bpe_with_the_stubs_engram_map():
    args = preset("small")
    tok = Tokenizer.for_model(args)
    assert tok.file.source is TokenizerSource.SMALL_BPE and tok.n_ids == 512
    assert tok.file.path == SMALL_BPE_JSON and tok.file.engram_source == SMALL_STUB_JSON
    np.testing.assert_array_equal(tok.engram_map(args), stub_token_map(512))
    np.testing.assert_array_equal(load_token_map(args, None), stub_token_map(512))
    # the BPE's own derived map is not the config's: why the stub's is the model's
    assert derive_token_map(tok.backend).n_compressed != args.engram_compressed_vocab_size


def test_stub_spells_its_words(stub):
    assert [stub.decode([t], skip_special=False) for t in range(4)] == ["w0", " W0", "w1", " W1"]
    assert stub.encode("w3 W3w255") == [6, 7, 510]
    assert stub.decode([0, 6, 7, 1]) == "w3 W3"  # BOS / EOS are special: left out
    assert stub.is_special(0) and stub.is_special(1) and stub.is_special(2)
    assert not stub.is_special(3)
    np.testing.assert_array_equal(stub.engram_map(preset("small")), stub_token_map(512))


def test_every_stub_spelling_encodes_back_to_its_id(stub):
    """The special spellings (`w0`, ` W0`, `w1`) never match inside a longer word: `w146` is one
    id, not PAD + `46` (what a chat's history re-encodes)."""
    assert [stub.encode(stub.decode([t], skip_special=False)) for t in range(512)] == [
        [t] for t in range(512)]
    assert stub.encode("w1w146 W0w10 W1") == [2, 292, 1, 20, 3]


def test_stub_refuses_text_outside_its_words(stub):
    with pytest.raises(ValueError, match="cannot spell this text"):
        stub.encode("hello w1")
    with pytest.raises(ValueError, match="outside the tokenizer's 512 ids"):
        stub.decode([512])


@pytest.mark.parametrize("fixture", ["small_case", "v41_case"])
def test_conformance_hashes_from_the_derived_map(fixture, request):
    """The checkpoints ship no tokenizer: their text goes through the small BPE, their Engram
    map is the stub's derived map, which must give the goldens."""
    case = request.getfixturevalue(fixture)
    args = load_config(case.checkpoint)
    found = find_tokenizer_file(args, case.checkpoint)
    assert found.source is TokenizerSource.SMALL_BPE and found.engram_source == SMALL_STUB_JSON
    t = build_tables(args, load_token_map(args, case.checkpoint))
    ids = engram_hash(t, empty_history(t, 1), case.tokens[None])[0]
    np.testing.assert_array_equal(ids, case.golden["engram_hash_ids"])


def test_deepseek_v4_tokenizer_is_the_default_for_the_released_vocab(deepseek):
    assert deepseek.file.source is TokenizerSource.DEEPSEEK_V4
    assert deepseek.file.path == deepseek_v4_tokenizer_json()
    assert deepseek.n_ids == DEEPSEEK_V4_VOCAB
    assert deepseek.backend.id_to_token(0) == "<｜begin▁of▁sentence｜>"
    assert deepseek.backend.id_to_token(1) == "<｜end▁of▁sentence｜>"
    assert deepseek.backend.id_to_token(2) == "<｜▁pad▁｜>"
    ids = deepseek.encode("Hello, 世界! ñ")
    assert deepseek.decode(ids) == "Hello, 世界! ñ"
    assert deepseek.encode("<｜User｜>hi<｜Assistant｜></think>")[0] == 128803


def test_deepseek_v4_engram_map_count_is_the_released_one(deepseek):
    args = preset("full")
    tmap = deepseek.engram_map(args)
    assert tmap.shape == (DEEPSEEK_V4_VOCAB,)
    assert int(tmap.max()) + 1 == 99_092 == args.engram_compressed_vocab_size
    assert tmap[:3].tolist() == [0, 1, 2]  # BOS, EOS, PAD: distinct keys, first appearance
    # tokens that differ only by case or a leading space share a compressed id
    pairs = [("Hello", " hello"), ("The", " the")]
    for a, b in pairs:
        ia, ib = deepseek.token_to_id(a), deepseek.token_to_id(b.replace(" ", "Ġ"))
        assert ia is not None and ib is not None and tmap[ia] == tmap[ib]


def test_wrong_tokenizer_is_refused(deepseek, stub, tmp_path):
    full, small = preset("full"), preset("small")
    with pytest.raises(ValueError, match="do not fit"):
        Tokenizer.from_file(deepseek.file.path, small)
    with pytest.raises(ValueError, match="derives 256 Engram compressed ids"):
        stub.engram_map(full)
    # a checkpoint whose tokenizer.json has 512 distinct words: 512 compressed ids, not 256
    vocab = {f"tok{i}": i for i in range(512)}
    HFTokenizer(models.WordLevel(vocab, unk_token="tok3")).save(str(tmp_path / "tokenizer.json"))
    assert find_tokenizer_file(small, tmp_path).source is TokenizerSource.CHECKPOINT
    with pytest.raises(ValueError, match="engram_compressed_vocab_size is 256"):
        load_token_map(small, tmp_path)


def test_padded_vocab_maps_extra_ids_to_the_compressed_pad(tmp_path):
    args = replace(preset("small"), vocab_size=520)
    src = json.loads(SMALL_STUB_JSON.read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps(src))
    tmap = load_token_map(args, tmp_path)
    assert tmap.shape == (520,)
    np.testing.assert_array_equal(tmap[:512], stub_token_map(512))
    assert (tmap[512:] == 1).all()  # engram_pad_id 2 -> compressed 1


def test_no_tokenizer_for_a_synthetic_vocab():
    args = preset("bench")
    assert find_tokenizer_file(args, None) is None
    with pytest.raises(ValueError, match="No tokenizer for a 8192-id vocabulary"):
        Tokenizer.for_model(args)
    np.testing.assert_array_equal(load_token_map(args, None), stub_token_map(8192))


def test_bad_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a HF tokenizers tokenizer.json"):
        Tokenizer.for_model(preset("small"), tmp_path)


def test_derive_matches_backend_decode():
    tok = HFTokenizer.from_file(str(find_tokenizer_file(preset("small"), None).engram_source))
    m = derive_token_map(tok)
    assert m.n_compressed == 256 and m.token_map.shape == (512,)
