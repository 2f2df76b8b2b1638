"""The SSD tier of the global KV cache: prefix blocks on disk, kept across restarts, each kept for
at least a guaranteed minimum lifetime.

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
bytes. bf16 travels as uint16; numpy's own kinds b/i/u/f/c are accepted, nothing else.

Last access survives a restart as the file's mtime: a write sets it to created_at and a hit sets
it to the clock's time (`os.utime`), and the scan at construction orders the LRU list by
max(created_at, mtime).

The root is a marked store folder (`store_folder`): created and marked on first use, a non-empty
folder without the marker is refused, and one owner holds it at a time (an advisory lock; a
second `KVStore` on it, in any process, gets `StoreBusyError`): the index lives in memory, and the
scan at construction removes temporary files left by a crashed writer. The scan never follows a
symbolic link and deletes only regular files at an entry's path (`<shard>/<key>.blk`, or a
writer's temporary name).

Every file operation is confined to the folder the store opened: the root is held open as a
directory descriptor (the one its lock is on), each shard is opened relative to it with
`O_NOFOLLOW`, and each file relative to its shard with `O_NOFOLLOW` (open, stat, unlink, rename,
utime), so a shard or block swapped for a symbolic link later is an I/O error (a miss, counted),
never a read or a deletion outside the store. Before every get, put and drop the store checks
that its path still names the folder it opened (same device and inode, not removed): a folder
removed or replaced under a running engine disables the store (logged once as an error; every
get misses, every put is refused), so it never writes into another owner's folder.

Time: ages come from the store's clock (wall seconds, kept in headers and mtimes so they survive a
restart), trusted within `MAX_CLOCK_SKEW_S`: an entry stamped further in the future than that (the
clock stepped back after it was written, or it was written while the clock ran ahead) is of
unknown age, so it is never protected by the minimum lifetime and is the first evicted; a clock
fault can never pin a full store.

Store I/O failures (permission, space, a directory or FIFO where a block should be, a file where
a shard folder should be) never escape: a failed read is a miss (`read_errors`), a failed write is
a refused write (`write_errors`), each kind logged once per store. Reads check the file type
before reading and open without blocking, so a special file never hangs a get.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsv41.runtime.tiers.base import NO_META, ArrayCheck
from dsv41.runtime.tiers.store_folder import FolderLock, claim_folder

FORMAT_VERSION = 1
STORE_KIND = "dsv41-kv-store"
MAGIC = b"DSV4KVB\x00"
_FIELDS = struct.Struct("<8sI32s32sQd32s")  # magic, version, key, fingerprint, len, created, sha
HEADER_SIZE = _FIELDS.size + 32  # + sha256 of the fields above
_ALIGN = 64
_DTYPE_KINDS = "biufc"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_TMP_RE = re.compile(r"\.[0-9a-f]{64}\.\d+\.[0-9a-f]{8}\.tmp")
_INT64_MAX = np.iinfo(np.int64).max
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_CLOCK_SKEW_S = 300.0  # how far in the future a timestamp is still trusted (then: unknown age)
_log = logging.getLogger(__name__)


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
    _check_fingerprint(fingerprint)
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
class KVStoreStats:
    entries: int  # blocks indexed now
    bytes: int  # sum of their file sizes, headers included
    capacity: int  # capacity_bytes
    hits: int  # get() that returned a block
    misses: int  # get() that returned None (absent, or found bad and deleted)
    writes: int  # put() that wrote a new file
    refused_writes: int  # put() refused: bigger than capacity, only younger entries to evict,
    # or the write failed (write_errors)
    evictions: int  # entries removed to make room (all at least min_lifetime_s old)
    corrupt: int  # files deleted for bad magic/header/checksum, wrong key, bad index, misplaced
    truncated: int  # files deleted for being shorter than their header says
    foreign: int  # files deleted for another model's fingerprint or another file format version
    read_errors: int = 0  # reads that failed (I/O error, not a regular file): misses, not deleted
    write_errors: int = 0  # writes or deletions that failed (permission, space, wrong file type)
    drops: int = 0  # drop() that removed a stored block
    disabled: bool = False  # the folder was removed or replaced under the store: serves nothing


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    refused_writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    truncated: int = 0
    foreign: int = 0
    read_errors: int = 0
    write_errors: int = 0
    drops: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    size: int  # bytes of the file, header included
    created_at: float  # clock() when written (from the header); starts the minimum lifetime


@dataclass(frozen=True, slots=True)
class _Header:
    payload_len: int
    created_at: float
    payload_sha256: bytes


class KVStore:
    """Prefix blocks on disk under a byte capacity, with a minimum lifetime.

    Eviction order: when a put does not fit, entries of unknown age (stamped more than
    `MAX_CLOCK_SKEW_S` in the future) are chosen first, then entries at least
    `min_lifetime_s` old (by created_at), least recently used first, until the new file fits.
    If all of those
    together do not free enough, nothing is evicted and the put is refused (counted in
    `refused_writes`): an entry younger than the lifetime is never evicted. A get hit and a put
    of a present key make the entry most recently used; `contains`/`lookup_prefix` do not.
    """

    def __init__(self, root: str | os.PathLike, *, capacity_bytes: int, fingerprint: bytes,
                 min_lifetime_s: float = 72 * 3600, clock: Callable[[], float] = time.time):
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) \
                or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}.")
        if not isinstance(min_lifetime_s, int | float) or isinstance(min_lifetime_s, bool) \
                or not math.isfinite(min_lifetime_s) or min_lifetime_s < 0:
            raise ValueError(f"min_lifetime_s must be a finite number >= 0, got "
                             f"{min_lifetime_s!r}.")
        if not callable(clock):
            raise ValueError("clock must be a callable returning unix seconds.")
        _check_fingerprint(fingerprint)
        self.root = Path(root)
        self._lock: FolderLock = claim_folder(self.root, kind=STORE_KIND, version=FORMAT_VERSION)
        self._dir = self._lock.fd  # the folder opened: every path below is relative to it
        opened = os.fstat(self._dir)
        self._identity = (opened.st_dev, opened.st_ino)
        self._disabled: str | None = None  # why the folder is no longer ours, once it is not
        self.capacity_bytes = capacity_bytes
        self.min_lifetime_s = float(min_lifetime_s)
        self.fingerprint = bytes(fingerprint)
        self.clock = clock
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._n = _Counters()
        self._logged: set[str] = set()  # failure kinds already logged (once each)
        try:
            self._scan()
        except BaseException:
            self._lock.close()
            raise

    # -- public ----------------------------------------------------------------------------

    def close(self) -> None:
        """Let the folder go (another owner may open it); the store serves nothing after."""
        self._lock.close()

    @property
    def closed(self) -> bool:
        return not self._lock.held

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """Store a block; True when it is (now or already) stored, False when refused (no room,
        or the write failed: counted in `write_errors` and logged once). A block is arrays
        only: `meta` and `holder` (the tier interface's) must be empty."""
        check_key(key)
        check_arrays(arrays)
        check_no_meta(meta, holder)
        self._check_open()
        if not self._folder_is_ours():
            self._n.refused_writes += 1
            return False
        if key in self._index:
            self._touch(key)
            return True
        payload = encode_block(arrays)
        size = HEADER_SIZE + len(payload)
        now = self.clock()
        victims = self._plan_eviction(size, now)
        if victims is None:
            self._n.refused_writes += 1
            return False
        for victim in victims:
            self._remove(victim)
            self._n.evictions += 1
        try:
            self._write(key, payload, now)
        except OSError as e:
            self._failed("write", f"writing block {key}", e)
            self._n.refused_writes += 1
            return False
        self._index[key] = _Entry(size, now)
        self._bytes += size
        self._n.writes += 1
        return True

    def get(self, key: str, *, check: ArrayCheck | None = None) -> dict[str, np.ndarray] | None:
        """The block's arrays (fresh, writable), or None. A bad file is deleted and counted.
        `check`: the reader's own test of the arrays (names, shapes, dtypes it expects); a
        ValueError from it makes the file a counted `corrupt` miss, deleted like any bad file."""
        check_key(key)
        self._check_open()
        if not self._folder_is_ours() or key not in self._index:
            self._n.misses += 1
            return None
        try:
            verdict, arrays = self._read(key)
        except FileNotFoundError:  # removed behind our back: forget it
            self._bytes -= self._index.pop(key).size
            self._n.misses += 1
            return None
        except OSError as e:  # unreadable (permission, a link, I/O): a miss; the file stays
            self._failed("read", f"reading block {key}", e)
            self._bytes -= self._index.pop(key).size
            self._n.misses += 1
            return None
        if verdict == "special":  # not a regular file: not ours to delete, never read
            self._failed("read", f"block {key}", OSError(errno.EINVAL, "not a regular file"))
            self._bytes -= self._index.pop(key).size
            self._n.misses += 1
            return None
        if arrays is not None and check is not None:
            try:
                check(arrays)
            except ValueError as e:
                _log.warning("KV store %s: block %s does not fit this engine (%s); deleted.",
                             self.root, key, e)
                verdict, arrays = "corrupt", None
        if arrays is None:
            self._discard(key, verdict)
            self._n.misses += 1
            return None
        self._touch(key)
        self._n.hits += 1
        return arrays

    def drop(self, key: str, *, holder: str | None = None) -> bool:
        """Forget a block and delete its file; True when it was stored. Only a regular file
        of the store's own name is deleted (never a link's target); a deletion that fails is
        counted in `write_errors` and the file is found again by a later start's scan. A block
        has no holders (`holder` must be None)."""
        check_key(key)
        check_no_meta(NO_META, holder)
        self._check_open()
        if not self._folder_is_ours() or key not in self._index:
            return False
        self._remove(key)
        self._n.drops += 1
        return True

    def contains(self, key: str) -> bool:
        check_key(key)
        return self._disabled is None and key in self._index

    def lookup_prefix(self, keys: Iterable[str]) -> int:
        """How many leading keys are stored (index only: no payload is read, no LRU change)."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        n = 0
        for key in keys:
            if self._disabled is not None or key not in self._index:
                break
            n += 1
        return n

    def stats(self) -> KVStoreStats:
        return KVStoreStats(entries=len(self._index), bytes=self._bytes,
                            capacity=self.capacity_bytes, disabled=self._disabled is not None,
                            **asdict(self._n))

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"The KV store at {self.root} is closed.")

    def _folder_is_ours(self) -> bool:
        """Whether the store's path still names the folder it opened (same device and inode,
        not removed). The first time it does not, the store disables itself (logged once)."""
        if self._disabled is not None:
            return False
        try:
            now, opened = os.stat(self.root), os.fstat(self._dir)
        except OSError as e:
            why = f"cannot be checked ({e.strerror or e})"
        else:
            if (now.st_dev, now.st_ino) == self._identity and opened.st_nlink > 0:
                return True
            why = "was removed or replaced since the store opened it"
        self._disabled = why
        _log.error("KV store %s: the folder %s; the SSD tier is disabled (every read misses, "
                   "every write is refused) until the engine is restarted on a store folder.",
                   self.root, why)
        return False

    def _failed(self, kind: str, what: str, error: OSError) -> None:
        """Count a read or write failure; log the first of each kind and errno."""
        setattr(self._n, f"{kind}_errors", getattr(self._n, f"{kind}_errors") + 1)
        tag = f"{kind}/{error.errno}"
        if tag not in self._logged:
            self._logged.add(tag)
            _log.warning("KV store %s: %s failed (%s); served as a miss / refused write, "
                         "further %s errors of this kind are only counted.", self.root, what,
                         error.strerror or error, kind)

    def _plan_eviction(self, size: int, now: float) -> list[str] | None:
        """Keys to evict so that `size` more bytes fit, or None when it cannot fit: entries of
        unknown age first, then those at least min_lifetime_s old, least recently used first."""
        if size > self.capacity_bytes:
            return None
        need = self._bytes + size - self.capacity_bytes
        unknown = [k for k, e in self._index.items() if e.created_at > now + MAX_CLOCK_SKEW_S]
        old = [k for k, e in self._index.items()
               if now + MAX_CLOCK_SKEW_S >= e.created_at and now - e.created_at
               >= self.min_lifetime_s]
        victims: list[str] = []
        for key in unknown + old:
            if need <= 0:
                break
            victims.append(key)
            need -= self._index[key].size
        return victims if need <= 0 else None

    def _shard(self, key: str, *, create: bool = False) -> contextlib.AbstractContextManager[int]:
        """The shard folder of `key`, opened relative to the store's folder without following
        a link (ELOOP / ENOTDIR when it is one, or a file); created when `create`."""
        return _opened_dir(key[:2], self._dir, create=create)

    def _touch(self, key: str) -> None:
        self._index.move_to_end(key)
        now = self.clock()
        try:  # last access survives a restart as the mtime; a failure only loses that hint
            with self._shard(key) as shard:
                os.utime(f"{key}.blk", (now, now), dir_fd=shard, follow_symlinks=False)
        except OSError:
            pass

    def _remove(self, key: str) -> None:
        """Forget an entry and delete its file (a failed deletion is counted; the scan of a
        later start finds the file again)."""
        self._bytes -= self._index.pop(key).size
        try:
            with self._shard(key) as shard:
                self._unlink(shard, f"{key}.blk")
        except FileNotFoundError:
            pass
        except OSError as e:  # the shard is a link, a file, or unreadable: nothing deleted
            self._failed("write", f"deleting {key}.blk", e)

    def _unlink(self, shard: int, name: str) -> None:
        """Delete `name` in the open shard, only ever a regular file of ours (never a link)."""
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=shard)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._failed("write", f"deleting {name}", e)

    def _discard(self, key: str, verdict: str) -> None:
        assert verdict in ("corrupt", "truncated", "foreign"), verdict
        self._remove(key)
        setattr(self._n, verdict, getattr(self._n, verdict) + 1)

    def _write(self, key: str, payload: bytes, created_at: float) -> None:
        """Write-temp, fsync, rename, fsync the directory: a crash leaves the old state or the
        new file whole, plus at most a temporary file that the next scan removes."""
        fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(key), self.fingerprint,
                              len(payload), created_at, hashlib.sha256(payload).digest())
        header = fields + hashlib.sha256(fields).digest()
        tmp = f".{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        with self._shard(key, create=True) as shard:
            try:
                with open(os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=shard), "wb") as f:
                    f.write(header)
                    f.write(payload)
                    f.flush()
                    os.utime(f.fileno(), (created_at, created_at))
                    os.fsync(f.fileno())
                os.replace(tmp, f"{key}.blk", src_dir_fd=shard, dst_dir_fd=shard)
            except BaseException:
                with contextlib.suppress(OSError):  # the first failure is the one to report
                    os.unlink(tmp, dir_fd=shard)
                raise
            os.fsync(shard)

    def _read(self, key: str) -> tuple[str, dict[str, np.ndarray] | None]:
        """("ok", arrays) or (verdict, None) with verdict one of corrupt/truncated/foreign, or
        special (not a regular file; never read, so a FIFO or device cannot block or feed it).
        """
        name = f"{key}.blk"
        with self._shard(key) as shard:
            if not stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
                return "special", None
            with open(os.open(name, _READ_FLAGS, dir_fd=shard), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
                    return "special", None
                size = st.st_size
                verdict, header = _check_header(f.read(HEADER_SIZE), key, self.fingerprint, size)
                if header is None:
                    return verdict, None
                payload = bytearray(header.payload_len)
                if f.readinto(payload) != header.payload_len:
                    return "truncated", None
        if hashlib.sha256(payload).digest() != header.payload_sha256:
            return "corrupt", None
        try:
            return "ok", decode_block(payload)
        except ValueError:
            return "corrupt", None

    def _scan(self) -> None:
        """Rebuild the index from headers (payloads are verified on get). Temporary files of a
        crashed writer are removed; bad entry files are deleted and counted; anything that is
        not a regular file at an entry's path (other names, links, folders, FIFOs) is left
        alone, and no link is followed. An entry stamped in the future (beyond the skew) is
        first in the LRU order: of unknown age, it is the first evicted."""
        found: list[tuple[float, str, _Entry]] = []
        now = self.clock()
        for shard_name in self._listing(self._dir, "the store folder"):
            if not _SHARD_RE.fullmatch(shard_name):
                continue
            try:
                with _opened_dir(shard_name, self._dir, create=False) as shard:
                    found += self._scan_shard(shard, shard_name, now)
            except OSError:  # not a folder, or a link: not ours, left alone
                continue
        for _, key, entry in sorted(found, key=lambda t: (t[0], t[1])):
            self._index[key] = entry
            self._bytes += entry.size

    def _scan_shard(self, shard: int, shard_name: str,
                    now: float) -> list[tuple[float, str, _Entry]]:
        found = []
        for name in self._listing(shard, shard_name):
            try:
                if not stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
                    continue
            except OSError:
                continue
            if _TMP_RE.fullmatch(name):
                self._unlink(shard, name)
                continue
            key = name[:-4]
            if not (name.endswith(".blk") and _KEY_RE.fullmatch(key)):
                continue
            if key[:2] != shard_name:  # misplaced: get() would never find it
                self._unlink(shard, name)
                self._n.corrupt += 1
                continue
            try:
                with open(os.open(name, _READ_FLAGS, dir_fd=shard), "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    verdict, header = _check_header(f.read(HEADER_SIZE), key,
                                                    self.fingerprint, st.st_size)
            except OSError as e:
                self._failed("read", f"scanning {name}", e)
                continue
            if header is None:
                self._unlink(shard, name)
                setattr(self._n, verdict, getattr(self._n, verdict) + 1)
                continue
            last_access = max(header.created_at, st.st_mtime)
            if header.created_at > now + MAX_CLOCK_SKEW_S:
                last_access = -math.inf
            found.append((last_access, key, _Entry(st.st_size, header.created_at)))
        return found

    def _listing(self, folder: int, what: str) -> list[str]:
        try:
            return sorted(os.listdir(folder))
        except OSError as e:
            self._failed("read", f"listing {what}", e)
            return []


@contextlib.contextmanager
def _opened_dir(name: str, parent: int, *, create: bool):
    """A child folder of the open folder `parent`, opened without following a link."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        os.mkdir(name, 0o755, dir_fd=parent)
        os.fsync(parent)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_header(buf: bytes, key: str, fingerprint: bytes,
                  file_size: int) -> tuple[str, _Header | None]:
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
    fields = buf[:_FIELDS.size]
    if hashlib.sha256(fields).digest() != buf[_FIELDS.size:HEADER_SIZE]:
        return "corrupt", None
    _, _, raw_key, fp, payload_len, created_at, sha = _FIELDS.unpack(fields)
    if fp != fingerprint:  # another model's block (its key differs too, being salted)
        return "foreign", None
    if raw_key.hex() != key:  # a file renamed to another key's name
        return "corrupt", None
    if file_size < HEADER_SIZE + payload_len:
        return "truncated", None
    if file_size > HEADER_SIZE + payload_len or not math.isfinite(created_at):
        return "corrupt", None
    return "ok", _Header(payload_len, created_at, sha)


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


def _check_fingerprint(fingerprint: bytes) -> None:
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
