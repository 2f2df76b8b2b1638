"""Helpers shared by test_kernel_norm.py and test_kernel_mhc.py:
torch <-> TVM views, bf16 comparisons, the GPU target of this machine."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm


def tv(t: torch.Tensor):
    """A zero-copy TVM view of a (contiguous) torch tensor."""
    return tvm.runtime.from_dlpack(t.contiguous())


def bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 as its int16 bits (so -0.0 != 0.0 and NaNs compare); other dtypes unchanged."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


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
    """A copy of a torch tensor on a TVM device (bf16 through ml_dtypes)."""
    return tvm.runtime.tensor(tv(t).numpy(), dev)


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
