"""`dsv41 bench kernels`: time each TIR kernel against its PyTorch oracle, on a roofline.

For every case the harness measures three implementations of one op on the same inputs:

* `kernel`:  the TVM kernel from `schedules/`, compiled once per static configuration and called
             through its packed function on zero-copy DLPack views (host-side index checks and
             tensor conversion are not timed). A kernel the compiled model runs as a chain is
             timed as that chain: `moe` is the six-kernel split of `schedules/moe/` that
             compiler/lower.py emits (route, qdq, gate_up, qdq, down, combine), built for the
             artifact's row hint, its intermediates allocated once outside the timed call (as
             Relax's memory plan reuses them), each kernel also timed alone (`parts`);
* `eager`:   the registered oracle `torch.ops.dsv41.<op>` (graph/ops.py) in eager mode;
* `compile`: `torch.compile` (defaults, dynamo reset per case) of the oracle's plain Python body.
             The registered custom op itself is opaque to Inductor (torch.compile of it runs the
             eager body, so it would measure eager again); the note column says so.

and puts the kernel on this machine's roofline: the memory bandwidth (best streaming copy/triad)
and the fp32 GEMM rate (torch.mm) are measured first, and each case states its compulsory bytes
and FLOPs (formulas in `FORMULAS` and in the `*_traffic` functions). The TIR kernels compute in
fp32, so fp32 GEMM is the compute roof they are held to; the one exception is the indexer sweep
on CPUs with AVX-512 VNNI, whose q.k dot runs on exact int8 products (4 per lane per
instruction) and can therefore beat the fp32 roof (ratio < 1: the FLOPs are counted the same
way, the roof is not moved to fit). Every side runs on the same cores: torch's threads, and
TVM's pool sized to match (`runtime.threads.default_tvm_pool`; TVM's own default is half the
hardware threads, which on this 2-vCPU VM put the kernels on 1 core against a 2-core roof).

Timing: up to `repeat` samples after a warm-up, each sample a loop long enough (>= ~10 ms) to
hide the timer; a measurement stops early at its time budget, and a call slower than the budget
is timed once (the 1M-entry oracle sweep takes ~10 s). Rows report the median (or, with
stat="min", the fastest sample: on a machine shared with other processes torch's eager ops, many
small OpenMP regions each waiting for a descheduled thread, vary by 10-100x; the TIR kernels,
one parallel region each, much less). The JSON keeps both.

Inputs stay the same across samples, so the caches are warm: with a 300 MB L3 a working set
below it can beat the DRAM roofline (ratio < 1), which the table shows rather than hides. The
exceptions are the decode and verify weight cases (`copies` in their names' dims): their
weights are cycled through twice the last-level cache of copies (`cold_bytes`), so each call
reads its weights from memory, as a decode step does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tvm
from tqdm import tqdm

from dsv41.compiler.build import tir_pipeline
from dsv41.compiler.kernels import bench_kernel
from dsv41.compiler.tools.bench.measure import (
    MIN_SAMPLE_S,
    Machine,
    Timing,
    format_machine,
    measure_machine,
    ms_cell,
    roof_point,
    table,
    time_call,
    times,
    write_json,
)
from dsv41.graph import formats as fmt
from dsv41.graph import ops
from dsv41.graph.config import preset
from dsv41.graph.targets import get_target
from dsv41.runtime.backends.tensors import to_tvm
from dsv41.runtime.backends.threads import default_tvm_pool
from dsv41.schedules import attention, gemm, indexer, moe

SCHEMA = "dsv41.bench.kernels/1"
FAMILIES = ("attend", "indexer", "fp8", "moe", "gemv")
COMPILE_NOTE = ("torch.compile (defaults, dynamo reset per case) of the oracle's plain Python "
                "body; the registered custom op is opaque to Inductor (compiling it times eager)")

ROW_FIELDS = {
    "bytes, flops": "the case's compulsory traffic and work (FORMULAS)",
    "kernel_s, eager_s, compile_s": "seconds per call (settings.stat of the samples): TVM "
                                    "kernel, eager oracle, torch.compile'd oracle body (None "
                                    "when skipped)",
    "min_s, median_s": "the fastest and the median sample of each",
    "gbs, gflops": "bytes / kernel_s, flops / kernel_s (in 1e9 per second)",
    "frac_bw, frac_peak": "gbs / machine bandwidth_gbs, gflops / machine gemm_gflops",
    "roofline_s, bound": "max(bytes / bandwidth, flops / gemm peak) and which term is larger",
    "roofline_ratio": "kernel_s / roofline_s",
    "speedup_eager, speedup_compile": "eager_s / kernel_s, compile_s / kernel_s",
    "tvm_compile_s": "seconds to schedule + build the kernel (shared by the cases of one static "
                     "configuration)",
    "torch_compile_s": "seconds of the first torch.compile'd call (compilation + one run)",
    "equal_fraction, max_abs_diff": "kernel output vs the eager oracle's on the timed inputs",
    "parts": "chained kernels only (moe): each kernel of the chain timed alone on the chain's "
             "buffers, in call order: {func: {time_s (settings.stat), min_s, median_s, "
             "samples}}",
}

FORMULAS = {
    "attend": "bytes = 2*b*s*h*d (q) + 2*b*s*h*d (out) + 4*h (sink) + 4*b*s*(w+k) (indices) + "
              "b*s*(w*(d + d/32) + k*(d/2 + d/16)) (gathered FP8 window + FP4 global entries, "
              "per query); flops = 4*b*s*h*d*(w+k) (QK and PV multiply-adds)",
    "indexer": "bytes = b*T*(D/2 + D/32) (MXFP4 keys; shared cases: per store the picks name) + "
               "2*b*s*H*D (q) + 2*b*s*H (weights) + "
               "8*b*s (lens) + 4*b*s*topk (positions); the bf16 score row the sweep writes and "
               "the select re-reads is an intermediate, not counted; flops = b*s*T*(2*H*D + "
               "3*H) (dots, relu, weight, head sum; the top-k select counts no flops)",
    "fp8": "bytes = 2*m*k (x) + n*k (E4M3 weight) + ceil(n/32)*k/32 (scales) + 2*m*n (y); "
           "flops = 2*m*n*k",
    "moe": "bytes = u*(2*inter*(dim/2 + dim/32) + dim*(inter/2 + inter/32)) (the u distinct "
           "routed experts' FP4 w1, w3, w2 + scales) + 2*n*dim (x) + 12*n*topk (weights, ids) + "
           "4*n*dim (y); flops = 6*n*topk*dim*inter (three GEMMs per routed token)",
    "gemv": "bytes = m*g*k*|x| (x, bf16 2 / fp32 4) + g*n*k*|w| (the weight as stored) + "
            "4*m*g*n (fp32 y); flops = 2*m*g*n*k (dense_gemv: the grouped o-projection, the head)",
}


# ---- cases ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmark point. `static` are the dims a kernel is compiled for (one compilation
    serves every case with the same family and static dims); `dims` the call's own sizes."""

    name: str
    family: str
    static: tuple[tuple[str, object], ...]
    dims: tuple[tuple[str, object], ...]

    def d(self) -> dict:
        return {**dict(self.static), **dict(self.dims)}


def _pow2_label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for cpu0 (sysfs; 0 where it reports none)."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes)


def cold_bytes() -> int:
    """Bytes of weight copies a cycled case reads in turn so that each call reads its copy from
    memory: twice the last-level cache (64 MB at least; on a 300 MB L3, 600 MB)."""
    return max(64 << 20, 2 * last_level_cache_bytes())


def copies_for(nbytes: int, *, quick: bool, cold: int) -> int:
    """Copies of a `nbytes` weight that fill `cold` bytes (1 for a quick run)."""
    return 1 if quick else max(1, -(-cold // max(1, nbytes)))


def default_cases(preset_name: str = "bench", *, quick: bool = False,
                  cold: int | None = None) -> list[Case]:
    """The issue-4 cases at the preset's real sizes; `quick` uses tiny fixed sizes instead (a
    smoke run of the whole harness in seconds, not a measurement). The per-layer decode and
    verify weights are cycled through `cold_bytes()` of copies, so they are read from memory
    as a decode step reads them (`cold`: those bytes, None: this machine's `cold_bytes()`)."""
    a = preset(preset_name)
    cold = cold_bytes() if cold is None else cold
    if quick:
        attn = dict(h=4, d=64, w=16, k=32)
        idx = dict(heads=4, dim=64, topk=16)
        lin = dict(n=256, k=128)
        moe = dict(dim=128, inter=64, n_experts=4, topk=2, swiglu_limit=a.swiglu_limit)
        attend_s, index_t, lin_m, moe_n = (1, 2), (1024, 4096), (1, 8), (1, 8)
        decode_lin = {"wq_a": (64, 128)}
        decode_gemv = {"wo_a": (2, 32, 64, "bfloat16"), "head": (1, 256, 128, "float32")}
    else:
        attn = dict(h=a.n_heads, d=a.head_dim, w=a.window_size, k=a.index_topk)
        idx = dict(heads=a.index_n_heads, dim=a.index_head_dim, topk=a.index_topk)
        # wq_b: the q low-rank up-projection, the widest dense weight of a layer
        lin = dict(n=a.n_heads * a.head_dim, k=a.q_lora_rank)
        moe = dict(dim=a.dim, inter=a.moe_inter_dim, n_experts=a.n_routed_experts,
                   topk=a.n_activated_experts, swiglu_limit=a.swiglu_limit)
        # attend: decode (s 1) and the verify of 1 + 4 drafted rows (s 5, the profile's verify)
        attend_s, index_t, lin_m, moe_n = (1, 2, 3, 4, 5), \
            (1 << 13, 1 << 16, 1 << 18, 1 << 20), (1, 128), (1, 128)
        # the other hot decode GEMVs of a layer (n, k): the FP8 q / kv / o projections and the
        # shared expert; the dense (bf16 / fp32 weight) GEMVs: the grouped o-projection and the
        # head (groups, n, k, weight dtype)
        hd = a.head_dim
        decode_lin = {"wq_a": (a.q_lora_rank, a.dim), "wkv": (hd, a.dim),
                      "wo_b": (a.dim, a.o_groups * a.o_lora_rank),
                      "shared_w1": (a.moe_inter_dim, a.dim), "shared_w2": (a.dim, a.moe_inter_dim)}
        decode_gemv = {"wo_a": (a.o_groups, a.o_lora_rank, a.n_heads * hd // a.o_groups,
                                gemm.FP8_WEIGHT if a.wo_a_dtype == "fp8" else "bfloat16"),
                       "head": (1, a.vocab_size, a.dim, "float32")}
    cases = [Case(f"attend-s{s}", "attend", tuple(attn.items()), (("b", 1), ("s", s)))
             for s in attend_s]
    cases += [Case(f"indexer-{_pow2_label(t)}", "indexer", tuple(idx.items()),
                   (("b", 1), ("s", 1), ("t", t))) for t in index_t]
    # the sweep behind the shared index-K pointer (indexer_topk_shared, 3 alternate stores as
    # at the bench preset): a decode step's (1 token) and a verify pass's (5 tokens whose picks
    # name two stores: the pointer moved at the third token), both at the middle context
    shared_t = index_t[1]
    cases += [Case(f"indexer-{name}-{_pow2_label(shared_t)}", "indexer",
                   (*idx.items(), ("n_alt", indexer.MAX_ALT)),
                   (("b", 1), ("s", len(picks)), ("t", shared_t), ("picks", picks)))
              for name, picks in (("shared", (2,)), ("verify5", (0, 0, 1, 1, 1)))]
    cases += [Case(f"fp8-{'gemv' if m == 1 else 'gemm'}-m{m}", "fp8",
                   (*lin.items(), ("hint", m)), (("m", m),)) for m in lin_m]
    cases += [Case(f"moe-n{n}", "moe", (*moe.items(), ("hint", artifact_rows_hint(n))),
                   (("n", n),)) for n in moe_n]
    cases += [Case(f"fp8-{name}-m1", "fp8", (("n", n), ("k", k), ("hint", 1)),
                   (("m", 1), ("copies", copies_for(n * k, quick=quick, cold=cold))))
              for name, (n, k) in decode_lin.items()]
    # the verify entry's kernels at its 1 + k rows: "verify" the row-group forms (each weight
    # load shared by the rows, bit for bit decode's kernel per row), "rowwise" decode's kernels
    # over the same rows (what the entry ran before); weights cycled through `copies` copies
    # (`cold_bytes()`: read from memory, as a decode step reads them, not from the L3)
    verify_rows = 1 + a.dspark_block_size
    wq_b = (lin["n"], lin["k"])
    fp8_copies = copies_for(wq_b[0] * wq_b[1], quick=quick, cold=cold)
    moe_bytes = moe["n_experts"] * 3 * moe["dim"] * moe["inter"] * 17 // 32
    moe_copies = copies_for(moe_bytes, quick=quick, cold=cold)
    forms = (("verify", verify_rows),) if quick else (("verify", verify_rows), ("rowwise", 1))
    ms = (2,) if quick else range(1, verify_rows + 1)
    for form, rows in forms:
        cases += [Case(f"fp8-{form}-wq_b-m{m}", "fp8",
                       (("n", wq_b[0]), ("k", wq_b[1]), ("hint", 1), ("rows", rows)),
                       (("m", m), ("copies", fp8_copies))) for m in ms]
        cases += [Case(f"moe-{form}-n{m}", "moe", (*moe.items(), ("hint", 1), ("rows", rows)),
                       (("n", m), ("copies", moe_copies))) for m in ms]
    # wo_b (K above 2048), the same two forms (appended: the cases above keep their order)
    wo_b = decode_lin.get("wo_b", (0, 0))
    wo_b_copies = copies_for(wo_b[0] * wo_b[1], quick=quick, cold=cold)
    for form, rows in forms if "wo_b" in decode_lin else ():
        cases += [Case(f"fp8-{form}-wo_b-m{m}", "fp8",
                       (("n", wo_b[0]), ("k", wo_b[1]), ("hint", 1), ("rows", rows)),
                       (("m", m), ("copies", wo_b_copies))) for m in ms]
    cases += [Case(f"gemv-{name}-m1", "gemv",
                   (("groups", g), ("n", n), ("k", k), ("x_dtype", "bfloat16"), ("w_dtype", wd)),
                   (("m", 1),)) for name, (g, n, k, wd) in decode_gemv.items()]
    # the verify entry's grouped o-projection (the row-group form) at 1 and 1 + k - 1 rows, its
    # weight cycled through `cold_bytes()` of copies as the fp8 verify cases'
    g, n, k, wd = decode_gemv["wo_a"]
    gemv_copies = copies_for(g * n * k * (1 if wd == gemm.FP8_WEIGHT else 2), quick=quick,
                             cold=cold)
    cases += [Case(f"gemv-verify-wo_a-m{m}", "gemv",
                   (("groups", g), ("n", n), ("k", k), ("x_dtype", "bfloat16"), ("w_dtype", wd),
                    ("rows", verify_rows)), (("m", m), ("copies", gemv_copies)))
              for m in ((2,) if quick else (1, verify_rows - 1))]
    # decode's own o-projection kernel (one row per group) on the same cycled copies: its
    # figure from memory, beside the verify form's at one row (appended: the order above kept)
    cases += [Case("gemv-decode-wo_a-m1", "gemv",
                   (("groups", g), ("n", n), ("k", k), ("x_dtype", "bfloat16"), ("w_dtype", wd)),
                   (("m", 1), ("copies", gemv_copies)))]
    return cases


def artifact_rows_hint(n: int) -> int | None:
    """The `rows_hint` the compiled model's kernels are built with for a call of n rows
    (compiler/build.py ROWS_HINT: decode 1, prefill None; drafts, 4, have no case here)."""
    return 1 if n == 1 else None


def select_cases(cases: list[Case], wanted: Sequence[str] | None) -> list[Case]:
    """Cases whose name or family is in `wanted` (all for None); unknown names are an error."""
    if not wanted:
        return list(cases)
    known = {c.name for c in cases} | {c.family for c in cases}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"Unknown case(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(sorted(known))}.")
    return [c for c in cases if c.name in wanted or c.family in wanted]


# ---- per-family: inputs, traffic, kernel runner, oracle --------------------------------------


def _tvm_view(x: torch.Tensor):
    return to_tvm(x)


@dataclass
class Prepared:
    """Everything one case needs to run: the three callables over one set of inputs, the output
    the kernel writes (a torch tensor shared with TVM), and the case's traffic."""

    kernel: Callable[[], None]
    kernel_out: torch.Tensor
    eager: Callable[[], torch.Tensor]
    body: Callable[..., torch.Tensor]  # the oracle's plain body (compiled by torch.compile)
    body_args: tuple
    bytes: int
    flops: int
    compile_note: str
    extra: dict = field(default_factory=dict)
    # a chained kernel's calls, in order, each runnable alone once `kernel` has run (timed too)
    parts: dict[str, Callable[[], None]] = field(default_factory=dict)


def attend_traffic(*, b, s, h, d, w, k, **_) -> tuple[int, int]:
    gathered = w * (d + d // 32) + k * (d // 2 + d // 16)
    return (4 * b * s * h * d + 4 * h + 4 * b * s * (w + k) + b * s * gathered,
            4 * b * s * h * d * (w + k))


def indexer_traffic(*, b, s, heads, dim, t, topk, picks=(0,), **_) -> tuple[int, int]:
    stores = len(set(picks))  # the shared sweep reads each store its picks name
    return (stores * b * t * (dim // 2 + dim // 32) + 2 * b * s * heads * dim + 2 * b * s * heads
            + 8 * b * s + 4 * b * s * topk,
            b * s * t * (2 * heads * dim + 3 * heads))


def fp8_traffic(*, m, n, k, **_) -> tuple[int, int]:
    return 2 * m * k + n * k + math.ceil(n / 32) * (k // 32) + 2 * m * n, 2 * m * n * k


def gemv_traffic(*, m, groups, n, k, x_dtype, w_dtype, **_) -> tuple[int, int]:
    size = {"bfloat16": 2, "float32": 4, "fp8": 1}  # fp8: + a scale byte per 32 x 32 tile
    tiles = -(-groups * n // 32) * (k // 32) if w_dtype == "fp8" else 0
    return (m * groups * k * size[x_dtype] + groups * n * k * size[w_dtype] + tiles
            + 4 * m * groups * n,
            2 * m * groups * n * k)


def dense_gemv_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the lowering replaces with dense_gemv: the grouped linear `mgk,gnk->mgn` in fp32
    over the weight as stored ([groups * n, k])."""
    g = x.shape[1]
    return torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(g, -1, w.shape[-1]))


def moe_traffic(*, n, dim, inter, topk, experts_used, **_) -> tuple[int, int]:
    per_expert = 2 * inter * (dim // 2 + dim // 32) + dim * (inter // 2 + inter // 32)
    return (experts_used * per_expert + 2 * n * dim + 12 * n * topk + 4 * n * dim,
            6 * n * topk * dim * inter)


@functools.cache
def compile_kernel(family: str, target_name: str, static: tuple) -> tuple[object, float]:
    """(executable, seconds to schedule + compile) for one family at its static dims: the
    kernel registry's builder for the family (`compiler.kernels`: the kernels the lowering
    emits, e.g. moe's split chain, gemv's dense decode GEMV)."""
    make = bench_kernel(family).build
    t0 = time.perf_counter()
    func = make(target_name, dict(static))
    # the artifact's TIR lowering (compiler.build.tir_pipeline: one-task parallel loops inline)
    ex = tvm.compile(func, target=get_target(target_name).tvm_target(),
                     tir_pipeline=tir_pipeline(target_name))
    return ex, time.perf_counter() - t0


def _body(op) -> tuple[Callable, str]:
    """(function torch.compile gets, note): the plain Python body of a registered custom op,
    which Inductor can see into; the op itself only where its body is not reachable."""
    fn = getattr(op, "_init_fn", None)
    if fn is None:
        return op, "compile: the custom op itself (opaque to Inductor: runs its eager body)"
    return fn, ""  # the usual case, stated once in the legend and the JSON settings


def _body_args(op, args: tuple, nbytes: int, flops: int) -> tuple:
    """Prepared's (body, body_args, bytes, flops, compile_note) fields for `op`."""
    fn, note = _body(op)
    return fn, args, nbytes, flops, note


def _cycled_calls(calls: list[Callable[[], None]]) -> Callable[[], None]:
    """One call per invocation, in turn (weights at several addresses: each call reads its
    copy from memory, not from a cache the previous call filled)."""
    turn = [0]

    def call():
        calls[turn[0]]()
        turn[0] = (turn[0] + 1) % len(calls)

    return call


def _cycled(ex, argsets: list[list]) -> Callable[[], None]:
    """`ex` over each argument set in turn (`_cycled_calls`)."""
    return _cycled_calls([functools.partial(ex, *args) for args in argsets])


def _torch_buffer(buf) -> torch.Tensor:
    """An uninitialised tensor for a plan buffer (Relax does not zero its allocations)."""
    return torch.empty([int(s) for s in buf.shape], dtype=getattr(torch, buf.dtype))


def moe_chain(ex, plan, inputs: Sequence[torch.Tensor]
              ) -> tuple[Callable[[], None], torch.Tensor, dict[str, Callable[[], None]]]:
    """(run the whole chain, y, each call alone) for `plan` (schedules.moe.moe_experts_plan)
    over the op's nine inputs: the intermediates and y allocated here, once, and every call
    bound to its buffers' DLPack views, so a timed call does no allocation or conversion."""
    env = {b.name: t.contiguous() for b, t in zip(plan.inputs, inputs, strict=True)}
    env.update({b.name: _torch_buffer(b) for b in (*plan.intermediates, plan.output)})
    views = {name: _tvm_view(t) for name, t in env.items()}
    parts = {c.func: functools.partial(ex[c.func], *(views[a] for a in (*c.args, *c.outs)))
             for c in plan.calls}
    calls = tuple(parts.values())

    def chain():
        for call in calls:
            call()

    return chain, env[plan.output.name], parts


def _prepare_shared(d: dict, ex) -> Prepared:
    """indexer_topk_shared: the own store, n_alt alternates of 2 T rows (a lower-ratio source's
    store), every sequence with the case's picks per token."""
    b, s, t = d["b"], d["s"], d["t"]
    q, kp, ks, w, lens = indexer.example_inputs_indexer_topk(b=b, s=s, heads=d["heads"],
                                                             dim=d["dim"], t=t)
    alts = [indexer.example_inputs_indexer_topk(b=b, s=1, heads=d["heads"], dim=d["dim"],
                                                t=2 * t, seed=1 + i)[1:3]
            for i in range(d["n_alt"])]
    alt_c, alt_s = [a[0] for a in alts], [a[1] for a in alts]
    pick = torch.tensor([d["picks"]] * b, dtype=torch.int64)
    ops.check_pick(pick, d["n_alt"], b, s)
    slots = [x for i in range(indexer.MAX_ALT)
             for x in ((alt_c[i], alt_s[i]) if i < d["n_alt"] else (kp, ks))]
    scores = torch.empty(b, s, indexer.padded(t), dtype=torch.bfloat16)
    out = torch.empty(b, s, d["topk"], dtype=torch.int32)
    args = [_tvm_view(x) for x in (q, kp, ks, *slots, pick, w, lens)]
    scores_v, out_v = _tvm_view(scores), _tvm_view(out)
    sweep, select = ex["index_scores_shared"], ex["select_positions"]

    def kernel():
        sweep(*args, scores_v)
        select(scores_v, out_v)

    nbytes, flops = indexer_traffic(**d)
    oracle_args = (q, kp, ks, alt_c, alt_s, pick, w, lens, d["topk"])
    return Prepared(kernel, out, lambda: ops.indexer_topk_shared(*oracle_args),
                    *_body_args(ops.indexer_topk_shared, oracle_args, nbytes, flops))


def prepare(case: Case, ex, target_name: str = "cpu") -> Prepared:
    """Inputs at the case's sizes and the three callables over them (target_name: the one
    `ex` was compiled for)."""
    d = case.d()
    if case.family == "attend":
        inputs = attention.example_inputs_sparse_attend(b=d["b"], s=d["s"], h=d["h"], d=d["d"],
                                                        w=d["w"], k=d["k"])
        attention.check_sparse_attend_indices(inputs[3], inputs[1].shape[1], inputs[6],
                                              inputs[4].shape[1])
        scale = d["d"] ** -0.5
        out = torch.empty(d["b"], d["s"], d["h"], d["d"], dtype=torch.bfloat16)
        args = [_tvm_view(x) for x in (*inputs, out)]
        nbytes, flops = attend_traffic(**d)
        return Prepared(lambda: ex(*args), out, lambda: ops.sparse_attend(*inputs, scale),
                        *_body_args(ops.sparse_attend, (*inputs, scale), nbytes, flops))
    if case.family == "indexer" and d.get("n_alt"):
        return _prepare_shared(d, ex)
    if case.family == "indexer":
        q, kp, ks, w, lens = indexer.example_inputs_indexer_topk(
            b=d["b"], s=d["s"], heads=d["heads"], dim=d["dim"], t=d["t"])
        scores = torch.empty(d["b"], d["s"], indexer.padded(d["t"]), dtype=torch.bfloat16)
        out = torch.empty(d["b"], d["s"], d["topk"], dtype=torch.int32)
        args = [_tvm_view(x) for x in (q, kp, ks, w, lens)]
        scores_v, out_v = _tvm_view(scores), _tvm_view(out)
        sweep, select = ex["index_scores"], ex["select_positions"]

        def kernel():
            sweep(*args, scores_v)
            select(scores_v, out_v)

        nbytes, flops = indexer_traffic(**d)
        topk = d["topk"]
        return Prepared(kernel, out, lambda: ops.indexer_topk(q, kp, ks, w, lens, topk),
                        *_body_args(ops.indexer_topk, (q, kp, ks, w, lens, topk), nbytes,
                                    flops))
    if case.family == "fp8":
        x, wt, sc = gemm.example_inputs_fp8_linear(m=d["m"], n=d["n"], k=d["k"])
        out = torch.empty(d["m"], d["n"], dtype=torch.bfloat16)
        sets = [(x, wt, sc)] + [(x, wt.clone(), sc.clone()) for _ in range(d.get("copies", 1) - 1)]
        kernel = _cycled(ex, [[_tvm_view(t) for t in (*s, out)] for s in sets])
        nbytes, flops = fp8_traffic(**d)
        return Prepared(kernel, out, lambda: ops.fp8_linear(x, wt, sc),
                        *_body_args(ops.fp8_linear, (x, wt, sc), nbytes, flops))
    if case.family == "gemv":
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(d["m"], d["groups"], d["k"], generator=gen).to(getattr(torch,
                                                                              d["x_dtype"]))
        wt = torch.randn(d["groups"] * d["n"], d["k"], generator=gen) * d["k"] ** -0.5
        if d["w_dtype"] == gemm.FP8_WEIGHT:  # E4M3 codes + 32 x 32 tile scales; oracle: bf16
            stored = tuple(fmt.torch_quant_fp8_weight(wt))
            wt = fmt.torch_dequant_fp8_weight(*stored).to(torch.bfloat16)
        else:
            wt = wt.to(getattr(torch, d["w_dtype"]))
            stored = (wt,)
        out = torch.empty(d["m"], d["groups"], d["n"])
        sets = [stored] + [tuple(t.clone() for t in stored) for _ in range(d.get("copies", 1)
                                                                          - 1)]
        kernel = _cycled(ex, [[_tvm_view(t) for t in (x, *w, out)] for w in sets])
        nbytes, flops = gemv_traffic(**d)
        return Prepared(kernel, out, lambda: dense_gemv_oracle(x, wt),
                        dense_gemv_oracle, (x, wt), nbytes, flops, "")
    if case.family == "moe":
        inputs = moe.example_inputs_moe_experts(n=d["n"], dim=d["dim"], inter=d["inter"],
                                                n_experts=d["n_experts"], topk=d["topk"])
        moe.check_expert_ids(inputs[2], d["n_experts"])
        limit = d["swiglu_limit"]
        # the same plan (buffer shapes, call order) as compiler/lower.py `_moe_experts`
        plan = moe.moe_experts_plan(target_name, dim=d["dim"], inter=d["inter"],
                                    n_experts=d["n_experts"], topk=d["topk"], n=d["n"],
                                    n_hint=d["hint"], rows=d.get("rows", 1))
        chain, out, parts = moe_chain(ex, plan, inputs)
        if d.get("copies", 1) > 1:  # the same weights at other addresses, cycled
            chains = [chain] + [moe_chain(ex, plan, [*inputs[:3], *(t.clone() for t in
                                                                   inputs[3:])])[0]
                                for _ in range(d["copies"] - 1)]
            chain = _cycled_calls(chains)
        used = int(torch.unique(inputs[2]).numel())
        nbytes, flops = moe_traffic(**d, experts_used=used)
        return Prepared(chain, out, lambda: ops.moe_experts(*inputs, limit),
                        *_body_args(ops.moe_experts, (*inputs, limit), nbytes, flops),
                        {"experts_used": used}, parts)
    raise AssertionError(f"unknown family {case.family}")


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements equal, max |got - ref|) of the kernel against eager."""
    equal = float((got == ref).float().mean()) if got.numel() else 1.0
    diff = (got.double() - ref.double()).abs()
    return equal, float(diff.max()) if diff.numel() else 0.0


# ---- one case ------------------------------------------------------------------------------------


def run_case(case: Case, *, target_name: str, machine: Machine, repeat: int, budget_s: float,
             use_compile: bool, stat: str = "median",
             status: Callable[[str], None] = lambda _: None) -> dict:
    """Time one case and put it on the machine's roofline; returns a JSON-ready row. `stat`
    ("median" or "min") is the statistic of the samples that the row's times report."""
    status(f"{case.name}: compiling TVM kernel")
    ex, tvm_compile_s = compile_kernel(case.family, target_name, case.static)
    prep = prepare(case, ex, target_name)
    notes = []

    status(f"{case.name}: timing kernel")
    t_kernel = time_call(prep.kernel, repeat=repeat, budget_s=budget_s)
    kernel_out = prep.kernel_out.clone()
    t_parts = {}
    for name, part in prep.parts.items():  # each reruns on the buffers the chain left
        status(f"{case.name}: timing {name}")
        t_parts[name] = time_call(part, repeat=repeat, budget_s=budget_s)

    status(f"{case.name}: timing eager oracle")
    ref = prep.eager()  # the warm-up call, and the reference the kernel is checked against
    t_eager = time_call(prep.eager, repeat=repeat, budget_s=budget_s, warmed=True)
    equal, max_err = _agreement(kernel_out, ref)

    t_comp, compile_s = None, None
    if use_compile:
        status(f"{case.name}: torch.compile")
        torch._dynamo.reset()  # every case compiles afresh for its own shapes
        compiled = torch.compile(prep.body)
        try:
            t0 = time.perf_counter()
            compiled(*prep.body_args)  # compiles, then runs once (the warm-up)
            compile_s = time.perf_counter() - t0
            status(f"{case.name}: timing torch.compile")
            t_comp = time_call(lambda: compiled(*prep.body_args), repeat=repeat,
                               budget_s=budget_s, warmed=True)
            if prep.compile_note:
                notes.append(prep.compile_note)
        except Exception as e:  # noqa: BLE001 - report any compiler failure, keep benchmarking
            notes.append(f"torch.compile failed: {type(e).__name__}: {str(e)[:120]}")
        finally:
            torch._dynamo.reset()
    if t_eager.samples == 1:
        notes.append("eager timed once (slow)")
    if equal < 1.0:
        notes.append(f"{equal:.2%} of outputs equal eager (max |diff| {max_err:.3g})")

    def pick(t: Timing | None) -> float | None:
        return None if t is None else t.median_s if stat == "median" else t.min_s

    k, t_e, t_c = pick(t_kernel), pick(t_eager), pick(t_comp)
    roof = roof_point(prep.bytes, prep.flops, k, bandwidth_gbs=machine.bandwidth_gbs,
                      gemm_gflops=machine.gemm_gflops)
    row = {
        "case": case.name,
        "family": case.family,
        "dims": case.d(),
        "bytes": prep.bytes,
        "flops": prep.flops,
        "kernel_s": k,
        "eager_s": t_e,
        "compile_s": t_c,
        "gbs": roof.achieved_gbs,
        "gflops": roof.achieved_gflops,
        "frac_bw": roof.bandwidth_frac,
        "frac_peak": roof.compute_frac,
        "roofline_s": roof.floor_s,
        "bound": roof.bound,
        "roofline_ratio": k / roof.floor_s,
        "speedup_eager": t_e / k,
        "speedup_compile": t_c / k if t_comp else None,
        "min_s": {"kernel": t_kernel.min_s, "eager": t_eager.min_s,
                  "compile": t_comp.min_s if t_comp else None},
        "median_s": {"kernel": t_kernel.median_s, "eager": t_eager.median_s,
                     "compile": t_comp.median_s if t_comp else None},
        "samples": {"kernel": t_kernel.samples, "eager": t_eager.samples,
                    "compile": t_comp.samples if t_comp else 0},
        "tvm_compile_s": tvm_compile_s,  # shared by the cases of one static configuration
        "torch_compile_s": compile_s,
        "equal_fraction": equal,
        "max_abs_diff": max_err,
        "note": "; ".join(notes),
        **prep.extra,
    }
    if t_parts:
        row["parts"] = {name: {"time_s": pick(t), "min_s": t.min_s, "median_s": t.median_s,
                               "samples": t.samples} for name, t in t_parts.items()}
    return row


# ---- the whole benchmark ------------------------------------------------------------------------


def check_target(target_name: str) -> None:
    """Only the CPU is measured by this harness; a CUDA target is a clear error."""
    target = get_target(target_name)  # ValueError for an unknown name
    if target.is_cuda:
        why = ("this machine has no CUDA GPU" if not tvm.cuda().exist
               else "GPU timing is not implemented in this harness yet")
        raise ValueError(f"Measuring target {target_name} needs a CUDA GPU and a GPU timing "
                         f"path; {why}. Use --target cpu here, or build the CUDA kernels with "
                         "schedules.cuda_build and time them on a GPU machine.")


def run_benchmark(preset_name: str = "bench", target_name: str = "cpu",
                  cases: Sequence[str] | None = None, repeat: int = 20, *, quick: bool = False,
                  use_compile: bool = True, budget_s: float | None = None,
                  stat: str = "median", progress: bool = True) -> dict:
    """Measure the machine and run the selected cases; returns the JSON report (schema,
    settings, machine, formulas, rows)."""
    check_target(target_name)
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1; got {repeat}.")
    budget_s = budget_s if budget_s is not None else (0.3 if quick else 1.5)
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be median or min; got {stat!r}.")
    if budget_s <= 0:
        raise ValueError(f"budget must be positive; got {budget_s}.")
    chosen = select_cases(default_cases(preset_name, quick=quick), cases)
    t_start = time.perf_counter()
    default_tvm_pool()  # the same pool the runtime sizes on artifact load
    machine = measure_machine(quick=quick)
    rows = []
    bar = tqdm(chosen, desc="bench kernels", unit="case", disable=not progress,
               file=sys.stderr)
    for case in bar:
        rows.append(run_case(case, target_name=target_name, machine=machine, repeat=repeat,
                             budget_s=budget_s, use_compile=use_compile, stat=stat,
                             status=bar.set_postfix_str))
    bar.close()
    return {
        "schema": SCHEMA,
        "preset": "quick (tiny fixed sizes)" if quick else preset_name,
        "target": target_name,
        "settings": {"repeat": repeat, "budget_s": budget_s, "quick": quick, "stat": stat,
                     "torch_compile": use_compile, "torch_compile_of": COMPILE_NOTE,
                     "min_sample_s": MIN_SAMPLE_S,
                     "cache": "warm (inputs reused across samples)"},
        "machine": dataclasses.asdict(machine),
        "load_avg_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t_start,
        "formulas": FORMULAS,
        "row_fields": ROW_FIELDS,
        "rows": rows,
    }


def bench_kernels(preset_name: str = "bench", target_name: str = "cpu",
                  cases: Sequence[str] | None = None, repeat: int = 20,
                  out_json: str | Path | None = None, **options) -> list[dict]:
    """`run_benchmark`, writing its report to out_json; returns the rows. options: quick,
    use_compile, budget_s, progress."""
    report = run_benchmark(preset_name, target_name, cases, repeat, **options)
    if out_json is not None:
        write_report(report, out_json)
    return report["rows"]


def write_report(report: dict, path: str | Path) -> None:
    write_json(path, report, final_newline=True)


# ---- the table -----------------------------------------------------------------------------------


LEGEND = (
    "times: the samples' {stat} (JSON has min and median); compile = " + COMPILE_NOTE + ".\n"
    "vs eager / vs compile: their time / the kernel's. %BW, %peak: achieved GB/s, GFLOP/s over "
    "the measured bandwidth and fp32 GEMM rate; roof = max(bytes/BW, flops/peak), /roof = "
    "kernel / roof (below 1: a bandwidth-bound working set served from cache, or a compute-bound "
    "kernel on faster units than fp32 FMA: the indexer's int8 VNNI dot).")


def format_table(rows: list[dict]) -> str:
    """Aligned text: times in ms, rates, roofline and speedups, one row per case."""
    head = ["case", "kernel ms", "eager ms", "compile ms", "vs eager", "vs compile", "GB/s",
            "%BW", "GFLOP/s", "%peak", "roof ms", "bound", "/roof", "note"]
    body = [[r["case"], ms_cell(r["kernel_s"]), ms_cell(r["eager_s"]), ms_cell(r["compile_s"]),
             times(r["speedup_eager"], whole_from=100),
             times(r["speedup_compile"], whole_from=100), f"{r['gbs']:.1f}",
             f"{100 * r['frac_bw']:.0f}%", f"{r['gflops']:.1f}", f"{100 * r['frac_peak']:.0f}%",
             ms_cell(r["roofline_s"]), r["bound"], f"{r['roofline_ratio']:.2f}", r["note"]]
            for r in rows]
    return table(head, body, free_last=True)


def format_parts(rows: list[dict]) -> str:
    """One line per chained case: each kernel's time in ms and its share of their sum, the sum
    next to the whole chain's time (empty when no row has parts)."""
    lines = []
    for r in rows:
        parts = r.get("parts")
        if not parts:
            continue
        total = sum(p["time_s"] for p in parts.values())
        cells = [f"{name} {ms_cell(p['time_s'])} ({100 * p['time_s'] / total:.0f}%)"
                 for name, p in parts.items()]
        lines.append(f"  {r['case']} parts, ms: " + ", ".join(cells)
                     + f"; sum {ms_cell(total)} vs chain {ms_cell(r['kernel_s'])}")
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelBenchOptions:
    """`dsv41 bench kernels`."""

    preset: str = "bench"  # sizes of the cases
    target: str = "cpu"
    cases: tuple[str, ...] | None = None  # case names or families (None: all)
    repeat: int = 20  # timed samples per measurement (max)
    budget_s: float | None = None  # per measurement (None: 1.5 s, quick 0.3 s)
    json: Path | None = None
    quick: bool = False  # tiny sizes, short probes: a smoke run of the harness
    use_compile: bool = True  # the torch.compile column
    stat: str = "median"  # median | min
    list_cases: bool = False  # list the cases and stop


def run_command(opts: KernelBenchOptions) -> int:
    """The benchmark (or the case list), its table and legend; the report to `opts.json`."""
    if opts.list_cases:
        for c in select_cases(default_cases(opts.preset, quick=opts.quick), opts.cases):
            print(f"{c.name:16s} {c.d()}")
        return 0
    print(f"bench kernels: preset {'quick (tiny sizes)' if opts.quick else opts.preset}, target "
          f"{opts.target}, cases {','.join(opts.cases) if opts.cases else 'all'}, repeat "
          f"{opts.repeat}, stat {opts.stat}, torch.compile {'on' if opts.use_compile else 'off'}"
          f", json {opts.json or '-'}")
    report = run_benchmark(opts.preset, opts.target, opts.cases, opts.repeat, quick=opts.quick,
                           use_compile=opts.use_compile, budget_s=opts.budget_s, stat=opts.stat)
    if opts.json:
        write_report(report, opts.json)
    print(format_machine(report["machine"]))
    print(format_table(report["rows"]))
    parts = format_parts(report["rows"])
    if parts:
        print(parts)
    print(LEGEND.format(stat=report["settings"]["stat"]))
    print(f"{len(report['rows'])} cases in {report['wall_s']:.0f} s; load avg at the end "
          f"{report['load_avg_end'][0]:.2f} (other processes share these cores)"
          + (f"; JSON -> {opts.json}" if opts.json else ""))
    return 0
