"""A folder the runtime owns: marked on first use, shared by any number of processes.

The runtime only ever deletes what it created, so a store folder says that it is one: a small
marker file (`MARKER_NAME`, JSON with the store kind and its format version) written when the
folder is first used. A folder that holds anything and has no marker is refused (it may be a
user's folder); a marker of another kind or version is refused too. Two processes marking one
new folder at once agree: each writes its own temporary marker and links it to the marker's
name; the second link finds the first one's marker and reads it.

Several owners per folder (processes, or store objects in one process): each opens the folder as
a directory descriptor (`StoreFolder.fd`) and takes the folder's exclusive advisory lock
(`fcntl.flock` on that descriptor) only for as long as a change that others must not interleave
takes (`StoreFolder.exclusive`: publishing a file, evicting, deleting). The lock goes with the
descriptor: a killed owner leaves no stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import weakref
from collections.abc import Iterator
from pathlib import Path

MARKER_NAME = "DSV41-STORE.json"
_MARKER_TMP_RE = re.compile(r"\.DSV41-STORE\.json\.[0-9a-f]{16}\.tmp")  # a marker being written


class StoreFolderError(ValueError):
    """The folder cannot be used as a store (a file, a user's folder, another kind or version,
    not writable to mark)."""


def _marker_doc(kind: str, version: int) -> dict:
    return {"kind": kind, "version": version}


def check_folder(root: str | os.PathLike, *, kind: str, version: int) -> bool:
    """Whether `root` can be used as a store of this kind and version, without changing
    anything: False when it does not exist yet or is empty, True when it is such a store;
    `StoreFolderError` otherwise."""
    root = Path(root)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be read ({e.strerror}).") from e
    if not stat.S_ISDIR(st.st_mode):
        raise StoreFolderError(f"Store folder {root} exists and is not a directory.")
    marker = root / MARKER_NAME
    try:
        names = [n for n in os.listdir(root) if not _MARKER_TMP_RE.fullmatch(n)]
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be listed ({e.strerror}).") from e
    if MARKER_NAME not in names:
        if names:
            raise StoreFolderError(
                f"Folder {root} is not empty and is not a dsv41 store (it has no {MARKER_NAME}); "
                "refusing to use it, since the store deletes files it finds there. Choose a "
                "new or empty folder.")
        return False
    _read_marker(marker, kind=kind, version=version)
    return True


def _read_marker(marker: Path, *, kind: str, version: int) -> None:
    try:
        st = os.lstat(marker)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            raise StoreFolderError(f"{marker} is not a store marker (not a small regular file).")
        doc = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFolderError(f"Store marker {marker} is unreadable ({e}).") from e
    if not isinstance(doc, dict) or doc.get("kind") != kind:
        raise StoreFolderError(f"{marker.parent} is not a {kind} folder (its marker says "
                               f"{doc!r}).")
    if doc.get("version") != version:
        raise StoreFolderError(f"{marker.parent} holds a {kind} of format version "
                               f"{doc.get('version')!r}; this runtime reads version {version}. "
                               "Use another folder.")


def _write_marker(root: Path, *, kind: str, version: int) -> None:
    """Write the marker under a name of this writer's own, then link it to MARKER_NAME: the
    first link wins, a second writer finds the first one's marker (EEXIST) and reads it."""
    tmp = root / f".{MARKER_NAME}.{os.urandom(8).hex()}.tmp"
    data = json.dumps(_marker_doc(kind, version), sort_keys=True).encode() + b"\n"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, root / MARKER_NAME, follow_symlinks=False)
        except FileExistsError:  # another process marked it first: its marker must agree
            _read_marker(root / MARKER_NAME, kind=kind, version=version)
        finally:
            os.unlink(tmp)
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be marked as a store "
                               f"({e.strerror}); it must be writable on first use.") from e


class StoreFolder:
    """A marked store folder, open; `close()` (or garbage collection) lets it go."""

    def __init__(self, root: Path, fd: int):
        self.root = root
        self._fd = fd
        self._depth = 0  # nesting of exclusive(): the lock is taken by the outermost only
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        """Whether the folder is still open here."""
        return self._finalizer.alive

    @property
    def fd(self) -> int:
        """The folder, open (O_DIRECTORY): a store opens every path in it relative to this
        descriptor (`dir_fd`), so its I/O stays in the folder it opened; the lock is on it."""
        assert self.held, "the store folder is closed"
        return self._fd

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the folder's exclusive lock for the block (waiting for another holder's brief
        change to end); nested use in one owner takes it once."""
        fd = self.fd
        if self._depth == 0:
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._finalizer()  # closing the descriptor releases a lock still held


def claim_folder(root: str | os.PathLike, *, kind: str, version: int) -> StoreFolder:
    """Create (if needed), open and mark `root` as a store of this kind and version; any number
    of owners may hold it at once.

    StoreFolderError when it is a file, a non-empty folder without the marker, a store of another
    kind or version, or cannot be created."""
    root = Path(root)
    check_folder(root, kind=kind, version=version)  # refuses before creating anything
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be created or opened "
                               f"({e.strerror}).") from e
    folder = StoreFolder(root, fd)
    try:  # checked again under the lock: the folder may have changed since
        with folder.exclusive():
            if not check_folder(root, kind=kind, version=version):
                _write_marker(root, kind=kind, version=version)
    except OSError as e:
        folder.close()
        raise StoreFolderError(f"Store folder {root} cannot be locked ({e.strerror}).") from e
    except BaseException:
        folder.close()
        raise
    return folder
