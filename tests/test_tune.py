"""`dsv41 tune`: a tiny MetaSchedule run writes its database under the artifact's tuning/
folder, a second run measures nothing, an interrupted run resumes from the records it
committed, compile's schedule step swaps in the verified tuned function (also on a symbolic row
count), and a CUDA target without a GPU is refused before anything is written.

The fast tests tune one small fp8_linear kernel built straight from its factory (no graph
capture); the slow one runs the whole command on the 6-layer shared-small config and compiles
in a fresh process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm

from dsv41.compiler import kernels
from dsv41.compiler import tune as tn
from dsv41.compiler import tune_task as tt
from dsv41.compiler import tuning_db as tdb
from dsv41.compiler.kernel_keys import Fp8LinearKey
from dsv41.graph.config import preset
from dsv41.graph.targets import get_target
from dsv41.schedules import tuning_space as ts

# a few-rows hint: a scheduled kernel on every CPU (the one-row hint is the hand-written
# make_fp8_gemv_avx2 on AVX2 hosts without AVX-512, which has nothing to tune)
KEY = Fp8LinearKey(n=64, k=128, m=4)
SPEC = get_target("cpu")


def _opts(tmp_path: Path, **kw) -> tn.TuneOptions:
    base = dict(args=preset("small"), model_name="tiny", target="cpu", out=tmp_path, trials=4,
                per_round=2, prefer="tuned")
    return tn.TuneOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def task():
    return kernels.kernel_task(KEY, SPEC, entry="decode", values={"m": 1})


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.json"))}


def test_task_shapes_and_workload(task):
    wl = task.workload()
    assert [[int(x) for x in b.shape] for b in wl["main"].params] == [[1, 128], [64, 128],
                                                                       [2, 4], [1, 64]]
    assert not ts.free_vars(wl["main"]) and ts.free_vars(task.func)
    assert ts.signature(task.func) == ts.signature(task.hand)
    arrays = ts.task_inputs("sparse_attend", [tvm.tirx.decl_buffer(s, d, n) for s, d, n in (
        ((1, 1, 4, 64), "bfloat16", "q"), ((1, 17, 64), "uint8", "wc"), ((1, 17, 2), "uint8", "ws"),
        ((1, 1, 16), "int32", "wi"), ((1, 300, 32), "uint8", "kc"), ((1, 300, 4), "uint8", "ks"),
        ((1, 1, 16), "int32", "ki"))])
    assert 0 <= arrays[3].min() and arrays[3].max() < 17  # window rows
    assert 0 <= arrays[6].min() and arrays[6].max() < 300  # global rows


@pytest.mark.slow
def test_tiny_tune_writes_database_reruns_as_noop_and_compile_uses_it(tmp_path, task):
    opts = _opts(tmp_path)
    report = tn.tune(opts, progress=False, say=lambda _: None, tasks=[task])
    tdir = opts.artifact_dir / "tuning"
    assert tdir == tmp_path / f"tiny-{preset('small').config_hash()[:12]}" / "cpu" / "tuning"
    assert {p.name for p in tdir.glob("*.json")} == {*tdb.DB_FILES, tdb.INDEX}
    (res,) = report.results
    assert res.trials == 4 and res.new_trials == 4 and res.exact and res.apply
    assert res.best_s and res.hand_s and res.tuned_s

    before = _snapshot(tdir)
    again = tn.tune(opts, progress=False, say=lambda _: None, tasks=[task])
    assert again.noop and again.results[0].new_trials == 0
    assert _snapshot(tdir) == before, "a run with nothing to do changed the database"

    # compile's schedule step: the hand kernel is replaced by the tuned one
    from dsv41.compiler.build import schedule

    name = task.function
    mod = tvm.IRModule({name: task.hand})
    out = schedule(mod, "cpu", (str(tdir), "decode"))
    assert tdb.tuned_functions(out) == [name]
    assert tdb.tuned_functions(schedule(mod, "cpu", (str(tdir), "prefill"))) == []  # per entry
    damaged = tmp_path / "damaged"
    shutil.copytree(tdir, damaged)
    with open(damaged / tdb.DB_FILES[1], "a") as f:
        f.write("{not json\n")
    with pytest.warns(UserWarning, match="keeps its hand schedule"):
        assert tdb.tuned_functions(schedule(mod, "cpu", (str(damaged), "decode"))) == []
    # ... and it is right on a row count it was not tuned at (the trace replays symbolically)
    params = [tvm.tirx.decl_buffer(s, d, n) for s, d, n in (
        ((3, 128), "bfloat16", "x"), ((64, 128), "uint8", "w"), ((2, 4), "uint8", "s"),
        ((3, 64), "bfloat16", "y"))]
    got = []
    for func in (out[name], task.hand):
        rt = tt.build_function(func, SPEC)
        args = tt.device_args(ts.task_inputs("fp8_linear", params, seed=1), tvm.cpu())
        rt["main"](*args)
        got.append(args[-1].numpy().astype(np.float32))
    np.testing.assert_array_equal(got[0], got[1])


def test_interrupted_run_resumes_from_the_database(tmp_path, task):
    tdir = _opts(tmp_path).tuning_dir

    class Stop(Exception):
        pass

    def killed_after_first_round(n, best):
        raise Stop  # as if the run died once this round's records were committed

    with pytest.raises(Stop):
        tt.tune_task(task, tdb.open_database(tdir), SPEC, trials=4, per_round=2, seed=0,
                     on_round=killed_after_first_round)
    assert tdb.record_counts(tdb.open_database(tdir)) == {tdb.workload_hash(task.workload()): 2}

    with pytest.raises(ValueError, match="--resume"):
        tn.tune(_opts(tmp_path), progress=False, say=lambda _: None, tasks=[task])
    report = tn.tune(_opts(tmp_path, resume=True), progress=False, say=lambda _: None,
                     tasks=[task])
    assert report.results[0].new_trials == 2 and report.results[0].trials == 4


def test_cuda_without_gpu_is_refused_and_writes_nothing(tmp_path, capsys):
    if tvm.cuda().exist:
        pytest.skip("this machine has a GPU")
    opts = _opts(tmp_path, target="cuda-sm90")
    with pytest.raises(ValueError, match="no database was written|No database was written"):
        tn.tune(opts, progress=False)
    assert not any(tmp_path.iterdir())
    from dsv41.compiler.tools.cli.main import main

    assert main(["tune", "--preset", "small", "--target", "cuda-sm90", "--out",
                 str(tmp_path)]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_cli_tune_then_compile_in_a_fresh_process(tmp_path):
    """The whole command on shared-small's decode entry: extraction, a tiny tune of the
    activations' FP8 quantiser (decode's matmuls are the hand GEMV kernels, which have no
    tuning task), a rerun that does nothing, and `dsv41 compile` in a new process using it."""
    from conftest import case_dir

    config = case_dir("shared-small") / "checkpoint" / "config.json"
    base = [sys.executable, "-m", "dsv41.compiler.tools.cli"]
    tune_cmd = [*base, "tune", "--config", str(config), "--ops", "quant_fp8", "--trials", "4",
                "--per-round", "4", "--prefer", "tuned", "--out", str(tmp_path)]
    first = subprocess.run(tune_cmd, capture_output=True, text=True, check=True)
    assert "tuning time" in first.stdout
    art = next(tmp_path.glob("shared-small-*/cpu"))
    before = _snapshot(art / "tuning")
    second = subprocess.run(tune_cmd, capture_output=True, text=True, check=True)
    assert "nothing to do" in second.stdout and _snapshot(art / "tuning") == before
    subprocess.run([*base, "compile", "--config", str(config), "--entries", "decode",
                    "--out", str(tmp_path)], capture_output=True, text=True, check=True)
    m = json.loads((art / "manifest.json").read_text())
    assert m["tuning_database_sha256"] == tdb.database_hash(art / "tuning")
    index = tdb.read_index(art / "tuning")
    used = sorted(d["function"] for d in index["tasks"]
                  if index["results"].get(d["name"], {}).get("apply"))
    assert used and m["tuning_applied"]["decode"] == used

    # entries built with another database are not kept: a changed database means recompiling
    from dsv41.compiler.build import built_entries
    from dsv41.graph.config import load_config

    args = load_config(config)
    assert list(built_entries(art, args, "cpu")) == ["decode"]
    with open(art / "tuning" / tdb.INDEX, "a") as f:
        f.write("\n")
    assert built_entries(art, args, "cpu") == {}
