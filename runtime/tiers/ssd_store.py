"""The SSD tier of the global KV cache: prefix blocks on disk, kept across restarts, each kept for
at least a guaranteed minimum lifetime.

A block is addressed by a chained hash of its tokens (`block_keys`), so a key names the whole
prefix up to and including its block, and the model fingerprint salts every key: two models never
share a key. Every file is self-describing (`block_file`: magic, format version, key, model
fingerprint, payload length and checksum, all covered by a header checksum), so a damaged,
truncated, renamed or foreign file is detected, deleted and counted, never served. Files live at
`<root>/<key[:2]>/<key>.blk`.

Last access survives a restart, and is shared by every owner, as the file's mtime: a write sets
it to created_at and a hit sets it to the clock's time (`os.utime`), and a scan orders the LRU
list by max(created_at, mtime).

The root is a marked store folder (`store_folder`): created and marked on first use, a non-empty
folder without the marker is refused. Any number of owners (processes, or stores in one process)
share it, each with its own in-memory index (`KVStore`: how they stay consistent). A scan removes
temporary files whose writer is gone (a live writer holds a lock on its temporary file); it never
follows a symbolic link and deletes only regular files at an entry's path (`<shard>/<key>.blk`,
or a writer's temporary name). Another model's entries (an engine with other options sharing
the folder) are kept and counted in the bytes in use, evicted by the same rules, never served.

Every file operation is confined to the folder the store opened: the root is held open as a
directory descriptor (the one the folder's lock is taken on), each shard is opened relative to
it with `O_NOFOLLOW`, and each file relative to its shard with `O_NOFOLLOW` (open, stat, unlink,
rename, utime), so a shard or block swapped for a symbolic link later is an I/O error (a miss,
counted), never a read or a deletion outside the store. Before every get, put and drop the store
checks that its path still names the folder it opened (same device and inode, not removed): a
folder removed or replaced under a running engine disables the store (logged once as an error;
every get misses, every put is refused), so it never writes into another owner's folder.

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
import fcntl
import hashlib
import logging
import math
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsv41.runtime.tiers.base import NO_META, ArrayCheck
from dsv41.runtime.tiers.block_file import (
    FINGERPRINT_SPAN,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    block_keys,
    check_arrays,
    check_fingerprint,
    check_header,
    check_key,
    check_no_meta,
    decode_block,
    encode_block,
    is_key,
    model_fingerprint,
    pack_header,
)
from dsv41.runtime.tiers.store_folder import StoreFolder, claim_folder

__all__ = [  # the store, and the entry files' names its callers use (from block_file)
    "FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "MAX_CLOCK_SKEW_S", "STORE_KIND", "USAGE_NAME",
    "KVStore", "KVStoreStats", "block_keys", "check_arrays", "check_key", "check_no_meta",
    "decode_block", "encode_block", "model_fingerprint",
]

STORE_KIND = "dsv41-kv-store"
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_TMP_RE = re.compile(r"\.[0-9a-f]{64}\.\d+\.[0-9a-f]{8}\.tmp")
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
USAGE_NAME = "DSV41-STORE.usage"  # the folder's ledger: bytes, generation, lifetime (`_Ledger`)
_USAGE = struct.Struct("<QQQQ")  # bytes, generation, lifetime ms, their xor with _USAGE_CHECK
_USAGE_CHECK = 0x5A5A_5A5A_5A5A_5A5A
MAX_CLOCK_SKEW_S = 300.0  # how far in the future a timestamp is still trusted (then: unknown age)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVStoreStats:
    entries: int  # blocks of this model indexed now
    bytes: int  # sum of the indexed files' sizes, headers and other models' entries included
    capacity: int  # capacity_bytes
    hits: int  # get() that returned a block
    misses: int  # get() that returned None (absent, or found bad and deleted)
    writes: int  # put() that wrote a new file
    refused_writes: int  # put() refused: bigger than capacity, only younger entries to evict,
    # or the write failed (write_errors)
    evictions: int  # entries removed to make room (all at least min_lifetime_s old)
    corrupt: int  # files deleted for bad magic/header/checksum, wrong key, bad index, misplaced
    truncated: int  # files deleted for being shorter than their header says
    foreign: int  # files deleted for another file format version, or read under one of this
    # model's keys with another model's fingerprint
    read_errors: int = 0  # reads that failed (I/O error, not a regular file): misses, not deleted
    write_errors: int = 0  # writes or deletions that failed (permission, space, wrong file type)
    drops: int = 0  # drop() that removed a stored block
    disabled: bool = False  # the folder was removed or replaced under the store: serves nothing
    others: int = 0  # entries of another model fingerprint in the folder (an engine sharing it
    # with other options): kept, counted in bytes, evicted by the same rules, never served
    adopted: int = 0  # entries another process wrote, found in the folder on a lookup
    rescans: int = 0  # folder scans to make room (the folder's own state, every owner's entries)


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
    adopted: int = 0
    rescans: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    size: int  # bytes of the file, header included
    created_at: float  # clock() when written (from the header); starts the minimum lifetime
    ino: int  # the file's inode: a file deleted and written again under its name is another
    ours: bool = True  # this model's fingerprint (else another engine's, never served)


@dataclass(frozen=True, slots=True)
class _Ledger:
    bytes: int  # the folder's bytes in use (exact after a scan; deletions of bad files and
    # drops leave it high, which only brings the next rescan sooner)
    generation: int  # bumped by every owner's change (publication, eviction, deletion)
    lifetime_ms: int  # the longest minimum lifetime any owner that wrote here promises: every
    # owner's eviction honours it (an owner of a shorter one never evicts a longer one's entry)


class KVStore:
    """Prefix blocks on disk under a byte capacity, with a minimum lifetime, shared by any
    number of processes (each with its own `KVStore` and in-memory index) on one folder.

    Eviction order: when a put does not fit, entries of unknown age (stamped more than
    `MAX_CLOCK_SKEW_S` in the future) are chosen first, then entries at least
    `min_lifetime_s` old (by created_at), least recently used first, until the new file fits.
    If all of those
    together do not free enough, nothing is evicted and the put is refused (counted in
    `refused_writes`): an entry younger than the lifetime is never evicted. A get hit and a put
    of a present key make the entry most recently used; `contains`/`lookup_prefix` do not.

    Sharing: entry files are write-once (a temporary file, fsynced, published under its name
    only while no file is there), and every publication, eviction and deletion happens under the
    folder's exclusive lock (`StoreFolder.exclusive`, held for that change only). The folder's
    bytes in use are a small ledger beside the marker (`USAGE_NAME`, with the longest lifetime
    any writer of the folder promised, which every owner's eviction honours), under the lock;
    when a put would pass the capacity by it, the store rescans the folder under the lock (every
    owner's files, ages from their headers, last access from their mtimes) and evicts by the
    order above, so no owner evicts another's young entry. Reads take no lock: a file deleted
    while read is read whole (the open file keeps its bytes), one deleted before is a miss. A
    lookup of a key the index lacks looks in the folder (another owner may have written it).
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
        check_fingerprint(fingerprint)
        self.root = Path(root)
        self._folder: StoreFolder = claim_folder(self.root, kind=STORE_KIND,
                                                 version=FORMAT_VERSION)
        self._dir = self._folder.fd  # the folder opened: every path below is relative to it
        opened = os.fstat(self._dir)
        self._identity = (opened.st_dev, opened.st_ino)
        self._disabled: str | None = None  # why the folder is no longer ours, once it is not
        self.capacity_bytes = capacity_bytes
        self.min_lifetime_s = float(min_lifetime_s)
        self.fingerprint = bytes(fingerprint)
        self.clock = clock
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._others = 0  # entries of the index that are another model's
        self._generation = -1  # the ledger's generation this index reflects (-1: none yet)
        self._lifetime_s = self.min_lifetime_s  # what eviction honours: the folder's, if longer
        self._n = _Counters()
        self._logged: set[str] = set()  # failure kinds already logged (once each)
        try:
            with self._folder.exclusive():
                self._scan(self.clock())
                if self._index or self._read_usage() is not None:
                    self._changed(self._bytes)  # the truth now (a scan is exact)
        except BaseException:
            self._folder.close()
            raise

    # -- public ----------------------------------------------------------------------------

    def close(self) -> None:
        """Let the folder go (other owners go on); the store serves nothing after."""
        self._folder.close()

    @property
    def closed(self) -> bool:
        return not self._folder.held

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def put(self, key: str, arrays: Mapping[str, np.ndarray],
            meta: Mapping[str, Any] = NO_META, *, holder: str | None = None) -> bool:
        """Store a block; True when it is (now or already, by any owner) stored, False when
        refused (no room, or the write failed: counted in `write_errors` and logged once). A
        block is arrays only: `meta` and `holder` (the tier interface's) must be empty."""
        check_key(key)
        check_arrays(arrays)
        check_no_meta(meta, holder)
        self._check_open()
        if not self._folder_is_ours():
            self._n.refused_writes += 1
            return False
        if self._present(key):
            self._touch(key)
            return True
        payload = encode_block(arrays)
        now = self.clock()
        if HEADER_SIZE + len(payload) > self.capacity_bytes:
            self._n.refused_writes += 1
            return False
        try:
            outcome = self._write(key, payload, now)
        except OSError as e:
            self._failed("write", f"writing block {key}", e)
            self._n.refused_writes += 1
            return False
        if outcome == "full":
            self._n.refused_writes += 1
            return False
        if outcome == "present":  # another owner published it first
            if not self._present(key):
                self._n.refused_writes += 1
                return False
            self._touch(key)
            return True
        self._n.writes += 1
        return True

    def get(self, key: str, *, check: ArrayCheck | None = None) -> dict[str, np.ndarray] | None:
        """The block's arrays (fresh, writable), or None. A bad file is deleted and counted.
        `check`: the reader's own test of the arrays (names, shapes, dtypes it expects); a
        ValueError from it makes the file a counted `corrupt` miss, deleted like any bad file.
        A key the index lacks is looked for in the folder (another owner may have written it).
        """
        check_key(key)
        self._check_open()
        if not self._folder_is_ours():
            self._n.misses += 1
            return None
        try:
            verdict, arrays, entry = self._read(key)
        except FileNotFoundError:  # absent, or removed by another owner: forget it
            self._forget(key)
            self._n.misses += 1
            return None
        except OSError as e:  # unreadable (permission, a link, I/O): a miss; the file stays
            self._failed("read", f"reading block {key}", e)
            self._forget(key)
            self._n.misses += 1
            return None
        if verdict == "special":  # not a regular file: not ours to delete, never read
            self._failed("read", f"block {key}", OSError(errno.EINVAL, "not a regular file"))
            self._forget(key)
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
            self._discard(key, verdict, entry.ino)
            self._n.misses += 1
            return None
        self._index_entry(key, entry)
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
        if not self._folder_is_ours() or (key not in self._index and not self._present(key)):
            return False
        with self._folder.exclusive():
            self._remove(key)
            self._changed()
        self._n.drops += 1
        return True

    def contains(self, key: str) -> bool:
        """Whether this model's block is in the folder now (its file checked; a key the index
        lacks is looked up and indexed when another owner wrote it)."""
        check_key(key)
        self._check_open()
        return self._disabled is None and self._present(key)

    def lookup_prefix(self, keys: Iterable[str]) -> int:
        """How many leading keys are stored (headers only: no payload is read, no LRU
        change)."""
        keys = list(keys)
        for key in keys:
            check_key(key)
        self._check_open()
        n = 0
        for key in keys:
            if self._disabled is not None or not self._present(key):
                break
            n += 1
        return n

    def stats(self) -> KVStoreStats:
        return KVStoreStats(entries=len(self._index) - self._others, bytes=self._bytes,
                            capacity=self.capacity_bytes, disabled=self._disabled is not None,
                            others=self._others, **asdict(self._n))

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

    def _index_entry(self, key: str, entry: _Entry, *, adopted: bool = True) -> None:
        """Index (or re-index) `key` as `entry`; a key new to the index and not written here
        (`adopted`) is another owner's."""
        old = self._index.get(key)
        if old is not None and old.ino == entry.ino:
            return
        if old is None and adopted:
            self._n.adopted += 1
        self._forget(key)
        self._index[key] = entry
        self._bytes += entry.size
        self._others += not entry.ours

    def _forget(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
            self._others -= not entry.ours

    def _present(self, key: str) -> bool:
        """Whether this model's block is at its path now: a stat for an indexed key (same
        inode), the header for a key the index lacks (indexed when it is this model's)."""
        if self._disabled is not None:
            return False
        entry = self._index.get(key)
        try:
            with self._shard(key) as shard:
                st = os.stat(f"{key}.blk", dir_fd=shard, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    self._forget(key)
                    return False
                if entry is not None and entry.ino == st.st_ino:
                    return entry.ours
                with open(os.open(f"{key}.blk", _READ_FLAGS, dir_fd=shard), "rb") as f:
                    st = os.fstat(f.fileno())
                    verdict, header = check_header(f.read(HEADER_SIZE), key, self.fingerprint,
                                                    st.st_size)
        except OSError:  # absent (or unreadable: get counts it)
            self._forget(key)
            return False
        if header is None or not stat.S_ISREG(st.st_mode):  # found bad by get, not here
            self._forget(key)
            return False
        self._index_entry(key, _Entry(st.st_size, header.created_at, st.st_ino))
        return True

    def _plan_eviction(self, size: int, now: float) -> list[str] | None:
        """Keys to evict so that `size` more bytes fit, or None when it cannot fit: entries of
        unknown age first, then those at least the lifetime old (min_lifetime_s, or the longer
        one of another owner that wrote here), least recently used first."""
        if size > self.capacity_bytes:
            return None
        need = self._bytes + size - self.capacity_bytes
        unknown = [k for k, e in self._index.items() if e.created_at > now + MAX_CLOCK_SKEW_S]
        old = [k for k, e in self._index.items()
               if now + MAX_CLOCK_SKEW_S >= e.created_at and now - e.created_at
               >= self._lifetime_s]
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
        try:  # last access is the mtime, shared by every owner; a failure only loses that hint
            with self._shard(key) as shard:
                os.utime(f"{key}.blk", (now, now), dir_fd=shard, follow_symlinks=False)
        except OSError:
            pass

    def _remove(self, key: str) -> None:
        """Forget an entry and delete its file, under the folder lock (a failed deletion is
        counted; a later scan finds the file again)."""
        self._forget(key)
        try:
            with self._shard(key) as shard:
                self._unlink(shard, f"{key}.blk")
        except FileNotFoundError:
            pass
        except OSError as e:  # the shard is a link, a file, or unreadable: nothing deleted
            self._failed("write", f"deleting {key}.blk", e)

    def _unlink(self, shard: int, name: str, ino: int | None = None) -> None:
        """Delete `name` in the open shard, only ever a regular file of ours (never a link),
        and with `ino` only that very file (not one another owner wrote since)."""
        try:
            st = os.stat(name, dir_fd=shard, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and ino in (None, st.st_ino):
                os.unlink(name, dir_fd=shard)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._failed("write", f"deleting {name}", e)

    def _discard(self, key: str, verdict: str, ino: int) -> None:
        """Delete the bad file read under `key` (that file only), under the folder lock."""
        assert verdict in ("corrupt", "truncated", "foreign"), verdict
        self._forget(key)
        try:
            with self._folder.exclusive(), self._shard(key) as shard:
                self._unlink(shard, f"{key}.blk", ino)
                self._changed()
        except OSError as e:
            self._failed("write", f"deleting {key}.blk", e)
        setattr(self._n, verdict, getattr(self._n, verdict) + 1)

    def _write(self, key: str, payload: bytes, created_at: float) -> str:
        """Write a temporary file and fsync it (no lock held), then under the folder lock make
        room and publish it under the entry's name unless a file is there already; fsync the
        shard. "written", "present" (another owner's file is there) or "full" (no room by the
        eviction rule). A crash leaves the old state or the new file whole, plus at most a
        temporary file that a scan removes once its writer's lock on it is gone."""
        header = pack_header(key, self.fingerprint, payload, created_at)
        size = HEADER_SIZE + len(payload)
        with self._shard(key, create=True) as shard:
            fd, tmp = _open_temp(shard, key)
            try:
                with open(fd, "wb", closefd=False) as f:
                    f.write(header)
                    f.write(payload)
                    f.flush()
                    os.utime(fd, (created_at, created_at))
                    os.fsync(fd)
                with self._folder.exclusive():
                    try:
                        there = os.stat(f"{key}.blk", dir_fd=shard, follow_symlinks=False)
                    except FileNotFoundError:
                        pass
                    else:  # another owner's entry, a bad file, or something not ours
                        if not stat.S_ISREG(there.st_mode):
                            raise OSError(errno.EEXIST, "not a regular file at the block's path")
                        verdict = self._header_verdict(shard, key)
                        if verdict == "ok":
                            return "present"
                        self._unlink(shard, f"{key}.blk", there.st_ino)  # bad: replaced
                        setattr(self._n, verdict, getattr(self._n, verdict) + 1)
                    usage = self._make_room(size, created_at)
                    if usage is None:
                        return "full"
                    os.replace(tmp, f"{key}.blk", src_dir_fd=shard, dst_dir_fd=shard)
                    os.fsync(shard)
                    self._index_entry(key, _Entry(size, created_at, os.fstat(fd).st_ino),
                                      adopted=False)
                    self._changed(usage + size, wrote=True)
                    return "written"
            finally:
                with contextlib.suppress(OSError):  # gone when published
                    os.unlink(tmp, dir_fd=shard)
                os.close(fd)  # lets the temporary file's lock go

    def _header_verdict(self, shard: int, key: str) -> str:
        """"ok" when the file at `key`'s path has a good header of this model's, else why not
        (corrupt / truncated / foreign); an unreadable file is "ok" (not ours to delete)."""
        try:
            with open(os.open(f"{key}.blk", _READ_FLAGS, dir_fd=shard), "rb") as f:
                verdict, _ = check_header(f.read(HEADER_SIZE), key, self.fingerprint,
                                          os.fstat(f.fileno()).st_size)
        except OSError:
            return "ok"
        return verdict

    def _make_room(self, size: int, now: float) -> int | None:
        """Under the folder lock: the folder's bytes in use once room for `size` more is made
        (evicting by the rule), or None when it cannot be. The index plans the eviction when
        no other owner changed the folder since this one's last change or scan (the ledger's
        generation says so); otherwise the folder is rescanned first (every owner's files)."""
        ledger = self._read_usage()
        if ledger is not None and ledger.bytes + size <= self.capacity_bytes:
            return ledger.bytes
        self._lifetime_s = max(self.min_lifetime_s, 0 if ledger is None else
                               ledger.lifetime_ms / 1000)
        if ledger is None or ledger.generation != self._generation:
            self._scan(now)
            self._n.rescans += 1
        victims = self._plan_eviction(size, now)
        if victims is None:
            self._changed(self._bytes)
            return None
        for victim in victims:
            self._remove(victim)
            self._n.evictions += 1
        return self._bytes

    def _changed(self, usage: int | None = None, *, wrote: bool = False) -> None:
        """Under the folder lock, after this owner changed the folder: the ledger's next
        generation (with `usage` bytes in use, else the ledger's own count), which this index
        reflects; when it `wrote` an entry, with this owner's lifetime if that is longer."""
        ledger = self._read_usage()
        if usage is None:
            if ledger is None:
                return  # no ledger yet: the next put that needs room rescans anyway
            usage = ledger.bytes
        generation = (0 if ledger is None else ledger.generation) + 1
        lifetime_ms = max(math.ceil(self.min_lifetime_s * 1000) if wrote else 0,
                          0 if ledger is None else ledger.lifetime_ms)
        if self._write_usage(_Ledger(usage, generation, lifetime_ms)):
            self._generation = generation

    def _read_usage(self) -> _Ledger | None:
        """The ledger (None when absent or damaged: then the folder is rescanned)."""
        try:
            with open(os.open(USAGE_NAME, _READ_FLAGS, dir_fd=self._dir), "rb") as f:
                raw = f.read(_USAGE.size + 1)
        except OSError:
            return None
        if len(raw) != _USAGE.size:
            return None
        value, generation, lifetime_ms, check = _USAGE.unpack(raw)
        if check != value ^ generation ^ lifetime_ms ^ _USAGE_CHECK:
            return None
        return _Ledger(value, generation, lifetime_ms)

    def _write_usage(self, ledger: _Ledger) -> bool:
        """Overwrite the ledger in place (32 bytes), under the lock; a damaged ledger only
        costs a rescan (and the lifetimes of owners that wrote before it). False when the write
        failed (counted)."""
        raw = _USAGE.pack(ledger.bytes, ledger.generation, ledger.lifetime_ms,
                          ledger.bytes ^ ledger.generation ^ ledger.lifetime_ms ^ _USAGE_CHECK)
        try:
            fd = os.open(USAGE_NAME, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=self._dir)
            try:
                os.pwrite(fd, raw, 0)
            finally:
                os.close(fd)
        except OSError as e:
            self._failed("write", "writing the usage ledger", e)
            return False
        return True

    def _read(self, key: str) -> tuple[str, dict[str, np.ndarray] | None, _Entry | None]:
        """("ok", arrays, entry) or (verdict, None, entry) with verdict one of corrupt /
        truncated / foreign, or special (not a regular file; never read, so a FIFO or device
        cannot block or feed it). `entry`: the file read (size, created_at, inode)."""
        name = f"{key}.blk"
        with self._shard(key) as shard:
            if not stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
                return "special", None, None
            with open(os.open(name, _READ_FLAGS, dir_fd=shard), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
                    return "special", None, None
                size = st.st_size
                verdict, header = check_header(f.read(HEADER_SIZE), key, self.fingerprint, size)
                if header is None:
                    return verdict, None, _Entry(size, 0.0, st.st_ino)
                entry = _Entry(size, header.created_at, st.st_ino)
                payload = bytearray(header.payload_len)
                if f.readinto(payload) != header.payload_len:
                    return "truncated", None, entry
        if hashlib.sha256(payload).digest() != header.payload_sha256:
            return "corrupt", None, entry
        try:
            return "ok", decode_block(payload), entry
        except ValueError:
            return "corrupt", None, entry

    def _scan(self, now: float) -> None:
        """Rebuild the index from the folder, under its lock (payloads are verified on get).
        Temporary files whose writer is gone (no lock on them) are removed; bad entry files are
        deleted and counted; another model's entries are indexed as others' (kept); anything
        that is not a regular file at an entry's path (other names, links, folders, FIFOs) is
        left alone, and no link is followed. A file already indexed under the same inode keeps
        its header's facts. Order: last access (max of created_at and mtime, which every owner
        sets on a hit), ties in the index's order; an entry stamped in the future (beyond the
        skew) is first: of unknown age, it is the first evicted."""
        found: list[tuple[float, int, str, _Entry]] = []
        for shard_name in self._listing(self._dir, "the store folder"):
            if not _SHARD_RE.fullmatch(shard_name):
                continue
            try:
                with _opened_dir(shard_name, self._dir, create=False) as shard:
                    found += self._scan_shard(shard, shard_name, now)
            except OSError:  # not a folder, or a link: not ours, left alone
                continue
        self._index.clear()
        self._bytes = self._others = 0
        for _, _, key, entry in sorted(found, key=lambda t: (t[0], t[1], t[2])):
            self._index[key] = entry
            self._bytes += entry.size
            self._others += not entry.ours

    def _scan_shard(self, shard: int, shard_name: str,
                    now: float) -> list[tuple[float, int, str, _Entry]]:
        found = []
        rank = {k: i for i, k in enumerate(self._index)}
        for name in self._listing(shard, shard_name):
            try:
                st = os.stat(name, dir_fd=shard, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if _TMP_RE.fullmatch(name):
                self._remove_abandoned(shard, name)
                continue
            key = name[:-4]
            if not (name.endswith(".blk") and is_key(key)):
                continue
            if key[:2] != shard_name:  # misplaced: get() would never find it
                self._unlink(shard, name)
                self._n.corrupt += 1
                continue
            known = self._index.get(key)
            if known is not None and known.ino == st.st_ino and known.size == st.st_size:
                entry = known
            else:
                entry = self._scan_header(shard, name, key)
                if entry is None:
                    continue
            last_access = max(entry.created_at, st.st_mtime)
            if entry.created_at > now + MAX_CLOCK_SKEW_S:
                last_access = -math.inf
            found.append((last_access, rank.get(key, len(rank)), key, entry))
        return found

    def _scan_header(self, shard: int, name: str, key: str) -> _Entry | None:
        """The entry of file `name` from its header; None when it is unreadable, or bad (then
        deleted and counted). Another model's file is an entry of others'."""
        try:
            with open(os.open(name, _READ_FLAGS, dir_fd=shard), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    return None
                buf = f.read(HEADER_SIZE)
        except OSError as e:
            self._failed("read", f"scanning {name}", e)
            return None
        verdict, header = check_header(buf, key, self.fingerprint, st.st_size)
        if verdict == "foreign":  # another model's (a sibling engine's) entry: kept, not served
            _, theirs = check_header(buf, key, buf[FINGERPRINT_SPAN], st.st_size)
            if theirs is not None:
                return _Entry(st.st_size, theirs.created_at, st.st_ino, ours=False)
        if header is None:
            self._unlink(shard, name, st.st_ino)
            setattr(self._n, verdict, getattr(self._n, verdict) + 1)
            return None
        return _Entry(st.st_size, header.created_at, st.st_ino)

    def _remove_abandoned(self, shard: int, name: str) -> None:
        """Delete a temporary file whose writer is gone: a live writer holds a lock on it from
        its creation to its publication (`_open_temp`), a killed one's lock went with it."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=shard)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer is alive and writing
            os.close(fd)
            return
        try:
            st = os.fstat(fd)
            self._unlink(shard, name, st.st_ino)
        finally:
            os.close(fd)

    def _listing(self, folder: int, what: str) -> list[str]:
        try:
            return sorted(os.listdir(folder))
        except OSError as e:
            self._failed("read", f"listing {what}", e)
            return []


def _open_temp(shard: int, key: str) -> tuple[int, str]:
    """A new temporary file for `key` in the open shard, locked (flock) by this writer until it
    is closed: a scan removes a temporary file only when it can take that lock (its writer is
    gone). A file a scan removed between its creation and the lock is made again."""
    for _ in range(3):
        tmp = f".{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=shard)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink > 0:
                return fd, tmp
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, "temporary files were removed while being created")


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


