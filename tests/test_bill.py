"""Tests of dsv41.graph.bill: the KV bill against hand arithmetic and against live allocations.

Expected numbers are worked out here from the SPEC's formats (FP4 main KV: d/2 + d/16 bytes;
MXFP4 index K: d/2 + d/32; FP8 window entry: d + d/32), never by calling the code under test.
"""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from dsv41.graph import bill as B
from dsv41.graph.cache import new_cache
from dsv41.graph.config import preset
from dsv41.graph.plan import build_plan

MILLION = 1_000_000
MEBI = 1_048_576


@pytest.fixture(scope="module")
def full_bill() -> B.Bill:
    return B.make_bill(preset("full"), contexts=(MILLION, 131_072, MEBI))


# --------------------------------------------------------------------------------------------
# full preset: the article's 890 B/token
# --------------------------------------------------------------------------------------------


def test_full_bytes_per_token(full_bill):
    # 3 sources at m=2 + 1 at m=1 = 2.5 entries/token, each 288 + 68 B
    assert full_bill.entries_per_token == 2.5
    assert full_bill.global_bytes_per_token == 890
    assert full_bill.global_arithmetic.endswith("= 890")


def test_full_source_rows(full_bill):
    rows = {s.layer: s for s in full_bill.sources}
    assert sorted(rows) == [2, 8, 14, 20]
    for layer in (2, 8, 14):
        s = rows[layer]
        assert (s.ratio, s.main_kv_bytes, s.index_k_bytes, s.entry_bytes) == (2, 288, 68, 356)
        assert s.bytes_per_token == 178
    s20 = rows[20]
    assert (s20.ratio, s20.main_kv_bytes, s20.index_k_bytes) == (1, 288, 68)
    assert s20.bytes_per_token == 356
    assert s20.readers == tuple(range(20, 40))
    assert rows[2].readers == tuple(range(2, 8))


def test_full_local_state(full_bill):
    local = full_bill.local
    assert local.backbone_window_bytes == 40 * 128 * 528 == 2_703_360
    assert local.dspark_window_bytes == 3 * 128 * 528
    # three m=2 sources, each an fp32 kv and score of 2 x 512
    assert local.tail_bytes == 3 * 2 * 2 * 512 * 4
    assert local.total_bytes == 2_703_360 + 202_752 + 24_576


def test_full_totals(full_bill):
    totals = {t.context: t for t in full_bill.totals}
    assert totals[MILLION].global_bytes == 890 * MILLION  # 0.89 GB, the article's figure
    assert round(totals[MILLION].global_bytes / 1e9, 2) == 0.89
    assert totals[MEBI].global_bytes == 890 * MEBI  # MEBI is even: every group complete
    assert totals[131_072].global_bytes == 890 * 131_072
    assert totals[MILLION].total_bytes == 890 * MILLION + full_bill.local.total_bytes


def test_full_generations(full_bill):
    gens = {g.name: g for g in full_bill.generations}
    llm = gens["DeepSeek LLM 67B"]
    assert llm.bytes_per_token == 95 * 8 * 128 * 2 * 2 == 389_120
    assert round(llm.ratio_to_dsv41) == 437
    assert llm.bytes_at[0] == 389_120 * MILLION
    v3 = gens["DeepSeek-V3"]
    assert v3.bytes_per_token == 61 * 576 * 2 == 70_272
    v4 = gens["DeepSeek-V4-Flash"]
    assert v4.bytes_per_token == 21 * (584 + 68) / 4 + 20 * 584 / 128 == 3514.25
    # complete entries at 1,000,000 tokens: 250,000 CSA entries and 7,812 HCA entries per layer
    assert v4.bytes_at[0] == 21 * 250_000 * 652 + 20 * 7_812 * 584
    assert round(v4.bytes_at[0] / 1e9, 1) == 3.5
    assert round(v4.ratio_to_dsv41) == 4  # "about 4x of it in this release"
    assert "3,423 + 91.25" in v4.arithmetic


def test_generation_arithmetic_matches_value():
    for g in B.GENERATIONS:
        shown = g.arithmetic().rsplit("=", 1)[1].strip().replace(",", "")
        assert float(shown) == g.bytes_per_token, g.name


def test_format_full(full_bill):
    text = B.format_bill(full_bill)
    assert "890 B/token" in text
    assert "0.89 GB per 1M (1,000,000) tokens" in text
    assert "1,000,000 tokens (1M)" in text
    assert "1,048,576 tokens (1Mi)" in text
    assert "890,000,000" in text and "933,232,640" in text
    assert "2,703,360 B" in text and "40 layers x 128 x 528 B" in text
    assert "437x" in text
    assert "95 x (8 x 128 x 2 x 2) = 389,120" in text


# --------------------------------------------------------------------------------------------
# other presets and kv_dtype
# --------------------------------------------------------------------------------------------


def test_small_preset_by_hand():
    bill = B.make_bill(preset("small"), contexts=(1000,))
    # head_dim 64: FP4 64/2 + 64/16 = 36 B; index_head_dim 64: MXFP4 64/2 + 64/32 = 34 B
    for s in bill.sources:
        assert (s.main_kv_bytes, s.index_k_bytes) == (36, 34)
    assert bill.global_bytes_per_token == 2.5 * 70 == 175
    # window 16 slots of FP8 64 + 64/32 = 66 B
    assert bill.local.backbone_window_bytes == 40 * 16 * 66
    assert bill.local.dspark_window_bytes == 3 * 16 * 66
    assert bill.local.tail_bytes == 3 * 2 * 2 * 64 * 4
    assert bill.totals[0].global_bytes == 3 * 500 * 70 + 1000 * 70
    assert bill.label == "dsv41 (preset small)"


def test_bench_preset_keeps_full_attention_sizes():
    bill = B.make_bill(preset("bench"), contexts=(MILLION,))
    # bench keeps head_dim 512, index_head_dim 128, window 128 and 40 layers
    assert bill.global_bytes_per_token == 890
    assert bill.local.backbone_window_bytes == 2_703_360
    assert bill.label == "dsv41 (preset bench)"


def test_bf16_main_kv():
    full = B.make_bill(preset("full"), kv_dtype="bf16")
    assert {s.main_kv_bytes for s in full.sources} == {2 * 512}
    assert full.global_bytes_per_token == 2.5 * (1024 + 68)
    small = B.make_bill(preset("small"), kv_dtype="bf16")
    assert {s.main_kv_bytes for s in small.sources} == {2 * 64}
    assert small.global_bytes_per_token == 2.5 * (128 + 34)


def test_unnamed_config_is_labelled_by_hash():
    args = preset("small").replace(window_size=8)
    assert B.make_bill(args, contexts=(10,)).label.startswith("dsv41 (config ")


@pytest.mark.parametrize("contexts", [(), (0,), (-4,), (1.5,), (True,), ("1M",)])
def test_make_bill_rejects_bad_contexts(contexts):
    with pytest.raises(ValueError, match="[Cc]ontext"):
        B.make_bill(preset("small"), contexts=contexts)


def test_make_bill_rejects_bad_kv_dtype():
    with pytest.raises(ValueError, match="kv_dtype"):
        B.make_bill(preset("small"), kv_dtype="fp8")


# --------------------------------------------------------------------------------------------
# the bill equals a real allocation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["fp4", "bf16"])
@pytest.mark.parametrize("tokens", [1000, 64])
def test_bill_matches_live_allocation(kv_dtype, tokens):
    args = preset("small")
    cache = new_cache(build_plan(args), batch=1, capacity=tokens, kv_dtype=kv_dtype)
    live = cache.nbytes()
    bill = B.make_bill(args, contexts=(tokens,), kv_dtype=kv_dtype)
    assert live["main_kv"] + live["index_k"] == bill.totals[0].global_bytes
    assert live["window"] == bill.local.backbone_window_bytes + bill.local.dspark_window_bytes
    assert live["tails"] == bill.local.tail_bytes


# --------------------------------------------------------------------------------------------
# context parsing and labels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("128K,1M", (128_000, 1_000_000)),
    ("128Ki, 1Mi", (131_072, 1_048_576)),
    ("4096", (4096,)),
    (" 2m ,3k", (2_000_000, 3_000)),
    ("1MI", (1_048_576,)),
    ("1000000,1000000", (1_000_000, 1_000_000)),
])
def test_parse_contexts(text, expected):
    assert B.parse_contexts(text) == expected


@pytest.mark.parametrize("text", [
    "", "  ", "0", "0K", "-5", "1.5M", "abc", "1G", "128K,,1M", "128K,", "K", "1 M i", "1e6",
])
def test_parse_contexts_rejects(text):
    with pytest.raises(ValueError, match="[Cc]ontext"):
        B.parse_contexts(text)


@pytest.mark.parametrize("n, label", [
    (1_000_000, "1,000,000 tokens (1M)"),
    (1_048_576, "1,048,576 tokens (1Mi)"),
    (131_072, "131,072 tokens (128Ki)"),
    (128_000, "128,000 tokens (128K)"),
    (1_024_000, "1,024,000 tokens (1024K)"),
    (2_048, "2,048 tokens (2Ki)"),
    (1_234, "1,234 tokens"),
])
def test_context_label(n, label):
    assert B.context_label(n) == label


@pytest.mark.parametrize("n", [1_000_000, 1_048_576, 131_072, 1_024_000, 3_000, 999])
def test_context_label_round_trips(n):
    label = B.context_label(n)
    short = label[label.index("(") + 1 : -1] if "(" in label else str(n)
    assert B.parse_contexts(short) == (n,)


# --------------------------------------------------------------------------------------------
# JSON and chart
# --------------------------------------------------------------------------------------------


def test_bill_json_round_trips(full_bill):
    data = json.loads(json.dumps(B.bill_json(full_bill)))
    assert data["global_bytes_per_token"] == 890
    assert data["local"]["backbone_window_bytes"] == 2_703_360
    assert [s["layer"] for s in data["sources"]] == [2, 8, 14, 20]
    assert data["totals"][0] == {"context": MILLION, "global_bytes": 890 * MILLION,
                                 "local_bytes": full_bill.local.total_bytes,
                                 "total_bytes": 890 * MILLION + full_bill.local.total_bytes}
    assert data["generations"][0]["bytes_per_token"] == 389_120


def test_bill_chart_writes_png(full_bill, tmp_path):
    path = B.bill_chart(full_bill, tmp_path / "bill.png")
    assert path.stat().st_size > 0
    image = matplotlib.image.imread(path)
    width, height = (round(v * B.CHART_DPI) for v in B.CHART_SIZE_IN)
    assert image.shape[:2] == (height, width)


# --------------------------------------------------------------------------------------------
# the encoder snapshot and the decode FLOPs
# --------------------------------------------------------------------------------------------


def test_encoder_snapshot_bytes_by_hand_and_from_a_live_cache():
    """small: 20 encoder rings of 16 FP8 entries (64 + 2 B), three ratio-2 tails (fp32 kv +
    score, 2 x 2 x 64 x 4 B), pos + index owner + 3 Engram lookback ids (int64)."""
    from dsv41.graph.layout import encoder_snapshot_bytes

    plan = build_plan(preset("small"))
    want = 20 * 16 * (64 + 2) + 3 * 2 * 2 * 64 * 4 + 8 * (2 + 3)
    assert encoder_snapshot_bytes(plan) == want
    cache = new_cache(plan, 1, 1024, engram_pad=2)
    live = sum(r.codes.nbytes + r.scales.nbytes for lay, r in cache.windows.items()
               if lay < plan.decoder_start)
    live += sum(s.tail_kv.nbytes + s.tail_score.nbytes for s in cache.stores.values()
                if s.tail_kv is not None)
    live += cache.pos.nbytes + cache.index_owner.nbytes + cache.engram_history.nbytes
    assert live == want
    bill = B.make_bill(preset("small"), contexts=(1000,))
    assert bill.encoder_snapshot.total_bytes == want
    assert f"encoder snapshot (DRAM pool, per sequence) {want:>11,} B" in B.format_bill(bill)
    assert B.bill_json(bill)["encoder_snapshot"]["total_bytes"] == want


def test_decode_flops_rise_from_4k_to_1m():
    bill = B.make_bill(preset("bench"), contexts=(4000, MILLION))
    a, b = bill.decode_flops
    assert (a.context, b.context) == (4000, MILLION)
    assert b.flops > a.flops and b.weighted_flops > a.weighted_flops
    assert b.weighted_flops / a.weighted_flops < b.flops / a.flops  # the sweeps are FP4
    text = B.format_bill(bill)
    assert f"x{b.weighted_flops / a.weighted_flops:.3f} weighted" in text
    assert [f["context"] for f in B.bill_json(bill)["decode_flops"]] == [4000, MILLION]
