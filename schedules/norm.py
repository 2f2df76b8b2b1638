"""RMSNorm as a TIR kernel (oracle: `dsv41::rms_norm`, graph/layers.py `rms_norm`), and the
bit-level helpers schedules/mhc.py shares.

`rms_norm` reads bf16 rows and a bf16 weight and writes bf16, computing
`bf16(w * (x * rsqrt(sum(x^2) / d + eps)))` in fp32 like the oracle. The only difference to the
oracle is the order of the d additions of the sum of squares: the kernel adds in `lanes`
strided partial sums (lane l holds the elements l, l + lanes, ...), then adds the lanes in order
(CUDA: a warp's shuffle tree); torch's vectorised reduction uses its own order. That moves rsqrt
by an ulp or two of fp32, which flips the bf16 rounding of an output on a small fraction of
elements (by one bf16 ulp; measured ~1e-5 of them). On CUDA, nvcc's fast math makes rsqrtf
approximate too (same bound, fewer exact).

bf16 inputs are widened on the bits (`f32_of_bf16`): TVM 0.27 miscompiles a bf16 Cast inside a
Let (schedules/gemm/). The outputs use `T.Cast("bfloat16", .)`, which rounds to nearest even
(checked on ties). `mul_bf16` forms a bf16 x fp32 product so that FMA contraction cannot change
its rounding (TVM's LLVM backend forms FMAs even with `fast-math-contract` off, and nvcc
contracts by default).

Layout: the kernel takes its rows as a symbolic int64 `n` (the leading dims flattened) and d
and eps from the factory's keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.config import preset
from dsv41.graph.layers import rms_norm
from dsv41.graph.targets import TargetSpec, get_target

# ---- shared helpers (also used by schedules/mhc.py) ------------------------------------------


def f32_of_bf16(v):
    """bf16 -> fp32 on the bits (exact; a plain Cast can be miscompiled inside a Let)."""
    return T.reinterpret("float32", T.Cast("uint32", T.reinterpret("uint16", v)) << T.uint32(16))


def split_hi(b):
    """b with the low 8 of its 24 significand bits cleared (exact; b - split_hi(b) is exact)."""
    return T.reinterpret("float32", T.reinterpret("uint32", b) & T.uint32(0xFFFFFF00))


def mul_bf16(a, b):
    """fp32(a * b) for `a` a bf16 value (<= 8 significant bits) and any fp32 `b`, computed so
    that FMA contraction cannot change it: b = hi + lo with hi the top 16 and lo the low 8
    significand bits, so a * hi and a * lo are exact and their sum is rounded once, to
    fp32(a * b), however LLVM or nvcc fuse the three operations. (TVM's LLVM backend forms
    FMAs even with `fast-math-contract` off, and nvcc does by default; a plain `x * c - y * s`
    then rounds differently from torch's separate multiply and subtract.) Exact unless a * b
    is below ~2^-110 in magnitude (the partial products underflow) or b is not finite."""
    hi = split_hi(b)
    return a * hi + a * (b - hi)


def neg(v):
    """-v as an exact sign flip (torch's unary minus), not 0 - v (which differs at +0)."""
    return v * T.float32(-1)


@dataclass(frozen=True)
class BenchData:
    """One benchmark case's tensors: call the kernel as `ex(*inputs, *outputs)` (torch tensors
    viewed through DLPack; it writes `outputs`); `oracle(*oracle_args)` is the eager PyTorch
    reference (the graph's own functions) and `pick(result)` the part of its result that
    corresponds to `outputs[0]`."""

    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    oracle: Callable[..., object]
    oracle_args: tuple
    pick: Callable[[object], torch.Tensor]


@dataclass(frozen=True)
class BenchCase:
    """What a benchmark needs for one kernel at one size (see `bench_cases`). `build(target)`
    gives the scheduled PrimFunc (compile it with tvm.compile; every case with the same family
    and `static` shares one build); `prepare()` allocates the example tensors (only when
    called: the bench-size cases hold hundreds of MB). bytes and flops are the compulsory
    traffic and arithmetic of one call (formula in `note`)."""

    name: str
    family: str
    static: tuple[tuple[str, object], ...]
    build: Callable[[str], tvm.tirx.PrimFunc]
    prepare: Callable[[], BenchData]
    bytes: int
    flops: int
    note: str = ""


def check_lanes(extent: int, lanes: int, what: str) -> None:
    if lanes <= 0 or extent % lanes:
        raise ValueError(f"{what}: lanes={lanes} must be positive and divide {extent}.")


# ---- rms_norm -------------------------------------------------------------------------------


def make_rms_norm(*, d: int, eps: float, lanes: int = 32) -> tvm.tirx.PrimFunc:
    """`rms_norm(x, weight) -> y`: bf16 [n, d] (n symbolic: the leading dims flattened), bf16
    weight [d] -> bf16 [n, d]. Blocks: `part` (lane partial sums of squares), `ssq`, `rstd`, `y`.
    """
    if d <= 0:
        raise ValueError(f"rms_norm needs d > 0, got {d}.")
    check_lanes(d, lanes, "rms_norm")
    D, L, DL = T.int64(d), T.int64(lanes), T.int64(d // lanes)

    @T.prim_func(s_tir=True)
    def rms_norm(x_h: T.handle, weight: T.Buffer((D,), "bfloat16"), y_h: T.handle):
        T.func_attr({"global_symbol": "rms_norm", "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, D), "bfloat16")
        y = T.match_buffer(y_h, (n, D), "bfloat16")
        part = T.sblock_alloc_buffer((n, L), "float32")
        ssq = T.sblock_alloc_buffer((n,), "float32")
        rstd = T.sblock_alloc_buffer((n,), "float32")
        for i, ln, k in T.grid(n, L, DL):
            with T.sblock("part"):
                vi, vl, vk = T.axis.remap("SSR", [i, ln, k])
                with T.init():
                    part[vi, vl] = T.float32(0)
                part[vi, vl] = part[vi, vl] + f32_of_bf16(x[vi, vk * L + vl]) \
                    * f32_of_bf16(x[vi, vk * L + vl])
        for i, ln in T.grid(n, L):
            with T.sblock("ssq"):
                vi, vl = T.axis.remap("SR", [i, ln])
                with T.init():
                    ssq[vi] = T.float32(0)
                ssq[vi] = ssq[vi] + part[vi, vl]
        for i in range(n):
            with T.sblock("rstd"):
                vi = T.axis.remap("S", [i])
                rstd[vi] = T.rsqrt(ssq[vi] / T.float32(d) + T.float32(eps))
        for i, k in T.grid(n, D):
            with T.sblock("y"):
                vi, vk = T.axis.remap("SS", [i, k])
                y[vi, vk] = T.Cast("bfloat16", f32_of_bf16(weight[vk])
                                   * (f32_of_bf16(x[vi, vk]) * rstd[vi]))

    return rms_norm


@dataclass(frozen=True)
class NormConfig:
    """lanes: strided partial sums of the sum of squares (part of the kernel's definition).
    CPU: one row per parallel task, the lanes and the output `vec` wide. CUDA: one warp per
    row, a lane per thread (the lanes summed by a warp shuffle reduction), `rows` rows (warps)
    per thread block."""

    lanes: int
    vec: int = 16
    rows: int = 1


def norm_config(target: TargetSpec, *, d: int) -> NormConfig:
    """32 lanes (two AVX-512 vectors: two independent add chains; one warp) or the largest
    power of two below that divides d."""
    lanes = 32
    while d % lanes:
        lanes //= 2
    if target.is_cuda:
        return NormConfig(lanes=lanes, vec=1, rows=4)
    return NormConfig(lanes=lanes, vec=16)


def schedule_rms_norm(func: tvm.tirx.PrimFunc, config: NormConfig,
                      target: TargetSpec) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    part, ssq, rstd, y = (sch.get_sblock(n) for n in ("part", "ssq", "rstd", "y"))
    lanes = int(sch.get(sch.get_loops(part)[1]).extent)
    if lanes != config.lanes:
        raise ValueError(f"The kernel was built with lanes={lanes} but the config asks for "
                         f"{config.lanes}; build it with make_rms_norm(..., lanes=config.lanes).")
    i, k = sch.get_loops(y)
    if target.is_cuda:
        bx, ty = sch.split(i, [None, config.rows])
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        for blk in (rstd, ssq, part):
            sch.compute_at(blk, ty)
        sch.bind(sch.get_loops(part)[-2], "threadIdx.x")  # a lane per thread
        sch.bind(sch.get_loops(ssq)[-1], "threadIdx.x")  # warp reduction over the lanes
        sch.set_scope(part, 0, "local")
        sch.set_scope(ssq, 0, "local")
        sch.set_scope(rstd, 0, "local")
        sch.bind(sch.split(k, [None, config.lanes])[1], "threadIdx.x")
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    for blk in (rstd, ssq, part):
        sch.compute_at(blk, i)
    sch.parallel(i)
    ln, kk = sch.get_loops(part)[1:]
    sch.reorder(kk, ln)
    sch.vectorize(ln)
    _, kv = sch.split(k, [None, config.vec])
    sch.vectorize(kv)
    sch.decompose_reduction(part, kk)  # last: the primitives above need the reduction form
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_rms_norm(target_name: str, *, d: int, eps: float) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = norm_config(target, d=d)
    return schedule_rms_norm(make_rms_norm(d=d, eps=eps, lanes=cfg.lanes), cfg, target)


# ---- example inputs and benchmark cases -----------------------------------------------------


def example_inputs_rms_norm(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    """[x bf16 (n, d), weight bf16 (d,)]: activations with a per-row scale spread and a few
    outlier channels; a weight around 1 (the checkpoint's norm weights are ~N(mean, 0.1 mean))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, :: max(d // 8, 1)] *= 6.0
    w = 1 + 0.1 * torch.randn(d, generator=g)
    return [x.to(torch.bfloat16), w.to(torch.bfloat16)]


def _norm_oracle(x, w, eps):

    return rms_norm(x, w, eps)


def bench_cases(preset_name: str = "bench", tokens: tuple[int, ...] = (1, 128, 2048)
                ) -> list[BenchCase]:
    """RMSNorm at the model's three widths (attn/ffn norm: dim, q_norm: q_lora_rank, kv_norm:
    head_dim) for each token count (b = 1). bytes: bf16 in + out + weight; flops: 4 per element
    (square-add, two products)."""

    a = preset(preset_name)
    eps, hd = a.norm_eps, a.head_dim
    cases = []
    for n in tokens:
        for label, d in (("dim", a.dim), ("q", a.q_lora_rank), ("kv", hd)):
            def prep(n=n, d=d):
                x, w = example_inputs_rms_norm(n=n, d=d, seed=n)
                return BenchData((x, w), (torch.empty_like(x),), _norm_oracle, (x, w, eps),
                                 lambda r: r)

            cases.append(BenchCase(
                name=f"rms_norm-{label}{d}-n{n}", family="norm",
                static=(("d", d), ("eps", eps)),
                build=lambda t, d=d: build_rms_norm(t, d=d, eps=eps), prepare=prep,
                bytes=4 * n * d + 2 * d, flops=4 * n * d, note="bytes = 4*n*d + 2*d"))
    return cases
