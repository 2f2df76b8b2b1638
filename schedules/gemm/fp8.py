"""FP8 (E4M3) activation quantisation as TIR expressions: the power-of-two E8M0 scale of a
block amax, the E4M3 rounding, quantise-dequantise, and the padded-row reads they share."""

from __future__ import annotations

from tvm.script import tirx as T

from dsv41.graph import formats as fmt
from dsv41.schedules.common import (
    bf16_to_f32,
    i64,
    let,
    u32,
)

BLOCK = 32  # FP8/MXFP4 quantisation group along K, and the weight tile edge

# ---- FP8 activation quantisation as TIR expressions (uint32 / fp32 lanes) -------------------


def pow2_scale_byte(amax):
    """E8M0 byte of the per-32 scale: exponent field of max(amax, 1e-4) * fp32(1/448), plus one
    if its mantissa is nonzero, saturated at 0xFF (formats.torch_round_scale_pow2). The floor is
    applied here so the amax reduction keeps max's identity (-inf; CUDA allreduce needs it)."""
    def body(bits):
        e = (bits >> u32(23)) & u32(0xFF)
        up = T.Cast("uint32", (bits & u32(0x7FFFFF)) != u32(0))
        return T.min(e + up, u32(0xFF))

    floored = T.max(amax, T.float32(fmt.FP8_AMAX_FLOOR))
    return let(T.reinterpret("uint32", floored * T.float32(fmt.FP8_MAX_INV)), body, "amax_bits")


def inv_pow2_scale(byte):
    """1 / 2^(byte-127) as fp32 bits (exact for bytes 1..253, the range of every finite bf16
    amax above the 1e-4 floor); byte 0 gives 2^127, bytes 254/255 give NaN."""
    def body(b):
        bi = T.Cast("int32", b)  # signed compares: the simplifier negates unsigned bounds
        ok = T.And(bi >= 1, bi <= 253)
        return T.reinterpret("float32",
                             T.Select(ok, (u32(254) - b) << u32(23), u32(0x7FC00000)))

    return let(byte, body, "byte")


def pow2_scale(byte):
    """2^(byte-127) for bytes 1..254 (`e8m0_to_f32` without its 0/0xFF cases, which the quantiser
    never produces from a finite amax; uses no unsigned compares, see `inv_pow2_scale`)."""
    return T.reinterpret("float32", byte << u32(23))


def e4m3_round(r, *, code: bool):
    """r (fp32, already clamped to [-448, 448]) rounded to the nearest E4M3 value, ties to even:
    its fp32 value (code=False) or its E4M3 byte as uint32 (code=True); the sign of zero is kept.

    Normal range: RNE on the fp32 bits down to 3 mantissa bits (a carry into the exponent is the
    right rounding). Subnormal range (|r| < 2^-6): round |r| * 2^9 to an integer with an RNE
    shift of the 24-bit significand; code 8 there is exactly the smallest normal code."""

    def on_bits(u):  # fp32 bits of r
        sign = u & u32(0x80000000)
        bits = u & u32(0x7FFFFFFF)
        rn = (bits + u32(0x7FFFF) + ((bits >> u32(20)) & u32(1))) & u32(0xFFF00000)
        exp = bits >> u32(23)
        sig = (bits & u32(0x7FFFFF)) | u32(0x800000)
        # |r| * 2^9 = sig * 2^(exp - 141): shift right by 141 - exp >= 21 (exp <= 120 here),
        # capped at 26 where every 24-bit significand rounds to 0 (fp32 subnormals included).
        sh = T.min(u32(141) - T.min(exp, u32(120)), u32(26))

        def on_q(q):
            small = bits < u32(0x3C800000)  # |r| < 2^-6
            if code:
                mag = T.Select(small, q, (rn >> u32(20)) - u32(120 << 3))
                return mag | (sign >> u32(24))
            sub = T.reinterpret("uint32", T.Cast("float32", q) * T.float32(2.0**-9))
            return T.reinterpret("float32", T.Select(small, sub, rn) | sign)

        return let((sig + (u32(1) << (sh - u32(1))) - u32(1) + ((sig >> sh) & u32(1)))
                    >> sh, on_q, "q")

    return let(T.reinterpret("uint32", r), on_bits, "rbits")


def fp8_ratio(x, byte):
    """x / 2^(byte-127) clamped to [-448, 448]; the division by a power of two is a product with
    its exact reciprocal."""
    r = x * inv_pow2_scale(byte)
    return T.max(T.min(r, T.float32(fmt.E4M3_MAX)), T.float32(-fmt.E4M3_MAX))


def fp8_qdq(x, byte):
    """FP8 quantise-dequantise of one fp32 value with its group's scale byte: the exact fp32
    value e4m3(x / s) * s that the oracle's `_act_quant` feeds its GEMM (scale folded in)."""
    return let(byte, lambda b: e4m3_round(fp8_ratio(x, b), code=False) * pow2_scale(b), "byte")


@T.macro
def fp8_qdq_rows(out, x, rows, blocks):
    """out[i, j] = fp8_qdq of bf16 x[i, j] with its 32-block's scale (the amax from the lowest
    fp32, as `stages.block_amax`): `make_moe_qdq`'s result in plain loops, rows in parallel,
    for a kernel that quantises its own input."""
    for i in T.parallel(rows):
        amax = T.alloc_buffer((1,), "float32", scope="local")
        for b in range(blocks):
            amax[0] = T.min_value("float32")
            for j in range(i64(BLOCK)):
                amax[0] = T.max(amax[0], T.fabs(bf16_to_f32(x[i, b * BLOCK + j])))
            for j in T.vectorized(i64(BLOCK)):
                out[i, b * BLOCK + j] = fp8_qdq(bf16_to_f32(x[i, b * BLOCK + j]),
                                                pow2_scale_byte(amax[0]))


def fp8_code(x, byte):
    """The E4M3 byte of x / s (formats.torch_e4m3_encode after the clamp)."""
    return T.Cast("uint8", e4m3_round(fp8_ratio(x, byte), code=True))


def padded_rows(m, pad: int):
    """m rounded up to a multiple of pad (m itself for pad 1)."""
    return m if pad == 1 else (m + i64(pad - 1)) // i64(pad) * i64(pad)


def row_f32(x, m, pad: int, row, col):
    """x[row, col] as fp32; rows past m (only when padded) read as zero."""
    if pad == 1:
        return bf16_to_f32(x[row, col])
    return T.if_then_else(row < m, bf16_to_f32(x[row, col]), T.float32(0))


# ---- fp8_linear -----------------------------------------------------------------------------


def check_out_dtype(out_dtype: str) -> None:
    if out_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"fp8_linear writes bfloat16 (fp8_linear) or float32 (fp8_linear_f32, "
                         f"a row-parallel partial sum), not {out_dtype}.")
