"""The AMX parts of the hand-vectorised sweep: tile geometry, the exponent window and the
E8M0-code helpers that fold key block scales into int8 shifts."""

from __future__ import annotations

from tvm.script import tirx as T

AMX_TILE = 32  # AMX sweep: entries per tile (2 tiles of 16 columns)
AMX_HEADS = 32  # AMX sweep: heads per pass (2 tiles of 16 rows; 4 accumulator tiles)


# ---- the hand-vectorised full sweep (AVX-512, or AVX2 with lanes=8) --------------------------


AMX_EXP_LO = 109  # AMX sweep: q + key exponent codes at least this (scale >= 2^-149)
AMX_EXP_HI = 364  # ... and at most this (|dot| < 2^21 x 2^106: finite)


def shift_bytes(word, sh):
    """Each signed byte of an int32 word shifted left by sh (|result| must fit a byte)."""
    out = T.int32(0)
    for i in range(4):
        byte = (word >> T.int32(8 * i)) & T.int32(255)
        signed = byte - ((byte >> T.int32(7)) << T.int32(8))
        out = out | (((signed << sh) & T.int32(255)) << T.int32(8 * i))
    return out


def code_word(KS, vb, pos):
    """Key row pos's 4 E8M0 codes (dim 128) as one little-endian uint32."""
    w = T.Cast("uint32", KS[vb, pos, 0])
    for blk in range(1, 4):
        w = w | (T.Cast("uint32", KS[vb, pos, blk]) << T.uint32(8 * blk))
    return w


def code_of(w, blk):
    return T.Cast("int32", (w >> T.uint32(8 * blk)) & T.uint32(255))


def code_min(w):
    """The least of the 4 codes in a `code_word` (int32)."""
    return T.min(T.min(code_of(w, 0), code_of(w, 1)), T.min(code_of(w, 2), code_of(w, 3)))


def code_max(w):
    return T.max(T.max(code_of(w, 0), code_of(w, 1)), T.max(code_of(w, 2), code_of(w, 3)))


def permb(lut, idx):
    """vpermb: byte i of the result is lut[idx byte i & 63] (a uint32x16 index vector)."""
    return T.call_llvm_pure_intrin("int8x64", "llvm.x86.avx512.permvar.qi.512",
                                   lut.vload([0], "int8x64"), T.reinterpret("int8x64", idx))
