"""RMSNorm and RoPE as standalone TIR kernels (oracles: graph/layers.py `rms_norm`, `apply_rope`).

Both read bf16 activations and write bf16, computing in fp32 like the oracle. Where they agree
with it, and why:

* `rope` is bit-exact. Each output is `re * cos - im * sin` (or `re * sin + im * cos`) in fp32,
  rounded once to bf16 (RNE), with the same operand order as the oracle. The products must be
  rounded separately, as torch does, but TVM's LLVM backend forms FMAs even with
  `fast-math-contract` off (a vfmsub231ps was found in this kernel), and nvcc contracts by
  default; `mul_bf16` computes each bf16 x fp32 product as a sum of two exact partial
  products, which rounds to fp32(a * b) whether or not it is fused. `inverse` negates sin
  exactly (a sign flip, as torch's `-sin`), never `0 - sin`. The non-rotated head of each row
  is copied unchanged. The kernel reads and writes (re, im) pairs as uint32 words (dense
  vectors; see `make_rope`), rounding to bf16 on the bits.
* `rms_norm` computes `bf16(w * (x * rsqrt(sum(x^2) / d + eps)))` in fp32. The only difference
  to the oracle is the order of the d additions of the sum of squares: the kernel adds in
  `lanes` strided partial sums (lane l holds the elements l, l + lanes, ...), then adds the
  lanes in order (CUDA: a warp's shuffle tree); torch's vectorised reduction uses its own
  order. That moves rsqrt by an ulp or two of fp32, which flips the bf16 rounding of an output
  on a small fraction of elements (by one bf16 ulp; measured ~1e-5 of them). On CUDA, nvcc's
  fast math makes rsqrtf approximate too (same bound, fewer exact).

bf16 inputs are widened on the bits (`f32_of_bf16`): TVM 0.27 miscompiles a bf16 Cast inside a
Let (schedules/gemm.py). rms_norm's outputs use `T.Cast("bfloat16", .)`, which rounds to
nearest even (checked on ties); rope rounds on the bits (`bf16_bits`).

Layout: every kernel takes its leading dims as symbolic int64 (`n` rows for rms_norm, `b, s` for
rope) and its static dims from the factory's keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec, get_target

# ---- shared helpers (also used by schedules/mhc.py and schedules/compressor.py) -------------


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


# ---- rope -----------------------------------------------------------------------------------


def bf16_bits(v):
    """The bf16 bit pattern (in the low 16 bits of a uint32) of fp32 v rounded to nearest even,
    as torch's `.to(bfloat16)`; a NaN becomes the canonical 0x7FC0."""
    u = T.reinterpret("uint32", v)
    rnd = (u + T.uint32(0x7FFF) + ((u >> T.uint32(16)) & T.uint32(1))) >> T.uint32(16)
    return T.Select(v != v, T.uint32(0x7FC0), rnd)


def make_rope(*, d: int, rd: int, heads: int | None = None,
              inverse: bool = False) -> tvm.tirx.PrimFunc:
    """`rope(x, cos, sin) -> y` on the last `rd` of `d` dims, interleaved (re, im) pairs.

    x, y: bf16 [b, s, d] (heads None) or [b, s, heads, d]; cos, sin: fp32 [b, s, rd/2] (the
    oracle also broadcasts a batch of 1; here the caller passes b rows). Blocks: `copy` (the
    first d - rd dims), `rot` (one pair each).

    Both blocks work on uint32 views of x and y (one (re, im) pair per word, re in the low
    half on a little-endian machine), so every load and store is dense: a pair decodes with
    a shift and a mask, and the two rounded outputs are packed back into one word."""
    if rd <= 0 or rd % 2 or rd > d or d % 2:
        raise ValueError(f"rope needs an even rd in (0, d] and an even d; got rd={rd}, d={d}.")
    if heads is not None and heads <= 0:
        raise ValueError(f"rope needs heads > 0 (or None for 3-D x), got {heads}.")
    D, D2, NOPE2, P = T.int64(d), T.int64(d // 2), T.int64((d - rd) // 2), T.int64(rd // 2)
    H = T.int64(heads or 1)

    def rotate(w, c, sn):
        """The packed output pair of the packed input pair w: (re*c - im*s, re*s + im*c), s
        negated for the inverse."""
        re = T.reinterpret("float32", w << T.uint32(16))
        im = T.reinterpret("float32", w & T.uint32(0xFFFF0000))
        if inverse:
            sn = neg(sn)
        out_re = mul_bf16(re, c) - mul_bf16(im, sn)
        out_im = mul_bf16(re, sn) + mul_bf16(im, c)
        return bf16_bits(out_re) | (bf16_bits(out_im) << T.uint32(16))

    if heads is None:
        @T.prim_func(s_tir=True)
        def rope(x_h: T.handle, cos_h: T.handle, sin_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": "rope", "tirx.noalias": True})
            b, s = T.int64(), T.int64()
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            cos = T.match_buffer(cos_h, (b, s, P), "float32")
            sin = T.match_buffer(sin_h, (b, s, P), "float32")
            y = T.match_buffer(y_h, (b, s, D), "bfloat16")
            xw = T.decl_buffer((b, s, D2), "uint32", data=x.data)
            yw = T.decl_buffer((b, s, D2), "uint32", data=y.data)
            for bb, ss, q in T.grid(b, s, NOPE2):
                with T.sblock("copy"):
                    vb, vs, vq = T.axis.remap("SSS", [bb, ss, q])
                    yw[vb, vs, vq] = xw[vb, vs, vq]
            for bb, ss, p in T.grid(b, s, P):
                with T.sblock("rot"):
                    vb, vs, vp = T.axis.remap("SSS", [bb, ss, p])
                    yw[vb, vs, NOPE2 + vp] = rotate(xw[vb, vs, NOPE2 + vp], cos[vb, vs, vp],
                                                    sin[vb, vs, vp])

        return rope

    @T.prim_func(s_tir=True)
    def rope_heads(x_h: T.handle, cos_h: T.handle, sin_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "rope", "tirx.noalias": True})
        b, s = T.int64(), T.int64()
        x = T.match_buffer(x_h, (b, s, H, D), "bfloat16")
        cos = T.match_buffer(cos_h, (b, s, P), "float32")
        sin = T.match_buffer(sin_h, (b, s, P), "float32")
        y = T.match_buffer(y_h, (b, s, H, D), "bfloat16")
        xw = T.decl_buffer((b, s, H, D2), "uint32", data=x.data)
        yw = T.decl_buffer((b, s, H, D2), "uint32", data=y.data)
        for bb, ss, hh, q in T.grid(b, s, H, NOPE2):
            with T.sblock("copy"):
                vb, vs, vh, vq = T.axis.remap("SSSS", [bb, ss, hh, q])
                yw[vb, vs, vh, vq] = xw[vb, vs, vh, vq]
        for bb, ss, hh, p in T.grid(b, s, H, P):
            with T.sblock("rot"):
                vb, vs, vh, vp = T.axis.remap("SSSS", [bb, ss, hh, p])
                yw[vb, vs, vh, NOPE2 + vp] = rotate(xw[vb, vs, vh, NOPE2 + vp],
                                                    cos[vb, vs, vp], sin[vb, vs, vp])

    return rope_heads


@dataclass(frozen=True)
class RopeConfig:
    """CPU: rows (b, s[, h]) fused into one parallel loop, `vec` pairs per vector op.
    CUDA: a thread block per (token, group of heads): blockIdx = (s [x head groups], b),
    threadIdx = (head, `lanes` pairs); only static extents are divided (dlight's fallback
    fuses b, s and the rest into one index and divides it by the symbolic s*h*d per
    element)."""

    vec: int = 16
    lanes: int = 32
    max_threads: int = 1024


def rope_config(target: TargetSpec, *, d: int, rd: int, **_dims) -> RopeConfig:
    if target.is_cuda:
        return RopeConfig(vec=1, lanes=32, max_threads=int(target.target["max_threads_per_block"]))
    return RopeConfig(vec=16)


def _vector_tail(sch: s_tir.Schedule, loops: list, vec: int) -> None:
    """Fuse the trailing loops and vectorise `vec` lanes of them (all when shorter)."""
    fused = sch.fuse(*loops)
    extent = int(sch.get(fused).extent)
    if extent <= vec:
        sch.vectorize(fused)
    elif extent % vec == 0:
        sch.vectorize(sch.split(fused, [None, vec])[1])


def schedule_rope(func: tvm.tirx.PrimFunc, config: RopeConfig,
                  target: TargetSpec) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    for name in ("copy", "rot"):
        blk = sch.get_sblock(name)
        loops = sch.get_loops(blk)
        if int(sch.get(loops[-1]).extent) == 0:  # rd == d: nothing to copy
            continue
        if not target.is_cuda:
            sch.parallel(sch.fuse(*loops[:-1]))
            _vector_tail(sch, loops[-1:], config.vec)
            continue
        bb, ss, *hh, q = loops
        _, tx = sch.split(q, [None, config.lanes])
        sch.bind(tx, "threadIdx.x")
        sch.bind(bb, "blockIdx.y")
        if hh:  # heads: threadIdx.y, in groups that fit the block
            per_block = max(1, config.max_threads // config.lanes)
            ho, hi = sch.split(hh[0], [None, min(per_block, int(sch.get(hh[0]).extent))])
            sch.bind(hi, "threadIdx.y")
            ss = sch.fuse(ss, ho)
        sch.bind(ss, "blockIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_rope(target_name: str, *, d: int, rd: int, heads: int | None = None,
               inverse: bool = False) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = rope_config(target, d=d, rd=rd)
    return schedule_rope(make_rope(d=d, rd=rd, heads=heads, inverse=inverse), cfg, target)


# ---- example inputs and benchmark cases -----------------------------------------------------


def example_inputs_rms_norm(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    """[x bf16 (n, d), weight bf16 (d,)]: activations with a per-row scale spread and a few
    outlier channels; a weight around 1 (the checkpoint's norm weights are ~N(mean, 0.1 mean))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, :: max(d // 8, 1)] *= 6.0
    w = 1 + 0.1 * torch.randn(d, generator=g)
    return [x.to(torch.bfloat16), w.to(torch.bfloat16)]


def rope_cos_sin(*, b: int, s: int, rd: int, start: int = 0, theta: float = 10000.0,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (b, s, rd/2) as the model builds them (graph.layers.rope_freqs + rope_table with
    the released YaRN settings), each batch row at its own start position."""
    from dsv41.graph.layers import rope_freqs, rope_table

    g = torch.Generator().manual_seed(seed)
    freqs = rope_freqs(rd, 65536, theta, 16.0, 32, 1)
    starts = start + torch.randint(0, 5000, (b, 1), generator=g) * (torch.arange(b) > 0)[:, None]
    return rope_table(freqs, starts + torch.arange(s))


def example_inputs_rope(*, b: int, s: int, d: int, rd: int, heads: int | None = None,
                        seed: int = 0) -> list[torch.Tensor]:
    """[x bf16 (b, s, [heads,] d), cos, sin fp32 (b, s, rd/2)]."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, s, d) if heads is None else (b, s, heads, d)
    x = (torch.randn(*shape, generator=g) * 2).to(torch.bfloat16)
    cos, sin = rope_cos_sin(b=b, s=s, rd=rd, seed=seed)
    return [x, cos, sin]


def _norm_oracle(x, w, eps):
    from dsv41.graph.layers import rms_norm

    return rms_norm(x, w, eps)


def _rope_oracle(x, cos, sin, rd, inverse):
    from dsv41.graph.layers import apply_rope

    return apply_rope(x, cos, sin, rd, inverse=inverse)


def bench_cases(preset_name: str = "bench", tokens: tuple[int, ...] = (1, 128, 2048)
                ) -> list[BenchCase]:
    """RMSNorm at the model's three widths (attn/ffn norm: dim, q_norm: q_lora_rank, kv_norm:
    head_dim) and RoPE on q (n_heads x head_dim), kv (head_dim) and the inverse on o, for each
    token count (b = 1). bytes: bf16 in + out (+ weight / cos, sin tables); flops: norm 4 per
    element (square-add, two products), rope 3 per rotated element (the copy counts none)."""
    from dsv41.graph.config import preset

    a = preset(preset_name)
    eps, hd, rd = a.norm_eps, a.head_dim, a.rope_head_dim
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
        for label, heads, inverse in (("q", a.n_heads, False), ("kv", None, False),
                                      ("o-inv", a.n_heads, True)):
            def prep(n=n, heads=heads, inverse=inverse):
                x, cos, sin = example_inputs_rope(b=1, s=n, d=hd, rd=rd, heads=heads, seed=n)
                return BenchData((x, cos, sin), (torch.empty_like(x),), _rope_oracle,
                                 (x, cos, sin, rd, inverse), lambda r: r)

            rows = n * (heads or 1)
            cases.append(BenchCase(
                name=f"rope-{label}-s{n}", family="rope",
                static=(("d", hd), ("rd", rd), ("heads", heads), ("inverse", inverse)),
                build=lambda t, h=heads, i=inverse: build_rope(t, d=hd, rd=rd, heads=h,
                                                               inverse=i),
                prepare=prep, bytes=4 * rows * hd + 4 * n * rd, flops=3 * rows * rd,
                note="bytes = 4*rows*d + 4*s*rd (cos/sin); rows = s*heads"))
    return cases
