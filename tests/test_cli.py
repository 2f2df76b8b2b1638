"""The CLI verbs end to end on small inputs (real commands, real outputs)."""

from __future__ import annotations

import numpy as np

from dsv41.compiler.cli import main


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
