"""The RoPE kernel (schedules/rope.py) against the graph's op `dsv41::rope` (graph/ops.py, which
is `layers.apply_rope`: what the compiled entries lower to this kernel).

Tolerance: none. Every non-NaN output is bit-identical to the oracle's, both forms (vector and
scalar), both directions; NaN outputs sit where the oracle's do (torch writes a NaN's bits as
0x7FC0 or 0xFFFF depending on its path, the kernel 0x7FC0). Inputs are finite bf16 values
above 2^-100 in magnitude, plus infinities, NaN and signed zeros (the kernel's exact range:
schedules/rope.py)."""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import cuda_build, tv

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.schedules import rope as R

CPU = get_target("cpu")


@functools.cache
def _kernel(h: int, d: int, rd: int, inverse: bool, lanes: int):
    cfg = R.RopeConfig(lanes=lanes)
    func = R.schedule_rope(R.make_rope(h=h, d=d, rd=rd, inverse=inverse, lanes=lanes), cfg, CPU)
    return tvm.compile(func, target=CPU.tvm_target())


def _inputs(b: int, s: int, h: int, d: int, rd: int, cos_batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, h, d, generator=g) * 4).to(torch.bfloat16)
    x.view(-1)[:: 97] *= 1e20  # large values: products and sums near the top of fp32
    x[0, 0, 0, -1] = float("inf")
    x[0, 0, 0, -4] = float("-inf")
    x[0, 0, h - 1, -2] = float("nan")
    x[-1, -1, 0, -3] = -0.0
    x[-1, -1, 0, -6] = 0.0
    angle = torch.rand(cos_batch, s, rd // 2, generator=g) * 1000  # positions up to ~1000 rad
    return x, angle.cos(), angle.sin()


def _assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("lanes", [16, 1])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("cos_batch", [2, 1])
def test_bit_identical_to_the_oracle(lanes, inverse, cos_batch):
    h, d, rd = 4, 160, 64  # two vector steps of pairs, three of the copy
    x, cos, sin = _inputs(2, 3, h, d, rd, cos_batch, seed=lanes + 2 * inverse + cos_batch)
    y = torch.empty_like(x)
    _kernel(h, d, rd, inverse, lanes)(tv(x), tv(cos), tv(sin), tv(y))
    _assert_same(y, ops.rope(x, cos, sin, rd, inverse))


def test_scalar_form_where_the_vector_form_does_not_fit():
    """rd 36, d 100: the config picks the scalar form; a (b, s, d) tensor is h = 1."""
    d, rd = 100, 36
    assert not R.vector_fits(d=d, rd=rd) and R.rope_config(CPU, d=d, rd=rd).lanes == 1
    assert R.rope_config(CPU, d=512, rd=64).lanes == 16
    ex = tvm.compile(R.build_rope("cpu", h=1, d=d, rd=rd), target=CPU.tvm_target())
    x, cos, sin = _inputs(1, 5, 1, d, rd, 1, seed=7)
    y = torch.empty_like(x)
    ex(tv(x), tv(cos), tv(sin), tv(y))
    _assert_same(y[:, :, 0], ops.rope(x[:, :, 0], cos, sin, rd, False))


def test_refusals():
    for kw, msg in ((dict(h=1, d=64, rd=63), "even rd"), (dict(h=1, d=64, rd=66), "even rd"),
                    (dict(h=0, d=64, rd=32), "h > 0"),
                    (dict(h=1, d=100, rd=36, lanes=16), "vector form needs"),
                    (dict(h=1, d=64, rd=32, lanes=8), "lanes is 1")):
        with pytest.raises(ValueError, match=msg):
            R.make_rope(**kw)
    x = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    cos = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="takes bf16 x and fp32"):
        ops.rope(x.float(), cos, cos, 32, False)
    with pytest.raises(ValueError, match="needs x"):
        ops.rope(x, cos, cos, 30, False)
    with pytest.raises(ValueError, match="needs x"):
        ops.rope(x, torch.zeros(1, 3, 16), torch.zeros(1, 3, 16), 32, False)


@pytest.mark.parametrize("target", ["cuda-sm90"])
def test_cuda_build_has_device_code(tmp_path, target):
    cuda_build(tmp_path, "rope", "build_rope", dict(h=64, d=512, rd=64, inverse=True), target)
