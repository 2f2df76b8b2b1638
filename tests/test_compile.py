"""The compiled artifact: built from the captured phases, loaded with its manifest verified, and
held to the same conformance bounds as the graph (and to the graph itself).

The artifact is compiled once per session for the 6-layer shared-small case (the entries the
tests use), on the local CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ARTIFACT_ENTRIES as ENTRIES

from dsv41.compiler.build import CompileOptions
from dsv41.graph.config import load_config
from dsv41.graph.conformance import evaluate
from dsv41.graph.score import GraphBackend, score
from dsv41.runtime.backends.artifact import Artifact, ArtifactError
from dsv41.runtime.backends.compiled import CompiledPhases


@pytest.fixture(scope="session")
def compiled(small_artifact, small_model):
    return CompiledPhases(Artifact.load(small_artifact, args=small_model.args), small_model)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def test_manifest_records_what_the_issue_lists(small_artifact, small_model):
    m = json.loads((small_artifact / "manifest.json").read_text())
    assert m["config_hash"] == small_model.args.config_hash()
    assert m["target"]["name"] == "cpu" and m["versions"]["tvm"]
    assert set(m["entries"]) == set(ENTRIES)
    for entry, sig in m["entries"].items():
        assert f"{entry}.so" in m["files"] and sig["params"] and sig["outputs"]
        assert any("s" in d for i in sig["inputs"] for d in i["shape"]), "symbolic dims"
    assert "layer_plan" in m and m["tuning_database_sha256"] is None


@pytest.fixture(scope="session")
def small_scores(small_case, small_model, compiled):
    art = score(GraphBackend(small_model, phases=compiled, capacity=64), small_case.tokens,
                prefill=small_case.prefill)
    graph = score(GraphBackend(small_model, capacity=64), small_case.tokens,
                  prefill=small_case.prefill)
    return art, graph


def test_artifact_close_to_graph(small_case, small_scores):
    """The artifact against the graph, by the same metrics and bounds as against the golden."""
    from dsv41.graph.conformance import against

    art, graph = small_scores
    e = _rel(art.logits, graph.logits)
    print(f"artifact vs graph: rel L2 max {e.max():.3g} median {np.median(e):.3g}")
    assert e.max() <= small_case.bounds["rel_l2_max"]
    assert np.median(e) <= small_case.bounds["rel_l2_median"]
    rep = evaluate(against(small_case, graph), art)
    print("artifact vs graph, all metrics:", rep.metrics, rep.failures)
    assert rep.conformant, rep.failures
    assert set(rep.metrics["index_jaccard_mean"]) == set(small_case.bounds[
        "index_jaccard_mean_min"])


def test_exact_mode_conformant(small_case, small_scores):
    rep = evaluate(small_case, small_scores[0])
    print("artifact vs golden:", rep.metrics, rep.failures)
    assert rep.conformant, rep.failures


def test_ced_pair_counts_and_matches_graph(small_case, small_model, compiled):
    from dsv41.graph.cache import new_cache
    from dsv41.graph.phases import ced_prefill

    toks = torch.from_numpy(small_case.tokens)[None]
    a = small_model.args
    c1 = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
    c2 = new_cache(small_model.plan, 1, 64, engram_pad=small_model.engram.pad_id)
    got = compiled.ced_prefill(small_model, c1, toks, all_logits=True)
    ref = ced_prefill(small_model, c2, toks, all_logits=True)
    n_dec = a.n_layers - small_model.plan.decoder_start
    assert got.token_layers == ref.token_layers == \
        small_model.plan.decoder_start * toks.size(1) + n_dec * min(toks.size(1), a.window_size)
    e = _rel(got.logits[0].numpy(), ref.logits[0].numpy())
    print(f"CED artifact vs graph: rel L2 max {e.max():.3g}")
    assert e.max() <= small_case.bounds["rel_l2_max"]


def test_score_cli_in_a_fresh_process(small_case, small_artifact, tmp_path, compiled):
    toks = tmp_path / "tokens.npy"
    np.save(toks, small_case.tokens)
    out = tmp_path / "logits.npz"
    cmd = [sys.executable, "-m", "dsv41.compiler.tools.cli", "score", "--checkpoint",
           str(small_case.checkpoint), "--tokens", str(toks), "--prefill",
           str(small_case.prefill), "--backend", str(small_artifact), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh = np.load(out)["logits"]
    here = score(GraphBackend(compiled.model, phases=compiled, capacity=4096),
                 small_case.tokens, prefill=small_case.prefill).logits
    np.testing.assert_array_equal(fresh, here)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_tampered_library_refuses_to_load(small_artifact, tmp_path):
    bad = _copy(small_artifact, tmp_path / "bad")
    lib = bad / "decode.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="decode.so does not match its checksum"):
        Artifact.load(bad)


def test_missing_file_wrong_config_target_and_tvm_version(small_artifact, small_case, tmp_path):
    gone = _copy(small_artifact, tmp_path / "gone")
    (gone / "decoder.so").unlink()
    with pytest.raises(ArtifactError, match="decoder.so is missing"):
        Artifact.load(gone)
    other = load_config(small_case.checkpoint).replace(window_size=8)
    with pytest.raises(ArtifactError, match="another config"):
        Artifact.load(small_artifact, args=other)
    for key, value, message in (("target", {"name": "tpu-v9"}, "unknown target"),
                                ("versions", {"tvm": "0.1.0"}, "built with TVM 0.1.0")):
        d = _copy(small_artifact, tmp_path / key)
        m = json.loads((d / "manifest.json").read_text())
        m[key] = value
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ArtifactError, match=message):
            Artifact.load(d)
    with pytest.raises(ArtifactError, match="no manifest"):
        Artifact.load(tmp_path)


def test_ids_and_positions_are_checked_before_the_compiled_gathers(small_case, small_model,
                                                                    compiled):
    from dsv41.graph.cache import new_cache
    from dsv41.graph.entries import entry_inputs

    m = small_model
    c = new_cache(m.plan, 1, 64, engram_pad=m.engram.pad_id)
    toks = torch.from_numpy(small_case.tokens[:8])[None]
    rows = m.p(m.args.engram_layer_ids[0], "engram.embed.weight").size(0)
    bad_ids = torch.full((1, 8, len(m.args.engram_layer_ids), 6), rows, dtype=torch.int64)
    with pytest.raises(ValueError, match="Engram ids"):
        compiled._check_inputs("prefill_all", c,
                               entry_inputs(m, c, "prefill_all", toks, hash_ids=bad_ids))
    with pytest.raises(ValueError, match="capacity"):
        compiled._check_inputs("prefill_all", c, entry_inputs(
            m, c, "prefill_all", toks, start=torch.tensor([60]), hash_ids=bad_ids * 0))
    with pytest.raises(ValueError):
        compiled.prefill_exact(m, c, torch.tensor([[m.args.vocab_size]]))


def test_onnx_export_has_the_custom_ops_in_their_domain(small_case, tmp_path):
    import onnx

    from dsv41.compiler.onnx_export import export_onnx

    opts = CompileOptions(args=load_config(small_case.checkpoint), model_name="shared-small",
                          target="cpu", out=tmp_path, entries=("draft",))
    opts.artifact_dir.mkdir(parents=True)
    (path,) = export_onnx(opts)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    ours = {n.op_type for n in proto.graph.node if n.domain == "dsv41"}
    assert {"fp8_linear", "sparse_attend", "moe_experts_plus", "quant_fp8"} <= ours
    assert not proto.graph.initializer  # weights are inputs, never copied into the file
