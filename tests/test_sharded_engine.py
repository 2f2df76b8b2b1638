"""`Engine.load` on a sharded artifact refuses, before any worker starts or any weight is read,
what cannot run: another worker count than the caller's, a plan that is not its config's, a
device other than the CPU workers, missing entries, another model's checkpoint. The artifacts
here are manifests over stand-in libraries (checksummed like real ones); none is run, so pytest's
process (tvm imported without disco) never needs a disco session: reaching one would raise
DiscoUnavailable, not the ArtifactError each test expects. The engine over a real 2-worker
artifact is tests/test_sharded_compiled.py (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import case_dir

from dsv41.graph.config import load_config
from dsv41.graph.conformance import load_case
from dsv41.graph.sharding import shard_plan, shard_plan_json
from dsv41.runtime.backends.artifact import ArtifactError, manifest_digest, sha256_file
from dsv41.runtime.backends.sharded import SHARDED_FORMAT, is_sharded, read_sharded
from dsv41.runtime.engine import Engine

SHARDS = 2


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return load_case(case_dir("shared-small")).checkpoint


def write_manifest(d: Path, m: dict) -> None:
    m = {k: v for k, v in m.items() if k != "manifest_sha256"}
    m["manifest_sha256"] = manifest_digest(m)
    (d / "manifest.json").write_text(json.dumps(m))


def stand_in(d: Path, checkpoint: Path, *, entries=("prefill_all", "decode"),
             shards: int = SHARDS) -> Path:
    """A sharded artifact's folder as `compile_sharded` writes it, its libraries stand-ins."""
    import tvm

    args = load_config(checkpoint)
    d.mkdir()
    for e in entries:
        (d / f"{e}.so").write_bytes(f"stand-in {e}".encode())
    write_manifest(d, {
        "format": SHARDED_FORMAT, "model": "shared-small", "config": args.to_dict(),
        "config_hash": args.config_hash(), "target": {"name": "cpu", "tvm": "llvm"},
        "versions": {"tvm": tvm.__version__}, "shards": shards, "ccl": "cpu-test",
        "plan": shard_plan_json(shard_plan(args, shards), context=args.max_seq_len),
        "entries": {e: {"inputs": [], "params": [], "cache": [], "outputs": ["logits"]}
                    for e in entries},
        "files": {f"{e}.so": sha256_file(d / f"{e}.so") for e in entries}})
    return d


def test_the_stand_in_is_a_valid_sharded_artifact(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint)
    assert is_sharded(d)
    spec = read_sharded(d, shards=SHARDS, device="cpu")
    assert (spec.shards, spec.entries) == (SHARDS, ("prefill_all", "decode"))


def test_an_amx_build_asks_for_amx_before_its_workers_start(tmp_path, checkpoint, monkeypatch):
    """The disco workers are threads of this process, and the first tile instruction of a
    process without AMX permission is a SIGILL: reading a sharded artifact built with AMX asks
    for it (`check_cpu_features`), and refuses where it is not granted."""
    import dsv41.runtime.backends.artifact as artifact_module

    d = stand_in(tmp_path / "art", checkpoint)
    m = json.loads((d / "manifest.json").read_text())
    m["target"] = {"name": "cpu", "tvm": {"kind": "llvm", "mattr": ["+amx-tile", "+amx-bf16"]}}
    write_manifest(d, m)
    asked = []
    monkeypatch.setattr(artifact_module, "request_amx", lambda: asked.append(1) or False)
    with pytest.raises(ArtifactError, match="compiled with AMX kernels"):
        read_sharded(d, shards=SHARDS)
    monkeypatch.setattr(artifact_module, "request_amx", lambda: asked.append(1) or True)
    assert read_sharded(d, shards=SHARDS).shards == SHARDS
    assert len(asked) == 2


def test_another_worker_count_is_refused(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint)
    with pytest.raises(ArtifactError, match="compiled for 2 workers; 4 were asked for"):
        Engine.load(d, checkpoint, exact=True, shards=4)


def test_a_one_worker_artifact_is_refused_for_two_workers(tmp_path, checkpoint):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "manifest.json").write_text(json.dumps({"format": "dsv41-artifact"}))
    with pytest.raises(ArtifactError, match="is a one-worker artifact; 2 workers"):
        Engine.load(tmp_path / "one", checkpoint, shards=2)


def test_a_plan_that_is_not_the_configs_is_refused(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint)
    m = json.loads((d / "manifest.json").read_text())
    m["plan"]["workers"][1]["weight_bytes"] += 1  # another planner's split
    write_manifest(d, m)
    with pytest.raises(ArtifactError, match="sharding plan in its manifest is not the plan"):
        Engine.load(d, checkpoint, exact=True)


def test_a_gpu_device_is_refused(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint)
    with pytest.raises(ArtifactError, match="run on CPU disco workers so far"):
        Engine.load(d, checkpoint, exact=True, device="cuda:0")


def test_missing_entries_are_refused_before_the_workers_start(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint, entries=("prefill_all",))
    with pytest.raises(ArtifactError, match="lacks the entries decode"):
        Engine.load(d, checkpoint, exact=True)


def test_another_models_checkpoint_is_refused(tmp_path, checkpoint):
    d = stand_in(tmp_path / "art", checkpoint)
    other = load_case(case_dir("shared-v41-small")).checkpoint
    with pytest.raises(ArtifactError, match="has another config than artifact"):
        Engine.load(d, other, exact=True)


def test_a_process_that_imported_tvm_without_disco_is_told_so(tmp_path, checkpoint):
    """Everything checks out, then the workers cannot start here: pytest's process imported tvm
    before `load_disco()` (a real run calls it first, as tests/sharded_engine.py does)."""
    import tvm

    from dsv41.runtime.backends.disco import DiscoUnavailable

    assert tvm.runtime.disco is None  # the precondition: this process has no disco
    d = stand_in(tmp_path / "art", checkpoint)
    with pytest.raises(DiscoUnavailable,
                       match=r"call\s+dsv41.runtime.backends.disco.load_disco\(\) before"):
        Engine.load(d, checkpoint, exact=True)


def test_cli_loads_disco_first_for_a_sharded_artifact(tmp_path):
    """`dsv41 run / serve --artifact DIR` on a sharded artifact: the CLI loads disco's runtime
    libraries before anything imports tvm (else the engine would refuse with DiscoUnavailable);
    a one-worker artifact, a missing folder or a broken manifest leave the process alone."""
    import subprocess
    import sys

    sharded, plain, broken = (tmp_path / n for n in ("sharded", "plain", "broken"))
    for d, text in ((sharded, json.dumps({"format": SHARDED_FORMAT})),
                    (plain, json.dumps({"format": 2})), (broken, "{not json")):
        d.mkdir()
        (d / "manifest.json").write_text(text)
    script = (
        "import argparse, sys\n"
        "from dsv41.compiler.tools.cli.main import load_disco_first\n"
        "for d in sys.argv[1:]:\n"
        "    print(load_disco_first(argparse.Namespace(artifact=d)))\n"
        "import tvm\n"
        "print(tvm.runtime.disco is not None)\n")
    for dirs, want in (([str(sharded)], ["True", "True"]),
                       ([str(plain), str(broken), str(tmp_path / "none")],
                        ["False", "False", "False", "False"])):
        out = subprocess.run([sys.executable, "-c", script, *dirs], capture_output=True,
                             text=True, check=True, timeout=120)
        assert out.stdout.split() == want, out.stderr
