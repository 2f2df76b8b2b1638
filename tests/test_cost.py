"""The decode-step roofline inputs (graph/cost.py) against hand counts."""

from __future__ import annotations

import pytest

from dsv41.graph.checkpoint import param_spec
from dsv41.graph.config import preset
from dsv41.graph.cost import decode_step_cost
from dsv41.graph.layout import KVLayout
from dsv41.graph.plan import build_plan


def test_weights_do_not_depend_on_context_and_kv_grows():
    a = preset("bench")
    c1, c2 = decode_step_cost(a, 4096), decode_step_cost(a, 65536)
    assert c1.weight_bytes == c2.weight_bytes
    assert c2.kv_bytes > c1.kv_bytes and c2.flops > c1.flops
    with pytest.raises(ValueError):
        decode_step_cost(a, -1)


def test_weight_bytes_by_hand():
    a = preset("small")
    spec = param_spec(a)
    dense = sum(s.nbytes for n, s in spec.items() if not n.startswith("mtp.")
                and ".ffn.experts." not in n and n != "embed.weight"
                and ".engram.embed." not in n)
    experts = sum(s.nbytes for n, s in spec.items() if not n.startswith("mtp.")
                  and ".ffn.experts." in n)
    per = a.n_activated_experts / a.n_routed_experts
    embed = spec["embed.weight"].nbytes // a.vocab_size
    got = decode_step_cost(a, 100).weight_bytes
    engram = sum(s.nbytes * a.engram_n_heads * (a.engram_max_ngram_size - 1) // s.shape[0]
                 for n, s in spec.items() if ".engram.embed." in n)
    assert got == dense + round(experts * per) + embed + engram


def test_kv_bytes_at_a_short_context_by_hand():
    """Context 9 on small: window min(10, 16) = 10 entries per layer; every compressed layer
    selects all of its entries (fewer than top-k) and every indexer sweeps them all."""
    a = preset("small")
    plan, lay = build_plan(a), KVLayout.from_plan(build_plan(a))
    src = {s.layer: s for s in lay.sources}
    want = 0
    for p in plan.backbone:
        want += 10 * lay.window_entry_bytes
        if p.role != "local":
            s = src[p.kv_source]
            want += (10 // s.ratio) * s.main_kv_bytes
            if p.runs_indexer:
                want += (10 // s.ratio) * s.index_k_bytes
    assert decode_step_cost(a, 9).kv_bytes == want


def test_an_exact_prefill_in_one_token_chunks_is_that_many_decode_steps():
    """Each one-token chunk reads the weights once and its KV at its own position, as a decode
    step there does; the whole prefill reads the weights once."""
    from dsv41.graph.cost import PrefillMode, prefill_cost

    a, n, start = preset("small"), 23, 5
    steps = [decode_step_cost(a, c) for c in range(start, start + n)]
    chunked = prefill_cost(a, n, start=start, mode=PrefillMode.EXACT, chunk_tokens=1)
    assert chunked.kv_bytes == sum(s.kv_bytes for s in steps)
    assert chunked.flops == sum(s.flops for s in steps)
    assert chunked.weighted_flops == pytest.approx(sum(s.weighted_flops for s in steps))
    assert chunked.weight_bytes == n * steps[0].weight_bytes
    once = prefill_cost(a, n, start=start, mode=PrefillMode.EXACT)
    assert once.kv_bytes == chunked.kv_bytes and once.weight_bytes < chunked.weight_bytes


def test_ced_prefill_runs_the_decoder_over_the_last_window_only():
    from dsv41.graph.cost import PrefillMode, prefill_cost

    a = preset("small")  # window 16
    # up to a window the decoder sees every token: CED is the exact prefill
    assert prefill_cost(a, 16, mode=PrefillMode.CED) == prefill_cost(a, 16,
                                                                     mode=PrefillMode.EXACT)
    ced, exact = prefill_cost(a, 200, mode=PrefillMode.CED), prefill_cost(
        a, 200, mode=PrefillMode.EXACT)
    assert ced.flops < exact.flops and ced.kv_bytes < exact.kv_bytes
    # beyond it, another token adds encoder work only: the decoder's share does not grow
    step = prefill_cost(a, 201, mode=PrefillMode.CED).flops - ced.flops
    exact_step = prefill_cost(a, 201, mode=PrefillMode.EXACT).flops - exact.flops
    assert 0 < step < exact_step
    with pytest.raises(ValueError, match="at least one token"):
        prefill_cost(a, 0)


def test_precision_weighted_flops_by_hand():
    """Context 9 on small: FP8 GEMMs count 0.5, FP4 experts and the MXFP4 index sweeps 0.25,
    everything else (bf16 / fp32 GEMMs, the attention over dequantized entries) 1."""
    a = preset("small")
    plan, lay = build_plan(a), KVLayout.from_plan(build_plan(a))
    spec = param_spec(a)
    want = 0.0
    for name, s in spec.items():
        if name.startswith("mtp.") or len(s.logical_shape) != 2 or s.kind == "e8m0_scale" \
                or "norm" in name or "embed" in name:
            continue
        f = 2 * s.logical_shape[0] * s.logical_shape[1]
        if ".ffn.experts." in name:
            f = f * a.n_activated_experts // a.n_routed_experts
        want += f * {"fp8_e4m3": 0.5, "fp4_e2m1_packed_x2": 0.25}.get(s.kind, 1.0)
    src = {s.layer: s for s in lay.sources}
    for p in plan.backbone:
        attended = 10
        if p.role != "local":
            n = 10 // src[p.kv_source].ratio
            attended += n
            if p.runs_indexer:
                want += 0.25 * 2 * n * a.index_n_heads * a.index_head_dim
        want += 2 * 2 * a.n_heads * a.head_dim * attended
    assert decode_step_cost(a, 9).weighted_flops == pytest.approx(want, rel=1e-12)
