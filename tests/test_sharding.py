"""The sharding plan (graph/sharding.py, `dsv41 plan --shards`) and the disco loader
(runtime/disco.py): every tensor placed once, per-worker bytes that add up exactly, slices that
tile each split dimension, whole-number refusals; disco usable from the PyPI wheel only through
the loader, in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv41.graph.checkpoint import param_spec
from dsv41.graph.config import preset
from dsv41.graph.sharding import Collective, Split, divisible_worker_counts, shard_plan


@pytest.mark.parametrize("name,shards", [("small", 2), ("bench", 4), ("full", 8)])
def test_worker_bytes_add_up_to_the_checkpoint(name, shards):
    args = preset(name)
    plan = shard_plan(args, shards)
    spec = param_spec(args)
    assert set(plan.tensors) == set(spec)
    whole = {s: sum(t.spec.nbytes for t in plan.tensors.values() if t.split is s) for s in Split}
    # replicated tensors count once per worker, split and expert ones once in all
    once = whole[Split.EXPERT] + whole[Split.ROWS] + whole[Split.COLS]
    assert sum(plan.worker_weight_bytes()) == shards * whole[Split.REPLICATED] + once
    assert plan.host_bytes() == whole[Split.HOST] > 0
    assert plan.total_bytes() == sum(s.nbytes for s in spec.values())


def test_full_over_8_workers():
    plan = shard_plan(preset("full"), 8)
    weights = plan.worker_weight_bytes()
    assert len(set(weights)) == 1  # 384 experts, 64 heads, 8 o-groups: an even split
    assert 39e9 < weights[0] < 41e9  # fits an H200 (141 GB) with room for the caches
    assert 0.8e9 < plan.worker_cache_bytes(1_000_000) < 1e9  # 890 B/token + local state
    per_step = plan.collectives_per_step()
    assert per_step == {Collective.ALL_REDUCE: 2 * 40 + 1, Collective.ALL_GATHER: 1}


def test_experts_are_contiguous_blocks_and_slices_tile_their_dimension():
    args = preset("full")
    plan = shard_plan(args, 8)
    owners = [plan.tensors[f"layers.5.ffn.experts.{e}.w1.weight"].owner for e in range(384)]
    assert owners == [e // 48 for e in range(384)]
    for name in ("layers.5.attn.wq_b.weight", "layers.5.attn.wq_b.scale",
                 "layers.5.attn.wo_b.weight", "layers.5.ffn.shared_experts.w2.scale",
                 "head.weight"):
        t = plan.tensors[name]
        dims = {t.slice(w, 8)[0] for w in range(8)}
        (dim,) = dims
        spans = [t.slice(w, 8)[1:] for w in range(8)]
        assert spans[0][0] == 0 and spans[-1][1] == t.spec.shape[dim]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert plan.tensors["layers.1.engram.embed.weight"].split is Split.HOST
    assert plan.tensors["layers.5.attn.wkv.weight"].split is Split.REPLICATED
    assert plan.tensors["layers.5.attn.wkv.weight"].slice(3, 8) is None


def test_one_worker_is_the_whole_model():
    args = preset("small")
    plan = shard_plan(args, 1)
    assert plan.meetings == ()
    assert plan.worker_weight_bytes() == (plan.total_bytes() - plan.host_bytes(),)


@pytest.mark.parametrize("shards,match", [(3, "4 query heads do not split over 3"),
                                          (0, "whole number >= 1"), (True, "whole number"),
                                          (2.0, "whole number")])
def test_bad_worker_counts_are_refused(shards, match):
    with pytest.raises(ValueError, match=match):
        shard_plan(preset("small"), shards)


def test_worker_counts_that_split():
    assert divisible_worker_counts(preset("small"), 8) == [1, 2]
    assert divisible_worker_counts(preset("full"), 16) == [1, 2, 4, 8]


def test_dsv41_plan_shards(tmp_path, capsys):
    from dsv41.compiler.tools.cli.main import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--preset", "full", "--shards", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "shards: 8 workers" in text and "host memory per machine" in text
    data = json.loads(out.read_text())
    assert [w["worker"] for w in data["workers"]] == list(range(8))
    assert data["context"] == 1_000_000 and data["host_bytes"] > 2e11
    assert main(["plan", "--preset", "small", "--shards", "3"]) == 2
    assert "do not split over 3" in capsys.readouterr().err


# ---- disco -------------------------------------------------------------------------------------

def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_disco_needs_the_loader_and_then_runs_two_cpu_workers():
    # the wheel as it is: tvm.runtime.disco is None
    assert _run("import tvm; print(tvm.runtime.disco is None)").strip() == "True"
    out = _run(
        "from dsv41.runtime.backends.disco import load_disco\n"
        "disco = load_disco()\n"
        "for kind in (disco.ThreadedSession, disco.ProcessSession):\n"
        "    s = kind(num_workers=2)\n"
        "    ids = s.get_global_func('runtime.disco.worker_id')()\n"
        "    print([ids.debug_get_from_remote(i)[0] for i in range(2)])\n"
        "    s.shutdown()\n")
    assert out.split("\n")[:2] == ["[0, 1]", "[0, 1]"]


def test_disco_loader_is_clear_when_too_late_and_without_nccl():
    out = _run(
        "import tvm\n"
        "from dsv41.runtime.backends.disco import DiscoUnavailable, load_disco\n"
        "try:\n"
        "    load_disco()\n"
        "except DiscoUnavailable as e:\n"
        "    print('late:', e)\n")
    assert "before anything imports tvm" in out
    out = _run(
        "from dsv41.runtime.backends.disco import DiscoUnavailable, check_ccl, load_disco\n"
        "load_disco()\n"
        "try:\n"
        "    check_ccl('nccl')\n"
        "except DiscoUnavailable as e:\n"
        "    print('ccl:', e)\n")
    assert "USE_NCCL=ON" in out
