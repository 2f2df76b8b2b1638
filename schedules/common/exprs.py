"""Small TIR expression helpers every kernel family uses: int literals, `let` binding, bf16
rounding on the bits, clamped table indices, SwiGLU."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T


def round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32, as torch's `.to(bfloat16).float()`.

    Done on the bits: TVM folds a Cast(f32, Cast(bf16, x)) pair away. NaN stays NaN, tested
    with isnan (TVM's simplifier folds a float `x != x` to false, and the rounding alone turns
    a NaN whose payload carries into the exponent into an infinity or a zero). A Select (both
    sides computed, no branch), so a vectorised loop of it stays vector code: if_then_else is
    scalarised into a branch per lane (the AMX sweep's epilogue took twice its time), and a
    test of the bits kept the sweep as slow."""
    return T.Select(T.isnan(x), x, round_bf16_finite(x))


def round_bf16_finite(x):
    """`round_bf16` of a value known not to be NaN: the rounding on the bits alone."""
    u = T.reinterpret("uint32", x)
    return T.reinterpret("float32", (u + ((u >> T.uint32(16)) & T.uint32(1)) + T.uint32(0x7FFF))
                         & T.uint32(0xFFFF0000))


def bf16_of(x):
    """fp32 -> bf16 (ties to even) as a bf16 value, on the bits: torch's `.to(bfloat16)` (a NaN
    stays a quiet NaN of its sign and top payload bits). What the compiled graph's fp32 ->
    bf16 casts compute (`compiler.lower`), so a kernel that stores bf16 through it equals an
    fp32 kernel followed by that cast, bit for bit."""
    u = T.reinterpret("uint32", x)
    r = (u + ((u >> T.uint32(16)) & T.uint32(1)) + T.uint32(0x7FFF)) >> T.uint32(16)
    r = T.Select(T.isnan(x), (u >> T.uint32(16)) | T.uint32(0x40), r)
    return T.reinterpret("bfloat16", T.Cast("uint16", r))


# ---- small TIR expression helpers shared by the GEMM and MoE kernels --------------------------


def u32(v):
    return T.uint32(v)


def let(value, body, name: str = "t"):
    """Bind `value` once and build `body(var)`: keeps the bit-route expressions linear in size
    (each helper uses its argument several times)."""
    if isinstance(value, tvm.tirx.Var):
        return body(value)
    var = tvm.tirx.Var(name, value.ty)
    return tvm.tirx.Let(var, value, body(var))


def bf16_to_f32(x):
    """bf16 -> fp32 on the bits. TVM's BF16 legalisation skips the value of a `Let`, where a plain
    Cast(float32, bf16) is then compiled as an integer conversion of the raw uint16."""
    return T.reinterpret("float32", T.Cast("uint32", T.reinterpret("uint16", x)) << u32(16))


def i64(v: int):
    return T.int64(v)


def round_bf16_bound(v):
    """`round_bf16` on a bound value (it reads its argument twice)."""
    return let(v, round_bf16, "r")


def idx(v, bound):
    """An int32 table entry as an int64 index clamped to [0, bound): a no-op on valid tables, it
    gives the schedule's region analysis a bound for these data-dependent indices."""
    return T.min(T.max(T.Cast("int64", v), i64(0)), bound - i64(1))


def silu_times(gate, up, limit: float):
    """swiglu(gate, up, limit) as graph.ops.swiglu: clamps when limit > 0, then
    silu(g) * u with silu(g) = g / (1 + exp(-g)) (torch's CPU formula)."""
    if limit > 0:
        up = T.max(T.min(up, T.float32(limit)), T.float32(-limit))
        gate = T.min(gate, T.float32(limit))
    return let(gate, lambda g: g / (T.float32(1) + T.exp(-g)) * up, "gate")
