"""x86 specifics: LLVM intrinsics (prefetch, vpermps, AMX tile instructions and macros) and the
CPU feature checks of a target (AVX-512, AMX-BF16)."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T
from tvm.target import codegen


def prefetch(addr):
    """Prefetch the cache line at `addr` (an address_of) into all cache levels, for reading."""
    return T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", addr, 0, 3, 1))


def pairwise_lane_sum(v, lanes: int):
    """The `lanes` lanes of vector v added pairwise (halves, then quarters, ..) to one lane."""
    while lanes > 1:
        lanes //= 2
        v = T.Shuffle([v], list(range(lanes))) + T.Shuffle([v], list(range(lanes, 2 * lanes)))
    return v


def permps(tbl, idx):
    """vpermps: lane i of the result is lane (idx lane i & 15) of the float32x16 table `tbl`."""
    return T.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.permvar.sf.512", tbl,
                                   T.reinterpret("int32x16", idx))


def permps8(tbl, idx):
    """vpermps (AVX2): lane i of the result is lane (idx lane i & 7) of the float32x8 `tbl`."""
    return T.call_llvm_pure_intrin("float32x8", "llvm.x86.avx2.permps", tbl,
                                   T.reinterpret("int32x8", idx))


def signed_fp4_8(tbl, v):
    """The table values of the E2M1 nibbles in the low 4 bits of v's uint32 lanes (8; higher
    bits ignored) on AVX2: the magnitude looked up in the first 8 entries (vpermps reads 3
    bits), the sign bit (bit 3) moved to bit 31 and flipped in. Bit for bit `permps` over the
    16-entry table wherever entry 8 + i is -(entry i), as E2M1's sign-magnitude values (and any
    positive scale times them) are."""
    sign = (v << T.broadcast(T.uint32(28), 8)) & T.broadcast(T.uint32(0x80000000), 8)
    return T.reinterpret("float32x8", T.reinterpret("uint32x8", permps8(tbl, v)) ^ sign)


def fma8(a, b, c):
    """a * b + c on float32 x 8, rounded once (vfmadd)."""
    return T.call_llvm_pure_intrin("float32x8", "llvm.fma.v8f32", a, b, c)


# ---- AVX-512 BF16 dot products -------------------------------------------------------------------
# LLVM's `llvm.x86.avx512bf16.dpbf16ps.*` take `<N x bfloat>` vectors, and TVM's LLVM codegen
# lowers every bf16 value to i16, so a TIR call cannot name the intrinsic directly. A small LLVM
# function, imported into the kernel's module by `pragma_import_llvm` (`with_bf16_dot`), takes the
# bf16 pairs as i16 lanes, bitcasts them and calls the intrinsic; it is always inlined, so the
# kernel's loop holds the bare `vdpbf16ps`. linkonce_odr lets several kernels of one module import
# the same definition.

BF16_DOT_LL = """
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
declare <8 x float> @llvm.x86.avx512bf16.dpbf16ps.256(<8 x float>, <16 x bfloat>, <16 x bfloat>)
define linkonce_odr <16 x float> @dsv41_dpbf16ps_512(<16 x float> %acc, <32 x i16> %a,
                                                  <32 x i16> %b) alwaysinline {
  %ab = bitcast <32 x i16> %a to <32 x bfloat>
  %bb = bitcast <32 x i16> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %ab,
                                                         <32 x bfloat> %bb)
  ret <16 x float> %r
}
define linkonce_odr <8 x float> @dsv41_dpbf16ps_256(<8 x float> %acc, <16 x i16> %a,
                                                 <16 x i16> %b) alwaysinline {
  %ab = bitcast <16 x i16> %a to <16 x bfloat>
  %bb = bitcast <16 x i16> %b to <16 x bfloat>
  %r = call <8 x float> @llvm.x86.avx512bf16.dpbf16ps.256(<8 x float> %acc, <16 x bfloat> %ab,
                                                        <16 x bfloat> %bb)
  ret <8 x float> %r
}
"""


def dpbf16ps(acc, a, b, lanes: int = 16):
    """vdpbf16ps: lane j of the result is acc[j] + a[2j+1] * b[2j+1] + a[2j] * b[2j] (each product
    exact in fp32, each sum rounded to nearest even, denormal inputs and outputs flushed to zero).
    `acc` is float32 x lanes; `a` and `b` are the bf16 bits as uint16 x (2 * lanes). The caller's
    prim_func body must be inside `with_bf16_dot` (it imports the definition). lanes: 16 or 8."""
    if lanes not in (8, 16):
        raise ValueError(f"dpbf16ps has 8 or 16 fp32 lanes, got {lanes}.")
    return T.call_pure_extern(f"float32x{lanes}", f"dsv41_dpbf16ps_{32 * lanes}", acc, a, b)


def fma16(a, b, c):
    """a * b + c on float32 x 16, rounded once (vfmadd)."""
    return T.call_llvm_pure_intrin("float32x16", "llvm.fma.v16f32", a, b, c)


def bf16_pair_halves(words):
    """The bf16 pairs of `words` (uint16 x 32, as `dpbf16ps` takes them) as two float32 x 16:
    lane j of the first is word 2j + 1, of the second word 2j (a bf16 value is the high half
    of its fp32: the pair's high word kept in place, the low one shifted up)."""
    u = T.reinterpret("uint32x16", words)
    return (T.reinterpret("float32x16", u & T.broadcast(T.uint32(0xFFFF0000), 16)),
            T.reinterpret("float32x16", u << T.broadcast(T.uint32(16), 16)))


def dpbf16ps_by_fma(acc, a_odd, a_even, b_odd, b_even):
    """`dpbf16ps` as two fp32 FMAs on `bf16_pair_halves` of each operand: acc + a[2j+1] *
    b[2j+1], rounded, then + a[2j] * b[2j], rounded, the sums vdpbf16ps forms in its order;
    the products are exact in fp32, so the FMAs round only the sums, and the result is
    vdpbf16ps' bit for bit wherever no input, product or sum is a denormal (vdpbf16ps flushes
    those to zero; an FMA keeps them). On Intel cores with AMX (Sapphire / Emerald Rapids)
    vdpbf16ps zmm issues once per two cycles and an FMA twice per cycle (a Xeon model 207,
    10 independent chains: 0.78 against 0.19 ns an instruction), so the two FMAs cost a
    quarter of the vdpbf16ps they replace where the halves are shared: a weight's halves by
    every row of a verify group, an activation's by every column."""
    return fma16(a_even, b_even, fma16(a_odd, b_odd, acc))


def with_bf16_dot():
    """The attribute scope that imports `BF16_DOT_LL` into a kernel's LLVM module:
    `with T.attr(T.int32(0), *with_bf16_dot()):` around the body that calls `dpbf16ps`."""
    return ("pragma_import_llvm", BF16_DOT_LL)


def has_avx512_bf16(target) -> bool:
    """Whether kernels for `target` (a TargetSpec) may use `dpbf16ps`."""
    return has_features(target, "avx512f", "avx512bf16", "avx512vl")


# ---- CPU features of a target ------------------------------------------------------------------


def has_features(target, *features: str) -> bool:
    """Whether code for `target` (a TargetSpec; never a CUDA one) may use every LLVM feature
    named (`avx512f`, `avx512vnni`, `amx-bf16`, ...)."""

    return not target.is_cuda and all(
        bool(codegen.target_has_features(f, target.tvm_target())) for f in features)


def has_avx512(target) -> bool:
    return has_features(target, "avx512f")


# ---- AMX tiles (Intel Advanced Matrix Extensions) ----------------------------------------------
# A kernel that uses them names tile registers 0..7 by number (the LLVM intrinsics take them as
# immediates), configures all eight as 16 rows x 64 bytes once per parallel task (`amx_configure`),
# and releases them at the end of the task. The process must hold the kernel's AMX permission
# (`graph.targets.request_amx`, which `get_target("cpu")` and the artifact loader call).

AMX_ROWS = 16  # rows of every tile
AMX_BYTES = 64  # bytes per tile row: 32 bf16, 16 fp32 / int32, 64 int8


def has_amx_bf16(target) -> bool:
    """Whether kernels for `target` (a TargetSpec) may use AMX-BF16 tiles."""
    return has_features(target, "amx-tile", "amx-bf16")


def amx(op: str, *args):
    """One AMX instruction (`llvm.x86.<op>`): tile numbers are `T.int8` immediates."""
    return T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{op}", *args))


@T.macro
def amx_configure(cfg):
    """Fill the 64-byte tile configuration `cfg` (a local uint8 buffer) and load it: palette 1,
    tiles 0..7 each AMX_ROWS x AMX_BYTES."""
    for t in range(64):
        cfg[t] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(8):
        cfg[16 + 2 * t] = T.uint8(AMX_BYTES)  # bytes per row (uint16, little end)
        cfg[48 + t] = T.uint8(AMX_ROWS)
    amx("ldtilecfg", T.address_of(cfg[0]))


def bf16_bits_of_exact(v):
    """The bf16 bits (uint16, or uint16 lanes for a float32 vector) of an fp32 value that bf16
    holds exactly (its low 16 bits are zero: decoded E4M3 values, their power-of-two multiples):
    the high halves, no rounding. An fp32 denormal keeps its high bits: a bf16 denormal, which
    vdpbf16ps reads as zero."""
    lanes = tvm.DataType(str(v.ty)).lanes
    if lanes == 1:
        return T.Cast("uint16", T.reinterpret("uint32", v) >> T.uint32(16))
    return T.Cast(f"uint16x{lanes}", T.reinterpret(f"uint32x{lanes}", v)
                  >> T.broadcast(T.uint32(16), lanes))


@T.macro
def amx_dot_2x2(a, a_row, a_col, a_bytes, a_step, b, b_row, b_col, b_col2, b_bytes, ksteps, c,
                c_row, c_col, c_bytes):
    """C = A x B on 2 x 2 output tiles (32 x 32 fp32), on tile registers 0..7 (configured by
    `amx_configure`), in `ksteps` steps of 32 bf16 along K. A: rows a_row .. a_row + 31 of `a`
    (row_bytes a_bytes), step s at column a_col + s * a_step (32 bf16: 32 elements of a uint16
    buffer, 16 of a uint32 one); B, in AMX's pair layout: rows b_row + 16 s .. + 15 of `b`
    (b_bytes apart), the first 16 output columns at column b_col, the next 16 at b_col2. Tiles
    4..7 accumulate from zero in fp32 (each tdpbf16ps adds bf16 products, exact in fp32, in
    pairs); C is stored at c[c_row, c_col] (rows c_row .. c_row + 31, 32 fp32 columns, c_bytes
    apart)."""
    amx("tilezero", T.int8(4))
    amx("tilezero", T.int8(5))
    amx("tilezero", T.int8(6))
    amx("tilezero", T.int8(7))
    for s in range(ksteps):
        amx("tileloadd64", T.int8(0), T.address_of(a[a_row, a_col + s * a_step]), a_bytes)
        amx("tileloadd64", T.int8(1), T.address_of(a[a_row + 16, a_col + s * a_step]), a_bytes)
        amx("tileloadd64", T.int8(2), T.address_of(b[b_row + s * 16, b_col]), b_bytes)
        amx("tileloadd64", T.int8(3), T.address_of(b[b_row + s * 16, b_col2]), b_bytes)
        amx("tdpbf16ps", T.int8(4), T.int8(0), T.int8(2))
        amx("tdpbf16ps", T.int8(5), T.int8(0), T.int8(3))
        amx("tdpbf16ps", T.int8(6), T.int8(1), T.int8(2))
        amx("tdpbf16ps", T.int8(7), T.int8(1), T.int8(3))
    amx("tilestored64", T.int8(4), T.address_of(c[c_row, c_col]), c_bytes)
    amx("tilestored64", T.int8(5), T.address_of(c[c_row, c_col + 16]), c_bytes)
    amx("tilestored64", T.int8(6), T.address_of(c[c_row + 16, c_col]), c_bytes)
    amx("tilestored64", T.int8(7), T.address_of(c[c_row + 16, c_col + 16]), c_bytes)
