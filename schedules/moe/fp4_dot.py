"""The FP4 expert GEMVs' sums on vdpbf16ps (`dot="bf16"` of the hand-vectorised forms in
avx512_gemv.py and avx512_rows.py): CPUs with AVX-512 BF16 and VBMI and without AMX.

Why: the fp32 form spends, per 32-block, two vpermd table lookups and two byte widenings (zmm
shuffles, two cycles each on a Zen 4) on a handful of FMAs, so it ran at 2.6-2.8x its byte
roof from cache (bench preset gate_up, one token, Zen 4). Here a block's 16 bytes become its
32 bf16 weights by two vpermb (the bytes spread to both words of their pair, then a 64-byte
table of the E2M1 values' bf16 low and high bytes), a word shift and a ternary mask, and one
vdpbf16ps sums all 32 products against the activation; the block's E8M0 scale multiplies the
block's 16 partial sums in one FMA into the accumulator (the block's parity picks one of two,
so the FMA chains are two deep per matrix). Measured (Zen 4, 2 threads, weights in cache, bench
preset gate_up, min of 2000 interleaved calls): 67 -> 52 us.

Exact where it matters: the activation (`moe_qdq_x` / `moe_qdq_h`: an E4M3 value times a
power of two) and the E2M1 weight are bf16 values, so each product is the fp32 product; a
pair's two products and the running sum are rounded in vdpbf16ps's order (denormal inputs and
sums flushed to zero), then the block sum times 2^(s - 127) (exact unless it leaves fp32's
range, as the fp32 form's scaled table does) is added with one rounding. Only the order and
grouping of the fp32 additions differ from the fp32 form and from the oracle; the verify form
sums each row exactly as the decode form, so the two stay bit-identical per row.
"""

from __future__ import annotations

from tvm.script import tirx as T

from dsv41.schedules.common import dpbf16ps, fma16, fp4_to_f32_select, i64

LUT_BYTES = 64  # vpermb's table: low bytes of the 16 nibbles' bf16, then their high bytes
# byte 4i .. 4i + 3 of the spread block: byte i of the packed block (both words of its pair)
SPREAD = tuple(i // 4 for i in range(64))


def lut_byte(i):
    """Byte i (an integer loop variable, 0..63) of the lookup table: i < 16 the low byte of the
    bf16 bits of E2M1 nibble i, 16 <= i < 32 the high byte of nibble i - 16, then 0."""
    word = T.reinterpret("uint32", fp4_to_f32_select(T.Cast("uint32", i % 16))) >> T.uint32(16)
    return T.Cast("uint8", T.Select(i < 16, word & T.uint32(0xFF),
                                    T.Select(i < 32, word >> T.uint32(8), T.uint32(0))))


def block_words(codes16, lut):
    """A packed 32-block (uint8 x 16, low nibble first) -> its 32 E2M1 values as bf16 bits
    (uint16 x 32, element j in word j). Each byte is spread to the four bytes of its two
    words; the odd word shifted right by 4 puts the high nibble in its low bits; the mask keeps
    each byte's nibble and adds 16 in the high byte (the table's high half); vpermb looks the
    bytes up."""
    spread = T.reinterpret("uint16x32", T.Shuffle([codes16] * 4, list(SPREAD)))
    shifts = T.Cast("uint16x32", (T.ramp(0, 1, 32) % 2) * 4)
    index = (spread >> shifts & T.broadcast(T.uint16(0x0F0F), 32)) \
        | T.broadcast(T.uint16(0x1000), 32)
    return T.reinterpret("uint16x32", T.call_llvm_pure_intrin(
        "int8x64", "llvm.x86.avx512.permvar.qi.512", lut[T.ramp(0, 1, LUT_BYTES)],
        T.reinterpret("int8x64", index)))


def block_sum(acc_slot, x_words, words, scale):
    """acc_slot + (the 32 products of the block summed by vdpbf16ps into 16 lanes) * scale."""
    return fma16(dpbf16ps(T.broadcast(T.float32(0), 16), x_words, words),
                 T.broadcast(scale, 16), acc_slot)


@T.macro
def each_block(nblk, body, args):
    """`body(*args, blk, par)` for blocks 0 .. nblk - 1 (a Python int) in order, two per step
    so that par = blk % 2, the accumulator slot a block adds into, is static (a register)."""
    for b2 in range(i64(nblk // 2)):
        for par in T.unroll(2):
            body(*args, b2 * 2 + par, par)
    if nblk % 2 == 1:  # static: the last block of an odd count (an even block: slot 0)
        body(*args, i64(nblk - 1), 0)
