"""Bit-exact low-precision number formats of DeepSeek-V4.1-Flash, in numpy and in torch.

The released checkpoint and kernels store weights, KV entries and index keys in four formats
(E2M1 "FP4", OCP E4M3 ``float8_e4m3fn``, E8M0 ``float8_e8m0fnu`` and fp32).  The compiled
graph, the runtime allocations and the test oracles all have to agree with those kernels to the
bit, so every rule lives here once, written twice with identical semantics:

* ``np_<name>`` operates on ``np.ndarray`` and is the easy-to-read oracle for tests and tools;
* ``torch_<name>`` operates on ``torch.Tensor`` using only plain vectorised torch ops (no Python
  loops over elements, no ``.item()``, no numpy), so it can be traced by ``torch.export`` and used
  inside the model graph.

Both versions follow the same algorithm step by step (integer bit manipulation of fp32 values,
exact power-of-two scalings, IEEE fp32 division), which is why they agree byte for byte.

Storage convention ("the uint8 bit route"): every code is a ``uint8``.  FP4 data are packed two
per byte, element ``2i`` in the LOW nibble and element ``2i + 1`` in the high nibble (the
convention of ``torch.float4_e2m1fn_x2``); E4M3 and E8M0 scales are stored as their raw byte.
Encoders first round their input to fp32 (``x.astype(np.float32)`` / ``x.float()``); the
reference feeds bf16 activations, which are exact in fp32.

Non-finite inputs: the element encoders saturate infinities to the largest finite code; NaN
encodes to the E4M3 NaN byte ``0x7F`` / ``0xFF`` and, since E2M1 has no NaN, to the saturated
E2M1 code ``0x7`` / ``0xF`` (sign kept).  Neither version raises on NaN, because the torch
version cannot raise on data and the two must agree; the quantisers are never fed NaN by the
model.  Shape and dtype errors raise ``ValueError`` in both versions.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = (
    "E2M1_MAX",
    "E4M3_MAX",
    "FP8_MAX_INV",
    "FP4_MAX_INV",
    "FP8_BLOCK",
    "FP4_KV_BLOCK",
    "MXFP4_BLOCK",
    "WEIGHT_TILE",
    "FP8_AMAX_FLOOR",
    "FP4_KV_AMAX_FLOOR",
    "MXFP4_AMAX_FLOOR",
    "fp4_kv_entry_bytes",
    "mxfp4_entry_bytes",
    "fp8_entry_bytes",
    "np_e2m1_decode",
    "np_e2m1_encode",
    "np_pack_fp4",
    "np_unpack_fp4",
    "np_e4m3_decode",
    "np_e4m3_encode",
    "np_e8m0_decode",
    "np_round_scale_pow2",
    "np_quant_fp8",
    "np_dequant_fp8",
    "np_quant_fp8_weight",
    "np_dequant_fp8_weight",
    "np_quant_fp4_kv",
    "np_dequant_fp4_kv",
    "np_quant_mxfp4",
    "np_dequant_mxfp4",
    "np_quant_fp4_weight",
    "np_dequant_fp4_weight",
    "torch_e2m1_decode",
    "torch_e2m1_encode",
    "torch_pack_fp4",
    "torch_unpack_fp4",
    "torch_e4m3_decode",
    "torch_e4m3_encode",
    "torch_e8m0_decode",
    "torch_round_scale_pow2",
    "torch_quant_fp8",
    "torch_dequant_fp8",
    "torch_quant_fp8_weight",
    "torch_dequant_fp8_weight",
    "torch_quant_fp4_kv",
    "torch_dequant_fp4_kv",
    "torch_quant_mxfp4",
    "torch_dequant_mxfp4",
    "torch_quant_fp4_weight",
    "torch_dequant_fp4_weight",
    "torch_qdq_fp8",
    "torch_qdq_fp4_kv",
    "torch_qdq_mxfp4",
)


def _fp32(value: float) -> float:
    """Round a Python float to the nearest fp32 value; the kernels use fp32 constants, and an
    fp32-representable Python scalar gives the same product in numpy and torch."""
    return float(np.float32(value))


E2M1_MAX = 6.0
E4M3_MAX = 448.0
# The kernels multiply by these fp32 reciprocals (never divide by 448 or 6); bit-exactness of
# the power-of-two scales depends on it.
FP8_MAX_INV = _fp32(1.0 / 448.0)
FP4_MAX_INV = _fp32(1.0 / 6.0)
FP8_BLOCK = 32
FP4_KV_BLOCK = 16
MXFP4_BLOCK = 32
WEIGHT_TILE = 32
# Amax floors keep all-zero groups away from zero / denormal scales.
FP8_AMAX_FLOOR = _fp32(1e-4)
FP4_KV_AMAX_FLOOR = 6.0 * 2.0**-9  # amax / 6 is then the smallest E4M3 subnormal, never 0
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126

# Minifloat layouts as (exponent bits, mantissa bits, bias, largest finite magnitude).
_E2M1 = (2, 1, 1, E2M1_MAX)
_E4M3 = (4, 3, 7, E4M3_MAX)

_F32_NAN_BITS = 0x7FC00000
_F32_2POW_M127_BITS = 0x00400000  # 2^-127, an fp32 subnormal


# --------------------------------------------------------------------------------------------
# Entry sizes and validation
# --------------------------------------------------------------------------------------------


def _check_group(size: int, group: int, what: str) -> None:
    """Reject a channel count that does not split into whole quantisation groups, because a
    partial group has no scale slot in the stored layout."""
    if group <= 0:
        raise ValueError(f"The group size of {what} must be positive, got {group}.")
    if size % group != 0:
        raise ValueError(
            f"The last dimension of {what} must be a multiple of {group}, got size {size}."
        )


def fp4_kv_entry_bytes(d: int) -> int:
    """Bytes of one main-KV FP4 entry of ``d`` channels: packed E2M1 plus one E4M3 per 16."""
    _check_group(d, FP4_KV_BLOCK, "an FP4 KV entry")
    return d // 2 + d // FP4_KV_BLOCK


def mxfp4_entry_bytes(d: int) -> int:
    """Bytes of one MXFP4 index-key entry of ``d`` channels: packed E2M1 plus one E8M0 per 32."""
    _check_group(d, MXFP4_BLOCK, "an MXFP4 entry")
    return d // 2 + d // MXFP4_BLOCK


def fp8_entry_bytes(d: int, block: int = FP8_BLOCK) -> int:
    """Bytes of one FP8 entry of ``d`` channels: E4M3 codes plus one E8M0 per ``block``."""
    _check_group(d, block, "an FP8 entry")
    return d + d // block


def _check_uint8(dtype_name: str, is_uint8: bool, what: str) -> None:
    """Codes travel as raw bytes; any other dtype means the caller mixed up values and codes."""
    if not is_uint8:
        raise ValueError(f"{what} must have dtype uint8, got {dtype_name}.")


def _check_scale_shape(codes_shape, scales_shape, group: int, what: str) -> None:
    """A scale tensor must hold exactly one scale per group of the code tensor."""
    expected = tuple(codes_shape[:-1]) + (codes_shape[-1] // group,)
    if tuple(scales_shape) != expected:
        raise ValueError(
            f"The scales of {what} must have shape {expected}, got {tuple(scales_shape)}."
        )


def _check_matrix(shape, what: str) -> None:
    """Weight formats are defined for 2-D [out, in] matrices only."""
    if len(shape) != 2:
        raise ValueError(f"{what} must be a 2-D [out, in] matrix, got shape {tuple(shape)}.")


def _tile_grid(shape) -> tuple[int, int]:
    """Number of 32x32 tiles along each axis of an [out, in] weight, partial tiles included."""
    return (math.ceil(shape[0] / WEIGHT_TILE), math.ceil(shape[1] / WEIGHT_TILE))


# --------------------------------------------------------------------------------------------
# numpy: element formats
# --------------------------------------------------------------------------------------------


def _np_decode_minifloat(codes: np.ndarray, layout) -> np.ndarray:
    """Decode sign/exponent/mantissa codes by assembling fp32 bits, which is exact for every
    normal code; subnormal codes are m * 2^(1 - bias - man_bits), also exact in fp32."""
    exp_bits, man_bits, bias, _ = layout
    c = codes.astype(np.int32)
    sign = (c >> (exp_bits + man_bits)) & 1
    e = (c >> man_bits) & ((1 << exp_bits) - 1)
    m = c & ((1 << man_bits) - 1)
    normal_bits = ((e + (127 - bias)) << 23) | (m << (23 - man_bits))
    subnormal = m.astype(np.float32) * np.float32(2.0 ** (1 - bias - man_bits))
    magnitude = np.where(e == 0, subnormal, normal_bits.view(np.float32))
    return np.where(sign == 1, -magnitude, magnitude).astype(np.float32)


def _np_encode_minifloat(x: np.ndarray, layout) -> np.ndarray:
    """Round fp32 to a saturating minifloat with round-to-nearest-even.

    Normal range: add the RNE bias to the fp32 bit pattern and drop the extra mantissa bits (a
    carry into the exponent is the correct rounding).  Subnormal range: scale by a power of two
    (exact) and round half to even; a result equal to 2^man_bits is exactly the smallest normal
    code, so both ranges share one integer code space.
    """
    exp_bits, man_bits, bias, max_value = layout
    x = np.asarray(x, dtype=np.float32)
    sign = np.signbit(x).astype(np.int32) << (exp_bits + man_bits)
    a = np.minimum(np.abs(x), np.float32(max_value))
    shift = 23 - man_bits
    bits = np.where(np.isnan(a), 0, a).astype(np.float32).view(np.int32)
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((127 - bias) << man_bits)
    subnormal = np.rint(a * np.float32(2.0 ** (bias - 1 + man_bits)))
    subnormal = np.where(np.isnan(subnormal), 0, subnormal).astype(np.int32)
    min_normal = np.float32(2.0 ** (1 - bias))
    code = np.where(a < min_normal, subnormal, normal)
    nan_code = (1 << (exp_bits + man_bits)) - 1
    code = np.where(np.isnan(a), nan_code, code)
    return (code | sign).astype(np.uint8)


def np_e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (one per uint8, low 4 bits) -> fp32 in {0, .5, 1, 1.5, 2, 3, 4, 6} with sign."""
    codes = np.asarray(codes)
    _check_uint8(str(codes.dtype), codes.dtype == np.uint8, "E2M1 codes")
    return _np_decode_minifloat(codes & np.uint8(0xF), _E2M1)


def np_e2m1_encode(x: np.ndarray) -> np.ndarray:
    """fp32 -> E2M1 codes (one per uint8), RNE ties to the even code, saturating at +-6,
    sign of zero kept; NaN -> 0x7 / 0xF (saturated, see module docstring)."""
    return _np_encode_minifloat(x, _E2M1)


def np_pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Pack E2M1 codes [..., D] into bytes [..., D/2]: element 2i low nibble, 2i+1 high."""
    codes = np.asarray(codes)
    _check_uint8(str(codes.dtype), codes.dtype == np.uint8, "E2M1 codes")
    _check_group(codes.shape[-1], 2, "packed FP4 codes")
    low = codes[..., 0::2] & np.uint8(0xF)
    high = codes[..., 1::2] & np.uint8(0xF)
    return (low | (high << np.uint8(4))).astype(np.uint8)


def np_unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Unpack bytes [..., D/2] into E2M1 codes [..., D] (inverse of ``np_pack_fp4``)."""
    packed = np.asarray(packed)
    _check_uint8(str(packed.dtype), packed.dtype == np.uint8, "Packed FP4 data")
    pairs = np.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1)
    return pairs.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def np_e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 (float8_e4m3fn) bytes -> fp32, exact; 0x7F / 0xFF decode to NaN."""
    codes = np.asarray(codes)
    _check_uint8(str(codes.dtype), codes.dtype == np.uint8, "E4M3 codes")
    values = _np_decode_minifloat(codes, _E4M3)
    return np.where((codes & np.uint8(0x7F)) == 0x7F, np.float32(np.nan), values)


def np_e4m3_encode(x: np.ndarray) -> np.ndarray:
    """fp32 -> E4M3 bytes: clamp to [-448, 448] ("satfinite") then RNE; NaN -> 0x7F / 0xFF."""
    return _np_encode_minifloat(x, _E4M3)


def np_e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """E8M0 (float8_e8m0fnu) bytes -> fp32 2^(e - 127); code 0 is the fp32 subnormal 2^-127,
    code 0xFF is NaN."""
    codes = np.asarray(codes)
    _check_uint8(str(codes.dtype), codes.dtype == np.uint8, "E8M0 codes")
    e = codes.astype(np.int32)
    bits = np.where(e == 0, _F32_2POW_M127_BITS, e << 23)
    bits = np.where(e == 0xFF, _F32_NAN_BITS, bits).astype(np.int32)
    return bits.view(np.float32)


def np_round_scale_pow2(amax: np.ndarray, max_inv: float) -> np.ndarray:
    """E8M0 byte of 2^ceil(log2(fp32(amax) * fp32(max_inv))), the released kernels' scale rule.

    Returns the stored byte, not the value (decode with ``np_e8m0_decode``).  Computed from the
    fp32 bit pattern of the product: byte = exponent field + (mantissa != 0).  A zero product
    gives byte 0 (2^-127), an fp32-subnormal product gives byte 1, and overflow / non-finite
    products give 0xFF (NaN), mirroring the kernels rather than the mathematical ceil.
    """
    x = np.asarray(amax, dtype=np.float32) * np.float32(max_inv)
    bits = np.asarray(x, dtype=np.float32).view(np.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    return np.minimum(e + (m != 0), 0xFF).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# numpy: grouped quantisers
# --------------------------------------------------------------------------------------------


def _np_groups(x: np.ndarray, group: int, what: str) -> np.ndarray:
    """View fp32 values [..., D] as [..., D/group, group] after checking D splits evenly."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError(f"{what} needs at least one dimension, got a scalar.")
    _check_group(x.shape[-1], group, what)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))


def _np_group_amax(groups: np.ndarray, floor: float) -> np.ndarray:
    """Per-group max |x| floored, so all-zero groups still get a usable scale."""
    return np.maximum(np.abs(groups).max(axis=-1), np.float32(floor))


def _np_scaled_codes(groups: np.ndarray, scale: np.ndarray, limit: float, encode) -> np.ndarray:
    """Encode clamp(x / s, -limit, limit) per group, flattening back to [..., D]."""
    ratio = np.clip(groups / scale[..., None], np.float32(-limit), np.float32(limit))
    codes = encode(ratio)
    return codes.reshape(groups.shape[:-2] + (groups.shape[-2] * groups.shape[-1],))


def _np_apply_scale(values: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """Multiply decoded values [..., D] by their per-group fp32 scale [..., D/group]."""
    shape = values.shape
    grouped = values.reshape(shape[:-1] + (shape[-1] // group, group)) * scale[..., None]
    return grouped.reshape(shape).astype(np.float32)


def np_quant_fp8(x: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """FP8 activation / window-KV quantisation along the last dim in groups of ``block``.

    Returns (E4M3 codes uint8 [..., D], E8M0 scales uint8 [..., D/block]).
    """
    groups = _np_groups(x, block, "FP8 quantisation input")
    scale_bytes = np_round_scale_pow2(_np_group_amax(groups, FP8_AMAX_FLOOR), FP8_MAX_INV)
    codes = _np_scaled_codes(groups, np_e8m0_decode(scale_bytes), E4M3_MAX, np_e4m3_encode)
    return codes, scale_bytes


def np_dequant_fp8(codes: np.ndarray, scales: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Inverse of ``np_quant_fp8``: E4M3 value x E8M0 scale, in fp32."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    _check_group(codes.shape[-1], block, "FP8 codes")
    _check_scale_shape(codes.shape, scales.shape, block, "FP8 codes")
    return _np_apply_scale(np_e4m3_decode(codes), np_e8m0_decode(scales), block)


def _np_pad_tiles(w: np.ndarray) -> np.ndarray:
    """Zero-pad a weight to whole 32x32 tiles; zeros never raise a tile's amax."""
    rows, cols = _tile_grid(w.shape)
    padded = np.zeros((rows * WEIGHT_TILE, cols * WEIGHT_TILE), dtype=np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    return padded


def _np_expand_tiles(tile_values: np.ndarray, shape) -> np.ndarray:
    """Broadcast one value per 32x32 tile back to an [out, in] matrix (partial tiles cut)."""
    full = np.repeat(np.repeat(tile_values, WEIGHT_TILE, axis=0), WEIGHT_TILE, axis=1)
    return full[: shape[0], : shape[1]]


def np_quant_fp8_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8 weight [out, in] -> (E4M3 codes [out, in], E8M0 scale per 32x32 tile
    [ceil(out/32), ceil(in/32)]); amax per tile floored at 1e-4, same scale rule as activations."""
    w = np.asarray(w, dtype=np.float32)
    _check_matrix(w.shape, "An FP8 weight")
    rows, cols = _tile_grid(w.shape)
    tiles = _np_pad_tiles(w).reshape(rows, WEIGHT_TILE, cols, WEIGHT_TILE)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), np.float32(FP8_AMAX_FLOOR))
    scale_bytes = np_round_scale_pow2(amax, FP8_MAX_INV)
    scale = _np_expand_tiles(np_e8m0_decode(scale_bytes), w.shape)
    ratio = np.clip(w / scale, np.float32(-E4M3_MAX), np.float32(E4M3_MAX))
    return np_e4m3_encode(ratio), scale_bytes


def np_dequant_fp8_weight(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """W[i, j] = e4m3(code[i, j]) * 2^(scale[i // 32, j // 32] - 127), in fp32."""
    codes, scales = np.asarray(codes), np.asarray(scales)
    _check_matrix(codes.shape, "FP8 weight codes")
    if tuple(scales.shape) != _tile_grid(codes.shape):
        raise ValueError(
            f"FP8 weight scales must have shape {_tile_grid(codes.shape)}, "
            f"got {tuple(scales.shape)}."
        )
    scale = _np_expand_tiles(np_e8m0_decode(scales), codes.shape)
    return (np_e4m3_decode(codes) * scale).astype(np.float32)


def np_quant_fp4_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Main-KV FP4 along the last dim in 16-channel groups with an E4M3 scale e4m3(amax / 6).

    Returns (packed E2M1 uint8 [..., D/2], E4M3 scales uint8 [..., D/16]).
    """
    groups = _np_groups(x, FP4_KV_BLOCK, "FP4 KV quantisation input")
    amax = _np_group_amax(groups, FP4_KV_AMAX_FLOOR)
    scale_bytes = np_e4m3_encode(amax / np.float32(E2M1_MAX))
    codes = _np_scaled_codes(groups, np_e4m3_decode(scale_bytes), E2M1_MAX, np_e2m1_encode)
    return np_pack_fp4(codes), scale_bytes


def np_dequant_fp4_kv(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of ``np_quant_fp4_kv``: E2M1 value x E4M3 scale, in fp32 [..., D]."""
    values = np_e2m1_decode(np_unpack_fp4(packed))
    scales = np.asarray(scales)
    _check_scale_shape(values.shape, scales.shape, FP4_KV_BLOCK, "FP4 KV data")
    return _np_apply_scale(values, np_e4m3_decode(scales), FP4_KV_BLOCK)


def np_quant_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index-key MXFP4 along the last dim in 32-channel groups with a power-of-two E8M0 scale.

    Returns (packed E2M1 uint8 [..., D/2], E8M0 scales uint8 [..., D/32]).
    """
    groups = _np_groups(x, MXFP4_BLOCK, "MXFP4 quantisation input")
    scale_bytes = np_round_scale_pow2(_np_group_amax(groups, MXFP4_AMAX_FLOOR), FP4_MAX_INV)
    codes = _np_scaled_codes(groups, np_e8m0_decode(scale_bytes), E2M1_MAX, np_e2m1_encode)
    return np_pack_fp4(codes), scale_bytes


def np_dequant_mxfp4(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Inverse of ``np_quant_mxfp4``: E2M1 value x E8M0 scale, in fp32 [..., D]."""
    values = np_e2m1_decode(np_unpack_fp4(packed))
    scales = np.asarray(scales)
    _check_scale_shape(values.shape, scales.shape, MXFP4_BLOCK, "MXFP4 data")
    return _np_apply_scale(values, np_e8m0_decode(scales), MXFP4_BLOCK)


def np_quant_fp4_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP4 expert weight [out, in] -> (packed E2M1 [out, in/2], E8M0 [out, in/32]); the
    checkpoint format is MXFP4 over 32 consecutive inputs."""
    w = np.asarray(w, dtype=np.float32)
    _check_matrix(w.shape, "An FP4 weight")
    return np_quant_mxfp4(w)


def np_dequant_fp4_weight(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Checkpoint FP4 expert weight -> fp32 [out, in]."""
    _check_matrix(np.shape(packed), "Packed FP4 weight data")
    return np_dequant_mxfp4(packed, scales)


# --------------------------------------------------------------------------------------------
# torch: element formats (same algorithms as the numpy versions above)
# --------------------------------------------------------------------------------------------


def _all_codes() -> torch.Tensor:
    """Every byte, uint8 (256,): the decoders' tables are their arithmetic on these."""
    return torch.arange(256, dtype=torch.uint8)


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """table[codes] for uint8 codes: the decoders evaluate their bit arithmetic once on all 256
    bytes and gather, one pass over the codes instead of about ten (same values, bit for bit)."""
    flat = codes.reshape(-1).to(torch.int32)
    return table.index_select(0, flat).reshape(codes.shape)


def _torch_decode_minifloat(codes: torch.Tensor, layout) -> torch.Tensor:
    """Torch twin of ``_np_decode_minifloat``."""
    exp_bits, man_bits, bias, _ = layout
    c = codes.to(torch.int32)
    sign = (c >> (exp_bits + man_bits)) & 1
    e = (c >> man_bits) & ((1 << exp_bits) - 1)
    m = c & ((1 << man_bits) - 1)
    normal_bits = ((e + (127 - bias)) << 23) | (m << (23 - man_bits))
    subnormal = m.to(torch.float32) * (2.0 ** (1 - bias - man_bits))
    magnitude = torch.where(e == 0, subnormal, normal_bits.view(torch.float32))
    return torch.where(sign == 1, -magnitude, magnitude)


def _torch_encode_minifloat(x: torch.Tensor, layout) -> torch.Tensor:
    """Torch twin of ``_np_encode_minifloat`` (RNE, saturating, NaN -> all-ones magnitude)."""
    exp_bits, man_bits, bias, max_value = layout
    x = x.to(torch.float32)
    sign = torch.signbit(x).to(torch.int32) << (exp_bits + man_bits)
    a = torch.clamp(x.abs(), max=max_value)
    is_nan = torch.isnan(a)
    shift = 23 - man_bits
    bits = torch.where(is_nan, torch.zeros_like(a), a).view(torch.int32)
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((127 - bias) << man_bits)
    subnormal = torch.round(a * (2.0 ** (bias - 1 + man_bits)))
    subnormal = torch.where(is_nan, torch.zeros_like(subnormal), subnormal).to(torch.int32)
    code = torch.where(a < 2.0 ** (1 - bias), subnormal, normal)
    nan_code = (1 << (exp_bits + man_bits)) - 1
    code = torch.where(is_nan, torch.full_like(code, nan_code), code)
    return (code | sign).to(torch.uint8)


def _torch_check_uint8(t: torch.Tensor, what: str) -> None:
    """Static dtype check (no data dependence, so it is fine under torch.export)."""
    _check_uint8(str(t.dtype), t.dtype == torch.uint8, what)


def torch_e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_e2m1_decode``."""
    _torch_check_uint8(codes, "E2M1 codes")
    return _lookup(_torch_decode_minifloat(_all_codes() & 0xF, _E2M1), codes)


def torch_e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_e2m1_encode``."""
    return _torch_encode_minifloat(x, _E2M1)


def torch_pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_pack_fp4``; the result can be ``.view(torch.float4_e2m1fn_x2)``."""
    _torch_check_uint8(codes, "E2M1 codes")
    _check_group(codes.shape[-1], 2, "packed FP4 codes")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def torch_unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_unpack_fp4``."""
    _torch_check_uint8(packed, "Packed FP4 data")
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return pairs.reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def torch_e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_e4m3_decode``."""
    _torch_check_uint8(codes, "E4M3 codes")
    values = _torch_decode_minifloat(_all_codes(), _E4M3)
    table = torch.where((_all_codes() & 0x7F) == 0x7F, torch.full_like(values, math.nan), values)
    return _lookup(table, codes)


def torch_e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_e4m3_encode``."""
    return _torch_encode_minifloat(x, _E4M3)


def torch_e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_e8m0_decode``."""
    _torch_check_uint8(codes, "E8M0 codes")
    e = _all_codes().to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, _F32_2POW_M127_BITS), e << 23)
    bits = torch.where(e == 0xFF, torch.full_like(e, _F32_NAN_BITS), bits)
    return _lookup(bits.view(torch.float32), codes)


def torch_round_scale_pow2(amax: torch.Tensor, max_inv: float) -> torch.Tensor:
    """Torch twin of ``np_round_scale_pow2`` (returns the E8M0 byte)."""
    x = amax.to(torch.float32) * _fp32(max_inv)
    bits = x.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    return torch.clamp(e + (m != 0).to(torch.int32), max=0xFF).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# torch: grouped quantisers
# --------------------------------------------------------------------------------------------


def _torch_groups(x: torch.Tensor, group: int, what: str) -> torch.Tensor:
    """Torch twin of ``_np_groups``."""
    if x.dim() == 0:
        raise ValueError(f"{what} needs at least one dimension, got a scalar.")
    _check_group(x.shape[-1], group, what)
    return x.to(torch.float32).reshape(x.shape[:-1] + (x.shape[-1] // group, group))


def _torch_group_amax(groups: torch.Tensor, floor: float) -> torch.Tensor:
    """Torch twin of ``_np_group_amax``."""
    return torch.clamp(groups.abs().amax(dim=-1), min=_fp32(floor))


def _torch_scaled_codes(groups: torch.Tensor, scale: torch.Tensor, limit: float, encode):
    """Torch twin of ``_np_scaled_codes``."""
    ratio = torch.clamp(groups / scale.unsqueeze(-1), -limit, limit)
    return encode(ratio).flatten(-2)


def _torch_apply_scale(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Torch twin of ``_np_apply_scale``."""
    grouped = values.unflatten(-1, (values.shape[-1] // group, group)) * scale.unsqueeze(-1)
    return grouped.flatten(-2)


def _torch_check_scale_shape(codes: torch.Tensor, scales: torch.Tensor, group, what) -> None:
    """Torch twin of the numpy scale-shape check."""
    _check_scale_shape(tuple(codes.shape), tuple(scales.shape), group, what)


def torch_quant_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``np_quant_fp8``."""
    groups = _torch_groups(x, block, "FP8 quantisation input")
    scale_bytes = torch_round_scale_pow2(_torch_group_amax(groups, FP8_AMAX_FLOOR), FP8_MAX_INV)
    codes = _torch_scaled_codes(groups, torch_e8m0_decode(scale_bytes), E4M3_MAX, torch_e4m3_encode)
    return codes, scale_bytes


def torch_dequant_fp8(
    codes: torch.Tensor, scales: torch.Tensor, block: int = FP8_BLOCK
) -> torch.Tensor:
    """Torch twin of ``np_dequant_fp8``."""
    _check_group(codes.shape[-1], block, "FP8 codes")
    _torch_check_scale_shape(codes, scales, block, "FP8 codes")
    return _torch_apply_scale(torch_e4m3_decode(codes), torch_e8m0_decode(scales), block)


def _torch_expand_tiles(tile_values: torch.Tensor, shape) -> torch.Tensor:
    """Torch twin of ``_np_expand_tiles``."""
    full = tile_values.repeat_interleave(WEIGHT_TILE, dim=0).repeat_interleave(WEIGHT_TILE, dim=1)
    return full[: shape[0], : shape[1]]


def torch_quant_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``np_quant_fp8_weight``."""
    _check_matrix(w.shape, "An FP8 weight")
    rows, cols = _tile_grid(w.shape)
    w = w.to(torch.float32)
    pad = (0, cols * WEIGHT_TILE - w.shape[1], 0, rows * WEIGHT_TILE - w.shape[0])
    tiles = torch.nn.functional.pad(w, pad).reshape(rows, WEIGHT_TILE, cols, WEIGHT_TILE)
    amax = torch.clamp(tiles.abs().amax(dim=(1, 3)), min=_fp32(FP8_AMAX_FLOOR))
    scale_bytes = torch_round_scale_pow2(amax, FP8_MAX_INV)
    scale = _torch_expand_tiles(torch_e8m0_decode(scale_bytes), w.shape)
    ratio = torch.clamp(w / scale, -E4M3_MAX, E4M3_MAX)
    return torch_e4m3_encode(ratio), scale_bytes


def torch_dequant_fp8_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_dequant_fp8_weight``."""
    _check_matrix(codes.shape, "FP8 weight codes")
    if tuple(scales.shape) != _tile_grid(codes.shape):
        raise ValueError(
            f"FP8 weight scales must have shape {_tile_grid(codes.shape)}, "
            f"got {tuple(scales.shape)}."
        )
    scale = _torch_expand_tiles(torch_e8m0_decode(scales), codes.shape)
    return torch_e4m3_decode(codes) * scale


def torch_quant_fp4_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``np_quant_fp4_kv``."""
    groups = _torch_groups(x, FP4_KV_BLOCK, "FP4 KV quantisation input")
    amax = _torch_group_amax(groups, FP4_KV_AMAX_FLOOR)
    scale_bytes = torch_e4m3_encode(amax / E2M1_MAX)
    codes = _torch_scaled_codes(groups, torch_e4m3_decode(scale_bytes), E2M1_MAX, torch_e2m1_encode)
    return torch_pack_fp4(codes), scale_bytes


def torch_dequant_fp4_kv(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_dequant_fp4_kv``."""
    values = torch_e2m1_decode(torch_unpack_fp4(packed))
    _torch_check_scale_shape(values, scales, FP4_KV_BLOCK, "FP4 KV data")
    return _torch_apply_scale(values, torch_e4m3_decode(scales), FP4_KV_BLOCK)


def torch_quant_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``np_quant_mxfp4``."""
    groups = _torch_groups(x, MXFP4_BLOCK, "MXFP4 quantisation input")
    amax = _torch_group_amax(groups, MXFP4_AMAX_FLOOR)
    scale_bytes = torch_round_scale_pow2(amax, FP4_MAX_INV)
    codes = _torch_scaled_codes(groups, torch_e8m0_decode(scale_bytes), E2M1_MAX, torch_e2m1_encode)
    return torch_pack_fp4(codes), scale_bytes


def torch_dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_dequant_mxfp4``."""
    values = torch_e2m1_decode(torch_unpack_fp4(packed))
    _torch_check_scale_shape(values, scales, MXFP4_BLOCK, "MXFP4 data")
    return _torch_apply_scale(values, torch_e8m0_decode(scales), MXFP4_BLOCK)


def torch_quant_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of ``np_quant_fp4_weight``."""
    _check_matrix(w.shape, "An FP4 weight")
    return torch_quant_mxfp4(w)


def torch_dequant_fp4_weight(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``np_dequant_fp4_weight``."""
    _check_matrix(packed.shape, "Packed FP4 weight data")
    return torch_dequant_mxfp4(packed, scales)


# --------------------------------------------------------------------------------------------
# torch: quantise-dequantise helpers used by the model
# --------------------------------------------------------------------------------------------


def torch_qdq_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 quantise then dequantise, computed in fp32 from ``x.float()``, returned as bf16
    because the released model runs activations in bf16 (the reference feeds bf16 ``x``)."""
    codes, scales = torch_quant_fp8(x.float(), block)
    return torch_dequant_fp8(codes, scales, block).to(torch.bfloat16)


def torch_qdq_fp4_kv(x: torch.Tensor) -> torch.Tensor:
    """Main-KV FP4 quantise then dequantise in fp32, returned as bf16 (reference feeds bf16)."""
    packed, scales = torch_quant_fp4_kv(x.float())
    return torch_dequant_fp4_kv(packed, scales).to(torch.bfloat16)


def torch_qdq_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """Index-key MXFP4 quantise then dequantise in fp32, returned as bf16 (reference feeds
    bf16)."""
    packed, scales = torch_quant_mxfp4(x.float())
    return torch_dequant_mxfp4(packed, scales).to(torch.bfloat16)
