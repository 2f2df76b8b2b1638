"""The KV compressor's per-entry work as one TIR kernel (oracles: graph/model.py `compress` and
`publish_main_kv`, graph/layers.py `softmax_pool`, `rms_norm`, `apply_rope`, graph/ops.py
`quant_fp4_kv`).

What the kernel computes, per group slot g of batch row b (one output entry each):

    m >= 2 (`compress_pool`):
        p[t, c]   = softmax over t < m of score[b, g, t, c]          (fp32, per channel)
        pooled[c] = sum_t kv[b, g, t, c] * p[t, c]                    (fp32, t in order)
    m == 1 (`compress_single`): pooled = kv[b, g] (already bf16: the bf16 `wkv` output)
    latent  = rms_norm(bf16(pooled), weight, eps)                     (bf16, pre-RoPE)
    roped   = apply_rope(latent, cos[b, g], sin[b, g], rd)            (bf16, last rd dims)
    fp4:  codes, scales = quant_fp4_kv(roped)    (E2M1 packed low nibble first; E4M3 per 16)
    bf16: kv_out = roped                          (the `kv_dtype="bf16"` store)

Outputs: `latent` (b, G, hd) bf16 -- what `Compressed.latent` holds and the indexer's `wk` reads
-- and the stored entry. For m >= 2, `ok[b, g]` false gives all-zero outputs (latent, codes,
scales, kv_out) whatever the inputs hold (an incomplete slot's inputs may be -inf / NaN).

What the caller passes (the graph's `compress` does the same gathers): kv, score fp32
(b, G, m, hd) = the `fp32_linear` outputs of each slot's member tokens, the first members
taken from the store's tail where the chunk started mid-group (`gather_members`); ok = the slot
is complete by the chunk's end; cos/sin fp32 (b, G, rd/2) = the compressed RoPE table
(`compress_rope_theta`) at the slot's first position (first + g) * m (`Compressed.positions`).
The tail bookkeeping (which members of a partial group wait for the next chunk) stays in the
graph; the kernel only sees gathered slots.

Agreement with the oracle:

* pooled: the oracle's formula in its order (max, e_t = exp(s_t - max), the sum of e in order,
  p_t = e_t / sum, sum_t kv_t * p_t with each product rounded). exp is Sleef's expf_u10
  written out with FMAs (`exp_sleef`), which is what torch's vectorised CPU softmax runs on x86
  (AVX2 / AVX-512), and products are fenced so no compiler fuses them into an FMA (`fence`:
  LLVM's arithmetic.fence on CPU, __fmul_rn / __fdiv_rn on CUDA). On x86 the pooled fp32 values
  are therefore bit-identical to torch's (measured: all of them); elsewhere, or on a GPU with
  nvcc's flush-to-zero, they may differ in the last bit.
* latent: RMSNorm with the sum of squares in `norm_lanes` strided partial sums (as
  schedules/norm.py), so within one bf16 ulp of the oracle and almost always equal (measured
  ~1e-5 of the values differ).
* roped, codes, scales: bit-exact functions of the kernel's own latent (RoPE with
  `norm.mul_bf16` products; the FP4-KV quantiser route of schedules/quant.py, which is bit-exact
  for every finite input). So the stored entry equals the oracle's wherever the latent does,
  and the tests check exactly that: codes and scales == quant_fp4_kv(apply_rope(kernel latent))
  bit for bit, and == the end-to-end oracle's on every entry whose latent matches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target

from .common import round_bf16
from .norm import BenchCase, BenchData, check_lanes, f32_of_bf16, mul_bf16
from .quant import e2m1_code, kv_scale_byte, kv_thresholds

KV_BLOCK = fmt.FP4_KV_BLOCK  # 16 channels per E4M3 scale
KV_FORMATS = ("fp4", "bf16")


def _abs_bits(x):
    """|x| as int32 bits (order-preserving for non-negative floats)."""
    return T.reinterpret("int32", T.reinterpret("uint32", x) & T.uint32(0x7FFFFFFF))


FENCES = ("llvm", "cuda", "none")
# Sleef's expf_u10 (the FMA variant), the exp of torch's vectorised CPU softmax
_R_LN2 = 1.442695040888963407359924681001892137426645954152985934135449406931
_L2U, _L2L = 0.693145751953125, 1.428606765330187045e-06
_EXP_POLY = (0.000198527617612853646278381, 0.00139304355252534151077271,
             0.00833336077630519866943359, 0.0416664853692054748535156,
             0.166666671633720397949219, 0.5)


def _let(value, body, name: str = "t"):
    """Bind `value` once and build `body(var)` (keeps reused subexpressions linear)."""
    var = tvm.tirx.Var(name, value.ty)
    return tvm.tirx.Let(var, value, body(var))


def mul_rn(a, b, fence: str):
    """fp32(a * b), rounded before any add that consumes it: LLVM's `arithmetic.fence` (TVM's
    LLVM backend forms FMAs even with contraction off) or CUDA's `__fmul_rn`; "none" leaves
    the product to the compiler."""
    if fence == "llvm":
        return T.call_llvm_pure_intrin("float32", "llvm.arithmetic.fence", a * b)
    if fence == "cuda":
        return T.call_pure_extern("float32", "__fmul_rn", a, b)
    return a * b


def fma(a, b, c, fence: str):
    """a * b + c rounded once (CUDA's codegen has no rule for tirx.fma: `fmaf`)."""
    if fence == "cuda":
        return T.call_pure_extern("float32", "fmaf", a, b, c)
    return T.fma(a, b, c)


def div_rn(a, b, fence: str):
    """IEEE a / b (CUDA: `__fdiv_rn`, since nvcc's fast math divides approximately)."""
    if fence == "cuda":
        return T.call_pure_extern("float32", "__fdiv_rn", a, b)
    return a / b


def exp_sleef(x, fence: str):
    """exp(x) for x <= 0 as Sleef's expf_u10 computes it with FMAs (torch's softmax on x86
    CPUs; bit-identical there): q = rint(x / ln2), the remainder in two FMA steps, a degree-5
    polynomial by FMAs, then 2^q as two exact power-of-two products; 0 below -104. Vectorises
    (libm's expf is a scalar call per lane, ~20x slower here).

    rint uses the 1.5 * 2^23 trick on the bits: T.nearbyint is scalarised per lane by TVM's
    LLVM backend, and TVM's simplifier folds a float `(y + c) - c` back to y."""
    def body(qi):
        q = T.Cast("float32", qi)
        s = fma(q, T.float32(-_L2U), x, fence)
        s = fma(q, T.float32(-_L2L), s, fence)

        def poly(sv):
            u = T.float32(_EXP_POLY[0])
            for c in _EXP_POLY[1:]:
                u = fma(u, sv, T.float32(c), fence)
            u = T.float32(1) + fma(sv * sv, u, sv, fence)
            half = T.shift_right(qi, T.int32(1))
            p1 = T.reinterpret("float32", T.shift_left(half + T.int32(127), T.int32(23)))
            p2 = T.reinterpret("float32", T.shift_left(qi - half + T.int32(127), T.int32(23)))
            return T.Select(x < T.float32(-104), T.float32(0), mul_rn(u * p1, p2, fence))

        return _let(s, poly, "s")

    # x / ln2 rounded first (as Sleef's rint(x * R_LN2)), then to an integer by adding 1.5 *
    # 2^23: the low significand bits of the sum are the integer (|x / ln2| < 2^22)
    shifted = mul_rn(T.max(x, T.float32(-200)), T.float32(_R_LN2), fence) \
        + T.float32(1.5 * 2**23)
    return _let(T.reinterpret("int32", shifted) - T.int32(0x4B400000), body, "q")


def pool_value(kv, score, vb, vg, vc, m: int, fence: str):
    """sum_t kv_t * softmax_t(score)_t for one channel, in the oracle's order: max, e_t =
    exp(s_t - max), the sum of e in order, p_t = e_t / sum, then sum_t kv_t * p_t in order with
    every product rounded. For m = 2 with one exp: exp(s_t - max) is exactly 1 for the larger
    score and exp(min - max) for the other (ties: both 1)."""
    s = [score[vb, vg, T.int64(t), vc] for t in range(m)]
    mx = s[0]
    for t in range(1, m):
        mx = T.max(mx, s[t])

    def finish(e):
        def with_total(tot):
            acc = mul_rn(kv[vb, vg, T.int64(0), vc], div_rn(e[0], tot, fence), fence)
            for t in range(1, m):
                acc = acc + mul_rn(kv[vb, vg, T.int64(t), vc], div_rn(e[t], tot, fence), fence)
            return acc

        tot = e[0]
        for t in range(1, m):
            tot = tot + e[t]
        return _let(tot, with_total, "tot")

    if m == 2:
        return _let(exp_sleef(T.min(s[0], s[1]) - T.max(s[0], s[1]), fence), lambda small: finish(
            [T.Select(s[0] >= s[1], T.float32(1), small),
             T.Select(s[1] >= s[0], T.float32(1), small)]), "small")
    def bind(values, bound):  # each exp is used twice (sum, quotient): bind it once
        if len(bound) == len(values):
            return finish(bound)
        return _let(values[len(bound)], lambda v: bind(values, [*bound, v]), "e")

    return _let(mx, lambda mxv: bind([exp_sleef(st - mxv, fence) for st in s], []), "mx")


def _check(m: int, hd: int, rd: int, kv_format: str, norm_lanes: int, fence: str) -> None:
    if fence not in FENCES:
        raise ValueError(f"fence must be one of {', '.join(FENCES)}, got {fence!r}.")
    if m < 1:
        raise ValueError(f"compress needs a ratio m >= 1, got {m}.")
    if hd <= 0 or hd % KV_BLOCK:
        raise ValueError(f"compress needs hd a positive multiple of {KV_BLOCK}, got {hd}.")
    if rd <= 0 or rd % 2 or rd > hd:
        raise ValueError(f"compress needs an even rd in (0, hd]; got rd={rd}, hd={hd}.")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {', '.join(KV_FORMATS)}, got {kv_format!r}.")
    check_lanes(hd, norm_lanes, "compress norm (hd)")


def make_compress(*, m: int, hd: int, rd: int, eps: float, kv_format: str = "fp4",
                  norm_lanes: int = 32, fence: str = "none") -> tvm.tirx.PrimFunc:
    """The compressor kernel for ratio m (see the module docstring). Buffers, in order:

    m >= 2: kv fp32 (b, G, m, hd), score fp32 (b, G, m, hd), ok bool (b, G),
    m == 1: kv bf16 (b, G, hd),
    then weight bf16 (hd,), cos fp32 (b, G, rd/2), sin fp32 (b, G, rd/2), latent bf16
    (b, G, hd), and codes uint8 (b, G, hd/2) + scales uint8 (b, G, hd/16) (kv_format "fp4") or
    kv_out bf16 (b, G, hd) ("bf16"). b and G are symbolic."""
    _check(m, hd, rd, kv_format, norm_lanes, fence)
    HD, NOPE, P = T.int64(hd), T.int64(hd - rd), T.int64(rd // 2)
    NL, DL = T.int64(norm_lanes), T.int64(hd // norm_lanes)
    NG, B, BH = T.int64(hd // KV_BLOCK), T.int64(KV_BLOCK), T.int64(KV_BLOCK // 2)
    M = T.int64(m)
    fp4 = kv_format == "fp4"

    def valid(ok, vb, vg):
        return ok[vb, vg] if m > 1 else T.bool(True)

    @T.macro
    def body(kv, score, ok, weight, cos, sin, latent, codes, scales, kv_out):
        b = cos.shape[0]
        g = cos.shape[1]
        for bb, gg in T.grid(b, g):
            with T.sblock("task"):
                vb, vg = T.axis.remap("SS", [bb, gg])
                pr = T.sblock_alloc_buffer((HD,), "float32")  # bf16(pooled)
                sqp = T.sblock_alloc_buffer((NL,), "float32")
                ssq = T.sblock_alloc_buffer((1,), "float32")
                lat = T.sblock_alloc_buffer((HD,), "float32")  # the bf16 latent
                ro = T.sblock_alloc_buffer((HD,), "float32")  # the bf16 roped entry
                amax = T.sblock_alloc_buffer((NG,), "int32")
                sbyte = T.sblock_alloc_buffer((NG,), "uint8")
                for c in range(HD):
                    with T.sblock("pool"):
                        vc = T.axis.remap("S", [c])
                        if m > 1:
                            pr[vc] = _let(pool_value(kv, score, vb, vg, vc, m, fence), round_bf16,
                                          "pooled")
                        else:
                            pr[vc] = f32_of_bf16(kv[vb, vg, vc])
                for ln, kk in T.grid(NL, DL):
                    with T.sblock("sq"):
                        vl, vk = T.axis.remap("SR", [ln, kk])
                        with T.init():
                            sqp[vl] = T.float32(0)
                        sqp[vl] = sqp[vl] + pr[vk * NL + vl] * pr[vk * NL + vl]
                for ln in range(NL):
                    with T.sblock("ssq"):
                        vl = T.axis.remap("R", [ln])
                        with T.init():
                            ssq[0] = T.float32(0)
                        ssq[0] = ssq[0] + sqp[vl]
                for c in range(HD):
                    with T.sblock("lat"):
                        vc = T.axis.remap("S", [c])
                        lat[vc] = round_bf16(f32_of_bf16(weight[vc]) * (
                            pr[vc] * T.rsqrt(ssq[0] / T.float32(hd) + T.float32(eps))))
                for c in range(HD):
                    with T.sblock("latent"):
                        vc = T.axis.remap("S", [c])
                        latent[vb, vg, vc] = T.Cast("bfloat16", T.Select(
                            valid(ok, vb, vg), lat[vc], T.float32(0)))
                for c in range(NOPE):
                    with T.sblock("rope_copy"):
                        vc = T.axis.remap("S", [c])
                        ro[vc] = lat[vc]
                for p, t in T.grid(P, T.int64(2)):
                    with T.sblock("rope_rot"):
                        vp, vt = T.axis.remap("SS", [p, t])
                        ro[NOPE + vp * T.int64(2) + vt] = round_bf16(T.Select(
                            vt == T.int64(0),
                            mul_bf16(lat[NOPE + vp * T.int64(2)], cos[vb, vg, vp])
                            - mul_bf16(lat[NOPE + vp * T.int64(2) + T.int64(1)],
                                       sin[vb, vg, vp]),
                            mul_bf16(lat[NOPE + vp * T.int64(2)], sin[vb, vg, vp])
                            + mul_bf16(lat[NOPE + vp * T.int64(2) + T.int64(1)],
                                       cos[vb, vg, vp])))
                if fp4:
                    for q in range(NG):
                        for j in range(B):
                            with T.sblock("amax"):
                                vq, vj = T.axis.remap("SR", [q, j])
                                with T.init():
                                    amax[vq] = T.int32(0)
                                amax[vq] = T.max(amax[vq], _abs_bits(ro[vq * B + vj]))
                        with T.sblock("sbyte"):
                            vq = T.axis.remap("S", [q])
                            sbyte[vq] = kv_scale_byte(T.reinterpret("float32", amax[vq]))
                        with T.sblock("scale"):
                            vq = T.axis.remap("S", [q])
                            scales[vb, vg, vq] = T.Select(valid(ok, vb, vg), sbyte[vq],
                                                          T.uint8(0))
                        for j in range(BH):
                            with T.sblock("code"):
                                vq, vj = T.axis.remap("SS", [q, j])
                                codes[vb, vg, vq * BH + vj] = T.Select(
                                    valid(ok, vb, vg), T.Cast("uint8", e2m1_code(
                                        ro[vq * B + vj * T.int64(2)],
                                        kv_thresholds(sbyte[vq])) | (e2m1_code(
                                            ro[vq * B + vj * T.int64(2) + T.int64(1)],
                                            kv_thresholds(sbyte[vq])) << T.uint32(4))),
                                    T.uint8(0))
                else:
                    for c in range(HD):
                        with T.sblock("kv_out"):
                            vc = T.axis.remap("S", [c])
                            kv_out[vb, vg, vc] = T.Cast("bfloat16", T.Select(
                                valid(ok, vb, vg), ro[vc], T.float32(0)))

    if m > 1 and fp4:
        @T.prim_func(s_tir=True)
        def compress_pool(kv_h: T.handle, score_h: T.handle, ok_h: T.handle,
                          weight: T.Buffer((HD,), "bfloat16"), cos_h: T.handle,
                          sin_h: T.handle, lat_h: T.handle, codes_h: T.handle,
                          scales_h: T.handle):
            T.func_attr({"global_symbol": "compress", "tirx.noalias": True, "dsv41.fence": fence})
            b, g = T.int64(), T.int64()
            kv = T.match_buffer(kv_h, (b, g, M, HD), "float32")
            score = T.match_buffer(score_h, (b, g, M, HD), "float32")
            ok = T.match_buffer(ok_h, (b, g), "bool")
            cos = T.match_buffer(cos_h, (b, g, P), "float32")
            sin = T.match_buffer(sin_h, (b, g, P), "float32")
            latent = T.match_buffer(lat_h, (b, g, HD), "bfloat16")
            codes = T.match_buffer(codes_h, (b, g, HD // T.int64(2)), "uint8")
            scales = T.match_buffer(scales_h, (b, g, NG), "uint8")
            body(kv, score, ok, weight, cos, sin, latent, codes, scales, None)

        return compress_pool

    if m > 1:
        @T.prim_func(s_tir=True)
        def compress_pool_bf16(kv_h: T.handle, score_h: T.handle, ok_h: T.handle,
                               weight: T.Buffer((HD,), "bfloat16"), cos_h: T.handle,
                               sin_h: T.handle, lat_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "compress", "tirx.noalias": True, "dsv41.fence": fence})
            b, g = T.int64(), T.int64()
            kv = T.match_buffer(kv_h, (b, g, M, HD), "float32")
            score = T.match_buffer(score_h, (b, g, M, HD), "float32")
            ok = T.match_buffer(ok_h, (b, g), "bool")
            cos = T.match_buffer(cos_h, (b, g, P), "float32")
            sin = T.match_buffer(sin_h, (b, g, P), "float32")
            latent = T.match_buffer(lat_h, (b, g, HD), "bfloat16")
            kv_out = T.match_buffer(out_h, (b, g, HD), "bfloat16")
            body(kv, score, ok, weight, cos, sin, latent, None, None, kv_out)

        return compress_pool_bf16

    if fp4:
        @T.prim_func(s_tir=True)
        def compress_single(kv_h: T.handle, weight: T.Buffer((HD,), "bfloat16"),
                            cos_h: T.handle, sin_h: T.handle, lat_h: T.handle,
                            codes_h: T.handle, scales_h: T.handle):
            T.func_attr({"global_symbol": "compress", "tirx.noalias": True, "dsv41.fence": fence})
            b, g = T.int64(), T.int64()
            kv = T.match_buffer(kv_h, (b, g, HD), "bfloat16")
            cos = T.match_buffer(cos_h, (b, g, P), "float32")
            sin = T.match_buffer(sin_h, (b, g, P), "float32")
            latent = T.match_buffer(lat_h, (b, g, HD), "bfloat16")
            codes = T.match_buffer(codes_h, (b, g, HD // T.int64(2)), "uint8")
            scales = T.match_buffer(scales_h, (b, g, NG), "uint8")
            body(kv, None, None, weight, cos, sin, latent, codes, scales, None)

        return compress_single

    @T.prim_func(s_tir=True)
    def compress_single_bf16(kv_h: T.handle, weight: T.Buffer((HD,), "bfloat16"),
                             cos_h: T.handle, sin_h: T.handle, lat_h: T.handle,
                             out_h: T.handle):
        T.func_attr({"global_symbol": "compress", "tirx.noalias": True, "dsv41.fence": fence})
        b, g = T.int64(), T.int64()
        kv = T.match_buffer(kv_h, (b, g, HD), "bfloat16")
        cos = T.match_buffer(cos_h, (b, g, P), "float32")
        sin = T.match_buffer(sin_h, (b, g, P), "float32")
        latent = T.match_buffer(lat_h, (b, g, HD), "bfloat16")
        kv_out = T.match_buffer(out_h, (b, g, HD), "bfloat16")
        body(kv, None, None, weight, cos, sin, latent, None, None, kv_out)

    return compress_single_bf16


# ---- config and schedule --------------------------------------------------------------------


@dataclass(frozen=True)
class CompressConfig:
    """norm_lanes: strided partial sums of the norm's sum of squares (part of the definition).
    CPU: one group slot per parallel task, `vec`-wide vectors over the channels. CUDA: one
    thread block of `threads` per slot, every stage spread over its threads."""

    norm_lanes: int = 32
    vec: int = 16
    threads: int = 1
    fence: str = "llvm"  # how products are kept out of FMAs (make_compress's `fence`)


def compress_config(target: TargetSpec, *, hd: int, **_dims) -> CompressConfig:
    lanes = 32
    while hd % lanes:
        lanes //= 2
    if target.is_cuda:
        return CompressConfig(norm_lanes=lanes, vec=1, threads=128, fence="cuda")
    return CompressConfig(norm_lanes=lanes, vec=16, fence="llvm")


def _blocks(sch: s_tir.Schedule) -> dict[str, list]:
    out: dict[str, list] = {}
    pending = sch.get_child_blocks(sch.get_sblock("task"))
    while pending:
        blk, pending = pending[0], pending[1:]
        out.setdefault(sch.get(blk).name_hint, []).append(blk)
        pending = sch.get_child_blocks(blk) + pending
    return out


def _inner(sch: s_tir.Schedule, blk) -> list:
    return [lp for lp in sch.get_loops(blk)
            if sch.get(lp).loop_var.name not in ("bb", "gg") and not sch.get(lp).thread_binding]


def _vectorize(sch: s_tir.Schedule, loop, vec: int) -> None:
    extent = int(sch.get(loop).extent)
    if extent <= vec:
        sch.vectorize(loop)
    elif extent % vec == 0:
        sch.vectorize(sch.split(loop, [None, vec])[1])


def schedule_compress(func: tvm.tirx.PrimFunc, config: CompressConfig,
                      target: TargetSpec) -> tvm.tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    sqp = sch.get(sch.get_sblock("task")).alloc_buffers[1]
    if int(sqp.shape[0]) != config.norm_lanes:
        raise ValueError(f"The kernel was built with norm_lanes={int(sqp.shape[0])} but the "
                         f"config asks for {config.norm_lanes}; build it with make_compress(..., "
                         "norm_lanes=config.norm_lanes).")
    fence = str(func.attrs["dsv41.fence"])
    if fence == ("llvm" if target.is_cuda else "cuda"):
        raise ValueError(f"The kernel was built with fence={fence!r}, which {target.name} cannot "
                         f"compile; build it with make_compress(..., fence=config.fence).")
    bb, gg = sch.get_loops(sch.get_sblock("task"))
    blocks = _blocks(sch)
    if target.is_cuda:
        sch.bind(bb, "blockIdx.y")
        sch.bind(gg, "blockIdx.x")
        for name in ("pool", "sq", "ssq", "lat", "rope_copy", "rope_rot", "amax", "sbyte"):
            for blk in blocks.get(name, []):
                sch.set_scope(blk, 0, "shared")
        # the per-16 quantisation group: one thread each (amax, scale byte, codes)
        if "code" in blocks:
            (code,) = blocks["code"]
            q = _inner(sch, code)[0]
            _, tq = sch.split(q, [None, config.threads])
            sch.bind(tq, "threadIdx.x")
            for name in ("amax", "sbyte"):
                sch.set_scope(blocks[name][0], 0, "local")
        reduce = {"sq", "ssq"}
        for name, blks in blocks.items():
            if name in ("amax", "sbyte", "scale", "code"):
                continue
            for blk in blks:
                loops = _inner(sch, blk)
                spatial = loops[:-1] if name in reduce else loops
                if not spatial:
                    spatial = [sch.add_unit_loop(loops[0])]
                _, tx = sch.split(sch.fuse(*spatial), [None, config.threads])
                sch.bind(tx, "threadIdx.x")
                if name in reduce:
                    sch.reverse_compute_at(sch.cache_write(blk, 0, "local"), tx)
        return sch.mod["main"].with_attr("tirx.is_scheduled", True)
    sch.parallel(sch.fuse(bb, gg))
    for name in ("pool", "lat", "latent", "rope_copy", "kv_out"):
        for blk in blocks.get(name, []):
            _vectorize(sch, _inner(sch, blk)[-1], config.vec)
    for blk in blocks.get("rope_rot", []):
        _vectorize(sch, sch.fuse(*_inner(sch, blk)), config.vec)
    (sq,) = blocks["sq"]
    ln, kk = _inner(sch, sq)
    sch.reorder(kk, ln)
    sch.vectorize(ln)
    for blk in blocks.get("code", []):
        sch.vectorize(_inner(sch, blk)[-1])
    sch.decompose_reduction(sq, kk)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def build_compress(target_name: str, *, m: int, hd: int, rd: int, eps: float,
                   kv_format: str = "fp4") -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = compress_config(target, hd=hd)
    func = make_compress(m=m, hd=hd, rd=rd, eps=eps, kv_format=kv_format,
                         norm_lanes=cfg.norm_lanes, fence=cfg.fence)
    return schedule_compress(func, cfg, target)


# ---- the oracle as the graph composes it, example inputs, benchmark cases -------------------


def compress_oracle(kv, score, ok, weight, cos, sin, m: int, rd: int, eps: float,
                    kv_format: str = "fp4"):
    """The graph's functions on gathered slots, as `compress` + `publish_main_kv` run them:
    (latent, codes, scales) or (latent, kv_out). No masking (the graph stores only ok slots)."""
    from dsv41.graph import ops
    from dsv41.graph.layers import apply_rope, rms_norm

    if m > 1:
        pooled = (kv * score.softmax(dim=2)).sum(dim=2)  # compress's grouped softmax_pool
        latent = rms_norm(pooled.to(torch.bfloat16), weight, eps)
    else:
        latent = rms_norm(kv, weight, eps)
    roped = apply_rope(latent, cos, sin, rd)
    if kv_format == "bf16":
        return latent, roped
    codes, scales = ops.quant_fp4_kv(roped.float())
    return latent, codes, scales


def example_inputs_compress(*, b: int, g: int, m: int, hd: int, rd: int, dim: int = 256,
                            invalid: int = 0, seed: int = 0) -> list[torch.Tensor]:
    """Gathered slot inputs as the model makes them: x ~ bf16 activations of width `dim`, kv and
    score from fp32 linears of x (score with a gate-like spread, so the softmax is neither flat
    nor one-hot), cos/sin of the compressed table at positions j * m, a norm weight around 1.
    The last `invalid` slots of every row are incomplete: ok False, their missing members'
    scores -inf (the store's empty tail) -- the kernel must write zeros there.
    m >= 2: [kv, score, ok, weight, cos, sin]; m == 1: [kv (bf16), weight, cos, sin]."""
    from dsv41.graph.layers import rope_freqs, rope_table

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, g * m, dim, generator=gen).to(torch.bfloat16)
    wkv = torch.randn(hd, dim, generator=gen) * dim**-0.5
    weight = (1 + 0.1 * torch.randn(hd, generator=gen)).to(torch.bfloat16)
    freqs = rope_freqs(rd, 65536, 160000.0, 16.0, 32, 1)
    first = torch.randint(0, 1000, (b, 1), generator=gen)
    cos, sin = rope_table(freqs, (first + torch.arange(g)) * m)
    if m == 1:
        kv = torch.nn.functional.linear(x, wkv.to(torch.bfloat16))
        return [kv, weight, cos, sin]
    wgate = torch.randn(hd, dim, generator=gen) * 2 * dim**-0.5
    kv = torch.nn.functional.linear(x.float(), wkv).unflatten(1, (g, m))
    score = torch.nn.functional.linear(x.float(), wgate).unflatten(1, (g, m))
    ok = torch.ones(b, g, dtype=torch.bool)
    if invalid:
        ok[:, g - invalid:] = False
        score[:, g - invalid:, 1:] = float("-inf")
        kv[:, g - invalid:, 1:] = 0.0
    return [kv.contiguous(), score.contiguous(), ok, weight, cos, sin]


def bench_cases(preset_name: str = "bench", tokens: tuple[int, ...] = (2, 128, 2048)
                ) -> list[BenchCase]:
    """The m = 2 and m = 1 compressors at the preset's head_dim / rope_head_dim, FP4 entries,
    for a chunk of s tokens (s / m slots, all complete; b = 1). bytes: m = 2: 2 * 4 * s * hd
    (kv and score) in, m = 1: 2 * s * hd; plus G * (2 * hd + hd / 2 + hd / 16) out. flops:
    ~8 per pooled channel-member + 6 per channel (norm, rope); memory / latency bound."""
    from dsv41.graph.config import preset

    a = preset(preset_name)
    hd, rd, eps = a.head_dim, a.rope_head_dim, a.norm_eps
    cases = []
    for m in (2, 1):
        for s in tokens:
            g = s // m

            def prep(m=m, s=s, g=g):
                ins = example_inputs_compress(b=1, g=g, m=m, hd=hd, rd=rd, dim=a.dim, seed=s)
                outs = (torch.empty(1, g, hd, dtype=torch.bfloat16),
                        torch.empty(1, g, hd // 2, dtype=torch.uint8),
                        torch.empty(1, g, hd // KV_BLOCK, dtype=torch.uint8))
                args = (*ins, m, rd, eps) if m > 1 else (ins[0], None, None, *ins[1:], m, rd,
                                                          eps)
                return BenchData(tuple(ins), outs, compress_oracle, args, lambda r: r[0])

            nin = 2 * 4 * s * hd if m > 1 else 2 * s * hd
            cases.append(BenchCase(
                name=f"compress-m{m}-s{s}", family="compressor",
                static=(("m", m), ("hd", hd), ("rd", rd), ("eps", eps)),
                build=lambda t, m=m: build_compress(t, m=m, hd=hd, rd=rd, eps=eps),
                prepare=prep, bytes=nin + g * (2 * hd + hd // 2 + hd // KV_BLOCK),
                flops=8 * s * hd + 6 * g * hd, note="bytes = inputs + G*(2*hd + hd/2 + hd/16)"))
    return cases
