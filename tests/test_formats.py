"""Bit-exactness tests of dsv41.graph.formats against ml_dtypes and torch's own float8 types.

Each test that exercises a format function runs on both backends (``np_*`` and ``torch_*``)
through a numpy-in / numpy-out adapter, so any divergence between the two shows up as a failure
of one parametrisation.  Oracles are built independently: element codes come from ml_dtypes
casts and scale exponents from ``np.frexp`` in float64 rather than from fp32 bit fiddling.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv41.graph import formats as F

E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------------------------
# Backends and helpers
# --------------------------------------------------------------------------------------------


def _as_torch(value):
    """numpy arrays become torch tensors; anything else (block sizes, constants) passes."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))  # torch wants writable memory
    return value


def _as_numpy(value):
    """Bring torch results back to numpy so both backends share one set of assertions."""
    if isinstance(value, tuple):
        return tuple(_as_numpy(v) for v in value)
    return value.numpy()


def _torch_adapter(fn):
    """Wrap a torch_* function so it takes and returns numpy arrays."""

    def call(*args, **kwargs):
        return _as_numpy(fn(*(_as_torch(a) for a in args), **kwargs))

    return call


@pytest.fixture(params=["np", "torch"])
def impl(request):
    """Return a lookup ``impl("quant_fp8")`` giving that backend's numpy-facing function."""

    def get(name: str):
        fn = getattr(F, f"{request.param}_{name}")
        return fn if request.param == "np" else _torch_adapter(fn)

    return get


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """fp32 equality that also distinguishes -0.0 and treats any NaN as equal to any NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (a.view(np.uint32) == b.view(np.uint32))))


def _finite_random_fp32(n: int, seed: int) -> np.ndarray:
    """Random fp32 bit patterns: every exponent (subnormals included) is equally likely."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return x[np.isfinite(x)]


def _with_neighbours(values: np.ndarray) -> np.ndarray:
    """Values together with their fp32 neighbours on both sides, both signs."""
    v = np.asarray(values, np.float32)
    up = np.nextafter(v, np.float32(np.inf))
    down = np.nextafter(v, np.float32(-np.inf))
    around = np.concatenate([v, up, down])
    return np.concatenate([around, -around])


@functools.cache
def _e4m3_magnitudes() -> np.ndarray:
    """All 127 non-negative finite E4M3 values, ascending (ml_dtypes as the reference)."""
    m = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    m.flags.writeable = False
    return m


@functools.cache
def _e4m3_sweep() -> np.ndarray:
    """Dense adversarial fp32 inputs for the E4M3 encoder."""
    mags = _e4m3_magnitudes()
    mids = ((mags[:-1].astype(np.float64) + mags[1:]) / 2).astype(np.float32)  # exact in fp32
    special = np.array(
        [448, 464, 480, 500, 1e4, 3.0e38, 2.0**-10, 2.0**-11, 1.5 * 2.0**-10, 1e-45, 2.0**-6],
        np.float32,
    )
    subnormal = np.linspace(0, 2.0**-6, 4097, dtype=np.float32)
    parts = [_with_neighbours(np.concatenate([mags, mids, special, subnormal]))]
    parts.append(np.array([0.0, -0.0, np.inf, -np.inf], np.float32))
    parts.append(_finite_random_fp32(1 << 20, seed=1))
    x = np.concatenate(parts)
    x.flags.writeable = False
    return x


@functools.cache
def _e2m1_sweep() -> np.ndarray:
    """Dense adversarial fp32 inputs for the E2M1 encoder."""
    mags = np.array(E2M1_TABLE, np.float32)
    mids = (mags[:-1] + mags[1:]) / 2
    special = np.array([6.5, 7, 100, 3.0e38, 1e-45, 0.125], np.float32)
    parts = [_with_neighbours(np.concatenate([mags, mids, special]))]
    parts.append(np.linspace(-8, 8, 1 << 14, dtype=np.float32))
    parts.append(np.array([0.0, -0.0, np.inf, -np.inf], np.float32))
    parts.append(_finite_random_fp32(1 << 18, seed=2))
    x = np.concatenate(parts)
    x.flags.writeable = False
    return x


def _ref_pow2_byte(amax, max_inv: float) -> np.ndarray:
    """Independent E8M0 scale rule: ceil(log2(fp32 product)) + 127 via float64 frexp, with the
    kernels' conventions at the ends (0 -> byte 0, fp32 subnormal -> byte 1, overflow -> NaN)."""
    x = np.asarray(amax, np.float32) * np.float32(max_inv)
    mant, exp = np.frexp(x.astype(np.float64))
    ceil_log2 = np.where(mant == 0.5, exp - 1, exp)
    byte = np.where(x < 2.0**-126, 1, ceil_log2 + 127)
    byte = np.where(x == 0, 0, byte)
    return np.minimum(byte, 255).astype(np.uint8)


def _ml_e4m3(x: np.ndarray) -> np.ndarray:
    """Satfinite E4M3 bytes from ml_dtypes (clamp first; its own cast maps overflow to NaN)."""
    return (
        np.clip(np.asarray(x, np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    )


def _ml_e2m1(x: np.ndarray) -> np.ndarray:
    """Saturating E2M1 codes (one per byte) from ml_dtypes."""
    return np.clip(np.asarray(x, np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def _ml_e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _ml_e2m1_decode(codes: np.ndarray) -> np.ndarray:
    return (codes & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _ml_e8m0_decode(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)


def _pack(codes: np.ndarray) -> np.ndarray:
    """Reference packing: element 2i low nibble, 2i + 1 high nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _grouped(x: np.ndarray, group: int) -> np.ndarray:
    return x.reshape(x.shape[:-1] + (x.shape[-1] // group, group))


def _oracle_fp8(x: np.ndarray, block: int = 32):
    """(codes, scales, dequantised) of FP8 quantisation built from ml_dtypes and frexp."""
    g = _grouped(np.asarray(x, np.float32), block)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-4))
    sbytes = _ref_pow2_byte(amax, F.FP8_MAX_INV)
    s = _ml_e8m0_decode(sbytes)[..., None]
    codes = _ml_e4m3(g / s)
    deq = (_ml_e4m3_decode(codes) * s).reshape(x.shape)
    return codes.reshape(x.shape), sbytes, deq


def _oracle_fp4_kv(x: np.ndarray):
    """(packed, scales, dequantised) of main-KV FP4 quantisation from ml_dtypes."""
    g = _grouped(np.asarray(x, np.float32), 16)
    amax = np.maximum(np.abs(g).max(-1), np.float32(6 * 2.0**-9))
    sbytes = _ml_e4m3(amax / np.float32(6))
    s = _ml_e4m3_decode(sbytes)[..., None]
    codes = _ml_e2m1(g / s)
    deq = (_ml_e2m1_decode(codes) * s).reshape(x.shape)
    return _pack(codes.reshape(x.shape)), sbytes, deq


def _oracle_mxfp4(x: np.ndarray):
    """(packed, scales, dequantised) of MXFP4 quantisation from ml_dtypes and frexp."""
    g = _grouped(np.asarray(x, np.float32), 32)
    amax = np.maximum(np.abs(g).max(-1), np.float32(6 * 2.0**-126))
    sbytes = _ref_pow2_byte(amax, F.FP4_MAX_INV)
    s = _ml_e8m0_decode(sbytes)[..., None]
    codes = _ml_e2m1(g / s)
    deq = (_ml_e2m1_decode(codes) * s).reshape(x.shape)
    return _pack(codes.reshape(x.shape)), sbytes, deq


ORACLES = (
    pytest.param(_oracle_fp8, "quant_fp8", "dequant_fp8", id="fp8"),
    pytest.param(_oracle_fp4_kv, "quant_fp4_kv", "dequant_fp4_kv", id="fp4_kv"),
    pytest.param(_oracle_mxfp4, "quant_mxfp4", "dequant_mxfp4", id="mxfp4"),
)


def _adversarial_inputs() -> list[np.ndarray]:
    """Activation-like and hostile [4, 128] tensors shared by the quantiser tests."""
    rng = np.random.default_rng(3)
    shape = (4, 128)
    normal = rng.standard_normal(shape).astype(np.float32)
    magnitudes = np.exp(rng.uniform(-60, 60, size=(4, 8, 1))).astype(np.float32)
    per_group = (_grouped(normal, 16) * magnitudes).reshape(shape)
    outlier = (normal * np.float32(1e-3)).copy()
    outlier[:, ::16] = np.float32(1e4)
    outlier[:, 5::32] = np.float32(-3e5)
    alternating = np.tile(np.array([1.5, -1.5], np.float32), (4, 64))
    alternating[2:] *= np.float32(2.0**-20)
    bits = _finite_random_fp32(4 * 128 * 2, seed=4)[: 4 * 128].reshape(shape)
    return [
        np.zeros(shape, np.float32),
        np.full(shape, -0.0, np.float32),
        normal,
        per_group,
        outlier,
        alternating,
        normal * np.float32(1e-40),  # fp32 subnormals
        normal * np.float32(1e-4),  # around the FP8 amax floor
        normal * np.float32(0.01171875 / 3),  # around the FP4 KV amax floor
        bits,
    ]


# --------------------------------------------------------------------------------------------
# Every code of every format
# --------------------------------------------------------------------------------------------


def test_e2m1_every_code_decodes_to_table_and_reencodes(impl):
    codes = np.arange(16, dtype=np.uint8)
    values = impl("e2m1_decode")(codes)
    expected = np.array(E2M1_TABLE + tuple(-v for v in E2M1_TABLE), np.float32)
    assert _bits_equal(values, expected)
    assert np.signbit(values[8]) and not np.signbit(values[0])
    assert _bits_equal(values, _ml_e2m1_decode(codes))
    np.testing.assert_array_equal(impl("e2m1_encode")(values), codes)


def test_e4m3_every_byte_decodes_like_ml_dtypes_and_torch(impl):
    codes = np.arange(256, dtype=np.uint8)
    values = impl("e4m3_decode")(codes)
    assert values.dtype == np.float32
    assert _bits_equal(values, _ml_e4m3_decode(codes))
    via_torch = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    assert _bits_equal(values, via_torch)
    assert np.isnan(values[[0x7F, 0xFF]]).all() and np.isnan(values).sum() == 2
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(impl("e4m3_encode")(values[finite]), codes[finite])


def test_e8m0_every_byte_decodes_like_ml_dtypes_and_torch(impl):
    codes = np.arange(256, dtype=np.uint8)
    values = impl("e8m0_decode")(codes)
    assert values.dtype == np.float32
    assert _bits_equal(values, _ml_e8m0_decode(codes))
    via_torch = torch.from_numpy(codes).view(torch.float8_e8m0fnu).float().numpy()
    assert _bits_equal(values, via_torch)
    assert values[0] == np.float32(2.0**-127) and values[127] == 1.0 and np.isnan(values[255])


# --------------------------------------------------------------------------------------------
# Element encoders
# --------------------------------------------------------------------------------------------


def test_e4m3_encode_matches_ml_dtypes_and_torch_on_dense_sweep(impl):
    x = _e4m3_sweep()
    got = impl("e4m3_encode")(x)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _ml_e4m3(x))
    via_torch = (
        torch.from_numpy(x.copy()).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    np.testing.assert_array_equal(got, via_torch.numpy())


def test_e4m3_encode_landmarks(impl):
    encode = impl("e4m3_encode")
    half_min = np.float32(2.0**-10)  # half the smallest subnormal: ties to the even code 0
    x = np.array(
        [0.0, -0.0, half_min, np.nextafter(half_min, np.float32(1)), 1.5 * 2.0**-9, 2.5 * 2.0**-9],
        np.float32,
    )
    x = np.concatenate([x, np.array([448, 464, 1e30, -np.inf], np.float32)])
    expected = [0x00, 0x80, 0x00, 0x01, 0x02, 0x02, 0x7E, 0x7E, 0x7E, 0xFE]
    np.testing.assert_array_equal(encode(x), expected)


def test_e2m1_encode_matches_ml_dtypes_on_dense_sweep(impl):
    x = _e2m1_sweep()
    got = impl("e2m1_encode")(x)
    assert got.dtype == np.uint8 and got.max() <= 0xF
    np.testing.assert_array_equal(got, _ml_e2m1(x))


def test_e2m1_encode_ties_go_to_even_code(impl):
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.25, 7.0, -np.inf], np.float32)
    expected = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -0.0, 6.0, -6.0], np.float32)
    codes = impl("e2m1_encode")(x)
    assert _bits_equal(impl("e2m1_decode")(codes), expected)


def test_nan_encoding_is_documented_behaviour(impl):
    x = np.array([np.nan, -np.nan], np.float32)
    np.testing.assert_array_equal(impl("e4m3_encode")(x), [0x7F, 0xFF])
    np.testing.assert_array_equal(impl("e2m1_encode")(x), [0x7, 0xF])


def test_fp4_packing_order_and_roundtrip(impl):
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 16, size=(3, 5, 64), dtype=np.uint8)
    packed = impl("pack_fp4")(codes)
    np.testing.assert_array_equal(packed, _pack(codes))
    np.testing.assert_array_equal(impl("unpack_fp4")(packed), codes)
    np.testing.assert_array_equal(impl("pack_fp4")(np.array([0x1, 0x2], np.uint8)), [0x21])


def test_fp4_packed_bytes_view_losslessly_as_torch_float4_x2():
    # torch 2.13 on CPU offers no casts to or from float4_e2m1fn_x2, only views; we check the
    # view is lossless and keeps one element per packed byte (two E2M1 values each).
    codes = torch.arange(256, dtype=torch.int32).remainder(16).to(torch.uint8).reshape(4, 64)
    packed = F.torch_pack_fp4(codes)
    as_fp4 = packed.view(torch.float4_e2m1fn_x2)
    assert as_fp4.shape == (4, 32)
    assert torch.equal(as_fp4.view(torch.uint8), packed)
    assert torch.equal(F.torch_unpack_fp4(as_fp4.view(torch.uint8)), codes)


# --------------------------------------------------------------------------------------------
# Scale rules
# --------------------------------------------------------------------------------------------


def test_round_scale_pow2_matches_frexp_reference(impl):
    rnd = impl("round_scale_pow2")
    amax = np.abs(_finite_random_fp32(1 << 16, seed=6))
    for max_inv in (F.FP8_MAX_INV, F.FP4_MAX_INV, 1.0):
        np.testing.assert_array_equal(rnd(amax, max_inv), _ref_pow2_byte(amax, max_inv))


def test_round_scale_pow2_exact_powers_keep_their_exponent(impl):
    rnd = impl("round_scale_pow2")
    k = np.arange(-126, 128)
    powers = np.ldexp(np.float32(1), k).astype(np.float32)
    np.testing.assert_array_equal(rnd(powers, 1.0), k + 127)
    above = np.nextafter(powers, np.float32(np.inf))
    np.testing.assert_array_equal(rnd(above, 1.0), np.minimum(k + 128, 255))
    # 448 * fp32(1/448) and 6 * fp32(1/6) both round to exactly 1.0 in fp32.
    kk = np.arange(-100, 100)
    for top, inv in ((448.0, F.FP8_MAX_INV), (6.0, F.FP4_MAX_INV)):
        amax = np.ldexp(np.float32(top), kk).astype(np.float32)
        np.testing.assert_array_equal(rnd(amax, inv), kk + 127)
        up = np.nextafter(amax, np.float32(np.inf))
        np.testing.assert_array_equal(rnd(up, inv), kk + 128)


def test_round_scale_pow2_ends(impl):
    rnd = impl("round_scale_pow2")
    x = np.array([0.0, 1e-45, 2.0**-126, 2.0**127, 3.0e38, np.inf], np.float32)
    np.testing.assert_array_equal(rnd(x, 1.0), [0, 1, 1, 254, 255, 255])
    # The kernels multiply by fp32(1/448) / fp32(1/6); an exhaustive fp32 sweep shows dividing
    # by 448 / 6 differs only here, where the quotient underflows to 0 but the product does not.
    tiny = np.array([224, 3], np.uint32).view(np.float32)
    np.testing.assert_array_equal(rnd(tiny[:1], F.FP8_MAX_INV), [1])
    np.testing.assert_array_equal(rnd(tiny[1:], F.FP4_MAX_INV), [1])


def test_all_zero_groups_get_the_floored_scale(impl):
    zeros = np.zeros((2, 64), np.float32)
    codes, scales = impl("quant_fp8")(zeros)
    assert (codes == 0).all() and (scales == 105).all()  # fp32(1e-4) * fp32(1/448) -> 2^-22
    packed, scales = impl("quant_fp4_kv")(zeros)
    assert (packed == 0).all() and (scales == 0x01).all()  # e4m3(2^-9), smallest subnormal
    packed, scales = impl("quant_mxfp4")(zeros)
    assert (packed == 0).all() and (scales == 1).all()  # 2^-126
    codes, _ = impl("quant_fp8")(-zeros)
    assert (codes == 0x80).all()
    packed, _ = impl("quant_mxfp4")(-zeros)
    assert (packed == 0x88).all()


def test_fp4_kv_scale_saturates_at_448(impl):
    x = np.zeros((3, 16), np.float32)
    x[0, 3] = 6 * 448
    x[1, 3] = -1e9
    x[2, :] = np.float32(2700)
    packed, scales = impl("quant_fp4_kv")(x)
    np.testing.assert_array_equal(scales, [[0x7E], [0x7E], [0x7E]])
    codes = F.np_unpack_fp4(packed)
    assert codes[0, 3] == 0x7 and codes[1, 3] == 0xF and (codes[2] == 0x7).all()


def test_fp4_kv_scale_divides_amax_by_six(impl):
    # An exhaustive sweep of fp32 amax found exactly these 15 values (one per binade) where
    # e4m3(amax / 6) and e4m3(amax * fp32(1/6)) differ; the spec is the division.
    bits = np.uint32(0x3DE3FFFF) + (np.arange(15, dtype=np.uint32) << np.uint32(23))
    amax = bits.view(np.float32)
    x = np.zeros((15, 16), np.float32)
    x[:, 7] = -amax
    _, scales = impl("quant_fp4_kv")(x)
    np.testing.assert_array_equal(scales[:, 0], 9 + 8 * np.arange(15))
    np.testing.assert_array_equal(scales[:, 0], _ml_e4m3(amax / np.float32(6)))


# --------------------------------------------------------------------------------------------
# Round trips against independent oracles
# --------------------------------------------------------------------------------------------


# Inputs near FLT_MAX legitimately dequantise to inf (e.g. 3.4e38 -> 256 * 2^120 = 2^128).
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize(("oracle", "quant_name", "dequant_name"), ORACLES)
def test_quantisers_match_ml_dtypes_oracle_on_adversarial_inputs(
    impl, oracle, quant_name, dequant_name
):
    quant, dequant = impl(quant_name), impl(dequant_name)
    for x in _adversarial_inputs():
        data, scales = quant(x)
        exp_data, exp_scales, exp_deq = oracle(x)
        np.testing.assert_array_equal(scales, exp_scales)
        np.testing.assert_array_equal(data, exp_data)
        assert _bits_equal(dequant(data, scales), exp_deq)


def test_quant_fp8_other_block_and_leading_dims(impl):
    x = np.random.default_rng(7).standard_normal((2, 3, 256)).astype(np.float32)
    codes, scales = impl("quant_fp8")(x, block=128)
    exp_codes, exp_scales, exp_deq = _oracle_fp8(x, block=128)
    assert scales.shape == (2, 3, 2)
    np.testing.assert_array_equal(codes, exp_codes)
    np.testing.assert_array_equal(scales, exp_scales)
    assert _bits_equal(impl("dequant_fp8")(codes, scales, block=128), exp_deq)


def test_values_exactly_on_codes_times_scale_roundtrip_exactly(impl):
    rng = np.random.default_rng(8)
    # FP8: codes x 2^k with a 448 in every group -> scale byte 127 + k, codes reproduced
    # (k >= -22 keeps 448 * 2^k above the 1e-4 amax floor).
    codes = rng.integers(0, 256, size=(6, 64), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    codes[:, ::32] = 0x7E | (rng.integers(0, 2, size=(6, 2), dtype=np.uint8) << 7)
    k = rng.integers(-22, 100, size=(6, 2))
    x = (_grouped(_ml_e4m3_decode(codes), 32) * np.ldexp(np.float32(1), k)[..., None]).reshape(
        6, 64
    )
    got_codes, got_scales = impl("quant_fp8")(x.astype(np.float32))
    np.testing.assert_array_equal(got_codes, codes)
    np.testing.assert_array_equal(got_scales, k + 127)
    assert _bits_equal(impl("dequant_fp8")(got_codes, got_scales), x)

    # MXFP4: E2M1 codes x 2^k with a 6 in every group.
    k = rng.integers(-126, 100, size=(6, 2))
    e2 = rng.integers(0, 16, size=(6, 64), dtype=np.uint8)
    e2[:, ::32] = 0x7 | (rng.integers(0, 2, size=(6, 2), dtype=np.uint8) << 3)
    x = (_grouped(_ml_e2m1_decode(e2), 32) * np.ldexp(np.float32(1), k)[..., None]).reshape(6, 64)
    packed, scales = impl("quant_mxfp4")(x.astype(np.float32))
    np.testing.assert_array_equal(packed, _pack(e2))
    np.testing.assert_array_equal(scales, k + 127)
    assert _bits_equal(impl("dequant_mxfp4")(packed, scales), x)

    # FP4 KV: E2M1 codes x an E4M3 scale s with a 6 in every group (6 * s / 6 == s exactly).
    e2 = rng.integers(0, 16, size=(6, 64), dtype=np.uint8)
    e2[:, ::16] = 0x7 | (rng.integers(0, 2, size=(6, 4), dtype=np.uint8) << 3)
    sbytes = rng.integers(0x01, 0x7F, size=(6, 4), dtype=np.uint8)
    x = (_grouped(_ml_e2m1_decode(e2), 16) * _ml_e4m3_decode(sbytes)[..., None]).reshape(6, 64)
    packed, scales = impl("quant_fp4_kv")(x.astype(np.float32))
    np.testing.assert_array_equal(packed, _pack(e2))
    np.testing.assert_array_equal(scales, sbytes)
    assert _bits_equal(impl("dequant_fp4_kv")(packed, scales), x)


def _e2m1_tie_groups(scales: np.ndarray, group: int) -> np.ndarray:
    """One group per scale s: 6s (fixes the scale), every E2M1 midpoint x s with both signs,
    zero padding; all products are exact in fp32."""
    mids = (np.array(E2M1_TABLE[:-1], np.float32) + np.array(E2M1_TABLE[1:], np.float32)) / 2
    row = np.zeros(group, np.float32)
    row[:15] = np.concatenate([[6.0], mids, -mids])
    return row[None, :] * scales.astype(np.float32)[:, None]


def test_fp4_kv_ties_inside_the_quantiser_go_to_even(impl):
    scales = _ml_e4m3_decode(np.arange(0x01, 0x7F, dtype=np.uint8))
    x = _e2m1_tie_groups(scales, 16)
    packed, sbytes = impl("quant_fp4_kv")(x)
    exp_packed, exp_sbytes, exp_deq = _oracle_fp4_kv(x)
    np.testing.assert_array_equal(sbytes[:, 0], np.arange(0x01, 0x7F))
    np.testing.assert_array_equal(packed, exp_packed)
    expected_codes = np.array([7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0], np.uint8)
    assert (F.np_unpack_fp4(packed) == expected_codes).all()
    assert _bits_equal(impl("dequant_fp4_kv")(packed, sbytes), exp_deq)


def test_mxfp4_and_fp8_ties_inside_the_quantiser_go_to_even(impl):
    k = np.arange(-126, 120, 5)
    x = _e2m1_tie_groups(np.ldexp(np.float32(1), k).astype(np.float32), 32)
    packed, sbytes = impl("quant_mxfp4")(x)
    np.testing.assert_array_equal(sbytes[:, 0], k + 127)
    np.testing.assert_array_equal(packed, _oracle_mxfp4(x)[0])
    mags = _e4m3_magnitudes()
    mids = ((mags[:-1].astype(np.float64) + mags[1:]) / 2).astype(np.float32)
    x = np.concatenate([mids, [448.0, -0.0]]).astype(np.float32).reshape(4, 32) * np.float32(
        2.0**-20
    )
    x[:, 0] = np.float32(448 * 2.0**-20)
    codes, sbytes = impl("quant_fp8")(x)
    np.testing.assert_array_equal(sbytes, np.full((4, 1), 107))
    np.testing.assert_array_equal(codes, _oracle_fp8(x)[0])


def _half_gap(table: np.ndarray, ratio: np.ndarray) -> np.ndarray:
    """Half the distance between the two representable magnitudes enclosing |ratio|."""
    a = np.abs(ratio.astype(np.float64))
    idx = np.clip(np.searchsorted(table, a, side="left"), 1, len(table) - 1)
    return (table[idx] - table[idx - 1]) / 2


@pytest.mark.parametrize(
    ("quant_name", "dequant_name", "group", "table", "scale_decode"),
    [
        ("quant_fp8", "dequant_fp8", 32, "e4m3", _ml_e8m0_decode),
        ("quant_fp4_kv", "dequant_fp4_kv", 16, "e2m1", _ml_e4m3_decode),
        ("quant_mxfp4", "dequant_mxfp4", 32, "e2m1", _ml_e8m0_decode),
    ],
)
def test_quantisation_error_is_at_most_half_a_code_step(
    impl, quant_name, dequant_name, group, table, scale_decode
):
    table = _e4m3_magnitudes() if table == "e4m3" else np.array(E2M1_TABLE, np.float32)
    table = table.astype(np.float64)
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((8, 256)) * np.exp(rng.uniform(-5, 5, size=(8, 1)))).astype(np.float32)
    data, scales = impl(quant_name)(x)
    deq = impl(dequant_name)(data, scales).astype(np.float64)
    s = np.repeat(scale_decode(scales).astype(np.float64), group, axis=-1)
    ratio = x / s
    inside = np.abs(ratio) <= table[-1]
    err = np.abs(x - deq) / s
    assert np.all(err[inside] <= _half_gap(table, ratio[inside]) * (1 + 1e-6))
    assert np.all(np.abs(deq[~inside]) == table[-1] * s[~inside])


@pytest.mark.parametrize(
    "name", ["quant_fp8", "quant_fp4_kv", "quant_mxfp4", "quant_fp8_weight", "quant_fp4_weight"]
)
def test_numpy_and_torch_quantisers_are_byte_identical(name):
    np_fn, torch_fn = getattr(F, f"np_{name}"), _torch_adapter(getattr(F, f"torch_{name}"))
    inputs = _adversarial_inputs() + [np.random.default_rng(10).standard_normal((70, 128))]
    for x in inputs:
        x = x.astype(np.float32)
        for a, b in zip(np_fn(x), torch_fn(x), strict=True):
            assert a.dtype == b.dtype == np.uint8
            np.testing.assert_array_equal(a, b)


def test_torch_qdq_helpers_equal_dequant_of_quant_in_bf16():
    rng = np.random.default_rng(11)
    x32 = (rng.standard_normal((3, 256)) * np.exp(rng.uniform(-8, 8, size=(3, 1)))).astype(
        np.float32
    )
    x = torch.from_numpy(x32).to(torch.bfloat16)
    xf = x.float().numpy()
    cases = [
        (F.torch_qdq_fp8(x), F.np_dequant_fp8(*F.np_quant_fp8(xf))),
        (F.torch_qdq_fp4_kv(x), F.np_dequant_fp4_kv(*F.np_quant_fp4_kv(xf))),
        (F.torch_qdq_mxfp4(x), F.np_dequant_mxfp4(*F.np_quant_mxfp4(xf))),
    ]
    for got, ref in cases:
        assert got.dtype == torch.bfloat16
        expected = torch.from_numpy(ref).to(torch.bfloat16)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(F.torch_qdq_fp8(x, block=64), F.torch_qdq_fp8(x.float(), block=64))


def test_torch_qdq_helpers_export():
    class QDQ(torch.nn.Module):
        def forward(self, x):
            return F.torch_qdq_fp8(x), F.torch_qdq_fp4_kv(x), F.torch_qdq_mxfp4(x)

    x = torch.randn(2, 128, dtype=torch.bfloat16)
    program = torch.export.export(QDQ(), (x,))
    for got, ref in zip(program.module()(x), QDQ()(x), strict=True):
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_entry_sizes():
    assert F.fp4_kv_entry_bytes(512) == 288
    assert F.mxfp4_entry_bytes(128) == 68
    assert F.fp8_entry_bytes(512) == 528
    assert F.fp8_entry_bytes(512, block=128) == 516
    with pytest.raises(ValueError, match="multiple of 16"):
        F.fp4_kv_entry_bytes(520)
    with pytest.raises(ValueError, match="multiple of 32"):
        F.mxfp4_entry_bytes(48)
    with pytest.raises(ValueError, match="multiple of 32"):
        F.fp8_entry_bytes(100)
    with pytest.raises(ValueError, match="positive"):
        F.fp8_entry_bytes(64, block=0)


# --------------------------------------------------------------------------------------------
# Weight formats
# --------------------------------------------------------------------------------------------


def test_fp8_weight_partial_tiles(impl):
    rng = np.random.default_rng(12)
    w = rng.standard_normal((70, 100)).astype(np.float32)
    w[64:, 96:] *= np.float32(1e3)  # the corner partial tile gets its own, larger scale
    w[:32, :32] = 0.0  # an all-zero tile takes the floored scale
    codes, scales = impl("quant_fp8_weight")(w)
    assert codes.shape == (70, 100) and scales.shape == (3, 4)
    assert scales[0, 0] == 105
    expected = np.empty((70, 100), np.float32)
    for ti in range(3):
        for tj in range(4):
            tile = w[32 * ti : 32 * ti + 32, 32 * tj : 32 * tj + 32]
            amax = max(np.abs(tile).max(), np.float32(1e-4))
            byte = _ref_pow2_byte(np.float32(amax), F.FP8_MAX_INV)
            assert scales[ti, tj] == byte
            s = _ml_e8m0_decode(np.array([byte], np.uint8))[0]
            tile_codes = _ml_e4m3(tile / s)
            np.testing.assert_array_equal(
                codes[32 * ti : 32 * ti + 32, 32 * tj : 32 * tj + 32], tile_codes
            )
            expected[32 * ti : 32 * ti + 32, 32 * tj : 32 * tj + 32] = (
                _ml_e4m3_decode(tile_codes) * s
            )
    assert _bits_equal(impl("dequant_fp8_weight")(codes, scales), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_fp4_weight_dequant_matches_ml_dtypes_decoding(impl):
    rng = np.random.default_rng(13)
    packed = rng.integers(0, 256, size=(64, 64), dtype=np.uint8)
    scales = rng.integers(0, 255, size=(64, 4), dtype=np.uint8)
    values = np.stack([_ml_e2m1_decode(packed & 0xF), _ml_e2m1_decode(packed >> 4)], -1)
    values = values.reshape(64, 128)
    expected = (_grouped(values, 32) * _ml_e8m0_decode(scales)[..., None]).reshape(64, 128)
    assert _bits_equal(impl("dequant_fp4_weight")(packed, scales), expected)


def test_fp4_weight_quant_roundtrip(impl):
    w = np.random.default_rng(14).standard_normal((48, 96)).astype(np.float32) * np.float32(0.02)
    packed, scales = impl("quant_fp4_weight")(w)
    assert packed.shape == (48, 48) and scales.shape == (48, 3)
    exp_packed, exp_scales, exp_deq = _oracle_mxfp4(w)
    np.testing.assert_array_equal(packed, exp_packed)
    np.testing.assert_array_equal(scales, exp_scales)
    assert _bits_equal(impl("dequant_fp4_weight")(packed, scales), exp_deq)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "args", "match"),
    [
        ("quant_fp8", (np.zeros((2, 48), np.float32),), "multiple of 32, got size 48"),
        ("quant_fp4_kv", (np.zeros((2, 40), np.float32),), "multiple of 16, got size 40"),
        ("quant_mxfp4", (np.zeros(80, np.float32),), "multiple of 32, got size 80"),
        ("quant_fp8_weight", (np.zeros(64, np.float32),), "2-D"),
        ("quant_fp4_weight", (np.zeros((2, 2, 64), np.float32),), "2-D"),
        ("quant_fp4_weight", (np.zeros((2, 48), np.float32),), "multiple of 32, got size 48"),
        ("dequant_fp8", (np.zeros((2, 64), np.uint8), np.zeros((2, 3), np.uint8)), "shape"),
        ("dequant_fp8", (np.zeros((2, 40), np.uint8), np.zeros((2, 1), np.uint8)), "size 40"),
        ("dequant_fp4_kv", (np.zeros((2, 32), np.uint8), np.zeros((2, 3), np.uint8)), "shape"),
        ("dequant_mxfp4", (np.zeros((2, 32), np.float32), np.zeros((2, 2), np.uint8)), "uint8"),
        (
            "dequant_fp8_weight",
            (np.zeros((70, 100), np.uint8), np.zeros((2, 4), np.uint8)),
            r"\(3, 4\)",
        ),
        ("e4m3_decode", (np.zeros(4, np.int32),), "uint8"),
        ("pack_fp4", (np.zeros(5, np.uint8),), "multiple of 2, got size 5"),
    ],
)
def test_bad_input_raises_value_error(impl, name, args, match):
    with pytest.raises(ValueError, match=match):
        impl(name)(*args)
