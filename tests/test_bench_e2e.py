"""`dsv41 bench` (compiler/tools/bench/e2e.py, synthetic.py): the synthetic cache matches a
really prefilled one in everything but its values, a reset step is repeatable, and the report's
arithmetic, budget skipping, JSON and plots. No timed asserts: timings are whatever the machine
gives."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from dsv41.compiler.tools.bench import e2e as B
from dsv41.compiler.tools.bench import synthetic as S
from dsv41.compiler.tools.bench.measure import interleaved_times, parse_tokens
from dsv41.compiler.tools.cli.main import main as cli_main
from dsv41.graph.cost import decode_step_cost
from dsv41.graph.formats import torch_dequant_fp4_kv, torch_dequant_fp8, torch_dequant_mxfp4

N = 32  # a multiple of every ratio, past the small model's window


def test_parse_tokens():
    assert parse_tokens("4K,64K, 1M,512") == (4096, 65536, 1 << 20, 512)
    for bad in ("", "x", "0", "-4K"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def _rows_filled(t: torch.Tensor) -> torch.Tensor:
    return (t[0] != 0).flatten(1).any(-1)


@pytest.fixture(scope="module")
def synthetic(small_model):
    return S.synthetic_cache(small_model, N, seed=0)


def test_interleaved_times_take_every_call_in_turn_after_an_untimed_round():
    order = []
    times = interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                              2)
    assert order == ["a", "b"] * 3  # round 0 (untimed), then 2 timed rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}
    assert all(t >= 0.0 for v in times.values() for t in v)


def test_synthetic_cache_matches_a_prefilled_one(small_model, synthetic):
    """Same structure as N really prefilled tokens: pos, index-K pointer, Engram lookback
    shape, the filled ring slots and store rows, empty tails; and every entry decodes to finite
    values (format-valid codes and scales)."""
    from dsv41.graph import phases
    from dsv41.graph.cache import new_cache

    m = small_model
    pad = m.engram.pad_id if m.engram is not None else None
    real = new_cache(m.plan, 1, N + 64, engram_pad=pad)
    phases.prefill_exact(m, real, torch.randint(3, m.args.vocab_size - 1, (1, N)))
    syn = synthetic
    assert int(syn.pos) == int(real.pos) == N
    assert int(syn.index_owner) == int(real.index_owner)
    assert (syn.engram_history is None) == (real.engram_history is None)
    if syn.engram_history is not None:
        assert syn.engram_history.shape == real.engram_history.shape
    assert syn.windows.keys() == real.windows.keys() and syn.stores.keys() == real.stores.keys()
    for lay, ring in syn.windows.items():
        assert torch.equal(_rows_filled(ring.scales), _rows_filled(real.windows[lay].scales))
        assert torch.isfinite(torch_dequant_fp8(ring.codes, ring.scales)).all()
    for lay, st in syn.stores.items():
        rs = real.stores[lay]
        assert st.capacity == rs.capacity
        assert torch.equal(_rows_filled(st.kv_scales), _rows_filled(rs.kv_scales))
        assert int(_rows_filled(st.kv_scales).sum()) == N // st.ratio
        assert torch.isfinite(torch_dequant_fp4_kv(st.kv_codes, st.kv_scales)).all()
        if st.k_codes is not None:
            assert torch.equal(_rows_filled(st.k_scales), _rows_filled(rs.k_scales))
            assert torch.isfinite(torch_dequant_mxfp4(st.k_codes, st.k_scales)).all()
        if st.tail_kv is not None:  # N is a multiple of the ratio: the tails are empty
            assert torch.equal(st.tail_kv, rs.tail_kv)
            assert torch.equal(st.tail_score, rs.tail_score)


def test_reset_step_is_repeatable(small_model, synthetic):
    """A decode step from the synthetic cache is finite, and after StepState.restore the next
    step starts from the same state (same logits, pos back to N)."""
    from dsv41.graph import phases

    state = S.StepState.of(synthetic)
    tok = torch.tensor([[B.DECODE_TOKEN]])
    a = phases.decode_step(small_model, synthetic, tok).logits
    assert int(synthetic.pos) == N + 1 and torch.isfinite(a).all()
    state.restore(synthetic)
    assert int(synthetic.pos) == N
    b = phases.decode_step(small_model, synthetic, tok).logits
    state.restore(synthetic)
    assert torch.equal(a, b)


def test_synthetic_cache_rejects_partial_groups(small_model):
    with pytest.raises(ValueError, match="multiple"):
        S.synthetic_cache(small_model, N + 1)


# ---- budget and interleaving, with stand-in implementations --------------------------------------


def _runner(name: str, seconds: float, log: list):
    def step(cache, tok):
        log.append(name)
        time.sleep(seconds)
        cache.pos = cache.pos + 1
        return SimpleNamespace(logits=torch.full((1, 1, 4), seconds))
    return step


def test_budget_skips_and_interleaves(small_model):
    from dsv41.graph.cache import new_cache

    cache = new_cache(small_model.plan, 1, 64)
    log: list[str] = []
    runners = {"artifact": _runner("artifact", 0.0, log), "eager": _runner("eager", 0.05, log),
               "compile": _runner("compile", 0.0, log)}
    opts = B.BenchOptions(reps=4, budget_s=0.04)
    cells = {c.impl: c for c in B.bench_decode_context(runners, cache, 4096, opts, {},
                                                       say=lambda s: None)}
    # eager's first step is over the budget: no samples, and the reason says so
    assert cells["eager"].samples_s == [] and "over the budget" in cells["eager"].skipped
    assert cells["eager"].median_s is None and cells["eager"].first_s >= 0.05
    assert len(cells["artifact"].samples_s) == 4 and cells["artifact"].skipped is None
    # rotating order: the first two reps start with different implementations
    assert log[:3] == ["artifact", "eager", "compile"] and log[3] == "compile"
    assert int(cache.pos) == 0  # put back after the last step
    assert cells["artifact"].logits_diff == pytest.approx(0.05)
    # a later context scaled from this one is skipped before it runs
    prev = B.DecodeCell("artifact", 4096, samples_s=[1.0])
    why = B.projected_skip(B.DecodeCell("artifact", 65536), prev, budget_s=10.0)
    assert why and "projected 16.0 s" in why
    skipped_prev = B.DecodeCell("eager", 4096, skipped="x")
    assert "skipped at 4096" in B.projected_skip(B.DecodeCell("eager", 8192), skipped_prev, 10)
    # a compiling implementation's first step is outside the budget
    cells = {c.impl: c for c in B.bench_decode_context(
        {"compile": _runner("compile", 0.05, [])}, cache, 4096, opts, {}, say=lambda s: None,
        compiles=frozenset({"compile"}))}
    assert cells["compile"].skipped is None and cells["compile"].samples_s


# ---- arithmetic, JSON, table and plots ----------------------------------------------------------


MACHINE = {"cpu": "test", "cores": 2, "bandwidth_gbs": 10.0, "gemm_gflops": 100.0}


def _report(small_model) -> B.BenchReport:
    opts = B.BenchOptions(preset="small", contexts=(4096, 65536), tier_context=8)
    r = B.BenchReport(opts, dict(MACHINE), {"torch": 2, "tvm": 2, "requested": 2}, "art", "w",
                      load_avg={"start": [1.0, 1.0, 1.0], "end": [2.0, 2.0, 2.0]})
    times = {("artifact", 4096): 0.1, ("eager", 4096): 1.0, ("compile", 4096): 0.25,
             ("artifact", 65536): 0.2, ("eager", 65536): 0.6, ("compile", 65536): None}
    for (impl, n), t in times.items():
        c = B.DecodeCell(impl, n, samples_s=[] if t is None else [t, t * 2, t], first_s=t,
                         skipped=None if t else "projected 99 s per step > budget 60 s",
                         load_avg=1.5)
        r.decode.append(c)
        r.roofline.append(B.roofline_row(impl, decode_step_cost(small_model.args, n),
                                         c.median_s, r.machine))
    r.tiers.append(B.TierRow("artifact", "cold", "cold", 8, 0.5, {"restore": 0.01,
                                                                 "prefill": 0.49}, 8, 0))
    r.tiers.append(B.TierRow("artifact", "prefix", "prefix-new-session", 4, 0.02,
                             {"restore": 0.005, "prefill": 0.015}, 4, 4, 8))
    r.prefill.append(B.PrefillRow("artifact", 64, (0.5,)))
    r.profile = {"context": 65536, "artifact": [{"name": "k", "calls": 2, "ms": 3.0,
                                                 "share": 0.5}]}
    return r


def test_ratios_roofline_and_targets(small_model):
    r = _report(small_model)
    rat = {x["context"]: x for x in B.ratios(r)}
    assert rat[4096]["vs_eager"] == pytest.approx(10.0)
    assert rat[4096]["vs_compile"] == pytest.approx(2.5)
    assert rat[65536]["vs_eager"] == pytest.approx(3.0) and rat[65536]["vs_compile"] is None
    assert rat[65536]["vs_compile_at_least"] is None  # never ran: no bound either
    r.cell("compile", 65536).first_s = 2.0  # one step over the budget bounds the ratio
    assert B.ratios(r)[1]["vs_compile_at_least"] == pytest.approx(10.0)
    r.cell("compile", 65536).first_s = None
    row = next(x for x in r.roofline if x.impl == "artifact" and x.context == 4096)
    cost = decode_step_cost(small_model.args, 4096)
    assert row.achieved_gbs == pytest.approx(cost.bytes / 0.1 / 1e9)
    assert row.bandwidth_frac == pytest.approx(cost.bytes / 0.1 / 1e9 / 10.0)
    assert row.compute_frac == pytest.approx(cost.flops / 0.1 / 1e9 / 100.0)
    assert row.floor_s == pytest.approx(cost.bytes / 10e9)
    assert row.flops_floor_s == pytest.approx(cost.flops / 100e9)
    assert row.roof_s == pytest.approx(max(cost.bytes / 10e9, cost.flops / 100e9))
    assert row.roof_frac == pytest.approx(row.roof_s / 0.1)
    t = B.targets(r)
    assert t["met_vs_eager"] is False and t["met_vs_compile"] is None
    assert B.speedup(None, 1.0) is None and B.speedup(2.0, 1.0) == 2.0


def test_the_roof_resampled_at_the_end_is_the_best_of_both_samples(small_model):
    """`resample_roof`: the bandwidth the best pass of both samples, each dtype's matrix rate
    the faster, both samples kept (`roof_samples`), and every roofline and prefill fraction
    recomputed against the merged roof (a slow first sample no longer flatters the step)."""
    r = _report(small_model)
    r.machine.update(bandwidth_passes=({"copy_gbs": 9.0, "triad_gbs": 10.0, "at_s": 0.0},),
                     copy_gbs=9.0, triad_gbs=10.0,
                     compute_by_dtype={"fp32": 100.0, "bf16": 300.0}, compute_gflops=300.0,
                     compute_dtype="bf16")
    r.prefill = [B.PrefillRow("artifact", 64, (0.5,), achieved_gflops=150.0, gemm_frac=1.5,
                              matrix_frac=0.5, matrix_dtype="bf16")]
    before = next(x for x in r.roofline if x.impl == "artifact" and x.context == 4096)
    end = {**MACHINE, "bandwidth_gbs": 20.0, "copy_gbs": 20.0, "triad_gbs": 18.0,
           "gemm_gflops": 90.0, "compute_by_dtype": {"fp32": 90.0, "bf16": 1500.0},
           "bandwidth_passes": ({"copy_gbs": 20.0, "triad_gbs": 18.0, "at_s": 0.0},)}
    said = []
    B.resample_roof(r, small_model, end, said.append)
    m = r.machine
    assert (m["bandwidth_gbs"], m["copy_gbs"], m["triad_gbs"]) == (20.0, 20.0, 18.0)
    assert len(m["bandwidth_passes"]) == 2 and m["gemm_gflops"] == 100.0
    assert m["compute_by_dtype"] == {"fp32": 100.0, "bf16": 1500.0}
    assert (m["compute_dtype"], m["compute_gflops"]) == ("bf16", 1500.0)
    assert [x["bandwidth_gbs"] for x in m["roof_samples"]] == [10.0, 20.0]
    after = next(x for x in r.roofline if x.impl == "artifact" and x.context == 4096)
    assert after.seconds == before.seconds == 0.1
    assert after.bandwidth_frac == pytest.approx(before.bandwidth_frac / 2)
    assert after.compute_gflops == 1500.0
    assert r.prefill[0].matrix_frac == pytest.approx(0.1)
    assert r.prefill[0].gemm_frac == pytest.approx(1.5)
    assert "20.0 GB/s (start 10.0)" in said[0] and "bf16 1500 (start 300)" in said[0]


def test_json_table_and_plots(small_model, tmp_path):
    r = _report(small_model)
    d = json.loads(json.dumps(B.report_json(r)))
    assert d["schema"] == B.SCHEMA
    assert {"options", "machine", "threads", "decode", "ratios", "roofline", "prefill", "ttft",
            "compile_s", "targets", "profile", "load_avg"} <= set(d)
    assert d["threads"] == {"torch": 2, "tvm": 2, "requested": 2}
    skipped = [c for c in d["decode"] if c["skipped"]]
    assert len(skipped) == 1 and skipped[0]["median_s"] is None
    assert d["prefill"][0]["tokens_per_s"] == pytest.approx(128.0)
    assert d["ttft"][1]["reused_tokens"] == 8
    assert d["ttft_new_session_speedup"] == {"artifact": pytest.approx(25.0)}
    text = B.format_report(r)
    assert "skipped compile @ 65536: projected" in text and "NOT met" in text
    assert "prefix hit, new session" in text and "25.0x faster than the cold turn" in text
    paths = B.write_plots(r, tmp_path)
    assert [p.name for p in paths] == ["decode_vs_context.png", "phases.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_cli_dispatch(capsys):
    with pytest.raises(SystemExit) as e:  # the parser tree's error: the sub-verbs it knows
        cli_main(["bench", "nonsense"])
    assert e.value.code == 2
    assert "invalid choice: 'nonsense' (choose from 'e2e', 'kernels'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "--impls"])  # the e2e parser owns the options
    with pytest.raises(ValueError, match="Unknown implementations"):
        B.BenchOptions(impls=("tvm",)).validate()


def test_check_contexts_refuses_undecodable_contexts_before_measuring(small_model):
    """A context of max_seq_len positions leaves no room for the decoded token (a sweep once ran
    to its last cell and died on this); an odd one has no synthetic cache."""
    top = max(p.ratio for p in small_model.plan.kv_sources)
    limit = small_model.args.max_seq_len
    longest = (limit - 1) // top * top
    S.check_contexts(small_model, (top, longest))
    for bad in (0, limit, longest + top, top + 1):
        with pytest.raises(ValueError, match="Cannot decode from a context"):
            S.check_contexts(small_model, (top, bad))


@pytest.mark.slow
def test_prefill_rows_per_length_with_memory_and_roofline(small_model):
    """A row per prompt length: the samples, the chunk, peak RSS around the prefill (at least
    what was resident before it), the cache the prompt filled, and the prefill's own roofline
    from graph.cost (CED, the same chunks) against the machine's GEMM rate."""
    from dsv41.graph.cache import new_cache
    from dsv41.graph.cost import PrefillMode, prefill_cost
    from dsv41.graph.phases_api import GraphPhases

    opts = B.BenchOptions(preset="small", prefill_lengths=(24, 40), prefill_chunk_tokens=7,
                          prefill_reps=1, budget_s=600.0)
    rows = B.bench_prefill({"eager": GraphPhases()}, small_model, opts, {"gemm_gflops": 50.0})
    assert [(r.impl, r.tokens, len(r.samples_s), r.chunk_tokens) for r in rows] == [
        ("eager", 24, 1, 7), ("eager", 40, 1, 7)]
    for r in rows:
        cost = prefill_cost(small_model.args, r.tokens, mode=PrefillMode.CED, chunk_tokens=7)
        assert (r.flops, r.cost_bytes) == (cost.flops, cost.bytes)
        assert r.achieved_gflops == pytest.approx(cost.flops / r.median_s / 1e9)
        assert r.gemm_frac == pytest.approx(r.achieved_gflops / 50.0)
        pad = small_model.engram.pad_id
        want = sum(new_cache(small_model.plan, 1, r.tokens + 64, engram_pad=pad).nbytes()
                   .values())
        assert r.cache_bytes == want and r.weights_bytes == B.model_bytes(small_model) > 0
        if r.peak_rss_bytes is not None:  # Linux
            assert r.peak_rss_bytes >= r.rss_before_bytes > r.weights_bytes
            assert r.peak_over_weights_cache_bytes == \
                r.peak_rss_bytes - r.weights_bytes - r.cache_bytes
    text = B.format_report(B.BenchReport(opts, dict(MACHINE), {"torch": 2, "tvm": 2},
                                         None, "w", prefill=rows,
                                         load_avg={"start": [0.0], "end": [0.0]}))
    assert "chunks of 7" in text and "peak RSS" in text
    with pytest.raises(ValueError, match="--prefill-chunk"):
        B.BenchOptions(prefill_chunk_tokens=1).validate()


def test_prefill_matrix_roof_is_the_best_of_fp32_and_bf16():
    prefill_matrix_roof = B.prefill_matrix_roof
    rates = {"fp32": 195.0, "bf16": 422.5, "int8": 873.5}  # int8: the index sweep's only
    assert prefill_matrix_roof({"compute_by_dtype": rates}) == ("bf16", 422.5)
    assert prefill_matrix_roof({"compute_by_dtype": {"fp32": 195.0}}) == ("fp32", 195.0)
    assert prefill_matrix_roof({"gemm_gflops": 195.0}) == (None, None)
    assert prefill_matrix_roof(None) == (None, None)
