"""Self-describing records of named numpy arrays, for state that leaves this process (the Redis
snapshot pool, the EPD hand-off between a prefill and a decode worker).

One record is one byte string:

    MAGIC (8 B) | header length (u32 LE) | header (JSON, UTF-8) | payload | sha256 (32 B)

The header names the record's kind, its key, the model fingerprint (hex) that wrote it, its
`created_at` (wall-clock seconds), a small JSON `meta`, and each array's name, dtype, shape,
offset and length in the payload. The trailing sha256 covers every byte before it, so any
change anywhere (a flipped bit, a truncation, another writer's bytes) is detected before a
field is parsed. `decode_record` checks the checksum, then the kind, the fingerprint and the
key against what the reader expects: a record is never served to another model or under
another key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

import numpy as np

MAGIC = b"DSV41REC"
VERSION = 1
_LEN = struct.Struct("<I")
_SHA = 32


class RecordKind(StrEnum):
    """What a record holds (a str: written into the header as its value)."""

    SNAPSHOT = "snapshot"  # a session's local state in the shared pool (runtime/redis_pool.py)
    HANDOFF = "handoff"  # an EPD prefill worker's runtime state (runtime/epd.py)
    IMAGE = "image"  # an image's bytes, by digest (runtime/images.py)
    FEATURES = "image-features"  # an image's tower rows (runtime/images.py)

    def __repr__(self) -> str:  # in messages, as the plain string it stands for
        return repr(self.value)


class RecordFault(Enum):
    """Why a stored record was not served."""

    CORRUPTED = "corrupted"  # checksum, magic, header or array layout wrong
    FOREIGN = "foreign"  # another model's fingerprint, another kind or another key


class RecordError(ValueError):
    """A record that must not be used; `fault` says why."""

    def __init__(self, fault: RecordFault, message: str):
        super().__init__(message)
        self.fault = fault


@dataclass(frozen=True, slots=True)
class Record:
    kind: RecordKind  # what the record holds
    key: str  # the name it was stored under
    fingerprint: str  # hex of the model fingerprint (runtime.salt.KeySalt) that wrote it
    created_at: float  # wall-clock seconds at encode
    meta: dict[str, Any]  # small JSON facts
    arrays: dict[str, np.ndarray]  # fresh, writable arrays
    nbytes: int  # sum of the arrays' nbytes


def encode_record(*, kind: RecordKind, key: str, fingerprint: bytes, created_at: float,
                  meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """The record's bytes (arrays in C order; `meta` must be JSON-serialisable)."""
    specs, parts, offset = [], [], 0
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            raise ValueError(f"Array {name!r} must be a numpy array of plain values.")
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # a view: join copies once
        specs.append([name, a.dtype.str, list(a.shape), offset, data.size])
        parts.append(data)
        offset += data.size
    header = json.dumps({"version": VERSION, "kind": kind, "key": key,
                         "fingerprint": fingerprint.hex(), "created_at": float(created_at),
                         "meta": meta, "arrays": specs}, separators=(",", ":")).encode()
    head = [MAGIC, _LEN.pack(len(header)), header]
    h = hashlib.sha256()
    for part in (*head, *parts):
        h.update(part)
    return b"".join([*head, *parts, h.digest()])  # the one copy of the arrays' bytes


def decode_record(data: bytes, *, kind: RecordKind, key: str, fingerprint: bytes) -> Record:
    """The record in `data`, or RecordError: CORRUPTED (checksum or layout), FOREIGN (another
    kind, key or model)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError(RecordFault.CORRUPTED, f"A record is bytes, not {type(data).__name__}.")
    data = memoryview(data).cast("B")  # slices below are views, not copies
    if len(data) < len(MAGIC) + _LEN.size + _SHA:
        raise RecordError(RecordFault.CORRUPTED, f"The record is truncated ({len(data)} bytes).")
    body, digest = data[:-_SHA], data[-_SHA:]
    if hashlib.sha256(body).digest() != bytes(digest):
        raise RecordError(RecordFault.CORRUPTED, "The record's checksum does not match.")
    if bytes(body[: len(MAGIC)]) != MAGIC:
        raise RecordError(RecordFault.CORRUPTED, "The record does not start with its magic.")
    (n,) = _LEN.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    try:
        head = json.loads(bytes(body[start: start + n]))
        payload = body[start + n:]
        if head["version"] != VERSION:
            raise RecordError(RecordFault.CORRUPTED, f"Record version {head['version']} is not "
                              f"{VERSION}.")
        if head["kind"] != kind or head["key"] != key or head["fingerprint"] != fingerprint.hex():
            raise RecordError(RecordFault.FOREIGN, f"The record is a {head['kind']!r} of key "
                              f"{head['key'][:16]!r} by model {head['fingerprint'][:16]}; this "
                              f"reader wants a {kind!r} of {key[:16]!r} by "
                              f"{fingerprint.hex()[:16]}.")
        arrays = {}
        for name, dtype, shape, offset, length in head["arrays"]:
            dt = np.dtype(dtype)
            if dt.hasobject or offset < 0 or offset + length > len(payload) \
                    or int(np.prod(shape, dtype=np.int64)) * dt.itemsize != length:
                raise RecordError(RecordFault.CORRUPTED, f"Array {name!r}'s layout does not fit "
                                  "the payload.")
            arrays[name] = np.frombuffer(payload[offset: offset + length], dtype=dt) \
                .reshape(shape).copy()
        return Record(kind, key, head["fingerprint"], float(head["created_at"]),
                      dict(head["meta"]), arrays, sum(a.nbytes for a in arrays.values()))
    except RecordError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # a header that is not ours
        raise RecordError(RecordFault.CORRUPTED, f"The record's header is malformed: {e}.") from e
