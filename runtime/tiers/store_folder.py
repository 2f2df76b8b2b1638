"""A folder the runtime owns: marked on first use, held by one owner at a time.

The runtime only ever deletes what it created, so a store folder says that it is one: a small
marker file (`MARKER_NAME`, JSON with the store kind and its format version) written when the
folder is first used. A folder that holds anything and has no marker is refused (it may be a
user's folder); a marker of another kind or version is refused too.

One owner per folder: the owner holds an exclusive advisory lock (`fcntl.flock`) on the folder
itself for as long as it is open, so a second owner (another process, or a second store object in
this one) gets `StoreBusyError` instead of sharing an in-memory index it cannot see. The lock
goes with the process: a killed owner leaves no stale lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import weakref
from pathlib import Path

MARKER_NAME = "DSV41-STORE.json"
_MARKER_TMP = f".{MARKER_NAME}.tmp"


class StoreFolderError(ValueError):
    """The folder cannot be used as a store (a file, a user's folder, another kind or version,
    not writable to mark)."""


class StoreBusyError(StoreFolderError):
    """Another owner holds the folder."""


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
        names = [n for n in os.listdir(root) if n != _MARKER_TMP]
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
    tmp = root / _MARKER_TMP
    data = json.dumps(_marker_doc(kind, version), sort_keys=True).encode() + b"\n"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, root / MARKER_NAME)
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be marked as a store "
                               f"({e.strerror}); it must be writable on first use.") from e


class FolderLock:
    """The exclusive hold on a marked store folder; `close()` (or garbage collection) lets go."""

    def __init__(self, root: Path, fd: int):
        self.root = root
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    @property
    def fd(self) -> int:
        """The folder, open (O_DIRECTORY): the lock is on it, and a store opens every path in
        it relative to this descriptor (`dir_fd`), so its I/O stays in the folder it claimed."""
        assert self.held, "the folder lock is closed"
        return self._fd

    def close(self) -> None:
        self._finalizer()  # closing the descriptor releases the flock


def claim_folder(root: str | os.PathLike, *, kind: str, version: int) -> FolderLock:
    """Create (if needed), lock and mark `root` as a store of this kind and version.

    StoreBusyError when another owner holds it; StoreFolderError when it is a file, a non-empty
    folder without the marker, a store of another kind or version, or cannot be created."""
    root = Path(root)
    check_folder(root, kind=kind, version=version)  # refuses before creating anything
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise StoreFolderError(f"Store folder {root} cannot be created or opened "
                               f"({e.strerror}).") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StoreBusyError(
                f"Store folder {root} is in use by another owner (another process, or another "
                "open store in this one); one owner per folder. Close it first or use another "
                "folder.") from e
        raise StoreFolderError(f"Store folder {root} cannot be locked ({e.strerror}).") from e
    try:  # checked again under the lock: the folder may have changed since
        if not check_folder(root, kind=kind, version=version):
            _write_marker(root, kind=kind, version=version)
    except BaseException:
        os.close(fd)
        raise
    return FolderLock(root, fd)
