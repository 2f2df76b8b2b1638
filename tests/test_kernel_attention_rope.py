"""The sparse-attend kernel's RoPE form (`make_sparse_attend(rope_rd=)`, op
`dsv41::sparse_attend_rope`): q rotated as the tasks stage it, the output rotated back as they
store it. Against the rope kernel, the plain sparse-attend kernel of the same structure and the
inverse rope kernel run in turn (what the compiled entries ran before): every output bit for bit,
for each CPU structure (the config's: vdpbf16ps on AVX-512 BF16; QK and PV on fp32 FMAs with the
vector staging; the CUDA-like restaging with scalar staging), a table batch of 1 and of b, a
verify's rows (s 3). The op's oracle is the three ops in turn. Tolerance: none."""

from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.schedules import attention as A
from dsv41.schedules import rope as R

CPU = get_target("cpu")
STRUCTURES = ("config", "fp32_dot", "restage")


@functools.cache
def _attend(structure: str, h: int, d: int, w: int, k: int, rope_rd: int):
    dims = dict(h=h, d=d, w=w, k=k, softmax_scale=d**-0.5)
    cfg = A.sparse_attend_config(CPU, h=h, d=d)
    if structure == "fp32_dot":
        cfg = dataclasses.replace(cfg, bf16_dot=False, amx_dot=False)
    elif structure == "restage":
        cfg = dataclasses.replace(cfg, heads_per_group=2, stage_rows=8, vector_decode=False,
                                  bf16_dot=False, amx_dot=False)
    func = A.make_sparse_attend(**dims, heads_per_group=cfg.heads_per_group,
                                stage_rows=cfg.stage_rows, vector_decode=cfg.vector_decode,
                                bf16_dot=cfg.bf16_dot, amx_dot=cfg.amx_dot, rope_rd=rope_rd)
    return tvm.compile(A.schedule_sparse_attend(func, cfg, CPU), target=CPU.tvm_target())


@functools.cache
def _rope(h: int, d: int, rd: int, inverse: bool):
    return tvm.compile(R.build_rope("cpu", h=h, d=d, rd=rd, inverse=inverse),
                       target=CPU.tvm_target())


def _bf16_out(ex, args, shape) -> torch.Tensor:
    out = tvm.runtime.tensor(np.zeros(shape, ml_dtypes.bfloat16))
    ex(*[to_tvm(t) for t in args], out)
    return torch.from_numpy(out.numpy().view(np.int16)).view(torch.bfloat16)


def _tables(b: int, s: int, rd: int, seed: int):
    angle = torch.rand(b, s, rd // 2, generator=torch.Generator().manual_seed(seed)) * 1000
    return angle.cos(), angle.sin()


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("b,s,cos_batch", [(1, 1, 1), (2, 3, 2), (2, 1, 1)])
def test_rope_form_is_the_three_kernels_bit_for_bit(structure, b, s, cos_batch):
    h, d, w, k, rd = 16, 64, 16, 32, 16
    args = A.example_inputs_sparse_attend(b=b, s=s, h=h, d=d, w=w, k=k, seed=b * 10 + s)
    q, rest = args[0], args[1:]
    cos, sin = _tables(cos_batch, s, rd, seed=s)
    shape = tuple(q.shape)
    qr = _bf16_out(_rope(h, d, rd, False), [q, cos, sin], shape)
    o = _bf16_out(_attend(structure, h, d, w, k, 0), [qr, *rest], shape)
    want = _bf16_out(_rope(h, d, rd, True), [o, cos, sin], shape)
    got = _bf16_out(_attend(structure, h, d, w, k, rd), [q, cos, sin, *rest], shape)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = ops.sparse_attend_rope(q, cos, sin, rd, *rest, d**-0.5)
    chain = ops.rope(ops.sparse_attend(ops.rope(q, cos, sin, rd, False), *rest, d**-0.5),
                     cos, sin, rd, True)
    assert torch.equal(ref.view(torch.int16), chain.view(torch.int16))


def test_rope_form_refusals():
    dims = dict(h=16, d=64, w=16, k=32, softmax_scale=0.125)
    for rd in (3, 66):
        with pytest.raises(ValueError, match="even rope_rd"):
            A.make_sparse_attend(**dims, rope_rd=rd)


@pytest.mark.parametrize("target", ["cuda-sm90"])
def test_cuda_build_of_the_rope_form(tmp_path, target):
    """The RoPE form builds for CUDA too (the CUDA lowering runs the three kernels instead; a
    direct build keeps the factory honest there)."""
    from kernel_numerics import cuda_build

    cuda_build(tmp_path, "attention", "build_sparse_attend",
               dict(h=64, d=512, w=128, k=512, softmax_scale=512**-0.5, rope_rd=64), target)
