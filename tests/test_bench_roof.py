"""`dsv41 bench`'s roofline (compiler/tools/bench/roof.py): best-of-N bandwidth with every pass
reported, the compute roof of the dtypes the CPU has dot products for, and the fraction of the
roofline computed from the best pass."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from dsv41.compiler.tools.bench import roof
from dsv41.compiler.tools.bench.e2e_records import roofline_row
from dsv41.compiler.tools.bench.measure import measure_machine
from dsv41.compiler.tools.bench.roof import Dtype, StreamPass
from dsv41.graph.cost import StepCost


def test_step_dtypes_follow_the_cpu_flags():
    """fp32 FMA always; bf16 and int8 only where lscpu lists their dot products."""
    assert roof.step_dtypes({"avx2", "fma"}) == (Dtype.FP32,)
    assert roof.step_dtypes({"avx512f", "avx512_vnni"}) == (Dtype.FP32, Dtype.INT8)
    assert roof.step_dtypes({"amx_bf16", "amx_int8"}) == (Dtype.FP32, Dtype.BF16, Dtype.INT8)
    assert roof.step_dtypes({"avx_vnni", "avx512_bf16"}) == (Dtype.FP32, Dtype.BF16, Dtype.INT8)


def test_best_bandwidth_is_the_best_pass_of_all():
    passes = (StreamPass(10.0, 12.0, 0.0), StreamPass(22.0, 14.4, 1.0), StreamPass(9.0, 9.5, 2.0))
    assert roof.best_bandwidth(passes) == 22.0
    assert roof.best_bandwidth([asdict(p) for p in passes]) == 22.0  # as the JSON holds them
    with pytest.raises(ValueError, match="No bandwidth passes"):
        roof.best_bandwidth(())


def test_stream_passes_reports_each_pass():
    runs = roof.stream_passes(1 << 20, passes=4)
    assert len(runs) == 4
    assert all(p.copy_gbs > 0 and p.triad_gbs > 0 for p in runs)
    assert [p.at_s for p in runs] == sorted(p.at_s for p in runs) and runs[0].at_s == 0.0
    with pytest.raises(ValueError, match="at least 1 pass, got 0"):
        roof.stream_passes(1 << 20, passes=0)


def test_compute_roof_is_the_fastest_dtype():
    c = roof.ComputeRoof({"fp32": 100.0, "bf16": 350.0, "int8": 200.0}, 64)
    assert (c.best_dtype, c.best_gflops) == ("bf16", 350.0)
    assert c.to_dict()["best_gflops"] == 350.0
    measured = roof.measure_compute({"avx512_vnni"}, 64, reps=1)
    assert list(measured.gflops) == ["fp32", "int8"] and min(measured.gflops.values()) > 0


def test_machine_reports_every_pass_and_the_best_is_the_roof():
    m = asdict(measure_machine(quick=True, passes=3))
    passes = m["bandwidth_passes"]
    assert len(passes) == 3 and set(passes[0]) == {"copy_gbs", "triad_gbs", "at_s"}
    assert m["bandwidth_gbs"] == max(max(p["copy_gbs"], p["triad_gbs"]) for p in passes)
    assert m["copy_gbs"] == max(p["copy_gbs"] for p in passes)  # the old fields: still there
    assert m["gemm_gflops"] == m["compute_by_dtype"]["fp32"]
    assert m["compute_gflops"] == max(m["compute_by_dtype"].values())
    assert m["compute_by_dtype"][m["compute_dtype"]] == m["compute_gflops"]
    assert "torch" in m["compute_method"]


def test_roofline_fraction_uses_best_bandwidth_and_compute_roof():
    """bytes / best-of-N bandwidth and flops / the compute roof (not the fp32 GEMM rate)."""
    cost = StepCost(65536, 6_000_000_000, 2_000_000_000, 400_000_000_000, 0.0, 1)
    machine = {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0, "compute_gflops": 400.0}
    row = roofline_row("artifact", cost, 0.5, machine)
    assert row.floor_s == pytest.approx(8e9 / 20e9)
    assert row.flops_floor_s == pytest.approx(400e9 / 400e9)
    assert row.roof_s == pytest.approx(1.0) and row.roof_frac == pytest.approx(2.0)
    assert row.bandwidth_frac == pytest.approx(16.0 / 20.0)
    old = roofline_row("artifact", cost, 0.5, {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0})
    assert old.flops_floor_s == pytest.approx(4.0)  # a record without a compute roof: fp32


# ---- --contend N --------------------------------------------------------------------------------


def test_contending_runs_busy_loops_at_nice_19_and_stops_them():
    from dsv41.compiler.tools.bench.contend import contending

    with contending(2) as c:
        assert c.processes == 2 and len(c.pids) == 2 and c.to_dict() == {"processes": 2, "nice": 19}
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in c.pids] == [19, 19]
    for pid in c.pids:  # reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with contending(0) as none:
        assert none.pids == ()
    with pytest.raises(
        ValueError, match="--contend takes a number of busy-loop processes >= 0, got -1."
    ):
        with contending(-1):
            pass


def test_contend_option_and_report():
    from dsv41.compiler.tools.bench.e2e_records import (
        BenchOptions,
        BenchReport,
        DecodeCell,
        contention,
    )
    from dsv41.compiler.tools.cli.main import main

    with pytest.raises(ValueError, match="--contend must be a number of processes >= 0, got -2."):
        BenchOptions(contend=-2).validate()
    with pytest.raises(SystemExit):
        main(["bench", "--contend", "-1"])
    report = BenchReport(BenchOptions(contend=1, contexts=(64,)), {}, {}, None, "w")
    assert contention(BenchReport(BenchOptions(), {}, {}, None, "w")) is None
    report.decode.append(DecodeCell("artifact", 64, samples_s=[0.010, 0.012, 0.011]))
    report.contended.append(DecodeCell("artifact", 64, samples_s=[0.013, 0.0143, 0.020]))
    c = contention(report)
    assert (c["processes"], c["nice"], c["target_ratio"]) == (1, 19, 1.3)
    row = c["rows"][0]
    assert (row["quiet_median_s"], row["contended_median_s"]) == (0.011, 0.0143)
    assert row["ratio"] == pytest.approx(1.3) and row["quiet_min_s"] == 0.010


def test_roofline_row_names_its_compute_roof():
    cost = StepCost(4096, 1_000_000, 0, 2_000_000_000, 0.0, 1)
    assert (
        roofline_row(
            "eager",
            cost,
            None,
            {"bandwidth_gbs": 1.0, "gemm_gflops": 100.0, "compute_gflops": 250.0},
        ).compute_gflops
        == 250.0
    )
    assert (
        roofline_row(
            "eager", cost, None, {"bandwidth_gbs": 1.0, "gemm_gflops": 100.0}
        ).compute_gflops
        == 100.0
    )
