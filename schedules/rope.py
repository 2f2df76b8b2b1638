"""RoPE on the last `rd` dims of bf16 rows as one kernel (oracle: `dsv41::rope`, graph/ops.py,
which is `graph.layers.apply_rope`).

`rope(x, cos, sin) -> y`: x bf16 [b, s, h, d], cos / sin fp32 [b or 1, s, rd/2], y bf16 like x.
The first d - rd lanes of a row are copied; each (re, im) pair of the last rd is rotated in
fp32 as the oracle writes it, re * cos - im * sin and re * sin + im * cos (sin negated for the
inverse rotation), and rounded to bf16 to nearest even; a NaN is 0x7FC0 (torch's scalar
conversion; its vector path writes 0xFFFF, so the tests compare NaN by position).

Bit-exact to the oracle: each product is formed by `mul_bf16` (re and im are bf16 values), so
FMA contraction (which TVM's LLVM backend and nvcc apply) cannot fuse it into the add; the
sum is then rounded once, as torch's separate multiply and add. A product whose bf16 factor is
infinite or NaN is a plain product (mul_bf16's split would make inf * 0 = NaN where torch has
inf). Exact for finite cos / sin (the host's tables) and products above ~2^-110 in magnitude
(mul_bf16's partial products underflow below that).

Why a kernel: the graph's slice, two strided takes, the rotation, the stack and the concat
were fused by TVM into an opaque, branchy kernel per rotation (the concat selects its source
lane by lane): 45 ms a call on a 2048-token chunk's q (8K CED prefill on `bench`), ~50 us on
a decode token's. Here the copy moves 32 bf16 lanes a step and the pairs are rotated 16 at a
time, deinterleaved on the bits (a pair of bf16 is one uint32: re its low half, im its high).

Layout: one block per (b, s, h) row; CPU: the rows in parallel, the vector form where the
dims allow it (`lanes` 16); CUDA: one thread per row, scalar (`lanes` 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common.rows import schedule_block_rows

COPY = 32  # bf16 lanes the vector form copies a step
PAIRS = 16  # pairs the vector form rotates a step (one fp32 vector of re, one of im)


def _check(*, h: int, d: int, rd: int, lanes: int) -> None:
    if h <= 0 or d <= 0:
        raise ValueError(f"rope needs h > 0 and d > 0, got h={h}, d={d}.")
    if rd <= 0 or rd % 2 or rd > d:
        raise ValueError(f"rope needs an even rd in 1..d={d}, got rd={rd}.")
    if lanes not in (1, PAIRS):
        raise ValueError(f"rope's lanes is 1 (scalar) or {PAIRS} (vector); got {lanes}.")
    if lanes == PAIRS and not vector_fits(d=d, rd=rd):
        raise ValueError(f"rope's vector form needs rd a multiple of {2 * PAIRS} and d - rd of "
                         f"{COPY}; got d={d}, rd={rd}.")


def vector_fits(*, d: int, rd: int) -> bool:
    """Whether the vector form's steps tile the row."""
    return rd % (2 * PAIRS) == 0 and (d - rd) % COPY == 0


def _lanes_u32(v: int, lanes: int):
    """A uint32 constant as the lanes' type (a scalar for lanes 1)."""
    return T.uint32(v) if lanes == 1 else T.broadcast(T.uint32(v), lanes)


def _bits(v, lanes: int):
    return T.reinterpret("uint32" if lanes == 1 else f"uint32x{lanes}", v)


def _mul(a, b, lanes: int):
    """fp32(a * b) for a bf16 value `a`, safe from contraction: `norm.mul_bf16` for the lanes'
    type (module docstring)."""
    ty = "float32" if lanes == 1 else f"float32x{lanes}"
    hi = T.reinterpret(ty, _bits(b, lanes) & _lanes_u32(0xFFFFFF00, lanes))
    finite = (_bits(a, lanes) & _lanes_u32(0x7F800000, lanes)) != _lanes_u32(0x7F800000, lanes)
    return T.Select(finite, a * hi + a * (b - hi), a * b)


def _to_bf16_bits(v, lanes: int):
    """fp32 -> bf16 bits (RNE, NaN -> 0x7FC0) in the low 16 bits of a uint32."""
    w = _bits(v, lanes)
    nan = (w & _lanes_u32(0x7FFFFFFF, lanes)) > _lanes_u32(0x7F800000, lanes)
    rounded = (w + ((w >> _lanes_u32(16, lanes)) & _lanes_u32(1, lanes))
               + _lanes_u32(0x7FFF, lanes)) >> _lanes_u32(16, lanes)
    return T.Select(nan, _lanes_u32(0x7FC0, lanes), rounded)


def rotated_bits(re, im, c, s, *, inverse: bool, lanes: int = 1):
    """(bf16 bits of re', bf16 bits of im'), each in the low half of a uint32 (or of each lane),
    of the pair (re, im) (fp32 holding bf16 values) rotated by (c, s) as `layers.apply_rope`
    rotates it, s negated for the inverse: every kernel that applies RoPE rotates through
    here, so all of them agree bit for bit."""
    if inverse:
        s = s * (T.float32(-1) if lanes == 1 else T.broadcast(T.float32(-1), lanes))
    return (_to_bf16_bits(_mul(re, c, lanes) - _mul(im, s, lanes), lanes),
            _to_bf16_bits(_mul(re, s, lanes) + _mul(im, c, lanes), lanes))


def make_rope(*, h: int, d: int, rd: int, inverse: bool = False,
              lanes: int = 1) -> tvm.tirx.PrimFunc:
    """`rope(x, cos, sin) -> y` (module docstring); b, s and the batch of cos / sin (b or 1)
    symbolic. `lanes`: 1 (scalar loops) or 16 (the vector form)."""
    _check(h=h, d=d, rd=rd, lanes=lanes)
    H, D, R2, NOPE = T.int64(h), T.int64(d), T.int64(rd // 2), T.int64(d - rd)
    L = lanes

    def u(v):  # a uint32 constant as the lanes' type
        return _lanes_u32(v, L)

    def rotate(re, im, c, s):
        """(bits of re', bits of im') of the rotated pair."""
        return rotated_bits(re, im, c, s, inverse=inverse, lanes=L)

    def f32_of(x16):  # bf16 bits (uint32, low half) -> fp32
        return T.reinterpret("float32", x16 << T.uint32(16))

    @T.prim_func(s_tir=True)
    def rope(x_h: T.handle, cos_h: T.handle, sin_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "rope", "tirx.noalias": True})
        b, s, cb = T.int64(), T.int64(), T.int64()
        x = T.match_buffer(x_h, (b, s, H, D), "bfloat16")
        cos = T.match_buffer(cos_h, (cb, s, R2), "float32")
        sin = T.match_buffer(sin_h, (cb, s, R2), "float32")
        y = T.match_buffer(y_h, (b, s, H, D), "bfloat16")
        for i, t, hh in T.grid(b, s, H):
            with T.sblock("rope"):
                vb, vt, vh = T.axis.remap("SSS", [i, t, hh])
                T.reads(x[vb, vt, vh, 0:D], cos[0:cb, vt, 0:R2], sin[0:cb, vt, 0:R2])
                T.writes(y[vb, vt, vh, 0:D])
                tb = T.Select(cb == T.int64(1), T.int64(0), vb)  # the tables' batch row
                if L == 1:
                    for j in range(NOPE):
                        y[vb, vt, vh, j] = x[vb, vt, vh, j]
                    for p in range(R2):
                        re_b, im_b = rotate(
                            f32_of(T.Cast("uint32", T.reinterpret(
                                "uint16", x[vb, vt, vh, NOPE + p * T.int64(2)]))),
                            f32_of(T.Cast("uint32", T.reinterpret(
                                "uint16", x[vb, vt, vh, NOPE + p * T.int64(2) + T.int64(1)]))),
                            cos[tb, vt, p], sin[tb, vt, p])
                        y[vb, vt, vh, NOPE + p * T.int64(2)] = T.reinterpret(
                            "bfloat16", T.Cast("uint16", re_b))
                        y[vb, vt, vh, NOPE + p * T.int64(2) + T.int64(1)] = T.reinterpret(
                            "bfloat16", T.Cast("uint16", im_b))
                else:
                    for j in range(NOPE // T.int64(COPY)):
                        y[vb, vt, vh, T.ramp(j * T.int64(COPY), 1, COPY)] = x.vload(
                            [vb, vt, vh, j * T.int64(COPY)], f"bfloat16x{COPY}")
                    for g in range(R2 // T.int64(PAIRS)):
                        pair = T.reinterpret(f"uint32x{PAIRS}", x.vload(
                            [vb, vt, vh, NOPE + g * T.int64(2 * PAIRS)], f"bfloat16x{2 * PAIRS}"))
                        re_b, im_b = rotate(
                            T.reinterpret(f"float32x{PAIRS}", pair << u(16)),
                            T.reinterpret(f"float32x{PAIRS}", pair & u(0xFFFF0000)),
                            cos.vload([tb, vt, g * T.int64(PAIRS)], f"float32x{PAIRS}"),
                            sin.vload([tb, vt, g * T.int64(PAIRS)], f"float32x{PAIRS}"))
                        y[vb, vt, vh, T.ramp(NOPE + g * T.int64(2 * PAIRS), 1, 2 * PAIRS)] = (
                            T.reinterpret(f"bfloat16x{2 * PAIRS}", re_b | (im_b << u(16))))

    return rope


@dataclass(frozen=True)
class RopeConfig:
    """lanes: 16 (the vector form, CPU where the dims allow it) or 1. CPU: rows in parallel;
    CUDA: `threads` rows (one a thread) per thread block."""

    lanes: int
    threads: int = 64


def rope_config(target: TargetSpec, *, d: int, rd: int) -> RopeConfig:
    if target.is_cuda:
        return RopeConfig(lanes=1)
    return RopeConfig(lanes=PAIRS if vector_fits(d=d, rd=rd) else 1)


def schedule_rope(func: tvm.tirx.PrimFunc, config: RopeConfig,
                  target: TargetSpec) -> tvm.tirx.PrimFunc:
    return schedule_block_rows(func, "rope", target, threads=config.threads)


def build_rope(target_name: str, *, h: int, d: int, rd: int,
               inverse: bool = False) -> tvm.tirx.PrimFunc:
    """make + config + schedule for `target_name` (a cuda_build builder)."""
    target = get_target(target_name)
    cfg = rope_config(target, d=d, rd=rd)
    return schedule_rope(make_rope(h=h, d=d, rd=rd, inverse=inverse, lanes=cfg.lanes), cfg,
                         target)
