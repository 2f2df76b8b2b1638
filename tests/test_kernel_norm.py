"""The RMSNorm kernel (schedules/norm.py) against the graph's op `dsv41::rms_norm` (graph/ops.py,
what the compiled entries lower to this kernel), and norm.py's shared `mul_bf16` helper.

Tolerance: the kernel adds the sum of squares in 32 strided partial sums, torch in its own
  order; rsqrt then moves by an fp32 ulp or two, so an output can round to the neighbouring
  bf16 value. Required: every element within one bf16 ulp of the oracle, and at least 99.9% of
  elements bit-identical (measured: > 99.99%).
"""

from __future__ import annotations

import functools

import pytest
import torch
import tvm
from kernel_numerics import (
    assert_within_one_bf16_ulp,
    bits,
    cuda_build,
    from_device,
    gpu_target,
    to_device,
    tv,
)
from tvm.script import tirx as T

from dsv41.graph.ops import rms_norm
from dsv41.graph.targets import get_target
from dsv41.schedules import norm as N

CPU = get_target("cpu")
EPS = 1e-20


@functools.cache
def _rms(d: int):
    return tvm.compile(N.build_rms_norm("cpu", d=d, eps=EPS), target=CPU.tvm_target())


def run_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    y = torch.empty_like(x2)
    _rms(d)(tv(x2), tv(w), tv(y))
    return y.reshape(x.shape)


# ---- rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,d", [(1, 1024), (3, 512), (37, 1024), (130, 64), (5, 1280),
                                 (9, 48)])
def test_rms_norm_matches(n, d):
    """Decode (1 row), odd row counts, the model's widths (dim, head_dim, q_lora_rank at
    `full`, the small preset's 64) and a width that is not a multiple of 32 (48: 16 lanes)."""
    x, w = N.example_inputs_rms_norm(n=n, d=d, seed=n + d)
    assert_within_one_bf16_ulp(run_rms(x, w), rms_norm(x, w, EPS), 0.999)


def test_rms_norm_extreme_scales_and_zero_rows():
    """Rows at 1e-30 .. 1e30 scale (the fp32 sum of squares stays finite for bf16 inputs up to
    ~1e18; beyond, both overflow to inf and give 0), an all-zero row (rsqrt(eps) * 0 = 0)."""
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-30, 1e-10, 1.0, 1e10, 1e17])
    x = (torch.randn(5, 512, generator=g) * scales[:, None]).to(torch.bfloat16)
    x = torch.cat([x, torch.zeros(1, 512, dtype=torch.bfloat16)])
    w = N.example_inputs_rms_norm(n=1, d=512)[1]
    got, ref = run_rms(x, w), rms_norm(x, w, EPS)
    assert_within_one_bf16_ulp(got, ref, 0.99)
    assert torch.equal(bits(got[-1]), torch.zeros(512, dtype=torch.int16))


def test_rms_norm_batch_dims_and_empty():
    x, w = N.example_inputs_rms_norm(n=2 * 7, d=512, seed=1)
    x = x.reshape(2, 7, 512)
    assert_within_one_bf16_ulp(run_rms(x, w), rms_norm(x, w, EPS), 0.999)
    assert run_rms(torch.zeros(0, 512, dtype=torch.bfloat16), w).shape == (0, 512)


def test_rms_norm_bench_size_mostly_exact():
    x, w = N.example_inputs_rms_norm(n=2048, d=1024, seed=2)
    assert_within_one_bf16_ulp(run_rms(x, w), rms_norm(x, w, EPS), 0.9999)


@T.prim_func(s_tir=True)
def _mul_add(a: T.Buffer((4096, 16), "bfloat16"), b: T.Buffer((4096, 16), "float32"),
             c: T.Buffer((4096, 16), "float32"), y: T.Buffer((4096, 16), "float32")):
    for i in range(4096):
        for j in T.vectorized(16):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = N.mul_bf16(N.f32_of_bf16(a[vi, vj]), b[vi, vj]) + c[vi, vj]


def test_mul_bf16_is_rounded_before_the_add():
    """fp32(a * b) + c with a bf16 and b, c fp32, exactly as torch rounds it (no FMA): the
    helper mHC relies on."""
    g = torch.Generator().manual_seed(4)
    a = (torch.randn(4096, 16, generator=g) * 10).to(torch.bfloat16)
    b = torch.randn(4096, 16, generator=g)
    c = torch.randn(4096, 16, generator=g) * 10
    y = torch.empty(4096, 16)
    tvm.compile(_mul_add, target=CPU.tvm_target())(tv(a), tv(b), tv(c), tv(y))
    assert torch.equal(y, a.float() * b + c)


# ---- factories, configs, schedules ------------------------------------------------------------


def test_factories_reject_bad_dims():
    with pytest.raises(ValueError, match="lanes"):
        N.make_rms_norm(d=48, eps=EPS, lanes=32)
    with pytest.raises(ValueError, match="d > 0"):
        N.make_rms_norm(d=0, eps=EPS)
    with pytest.raises(ValueError, match="lanes=16"):
        N.schedule_rms_norm(N.make_rms_norm(d=64, eps=EPS, lanes=16),
                            N.norm_config(CPU, d=64), CPU)


def test_signatures_are_int64_and_ordered():
    f = N.make_rms_norm(d=512, eps=EPS)
    assert [p.name for p in f.params] == ["x", "weight", "y"]
    assert all(str(dim.ty) == "int64" for p in f.params for dim in p.shape)


def test_cpu_schedules_are_parallel_and_vectorised():
    func = N.build_rms_norm("cpu", d=512, eps=EPS)
    assert func.attrs["tirx.is_scheduled"]
    text = func.script()
    assert "T.parallel(" in text and "T.vectorized(" in text


def test_bench_cases_run():
    cases = N.bench_cases(tokens=(3,))
    assert {c.family for c in cases} == {"norm"}
    for c in cases[:2]:
        ex = tvm.compile(c.build("cpu"), target=CPU.tvm_target())
        data = c.prepare()
        ex(*[tv(t) for t in (*data.inputs, *data.outputs)])
        ref = data.pick(data.oracle(*data.oracle_args))
        assert_within_one_bf16_ulp(data.outputs[0], ref, 0.99)
        assert c.bytes > 0 and c.flops > 0


# ---- CUDA -------------------------------------------------------------------------------------

BUILDERS = {
    "rms_norm": ("build_rms_norm", dict(d=1024, eps=EPS)),
    "rms_norm_q": ("build_rms_norm", dict(d=512, eps=EPS)),
}
# A child-process build takes 6-15 s here: two by default (sm_90 and sm_80), the rest `slow`.
CUDA_DEFAULT = [("rms_norm", "cuda-sm90"), ("rms_norm_q", "cuda-sm80")]
CUDA_SLOW = [(k, a) for k in BUILDERS for a in ("cuda-sm80", "cuda-sm90", "cuda-sm100")
             if (k, a) not in CUDA_DEFAULT]


def _cuda_build(tmp_path, kernel, target):
    name, dims = BUILDERS[kernel]
    cuda_build(tmp_path, "norm", name, dims, target)


@pytest.mark.parametrize("kernel,target", CUDA_DEFAULT)
def test_cuda_builds_have_device_code(tmp_path, kernel, target):
    _cuda_build(tmp_path, kernel, target)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,target", CUDA_SLOW)
def test_cuda_builds_other_archs(tmp_path, kernel, target):
    _cuda_build(tmp_path, kernel, target)


@pytest.mark.gpu
def test_gpu_numerics():
    """On the GPU: rms_norm within one bf16 ulp (warp-tree sum order and the approximate
    rsqrtf; >= 99% exact)."""
    name = gpu_target()
    target, dev = get_target(name), tvm.cuda()

    def run(func, ins, outs):
        with target.tvm_target():
            ex = tvm.compile(func, target=target.tvm_target())
        douts = [to_device(t, dev) for t in outs]
        ex(*[to_device(t, dev) for t in ins], *douts)
        return [from_device(o) for o in douts]

    x, w = N.example_inputs_rms_norm(n=37, d=1024, seed=7)
    (y,) = run(N.build_rms_norm(name, d=1024, eps=EPS), [x, w], [torch.empty_like(x)])
    assert_within_one_bf16_ulp(y, rms_norm(x, w, EPS), 0.99)
