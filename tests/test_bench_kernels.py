"""`dsv41 bench kernels` (compiler/bench_kernels.py): the harness at tiny sizes (--quick).

What is checked: the JSON schema, that every number is positive and finite, that the derived
columns are the stated arithmetic of the measured ones (GB/s = bytes / time, roofline = max of
the two roofs, speedups = time ratios), that the kernel outputs the harness compared agree with
the oracle (so it timed the right op on the right inputs), that `moe` times the six-kernel split
chain the compiled model runs (built for the artifact's row hint, each kernel timed too), the
traffic formulas at the bench sizes by hand, the timer's budget rule, and the CLI's refusals.
Not checked: the speed itself (the machine is shared)."""

from __future__ import annotations

import json
import math
import os
import re
import time

import pytest
import torch

from dsv41.compiler.tools.bench import kernels as bench
from dsv41.compiler.tools.bench import measure
from dsv41.compiler.tools.cli.main import main as cli_main
from dsv41.graph import ops
from dsv41.graph.targets import get_target
from dsv41.schedules import moe

ROW_KEYS = {"case", "family", "dims", "bytes", "flops", "kernel_s", "eager_s", "compile_s", "gbs",
            "gflops", "frac_bw", "frac_peak", "roofline_s", "bound", "roofline_ratio",
            "speedup_eager", "speedup_compile", "samples", "tvm_compile_s", "torch_compile_s",
            "equal_fraction", "max_abs_diff", "note", "min_s",
            "median_s"}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    """One --quick run of every case through the CLI (no torch.compile: ~15 s)."""
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    rc = cli_main(["bench", "kernels", "--quick", "--no-compile", "--repeat", "3", "--budget",
                   "0.05", "--json", str(path)])
    assert rc == 0
    return json.loads(path.read_text())


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9)


@pytest.mark.slow  # the --quick run compiles every case: 40-60 s of the default suite
def test_report_schema_and_machine(quick_report):
    r = quick_report
    assert r["schema"] == bench.SCHEMA
    assert r["target"] == "cpu" and r["settings"]["quick"] is True
    assert set(r["formulas"]) == set(bench.FAMILIES)
    m = r["machine"]
    for key in ("copy_gbs", "triad_gbs", "bandwidth_gbs", "gemm_gflops", "cores"):
        assert m[key] > 0 and math.isfinite(m[key]), key
    assert m["bandwidth_gbs"] == max(m["copy_gbs"], m["triad_gbs"])
    # the kernels run on the cores the roofline (torch's GEMM) was measured on, not on TVM's
    # default of half the hardware threads
    assert m["tvm_threads"] == m["torch_threads"] or "TVM_NUM_THREADS" in os.environ
    if m["theoretical_gflops"] is not None:
        assert _close(m["theoretical_gflops"],
                      m["cores"] * m["clock_ghz"] * m["flops_per_cycle"])
    assert len(m["load_avg_start"]) == 3 and len(r["load_avg_end"]) == 3
    names = [row["case"] for row in r["rows"]]
    assert names == [c.name for c in bench.default_cases(quick=True)]


@pytest.mark.slow  # the --quick run compiles every case: 40-60 s of the default suite
def test_rows_are_positive_and_self_consistent(quick_report):
    m = quick_report["machine"]
    bw, peak = m["bandwidth_gbs"], m["gemm_gflops"]
    for row in quick_report["rows"]:
        name = row["case"]
        assert set(row) >= ROW_KEYS, name
        for key in ("bytes", "flops", "kernel_s", "eager_s", "gbs", "gflops", "roofline_s",
                    "roofline_ratio", "speedup_eager", "tvm_compile_s"):
            assert row[key] > 0 and math.isfinite(row[key]), (name, key)
        assert row["compile_s"] is None and row["speedup_compile"] is None  # --no-compile
        t = row["kernel_s"]
        assert _close(row["gbs"], row["bytes"] / t / 1e9), name
        assert _close(row["gflops"], row["flops"] / t / 1e9), name
        assert _close(row["frac_bw"], row["gbs"] / bw), name
        assert _close(row["frac_peak"], row["gflops"] / peak), name
        roof_bw, roof_fl = row["bytes"] / (bw * 1e9), row["flops"] / (peak * 1e9)
        assert _close(row["roofline_s"], max(roof_bw, roof_fl)), name
        assert row["bound"] == ("memory" if roof_bw >= roof_fl else "compute"), name
        assert _close(row["roofline_ratio"], t / row["roofline_s"]), name
        assert _close(row["speedup_eager"], row["eager_s"] / t), name
        assert 1 <= row["samples"]["kernel"] <= 3 and row["samples"]["eager"] >= 1, name
        assert row["median_s"]["kernel"] == t and row["median_s"]["eager"] == row["eager_s"]
        assert 0 < row["min_s"]["kernel"] <= t and 0 < row["min_s"]["eager"] <= row["eager_s"]


@pytest.mark.slow  # the --quick run compiles every case: 40-60 s of the default suite
def test_kernel_outputs_match_the_oracle(quick_report):
    """The harness compares the kernel's output with the eager oracle's on the timed inputs: the
    indexer's positions are exact; attention is bf16-rounding close (>= 99% equal in its own
    tests), fp8_linear within 1 bf16 ulp, the experts fp32-close, the dense GEMV's fp32 sums
    (another addition order than torch's, not rounded to bf16 here) within 1e-5; a harness that
    fed the kernel other inputs than the oracle would agree nowhere."""
    for row in quick_report["rows"]:
        if row["family"] == "indexer":
            assert row["equal_fraction"] == 1.0, row["case"]
        elif row["family"] == "gemv":
            assert row["max_abs_diff"] < 1e-5, (row["case"], row["max_abs_diff"])
        else:
            assert row["equal_fraction"] >= 0.8, (row["case"], row["equal_fraction"])
            assert row["max_abs_diff"] < 0.1, (row["case"], row["max_abs_diff"])


def _moe_funcs(row: dict) -> list[str]:
    d = row["dims"]
    plan = moe.moe_experts_plan("cpu", dim=d["dim"], inter=d["inter"], n_experts=d["n_experts"],
                                topk=d["topk"], n=d["n"], n_hint=d["hint"], rows=d.get("rows", 1))
    return [c.func for c in plan.calls]


@pytest.mark.slow  # the --quick run compiles every case: 40-60 s of the default suite
def test_moe_rows_time_the_split_chain(quick_report):
    """The moe cases time compiler/lower.py's chain (route, qdq, gate_up, qdq, down, combine;
    at one row on AVX-512 its two-call form),
    built for the artifact's row hint (1 at one row, None above; the verify entry's at 2 rows,
    hint 1), with each kernel's time in call order; the chain matches the oracle as closely as
    in tests/test_kernel_moe.py."""
    rows = [r for r in quick_report["rows"] if r["family"] == "moe"]
    assert [(r["dims"]["n"], r["dims"]["hint"], r["dims"].get("rows", 1)) for r in rows] == [
        (1, 1, 1), (8, None, 1), (2, 1, 6)]
    six = ["moe_route", "moe_qdq_x", "moe_gate_up", "moe_qdq_h", "moe_down", "moe_combine"]
    for row in rows:
        d = row["dims"]
        config = moe.moe_split_config(get_target("cpu"), dim=d["dim"], inter=d["inter"],
                                      n_experts=d["n_experts"], topk=d["topk"], n=d["hint"],
                                      rows=d.get("rows", 1))
        fused = ["moe_gate_up_route", "moe_down_combine"]  # decode's GEMVs, prefill's tiles
        assert list(row["parts"]) == _moe_funcs(row) == (
            fused if moe.fused_chain(config, get_target("cpu")) else six), row["case"]
        for name, part in row["parts"].items():
            assert part["time_s"] == part["median_s"] >= part["min_s"] > 0, (row["case"], name)
            assert 1 <= part["samples"] <= 3
        assert row["equal_fraction"] >= 0.99 and row["max_abs_diff"] < 0.1, row["case"]
    assert all("parts" not in r for r in quick_report["rows"] if r["family"] != "moe")
    text = bench.format_parts(quick_report["rows"])
    assert [line.split()[0] for line in text.splitlines()] == [r["case"] for r in rows]


def test_moe_chain_buffers_are_reused():
    """prepare binds every call to buffers allocated once: the chain run twice, or its last
    call (the combine) rerun alone, leaves the same y (in the tensor kernel_out names) as the
    oracle's."""
    case = next(c for c in bench.default_cases(quick=True) if c.name == "moe-n8")
    ex, _ = bench.compile_kernel("moe", "cpu", case.static)
    prep = bench.prepare(case, ex)
    prep.kernel()
    first = prep.kernel_out.clone()
    prep.kernel()
    prep.parts[list(prep.parts)[-1]]()  # the chain's last call: the combine
    assert torch.equal(prep.kernel_out, first)
    d = case.d()
    ref = ops.moe_experts(*prep.body_args)
    assert prep.body_args[-1] == d["swiglu_limit"] and ref.shape == (d["n"], d["dim"])
    assert float((first == ref).float().mean()) >= 0.99


def test_traffic_formulas_at_bench_sizes():
    """By hand, for the issue-4 shapes (bench preset)."""
    # wq_b GEMV: 512 x 32768 E4M3 weight, 1024 x 16 scale bytes, x and y in bf16
    assert bench.fp8_traffic(m=1, n=32768, k=512) == (
        2 * 512 + 32768 * 512 + 1024 * 16 + 2 * 32768, 2 * 32768 * 512)
    # one decode query: 128 FP8 window rows (512 B + 16 scales) + 512 FP4 rows (256 + 32)
    nbytes, flops = bench.attend_traffic(b=1, s=1, h=64, d=512, w=128, k=512)
    assert nbytes == 4 * 64 * 512 + 4 * 64 + 4 * 640 + 128 * 528 + 512 * 288
    assert flops == 4 * 64 * 512 * 640
    # 1M-entry sweep: 64 + 4 bytes per key
    nbytes, flops = bench.indexer_traffic(b=1, s=1, heads=32, dim=128, t=1 << 20, topk=512)
    assert nbytes == (1 << 20) * 68 + 2 * 32 * 128 + 2 * 32 + 8 + 4 * 512
    assert flops == (1 << 20) * (2 * 32 * 128 + 3 * 32)
    # a verify pass's shared sweep: 5 tokens whose picks name two stores read both
    nbytes, _ = bench.indexer_traffic(b=1, s=5, heads=32, dim=128, t=1 << 16, topk=512,
                                      picks=(0, 0, 1, 1, 1))
    assert nbytes == 2 * (1 << 16) * 68 + 5 * (2 * 32 * 128 + 2 * 32 + 8 + 4 * 512)
    # one token routed to 2 distinct experts of dim 1024, inter 512
    nbytes, flops = bench.moe_traffic(n=1, dim=1024, inter=512, topk=2, experts_used=2)
    per_expert = 2 * 512 * (512 + 32) + 1024 * (256 + 16)
    assert nbytes == 2 * per_expert + 2 * 1024 + 12 * 2 + 4 * 1024
    assert flops == 6 * 2 * 1024 * 512
    # the head: one bf16 row against an fp32 [8192, 1024] weight
    nbytes, flops = bench.gemv_traffic(m=1, groups=1, n=8192, k=1024, x_dtype="bfloat16",
                                       w_dtype="float32")
    assert nbytes == 2 * 1024 + 4 * 8192 * 1024 + 4 * 8192 and flops == 2 * 8192 * 1024


def test_bench_cases_use_the_preset_sizes():
    cases = {c.name: c.d() for c in bench.default_cases("bench", cold=64 << 20)}
    assert set(cases) == {"attend-s1", "attend-s2", "attend-s3", "attend-s4", "attend-s5",
                          "indexer-8K",
                          "indexer-64K", "indexer-256K", "indexer-1M", "indexer-shared-64K",
                          "indexer-verify5-64K", "fp8-gemv-m1",
                          "fp8-gemm-m128", "moe-n1", "moe-n128", "fp8-wq_a-m1", "fp8-wkv-m1",
                          "fp8-wo_b-m1", "fp8-shared_w1-m1", "fp8-shared_w2-m1", "gemv-wo_a-m1",
                          "gemv-head-m1", "gemv-verify-wo_a-m1", "gemv-verify-wo_a-m5",
                          "gemv-decode-wo_a-m1",
                          *(f"{f}-{form}-{w}{m}" for f, w in (("fp8", "wq_b-m"), ("moe", "n"))
                            for form in ("verify", "rowwise") for m in range(1, 7)),
                          *(f"fp8-{form}-wo_b-m{m}" for form in ("verify", "rowwise")
                            for m in range(1, 7))}
    assert cases["fp8-verify-wo_b-m5"] == {"n": 1024, "k": 4096, "hint": 1, "rows": 6, "m": 5,
                                           "copies": 16}
    # the verify entry's kernels at 1 + dspark_block_size rows, weights cycled through 64 MB+
    assert cases["fp8-verify-wq_b-m5"] == {"n": 32768, "k": 512, "hint": 1, "rows": 6, "m": 5,
                                           "copies": 4}
    assert cases["fp8-rowwise-wq_b-m5"]["rows"] == 1
    assert (cases["moe-verify-n3"]["rows"], cases["moe-verify-n3"]["copies"]) == (6, 6)
    assert cases["fp8-wo_b-m1"] == {"n": 1024, "k": 8 * 512, "hint": 1, "m": 1, "copies": 16}
    assert cases["fp8-wq_a-m1"] == {"n": 512, "k": 1024, "hint": 1, "m": 1, "copies": 128}
    # the bench preset's wo_a is the hub's FP8 (`wo_a_dtype`): E4M3 codes + tile scales
    assert cases["gemv-wo_a-m1"] == {"groups": 8, "n": 512, "k": 64 * 512 // 8,
                                     "x_dtype": "bfloat16", "w_dtype": "fp8", "m": 1}
    # decode's o-projection kernel (no rows: one row per group) from memory: 16 MB, 4 copies
    assert cases["gemv-decode-wo_a-m1"] == {**cases["gemv-wo_a-m1"], "copies": 4}
    assert cases["attend-s4"] == {"h": 64, "d": 512, "w": 128, "k": 512, "b": 1, "s": 4}
    assert cases["attend-s5"] == {"h": 64, "d": 512, "w": 128, "k": 512, "b": 1, "s": 5}
    assert cases["indexer-1M"]["t"] == 1 << 20 and cases["indexer-1M"]["heads"] == 32
    # the shared index-K pointer's sweep: a decode step's, a verify pass's (picks per token)
    assert cases["indexer-verify5-64K"] == {"heads": 32, "dim": 128, "topk": 512, "n_alt": 3,
                                            "b": 1, "s": 5, "t": 1 << 16,
                                            "picks": (0, 0, 1, 1, 1)}
    assert (cases["indexer-shared-64K"]["s"], cases["indexer-shared-64K"]["picks"]) == (1, (2,))
    assert (cases["fp8-gemm-m128"]["n"], cases["fp8-gemm-m128"]["k"]) == (32768, 512)
    assert cases["moe-n128"]["n_experts"] == 16 and cases["moe-n128"]["topk"] == 2
    # the compiled model's rows_hint (compiler/build.py ROWS_HINT): decode 1, prefill None
    assert cases["moe-n1"]["hint"] == 1 and cases["moe-n128"]["hint"] is None
    assert [c.name for c in bench.select_cases(bench.default_cases("bench", cold=64 << 20),
                                               ["fp8", "moe-n1"])] == \
        ["fp8-gemv-m1", "fp8-gemm-m128", "moe-n1", "fp8-wq_a-m1", "fp8-wkv-m1", "fp8-wo_b-m1",
         "fp8-shared_w1-m1", "fp8-shared_w2-m1",
         *(f"fp8-{form}-wq_b-m{m}" for form in ("verify", "rowwise") for m in range(1, 7)),
         *(f"fp8-{form}-wo_b-m{m}" for form in ("verify", "rowwise") for m in range(1, 7))]
    with pytest.raises(ValueError, match="Unknown case"):
        bench.select_cases(bench.default_cases("bench"), ["attention"])


def test_time_call_budget_rule():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.03)

    t = measure.time_call(slow, repeat=5, budget_s=0.01)  # slower than the budget: timed once
    assert (t.samples, t.number, len(calls)) == (1, 1, 2)  # warm-up + the one timed call
    assert t.median_s >= 0.03
    calls.clear()
    t = measure.time_call(slow, repeat=3, budget_s=10.0, warmed=True)
    assert (t.samples, t.number, len(calls)) == (3, 1, 4)  # sizing call + 3 samples
    assert 0.03 <= t.median_s < 0.3
    t = measure.time_call(lambda: None, repeat=2, budget_s=1.0)
    assert t.number > 1  # fast calls are looped so a sample outlasts the timer's resolution


def test_cli_refuses_cuda_and_unknown_cases(capsys):
    assert cli_main(["bench", "kernels", "--quick", "--target", "cuda-sm90"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert cli_main(["bench", "kernels", "--quick", "--cases", "nope"]) == 2
    assert "Unknown case" in capsys.readouterr().err
    assert cli_main(["bench", "kernels", "--quick", "--target", "tpu"]) == 2
    assert cli_main(["bench", "kernels", "--list", "--cases", "indexer"]) == 0
    out = capsys.readouterr().out
    assert "indexer-1M" in out and "attend" not in out


def test_table_is_aligned(tmp_path):
    """Two families' rows (an FP8 GEMV, the MoE chain with its parts) in one table: the quick
    run of every case is the slow tests' (`quick_report`)."""
    path = tmp_path / "kernels.json"
    assert cli_main(["bench", "kernels", "--quick", "--no-compile", "--cases", "fp8-wq_a-m1,moe-n1",
                     "--repeat", "3", "--budget", "0.05", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert sorted(r["case"] for r in report["rows"]) == ["fp8-wq_a-m1", "moe-n1"]
    lines = bench.format_table(report["rows"]).splitlines()
    assert len(lines) == 2 + len(report["rows"])
    # the 12 right-justified cells after the case name end at the same columns in every row
    ends = {tuple([m.end() for m in re.finditer(r"\S+", line)][1:13]) for line in lines[2:]}
    assert len(ends) == 1
    assert "machine:" in measure.format_machine(report["machine"])


@pytest.mark.slow
def test_torch_compile_column(tmp_path):
    """One tiny case with torch.compile of the oracle body (Inductor compiles for ~20-30 s)."""
    rows = bench.bench_kernels("bench", "cpu", ["fp8-gemv-m1"], 3, tmp_path / "c.json",
                               quick=True, budget_s=0.05, stat="min", progress=False)
    (row,) = rows
    assert row["compile_s"] > 0 and row["torch_compile_s"] > 0
    assert math.isclose(row["speedup_compile"], row["compile_s"] / row["kernel_s"])
    # the oracle body compiled (the usual case, said in the legend): no compile note; a busy
    # machine may add "eager timed once (slow)" when one eager call outlasts the budget
    assert "compile" not in row["note"], row["note"]
    assert row["kernel_s"] == row["min_s"]["kernel"]  # stat="min" below
    assert json.loads((tmp_path / "c.json").read_text())["rows"][0]["case"] == "fp8-gemv-m1"


def test_cycled_weights_fill_twice_the_last_level_cache():
    """On a machine with a 300 MB L3 the 64 MB of copies stayed in the cache (219% of the
    DRAM bandwidth): the copies fill cold_bytes(), twice the largest cache, 64 MB at least."""
    assert bench.cold_bytes() == max(64 << 20, 2 * bench.last_level_cache_bytes())
    big = {c.name: c.d() for c in bench.default_cases("bench", cold=600 << 20)}
    assert big["fp8-verify-wq_b-m1"]["copies"] == -(-(600 << 20) // (32768 * 512))  # 38
    assert big["fp8-wo_b-m1"]["copies"] == 150
    assert big["gemv-decode-wo_a-m1"]["copies"] == 38  # 600 MiB / 16 MiB (FP8), rounded up
    quick = {c.name: c.d() for c in bench.default_cases("bench", quick=True, cold=600 << 20)}
    assert all(d.get("copies", 1) == 1 for d in quick.values())
