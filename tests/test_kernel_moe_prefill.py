"""The CPU prefill `moe_experts` chain in two calls (`moe.fused_tiles`: `moe_gate_up_route`,
`moe_down_combine(_plus)`) against the six tile kernels it replaces: every output bit for bit.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import tirx

from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.schedules import moe

LIMIT = 10.0
DIMS = {"dim": 64, "inter": 96, "n_experts": 6}
ODD = {"dim": 96, "inter": 64, "n_experts": 5}  # an odd number of 32-blocks along dim (3)
SIX = ["moe_route", "moe_qdq_x", "moe_gate_up", "moe_qdq_h", "moe_down", "moe_combine"]


@functools.cache
def _prefill(target: str, null_expert: bool, dims: tuple):
    """The prefill module (hint None: the tile kernels, the six and the two calls), compiled."""
    mod = moe.build_moe_experts_split(target, topk=2, swiglu_limit=LIMIT, n=None,
                                      null_expert=null_expert, **dict(dims))
    return tvm.compile(mod, target=get_target(target).tvm_target())


def _run(ex, target: str, args: list[torch.Tensor], dims: dict, plus: bool, fuse: bool
         ) -> dict[str, tvm.runtime.Tensor]:
    """The plan's calls in order, its intermediates and y filled with NaN first (Relax leaves
    them uninitialised): a value read before it is written would show."""
    plan = moe.moe_experts_plan(target, n=args[0].shape[0], n_hint=None, topk=2, plus=plus,
                                fuse=fuse, **dims)
    env = {b.name: to_tvm(t) for b, t in zip(plan.inputs, args, strict=True)}
    for b in (*plan.intermediates, plan.output):
        dtype = ml_dtypes.bfloat16 if b.dtype == "bfloat16" else b.dtype
        fill = np.nan if b.dtype in ("bfloat16", "float32") else 0
        env[b.name] = tvm.runtime.tensor(np.full([int(s) for s in b.shape], fill, dtype))
    for call in plan.calls:
        ex[call.func](*[env[a] for a in call.args], *[env[o] for o in call.outs])
    return env


def _inputs(n: int, dims: dict, null_expert: bool, seed: int) -> list[torch.Tensor]:
    """The model's routing (skewed: popular experts take several 64-row tiles at 200 tokens,
    others none at few); with null_expert, every third token's second pair goes to the null
    expert (the last, weight 0; a repeated id where its first pair is there too) and every
    fifth token's both pairs."""
    args = moe.example_inputs_moe_experts(n=n, topk=2, seed=seed, **dims)
    if null_expert:
        null = dims["n_experts"] - 1
        ids = args[2].clone()
        ids[::3, 1] = null
        ids[::5, :] = null
        args[2] = ids
        args[1] = torch.where(ids == null, 0.0, args[1])
    else:
        moe.check_expert_ids(args[2], dims["n_experts"])
    return args


def _bytes(t: tvm.runtime.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint8)


def test_prefill_plan_is_two_calls_on_cpu_only():
    """CPU prefill (any CPU target) plans the two calls, with fuse=False the six; CUDA keeps
    the six (its kernels cannot allocate the token-sized buffers); the calls name the module's
    PrimFuncs with their arity."""
    n = tirx.Var("n", "int64")
    for target in ("cpu", "cpu-x86-64"):
        config = moe.moe_split_config(get_target(target), topk=2, **DIMS)
        assert moe.fused_tiles(config, get_target(target))
        assert moe.fused_chain(config, get_target(target))
        for plus in (False, True):
            plan = moe.moe_experts_plan(target, n=n, topk=2, plus=plus, **DIMS)
            combine = "moe_down_combine_plus" if plus else "moe_down_combine"
            assert [c.func for c in plan.calls] == ["moe_gate_up_route", combine]
            assert {b.name for b in plan.intermediates} == {"row_pair", "token_rows", "tiles",
                                                             "h"}
            mod = moe.build_moe_experts_split(target, topk=2, swiglu_limit=LIMIT, **DIMS)
            for call in plan.calls:
                assert len(mod[call.func].params) == len(call.args) + len(call.outs)
        six = moe.moe_experts_plan(target, n=n, topk=2, fuse=False, **DIMS)
        assert [c.func for c in six.calls] == SIX
    cuda = moe.moe_split_config(get_target("cuda-sm90"), topk=2, **DIMS)
    assert not moe.fused_chain(cuda, get_target("cuda-sm90"))
    assert [c.func for c in moe.moe_experts_plan("cuda-sm90", n=n, topk=2, **DIMS).calls] == SIX
    with pytest.raises(ValueError, match="CPU tile kernels"):
        moe.fused_tiles_funcs(cuda, get_target("cuda-sm90"), topk=2, swiglu_limit=LIMIT,
                              **DIMS)


@pytest.mark.parametrize("target,dims", [("cpu", DIMS), ("cpu", ODD), ("cpu-x86-64", DIMS)],
                         ids=["host", "host-odd-blocks", "x86-64"])
@pytest.mark.parametrize("null_expert", [False, True], ids=["experts", "null-expert"])
def test_fused_prefill_chain_bit_identical_to_six_calls(target, dims, null_expert):
    """The two calls give the six kernels' row_pair, token_rows, tiles, h and y bit for bit,
    with and without the shared expert's output (`plus`), for 0..200 tokens: experts with no
    tile, one partial tile and several (64 rows each), a sharded worker's null expert (its
    pairs get no tiles; their rows of h, never written, stay the caller's NaN in both)."""
    ex = _prefill(target, null_expert, tuple(dims.items()))
    for n in (0, 1, 5, 70, 200):
        args = _inputs(n, dims, null_expert, seed=n + 61)
        shared = (torch.randn(n, dims["dim"], generator=torch.Generator().manual_seed(n))
                  * 4).to(torch.bfloat16)
        for plus in (False, True):
            a = [*args, shared] if plus else args
            ref = _run(ex, target, a, dims, plus, fuse=False)
            got = _run(ex, target, a, dims, plus, fuse=True)
            for name in ("row_pair", "token_rows", "tiles", "h", "y"):
                assert np.array_equal(_bytes(got[name]), _bytes(ref[name])), (n, plus, name)
            experts = [e for e, _, rows in got["tiles"].numpy().tolist() if rows]
            if n == 5 and dims is DIMS:  # experts with no tile among six
                assert len(set(experts)) < dims["n_experts"] - null_expert
            if n == 200:  # an expert with several tiles (more than 64 rows)
                assert max(experts.count(e) for e in experts) > 1
            assert not np.isnan(got["y"].numpy().astype(np.float32)).any(), (n, plus)
