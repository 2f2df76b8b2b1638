"""Helpers shared by the kernel tests (test_kernel_norm.py, test_kernel_mhc.py, the AVX-512 BF16
FP8 kernels' test_kernel_fp8_rows.py and test_kernel_fp8_gemm_bf16.py): torch <-> TVM views,
bf16 comparisons, x86 targets by CPU model, the GPU target of this machine."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm

from dsv41.graph.targets import TargetSpec, get_target
from dsv41.runtime.backends.tensors import to_torch, to_tvm

# x86 targets by CPU model: AVX-512 BF16 + VBMI without AMX, AVX-512 alone, AMX
ZEN4 = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "znver4"})
SKX = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "skylake-avx512"})
SPR = TargetSpec("cpu", {**get_target("cpu-x86-64").target, "mcpu": "sapphirerapids"})


def tv(t: torch.Tensor):
    """A zero-copy TVM view of a (contiguous) torch tensor (`runtime.tensors.to_tvm`)."""
    return to_tvm(t)


def bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 as its int16 bits (so -0.0 != 0.0 and NaNs compare); other dtypes unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def run_fp8_linear(ex, x, weight, scale, dtype=torch.bfloat16) -> torch.Tensor:
    """y = ex(x, weight, scale) for a compiled `fp8_linear` kernel, y [m, n] of `dtype`."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=dtype)
    view = to_tvm(out)
    ex(*[to_tvm(t) for t in (x, weight, scale)], view)
    return to_torch(view)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors (on their ordered bits)."""
    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_within_one_bf16_ulp(got: torch.Tensor, ref: torch.Tensor, min_exact: float) -> None:
    """Every element within one bf16 ulp of ref (at ref's binade), and at least `min_exact` of
    them bit-identical."""
    g, r = got.float(), ref.float()
    assert torch.isfinite(g).all(), "kernel produced non-finite values"
    _, exp = torch.frexp(r)
    ulp = torch.ldexp(torch.ones_like(r), exp - 8)
    over = (g - r).abs() > ulp
    assert not over.any(), (f"{int(over.sum())} elements differ by more than one bf16 ulp; "
                            f"max abs diff {(g - r).abs().max().item():.3g}")
    if got.numel():
        exact = (bits(got) == bits(ref)).float().mean().item()
        assert exact >= min_exact, f"only {exact:.5f} of elements are bit-identical"


def to_device(t: torch.Tensor, dev):
    """A torch tensor on a TVM device (a copy onto a GPU: `runtime.tensors.to_tvm`)."""
    return to_tvm(t, dev)


def from_device(a) -> torch.Tensor:
    arr = np.asarray(a.numpy())
    if arr.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def gpu_target() -> str:
    """Our target name for this machine's GPU; skips the test where there is none."""
    if not tvm.cuda().exist:
        pytest.skip("no CUDA GPU on this machine")
    major = tvm.cuda().compute_version.split(".")[0]
    arch = {"8": "cuda-sm80", "9": "cuda-sm90", "10": "cuda-sm100"}.get(major)
    if arch is None:
        pytest.skip(f"no target for compute capability {tvm.cuda().compute_version}")
    return arch


def cuda_build(tmp_path, module: str, builder: str, dims: dict, target: str) -> None:
    """Build `dsv41.schedules.<module>:<builder>(target, **dims)` into SASS + PTX and check
    the library holds device code for the target's arch (skips without nvcc)."""
    from dsv41.schedules.cuda_build import build_cuda, has_device_code, toolchain_problem

    if toolchain_problem():
        pytest.skip(f"cannot build CUDA here: {toolchain_problem()}")
    out = tmp_path / f"{builder}_{target}.so"
    build_cuda(f"dsv41.schedules.{module}:{builder}", dict(target_name=target, **dims), target,
               out)
    arch = "sm_" + target.removeprefix("cuda-sm")
    assert has_device_code(out, arch), f"{builder} for {target} holds no {arch} code"


# ---- the graph's fused ops through the CPU kernels the compiled entries run -------------------


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (torch's allocator aligns fresh tensors to 64 bytes, which TVM needs;
    views into a larger tensor may not be)."""
    return t.contiguous().clone()


@functools.cache
def _mhc_pre_mix_kernel(hc: int, d: int, iters: int, norm_eps: float, hc_eps: float):
    from dsv41.graph.targets import get_target
    from dsv41.schedules import mhc

    func = mhc.build_hc_pre_mix("cpu", hc=hc, d=d, iters=iters, norm_eps=norm_eps,
                                hc_eps=hc_eps, with_norm=True)
    return tvm.compile(func, target=get_target("cpu").tvm_target())


@functools.cache
def _mhc_post_kernel(hc: int, d: int):
    from dsv41.graph.targets import get_target
    from dsv41.schedules import mhc

    return tvm.compile(mhc.build_hc_post("cpu", hc=hc, d=d),
                       target=get_target("cpu").tvm_target())


@functools.cache
def _rms_norm_kernel(d: int, eps: float):
    from dsv41.graph.targets import get_target
    from dsv41.schedules import norm

    return tvm.compile(norm.build_rms_norm("cpu", d=d, eps=eps),
                       target=get_target("cpu").tvm_target())


def kernel_hc_pre_mix(h, fn, scale, base, pre_in, weight, hc, iters, norm_eps, hc_eps):
    """`dsv41::hc_pre_mix` computed by schedules/mhc.py's CPU kernel (the compiled lowering)."""
    b, s, _, d = h.shape
    outs = (torch.empty(b, s, d, dtype=torch.bfloat16), torch.empty(b, s, hc),
            torch.empty(b, s, hc), torch.empty(b, s, hc, hc))
    ins = [tv(_aligned(t)) for t in (h, fn, scale, base, pre_in, weight)]
    _mhc_pre_mix_kernel(hc, d, iters, norm_eps, hc_eps)(*ins, *[tv(t) for t in outs])
    return outs


def kernel_hc_post(f, h, post, comb):
    """`dsv41::hc_post` computed by schedules/mhc.py's CPU kernel."""
    out = torch.empty_like(h)
    ins = [tv(_aligned(t)) for t in (f, h, post, comb)]
    _mhc_post_kernel(h.shape[2], h.shape[3])(*ins, tv(out))
    return out


def kernel_rms_norm(x, weight, eps):
    """`dsv41::rms_norm` computed by schedules/norm.py's CPU kernel, over rows of x."""
    d = x.shape[-1]
    rows = _aligned(x).reshape(-1, d)
    out = torch.empty_like(rows)
    _rms_norm_kernel(d, float(eps))(tv(rows), tv(_aligned(weight)), tv(out))
    return out.reshape(x.shape)


@functools.cache
def swiglu_relax(limit: float, k: int):
    """The lowering's SwiGLU where the fp8 kernel cannot form it (`fused_ops.swiglu_values`,
    then `round_to_bf16`): bf16 gate, up [m, k] -> bf16 h, compiled for the host (a VM)."""
    from types import SimpleNamespace

    from tvm import relax

    from dsv41.compiler.fused_ops import swiglu_values
    from dsv41.compiler.relax_ops import in_fp32, round_to_bf16

    bb = relax.BlockBuilder()
    ty = relax.TensorType([tvm.tirx.Var("m", "int64"), k], "bfloat16")
    g, u = relax.Var("g", ty), relax.Var("u", ty)
    imp = SimpleNamespace(block_builder=bb)
    with bb.function("main", [g, u]):
        with bb.dataflow():
            h = round_to_bf16(imp, swiglu_values(imp, in_fp32(imp, g), in_fp32(imp, u), limit))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=get_target("cpu").tvm_target()),
                                tvm.cpu())


def patch_fused_ops(monkeypatch) -> None:
    """Make the graph compute `dsv41::hc_pre_mix`, `hc_post` and `rms_norm` with the CPU kernels
    the compiled entries lower them to. The model calls them through `dsv41.graph.ops`, so a graph
    engine run under this patch has the artifact's numerics for these ops; the compiled engine can
    then be compared with it op for op, not through the model's amplification of fp32 rounding."""
    from dsv41.graph import ops

    monkeypatch.setattr(ops, "hc_pre_mix", kernel_hc_pre_mix)
    monkeypatch.setattr(ops, "hc_post", kernel_hc_post)
    monkeypatch.setattr(ops, "rms_norm", kernel_rms_norm)
