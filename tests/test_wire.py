"""Records of named arrays (runtime/wire.py): exact round trips, and every damage or mismatch
refused with its fault."""

from __future__ import annotations

import numpy as np
import pytest

from dsv41.runtime.tiers.wire import RecordError, RecordFault, decode_record, encode_record

FP = bytes(range(32))


def _arrays() -> dict[str, np.ndarray]:
    return {"strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
            "empty": np.zeros((0, 3), np.uint8), "bits": np.array([1, 65535], np.uint16),
            "scalar": np.array(5, np.int64), "flags": np.array([True, False])}


def _encode(**kw) -> bytes:
    args = {"kind": "snapshot", "key": "k", "fingerprint": FP, "created_at": 12.5,
            "meta": {"tokens": 3}, "arrays": _arrays()} | kw
    return encode_record(**args)


def test_round_trip_is_exact_and_writable():
    rec = decode_record(_encode(), kind="snapshot", key="k", fingerprint=FP)
    assert (rec.created_at, rec.meta, rec.fingerprint) == (12.5, {"tokens": 3}, FP.hex())
    for name, a in _arrays().items():
        got = rec.arrays[name]
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()
        assert got.flags.writeable
    assert rec.nbytes == sum(a.nbytes for a in _arrays().values())


@pytest.mark.parametrize("want, fault", [
    ({"kind": "handoff"}, RecordFault.FOREIGN), ({"key": "other"}, RecordFault.FOREIGN),
    ({"fingerprint": bytes(32)}, RecordFault.FOREIGN)])
def test_another_kind_key_or_model_is_foreign(want, fault):
    args = {"kind": "snapshot", "key": "k", "fingerprint": FP} | want
    with pytest.raises(RecordError) as e:
        decode_record(_encode(), **args)
    assert e.value.fault is fault


def test_any_flipped_byte_or_truncation_is_corrupted():
    value = _encode()
    for at in range(0, len(value), max(1, len(value) // 40)):
        bad = bytearray(value)
        bad[at] ^= 0x01
        with pytest.raises(RecordError) as e:
            decode_record(bytes(bad), kind="snapshot", key="k", fingerprint=FP)
        assert e.value.fault is RecordFault.CORRUPTED
    for cut in (0, 10, len(value) - 1):
        with pytest.raises(RecordError, match="truncated|checksum"):
            decode_record(value[:cut], kind="snapshot", key="k", fingerprint=FP)


def test_object_arrays_are_refused():
    with pytest.raises(ValueError, match="plain values"):
        _encode(arrays={"o": np.array([object()])})
