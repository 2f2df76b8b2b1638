"""The SSD store's entry files: keys, the file layout, and the checks of a header and a payload
(`runtime/tiers/ssd_store.py` keeps them in a folder).

A block is addressed by a chained hash of its tokens (`block_keys`), so a key names the whole
prefix up to and including its block, and the model fingerprint salts every key: two models never
share a key. Every file is self-describing (magic, format version, key, model fingerprint, payload
length and checksum, all covered by a header checksum), so a damaged, truncated, renamed or
foreign file is detected, deleted and counted, never served.

File layout of `<root>/<key[:2]>/<key>.blk` (all integers little-endian):

    offset  size  field
    0       8     magic b"DSV4KVB\\0"
    8       4     u32 file format version (FORMAT_VERSION)
    12      32    key, raw (the 64 hex chars of the file name, decoded)
    44      32    model fingerprint (`model_fingerprint`)
    76      8     u64 payload length
    84      8     f64 created_at, unix seconds from the store's clock
    92      32    sha256 of the payload
    124     32    sha256 of bytes 0..124 (the header checksum)
    156     ...   payload (`encode_block`)

The payload is a u64 index length, the index as canonical JSON (sorted keys, no spaces) listing
each array's name, dtype string (numpy `dtype.str`, e.g. "<f4"), shape, offset and byte count,
zero padding to a 64-byte boundary, then each array's C-order bytes at a 64-byte-aligned offset
from the start of that data region. Arrays are written in name order, so equal blocks give equal
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT_VERSION = 1
MAGIC = b"DSV4KVB\x00"
FIELDS = struct.Struct("<8sI32s32sQd32s")  # magic, version, key, fingerprint, len, created, sha
HEADER_SIZE = FIELDS.size + 32  # + sha256 of the fields above
FINGERPRINT_SPAN = slice(44, 76)  # where a header keeps the model fingerprint
_ALIGN = 64
_DTYPE_KINDS = "biufc"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_INT64_MAX = np.iinfo(np.int64).max


def model_fingerprint(config_hash: str, weights_hash: str, format_version: int) -> bytes:
    """32 bytes that name the model whose KV a block holds: the config, the weights and the
    version of the KV tensor layout (not the file format, which has its own FORMAT_VERSION)."""
    for name, value in (("config_hash", config_hash), ("weights_hash", weights_hash)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}.")
    if not isinstance(format_version, int) or isinstance(format_version, bool) \
            or format_version < 0:
        raise ValueError(f"format_version must be a non-negative int, got {format_version!r}.")
    doc = {"config_hash": config_hash, "weights_hash": weights_hash,
           "format_version": format_version}
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"dsv41-kv-fingerprint\x00" + canon).digest()


def block_keys(token_ids: Sequence[int], block_tokens: int, fingerprint: bytes) -> list[str]:
    """One key per complete block of `block_tokens` tokens; a partial trailing block has none.

    key_i = sha256(fingerprint || digest_{i-1} || block_i as little-endian int64).hexdigest(),
    where digest_{i-1} is the raw 32-byte digest of the previous key (empty for the first block).
    The chain makes a key name its whole prefix; only hashlib is used, so keys agree across
    processes and machines.
    """
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
        raise ValueError(f"block_tokens must be a positive int, got {block_tokens!r}.")
    check_fingerprint(fingerprint)
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {ids.shape}.")
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers that fit int64, got dtype {ids.dtype}.")
    if ids.size and ids.dtype.kind == "u" and int(ids.max()) > _INT64_MAX:
        raise ValueError("token_ids must fit int64.")
    ids = ids.astype("<i8")
    keys, prev = [], b""
    for i in range(len(ids) // block_tokens):
        block = ids[i * block_tokens:(i + 1) * block_tokens]
        h = hashlib.sha256(fingerprint + prev + block.tobytes())
        keys.append(h.hexdigest())
        prev = h.digest()
    return keys


def encode_block(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The payload bytes of a block; deterministic (name order, fixed padding, canonical JSON)."""
    check_arrays(arrays)
    index, chunks, offset = [], [], 0
    for name in sorted(arrays):
        a = arrays[name]
        pad = -offset % _ALIGN
        chunks.append(b"\x00" * pad)
        offset += pad
        index.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                      "offset": offset, "nbytes": a.nbytes})
        chunks.append(a.tobytes(order="C"))
        offset += a.nbytes
    head = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    lead = struct.pack("<Q", len(head)) + head
    return lead + b"\x00" * (-len(lead) % _ALIGN) + b"".join(chunks)


def decode_block(payload: bytes | bytearray) -> dict[str, np.ndarray]:
    """The arrays of a payload; ValueError when it is malformed. The arrays view `payload`, so
    they are writable when it is a bytearray."""
    try:
        (n,) = struct.unpack_from("<Q", payload, 0)
        index = json.loads(bytes(payload[8:8 + n]).decode())
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"Block index is unreadable ({e}).") from e
    if 8 + n > len(payload) or not isinstance(index, list):
        raise ValueError("Block index is malformed.")
    start = 8 + n + (-(8 + n) % _ALIGN)
    out: dict[str, np.ndarray] = {}
    for item in index:
        try:
            name, dtype = item["name"], np.dtype(item["dtype"])
            shape, off, nbytes = tuple(item["shape"]), item["offset"], item["nbytes"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"Block index entry {item!r} is malformed.") from e
        if not isinstance(name, str) or name in out or dtype.kind not in _DTYPE_KINDS \
                or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or not isinstance(off, int) or off < 0 \
                or nbytes != math.prod(shape) * dtype.itemsize \
                or start + off + nbytes > len(payload):
            raise ValueError(f"Block index entry {item!r} is inconsistent.")
        if nbytes == 0:
            out[name] = np.empty(shape, dtype)
        else:
            out[name] = np.frombuffer(payload, dtype, math.prod(shape), start + off).reshape(shape)
    return out


@dataclass(frozen=True, slots=True)
class Header:
    payload_len: int
    created_at: float
    payload_sha256: bytes



def pack_header(key: str, fingerprint: bytes, payload: bytes, created_at: float) -> bytes:
    """The header of the file of `key` holding `payload` (`encode_block`)."""
    fields = FIELDS.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(key), fingerprint, len(payload),
                         created_at, hashlib.sha256(payload).digest())
    return fields + hashlib.sha256(fields).digest()


def is_key(name: str) -> bool:
    """Whether `name` is a block key (64 lowercase hex characters)."""
    return _KEY_RE.fullmatch(name) is not None


def check_header(buf: bytes, key: str, fingerprint: bytes,
                  file_size: int) -> tuple[str, Header | None]:
    """("ok", header) or (verdict, None); checks in the order the fields can be trusted."""
    if len(buf) < len(MAGIC):
        return ("truncated" if MAGIC.startswith(buf) else "corrupt"), None
    if buf[:len(MAGIC)] != MAGIC:
        return "corrupt", None
    if len(buf) < len(MAGIC) + 4:
        return "truncated", None
    (version,) = struct.unpack_from("<I", buf, len(MAGIC))
    if version != FORMAT_VERSION:
        return "foreign", None
    if len(buf) < HEADER_SIZE:
        return "truncated", None
    fields = buf[:FIELDS.size]
    if hashlib.sha256(fields).digest() != buf[FIELDS.size:HEADER_SIZE]:
        return "corrupt", None
    _, _, raw_key, fp, payload_len, created_at, sha = FIELDS.unpack(fields)
    if fp != fingerprint:  # another model's block (its key differs too, being salted)
        return "foreign", None
    if raw_key.hex() != key:  # a file renamed to another key's name
        return "corrupt", None
    if file_size < HEADER_SIZE + payload_len:
        return "truncated", None
    if file_size > HEADER_SIZE + payload_len or not math.isfinite(created_at):
        return "corrupt", None
    return "ok", Header(payload_len, created_at, sha)


def check_no_meta(meta: Mapping[str, Any], holder: str | None = None) -> None:
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a mapping, got {type(meta).__name__}.")
    if meta:
        raise ValueError(f"A KV block holds arrays only; the SSD store keeps no metadata (got "
                         f"{', '.join(sorted(map(str, meta)))}).")
    if holder is not None:
        raise ValueError(f"A KV block has no holders (it serves every sequence with its "
                         f"prefix); got holder {holder!r}.")


def check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"A block key must be 64 lowercase hex characters, got {key!r}.")


def check_fingerprint(fingerprint: bytes) -> None:
    if not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
        raise ValueError("fingerprint must be the 32 bytes returned by model_fingerprint(), got "
                         f"{fingerprint!r}.")


def check_arrays(arrays: Mapping[str, np.ndarray]) -> None:
    if not isinstance(arrays, Mapping):
        raise ValueError(f"A block must be a mapping of name to numpy array, got "
                         f"{type(arrays).__name__}.")
    for name, a in arrays.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"Array names must be non-empty strings, got {name!r}.")
        if not isinstance(a, np.ndarray):
            raise ValueError(f"Array {name!r} must be a numpy array, got {type(a).__name__}.")
        if a.dtype.kind not in _DTYPE_KINDS:
            raise ValueError(f"Array {name!r} has dtype {a.dtype}; a block holds bool, int, "
                             "uint, float or complex arrays (bf16 as uint16).")
