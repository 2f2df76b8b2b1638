"""The runtime without the compiler: the CPU engine runtime-only (TVM_USE_RUNTIME_LIB=1) in a
subprocess, bit for bit the in-process engine; `dsv41 bundle` (fits in 64 MiB, runs isolated
from the installed packages, a clean venv in the slow test); `dsv41 selftest`'s refusal on a
host without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv41.compiler.tools.bundle import DEFAULT_MAX_BYTES, BundleOptions, write_bundle

IDS = [int(x) for x in np.random.default_rng(5).integers(3, 500, 29)]

RUNTIME_ONLY = r"""
import json, sys
import numpy as np
from dsv41.runtime.engine import Engine
from dsv41.runtime.backends.device import compiler_available
art, ckpt, ids, out = sys.argv[1:5]
e = Engine.load(art, ckpt, device="cpu", page_tokens=8)
s = e.session()
toks = list(s.send(json.loads(ids), max_new_tokens=3, keep_logits=True))
np.savez(out, logits=np.stack(s.turns[-1].logits), tokens=np.array(toks))
import tvm
print(json.dumps({"compiler": compiler_available(), "libs": sorted(tvm.base._LOADED_LIBS)}))
"""


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVM_USE_RUNTIME_LIB")}
    return {**env, **extra}


def test_cpu_engine_runs_runtime_only_bit_for_bit(small_artifact, small_case, tmp_path):
    from dsv41.runtime.engine import Engine

    art, ckpt = str(small_artifact), str(small_case.checkpoint)
    out = tmp_path / "turn.npz"
    res = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, art, ckpt, json.dumps(IDS),
                          str(out)], capture_output=True, text=True, timeout=900,
                         env=_clean_env(TVM_USE_RUNTIME_LIB="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["compiler"] is False and "tvm_compiler" not in info["libs"], info
    s = Engine.load(art, ckpt, device="cpu", page_tokens=8).session()
    toks = list(s.send(IDS, max_new_tokens=3, keep_logits=True))
    got = np.load(out)
    assert got["tokens"].tolist() == toks
    np.testing.assert_array_equal(got["logits"], np.stack(s.turns[-1].logits))


@pytest.fixture(scope="module")
def small_bundle(small_artifact, small_case, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle") / "small"
    report = write_bundle(BundleOptions(artifacts=(small_artifact,), out=out,
                                        case=small_case.root))
    return report


def test_small_bundle_fits_and_lists_its_files(small_bundle):
    out = small_bundle.out
    assert small_bundle.total_bytes <= DEFAULT_MAX_BYTES
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and
               p.name != "bundle.json")
    assert size == small_bundle.total_bytes
    manifest = json.loads((out / "bundle.json").read_text())
    assert set(manifest["files"]) == {str(p.relative_to(out)) for p in out.rglob("*")
                                      if p.is_file() and p.name != "bundle.json"}
    libs = {p.name for p in (out / "lib" / "tvm" / "lib").iterdir()}
    assert {"libtvm_runtime.so", "libtvm_runtime_extra.so", "libtvm_runtime_cuda.so"} <= libs
    assert "libtvm_compiler.so" not in libs
    assert not list(out.rglob("libtvm_compiler*"))
    (art,) = manifest["artifacts"].values()
    assert art["target"] == "cpu" and "decode" in art["entries"]


def _run_bundle(python: str, bundle: Path, tmp_path: Path) -> dict:
    out = tmp_path / "selftest.json"
    res = subprocess.run([python, str(bundle / "gpu_check.py"), "--target", "cpu", "--json",
                          str(out)], capture_output=True, text=True, timeout=1200,
                         cwd=tmp_path, env=_clean_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "conformance  pass" in res.stdout and "PASSED" in res.stdout, res.stdout
    return json.loads(out.read_text())["selftest"]


def test_small_bundle_runs_its_own_copies_runtime_only(small_bundle, tmp_path):
    """The bundle's gpu_check.py on the CPU: shared-small within its bounds and its host Engram
    prefetch bit-equal to none, from the bundle's own dsv41 and TVM (not the installed ones),
    without TVM's compiler."""
    report = _run_bundle(sys.executable, small_bundle.out, tmp_path)
    env = report["environment"]
    root = str(small_bundle.out.resolve())
    assert env["tvm"].startswith(root) and env["dsv41_runtime"].startswith(root), env
    assert env["tvm_compiler_loaded"] is False
    assert [c["name"] for c in report["checks"]] == ["conformance", "engram", "kernels", "decode"]
    assert [c["status"] for c in report["checks"]] == ["pass", "pass", "skip", "skip"]


@pytest.mark.slow
def test_small_bundle_runs_in_a_clean_venv(small_bundle, tmp_path):
    """A fresh venv with only torch and numpy (pip's configured wheel source, no index needed
    when the wheels are local) runs the bundle."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    res = subprocess.run([py, "-m", "pip", "install", "-q", f"torch=={torch.__version__}",
                          "numpy"], capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        pytest.skip(f"torch {torch.__version__} does not install here: {res.stderr[-500:]}")
    report = _run_bundle(py, small_bundle.out, tmp_path)
    assert report["environment"]["tvm_compiler_loaded"] is False


def test_bundle_refusals_leave_nothing(small_artifact, tmp_path):
    out = tmp_path / "b"
    with pytest.raises(ValueError, match=r"above the 1 MiB allowed"):
        write_bundle(BundleOptions(artifacts=(small_artifact,), out=out, max_bytes=1 << 20))
    assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(ValueError, match="exists and is not empty"):
        write_bundle(BundleOptions(artifacts=(small_artifact,), out=out))
    with pytest.raises(ValueError, match="at least one artifact"):
        write_bundle(BundleOptions(artifacts=(), out=tmp_path / "c"))
    with pytest.raises(ValueError, match="not a conformance case"):
        write_bundle(BundleOptions(artifacts=(small_artifact,), out=tmp_path / "d",
                                   case=tmp_path))


def test_selftest_refuses_without_a_gpu(tmp_path, capsys):
    from dsv41.compiler.tools.selftest import REFUSED, main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "st.json"
    assert main(["--target", "cuda-sm90", "--json", str(out)]) == REFUSED
    printed = capsys.readouterr().out
    assert "selftest cuda-sm90: REFUSED (no GPU: cuda-sm90 runs on a CUDA GPU, and this " \
           "machine has no CUDA GPU" in printed
    report = json.loads(out.read_text())["selftest"]
    assert report["refused"].startswith("no GPU:") and report["checks"] == []
    assert report["passed"] is False


def test_bundle_command_refuses_before_compiling(tmp_path, capsys):
    from dsv41.compiler.tools.cli.main import main

    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    case = "../shared/conformance/shared-small"
    assert main(["bundle", "--gpu-check", "cuda-sm90", "--case", case, "--out", str(full),
                 "--artifacts-out", str(tmp_path / "arts")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert not (tmp_path / "arts").exists()  # nothing compiled
    assert main(["bundle", "--gpu-check", "cuda-sm90", "--out", str(tmp_path / "o")]) == 2
    assert "--gpu-check needs --case" in capsys.readouterr().err
    assert main(["bundle", "--out", str(tmp_path / "o")]) == 2
    assert "at least one artifact" in capsys.readouterr().err


def test_gpu_check_artifacts_compile_what_is_missing_with_a_progress_log(tmp_path,
                                                                        monkeypatch):
    """`check_artifacts` compiles the entries the check's two artifacts lack, reporting through
    a CompileProgress (a bare callable once crashed it at the first phase)."""
    from dsv41.compiler import build
    from dsv41.compiler.progress import CompileProgress
    from dsv41.compiler.tools import bundle

    calls = []

    def compile_artifact(opts, progress=None):
        assert isinstance(progress, CompileProgress)
        progress.started("decode", "capture")
        progress.finished("decode", "capture", 1.25)
        progress.note("built")
        calls.append((opts.model_name, opts.target, opts.entries))

    monkeypatch.setattr(build, "compile_artifact", compile_artifact)
    lines = []
    small, bench = bundle.check_artifacts("cuda-sm90",
                                          Path("../shared/conformance/shared-small"),
                                          tmp_path, say=lines.append)
    assert calls == [("shared-small", "cuda-sm90", bundle.SMALL_ENTRIES),
                     ("bench", "cuda-sm90", bundle.BENCH_ENTRIES)]
    assert small.parent.parent == bench.parent.parent == tmp_path
    assert "  decode: capture 1.2 s" in lines and "  built" in lines


def test_selftest_decode_check_on_the_cpu(small_artifact, small_case, tmp_path):
    """The decode check's whole path on the CPU (shared-small's checkpoint and artifact, short
    contexts): one row per context with its ms per token and bytes; no HBM fraction without a
    GPU."""
    from dsv41.compiler.tools.selftest import SelftestOptions, Status, check_decode
    from dsv41.runtime.backends.device import Device, DeviceKind

    opts = SelftestOptions(target="cpu", artifacts=(small_artifact,),
                           bench_checkpoint=small_case.checkpoint, contexts=(32, 64), reps=2)
    check = check_decode(opts, Device(DeviceKind.CPU), deadline=float("inf"))
    assert check.status is Status.PASS, check.summary
    rows = check.data["rows"]
    assert [r["context"] for r in rows] == [32, 64]
    assert all(r["ms_per_token"] > 0 and r["bytes"] > 0 and r["hbm_fraction"] is None
               for r in rows)
    assert check.data["checkpoint_written_s"] is None


def test_selftest_engram_check_on_the_cpu(small_artifact, small_case):
    """The Engram check's whole path on the CPU: shared-small's artifact with its tables in
    host memory, prefetch on and off bit-equal, the gathers timed and counted."""
    from dsv41.compiler.tools.selftest import SelftestOptions, Status, check_engram
    from dsv41.runtime.backends.device import Device, DeviceKind

    opts = SelftestOptions(target="cpu", artifacts=(small_artifact,),
                           case=small_case.root)
    check = check_engram(opts, Device(DeviceKind.CPU), prompt=20, steps=2)
    assert check.status is Status.PASS, check.summary
    on, off = check.data["prefetch_on"], check.data["prefetch_off"]
    assert check.data["identical"] and on["calls"] == off["calls"] == 3
    assert on["rows"] == off["rows"] > 0 and on["gather_ms"] > 0
    assert off["hidden_ms"] == 0.0  # gathered inside the entry: nothing hidden
