"""`dsv41 bench load`: the child's measurement of a checkpoint load (shared-small: the sizes are
exact; the peaks are the kernel's and are only checked for consistency here, the bench preset's
numbers are in the README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv41.compiler.tools.bench.load import measure_load, model_tensors
from dsv41.compiler.tools.cli.main import main as cli_main


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.slow
def test_load_measurement_counts_the_model_bytes(small_case, small_model, tmp_path, capsys):
    from dsv41.graph.checkpoint import checkpoint_nbytes

    m = measure_load(small_case.checkpoint)
    assert m.checkpoint_bytes == checkpoint_nbytes(small_model.args)
    assert m.resident_bytes == sum(t.nbytes for t in model_tensors(small_model))
    assert 0 < m.load_peak_bytes <= m.touched_peak_bytes
    assert m.ratio == pytest.approx(m.touched_peak_bytes / m.resident_bytes)
    out = tmp_path / "load.json"
    assert cli_main(["bench", "load", "--checkpoint", str(small_case.checkpoint), "--json",
                     str(out)]) == 0
    assert "ratio" in capsys.readouterr().out
    got = json.loads(out.read_text())["load"]
    assert got["resident_bytes"] == m.resident_bytes and "within_target" in got
