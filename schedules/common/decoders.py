"""Decoders of the low-precision formats (E2M1, E4M3, E8M0, fp16 bits) as TIR expressions on
integer lanes, bit-exact to `graph.formats`; the `_select` forms vectorise."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

from dsv41.schedules.common.exprs import i64, let, u32

# ---- the uint8 bit route (TIR expressions; arguments are uint32 lanes) -------------------------


def fp4_to_f32(n):
    """E2M1 nibble (0..15) -> fp32, exact for all 16 codes."""
    s = (n >> T.uint32(3)) & T.uint32(1)
    e = (n >> T.uint32(1)) & T.uint32(3)
    m = n & T.uint32(1)
    normal = T.reinterpret("float32", (s << T.uint32(31)) | ((e + T.uint32(126)) << T.uint32(23))
                           | (m << T.uint32(22)))
    sign = T.if_then_else(s == T.uint32(1), T.float32(-1), T.float32(1))
    sub = T.Cast("float32", m) * T.float32(0.5) * sign
    return T.if_then_else(e == T.uint32(0), sub, normal)


def e4m3_to_f32(b):
    """E4M3 byte -> fp32, exact for all finite codes; 0x7f/0xff give NaN."""
    s = (b >> T.uint32(7)) & T.uint32(1)
    e = (b >> T.uint32(3)) & T.uint32(15)
    m = b & T.uint32(7)
    normal = T.reinterpret("float32", (s << T.uint32(31)) | ((e + T.uint32(120)) << T.uint32(23))
                           | (m << T.uint32(20)))
    sign = T.if_then_else(s == T.uint32(1), T.float32(-1), T.float32(1))
    sub = T.Cast("float32", m) * T.float32(2.0**-9) * sign
    val = T.if_then_else(e == T.uint32(0), sub, normal)
    return T.if_then_else((b & T.uint32(0x7F)) == T.uint32(0x7F),
                          T.reinterpret("float32", T.uint32(0x7FC00000)), val)


def e4m3_to_f16_bits(b_u8):
    """E4M3 byte (a uint8 expression) -> the bits (uint16) of the fp16 that equals its value
    times 2^-8, for all 256 codes, the NaN codes 0x7f/0xff giving an fp16 NaN. All the work is
    16-bit integer lanes, so a vectorised decode widens 32 codes per 512-bit register; the caller
    converts with the exact fp16 -> fp32 hardware conversion and owes the factor 2^8.

    Sign-extending the byte to 16 bits and shifting left by 7 puts the sign at bit 15 and
    eeeemmm at bits 13..7 (fp16's bias is 8 above E4M3's, and fp16 subnormals keep E4M3's
    subnormal spacing, so these bits are the value times 2^-8; bit 14, a copy of the sign, is
    cleared by the mask). Of those magnitudes only the NaN codes' 0x3f80 reaches 0x4000 when 0x80 is
    added, so adding that sum's bit 14 turns exactly them into exponent 11111, mantissa 0x380:
    a NaN. No compare or select is needed."""
    sx = T.reinterpret("uint16", T.Cast("int16", T.reinterpret("int8", b_u8)))

    def body(h):
        return h + (((h & T.uint16(0x3FFF)) + T.uint16(0x80)) & T.uint16(0x4000))

    return let((sx << T.uint16(7)) & T.uint16(0xBF80), body, "h16")


def f16_bits_to_f32(h):
    """uint16 fp16 bits -> fp32 (exact, the hardware conversion)."""
    return T.Cast("float32", T.reinterpret("float16", h))


def e8m0_to_f32(b):
    """E8M0 byte -> 2^(b-127) fp32; code 0 is 2^-127 (a subnormal), 0xff is NaN. Built from
    Select on the bits (no branches), so a loop of these vectorises (if_then_else is
    scalarised into a branch per byte: 8 instructions and two branches per scale, more than
    the FP4 expert GEMV's own work per 32-block)."""
    bits = T.Select(b == T.uint32(0), T.uint32(0x00400000),
                    T.Select(b == T.uint32(0xFF), T.uint32(0x7FC00000), b << T.uint32(23)))
    return T.reinterpret("float32", bits)


def e8m0_byte(byte_u8):
    return e8m0_to_f32(T.Cast("uint32", byte_u8))


def fp4_element(packed_u8, col):
    """E2M1 value of element `col` of a packed row (low nibble first)."""
    shift = T.Cast("uint32", col % i64(2)) * u32(4)
    return fp4_to_f32((T.Cast("uint32", packed_u8) >> shift) & u32(0xF))


def fp4_pair_f16_bits(packed_u8):
    """A packed E2M1 byte (uint8) -> the uint16 bits of the two fp16s that equal its elements
    times 2^-14, (low nibble = even element, high nibble = odd element). E2M1's sign / 2-bit
    exponent / 1-bit mantissa land on fp16's sign, exponent bits 11..10 and mantissa bit 9, so
    code 1 (0.5) is the fp16 subnormal 2^-15 and code 7 (6) is 1.5 * 2^-12: integer lanes only,
    then the exact fp16 -> fp32 hardware conversion (`f16_bits_to_f32`); the caller owes 2^14."""
    b = T.Cast("uint16", packed_u8)
    lo = ((b & T.uint16(0x8)) << T.uint16(12)) | ((b & T.uint16(0x7)) << T.uint16(9))
    hi = ((b & T.uint16(0x80)) << T.uint16(8)) | ((b & T.uint16(0x70)) << T.uint16(5))
    return lo, hi


# ---- decoders that vectorise (Select, no conditional loads) -----------------------------------


def e4m3_to_f32_select(b):
    """E4M3 byte (uint32 lanes) -> fp32 with Select (vectorises), bit-identical to
    common.e4m3_to_f32: NaN for 0x7f/0xff, subnormals m * 2^-9, -0.0 for 0x80."""
    lanes = tvm.DataType(str(b.ty)).lanes
    f32, u32 = ("float32", "uint32") if lanes == 1 else (f"float32x{lanes}", f"uint32x{lanes}")
    s = (b >> T.uint32(7)) & T.uint32(1)
    e = (b >> T.uint32(3)) & T.uint32(15)
    m = b & T.uint32(7)
    normal = T.reinterpret(f32, (s << T.uint32(31)) | ((e + T.uint32(120)) << T.uint32(23))
                           | (m << T.uint32(20)))
    sub = T.reinterpret(f32, T.reinterpret(u32, T.Cast(f32, m) * T.float32(2.0**-9))
                        | (s << T.uint32(31)))
    val = T.Select(e == T.uint32(0), sub, normal)
    nan = T.uint32(0x7FC00000) if lanes == 1 else T.broadcast(T.uint32(0x7FC00000), lanes)
    return T.Select((b & T.uint32(0x7F)) == T.uint32(0x7F), T.reinterpret(f32, nan), val)


def fp4_to_f32_select(n):
    """E2M1 nibble (uint32) -> fp32, exact; built from Select (no conditional loads) so that the
    decode vectorises (common.fp4_to_f32 uses if_then_else, which the vectoriser scalarises).
    `n` may also be a uint32 vector (the result has its lanes)."""
    lanes = tvm.DataType(str(n.ty)).lanes
    f32 = "float32" if lanes == 1 else f"float32x{lanes}"
    s = (n >> T.uint32(3)) & T.uint32(1)
    e = (n >> T.uint32(1)) & T.uint32(3)
    m = n & T.uint32(1)
    normal = T.reinterpret(f32, (s << T.uint32(31)) | ((e + T.uint32(126)) << T.uint32(23))
                           | (m << T.uint32(22)))
    sub = T.reinterpret(f32, (s << T.uint32(31)) | (m * T.uint32(0x3F000000)))  # +-0.5
    return T.Select(e == T.uint32(0), sub, normal)
