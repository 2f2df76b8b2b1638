"""Quantiser kernels: `quant_fp8`, `quant_fp4_kv`, `quant_mxfp4`, `qdq_mxfp4` (oracles in
graph/ops.py, number formats in graph/formats.py). All four are bit-exact against the torch
oracle for every finite input, fp32 subnormals included.

Why the arithmetic is exact, and why it stays exact under nvcc's `--use_fast_math` (approximate
division, flush-to-zero):

* Group amax is an int32 max over the |x| bit patterns (order-preserving for non-negative
  floats; vectorises without fast-math flags, and no flush-to-zero can touch it).
* FP8 (E4M3 codes, E8M0 scale): the helpers of schedules/gemm/ (`pow2_scale_byte`,
  `fp8_code`): integer bit work plus one product with an exact power-of-two reciprocal. The
  product only underflows where the code is 0 anyway.
* E2M1 codes (both FP4 formats): the oracle rounds r = fp32(x / s) to E2M1 with RNE. E2M1 has
  seven rounding boundaries t (0.25, 0.75, ..., 5), each with a fixed tie direction (ties go to
  the even code), so code = sum over t of [r > t] or [r >= t]. fp32 rounding is monotone and t is
  an fp32 value, and for an fp32 x and a scale s of at most 4 significant bits x / s never
  rounds onto t unless it equals t (|x - t*s| >= ulp(x), which is more than half an ulp of t
  after the division). Hence [r > t] == [|x| > t*s] exactly, with t*s an exact fp32 product.
  The compares are done on the fp32 bit patterns as int32 (monotone for non-negative values),
  so nothing is flushed and a NaN input compares above everything: code 7 with its sign, as the
  oracle gives for a NaN element. No division, no clamp and no float rounding remain.
* MXFP4 thresholds t * 2^(b-127) are built on the bits (exponent add; the two subnormal cases of
  the smallest scale byte by a shift), so they are exact without any float product.
* FP4-KV scale byte = E4M3(fp32(amax / 6)): fp32(amax / 6) is computed with integers (the 24-bit
  significand divided by 3, RNE from the remainder), since fast-math division is not IEEE.
* qdq_mxfp4 writes bf16 bits directly: every E2M1 value times a power of two has at most two
  significant bits, so it is exact in bf16 (2^-127 is a bf16 subnormal; 4 * 2^126 overflows to
  inf exactly as in the oracle).

Non-finite inputs (the model never feeds them; only finite groups are matched, and a
non-finite group never disturbs other groups): the group amax is a max over the |x| bit
patterns, so inf and NaN propagate into it. FP8 and MXFP4 then give scale byte 0xFF exactly as
the oracle, but their codes differ from the oracle's (which divides by the NaN scale and gets
the saturated code for every element): FP8 gives unspecified codes, MXFP4 gives 0 | sign for
finite elements and 7 | sign for inf/NaN ones. FP4-KV gives an unspecified scale byte and codes.

TVM 0.27 traps avoided (see schedules/gemm/): no bf16 Cast inside a Let, `T.Select` rather than
`if_then_else` on vector lanes, signed compares only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import tvm
from tvm import s_tir
from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.graph.targets import TargetSpec, get_target
from dsv41.schedules.common import e4m3_to_f32
from dsv41.schedules.common.stages import abs_bits_amax_scale_byte
from dsv41.schedules.gemm import e4m3_round, fp8_code, pow2_scale_byte

FP8_BLOCK = fmt.FP8_BLOCK  # 32
MX_BLOCK = fmt.MXFP4_BLOCK  # 32
KV_BLOCK = fmt.FP4_KV_BLOCK  # 16
# E2M1 rounding boundaries (midpoints between neighbouring magnitudes) and whether a tie there
# rounds up (the upper neighbour has the even code).
E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))
_INF_BITS = 0x7F800000


def _i64(v: int):
    return T.int64(v)


def _u32(v: int):
    return T.uint32(v)


def _i32(v: int):
    return T.int32(v)


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def abs_bits(x):
    """|x| as int32 bits (order-preserving for non-negative floats, NaN above inf)."""
    return T.reinterpret("int32", T.reinterpret("uint32", x) & _u32(0x7FFFFFFF))


def _sign_nibble(x):
    """E2M1 sign bit (bit 3) from the fp32 sign of x (-0.0 included)."""
    return (T.reinterpret("uint32", x) >> _u32(31)) << _u32(3)


def e2m1_code(x, thresholds):
    """E2M1 code (uint32, 0..15) of x / s given the int32 bits of t * s for the seven boundaries
    of `E2M1_BOUNDS` (see the module docstring for why this equals RNE of fp32(x / s))."""
    a = abs_bits(x)
    mag = _u32(0)
    for (_, tie_up), thr in zip(E2M1_BOUNDS, thresholds, strict=True):
        mag = mag + T.Cast("uint32", (a >= thr) if tie_up else (a > thr))
    return mag | _sign_nibble(x)


def kv_thresholds(scale_byte):
    """Bits of t * s for an E4M3 scale byte (1..0x7E): exact fp32 products (<= 7 significant
    bits, all normal since s >= 2^-9)."""
    s = e4m3_to_f32(T.Cast("uint32", scale_byte))
    return [T.reinterpret("int32", s * T.float32(t)) for t, _ in E2M1_BOUNDS]


def mx_thresholds(scale_byte):
    """Bits of t * 2^(b-127) for an E8M0 byte b (1..254), built on the bits: exponent add,
    saturating to inf, and a right shift where the result is an fp32 subnormal (b = 1, 2)."""
    b = T.Cast("int32", scale_byte)
    out = []
    for t, _ in E2M1_BOUNDS:
        tb = _f32_bits(t)
        field = b + _i32((tb >> 23) - 127)  # biased exponent of the product
        normal = T.min(b * _i32(1 << 23) + _i32(tb - (127 << 23)), _i32(_INF_BITS))
        sig = _i32((tb & 0x7FFFFF) | 0x800000)
        sub = T.shift_right(sig, T.min(T.max(_i32(1) - field, _i32(0)), _i32(31)))
        out.append(T.Select(field >= 1, normal, sub))
    return out


def mx_scale_byte(amax):
    """E8M0 byte of max(amax, MXFP4 floor) * fp32(1/6) (formats.torch_round_scale_pow2): the
    exponent field plus one if the mantissa is nonzero, saturated at 0xFF. The product is normal
    (>= 2^-126) thanks to the floor."""
    bits = T.reinterpret("int32", T.max(amax, T.float32(fmt.MXFP4_AMAX_FLOOR))
                         * T.float32(fmt.FP4_MAX_INV))
    e = T.shift_right(bits, _i32(23)) & _i32(0xFF)
    up = T.Cast("int32", (bits & _i32(0x7FFFFF)) != _i32(0))
    return T.Cast("uint8", T.min(e + up, _i32(0xFF)))


def div6(a):
    """fp32(a / 6) with IEEE round-to-nearest, on integers: a positive normal fp32 with a
    biased exponent >= 4 (the FP4-KV amax is floored at 6 * 2^-9). With M the 24-bit
    significand, Q = (M << k) / 3 has 24 bits for k = 2 (M < 3 * 2^22) or k = 1; the remainder
    0/1/2 rounds down/down/up (no ties)."""
    u = T.reinterpret("int32", a)
    ef = T.shift_right(u, _i32(23))
    m = (u & _i32(0x7FFFFF)) | _i32(0x800000)
    k = T.Select(m >= _i32(3 << 22), _i32(1), _i32(2))
    n = T.shift_left(m, k)
    q = T.truncdiv(n, _i32(3))
    rnd = T.Cast("int32", n - q * _i32(3) == _i32(2))
    bits = T.shift_left(ef - _i32(1) - k, _i32(23)) + (q - _i32(0x800000)) + rnd
    return T.reinterpret("float32", bits)


def kv_scale_byte(amax):
    """E4M3 byte of fp32(max(amax, floor) / 6), saturated at 448 (formats.torch_quant_fp4_kv)."""
    r = T.min(div6(T.max(amax, T.float32(fmt.FP4_KV_AMAX_FLOOR))), T.float32(fmt.E4M3_MAX))
    return T.Cast("uint8", e4m3_round(r, code=True))


def _bf16_of_mx(code, scale_byte):
    """bf16 of e2m1(code) * 2^(b-127), built on the bits (exact, see the module docstring)."""
    mag = code & _u32(7)
    e = T.shift_right(mag, _u32(1))  # E2M1 exponent field
    # fp32 bits of the E2M1 magnitude (normal codes 2..7; code 1 is 0.5 = 2^-1)
    vbits = T.Select(e == _u32(0), T.Cast("int32", mag) * _i32(0x3F000000),
                     T.Cast("int32", ((e + _u32(126)) << _u32(23)) | ((mag & _u32(1)) << _u32(22))))
    b = T.Cast("int32", scale_byte)
    field = T.shift_right(vbits, _i32(23)) + b - _i32(127)
    scaled = T.min(vbits + b * _i32(1 << 23) - _i32(127 << 23), _i32(_INF_BITS))
    # the only product below 2^-126: 0.5 * 2^-126 = 2^-127 (b = 1)
    scaled = T.Select(field >= 1, scaled, _i32(0x00400000))
    scaled = T.Select(mag == _u32(0), _i32(0), scaled)
    sign = T.Cast("int32", (code >> _u32(3)) << _u32(15))
    return T.reinterpret("bfloat16", T.Cast("uint16", T.shift_right(scaled, _i32(16)) | sign))


def _f32_of_bf16(x):
    """bf16 -> fp32 on the bits (a plain Cast can be miscompiled inside a Let: schedules/gemm/)."""
    return T.reinterpret("float32", T.Cast("uint32", T.reinterpret("uint16", x)) << _u32(16))


# ---- kernel definitions ---------------------------------------------------------------------


def _check(d: int, group: int, op: str) -> None:
    if d <= 0 or d % group:
        raise ValueError(f"{op} needs d a positive multiple of {group}, got {d}.")


def make_quant_fp8(*, d: int) -> tvm.tirx.PrimFunc:
    """`quant_fp8(x) -> (codes, scales)`: fp32 [n, d] (symbolic n: the op's leading dims
    flattened) -> E4M3 uint8 [n, d], E8M0 uint8 [n, d/32]. Blocks: `amax` (per 32), `scale`,
    `code`."""
    _check(d, FP8_BLOCK, "quant_fp8")
    D, G, B = _i64(d), _i64(d // FP8_BLOCK), _i64(FP8_BLOCK)

    def abs_bits_of(x, i, j):
        return abs_bits(x[i, j])

    def fp8_scale_byte(amax):
        return T.Cast("uint8", pow2_scale_byte(amax))

    amax_stage = abs_bits_amax_scale_byte()

    @T.prim_func(s_tir=True)
    def quant_fp8(x_h: T.handle, codes_h: T.handle, scales_h: T.handle):
        T.func_attr({"global_symbol": "quant_fp8", "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, D), "float32")
        codes = T.match_buffer(codes_h, (n, D), "uint8")
        scales = T.match_buffer(scales_h, (n, G), "uint8")
        amax = T.sblock_alloc_buffer((n, G), "int32")
        sbyte = T.sblock_alloc_buffer((n, G), "uint8")
        for i, g in T.grid(n, G):
            amax_stage(amax, sbyte, x, i, g, B, abs_bits_of, fp8_scale_byte)
            with T.sblock("scale"):
                vi, vg = T.axis.remap("SS", [i, g])
                scales[vi, vg] = sbyte[vi, vg]
            for j in range(B):
                with T.sblock("code"):
                    vi, vg, vj = T.axis.remap("SSS", [i, g, j])
                    codes[vi, vg * B + vj] = fp8_code(x[vi, vg * B + vj],
                                                      T.Cast("uint32", sbyte[vi, vg]))

    return quant_fp8


def _make_quant_fp4(*, d: int, group: int, name: str, scale_byte, thresholds, bf16_out: bool):
    """Shared body of the FP4 quantisers: `amax` per group, `scale` byte, `code` (one packed
    byte = two elements, low nibble first). bf16_out: qdq_mxfp4 (bf16 in, bf16 out; the scale
    byte lives in a scratch buffer and `code` writes the dequantised pair instead)."""
    _check(d, group, name)
    D, DH, G, B, BH = _i64(d), _i64(d // 2), _i64(d // group), _i64(group), _i64(group // 2)
    in_dtype = "bfloat16" if bf16_out else "float32"

    def val(x, i, j):
        return _f32_of_bf16(x[i, j]) if bf16_out else x[i, j]

    def abs_bits_of(x, i, j):
        return abs_bits(val(x, i, j))

    amax_stage = abs_bits_amax_scale_byte()

    if bf16_out:
        @T.prim_func(s_tir=True)
        def qdq(x_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": name, "tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(x_h, (n, D), in_dtype)
            y = T.match_buffer(y_h, (n, D), "bfloat16")
            amax = T.sblock_alloc_buffer((n, G), "int32")
            sbyte = T.sblock_alloc_buffer((n, G), "uint8")
            for i, g in T.grid(n, G):
                amax_stage(amax, sbyte, x, i, g, B, abs_bits_of, scale_byte)
                for j in range(B):
                    with T.sblock("code"):
                        vi, vg, vj = T.axis.remap("SSS", [i, g, j])
                        y[vi, vg * B + vj] = _bf16_of_mx(
                            e2m1_code(val(x, vi, vg * B + vj), thresholds(sbyte[vi, vg])),
                            sbyte[vi, vg])

        return qdq

    @T.prim_func(s_tir=True)
    def quant(x_h: T.handle, packed_h: T.handle, scales_h: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(x_h, (n, D), in_dtype)
        packed = T.match_buffer(packed_h, (n, DH), "uint8")
        scales = T.match_buffer(scales_h, (n, G), "uint8")
        amax = T.sblock_alloc_buffer((n, G), "int32")
        sbyte = T.sblock_alloc_buffer((n, G), "uint8")
        for i, g in T.grid(n, G):
            amax_stage(amax, sbyte, x, i, g, B, abs_bits_of, scale_byte)
            with T.sblock("scale"):
                vi, vg = T.axis.remap("SS", [i, g])
                scales[vi, vg] = sbyte[vi, vg]
            for p in range(BH):
                with T.sblock("code"):
                    vi, vg, vp = T.axis.remap("SSS", [i, g, p])
                    packed[vi, vg * BH + vp] = T.Cast("uint8", e2m1_code(
                        val(x, vi, vg * B + vp * 2), thresholds(sbyte[vi, vg])) | (e2m1_code(
                            val(x, vi, vg * B + vp * 2 + 1), thresholds(sbyte[vi, vg]))
                            << _u32(4)))

    return quant


def make_quant_fp4_kv(*, d: int) -> tvm.tirx.PrimFunc:
    """`quant_fp4_kv(x) -> (packed, scales)`: fp32 [n, d] -> packed E2M1 uint8 [n, d/2] (low
    nibble = even element), E4M3 uint8 [n, d/16]."""
    return _make_quant_fp4(d=d, group=KV_BLOCK, name="quant_fp4_kv", scale_byte=kv_scale_byte,
                           thresholds=kv_thresholds, bf16_out=False)


def make_quant_mxfp4(*, d: int) -> tvm.tirx.PrimFunc:
    """`quant_mxfp4(x) -> (packed, scales)`: fp32 [n, d] -> packed E2M1 uint8 [n, d/2], E8M0
    uint8 [n, d/32]."""
    return _make_quant_fp4(d=d, group=MX_BLOCK, name="quant_mxfp4", scale_byte=mx_scale_byte,
                           thresholds=mx_thresholds, bf16_out=False)


def make_qdq_mxfp4(*, d: int) -> tvm.tirx.PrimFunc:
    """`qdq_mxfp4(x) -> y`: bf16 [n, d] -> MXFP4 quantise-dequantise -> bf16 [n, d]."""
    return _make_quant_fp4(d=d, group=MX_BLOCK, name="qdq_mxfp4", scale_byte=mx_scale_byte,
                           thresholds=mx_thresholds, bf16_out=True)


# ---- schedules ------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """CPU: `rows` rows per parallel task; the outputs of one quantisation group (32 codes, or
    16 / 8 packed bytes) vectorised `vec` lanes wide. CUDA: one thread per quantisation group
    (amax, scale byte and codes in registers), `threads` groups per thread block."""

    rows: int = 4
    vec: int = 16
    threads: int = 128


def quant_config(target: TargetSpec, *, d: int, lanes: int) -> QuantConfig:
    """lanes: outputs per quantisation group in the `code` loop (32 for quant_fp8 and
    qdq_mxfp4, 16 packed bytes for quant_mxfp4, 8 for quant_fp4_kv)."""
    if target.is_cuda:
        return QuantConfig(rows=1, vec=1, threads=128)
    return QuantConfig(rows=4, vec=min(lanes, 16), threads=1)


def schedule_quant(func: tvm.tirx.PrimFunc, config: QuantConfig,
                   target: TargetSpec) -> tvm.tirx.PrimFunc:
    """Shared by the four quantisers. Their definitions already nest the per-group stages
    (`amax`, `sbyte`, `scale`, `code`) under the (row, group) loops, so the scratch amax and
    scale byte live in registers; this only distributes those loops."""
    sch = s_tir.Schedule(func)
    i, g, jj = sch.get_loops(sch.get_sblock("code"))
    if target.is_cuda:
        bx, tx = sch.split(sch.fuse(i, g), [None, config.threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        for name in ("amax", "sbyte"):  # per-thread scratch in registers
            sch.set_scope(sch.get_sblock(name), 0, "local")
    else:
        io, _ = sch.split(i, [None, config.rows])
        sch.parallel(io)
        _, jv = sch.split(jj, [None, config.vec])
        sch.vectorize(jv)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


# op -> (factory, outputs per quantisation group in its `code` loop)
_MAKERS = {
    "quant_fp8": (make_quant_fp8, FP8_BLOCK),
    "quant_fp4_kv": (make_quant_fp4_kv, KV_BLOCK // 2),
    "quant_mxfp4": (make_quant_mxfp4, MX_BLOCK // 2),
    "qdq_mxfp4": (make_qdq_mxfp4, MX_BLOCK),
}


def _build(op: str, target_name: str, d: int) -> tvm.tirx.PrimFunc:
    make, lanes = _MAKERS[op]
    target = get_target(target_name)
    return schedule_quant(make(d=d), quant_config(target, d=d, lanes=lanes), target)


def build_quant_fp8(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    return _build("quant_fp8", target_name, d)


def build_quant_fp4_kv(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    return _build("quant_fp4_kv", target_name, d)


def build_quant_mxfp4(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    return _build("quant_mxfp4", target_name, d)


def build_qdq_mxfp4(target_name: str, *, d: int) -> tvm.tirx.PrimFunc:
    return _build("qdq_mxfp4", target_name, d)


# ---- example inputs for benchmarks ----------------------------------------------------------


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Activations ~N(0, 1) with a per-row magnitude spread (as KV / key entries have) and a few
    outlier channels, rounded through bf16 as the model produces them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    x[:, :: max(d // 8, 1)] *= 8.0
    return x.to(torch.bfloat16)


def example_inputs_quant_fp8(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    return [_rows(n, d, seed).float()]


def example_inputs_quant_fp4_kv(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    return [_rows(n, d, seed).float()]


def example_inputs_quant_mxfp4(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    return [_rows(n, d, seed).float()]


def example_inputs_qdq_mxfp4(*, n: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    return [_rows(n, d, seed)]
