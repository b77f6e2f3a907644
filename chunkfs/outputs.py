"""The writable area of a mount, ``MOUNTPOINT/.out/``: results and checkpoints.

What it guarantees (close-to-open, like NFS)
--------------------------------------------
- A file written under ``.out`` is staged in a local directory while it is open. When
  ``close()`` (FUSE flush/release) or ``fsync()`` returns without error, its whole
  content is stored in the object store under ``outputs/<path>`` — durable, and
  visible to every other mount of the same store from then on. A failed upload
  (after retrying transient errors for ``retry_s``) is an error of that close/fsync.
- ``stat``, ``open`` and listings under ``.out`` ask the store every time (no stale
  cache), so a mount sees what another mount closed before it looked.
- An upload replaces the object atomically: readers see the old file or the new one.

What it does not do: share a file being written between mounts (the last close wins),
locking, hard links, symlinks, permissions beyond the mode bits shown, or mtimes
other than "when this mount saw it" (``mtime_ns`` of the mount's start for stored
files). Directories are objects ``outputs/<dir>/.chunkfs-dir`` (created by ``mkdir``);
a prefix with objects under it counts as a directory too. Renames copy and delete
(fine for checkpoints, slow for huge trees).

Paths here are relative to ``.out`` (``""`` is ``.out`` itself). Errors are Python's
own ``OSError`` subclasses (``FileNotFoundError``, ``FileExistsError``, …) or hypermesh
store errors; ``fs.py`` turns them into errno. Thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hypermesh.chunkfs.store import ObjectStore, retry_transient
from hypermesh.errors import NoSuchObject

log = logging.getLogger(__name__)

PREFIX = "outputs/"
MARKER = ".chunkfs-dir"
READ_WINDOW = 4 << 20  # bytes fetched per ranged GET when reading a stored file
T = TypeVar("T")


@dataclass(frozen=True)
class OutStat:
    """What ``stat`` knows of a path: ``kind`` ``"f"`` or ``"d"``, size, mtime."""

    kind: str
    size: int
    mtime_ns: int


@dataclass
class _Staged:
    """A file open for writing on this mount: its local copy. Guarded by ``lock``."""

    path: str
    local: Path
    refs: int = 0
    dirty: bool = False
    deleted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Handle:
    path: str
    staged: _Staged | None  # writing (or reading a file being written here)
    size: int = 0  # of the stored object, when reading it from the store
    buf: tuple[int, bytes] = (0, b"")  # the last window read: (offset, bytes)


def _key(path: str) -> str:
    return PREFIX + path


def _check_name(path: str) -> None:
    if path.rpartition("/")[2] == MARKER:
        raise PermissionError(errno.EPERM, f"{MARKER} is reserved")


class Outputs:
    """The ``.out`` area over an object store (see module doc)."""

    def __init__(self, store: ObjectStore, staging: Path, *, retry_s: float = 30.0) -> None:
        self.store = store
        self.staging = Path(staging)
        self.staging.mkdir(parents=True, exist_ok=True)
        self.retry_s = retry_s
        self.started_ns = time.time_ns()
        self.uploads = 0
        self.upload_bytes = 0
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}
        self._handles: dict[int, _Handle] = {}
        self._next = 1

    def _retry(self, fn: Callable[[], T]) -> T:
        return retry_transient(fn, self.retry_s)

    # ---------------------------------------------------------------- queries
    def stat(self, path: str) -> OutStat | None:
        if path == "":
            return OutStat("d", 0, self.started_ns)
        with self._lock:
            staged = self._staged.get(path)
        if staged is not None and not staged.deleted:
            st = staged.local.stat()
            return OutStat("f", st.st_size, st.st_mtime_ns)
        size = self._retry(lambda: self.store.size(_key(path)))
        if size is not None:
            return OutStat("f", size, self.started_ns)
        if self._retry(lambda: self.store.size(_key(f"{path}/{MARKER}"))) is not None:
            return OutStat("d", 0, self.started_ns)
        keys = self._retry(lambda: next(iter(self.store.list(_key(path + "/"))), None))
        return OutStat("d", 0, self.started_ns) if keys else None

    def _need_dir(self, path: str) -> None:
        st = self.stat(path)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", path)
        if st.kind != "d":
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)

    def listdir(self, path: str) -> list[tuple[str, str]]:
        """``(name, kind)`` of the children of directory ``path``, sorted by name."""
        self._need_dir(path)
        prefix = _key(path + "/") if path else PREFIX
        children: dict[str, str] = {}
        for key in self._retry(lambda: list(self.store.list(prefix))):
            name, sep, _rest = key[len(prefix) :].partition("/")
            if name and name != MARKER:
                children[name] = "d" if sep else children.get(name, "f")
        base = path + "/" if path else ""
        with self._lock:
            for p, staged in self._staged.items():
                if p.startswith(base) and "/" not in p[len(base) :] and not staged.deleted:
                    children.setdefault(p[len(base) :], "f")
        return sorted(children.items())

    # ----------------------------------------------------------------- handles
    def _new_handle(self, handle: _Handle) -> int:
        with self._lock:
            fh = self._next
            self._next += 1
            self._handles[fh] = handle
            if handle.staged is not None:
                handle.staged.refs += 1
            return fh

    def create(self, path: str) -> int:
        """A new empty file (replacing any), open for writing."""
        _check_name(path)
        parent = path.rpartition("/")[0]
        self._need_dir(parent)
        st = self.stat(path)
        if st is not None and st.kind == "d":
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return self._new_handle(_Handle(path, self._stage(path, truncate=True)))

    def _need_file(self, path: str) -> OutStat:
        st = self.stat(path)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        if st.kind == "d":
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return st

    def open(self, path: str, write: bool, truncate: bool) -> int:
        st = self._need_file(path)
        with self._lock:
            staged = self._staged.get(path)
        if write or staged is not None:
            return self._new_handle(_Handle(path, self._stage(path, truncate=truncate)))
        return self._new_handle(_Handle(path, None, size=st.size))

    def _stage(self, path: str, truncate: bool) -> _Staged:
        """The staged copy of ``path`` (made, and filled from the store, if needed)."""
        with self._lock:
            staged = self._staged.get(path)
            if staged is None or staged.deleted:
                fd, name = tempfile.mkstemp(dir=self.staging, prefix="out-")
                os.close(fd)
                staged = self._staged[path] = _Staged(path, Path(name), dirty=truncate)
                fresh = True
            else:
                fresh = False
        with staged.lock:
            if truncate:
                os.truncate(staged.local, 0)
                staged.dirty = True
            elif fresh:
                self._download(path, staged.local)
        return staged

    def _download(self, path: str, local: Path) -> None:
        with open(local, "wb") as f:
            size = self._retry(lambda: self.store.size(_key(path))) or 0
            for start in range(0, size, 8 << 20):
                piece = functools.partial(
                    self.store.get_range, _key(path), start, min(8 << 20, size - start)
                )
                f.write(self._retry(piece))

    def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles[fh]
        if handle.staged is not None:
            with open(handle.staged.local, "rb") as f:
                return os.pread(f.fileno(), size, offset)
        end = min(offset + size, handle.size)
        if offset >= end:
            return b""
        start, buf = handle.buf
        if not start <= offset < end <= start + len(buf):
            n = min(max(READ_WINDOW, end - offset), handle.size - offset)
            start, buf = offset, self._retry(
                lambda: self.store.get_range(_key(handle.path), offset, n)
            )
            handle.buf = (start, buf)
        return buf[offset - start : end - start]

    def write(self, fh: int, offset: int, data: bytes) -> int:
        staged = self._handles[fh].staged
        if staged is None:
            raise PermissionError(errno.EBADF, "not open for writing")
        with staged.lock:
            fd = os.open(staged.local, os.O_WRONLY)
            try:
                written = os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
            staged.dirty = True
        return written

    def truncate(self, path: str, size: int, fh: int | None = None) -> None:
        handle = self._handles.get(fh) if fh is not None else None
        if handle is not None and handle.staged is not None:
            with handle.staged.lock:
                os.truncate(handle.staged.local, size)
                handle.staged.dirty = True
            return
        tmp = self.open(path, write=True, truncate=size == 0)
        try:
            self.truncate(path, size, tmp)
            self.flush(tmp)
        finally:
            self.release(tmp)

    def flush(self, fh: int) -> None:
        """Upload the file if it changed; returns when it is durable in the store."""
        handle = self._handles.get(fh)
        if handle is not None and handle.staged is not None:
            self._upload(handle.staged)

    def _upload(self, staged: _Staged) -> None:
        with staged.lock:
            if not staged.dirty or staged.deleted:
                return
            size = staged.local.stat().st_size
            self._retry(lambda: self.store.put_file(_key(staged.path), staged.local))
            staged.dirty = False
            self.uploads += 1
            self.upload_bytes += size

    def release(self, fh: int) -> None:
        """Close a handle; the last one of a staged file uploads it (if still changed)."""
        with self._lock:
            handle = self._handles.pop(fh, None)
        if handle is None or handle.staged is None:
            return
        staged = handle.staged
        try:
            self._upload(staged)
        finally:
            with self._lock:
                staged.refs -= 1
                last = staged.refs == 0
                if last and self._staged.get(staged.path) is staged:
                    del self._staged[staged.path]
            if last:
                staged.local.unlink(missing_ok=True)

    # ------------------------------------------------------------ name changes
    def mkdir(self, path: str) -> None:
        _check_name(path)
        self._need_dir(path.rpartition("/")[0])
        if self.stat(path) is not None:
            raise FileExistsError(errno.EEXIST, "exists", path)
        self._retry(lambda: self.store.put(_key(f"{path}/{MARKER}"), b""))

    def rmdir(self, path: str) -> None:
        self._need_dir(path)
        if path == "":
            raise PermissionError(errno.EBUSY, ".out itself cannot be removed")
        if self.listdir(path):
            raise OSError(errno.ENOTEMPTY, "directory not empty", path)
        self._retry(lambda: self.store.delete(_key(f"{path}/{MARKER}")))

    def unlink(self, path: str) -> None:
        self._need_file(path)
        with self._lock:
            staged = self._staged.pop(path, None)
        if staged is not None:
            with staged.lock:
                staged.deleted = True
        self._retry(lambda: self.store.delete(_key(path)))

    def rename(self, old: str, new: str) -> None:
        """Move a file or a directory tree (copy, then delete), replacing a file at ``new``."""
        _check_name(new)
        src = self.stat(old)
        if src is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", old)
        self._need_dir(new.rpartition("/")[0])
        dst = self.stat(new)
        if dst is not None and dst.kind == "d":
            if src.kind != "d":
                raise IsADirectoryError(errno.EISDIR, "is a directory", new)
            if self.listdir(new):
                raise OSError(errno.ENOTEMPTY, "directory not empty", new)
        if src.kind == "d" and (new + "/").startswith(old + "/"):
            raise OSError(errno.EINVAL, "cannot move a directory into itself", new)
        with self._lock:
            staged = self._staged.get(old)
        if staged is not None:
            self._upload(staged)
        if src.kind == "f":
            self._copy(_key(old), _key(new))
            self._retry(lambda: self.store.delete(_key(old)))
        else:
            keys = self._retry(lambda: list(self.store.list(_key(old + "/"))))
            for key in keys:
                self._copy(key, _key(new) + key[len(_key(old)) :])
            for key in keys:
                self._retry(functools.partial(self.store.delete, key))
        with self._lock:
            if staged is not None and self._staged.get(old) is staged:
                del self._staged[old]
                staged.path = new
                self._staged[new] = staged

    def _copy(self, src_key: str, dst_key: str) -> None:
        with tempfile.NamedTemporaryFile(dir=self.staging, prefix="mv-") as tmp:
            path = src_key[len(PREFIX) :]
            try:
                self._download(path, Path(tmp.name))
            except NoSuchObject:
                return
            self._retry(lambda: self.store.put_file(dst_key, tmp.name))

    def close(self) -> None:
        """Upload what is still staged (best effort) and forget the handles."""
        for fh in list(self._handles):
            with contextlib.suppress(Exception):
                self.release(fh)
