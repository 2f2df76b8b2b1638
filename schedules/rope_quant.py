"""A new cache entry's RMSNorm, RoPE and quantisation as one kernel (oracle: `dsv41::rope_quant`,
graph/ops.py: `quant(rope(rms_norm(x)).float())`, the norm optional).

Every write of a new entry into a cache ran these as three or four kernels: the window's KV
(`rms_norm`, `rope`, the fp32 cast, `quant_fp8`), the compressor's index keys (the same with
`quant_mxfp4`), its main KV (`rope`, the cast, `quant_fp4_kv`: normed before its pooling). Here
one block per row (b, s) does all of it:

* the norm: the sum of squares in `norm_lanes` strided partials added in lane order, rstd,
  y = bf16(w * (x * rstd)), each exactly as `norm.make_rms_norm` (the same expressions in the
  same order, so the same bits: a bf16 square is exact in fp32, so contraction cannot change a
  partial sum either);
* RoPE on the last rd dims, through `rope.rotated_bits` (the rope kernel's arithmetic);
* the quantiser of `fmt`, through quant.py's helpers (group amax on the |x| bits, the scale
  byte, the codes), bit-exact as `schedules/quant.py` explains.

So the outputs are the bits of the unfused kernels' chain (tested), and without the norm the
bits of the oracle (RoPE and the quantisers are bit-exact); with it, the norm is within one bf16
ulp of torch's, almost always equal, as `rms_norm`'s.

The row's normed values (bf16) and quantiser inputs (fp32) pass through two per-row scratch
buffers, local on CUDA. CPU: rows in parallel, the element loops vectorised (`vec`); CUDA: one
thread per row, scalar (`vec` False), `threads` rows per thread block. The whole row is
staged before it is quantised, so a group may straddle the RoPE'd dims (the small preset's 48
+ 16 with groups of 32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph.ops import ENTRY_GROUP, EntryFormat, entry_code_width
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common.rows import schedule_block_rows
from dsv41.schedules.common.stages import rms_norm_row
from dsv41.schedules.gemm import fp8_code, pow2_scale_byte
from dsv41.schedules.norm import check_lanes, f32_of_bf16, norm_config
from dsv41.schedules.quant import (
    abs_bits,
    e2m1_code,
    kv_scale_byte,
    kv_thresholds,
    mx_scale_byte,
    mx_thresholds,
)
from dsv41.schedules.rope import rotated_bits

VEC = 16  # CPU: lanes of the vectorised element loops (fp32: one AVX-512 vector)


def _scale_byte(fmt: EntryFormat, amax):
    if fmt == EntryFormat.FP8:
        return T.Cast("uint8", pow2_scale_byte(amax))
    return kv_scale_byte(amax) if fmt == EntryFormat.FP4_KV else mx_scale_byte(amax)


def _thresholds(fmt: EntryFormat, sbyte):
    return kv_thresholds(sbyte) if fmt == EntryFormat.FP4_KV else mx_thresholds(sbyte)


def _check(*, d: int, rd: int, fmt: EntryFormat, norm_lanes: int) -> None:
    group = ENTRY_GROUP[fmt]
    if d <= 0 or rd <= 0 or rd % 2 or rd > d:
        raise ValueError(f"rope_quant needs d > 0 and an even rd in 1..d; got d={d}, rd={rd}.")
    if d % group:
        raise ValueError(f"rope_quant needs d a multiple of the {fmt.value} group ({group}); "
                         f"got d={d}.")
    check_lanes(d, norm_lanes, "rope_quant norm (d)")


def make_rope_quant(*, d: int, rd: int, fmt: EntryFormat, eps: float | None,
                    norm_lanes: int = 32, vec: bool = True, scratch: str = "global",
                    into: bool = False, window: bool = False) -> tvm.tirx.PrimFunc:
    """`rope_quant(x, cos, sin[, weight]) -> (codes, scales)`: x bf16 (b, s, d), cos / sin fp32
    (b or 1, s, rd/2), weight bf16 (d,) when `eps` is not None (the norm), codes uint8 (b, s,
    `entry_code_width`), scales uint8 (b, s, d / group); b, s and the tables' batch symbolic.
    `vec`: the element loops vectorised (CPU); `scratch`: the per-row buffers' scope.

    `into`: `rope_quant_rows(codes, scales, idx, x, cos, sin[, weight])`, the entries written
    in place into rows idx (b, s) int64 of a cache's codes (b, n, width) and scales (b, n,
    d / group) (the lowering's `call_tir_inplace`), as `scatter_rows` writes them: a row whose
    index is outside 0..n-1 (-1: none) is neither computed nor written.

    `window`: `rope_quant_window(codes, scales, slot, x, cos, sin[, weight]) -> (buf_codes,
    buf_scales)`, a chunk's window entries: buf (b, w + s, ..) = the ring (b, w, ..) as it was,
    then the chunk's entries; afterwards the ring's rows slot (b, s) int64 (-1 or outside
    0..w-1: none) take their entries, in place. Three stages in turn (`ring_copy`, `row`,
    `ring_write`), each parallel over its rows: the ring's copy, the concatenation and the
    scatter kernels of the unfused chain, bit for bit."""
    if into and window:
        raise ValueError("rope_quant writes into rows of a cache or into a window, not both.")
    fmt = EntryFormat(fmt)
    _check(d=d, rd=rd, fmt=fmt, norm_lanes=norm_lanes)
    group = ENTRY_GROUP[fmt]
    D, R2, NOPE = T.int64(d), T.int64(rd // 2), T.int64(d - rd)
    B, G = T.int64(group), T.int64(d // group)
    CW = T.int64(entry_code_width(fmt, d))
    NL = T.int64(norm_lanes)
    loop = T.vectorized if vec else T.serial

    def width(n: int) -> T.int64:  # the vector width of a loop of n elements
        return T.int64(math.gcd(VEC, n) if vec else 1)

    VD, VN, VL = width(d), width(d - rd), width(norm_lanes)
    with_norm = eps is not None

    norm_row = rms_norm_row(vec=int(VL))  # a fresh macro (see common.stages)

    @T.macro
    def quantise(v, amax, sb, codes, scales, vb, crow, g):
        """Group g of the row's values v: its scale byte, then its codes, into row crow."""
        amax[0] = T.int32(0)
        for j in range(B):
            amax[0] = T.max(amax[0], abs_bits(v[g * B + j]))
        sb[0] = _scale_byte(fmt, T.reinterpret("float32", amax[0]))
        scales[vb, crow, g] = sb[0]
        if fmt == EntryFormat.FP8:
            for j in loop(B):
                codes[vb, crow, g * B + j] = fp8_code(v[g * B + j], T.Cast("uint32", sb[0]))
        else:
            for p in loop(B // T.int64(2)):
                codes[vb, crow, g * (B // T.int64(2)) + p] = T.Cast("uint8", e2m1_code(
                    v[g * B + p * T.int64(2)], _thresholds(fmt, sb[0])) | (e2m1_code(
                        v[g * B + p * T.int64(2) + T.int64(1)], _thresholds(fmt, sb[0]))
                        << T.uint32(4)))

    @T.macro
    def row(x, cos, sin, weight, codes, scales, vb, vt, crow, ok, cb):
        """Row (vb, vt) of x into row crow of codes / scales, where `ok` (True: always)."""
        nb = T.sblock_alloc_buffer((D,), "float32", scope=scratch)  # the normed row (bf16 values)
        v = T.sblock_alloc_buffer((D,), "float32", scope=scratch)  # the quantiser's input
        amax = T.sblock_alloc_buffer((1,), "int32", scope=scratch)
        sb = T.sblock_alloc_buffer((1,), "uint8", scope=scratch)
        if with_norm:  # static: the norm's lane partials and sum of squares
            part = T.sblock_alloc_buffer((NL,), "float32", scope=scratch)
            ssq = T.sblock_alloc_buffer((1,), "float32", scope=scratch)
        else:
            part = T.meta_var(None)
            ssq = T.meta_var(None)
        if ok:
            if with_norm:
                norm_row(nb, lambda c: (c,), part, ssq, lambda c: f32_of_bf16(x[vb, vt, c]),
                         weight, d, eps, norm_lanes)
            else:
                for c0 in range(D // VD):
                    for c1 in loop(VD):
                        nb[c0 * VD + c1] = f32_of_bf16(x[vb, vt, c0 * VD + c1])
            for c0 in range(NOPE // VN):
                for c1 in loop(VN):
                    v[c0 * VN + c1] = nb[c0 * VN + c1]
            tb = T.Select(cb == T.int64(1), T.int64(0), vb)  # the tables' batch row
            for p in range(R2):
                re_b, im_b = rotated_bits(nb[NOPE + p * T.int64(2)],
                                          nb[NOPE + p * T.int64(2) + T.int64(1)],
                                          cos[tb, vt, p], sin[tb, vt, p], inverse=False)
                v[NOPE + p * T.int64(2)] = T.reinterpret("float32", re_b << T.uint32(16))
                v[NOPE + p * T.int64(2) + T.int64(1)] = T.reinterpret("float32",
                                                                      im_b << T.uint32(16))
            for g in range(G):
                quantise(v, amax, sb, codes, scales, vb, crow, g)

    if into:
        return _rows_kernel(row, D=D, R2=R2, CW=CW, G=G, with_norm=with_norm)
    if window:
        return _window_kernel(row, D=D, R2=R2, CW=CW, G=G, with_norm=with_norm, loop=loop,
                              vw=width(entry_code_width(fmt, d)), vg=width(d // group))
    return _entries_kernel(row, D=D, R2=R2, CW=CW, G=G, with_norm=with_norm)


def _entries_kernel(row, *, D, R2, CW, G, with_norm: bool) -> tvm.tirx.PrimFunc:
    """`rope_quant`'s function around the row macro: the codes and scales as outputs."""

    @T.macro
    def each_entry(x, cos, sin, weight, codes, scales):
        b, s, cb = T.meta_var(x.shape[0]), T.meta_var(x.shape[1]), T.meta_var(cos.shape[0])
        for i, t in T.grid(b, s):
            with T.sblock("row"):
                vb, vt = T.axis.remap("SS", [i, t])
                if weight is not None:  # static
                    T.reads(x[vb, vt, 0:D], cos[0:cb, vt, 0:R2], sin[0:cb, vt, 0:R2],
                            weight[0:D])
                else:
                    T.reads(x[vb, vt, 0:D], cos[0:cb, vt, 0:R2], sin[0:cb, vt, 0:R2])
                T.writes(codes[vb, vt, 0:CW], scales[vb, vt, 0:G])
                row(x, cos, sin, weight, codes, scales, vb, vt, vt, True, cb)

    if with_norm:
        @T.prim_func(s_tir=True)
        def rope_quant_norm(x_h: T.handle, cos_h: T.handle, sin_h: T.handle,
                            weight: T.Buffer((D,), "bfloat16"), codes_h: T.handle,
                            scales_h: T.handle):
            T.func_attr({"global_symbol": "rope_quant", "tirx.noalias": True})
            b, s, cb = T.int64(), T.int64(), T.int64()
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
            sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
            codes = T.match_buffer(codes_h, (b, s, CW), "uint8")
            scales = T.match_buffer(scales_h, (b, s, G), "uint8")
            each_entry(x, cos, sin, weight, codes, scales)

        return rope_quant_norm

    @T.prim_func(s_tir=True)
    def rope_quant(x_h: T.handle, cos_h: T.handle, sin_h: T.handle, codes_h: T.handle,
                   scales_h: T.handle):
        T.func_attr({"global_symbol": "rope_quant", "tirx.noalias": True})
        b, s, cb = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (b, s, D), "bfloat16")
        cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
        sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
        codes = T.match_buffer(codes_h, (b, s, CW), "uint8")
        scales = T.match_buffer(scales_h, (b, s, G), "uint8")
        each_entry(x, cos, sin, None, codes, scales)

    return rope_quant


def _rows_kernel(row, *, D, R2, CW, G, with_norm: bool) -> tvm.tirx.PrimFunc:
    """`rope_quant_rows`' function around the row macro: codes and scales written in place at
    the rows idx names (a row outside the cache: skipped)."""

    @T.macro
    def each_row(codes, scales, idx, x, cos, sin, weight):
        b, s, n = T.meta_var(x.shape[0]), T.meta_var(x.shape[1]), T.meta_var(codes.shape[1])
        cb = T.meta_var(cos.shape[0])
        for i, t in T.grid(b, s):
            with T.sblock("row"):
                vb, vt = T.axis.remap("SS", [i, t])
                if weight is not None:  # static
                    T.reads(idx[vb, vt], x[vb, vt, 0:D], cos[0:cb, vt, 0:R2],
                            sin[0:cb, vt, 0:R2], weight[0:D])
                else:
                    T.reads(idx[vb, vt], x[vb, vt, 0:D], cos[0:cb, vt, 0:R2],
                            sin[0:cb, vt, 0:R2])
                T.writes(codes[vb, 0:n, 0:CW], scales[vb, 0:n, 0:G])
                row(x, cos, sin, weight, codes, scales, vb, vt, idx[vb, vt],
                    idx[vb, vt] >= T.int64(0) and idx[vb, vt] < n, cb)

    if with_norm:
        @T.prim_func(s_tir=True)
        def rope_quant_rows_norm(codes_h: T.handle, scales_h: T.handle, idx_h: T.handle,
                                 x_h: T.handle, cos_h: T.handle, sin_h: T.handle,
                                 weight: T.Buffer((D,), "bfloat16")):
            T.func_attr({"global_symbol": "rope_quant_rows", "tirx.noalias": True})
            b, n, s, cb = T.int64(), T.int64(), T.int64(), T.int64()
            codes = T.match_buffer(codes_h, (b, n, CW), "uint8")
            scales = T.match_buffer(scales_h, (b, n, G), "uint8")
            idx = T.match_buffer(idx_h, (b, s), "int64")
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
            sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
            each_row(codes, scales, idx, x, cos, sin, weight)

        return rope_quant_rows_norm

    @T.prim_func(s_tir=True)
    def rope_quant_rows(codes_h: T.handle, scales_h: T.handle, idx_h: T.handle, x_h: T.handle,
                        cos_h: T.handle, sin_h: T.handle):
        T.func_attr({"global_symbol": "rope_quant_rows", "tirx.noalias": True})
        b, n, s, cb = T.int64(), T.int64(), T.int64(), T.int64()
        codes = T.match_buffer(codes_h, (b, n, CW), "uint8")
        scales = T.match_buffer(scales_h, (b, n, G), "uint8")
        idx = T.match_buffer(idx_h, (b, s), "int64")
        x = T.match_buffer(x_h, (b, s, D), "bfloat16")
        cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
        sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
        each_row(codes, scales, idx, x, cos, sin, None)

    return rope_quant_rows


def _window_kernel(row, *, D, R2, CW, G, with_norm: bool, loop, vw, vg) -> tvm.tirx.PrimFunc:
    """`rope_quant_window`'s function around the row macro (see `make_rope_quant`): the ring
    copied into buf, the entries quantised into buf after it, then copied into the ring's
    slots. vw / vg: the vector widths of a codes / scales row's copy."""

    @T.macro
    def copy_row(src, dst, vb, srow, drow, n, vn):
        for c0 in range(n // vn):
            for c1 in loop(vn):
                dst[vb, drow, c0 * vn + c1] = src[vb, srow, c0 * vn + c1]

    @T.macro
    def stages(codes, scales, slot, x, cos, sin, weight, buf_c, buf_s):
        b, w, s = T.meta_var(codes.shape[0]), T.meta_var(codes.shape[1]), T.meta_var(x.shape[1])
        cb = T.meta_var(cos.shape[0])
        for i, t in T.grid(b, w):
            with T.sblock("ring_copy"):
                vb, vt = T.axis.remap("SS", [i, t])
                T.reads(codes[vb, vt, 0:CW], scales[vb, vt, 0:G])
                T.writes(buf_c[vb, vt, 0:CW], buf_s[vb, vt, 0:G])
                copy_row(codes, buf_c, vb, vt, vt, CW, vw)
                copy_row(scales, buf_s, vb, vt, vt, G, vg)
        for i, t in T.grid(b, s):
            with T.sblock("row"):
                vb, vt = T.axis.remap("SS", [i, t])
                if weight is not None:  # static
                    T.reads(x[vb, vt, 0:D], cos[0:cb, vt, 0:R2], sin[0:cb, vt, 0:R2],
                            weight[0:D])
                else:
                    T.reads(x[vb, vt, 0:D], cos[0:cb, vt, 0:R2], sin[0:cb, vt, 0:R2])
                T.writes(buf_c[vb, w + vt, 0:CW], buf_s[vb, w + vt, 0:G])
                row(x, cos, sin, weight, buf_c, buf_s, vb, vt, w + vt, True, cb)
        for i, t in T.grid(b, s):
            with T.sblock("ring_write"):
                vb, vt = T.axis.remap("SS", [i, t])
                T.reads(slot[vb, vt], buf_c[vb, w + vt, 0:CW], buf_s[vb, w + vt, 0:G])
                T.writes(codes[vb, 0:w, 0:CW], scales[vb, 0:w, 0:G])
                if slot[vb, vt] >= T.int64(0) and slot[vb, vt] < w:
                    copy_row(buf_c, codes, vb, w + vt, slot[vb, vt], CW, vw)
                    copy_row(buf_s, scales, vb, w + vt, slot[vb, vt], G, vg)

    if with_norm:
        @T.prim_func(s_tir=True)
        def rope_quant_window_norm(codes_h: T.handle, scales_h: T.handle, slot_h: T.handle,
                                   x_h: T.handle, cos_h: T.handle, sin_h: T.handle,
                                   weight: T.Buffer((D,), "bfloat16"), buf_c_h: T.handle,
                                   buf_s_h: T.handle):
            T.func_attr({"global_symbol": "rope_quant_window", "tirx.noalias": True})
            b, w, s, cb = T.int64(), T.int64(), T.int64(), T.int64()
            codes = T.match_buffer(codes_h, (b, w, CW), "uint8")
            scales = T.match_buffer(scales_h, (b, w, G), "uint8")
            slot = T.match_buffer(slot_h, (b, s), "int64")
            x = T.match_buffer(x_h, (b, s, D), "bfloat16")
            cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
            sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
            buf_c = T.match_buffer(buf_c_h, (b, w + s, CW), "uint8")
            buf_s = T.match_buffer(buf_s_h, (b, w + s, G), "uint8")
            stages(codes, scales, slot, x, cos, sin, weight, buf_c, buf_s)

        return rope_quant_window_norm

    @T.prim_func(s_tir=True)
    def rope_quant_window(codes_h: T.handle, scales_h: T.handle, slot_h: T.handle,
                          x_h: T.handle, cos_h: T.handle, sin_h: T.handle, buf_c_h: T.handle,
                          buf_s_h: T.handle):
        T.func_attr({"global_symbol": "rope_quant_window", "tirx.noalias": True})
        b, w, s, cb = T.int64(), T.int64(), T.int64(), T.int64()
        codes = T.match_buffer(codes_h, (b, w, CW), "uint8")
        scales = T.match_buffer(scales_h, (b, w, G), "uint8")
        slot = T.match_buffer(slot_h, (b, s), "int64")
        x = T.match_buffer(x_h, (b, s, D), "bfloat16")
        cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
        sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
        buf_c = T.match_buffer(buf_c_h, (b, w + s, CW), "uint8")
        buf_s = T.match_buffer(buf_s_h, (b, w + s, G), "uint8")
        stages(codes, scales, slot, x, cos, sin, None, buf_c, buf_s)

    return rope_quant_window


@dataclass(frozen=True)
class RopeQuantConfig:
    """norm_lanes: the norm's strided partial sums (`norm.norm_config`'s, so the bits match the
    rms_norm kernel's). CPU: rows in parallel, element loops vectorised; CUDA: one thread per
    row (`threads` a block), scalar, its scratch local."""

    norm_lanes: int
    vec: bool = True
    threads: int = 64

    @property
    def scratch(self) -> str:
        return "global" if self.vec else "local"


def rope_quant_config(target: TargetSpec, *, d: int) -> RopeQuantConfig:
    lanes = norm_config(target, d=d).lanes
    if target.is_cuda:
        return RopeQuantConfig(norm_lanes=lanes, vec=False)
    return RopeQuantConfig(norm_lanes=lanes)


def schedule_rope_quant(func: tvm.tirx.PrimFunc, config: RopeQuantConfig,
                        target: TargetSpec) -> tvm.tirx.PrimFunc:
    """The rows' loops only: the element loops are vectorised (or not) by the definition (the
    window form: each of its three stages' rows)."""
    sch = s_tir.Schedule(func)
    names = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    for name in ("ring_copy", "row", "ring_write"):
        if name in names:
            func = schedule_block_rows(func, name, target, threads=config.threads)
    return func


def build_rope_quant(target_name: str, *, d: int, rd: int, fmt: str, eps: float | None,
                     into: bool = False, window: bool = False) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = rope_quant_config(target, d=d)
    func = make_rope_quant(d=d, rd=rd, fmt=EntryFormat(fmt), eps=eps,
                           norm_lanes=cfg.norm_lanes, vec=cfg.vec, scratch=cfg.scratch,
                           into=into, window=window)
    return schedule_rope_quant(func, cfg, target)


def example_inputs_rope_quant(*, b: int, s: int, d: int, rd: int, norm: bool, cos_batch: int = 1,
                              seed: int = 0) -> list[torch.Tensor]:
    """x, cos, sin[, weight]: values like a layer's (x ~ 4 N(0, 1), weight ~ 1 + N(0, 0.1)),
    angles up to ~1000 rad."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, d, generator=g) * 4).to(torch.bfloat16)
    angle = torch.rand(cos_batch, s, rd // 2, generator=g) * 1000
    out = [x, angle.cos(), angle.sin()]
    if norm:
        out.append((1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16))
    return out
