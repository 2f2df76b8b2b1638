"""compile_artifact's progress events: every phase of every entry started then finished, in
PHASES order, with its seconds; the phases themselves are stand-ins here (the real compile is
tests/test_compile.py's)."""

from __future__ import annotations

import pytest

from dsv41.compiler import build
from dsv41.compiler.build import PHASES, CompileOptions, compile_artifact
from dsv41.graph.config import preset


class Recorder:
    def __init__(self):
        self.events = []

    def started(self, entry, phase):
        self.events.append(("started", entry, phase))

    def finished(self, entry, phase, seconds, *, phases=1):
        assert seconds >= 0
        self.events.append(("finished", entry, phase, phases))

    def note(self, text):
        self.events.append(("note", text))


@pytest.fixture
def stand_ins(monkeypatch):
    import dsv41.compiler.lower as lower
    import dsv41.compiler.tuning_db as tuning_db

    monkeypatch.setattr(build, "capture", lambda model, entry: (f"ep-{entry}", "template"))
    monkeypatch.setattr(build, "entry_signature", lambda ep, template, plan, entry: {})
    monkeypatch.setattr(build, "entry_bounds", lambda model, entry, ep, template: None)
    monkeypatch.setattr(lower, "lower", lambda ep, spec, **kw: f"lowered-{ep}")
    monkeypatch.setattr(build, "fuse", lambda mod, target: (f"fused-{mod}", True))
    monkeypatch.setattr(build, "schedule", lambda mod, target, tuning: f"scheduled-{mod}")
    monkeypatch.setattr(tuning_db, "tuned_functions", lambda mod: [])
    monkeypatch.setattr(build, "_dump", lambda *a: None)
    built = []
    monkeypatch.setattr(build, "_build_library", lambda mod, spec, lib: built.append(mod))
    monkeypatch.setattr(build, "write_manifest", lambda opts, entries, report: None)
    return built


def test_every_phase_is_reported_in_order(stand_ins, tmp_path):
    rec = Recorder()
    opts = CompileOptions(args=preset("small"), model_name="small", target="cpu", out=tmp_path,
                          entries=("encoder", "decode"))
    report = compile_artifact(opts, progress=rec)
    expected = []
    for entry in ("encoder", "decode"):
        for phase in PHASES:
            expected += [("started", entry, phase), ("finished", entry, phase, 1)]
    assert rec.events == expected
    assert stand_ins == ["scheduled-fused-lowered-ep-encoder", "scheduled-fused-lowered-ep-decode"]
    assert set(report.seconds["decode"]) == set(PHASES)
