"""The soak's pieces: the oneDNN cache bounds (runtime/onednn.py) and `dsv41 bench soak`
(compiler/soak.py). The RSS check itself is slow (a subprocess JIT-compiling hundreds of
shapes); the rest is fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dsv41.compiler.tools.bench import soak
from dsv41.compiler.tools.bench.soak import SoakOptions, report_json, run_soak
from dsv41.compiler.tools.cli import main as cli
from dsv41.compiler.tools.cli.bench import soak_options
from dsv41.runtime.backends.onednn import (
    DEFAULT_ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLES,
    bound_onednn_caches,
)
from dsv41.runtime.engine import Engine


@pytest.fixture
def no_cache_env(monkeypatch):
    for name in ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_bound_sets_unset_variables_and_keeps_the_users(no_cache_env):
    no_cache_env.setenv("LRU_CACHE_CAPACITY", "7")
    got = bound_onednn_caches(32)
    assert got == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 32, "LRU_CACHE_CAPACITY": 7}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


@pytest.mark.parametrize("capacity", [0, -1, True, 2.5, "64"])
def test_bound_refuses_a_bad_capacity(no_cache_env, capacity):
    with pytest.raises(ValueError, match="positive int"):
        bound_onednn_caches(capacity)


def test_bound_refuses_a_non_integer_environment_value(no_cache_env):
    no_cache_env.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "lots")
    with pytest.raises(ValueError, match="ONEDNN_PRIMITIVE_CACHE_CAPACITY='lots'"):
        bound_onednn_caches()


def test_an_engine_bounds_the_caches(no_cache_env, small_model):
    Engine.from_model(small_model, weights_hash="w" * 64, page_tokens=8).close()
    for name in ONEDNN_CACHE_VARIABLES:
        assert os.environ[name] == str(DEFAULT_ONEDNN_CACHE_CAPACITY)


def test_soak_runs_every_tier_evicting_and_reports(small_case, tmp_path):
    opts = SoakOptions(checkpoint=small_case.checkpoint, turns=8, sessions=2, baseline_turn=4,
                       sample_every=4, pool_snapshots=1, store_blocks=3)
    lines = []
    report = run_soak(opts, tmp_path / "store", say=lines.append)
    assert [s.turn for s in report.samples] == [4, 8]
    last = report.samples[-1]
    assert sum(last.tiers.values()) == 8
    assert last.pool_evictions + last.pool_expired > 0 and last.store_evictions > 0
    assert report.tiers_evicting
    doc = json.loads(json.dumps(report_json(report)))
    assert doc["options"]["turns"] == 8 and doc["options"]["checkpoint"] == str(opts.checkpoint)
    assert doc["rss_baseline_bytes"] == report.samples[0].rss_bytes
    assert doc["rss_last_bytes"] == last.rss_bytes
    assert doc["rss_ratio"] == pytest.approx(last.rss_bytes / report.samples[0].rss_bytes)
    assert len(lines) == 3 and lines[0].startswith("soak: PyTorch graph")


@pytest.mark.parametrize("field, value, match", [
    ("turns", 0, "--turns must be a positive integer"),
    ("sessions", 1.5, "--sessions must be a positive integer"),
    ("baseline_turn", 600, "--baseline-turn 600 is past the last turn"),
    ("pool_ttl_s", float("nan"), "--pool-ttl-s must be a positive number"),
])
def test_soak_options_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        SoakOptions(**{field: value}).validate()


def test_bench_soak_bad_argument_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:  # refused while parsing (cli/common.count)
        cli.main(["bench", "soak", "--turns", "0"])
    assert exit_info.value.code == 2
    assert ("argument --turns: must be a whole number of at least 1, got '0'"
            in capsys.readouterr().err)


def test_bench_soak_resolves_the_preset_and_writes_its_json(small_case, tmp_path, capsys):
    asked = []

    def default_checkpoint(preset, seed):
        asked.append((preset, seed))
        return small_case.checkpoint

    out = tmp_path / "soak.json"
    argv = ["--turns", "2", "--sessions", "1", "--baseline-turn", "1", "--sample-every", "1",
            "--seed", "3", "--json", str(out)]
    opts = soak_options(cli.build_parser().parse_args(["bench", "soak", *argv]))
    assert soak.run_command(opts, default_checkpoint=default_checkpoint) == 0
    assert asked == [("small", 3)]
    doc = json.loads(out.read_text())
    assert [s["turn"] for s in doc["samples"]] == [1, 2]
    assert "RSS turn 1 " in capsys.readouterr().out


_SHAPES = textwrap.dedent("""
    import sys, psutil, torch
    from dsv41.runtime.backends.onednn import bound_onednn_caches
    if sys.argv[1] != "default":
        bound_onednn_caches(int(sys.argv[1]))
    torch.set_num_threads(1)
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    rss = {}
    for t in range(1, 601):  # a new (queries x context) shape per call, as in decode
        torch.einsum("bhd,btd->bht", q, torch.randn(1, t, 64, dtype=torch.bfloat16))
        if t in (200, 600):
            rss[t] = psutil.Process().memory_info().rss
    print((rss[600] - rss[200]) / 2**20)
""")


def _growth_mib(capacity: str) -> float:
    out = subprocess.run([sys.executable, "-c", _SHAPES, capacity], check=True,
                         capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items()
                              if k not in ONEDNN_CACHE_VARIABLES})
    return float(out.stdout.split()[-1])


@pytest.mark.slow
def test_bounded_caches_keep_rss_flat_over_new_shapes():
    unbounded = _growth_mib("default")
    if unbounded < 50:
        pytest.skip(f"this CPU keeps no JIT primitive per bf16 matmul shape (400 new shapes "
                    f"grew RSS by {unbounded:.1f} MiB)")
    bounded = _growth_mib("16")
    assert bounded < 10, (bounded, unbounded)


@pytest.mark.slow
def test_soak_on_the_compiled_engine_keeps_rss_flat(small_case, small_artifact, tmp_path):
    """The must-show's soak on the production path, shortened: 200 turns, 4 sessions, both tiers
    evicting, RSS at turn 200 within 2% of turn 50 (500 turns measured +0.25%)."""
    opts = SoakOptions(checkpoint=small_case.checkpoint, artifact=small_artifact, turns=200,
                       baseline_turn=50, sample_every=50)  # threads: as the suite set them
    report = run_soak(opts, tmp_path / "store", say=lambda line: None)
    assert report.tiers_evicting
    assert report.ratio < 1.02, [s.rss_bytes for s in report.samples]
