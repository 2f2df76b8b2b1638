"""What every kernel shares: the uint8 bit route for low-precision decoding, and a
bf16 rounding helper.

LLVM's fp8/fp4 casts are wrong near zero and at NaN (../shared/TVM.md §2), so every decode goes
through integer bit manipulation on uint32 lanes; the results are bit-exact to `graph.formats`.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

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
    """E8M0 byte -> 2^(b-127) fp32; code 0 is 2^-127 (a subnormal), 0xff is NaN."""
    val = T.reinterpret("float32", b << T.uint32(23))
    val = T.if_then_else(b == T.uint32(0), T.reinterpret("float32", T.uint32(0x00400000)), val)
    return T.if_then_else(b == T.uint32(0xFF), T.reinterpret("float32", T.uint32(0x7FC00000)),
                          val)


def round_bf16(x):
    """fp32 -> nearest bf16 (ties to even) -> fp32, as torch's `.to(bfloat16).float()`.

    Done on the bits: TVM folds a Cast(f32, Cast(bf16, x)) pair away. NaN stays NaN."""
    return T.if_then_else(x != x, x, round_bf16_finite(x))


def round_bf16_finite(x):
    """`round_bf16` of a value known not to be NaN: the rounding on the bits alone."""
    u = T.reinterpret("uint32", x)
    return T.reinterpret("float32", (u + ((u >> T.uint32(16)) & T.uint32(1)) + T.uint32(0x7FFF))
                         & T.uint32(0xFFFF0000))


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


def silu_times(gate, up, limit: float):
    """swiglu(gate, up, limit) as graph.ops.swiglu: clamps when limit > 0, then
    silu(g) * u with silu(g) = g / (1 + exp(-g)) (torch's CPU formula)."""
    if limit > 0:
        up = T.max(T.min(up, T.float32(limit)), T.float32(-limit))
        gate = T.min(gate, T.float32(limit))
    return let(gate, lambda g: g / (T.float32(1) + T.exp(-g)) * up, "gate")


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


# ---- CPU features of a target ------------------------------------------------------------------


def has_features(target, *features: str) -> bool:
    """Whether code for `target` (a TargetSpec; never a CUDA one) may use every LLVM feature
    named (`avx512f`, `avx512vnni`, `amx-bf16`, ...)."""
    from tvm.target import codegen  # noqa: PLC0415

    return not target.is_cuda and all(
        bool(codegen.target_has_features(f, target.tvm_target())) for f in features)


def has_avx512(target) -> bool:
    return has_features(target, "avx512f")


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
    """The bf16 bits (uint16) of an fp32 value that bf16 holds exactly (its low 16 bits are
    zero: decoded E4M3 values, their power-of-two multiples): no rounding is needed."""
    return T.Cast("uint16", T.reinterpret("uint32", v) >> T.uint32(16))


@T.macro
def amx_dot_32x32(a, a_row, row_bytes, b, b_tile, kblocks, yt):
    """yt[c, r] = sum over k of a[a_row + c, k] * B[k, r] for 32 columns c x 32 rows r, on tile
    registers 0..7 (configured by `amx_configure`): `a` holds bf16 (bits) rows of row_bytes,
    read in place as A tiles (16 rows x 32 K); `b[b_tile]` is [k/2, 32] uint32 bf16 pairs,
    AMX's B layout (a row: one K pair for each of 32 rows, 128 bytes apart); kblocks blocks of
    32 K. Tiles 4..7 accumulate the 2 x 2 output tiles in fp32; `yt` is [32, 32] fp32."""
    amx("tilezero", T.int8(4))
    amx("tilezero", T.int8(5))
    amx("tilezero", T.int8(6))
    amx("tilezero", T.int8(7))
    for kb in range(kblocks):
        amx("tileloadd64", T.int8(0), T.address_of(a[a_row, kb * 32]), row_bytes)
        amx("tileloadd64", T.int8(1), T.address_of(a[a_row + 16, kb * 32]), row_bytes)
        amx("tileloadd64", T.int8(2), T.address_of(b[b_tile, kb * 16, 0]), T.int64(128))
        amx("tileloadd64", T.int8(3), T.address_of(b[b_tile, kb * 16, 16]), T.int64(128))
        amx("tdpbf16ps", T.int8(4), T.int8(0), T.int8(2))
        amx("tdpbf16ps", T.int8(5), T.int8(0), T.int8(3))
        amx("tdpbf16ps", T.int8(6), T.int8(1), T.int8(2))
        amx("tdpbf16ps", T.int8(7), T.int8(1), T.int8(3))
    amx("tilestored64", T.int8(4), T.address_of(yt[0, 0]), T.int64(128))
    amx("tilestored64", T.int8(5), T.address_of(yt[0, 16]), T.int64(128))
    amx("tilestored64", T.int8(6), T.address_of(yt[16, 0]), T.int64(128))
    amx("tilestored64", T.int8(7), T.address_of(yt[16, 16]), T.int64(128))
