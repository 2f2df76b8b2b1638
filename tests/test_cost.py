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
