"""TIR quantisers of schedules/quant.py against the torch oracles in graph/ops.py.

Tolerance: none. Every kernel is bit-exact (codes, scale bytes, bf16 outputs) for every finite
input: the kernels use integer bit routes, exact products and threshold compares that provably
equal the oracle's fp32 division + RNE (see the module docstring of schedules/quant.py). The
inputs cover every finite bf16 bit pattern, random fp32 bit patterns (full 24-bit mantissas, fp32
subnormals, values near fp32 max), all-zero / negative-zero / tiny groups (amax floors), exact
ties at every E2M1 / E4M3 rounding boundary and one fp32 ulp either side, and Gaussians at
scales 1e-30 .. 1e30. Non-finite inputs are not matched (documented in quant.py); a test only
checks that they leave the other rows untouched.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.schedules import quant
from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

CPU = "cpu"
# op -> (oracle, input dtype, group of the scale bytes)
OPS = {
    "quant_fp8": (ops.quant_fp8, torch.float32, fmt.FP8_BLOCK),
    "quant_fp4_kv": (ops.quant_fp4_kv, torch.float32, fmt.FP4_KV_BLOCK),
    "quant_mxfp4": (ops.quant_mxfp4, torch.float32, fmt.MXFP4_BLOCK),
    "qdq_mxfp4": (ops.qdq_mxfp4, torch.bfloat16, fmt.MXFP4_BLOCK),
}


@functools.cache
def _compiled(op: str, d: int, target_name: str = CPU):
    """Compile one kernel once per session."""
    target = get_target(target_name)
    func = getattr(quant, f"build_{op}")(target_name, d=d)
    with target.tvm_target():
        return tvm.compile(func, target=target.tvm_target())


def _run(op: str, x: torch.Tensor, target_name: str = CPU) -> list[torch.Tensor]:
    """Run the kernel on x [..., d] (leading dims flattened as the compiler does); outputs as
    torch tensors with the oracle's shapes (bf16 outputs as their int16 bits)."""
    d = x.shape[-1]
    n = x.numel() // d
    dev = tvm.cuda() if target_name != CPU else tvm.cpu()
    if op == "qdq_mxfp4":
        shapes = [((n, d), ml_dtypes.bfloat16)]
    else:
        data = d if op == "quant_fp8" else d // 2
        shapes = [((n, data), np.uint8), ((n, d // OPS[op][2]), np.uint8)]
    outs = [tvm.runtime.tensor(np.zeros(s, dt), dev) for s, dt in shapes]
    _compiled(op, d, target_name)(to_tvm(x.reshape(n, d), dev), *outs)
    res = []
    for o in outs:
        arr = o.numpy()
        t = torch.from_numpy(arr.view(np.int16) if arr.dtype == ml_dtypes.bfloat16 else arr)
        res.append(t.reshape(*x.shape[:-1], t.shape[-1]))
    return res


def _oracle(op: str, x: torch.Tensor) -> list[torch.Tensor]:
    out = OPS[op][0](x)
    if op == "qdq_mxfp4":
        return [out.view(torch.int16)]
    return list(out)


def _assert_exact(op: str, x: torch.Tensor, target_name: str = CPU) -> None:
    got, want = _run(op, x, target_name), _oracle(op, x)
    for name, g, w in zip(("data", "scales"), got, want, strict=False):
        bad = (g != w).nonzero()
        assert bad.numel() == 0, (
            f"{op}: {bad.shape[0]} {name} differ, first at {bad[0].tolist()}: "
            f"got {g[tuple(bad[0])].item()}, want {w[tuple(bad[0])].item()}")


# ---- inputs ---------------------------------------------------------------------------------


def _rows(values: torch.Tensor, d: int) -> torch.Tensor:
    """Pad a flat fp32 tensor with zeros to whole rows of d."""
    pad = (-values.numel()) % d
    return torch.cat([values, torch.zeros(pad)]).reshape(-1, d)


def _every_bf16(g: torch.Generator) -> torch.Tensor:
    """Every finite bf16 value (both zeros, subnormals, max) once, shuffled."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    every = every[torch.isfinite(every)]
    return every[torch.randperm(every.numel(), generator=g)]


def _random_fp32(g: torch.Generator, count: int) -> torch.Tensor:
    """Random finite fp32 bit patterns: every exponent (subnormals, near-max) and mantissa."""
    bits = torch.randint(-(2**31), 2**31, (count,), generator=g, dtype=torch.int64)
    vals = bits.to(torch.int32).view(torch.float32)
    return vals[torch.isfinite(vals)]


def _lead_groups(g: torch.Generator, amaxes: torch.Tensor, group: int) -> torch.Tensor:
    """One group per amax value: the value itself, then values below it in magnitude (so every
    amax bit pattern reaches the scale rule and ratios spread over the whole code range)."""
    rest = amaxes[:, None] * (torch.rand(amaxes.numel(), group - 1, generator=g) * 2 - 1)
    return torch.cat([amaxes[:, None], rest], dim=1).flatten()


def _boundary_groups(op: str, g: torch.Generator, group: int) -> torch.Tensor:
    """Groups whose ratios sit exactly on every rounding boundary of the element format (and
    one fp32 ulp either side), for scales across the whole range: the scale is taken from the
    oracle for a group led by its amax."""
    if op == "quant_fp8":
        e4m3 = fmt.torch_e4m3_decode(torch.arange(0, 0x7F, dtype=torch.uint8))
        bounds = torch.cat([(e4m3[1:] + e4m3[:-1]) / 2, e4m3])
        rule = fmt.torch_quant_fp8
    else:
        bounds = torch.tensor([t for t, _ in quant.E2M1_BOUNDS]
                              + [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])
        rule = fmt.torch_quant_fp4_kv if op == "quant_fp4_kv" else fmt.torch_quant_mxfp4
    amaxes = torch.cat([2.0 ** torch.arange(-140, 128, 3.0),
                        torch.rand(40, generator=g) * 1e4, torch.tensor([3.3e38])])
    amaxes = amaxes[torch.isfinite(amaxes)]
    out = []
    for amax in amaxes:
        lead = torch.full((1, group), float(amax))
        _, byte = rule(lead)
        scale = fmt.torch_e4m3_decode(byte) if op == "quant_fp4_kv" else \
            fmt.torch_e8m0_decode(byte)
        ratios = bounds * float(scale[0, 0])  # exact: few significant bits
        vals = torch.cat([ratios, torch.nextafter(ratios, torch.full_like(ratios, np.inf)),
                          torch.nextafter(ratios, torch.zeros_like(ratios))])
        vals = vals[torch.isfinite(vals) & (vals.abs() <= amax * 1.0)]
        vals = torch.cat([vals, -vals])
        for k in range(0, vals.numel(), group - 1):  # each chunk led by amax: same scale
            chunk = vals[k:k + group - 1]
            chunk = torch.cat([amax.reshape(1), chunk, torch.zeros(group - 1 - chunk.numel())])
            out.append(chunk)
    return torch.cat(out)


@functools.cache
def _cases(op: str, d: int) -> torch.Tensor:
    """All the cases of the module docstring as rows of d (fp32; bf16-exact for qdq_mxfp4)."""
    group = OPS[op][2]
    g = torch.Generator().manual_seed(7)
    every = _every_bf16(g)
    parts = [
        every,
        _lead_groups(g, every.abs()[torch.randperm(every.numel(), generator=g)[:4096]], group),
        torch.zeros(group), torch.full((group,), -0.0),
        torch.randn(4 * group, generator=g) * 1e-40,  # fp32 subnormals
        torch.randn(4 * group, generator=g) * 1e-30,
        (torch.randn(4 * group, generator=g) * 1e38).clamp(-3.4e38, 3.4e38),
        torch.randn(64 * group, generator=g) * torch.logspace(-30, 30, 64).repeat_interleave(
            group),
    ]
    if OPS[op][1] == torch.float32:
        rnd = _random_fp32(g, 1 << 15)
        parts += [rnd, _lead_groups(g, rnd.abs()[:4096], group),
                  _boundary_groups(op, g, group)]
    else:
        parts += [_boundary_groups("quant_mxfp4", g, group)]
    x = _rows(torch.cat(parts), d)
    if OPS[op][1] == torch.bfloat16:
        x = x.to(torch.bfloat16)
    return x


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [512, 128])
@pytest.mark.parametrize("op", list(OPS))
def test_bit_exact_exhaustive(op, d):
    _assert_exact(op, _cases(op, d))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("shape", [(1, 512), (3, 512), (2, 5, 512)])
def test_bit_exact_shapes(op, shape):
    """Decode (1 row), a row count that is not a multiple of the CPU row tile, batch dims."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    _assert_exact(op, x.to(OPS[op][1]))


@pytest.mark.parametrize("op", list(OPS))
def test_example_inputs_match(op):
    (x,) = getattr(quant, f"example_inputs_{op}")(n=37, d=512, seed=3)
    assert x.dtype == OPS[op][1]
    _assert_exact(op, x)


def test_zero_rows():
    x = torch.zeros(0, 512)
    codes, scales = _run("quant_fp8", x)
    assert codes.shape == (0, 512) and scales.shape == (0, 16)


def test_ties_actually_exercised():
    """The boundary cases must contain exact E2M1 ties that round both ways (guards the test
    input itself): ratio 0.25 -> code 0 and 0.75 -> code 2."""
    x = _cases("quant_mxfp4", 128).float()
    codes = fmt.torch_unpack_fp4(fmt.torch_quant_mxfp4(x)[0])
    _, scales = fmt.torch_quant_mxfp4(x)
    ratio = x / fmt.torch_e8m0_decode(scales).repeat_interleave(32, dim=-1)
    assert bool(((ratio == 0.25) & (codes == 0)).any())
    assert bool(((ratio == 0.75) & (codes == 2)).any())
    assert bool(((ratio == 5.0) & (codes == 6)).any())


@pytest.mark.parametrize("op", list(OPS))
def test_non_finite_rows_stay_local(op):
    """Inf/NaN are not matched (see quant.py), but must not disturb other rows."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=g)
    x[1, 3], x[2, 40] = float("inf"), float("nan")
    x = x.to(OPS[op][1])
    got, want = _run(op, x), _oracle(op, x)
    for gg, w in zip(got, want, strict=True):
        assert torch.equal(gg[[0, 3]], w[[0, 3]])


@pytest.mark.parametrize("make,d", [(quant.make_quant_fp8, 48), (quant.make_quant_fp4_kv, 24),
                                    (quant.make_quant_mxfp4, 16), (quant.make_qdq_mxfp4, 0)])
def test_rejects_partial_group(make, d):
    with pytest.raises(ValueError, match="multiple"):
        make(d=d)


@T.prim_func(s_tir=True)
def _div6_kernel(x_h: T.handle, y_h: T.handle):
    n = T.int64()
    x = T.match_buffer(x_h, (n,), "float32")
    y = T.match_buffer(y_h, (n,), "float32")
    for i in range(n):
        with T.sblock("y"):
            vi = T.axis.spatial(n, i)
            y[vi] = quant.div6(x[vi])


def test_div6_exact():
    """The integer fp32(a / 6) of the FP4-KV scale against IEEE division, on every fp32
    exponent above the floor and random mantissas (plus every bf16 value)."""
    g = torch.Generator().manual_seed(11)
    a = torch.cat([_random_fp32(g, 1 << 16).abs(), _every_bf16(g).abs()])
    a = a[a >= fmt.FP4_KV_AMAX_FLOOR]

    ex = tvm.compile(_div6_kernel, target=get_target(CPU).tvm_target())
    out = tvm.runtime.tensor(np.zeros(a.numel(), np.float32))
    ex(tvm.runtime.tensor(a.numpy()), out)
    assert torch.equal(torch.from_numpy(out.numpy()).view(torch.int32),
                       (a / 6.0).view(torch.int32))


def test_schedules_are_marked():
    for op in OPS:
        for target in (CPU, "cuda-sm90"):
            func = getattr(quant, f"build_{op}")(target, d=512)
            assert func.attrs["tirx.is_scheduled"]


# ---- CUDA -----------------------------------------------------------------------------------

ALL_ARCHS = ("cuda-sm80", "cuda-sm90", "cuda-sm100")
# One child-process build is ~7 s here: each op on one arch by default (every arch covered),
# the rest of the 4 x 3 matrix under the slow marker.
CUDA_BUILDS = [("quant_fp8", "cuda-sm80"), ("quant_fp4_kv", "cuda-sm90"),
               ("quant_mxfp4", "cuda-sm100"), ("qdq_mxfp4", "cuda-sm90")]
SLOW_CUDA_BUILDS = [(op, arch) for op in OPS for arch in ALL_ARCHS
                    if (op, arch) not in CUDA_BUILDS]


def _check_cuda_build(tmp_path, op, target):
    problem = toolchain_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path / f"{op}_{target}.so"
    build_cuda(f"dsv41.schedules.quant:build_{op}", {"target_name": target, "d": 512}, target,
               out)
    arch = "sm_" + target.removeprefix("cuda-sm")
    assert has_device_code(out, arch), f"{op} for {target} holds no {arch} code"


@pytest.mark.parametrize("op,target", CUDA_BUILDS)
def test_cuda_builds_have_device_code(tmp_path, op, target):
    _check_cuda_build(tmp_path, op, target)


@pytest.mark.slow
@pytest.mark.parametrize("op,target", SLOW_CUDA_BUILDS)
def test_cuda_builds_other_archs(tmp_path, op, target):
    _check_cuda_build(tmp_path, op, target)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 128])
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_bit_exact(op, d):
    """On the GPU (nvcc fast math: flush-to-zero, approximate division) the kernels must still
    be bit-exact, fp32 subnormal inputs included."""
    if not tvm.cuda().exist:
        pytest.skip("no CUDA GPU on this machine")
    target = "cuda-sm90" if float(tvm.cuda().compute_version) >= 9.0 else "cuda-sm80"
    _assert_exact(op, _cases(op, d), target)
    _assert_exact(op, torch.randn(1, d).to(OPS[op][1]), target)
