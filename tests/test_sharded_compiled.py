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


@pytest.fixture(scope="module")
def sharded_artifact(small_case) -> Path:
    from dsv41.compiler.sharded import compile_sharded
    from dsv41.graph.collectives import CclBackend

    args = load_config(small_case.checkpoint)
    key = compile_inputs_digest(args.config_hash(), f"sharded-{SHARDS}-cpu-test-prefill_all",
                                (PACKAGE / "compiler" / "sharded.py").read_text(),
                                (PACKAGE / "runtime" / "sharded.py").read_text())
    cache = artifact_cache_root() / "sharded"
    done = cache / key
    if (done / "manifest.json").is_file():
        return done
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
    compile_sharded(args, work, shards=SHARDS, entries=("prefill_all",),
                    ccl=CclBackend.CPU_TEST, model_name="shared-small")
    try:
        os.rename(work, done)
    except OSError:  # another run built the same key first
        shutil.rmtree(work, ignore_errors=True)
    return done


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
