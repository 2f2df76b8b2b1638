"""The GPU path stays buildable: shared-small's `decode` compiled for `cuda-sm90` (real SASS,
built without a GPU) in the default suite, cached like the CPU test artifact (conftest's
`cached_artifact`: keyed by the code, the config, the entries, the target and TVM), so a fusion
or schedule that breaks the CUDA lowering fails here rather than on the day a GPU is lent.

The first build of a key takes about 100 s of CPU (about 15 s capture, the rest TVM's CUDA
codegen and ptxas); every later run of the same code reuses it."""

from __future__ import annotations

import pytest
import torch
from conftest import cached_artifact

from dsv41.graph.config import load_config
from dsv41.runtime.backends.artifact import Artifact, ArtifactError, verify

TARGET = "cuda-sm90"


@pytest.fixture(scope="session")
def cuda_decode(small_case):
    args = load_config(small_case.checkpoint)
    return args, cached_artifact(args, "shared-small", ("decode",), target=TARGET)


def test_shared_small_decode_builds_for_cuda_sm90(cuda_decode):
    args, path = cuda_decode
    m = verify(path, args=args, check_device=False)  # checksums, config, TVM version
    assert m.target.name == TARGET and list(m.entries) == ["decode"]
    assert dict(m.target.tvm)["arch"] == "sm_90"
    assert m.entries["decode"].outputs[0] == "logits"
    lib = (path / "decode.so").read_bytes()
    assert b"-arch sm_90" in lib  # device code for the H100 was assembled (ptxas) into it


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the artifact runs here")
def test_cuda_artifact_is_refused_without_a_gpu(cuda_decode):
    args, path = cuda_decode
    with pytest.raises(ArtifactError, match=TARGET):
        Artifact.load(path, args=args)


def test_fp8_wo_a_decode_builds_for_cuda_sm90(small_case):
    """The grouped o-projection over the hub's FP8 `wo_a` (`wo_a_dtype` "fp8") on CUDA: the
    weight dequantized by the fp8_dequant kernel, then the generic einsum; it builds to SASS."""
    args = load_config(small_case.checkpoint).replace(wo_a_dtype="fp8")
    path = cached_artifact(args, "shared-small-fp8-wo-a", ("decode",), target=TARGET)
    m = verify(path, args=args, check_device=False)
    assert m.target.name == TARGET and list(m.entries) == ["decode"]
    names = {p.param for p in m.entries["decode"].params}
    assert "layers__0__attn__wo_a__scale" in names, sorted(names)[:8]
    assert b"-arch sm_90" in (path / "decode.so").read_bytes()
