"""The kernel registry (`compiler.kernels`): one entry per op family, one entry per kernel kind
the lowering emits, every custom op converted by exactly one entry, every entry's factory
reached by a compiled entry or by `bench kernels`, and keys that round-trip through their
serialised form (JSON) with the same function name."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dsv41.compiler import kernel_keys as kk
from dsv41.compiler import kernels
from dsv41.compiler.kernel_keys import (
    KEY_KINDS,
    Fp8LinearKey,
    KernelKey,
    MoeKey,
    QuantKey,
    key_from_dict,
)
from dsv41.compiler.tools.bench.kernels import FAMILIES
from dsv41.schedules.router import TopkRouting

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = (  # one key of every kind
    Fp8LinearKey(n=64, k=128, m=1), Fp8LinearKey(n=64, k=128, m=None, out_dtype="float32"),
    Fp8LinearKey(n=64, k=512, m=1, rows=6, norm_eps=1e-6),
    Fp8LinearKey(n=64, k=512, m=1, pair_n=96),
    kk.Fp8DequantKey(d=128),
    kk.SparseAttendKey(h=4, d=64, w=16, k=32, softmax_scale=0.125),
    kk.SparseAttendKey(h=4, d=64, w=16, k=32, softmax_scale=0.125, kv="bf16"),
    kk.SparseAttendKey(h=16, d=64, w=16, k=32, softmax_scale=0.125, rope_rd=16),
    kk.IndexScoresKey(heads=4, dim=64), kk.IndexScoresSharedKey(heads=4, dim=64, n_alt=2),
    kk.SelectPositionsKey(topk=16), kk.SelectBlocksKey(topk_blocks=4, block_size=64),
    kk.PoolKey(heads=4, dim=64, topk=16, block_size=64, func="select"),
    MoeKey(dim=64, inter=32, n_experts=5, topk=2, swiglu_limit=7.0, n_hint=1, null_expert=True,
           func="moe_route"),
    MoeKey(dim=64, inter=32, n_experts=5, topk=2, swiglu_limit=7.0, n_hint=1, null_expert=False,
           func="moe_gate_up_route_gate", gate=True,
           routing=TopkRouting(e=5, k=2, normalize=True, route_scale=1.5, gate_temp=1.0)),
    Fp8LinearKey(n=64, k=512, m=1, swiglu_limit=10.0),
    kk.Fp8QkvKey(n_q=64, n_kv=96, k=512, n_b=128, norm_eps=1e-6, m=1, rows=6),
    kk.ScatterRowsKey(width=512, dtype="bfloat16"), kk.RmsNormKey(d=64, eps=1e-6),
    kk.RopeKey(h=4, d=128, rd=64, inverse=True),
    kk.RopeQuantKey(d=512, rd=64, form="fp8", eps=1e-20),
    kk.RopeQuantKey(d=512, rd=64, form="fp4_kv", eps=None),
    kk.RopeQuantKey(d=128, rd=64, form="mxfp4", eps=1e-20, into=True),
    kk.RouteTopkKey(e=16, k=2, normalize=True, route_scale=1.5, bias_rows=False),
    kk.RouteTopkKey(e=16, k=2, normalize=True, route_scale=1.5, bias_rows=True, gate_temp=1.0),
    kk.HcPreMixKey(hc=4, d=64, iters=20, norm_eps=1e-6, hc_eps=1e-6), kk.HcPostKey(hc=4, d=64),
    kk.HcPostPreMixKey(hc=4, d=64, iters=20, norm_eps=1e-6, hc_eps=1e-6),
    QuantKey(op="quant_mxfp4", d=128),
    kk.DenseGemvKey(groups=2, n=32, k=64, x_dtype="bfloat16", w_dtype="float32"),
    kk.DenseGemvKey(groups=2, n=32, k=64, x_dtype="bfloat16", w_dtype="bfloat16", rows=6,
                    out_dtype="bfloat16"),
    kk.DenseGemmKey(groups=2, n=32, k=64, x_dtype="bfloat16", w_dtype="float32"),
)


def _custom_ops() -> set[str]:
    """Every `dsv41::` op graph/ defines (`torch.library.custom_op("dsv41::name", ...)`)."""
    ops = set()
    for path in sorted((ROOT / "graph").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "custom_op":
                name = node.args[0].value
                ops.add(name.removeprefix("dsv41::"))
    return ops


def test_every_kernel_kind_has_exactly_one_entry():
    owners = {kind: [e.name for e in kernels.REGISTRY if cls in e.keys]
              for kind, cls in KEY_KINDS.items()}
    assert {k: v for k, v in owners.items() if len(v) != 1} == {}
    listed = [cls for e in kernels.REGISTRY for cls in e.keys]
    assert sorted(c.kind for c in listed) == sorted(KEY_KINDS)  # no key outside KEY_KINDS
    assert len({e.name for e in kernels.REGISTRY}) == len(kernels.REGISTRY)


def test_every_custom_op_has_exactly_one_converter():
    given = [op for e in kernels.REGISTRY for op in e.converters] + list(kernels.COLLECTIVES) \
        + list(kernels.HOST_CALLS)
    assert len(given) == len(set(given)), "an op converted by two entries"
    assert {op.removesuffix(".default") for op in given} == _custom_ops()


def test_bench_families_are_the_registry_s():
    assert sorted(e.bench.family for e in kernels.REGISTRY if e.bench) == sorted(FAMILIES)
    with pytest.raises(ValueError, match="No kernel benchmark family"):
        kernels.bench_kernel("nope")


@pytest.fixture(scope="module")
def lowered_keys(small_model) -> dict[str, set[KernelKey]]:
    """Kernel keys of the small model's decode and prefill entries (CPU), as lowered (capture +
    lower of two entries: minutes on two cores, hence the tests using it are slow)."""
    from dsv41.compiler.build import run_phases
    from dsv41.graph.model import Model

    model = Model.placeholder(small_model.args)
    return {entry: set(run_phases(model, entry, "cpu", until="lower").kernels)
            for entry in ("decode", "prefill")}


@pytest.mark.slow
def test_every_lowered_kernel_has_exactly_one_entry_and_a_unique_name(lowered_keys):
    for entry, keys in lowered_keys.items():
        assert keys, f"{entry} lowered no kernel"
        for key in keys:
            assert sum(type(key) in e.keys for e in kernels.REGISTRY) == 1, key
        names = [k.function_name for k in keys]
        assert len(names) == len(set(names)), f"{entry}: two keys, one function name"


@pytest.mark.slow
def test_every_entry_is_reached_by_a_compiled_entry_or_bench_kernels(lowered_keys):
    emitted = {type(k) for keys in lowered_keys.values() for k in keys}
    unreached = [e.name for e in kernels.REGISTRY
                 if not emitted & set(e.keys) and e.bench is None]
    assert unreached == []


@pytest.mark.slow
def test_lowered_keys_round_trip_through_json(lowered_keys):
    for key in {k for ks in lowered_keys.values() for k in ks}:
        back = key_from_dict(json.loads(json.dumps(key.to_dict())))
        assert back == key and back.function_name == key.function_name


def test_keys_of_every_kind_round_trip_through_json():
    for key in EXAMPLES:
        back = key_from_dict(json.loads(json.dumps(key.to_dict())))
        assert back == key and back.function_name == key.function_name
    assert {type(k) for k in EXAMPLES} == set(KEY_KINDS.values())


def test_function_names_are_the_positional_names_databases_recorded():
    """The names tuning databases and dumps know (`k_` + the old tuple's parts)."""
    assert Fp8LinearKey(n=64, k=128, m=1).function_name == "k_fp8_linear_64_128_1"
    assert Fp8LinearKey(n=64, k=128, m=None, out_dtype="float32").function_name == \
        "k_fp8_linear_f32_64_128_None"
    assert QuantKey(op="quant_fp4_kv", d=128).function_name == "k_quant_fp4_kv_128"
    assert MoeKey(dim=64, inter=32, n_experts=5, topk=2, swiglu_limit=7.5, n_hint=None,
                  null_expert=True, func="moe_down").function_name == \
        "k_moe_64_32_5_2_7p5_None_null_moe_down"


def test_a_bad_key_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown kernel kind"):
        key_from_dict({"kind": "fp9_linear", "n": 1})
    with pytest.raises(AssertionError, match="quant op"):
        QuantKey(op="quant_fp9", d=128)
