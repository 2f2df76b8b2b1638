"""The device-generic runtime: `Device` parsing, the refusals of a device that cannot run an
artifact (a CUDA artifact without a GPU, another arch, a CPU artifact on a GPU), and the CPU
engine constructed with an explicit device, bit for bit the engine over the graph's own loading
of the same weights. The engine and refusal tests over the compiled artifact use the suite's
shared-small artifact (conftest)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dsv41.runtime.backends.artifact import Artifact, ArtifactError, manifest_digest
from dsv41.runtime.backends.device import (
    Device,
    DeviceError,
    DeviceKind,
    check_cuda,
    device_for_target,
)

TURNS = [[int(x) for x in np.random.default_rng(i).integers(3, 500, n)]
         for i, n in ((1, 37), (2, 5))]


@pytest.mark.parametrize(("text", "want"), [("cpu", Device(DeviceKind.CPU)),
                                            ("cuda", Device(DeviceKind.CUDA, 0)),
                                            ("cuda:3", Device(DeviceKind.CUDA, 3))])
def test_device_parse(text, want):
    assert Device.parse(text) == want
    assert str(Device.parse(str(want))) == str(want)
    assert Device.parse(want) is want


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cpu:1", "", "cuda:-1"])
def test_unknown_devices_are_refused(text):
    with pytest.raises(DeviceError, match="Unknown device"):
        Device.parse(text)


def test_the_target_kind_is_the_default_device_and_must_match():
    assert device_for_target("cpu") == Device(DeviceKind.CPU)
    assert device_for_target("cpu-x86-64", "cpu") == Device(DeviceKind.CPU)
    with pytest.raises(DeviceError, match="built for cpu runs on the CPU, not on cuda:0"):
        device_for_target("cpu", "cuda:0")
    with pytest.raises(DeviceError, match="built for cuda-sm90 runs on a CUDA GPU, not on cpu"):
        device_for_target("cuda-sm90", "cpu")
    with pytest.raises(ValueError, match="Unknown target"):
        device_for_target("tpu-v9")


def test_a_cuda_target_without_a_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(DeviceError, match="cuda-sm90 runs on a CUDA GPU, and this machine has "
                                          "no CUDA GPU"):
        device_for_target("cuda-sm90")


def test_a_gpu_of_another_arch_is_refused(monkeypatch):
    """The arch check on a (simulated) sm_80 GPU: an sm_90 artifact names both archs and the
    compile command for this GPU; a device index past the GPUs is refused too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100")
    with pytest.raises(DeviceError, match=r"built for cuda-sm90 \(sm_90\), and cuda:0 is NVIDIA "
                                          r"A100 \(sm_80\).*--target cuda-sm80"):
        check_cuda(Device(DeviceKind.CUDA, 0), "sm_90", "cuda-sm90")
    with pytest.raises(DeviceError, match="cuda:1 does not exist"):
        check_cuda(Device(DeviceKind.CUDA, 1), "sm_80", "cuda-sm80")


def _retargeted(src, dst, target: str):
    """A copy of an artifact whose manifest names another target (digest recomputed): what the
    loader sees of an artifact built for it, without building one."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["target"] = {**m["target"], "name": target}
    m["manifest_sha256"] = manifest_digest(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_artifact_load_refuses_the_wrong_device(small_artifact, tmp_path):
    with pytest.raises(ArtifactError, match="runs on the CPU, not on cuda:0"):
        Artifact.load(small_artifact, device="cuda:0")
    assert Artifact.load(small_artifact, device="cpu").device == Device(DeviceKind.CPU)
    if torch.cuda.is_available():
        return
    cuda = _retargeted(small_artifact, tmp_path / "cuda", "cuda-sm90")
    with pytest.raises(ArtifactError, match="this machine has no CUDA GPU"):
        Artifact.load(cuda)


def test_weights_on_another_device_are_refused_at_bind(small_artifact, small_model):
    art = Artifact.load(small_artifact)
    art.device = Device(DeviceKind.CUDA, 0)  # as if it ran on a GPU
    with pytest.raises(ArtifactError, match="is on cpu, the artifact runs on cuda:0"):
        art.bind(small_model)


def test_cpu_engine_on_an_explicit_device_matches_the_graph_loaded_weights(small_artifact,
                                                                           small_case):
    """Engine.load(device="cpu") (weights loaded by `Model.from_checkpoint` onto the device:
    views and in-place reads) gives bit for bit the logits and tokens of the same artifact over
    the weights as loaded before devices (`load_checkpoint` views, experts `torch.stack`ed)."""
    from dsv41.graph.checkpoint import load_checkpoint, weights_fingerprint
    from dsv41.graph.model import Model
    from dsv41.runtime.backends.compiled import CompiledPhases
    from dsv41.runtime.engine import Engine

    art, ckpt = str(small_artifact), small_case.checkpoint
    on_device = Engine.load(art, ckpt, device="cpu", page_tokens=8)
    assert on_device.model.device == torch.device("cpu")
    a = Artifact.load(art)
    stacked = Model.from_weights(a.args, load_checkpoint(ckpt, a.args),
                                 on_device.model.engram.token_map)
    before = Engine(stacked, CompiledPhases(a, stacked), weights_hash=weights_fingerprint(ckpt),
                    options=on_device.options, backend="before", backend_id="before")
    runs = []
    for engine in (on_device, before):
        s = engine.session()
        for ids in TURNS:
            list(s.send(ids, max_new_tokens=3, keep_logits=True))
        runs.append((s.transcript, [np.stack(t.logits) for t in s.turns]))
    (tokens, logits), (tokens0, logits0) = runs
    assert tokens == tokens0
    for x, y in zip(logits, logits0, strict=True):
        np.testing.assert_array_equal(x, y)


def test_an_amx_artifact_is_refused_where_amx_is_not_granted(small_artifact, tmp_path,
                                                              monkeypatch):
    """An artifact whose target names AMX loads only where the process gets AMX permission
    (asked for at load); elsewhere its first tile instruction would kill the process."""
    import dsv41.runtime.backends.artifact as artifact_module

    dst = tmp_path / "amx"
    shutil.copytree(small_artifact, dst)
    m = json.loads((dst / "manifest.json").read_text())
    tvm_target = dict(m["target"]["tvm"])
    tvm_target["mattr"] = sorted({*tvm_target.get("mattr", []), "+amx-tile", "+amx-bf16"})
    m["target"] = {**m["target"], "tvm": tvm_target}
    m["manifest_sha256"] = manifest_digest(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    asked = []
    monkeypatch.setattr(artifact_module, "request_amx", lambda: asked.append(1) or False)
    with pytest.raises(ArtifactError, match="compiled with AMX kernels"):
        Artifact.load(dst)
    monkeypatch.setattr(artifact_module, "request_amx", lambda: asked.append(1) or True)
    assert Artifact.load(dst).device == Device(DeviceKind.CPU)
    assert len(asked) == 2


def test_an_artifact_for_vector_features_this_cpu_lacks_is_refused(small_artifact, tmp_path,
                                                                    monkeypatch):
    """An artifact whose target uses AVX-512 (a `cpu` artifact of an AVX-512 machine, copied to
    an AVX2 one) is refused at load, naming what is missing and the portable targets; one for
    `cpu-avx2` loads on a CPU with AVX2, FMA, F16C and BMI2 and is refused without them; an
    artifact asking for nothing this CPU lacks loads."""
    import dsv41.graph.targets as targets
    from dsv41.graph.targets import get_target, missing_cpu_features

    avx2_cpu = frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi2"})
    monkeypatch.setattr(targets, "cpu_flags", lambda: avx2_cpu)
    zen4 = {**get_target("cpu-avx2").target, "mcpu": "znver4"}
    assert missing_cpu_features(zen4) == sorted(
        ["avx512_bf16", "avx512_vbmi2", "avx512_vnni", "avx512bw", "avx512cd", "avx512dq",
         "avx512f", "avx512vbmi", "avx512vl"])
    assert missing_cpu_features(get_target("cpu-avx2").target) == []
    assert missing_cpu_features(get_target("cpu-x86-64").target) == []
    assert missing_cpu_features({"kind": "cuda", "arch": "sm_90"}) == []
    monkeypatch.setattr(targets, "cpu_flags", lambda: avx2_cpu - {"fma"})
    assert missing_cpu_features(get_target("cpu-avx2").target) == ["fma"]

    dst = tmp_path / "zen4"
    shutil.copytree(small_artifact, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["target"] = {**m["target"], "tvm": {**m["target"]["tvm"], "mcpu": "znver4"}}
    m["manifest_sha256"] = manifest_digest(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(targets, "cpu_flags", lambda: avx2_cpu)
    with pytest.raises(ArtifactError, match=r"avx512f.*--target cpu-avx2"):
        Artifact.load(dst)
    monkeypatch.setattr(targets, "cpu_flags", lambda: avx2_cpu | {
        "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16",
        "avx512_vnni", "avx512vbmi", "avx512_vbmi2"})
    assert Artifact.load(dst).device == Device(DeviceKind.CPU)


def test_a_runtime_without_llvm_checks_the_features_the_manifest_recorded(small_artifact,
                                                                         tmp_path, monkeypatch):
    """The compiler records the CPU features its target's code may use (`target.cpu_features`,
    read back as written); a runtime-only TVM (no LLVM targets: `target_cpu_features` None)
    refuses an artifact whose recorded features this CPU lacks, naming them, and loads it where
    the CPU has them. A manifest without the record (an older artifact) is read as before."""
    import dsv41.graph.targets as targets
    from dsv41.graph.artifact_format import ArtifactTarget, TargetName
    from dsv41.graph.targets import get_target, target_cpu_features

    avx2 = target_cpu_features(get_target("cpu-avx2").target)
    assert avx2 is not None and {"avx2", "fma", "f16c"} <= set(avx2)
    assert "avx512f" not in avx2
    assert target_cpu_features({"kind": "cuda", "arch": "sm_90"}) is None
    rec = ArtifactTarget(TargetName("cpu-avx2"), {"kind": "llvm"}, ("avx2", "fma"))
    assert ArtifactTarget.from_json(rec.to_json(), "t") == rec
    old = ArtifactTarget(TargetName("cpu-avx2"), {"kind": "llvm"})
    assert "cpu_features" not in old.to_json()
    assert ArtifactTarget.from_json(old.to_json(), "t").cpu_features is None

    dst = tmp_path / "recorded"
    shutil.copytree(small_artifact, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["target"] = {**m["target"], "cpu_features": ["avx2", "avx512_bf16", "avx512f"]}
    m["manifest_sha256"] = manifest_digest(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    monkeypatch.setattr(targets, "target_cpu_features", lambda target: None)  # runtime-only
    monkeypatch.setattr(targets, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma"}))
    with pytest.raises(ArtifactError, match=r"avx512_bf16, avx512f, which this CPU lacks"):
        Artifact.load(dst)
    monkeypatch.setattr(targets, "cpu_flags",
                        lambda: frozenset({"sse2", "avx2", "fma", "avx512f", "avx512_bf16"}))
    assert Artifact.load(dst).device == Device(DeviceKind.CPU)


def test_a_text_only_model_binds_zeros_for_the_span_entries_gate_bias_vl():
    """The span entries of a config with a vision tower take every gate's `bias_vl`; a model
    loaded from a checkpoint without the tower has none, and reads it only at image-span
    positions, which it refuses: zeros of the declared shape stand in. With the tower the
    checkpoint's tensor is bound, and any other missing weight is still an error."""
    from types import SimpleNamespace

    from dsv41.runtime.backends.artifact import TensorSpec, weight_for

    spec = TensorSpec(name="p_layers__3__ffn__gate__bias_vl", dtype="float32", shape=("16",),
                      param="layers__3__ffn__gate__bias_vl")
    bias = torch.arange(16, dtype=torch.float32)
    text_only = SimpleNamespace(vision=False, w={"layers.3.ffn.gate.bias": bias})
    got = weight_for(text_only, spec.param, spec)
    assert got.dtype == torch.float32 and got.shape == (16,) and not bool(got.any())
    with_tower = SimpleNamespace(vision=True, w={"layers.3.ffn.gate.bias": bias,
                                                 "layers.3.ffn.gate.bias_vl": bias + 1})
    assert torch.equal(weight_for(with_tower, spec.param, spec), bias + 1)
    with pytest.raises(KeyError):  # no parameter record: nothing to shape zeros after
        weight_for(text_only, "layers__3__ffn__gate__bias_vl")
    with pytest.raises(KeyError):
        weight_for(text_only, "layers__3__attn__wq_a__weight", spec)
