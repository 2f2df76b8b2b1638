"""The sharded artifact (compiler/sharded.py, runtime/sharded.py): shared-small's prefill_all
entry built once for 2 workers, run by 2 TVM disco workers (a ThreadedSession) with the CPU test
collective, against the one-worker graph.

Tolerance: the pack's acceptance bounds (conformance), the bound the one-worker artifact is held
to, and a median row within 0.05 relative L2. Not the eager run's 1e-5: the eager 2-worker graph
is bit-identical to one worker (tests/test_sharded.py), but the compiled kernels add in their
own order (fp8_linear: 1 fp32 ulp, see test_kernel_gemm.py), and the model is discontinuous
(FP8 activation quantisation, top-k selection): measured, the compiled run is bit-equal to the
eager workers through layer 1 and on 39 of 40 rows of layer 2's attention; on row 22 a last-bit
difference crosses a quantisation step in worker 0's heads, and the L3 indexer's top-k for that
row flips, after which the rows move by 0.015 (median) to 0.11 relative L2, within the pack's
bounds. The build takes minutes (slow); it is cached between runs like the suite's other
artifacts, keyed by everything it reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import PACKAGE, artifact_cache_root, compile_inputs_digest

from dsv41.graph.config import load_config
from dsv41.graph.conformance import evaluate
from dsv41.graph.score import GraphBackend, ScoreResult, score

pytestmark = pytest.mark.slow
SHARDS = 2


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


ENTRIES = ("prefill_all", "decode")  # an exact engine's (prefill_all serves for prefill)


def build_sharded(args) -> Path:
    """shared-small's sharded CPU-test artifact of ENTRIES, from the test artifact cache (keyed
    by everything the compile reads: the compile sources, compiler/sharded.py, the format) or
    built and put there whole."""
    from dsv41.compiler.sharded import compile_sharded
    from dsv41.graph.collectives import CclBackend
    from dsv41.runtime.backends.sharded import SHARDED_FORMAT

    key = compile_inputs_digest(args.config_hash(), f"sharded-{SHARDS}-cpu-test-"
                                f"{','.join(ENTRIES)}-{SHARDED_FORMAT}",
                                (PACKAGE / "compiler" / "sharded.py").read_text())
    cache = artifact_cache_root() / "sharded"
    done = cache / key
    if (done / "manifest.json").is_file():
        return done
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
    compile_sharded(args, work, shards=SHARDS, entries=ENTRIES, ccl=CclBackend.CPU_TEST,
                    model_name="shared-small")
    try:
        os.rename(work, done)
    except OSError:  # another run built the same key first
        shutil.rmtree(work, ignore_errors=True)
    return done


@pytest.fixture(scope="module")
def sharded_artifact(small_case) -> Path:
    return build_sharded(load_config(small_case.checkpoint))


def test_the_manifest_records_the_plan(sharded_artifact):
    m = json.loads((sharded_artifact / "manifest.json").read_text())
    assert m["shards"] == SHARDS and m["ccl"] == "cpu-test"
    assert [w["worker"] for w in m["plan"]["workers"]] == [0, 1]
    assert m["plan"]["splits"]["layers.1.attn.wo_b.weight"] == "cols"
    params = {p["param"]: p["shape"] for p in m["entries"]["prefill_all"]["params"]}
    assert params["layers__1__attn__wo_b__weight"] == ["256", "64"]  # half the columns
    assert params["experts__1__w1"][0] == "3"  # 2 of 4 experts + the null expert
    assert "shard__rank" in params


def test_two_disco_workers_equal_one_worker_on_shared_small(sharded_artifact, small_case,
                                                            small_model, tmp_path):
    out = tmp_path / "two.npz"
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sharded_score.py")),
                           str(sharded_artifact), str(small_case.root), str(out)],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    two = ScoreResult.from_npz(out)
    one = score(GraphBackend(small_model), small_case.tokens, prefill=small_case.prefill)
    rel = _rel(two.logits, one.logits)
    print(f"2 disco workers vs the graph: logits rel L2 max {rel.max():.3g}, median "
          f"{np.median(rel):.3g}")
    assert np.median(rel) < 0.05
    rep = evaluate(small_case, two)
    print({k: v for k, v in rep.metrics.items() if not isinstance(v, dict)})
    assert rep.conformant, rep.failures


ENGINE_TURNS = [[int(x) for x in np.random.default_rng(i).integers(3, 500, n)]
                for i, n in ((1, 37), (2, 5), (3, 11))]


@pytest.fixture(scope="module")
def engine_run(sharded_artifact, small_case, tmp_path_factory) -> tuple[dict, dict]:
    """tests/sharded_engine.py's report and arrays (its own process: disco), run once."""
    d = tmp_path_factory.mktemp("engine")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sharded_engine.py")),
                           str(sharded_artifact), str(small_case.checkpoint), str(d / "store"),
                           json.dumps(ENGINE_TURNS), str(d / "two.npz")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), dict(np.load(d / "two.npz"))


def test_an_engine_on_two_workers_tracks_the_one_worker_engine(engine_run, small_artifact,
                                                               small_case):
    """The same Engine / Session API over the 2 disco workers (tests/sharded_engine.py, a
    process of its own): three exact turns on one live session (no store: the later turns on
    its live cache), and the first two with an SSD store (the second from the DRAM snapshot the
    first left), the third resumed from the store in a new engine. The stored and resumed turns
    equal the live ones bit for bit (the tiers hold the controller's cache exactly); against
    the one-worker artifact's engine on the same turns, the greedy tokens agree and every
    logits row is within the conformance bound on rel L2, the median within 0.05 (the bounds of
    the prefill test above: the kernels add in another order, see the module docstring; on
    these turns, measured, every row is bit-identical, rel L2 0)."""
    from dsv41.runtime.engine import Engine

    report, two = engine_run
    assert report["tiers"] == {"live": ["cold", "live", "live"], "stored": ["cold", "snapshot"],
                               "resumed": ["snapshot-ssd"]}
    assert "have been shut down" in report["after_close"]  # Engine.close ended the workers
    for k in range(2):
        for part in ("tokens", "logits"):
            np.testing.assert_array_equal(two[f"stored.{k}.{part}"], two[f"live.{k}.{part}"])
    for part in ("tokens", "logits"):
        np.testing.assert_array_equal(two[f"resumed.0.{part}"], two[f"live.2.{part}"])

    one = Engine.load(small_artifact, small_case.checkpoint, exact=True, page_tokens=8).session()
    rels = []
    for k, ids in enumerate(ENGINE_TURNS):
        tokens = list(one.send(ids, max_new_tokens=4, keep_logits=True))
        rel = _rel(two[f"live.{k}.logits"], np.stack(one.turns[-1].logits))  # (steps,)
        print(f"turn {k}: tokens 2 workers {two[f'live.{k}.tokens'].tolist()}, 1 worker "
              f"{tokens}; logits rel L2 per step {np.round(rel, 4).tolist()}")
        assert two[f"live.{k}.tokens"].tolist() == tokens
        rels.extend(rel)
    print(f"2-worker vs 1-worker engine: logits rel L2 max {max(rels):.3g}, median "
          f"{np.median(rels):.3g}; traffic over the turns {report['traffic']}")
    assert max(rels) <= small_case.bounds["rel_l2_max"]
    assert np.median(rels) < 0.05


def test_the_cache_stays_on_the_workers_and_only_changes_are_sent(engine_run,
                                                                  sharded_artifact):
    """A decode step on a cache the workers hold sends only the step's inputs (tokens,
    positions, RoPE rows, Engram ids) and gives the logits of the same step on a copy sent
    whole; the tensors a step lent to the workers (updated there in place) and a tensor changed
    on the host in place are sent again (tests/sharded_engine.py, `resident_steps`)."""
    report, got = engine_run
    sent = report["step_bytes"]
    m = json.loads((sharded_artifact / "manifest.json").read_text())["entries"]["decode"]
    step = sum(int(np.prod([int(d) if d.isdigit() else 1 for d in i["shape"]]))  # batch 1
               * np.dtype(i["dtype"]).itemsize for i in m["inputs"][:-len(m["cache"])])
    assert step == 1784  # x, start, floor 8 each; 4 RoPE tables (13, 8) fp32; Engram ids (2, 6)
    assert sent["same.resident"] == SHARDS * step
    assert sent["same.sent"] == sent["lent.resident"] == SHARDS * (step + sent["cache"])
    assert sent["changed.resident"] == SHARDS * (step + sent["ring"])
    for case in ("same.sent", "lent.resident"):
        np.testing.assert_array_equal(got[f"step.{case}"], got["step.same.resident"])
    np.testing.assert_array_equal(got["step.changed.resident"], got["step.changed.sent"])
    assert not np.array_equal(got["step.changed.sent"], got["step.unchanged.sent"])
    per_step = report["traffic"]["decode"]
    print(f"decode over the turns: {per_step['calls']} steps sent {per_step['sent_bytes']} "
          f"bytes, kept {per_step['resident_bytes']} on the workers; one step sends "
          f"{sent['same.resident']} bytes resident, {sent['same.sent']} whole")
