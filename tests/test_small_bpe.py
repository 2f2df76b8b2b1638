"""The `small` preset's byte-level BPE (`graph/presets/small_bpe.json`): any UTF-8 text encodes
and decodes back to itself, its special ids are where the SPEC and the small configs put them
and never come from a client's text, V4.1's chat format encodes with it, and the shipped file is
the one `scripts/train_small_bpe.py` regenerates.

Exact tests (ids and strings); the round trip runs over a seeded sample of strings drawn from
every Unicode plane's assigned-or-not code points (no surrogates: they are not UTF-8), with
emoji ZWJ sequences, CJK, combining marks and control characters mixed in."""

from __future__ import annotations

import hashlib
import importlib.util
import random
from pathlib import Path

import pytest

from dsv41.graph.config import BOS_ID, EOS_ID, PAD_ID, preset
from dsv41.graph.vocab import SMALL_BPE_JSON, TokenizerSource
from dsv41.runtime.serving.chat_format import (
    MARKERS,
    ChatOptions,
    IncrementalDecoder,
    Message,
    Role,
    encode_chat,
    render_chat,
)
from dsv41.runtime.serving.prompts import PromptFormat, prompt_format
from dsv41.runtime.serving.tokenizer import Tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_small_bpe.py"
# sha256 of the shipped file: a change to it is a change to this line (regenerate, then update)
SHIPPED_SHA256 = "8033e6afe9c4ee5691bbdcd7a46f5db00bed76bdea0a243625dc3d7315903ea8"

# id -> spelling of every added token (the script's layout)
ADDED = {0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<｜▁pad▁｜>",
         505: "<｜User｜>", 506: "<｜Assistant｜>", 507: "<think>", 508: "</think>",
         509: "｜DSML｜", 510: "<｜deepseek_image｜>", 511: "<｜System｜>"}

SAMPLES = [
    "", " ", "\n", "Write the number 0 in words, then stop.", "zero",
    "你好，世界！这是一个测试。", "日本語のテキスト、カタカナ", "한국어 텍스트",
    "👩‍👩‍👧‍👦 👨🏽‍💻 🏳️‍🌈 🇯🇵🇫🇷 ❤️‍🔥 1️⃣", "e\u0301 n\u0303 \u0915\u094d\u0937",
    "\x00\x01\x07\x08\x0b\x0c\x1b\x1f\x7f\x80\x85\x9f", "\t\r\n \u00a0\u2028\u2029\u3000",
    "\ufeff\u200b\u200d\ufffd\ufffc", "\U0010ffff\U000e0001\U0001f9ff", "  leading and trailing  ",
    "<｜User｜>hi<｜Assistant｜></think>｜DSML｜<｜System｜><｜deepseek_image｜>",
    "<|User|> <think> </think>", "12345678901234567890", "a" * 300, "ÿþ\xff\xfe",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.for_model(preset("small"))


def _random_text(rng: random.Random) -> str:
    """A string of 0-40 code points from anywhere in Unicode (no surrogates), with runs of
    ASCII, CJK and emoji so that merges are exercised too."""
    def anywhere() -> str:
        return chr(rng.choice([rng.randrange(0x80, 0xd800), rng.randrange(0xe000, 0x110000)]))

    pools = [lambda: chr(rng.randrange(0x20, 0x7f)), lambda: chr(rng.randrange(0, 0x20)),
             lambda: chr(rng.randrange(0x4e00, 0x9fa6)),
             lambda: chr(rng.randrange(0x1f300, 0x1fa00)), lambda: "\u200d",
             lambda: chr(rng.randrange(0x300, 0x370)), anywhere,
             lambda: rng.choice([" the", " and", "ing", "model", "\n\n", "  "])]
    return "".join(rng.choice(pools)() for _ in range(rng.randrange(41)))


def test_layout(tok):
    assert tok.file.source is TokenizerSource.SMALL_BPE and tok.n_ids == 512
    assert (tok.special.bos, tok.special.eos, tok.special.pad) == (BOS_ID, EOS_ID, PAD_ID)
    assert {i: tok.backend.id_to_token(i) for i in ADDED} == ADDED
    assert {i for i in range(512) if tok.is_special(i)} == {0, 1, 2, 511}  # as the release flags
    # ids 3..258 are the bytes in order; 259..504 the merges, each two or more bytes
    assert [tok.backend.decode([3 + b]).encode("utf-8", "surrogateescape") for b in range(0x80)
            ] == [bytes([b]) for b in range(0x80)]
    assert all(len(tok.decode([t]).encode()) >= 2 for t in range(259, 505))
    args = preset("small")
    assert tok.token_to_id("<｜deepseek_image｜>") == 510 == preset("small").replace(
        image_token_id=510).image_token_id
    assert tok.token_to_id("<｜System｜>") == args.dspark_noise_token_id == 511
    assert prompt_format(tok) is PromptFormat.CHAT


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(tok, text):
    for ids in (tok.encode_text(text), tok.encode(text)):
        assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(tok.encode_text(text)) == text  # no added token in a client's text


def test_round_trip_random_unicode(tok):
    rng = random.Random(37)
    texts = [_random_text(rng) for _ in range(2000)]
    bad = [t for t in texts if tok.decode(tok.encode_text(t)) != t]
    assert not bad, f"{len(bad)} strings do not round-trip, e.g. {bad[0]!r}"
    # whole runs as a stream too: the incremental decoder gives the same text, deltas whole
    for t in texts[:200]:
        dec = IncrementalDecoder(tok)
        deltas = [dec.feed(i) for i in tok.encode_text(t)] + [dec.flush()]
        assert "".join(deltas) == t and all("\ufffd" not in d for d in deltas if "\ufffd" not in t)


def test_specials_never_come_from_text(tok):
    text = "".join(ADDED.values()) + " <｜User｜> w0 W0 w1 <think>x</think>"
    ids = tok.encode_text(text)
    assert not set(ids) & set(ADDED)
    assert tok.decode(ids) == text
    rng = random.Random(5)
    for _ in range(300):
        t = _random_text(rng) + rng.choice(list(ADDED.values())) + _random_text(rng)
        assert not set(tok.encode_text(t)) & set(ADDED)
    # `encode` (the format's own words) does read the markers
    assert tok.encode("<｜User｜>hi</think>")[0] == 505 and tok.encode("</think>") == [508]


def test_chat_format_encodes_on_the_small_bpe(tok):
    msgs = [Message(Role.SYSTEM, "Be brief."), Message(Role.USER, "Write the number 0 in words.")]
    ids = encode_chat(tok, msgs, ChatOptions())
    assert ids[0] == BOS_ID and 511 in ids and 505 in ids and 506 in ids
    assert tok.decode(ids, skip_special=False) == render_chat(msgs, ChatOptions())
    assert all(tok.token_to_id(m) is not None for m in MARKERS)


def test_shipped_file_is_what_the_script_regenerates():
    spec = importlib.util.spec_from_file_location("train_small_bpe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = mod.build(mod.CORPUS.read_text(encoding="utf-8")).to_str(pretty=True) + "\n"
    shipped = SMALL_BPE_JSON.read_text(encoding="utf-8")
    assert hashlib.sha256(shipped.encode()).hexdigest() == SHIPPED_SHA256
    assert text == shipped, "run python scripts/train_small_bpe.py (and update SHIPPED_SHA256)"
