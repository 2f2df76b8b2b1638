"""The CLI verbs end to end on small inputs (real commands, real outputs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsv41.compiler.tools.bench.e2e import BenchOptions
from dsv41.compiler.tools.bench.serve import ServeBenchOptions
from dsv41.compiler.tools.cli.bench import BENCH_VERBS, with_default_bench_verb
from dsv41.compiler.tools.cli.main import build_parser, main


def test_plan_all_presets(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    for name in ("small", "bench", "full"):
        assert f"layer plan: {name}" in out
    assert "pool-masked" in out and "sweep + candidates" in out


def test_bill_full_and_chart(tmp_path, capsys):
    chart = tmp_path / "bill.png"
    assert main(["bill", "--preset", "full", "--context", "1M", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "890 B/token" in out and "437x" in out
    assert chart.stat().st_size > 10_000


def test_score_writes_logits_and_perplexity(tmp_path, small_case):
    toks = tmp_path / "t.txt"
    toks.write_text(" ".join(str(t) for t in small_case.tokens[:12]))
    out = tmp_path / "s.npz"
    rc = main(["score", "--checkpoint", str(small_case.checkpoint), "--tokens", str(toks),
               "--prefill", "8", "--out", str(out), "--hidden-states", "0,1"])
    assert rc == 0
    z = np.load(out)
    assert z["logits"].shape == (12, 512) and np.isfinite(z["logits"]).all()
    assert z["hidden_after_L0"].shape == (8, 4, 256) and z["final_hidden"].shape == (8, 256)
    assert np.isfinite(z["perplexity"]) and z["perplexity"] > 1


def test_bad_input_is_a_clear_error(tmp_path, capsys, small_case):
    toks = tmp_path / "t.txt"
    toks.write_text("1 2 x")
    rc = main(["score", "--checkpoint", str(small_case.checkpoint), "--tokens", str(toks),
               "--out", str(tmp_path / "o.npz")])
    assert rc == 2 and "integer ids" in capsys.readouterr().err
    toks.write_text("1 2 99999")
    rc = main(["score", "--checkpoint", str(small_case.checkpoint), "--tokens", str(toks),
               "--out", str(tmp_path / "o.npz")])
    assert rc == 2 and "Token ids must lie in" in capsys.readouterr().err
    assert main(["bill", "--context", "0"]) == 2


# ---- the one parser tree ------------------------------------------------------------------------

VERBS = (["plan"], ["bill"], ["checkpoint"], ["score"], ["compile"], ["bundle"], ["selftest"],
         ["bench"], *(["bench", v] for v in BENCH_VERBS), ["run"], ["ledger"], ["tune"],
         ["serve"], ["chat"])


def test_every_verb_and_sub_verb_has_help(capsys):
    for argv in ([], *VERBS):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
        out = capsys.readouterr().out
        assert out.startswith(f"usage: {' '.join(['dsv41', *argv])} "), argv
    required = {"checkpoint": ["--out", "o"], "bundle": ["--out", "o"],
                "score": ["--checkpoint", "c", "--tokens", "t", "--out", "o"]}
    for argv in VERBS:  # the tree dispatches every verb and sub-verb to its command
        ns = build_parser().parse_args(with_default_bench_verb([*argv,
                                                                *required.get(argv[0], [])]))
        # a verb's module's `run`; a bench sub-verb's `run_<sub-verb>` of cli/bench.py
        module, name = ("bench", f"run_{argv[1] if argv[1:] else 'e2e'}") \
            if argv[0] == "bench" else (argv[0], "run")
        assert (ns.func.__module__, ns.func.__name__) == \
            (f"dsv41.compiler.tools.cli.{module}", name), argv


def test_bad_input_is_an_argparse_error(capsys):
    for argv, msg in ((["bench", "nope"], "invalid choice: 'nope'"),
                      (["bench", "--reps", "x"],
                       "argument --reps: must be a whole number, got 'x'"),
                      (["bench", "kernels", "--stat", "mean"], "invalid choice: 'mean'"),
                      (["bench", "serve", "--port", "1"], "unrecognized arguments: --port"),
                      (["bench", "soak", "--turns", "1.5"],
                       "argument --turns: must be a whole number, got '1.5'"),
                      (["bench", "serve", "--clients", "a"], "comma-separated counts"),
                      (["bench", "pool", "--reps", "0"],
                       "argument --reps: must be a whole number of at least 1, got '0'"),
                      (["selftest", "--reps", "many"],
                       "argument --reps: must be a whole number, got 'many'"),
                      (["plan", "--nope"], "unrecognized arguments: --nope"),
                      (["nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_bench_without_a_sub_verb_is_e2e():
    assert with_default_bench_verb(["bench"]) == ["bench", "e2e"]
    assert with_default_bench_verb(["bench", "--reps", "2"]) == ["bench", "e2e", "--reps", "2"]
    for argv in (["bench", "kernels"], ["bench", "--help"], ["bench", "nope"], ["plan"], []):
        assert with_default_bench_verb(argv) == argv
    ns = build_parser().parse_args(with_default_bench_verb(["bench", "--contexts", "4K"]))
    assert ns.options(ns) == BenchOptions(contexts=(4096,))


def _options(argv):
    ns = build_parser().parse_args(with_default_bench_verb(argv))
    return ns.options(ns)


def test_each_verb_builds_its_options_with_the_documented_defaults():
    from dsv41.compiler.build import CompileOptions
    from dsv41.compiler.tools.bench.kernels import KernelBenchOptions
    from dsv41.compiler.tools.bench.load import LoadBenchOptions
    from dsv41.compiler.tools.bench.pool import PoolBenchOptions
    from dsv41.compiler.tools.bench.serve import BenchServeOptions
    from dsv41.compiler.tools.bench.soak import SoakOptions
    from dsv41.compiler.tools.bench.spec import SpecBenchOptions
    from dsv41.compiler.tools.ledger import LedgerCommandOptions
    from dsv41.compiler.tools.scoring import ScoreOptions
    from dsv41.compiler.tools.selftest import SelftestOptions
    from dsv41.compiler.tune import TuneOptions
    from dsv41.graph.config import preset
    from dsv41.graph.entries import ENTRIES
    from dsv41.runtime.serving.assembly import ChatOptions, ServeOptions, ServingOptions
    from dsv41.schedules.tuning_space import PhaseShape

    assert _options(["bench"]) == _options(["bench", "e2e"]) == BenchOptions()
    assert _options(["bench", "kernels"]) == KernelBenchOptions()
    assert _options(["bench", "serve"]) == BenchServeOptions()
    assert _options(["bench", "pool"]) == PoolBenchOptions()
    assert _options(["bench", "soak"]) == SoakOptions()
    assert _options(["bench", "load"]) == LoadBenchOptions()
    assert _options(["bench", "spec"]) == SpecBenchOptions()
    assert _options(["selftest"]) == replace(SelftestOptions(), artifacts=(Path("artifacts"),))
    assert _options(["serve"]) == ServeOptions()
    assert _options(["chat"]) == ChatOptions()
    assert _options(["compile"]) == CompileOptions(args=preset("small"), model_name="small",
                                                   target="cpu", entries=ENTRIES)
    assert _options(["tune"]) == TuneOptions(
        args=preset("small"), model_name="small", target="cpu",
        shape=PhaseShape(batch=1, tokens=256, context=8192))
    # every flag reaches its field
    assert _options(["bench", "kernels", "--cases", "indexer, moe", "--no-compile", "--quick",
                     "--stat", "min", "--json", "k.json", "--list"]) == KernelBenchOptions(
        cases=("indexer", "moe"), use_compile=False, quick=True, stat="min",
        json=Path("k.json"), list_cases=True)
    assert _options(["bench", "serve", "--backend", "torch", "--clients", "2,3", "--seed", "4"]) \
        == BenchServeOptions(ServingOptions(backend="torch", seed=4),
                             ServeBenchOptions(clients=(2, 3), seed=4))
    assert _options(["serve", "--request-timeout", "0"]).request_timeout_s is None
    assert _options(["ledger"]) == LedgerCommandOptions()
    assert _options(["score", "--checkpoint", "c", "--tokens", "t", "--out", "o"]) == \
        ScoreOptions(checkpoint=Path("c"), tokens=Path("t"), out=Path("o"))
    assert _options(["score", "--checkpoint", "c", "--tokens", "t", "--out", "o",
                     "--hidden-states", "0,2", "--images", "a.png,b.png"]) == ScoreOptions(
        Path("c"), Path("t"), Path("o"), hidden_states=(0, 2),
        images=(Path("a.png"), Path("b.png")))


def test_verbs_refuse_bad_options_before_any_work(capsys):
    for argv, msg in ((["bench", "spec", "--rates", "0.5,1.5"], "strictly between 0 and 1"),
                      (["bench", "spec", "--rates", "x"], "comma-separated numbers"),
                      (["bench", "--contexts", "0"], "must be positive"),
                      (["serve", "--port", "65536"], "--port must be in 1..65535"),
                      (["serve", "--role", "decode"], "needs --redis-url"),
                      (["compile", "--target", "tpu"], "Unknown target 'tpu'"),
                      (["compile", "--entries", "nope"], "Unknown entries"),
                      (["tune", "--target", "tpu"], "Unknown target 'tpu'")):
        with pytest.raises(ValueError, match=msg):
            _options(argv)
    assert main(["bench", "kernels", "--target", "tpu"]) == 2
    assert "dsv41 bench kernels: error: " in capsys.readouterr().err
