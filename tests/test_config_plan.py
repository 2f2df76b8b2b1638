"""Configs (both file forms, presets, errors) and the layer plan (roles, sources, errors)."""

from __future__ import annotations

import json

import pytest

from dsv41.graph.config import args_from_hf, load_config, preset
from dsv41.graph.plan import FULL, LOCAL, REINDEX, REUSE, build_plan


def test_small_preset_is_the_conformance_config(v41_case):
    assert preset("small") == load_config(v41_case.checkpoint)


def test_full_preset_is_the_released_config():
    a = preset("full")
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim, a.window_size) == (5120, 40, 64, 512, 128)
    assert a.kv_source_layers == (2, 8, 14, 20) and a.candidate_source_layer == 20
    assert a.engram_num_embeddings == (384006168, 384016682)


def test_bench_preset_has_released_attention_sizes():
    a = preset("bench")
    assert (a.n_heads, a.head_dim, a.window_size, a.index_n_heads, a.index_head_dim,
            a.index_topk, a.candidate_block_size, a.candidate_topk_blocks, a.dim) == (
        64, 512, 128, 32, 128, 512, 8, 2048, 1024)


def test_long_preset_has_released_selection_sizes_at_small_widths():
    a, full, small = preset("long"), preset("full"), preset("small")
    assert (a.window_size, a.index_topk, a.candidate_topk_blocks, a.candidate_block_size,
            a.max_seq_len, a.original_seq_len, a.rope_factor) == (128, 512, 2048, 8, 1_048_576,
                                                                  65536, 16.0)
    assert (a.dim, a.n_heads, a.head_dim, a.index_n_heads, a.index_head_dim, a.vocab_size) == (
        small.dim, small.n_heads, small.head_dim, small.index_n_heads, small.index_head_dim,
        small.vocab_size)
    roles = [(p.layer, p.role, p.stage, p.kv_source, p.index_source) for p in build_plan(a).layers]
    assert roles == [(p.layer, p.role, p.stage, p.kv_source, p.index_source)
                     for p in build_plan(full).layers]


def test_hf_form_maps_to_the_same_args(tmp_path):
    a = preset("small")
    hf = {"model_type": "deepseek_v41", "text_config": {
        "hidden_size": a.dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "kv_source_layer_ids": list(a.kv_source_layers),
        "candidate_source_layer_id": a.candidate_source_layer,
        "rope_scaling": {"type": "yarn", "factor": a.rope_factor, "beta_fast": a.beta_fast,
                         "beta_slow": a.beta_slow,
                         "original_max_position_embeddings": a.original_seq_len},
    }}
    rest = {k: v for k, v in a.to_dict().items()
            if k not in ("dim", "n_layers", "n_heads", "kv_source_layers",
                         "candidate_source_layer", "rope_factor", "beta_fast", "beta_slow",
                         "original_seq_len")}
    hf["text_config"].update(rest)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert load_config(path) == a


@pytest.mark.parametrize("bad, words", [
    ({"hidden_sizee": 3}, "hidden_sizee"),
    ({"hidden_size": 256, "dim": 512}, "contradicts"),
    ({"rope_scaling": {"type": "linear"}}, "yarn"),
])
def test_hf_errors_name_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        args_from_hf({"text_config": {**preset("small").to_dict(), **bad}})


def test_unknown_inference_field_is_named(tmp_path):
    d = preset("small").to_dict() | {"n_layer": 3}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="n_layer"):
        load_config(tmp_path)


def test_plan_roles_full():
    plan = build_plan(preset("full"))
    roles = {p.layer: p.role for p in plan.backbone}
    assert [roles[i] for i in (0, 1)] == [LOCAL, LOCAL]
    assert [i for i, r in roles.items() if r == FULL] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r == REINDEX] == [24, 28, 32, 36]
    assert roles[3] == REUSE and plan.layers[3].kv_source == 2 and plan.layers[3].index_source == 2
    assert plan.layers[25].kv_source == 20 and plan.layers[25].index_source == 24
    assert plan.decoder_start == 20 and plan.layers[20].candidate_source
    assert all(plan.layers[i].uses_candidates for i in (24, 28, 32, 36))
    assert [p.layer for p in plan.layers if p.engram] == [1, 14]
    assert [p.layer for p in plan.layers if p.dspark_tap] == [37, 38, 39]
    assert [p.stage for p in plan.layers[40:]] == ["dspark"] * 3


def test_plan_six_layer_case(small_case):
    plan = build_plan(load_config(small_case.checkpoint))
    assert [p.role for p in plan.backbone] == [LOCAL, FULL, REUSE, FULL, REUSE, REINDEX]
    assert plan.decoder_start == 3


@pytest.mark.parametrize("change, words", [
    ({"kv_source_layers": (8, 14, 20), "index_source_layers": (8, 14, 20, 24, 28, 32, 36)},
     "consumer before its source"),
    ({"candidate_source_layer": -1}, "no candidate source"),
    ({"compress_ratios": (0, 0) + (2,) * 18 + (2,) + (1,) * 19 + (0, 0, 0)},
     "ratio 1 but its KV source"),
    ({"index_source_layers": (2, 8, 14, 20, 24, 28, 32, 36, 1)}, "strictly increasing"),
])
def test_invalid_plans_are_clear_errors(change, words):
    with pytest.raises(ValueError, match=words):
        build_plan(preset("full").replace(**change))
