"""`dsv41 bench` (e2e.py): the report of a run as text (`format_report`), as the JSON document
(`report_json`, schema `SCHEMA`) and as plots (`write_plots`).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dsv41.compiler.tools.bench.e2e_records import (
    LABELS,
    SCHEMA,
    TARGET_VS_COMPILE,
    TARGET_VS_EAGER,
    TIER_LABELS,
    BenchReport,
    Impl,
    contention,
    new_session_speedup,
    ratios,
    targets,
)
from dsv41.compiler.tools.bench.measure import gib, ms, pct, table, times
from dsv41.compiler.tools.bench.profile import format_layers

# ---- output -------------------------------------------------------------------------------------


def format_report(report: BenchReport) -> str:
    o, m = report.options, report.machine
    impls = list(o.impls)
    out = [f"machine: {m['cpu']}, {m['cores']} cores; threads torch {report.threads['torch']}, "
           f"TVM {report.threads['tvm']}; bandwidth {m['bandwidth_gbs']:.1f} GB/s, fp32 GEMM "
           f"{m['gemm_gflops']:.1f} GFLOP/s; load avg start {report.load_avg['start'][0]:.2f}, "
           f"end {report.load_avg.get('end', [math.nan])[0]:.2f}",
           f"weights: {report.weights}; artifact: {report.artifact}", "",
           "decode, batch 1, one token from a synthetic cache of N positions (median of "
           f"{o.reps} interleaved steps):"]
    rows = []
    for n in (o.contexts if report.decode else ()):  # no decode rows when nothing decoded
        cells = [report.cell(i, n) for i in impls]
        r = next(x for x in ratios(report) if x["context"] == n)
        rows.append([str(n), *[ms(c.median_s) if c and not c.skipped else "skipped"
                               for c in cells], _ratio(r, Impl.EAGER), _ratio(r, Impl.COMPILE),
                     f"{max((c.load_avg or 0) for c in cells):.2f}"])
    out.append(table(["context", *[f"{i} ms/tok" for i in impls], "art/eager", "art/compile",
                       "load"], rows))
    skipped = [c for c in report.decode if c.skipped]
    for c in skipped:
        out.append(f"  skipped {c.impl} @ {c.context}: {c.skipped}")
    passes = m.get("bandwidth_passes") or ()
    out += ["", f"roofline (one decode step; bandwidth {m['bandwidth_gbs']:.1f} GB/s, the best of "
            f"{len(passes) or 1} passes, compute roof "
            f"{m.get('compute_gflops') or m['gemm_gflops']:.1f} GFLOP/s "
            f"({m.get('compute_dtype', 'fp32')})):"]
    rows = []
    for r in report.roofline:
        rows.append([str(r.context), r.impl, f"{r.weight_bytes / 1e6:.0f}",
                     f"{r.kv_bytes / 1e6:.1f}", f"{r.flops / 1e9:.2f}", ms(r.floor_s),
                     ms(r.flops_floor_s), ms(r.seconds),
                     "-" if r.achieved_gbs is None else f"{r.achieved_gbs:.2f}",
                     pct(r.bandwidth_frac), pct(r.compute_frac), pct(r.roof_frac)])
    out.append(table(["context", "impl", "weights MB", "KV MB", "GFLOP", "floor",
                       "flop floor", "time", "GB/s", "of BW", "of peak", "of roof"], rows))
    out.append("  floor: bytes / bandwidth; flop floor: FLOPs / the compute roof; of roof: the "
               "larger floor / time")
    if report.compile_s:
        out += ["", "compile: " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                             report.compile_s.items())]
    if report.prefill:
        out += ["", f"prefill (CED from an empty cache, chunks of {o.prefill_chunk_tokens}, "
                f"median of up to {o.prefill_reps}; peak RSS of the prefill; roofline against "
                f"the fp32 GEMM rate {m['gemm_gflops']:.1f} GFLOP/s and the best matrix rate "
                f"of the prefill's dtypes):"]
        out.append(table(["impl", "tokens", "median", "tokens/s", "peak RSS", "weights",
                           "cache", "peak-w-c", "GFLOP", "GFLOP/s", "of GEMM", "of matrix",
                           "note"],
                          [[p.impl, str(p.tokens), ms(p.median_s),
                            "-" if p.tokens_per_s is None else f"{p.tokens_per_s:.1f}",
                            gib(p.peak_rss_bytes), gib(p.weights_bytes), gib(p.cache_bytes),
                            gib(p.peak_over_weights_cache_bytes),
                            "-" if p.flops is None else f"{p.flops / 1e9:.0f}",
                            "-" if p.achieved_gflops is None else f"{p.achieved_gflops:.1f}",
                            pct(p.gemm_frac),
                            "-" if p.matrix_frac is None else
                            f"{pct(p.matrix_frac)} ({p.matrix_dtype})",
                            p.skipped or ""] for p in report.prefill]))
    if report.tiers:
        out += ["", f"time to first token per turn (one sample each; turn 1 {o.tier_context} "
                f"tokens, turns 2-3 {o.tier_suffix} new tokens; then a new session in a new "
                f"engine: turn 1's prompt + {o.tier_suffix} new tokens):"]
        out.append(table(["impl", "tier", "served by", "TTFT", "restore", "prefill",
                           "replayed"],
                          [[t.impl, TIER_LABELS[t.expected], t.tier, ms(t.ttft_s),
                            ms(t.seconds.get("restore")), ms(t.seconds.get("prefill")),
                            str(t.replayed)] for t in report.tiers]))
        for impl, x in new_session_speedup(report).items():
            out.append(f"{impl}: prefix hit in a new session reaches its first token {x:.1f}x "
                       f"faster than the cold turn")
    tg = targets(report)
    out += ["", f"bar at {tg['context']}: artifact vs torch.compile {times(tg['vs_compile'])} "
            f"(need {TARGET_VS_COMPILE:g}x: {_verdict(tg['met_vs_compile'])}), vs eager "
            f"{times(tg['vs_eager'])} (need {TARGET_VS_EAGER:g}x: {_verdict(tg['met_vs_eager'])})"]
    if report.profile:
        out += ["", format_profile(report.profile)]
    cont = contention(report)
    if cont:
        out += ["", f"decode beside {cont['processes']} busy loop(s) at nice {cont['nice']} "
                f"(median; bar: at most {cont['target_ratio']}x the quiet step):"]
        out += [f"  {r['impl']} @ {r['context']}: quiet {ms(r['quiet_median_s'])}, contended "
                f"{ms(r['contended_median_s'])}, {times(r['ratio'])}" for r in cont["rows"]]
    out += [f"note: {n}" for n in report.notes]
    return "\n".join(out)


def _ratio(r: dict, other: str) -> str:
    if r[f"vs_{other}"] is None and r.get(f"vs_{other}_at_least"):
        return f">{r[f'vs_{other}_at_least']:.1f}x"
    return times(r[f"vs_{other}"])


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else "met" if met else "NOT met"


def format_profile(p: dict) -> str:
    out = [f"profile of one decode step at {p['context']}:"]
    for impl in (Impl.ARTIFACT, Impl.EAGER, Impl.COMPILE):
        rows = p.get(impl)
        if rows:
            out.append(f"  {impl} (top {len(rows)} by time):")
            out += [f"    {r['ms']:9.2f} ms {r['share'] * 100:5.1f}% {r['calls']:5d}x  "
                    f"{r['name'][:70]}" for r in rows]
        elif p.get(f"{impl}_error"):
            out.append(f"  {impl}: no profile ({p[f'{impl}_error']})")
    layers = p.get("artifact_layers") or {}
    if layers:
        out.append("  artifact kernels per layer kind (decode; prefill: one chunk of "
                   f"{layers.get('prefill', {}).get('tokens', '-')} tokens):")
        for phase, prof in layers.items():
            out += ["  " + line for line in format_layers(phase, prof)]
    return "\n".join(out)


def report_json(report: BenchReport) -> dict:
    o = asdict(report.options)
    o = {k: (str(v) if isinstance(v, Path) else v) for k, v in o.items()}
    return {"schema": SCHEMA, "options": o, "machine": report.machine,
            "threads": report.threads, "artifact": report.artifact, "weights": report.weights,
            "load_avg": report.load_avg,
            "decode": [c.as_dict() for c in report.decode], "ratios": ratios(report),
            "roofline": [asdict(r) for r in report.roofline],
            "prefill": [{**asdict(p), "median_s": p.median_s, "tokens_per_s": p.tokens_per_s}
                        for p in report.prefill],
            "ttft": [asdict(t) for t in report.tiers], "compile_s": report.compile_s,
            "ttft_new_session_speedup": new_session_speedup(report),
            "targets": targets(report), "profile": report.profile, "notes": report.notes,
            "contended": [c.as_dict() for c in report.contended],
            "contention": contention(report)}


def write_plots(report: BenchReport, out_dir: Path) -> list[Path]:
    """decode_vs_context.png (ms per token against context, log-x, with the roofline floor) and
    phases.png (TTFT per tier split into restore / prefill, and the step's top kernels)."""
    import matplotlib  # optional, and slow to import: only when plots are asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in report.options.impls:
        pts = [(c.context, c.median_s * 1e3) for c in report.decode
               if c.impl == impl and c.median_s]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[impl])
    floor = sorted({(r.context, r.floor_s * 1e3) for r in report.roofline})
    if floor:
        ax.plot(*zip(*floor, strict=True), "k--", label="roofline floor (bytes / bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (positions in the cache)")
    ax.set_ylabel("ms per decoded token")
    ax.set_title(f"decode step, {report.options.preset} preset, batch 1")
    ax.grid(alpha=0.3)
    ax.legend()
    p = out_dir / "decode_vs_context.png"
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)

    prof = (report.profile or {}).get(Impl.ARTIFACT)
    fig, axes = plt.subplots(1, 2 if prof else 1, figsize=(13 if prof else 7, 4.5))
    axes = np.atleast_1d(axes)
    ax = axes[0]
    labels, restore, prefill = [], [], []
    for t in report.tiers:
        labels.append(f"{t.impl}\n{TIER_LABELS[t.expected]}")
        restore.append(t.seconds.get("restore", 0.0) * 1e3)
        prefill.append(t.seconds.get("prefill", 0.0) * 1e3)
    if labels:
        x = np.arange(len(labels))
        ax.bar(x, restore, label="restore")
        ax.bar(x, prefill, bottom=restore, label="prefill")
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_yscale("log")
        ax.legend()
    ax.set_ylabel("ms")
    ax.set_title("time to first token by tier and phase")
    if prof:
        ax = axes[1]
        names = [r["name"][:40] for r in prof][::-1]
        ax.barh(names, [r["ms"] for r in prof][::-1])
        ax.set_xlabel("ms per decode step")
        ax.set_title(f"artifact decode step at {report.profile['context']}: top kernels")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    p = out_dir / "phases.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths
