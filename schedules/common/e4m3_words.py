"""E4M3 codes as exact bf16 words on AVX-512 VBMI: a 256-byte table (the low, then the high byte
of each |code|'s bf16 bits), looked up 64 codes at a time by two vpermi2b (which read the index's
low 7 bits), the sign put back on the high byte, the two bytes interleaved into uint16 words.
Used by the FP8 decode GEMV (its own word order, matched by its activation layout) and the dense
GEMV over an FP8 weight (natural order, an E8M0 tile scale added to the exponent)."""

from __future__ import annotations

from collections.abc import Sequence

from tvm.script import tirx as T

from dsv41.graph.checkpoint.fp8_tiles import EXACT_SCALE_BYTES
from dsv41.schedules.common.decoders import e4m3_to_f32
from dsv41.schedules.common.x86 import bf16_bits_of_exact

CODES = 64  # E4M3 codes per lookup (one 512-bit load)
WORDS = 32  # bf16 words per result vector
HALVES = (list(range(WORDS)), list(range(WORDS, CODES)))  # a load's two halves, in K order
__all__ = ["CODES", "EXACT_SCALE_BYTES", "HALVES", "WORDS", "e4m3_bf16_table",
           "e4m3_bf16_words", "k_order_words", "scaled_words", "scaled_x_words",
           "table_vectors"]


@T.macro
def e4m3_bf16_table(tbl):
    """tbl (256 uint8): [t] the low byte of code t's bf16 bits, [128 + t] the high byte (t <
    128: the sign is the caller's); the NaN code 0x7f looks up the bf16 of a NaN."""
    for t in range(128):
        tbl[t] = T.Cast("uint8", bf16_bits_of_exact(e4m3_to_f32(T.Cast("uint32", t)))
                        & T.uint16(0xFF))
        tbl[128 + t] = T.Cast("uint8", bf16_bits_of_exact(
            e4m3_to_f32(T.Cast("uint32", t))) >> T.uint16(8))


def table_vectors(tbl) -> tuple[list, list]:
    """The table's low-byte and high-byte halves as two pairs of uint8x64 (vpermi2b operands)."""
    return ([tbl.vload([0], "uint8x64"), tbl.vload([64], "uint8x64")],
            [tbl.vload([128], "uint8x64"), tbl.vload([192], "uint8x64")])


def e4m3_bf16_words(codes, lo_tbl, hi_tbl, sources: Sequence[int]):
    """The bf16 bits (uint16 x 32) of the 64 E4M3 `codes` (uint8x64) at offsets `sources` (32
    of them, in word order): |code| looked up (low and high byte), the code's sign bit put on
    the high byte, the bytes interleaved little-endian. Exact for every code (E4M3 has 4
    significant bits; bf16 has 8 and fp32's exponent range)."""
    if len(sources) != WORDS:
        raise ValueError(f"e4m3_bf16_words makes {WORDS} words, got {len(sources)} sources.")
    name = "llvm.x86.avx512.vpermi2var.qi.512"
    lo = T.call_llvm_pure_intrin("int8x64", name, lo_tbl[0], T.reinterpret("int8x64", codes),
                                 lo_tbl[1])
    hi = T.call_llvm_pure_intrin("int8x64", name, hi_tbl[0], T.reinterpret("int8x64", codes),
                                 hi_tbl[1])
    hi = T.reinterpret("uint8x64", hi) | (codes & T.broadcast(T.uint8(0x80), CODES))
    idx = []
    for src in sources:
        idx += [src, CODES + src]
    return T.reinterpret("uint16x32", T.Shuffle([T.reinterpret("uint8x64", lo), hi], idx))


def _exponent_step(scale_byte):
    """2^(scale_byte - 127) as what a bf16 word adds to move its exponent field by that much
    (uint16, mod 2^16)."""
    return T.Cast("uint16", (T.Cast("int32", scale_byte) - 127) * 128)


def scaled_words(words, scale_byte):
    """bf16 words (uint16x32) times the E8M0 scale 2^(scale_byte - 127), exactly: the scale's
    exponent added to every nonzero word's exponent field (a zero, +-0, stays itself). Exact
    where each nonzero result is a normal bf16: a scale byte in `EXACT_SCALE_BYTES`
    (`checkpoint.fp8_tiles`, which the loader checks)."""
    step = _exponent_step(scale_byte)
    nonzero = (words & T.broadcast(T.uint16(0x7FFF), WORDS)) != T.broadcast(T.uint16(0), WORDS)
    return T.Select(nonzero, words + T.broadcast(step, WORDS), words)


def scaled_x_words(words, scale_byte):
    """(scaled, flags) of bf16 words (uint16x32: activations) and an E8M0 scale byte: scaled
    = each normal word times 2^(scale_byte - 127) (its exponent field moved), a zero or
    denormal word as the zero of its sign (`vdpbf16ps` reads a denormal as zero), an inf or
    NaN as it is; flags (uint16x32) 1 where a normal word's scaled exponent left 1 .. 254 (its
    product with a word would no longer be the exact one: the caller then scales the other
    operand instead). Where no flag is set, x 2^e times a word w is exactly x times w 2^e
    (`scaled_words`), and `vdpbf16ps` forms the same sums from either pair."""
    exp = (words >> T.broadcast(T.uint16(7), WORDS)) & T.broadcast(T.uint16(0xFF), WORDS)
    step = _exponent_step(scale_byte)
    moved = T.reinterpret(f"int16x{WORDS}", exp) + T.broadcast(
        T.Cast("int16", T.Cast("int32", scale_byte) - 127), WORDS)
    normal = ((exp != T.broadcast(T.uint16(0), WORDS))
              & (exp != T.broadcast(T.uint16(0xFF), WORDS)))
    out_of_range = ((moved < T.broadcast(T.int16(1), WORDS))
                    | (moved > T.broadcast(T.int16(254), WORDS)))
    scaled = T.Select(normal, words + T.broadcast(step, WORDS),
                      T.Select(exp == T.broadcast(T.uint16(0), WORDS),
                               words & T.broadcast(T.uint16(0x8000), WORDS), words))
    flags = T.Select(normal & out_of_range, T.broadcast(T.uint16(1), WORDS),
                     T.broadcast(T.uint16(0), WORDS))
    return scaled, flags


def k_order_words(codes, lo_tbl, hi_tbl, first_scale, second_scale):
    """The 64 `codes` (two 32-code tiles of one row, in K order) as two vectors of 32 bf16
    words in K order, each half times its tile's E8M0 scale (`scaled_words`): the bf16 of the
    dequantized weight, exactly, while both scale bytes are in `EXACT_SCALE_BYTES`."""
    return tuple(scaled_words(e4m3_bf16_words(codes, lo_tbl, hi_tbl, half), scale)
                 for half, scale in zip(HALVES, (first_scale, second_scale), strict=True))
