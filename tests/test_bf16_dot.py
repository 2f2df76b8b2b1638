"""`schedules.common.dpbf16ps`: the AVX-512 BF16 dot product reached through an imported LLVM
function (TVM's codegen has no bfloat vector type). Two kernels of one module import the same
definition; every lane equals acc + a[2j+1] * b[2j+1] + a[2j] * b[2j] summed in that order in fp32
(the products are exact), bit for bit, on values without denormals."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm.script import tirx as T

from dsv41.graph.targets import get_target
from dsv41.schedules.common import dpbf16ps, has_avx512_bf16, with_bf16_dot

TARGET = get_target("cpu")
pytestmark = pytest.mark.skipif(not has_avx512_bf16(TARGET),
                                reason="this CPU has no AVX-512 BF16 (vdpbf16ps)")


def _kernel(name: str, lanes: int, steps: int):
    pairs = 2 * lanes

    @T.prim_func(s_tir=True)
    def dot(a: T.Buffer((steps, pairs), "uint16"), b: T.Buffer((steps, pairs), "uint16"),
            c: T.Buffer((lanes,), "float32")):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        with T.attr(T.int32(0), *with_bf16_dot()):
            for s in range(steps):
                c[T.ramp(0, 1, lanes)] = dpbf16ps(
                    c[T.ramp(0, 1, lanes)], a[s, T.ramp(0, 1, pairs)], b[s, T.ramp(0, 1, pairs)],
                    lanes=lanes)

    return dot


def _reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    acc = c.clone()
    prod = (a.float() * b.float()).view(a.shape[0], -1, 2)
    for s in range(a.shape[0]):
        acc = acc + prod[s, :, 1]
        acc = acc + prod[s, :, 0]
    return acc


def test_dpbf16ps_lanes_equal_the_pairwise_fp32_sum_bit_for_bit():
    steps = 7
    mod = tvm.compile(tvm.IRModule({"dot16": _kernel("dot16", 16, steps),
                                    "dot8": _kernel("dot8", 8, steps)}),
                      target=TARGET.tvm_target())
    gen = torch.Generator().manual_seed(3)
    for lanes in (16, 8):
        a = torch.randn(steps, 2 * lanes, generator=gen).bfloat16()
        b = torch.randn(steps, 2 * lanes, generator=gen).bfloat16()
        c = torch.randn(lanes, generator=gen)
        out = c.clone()
        mod[f"dot{lanes}"](*[tvm.runtime.from_dlpack(x) for x in (
            a.view(torch.uint16), b.view(torch.uint16), out)])
        assert torch.equal(out, _reference(a, b, c)), lanes


def test_dpbf16ps_names_its_lane_counts():
    with pytest.raises(ValueError, match="8 or 16 fp32 lanes, got 4"):
        dpbf16ps(None, None, None, lanes=4)
