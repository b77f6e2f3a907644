"""The FUSE file system (pyfuse3, asyncio): one data set version, read-only, plus ``.out``.

What a mount shows
------------------
- The data set's tree, read-only (writes: ``EROFS``), with the sizes, permission bits
  and mtimes that were put; owner and group are the mounting user's. Data never
  changes, so entries and attributes are cached by the kernel for an hour and file
  pages stay in the page cache across opens (``keep_cache``).
- ``.out/``: the writable area (see ``outputs.py``), never cached by the kernel.
- ``.chunkfs-stats``: a JSON snapshot of the mount's counters, made at each open.
  Both names shadow entries of the same name at the data set's root.

Inode numbers are assigned on first sight of a path and stay the same for the life of
the mount (the mapping is never forgotten: ~200 bytes per path seen).

This is the only place where errors become errno: ``NotFound``/``NoSuchObject`` →
ENOENT, ``CorruptData`` and ``StoreUnavailable`` (after the reader's deadline) → EIO,
each EIO logged with its cause; Python ``OSError``s (from ``.out``) keep their errno.
Blocking work (manifest pages, chunk reads, uploads) runs in the event loop's default
executor, so a slow store never stalls other requests.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import json
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar, cast

import pyfuse3

from hypermesh.chunkfs.fetch import FileReader, PagePush, Readahead
from hypermesh.chunkfs.format import Entry, Root
from hypermesh.chunkfs.manifest import Manifest
from hypermesh.chunkfs.outputs import Outputs, OutStat
from hypermesh.chunkfs.pagepush import PagePusher
from hypermesh.errors import HypermeshError, NotFound, UsageError

log = logging.getLogger(__name__)

OUT = ".out"
STATS = ".chunkfs-stats"
DATA_TIMEOUT = 3600.0  # seconds the kernel may cache entries and attributes of data
BLKSIZE = 1 << 20  # st_blksize: tools size their buffers by it
DIR_BATCH = 256  # directory entries taken from the manifest per thread hop
T = TypeVar("T")
P = ParamSpec("P")


def errno_of(exc: BaseException) -> int:
    """The errno a FUSE reply carries for ``exc``."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, NotFound):
        return errno.ENOENT
    if isinstance(exc, UsageError):
        return errno.EINVAL
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO


def _fuse_errors(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Turn what an operation raises into a ``FUSEError``; log every EIO with its cause."""

    @functools.wraps(fn)
    async def op(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            code = errno_of(exc)
            if code == errno.EIO:
                if isinstance(exc, HypermeshError | OSError):
                    log.error("EIO from %s: %s: %s", fn.__name__, type(exc).__name__, exc)
                else:
                    log.exception("EIO from %s: unexpected error", fn.__name__)
            raise pyfuse3.FUSEError(code) from exc

    return op


def _thread(fn: Callable[..., T], *args: Any) -> Awaitable[T]:
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


@dataclass
class _DataFile:
    entry: Entry
    readahead: Readahead
    push: PagePush | None = None


@dataclass
class _Listing:
    """An open directory: the position reached and the stream it came from."""

    path: str
    pos: int = 0
    names: Iterator[tuple[str, Entry | OutStat | None]] | None = None
    pending: list[tuple[str, Entry | OutStat | None]] = field(default_factory=list)


class ChunkFS(pyfuse3.Operations):
    """pyfuse3 operations over a ``Manifest``, a ``FileReader`` and an ``Outputs`` area.

    State changes only through FUSE requests (inode and handle tables) and the
    components it holds; ``stats`` is a callable the mount provides for ``.chunkfs-stats``.
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        root: Root,
        manifest: Manifest,
        files: FileReader,
        outputs: Outputs | None,
        stats: Callable[[], dict[str, Any]],
        *,
        readahead: tuple[int, int, int] = (4 << 20, 64 << 20, 8 << 20),
        pusher: PagePusher | None = None,
    ) -> None:
        super().__init__()
        self.root = root
        self.manifest = manifest
        self.files = files
        self.outputs = outputs
        self.stats = stats
        self.readahead = readahead
        self.pusher = pusher
        self.uid, self.gid = os.getuid(), os.getgid()
        self._lock = threading.Lock()
        self._ino: dict[str, int] = {"": pyfuse3.ROOT_INODE}
        self._path: dict[int, str] = {pyfuse3.ROOT_INODE: ""}
        self._entries: dict[int, Entry] = {pyfuse3.ROOT_INODE: manifest.root_entry}
        self._next_ino = itertools.count(pyfuse3.ROOT_INODE + 1)
        self._handles: dict[int, Any] = {}
        self._next_fh = itertools.count(1)

    # ---------------------------------------------------------------- inodes
    def _inode(self, path: str) -> int:
        with self._lock:
            ino = self._ino.get(path)
            if ino is None:
                ino = self._ino[path] = next(self._next_ino)
                self._path[ino] = path
            return ino

    def _path_of(self, inode: int) -> str:
        try:
            return self._path[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    @staticmethod
    def _out_path(path: str) -> str | None:
        """The path inside ``.out`` if ``path`` is there, else None."""
        if path == OUT:
            return ""
        return path[len(OUT) + 1 :] if path.startswith(OUT + "/") else None

    @staticmethod
    def _join(parent: str, name: str) -> str:
        return f"{parent}/{name}" if parent else name

    # ------------------------------------------------------------- attributes
    def _data_attr(self, ino: int, entry: Entry) -> pyfuse3.EntryAttributes:
        attr = self._base_attr(ino, DATA_TIMEOUT)
        if entry.kind == "d":
            attr.st_mode = stat.S_IFDIR | entry.mode
            attr.st_nlink = 2
        elif entry.kind == "l":
            attr.st_mode = stat.S_IFLNK | 0o777
            attr.st_size = len(os.fsencode(entry.target))
        else:
            attr.st_mode = stat.S_IFREG | entry.mode
            attr.st_size = entry.size
        attr.st_blocks = (attr.st_size + 511) // 512
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = entry.mtime_ns
        return attr

    def _out_attr(self, ino: int, st: OutStat) -> pyfuse3.EntryAttributes:
        attr = self._base_attr(ino, 0)
        attr.st_mode = (stat.S_IFDIR | 0o755) if st.kind == "d" else (stat.S_IFREG | 0o644)
        attr.st_nlink = 2 if st.kind == "d" else 1
        attr.st_size = st.size
        attr.st_blocks = (st.size + 511) // 512
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = st.mtime_ns
        return attr

    def _stats_attr(self, ino: int) -> pyfuse3.EntryAttributes:
        attr = self._base_attr(ino, 0)
        attr.st_mode = stat.S_IFREG | 0o444
        attr.st_mtime_ns = attr.st_ctime_ns = attr.st_atime_ns = self.root.created_ns
        return attr

    def _base_attr(self, ino: int, timeout: float) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ino
        attr.entry_timeout = attr.attr_timeout = timeout
        attr.st_nlink = 1
        attr.st_uid, attr.st_gid = self.uid, self.gid
        attr.st_blksize = BLKSIZE
        return attr

    def _attr_of(self, path: str) -> pyfuse3.EntryAttributes:
        """Attributes of a mount path (blocking: may ask the manifest or the store)."""
        out = self._out_path(path) if self.outputs else None
        if out is not None:
            assert self.outputs is not None
            st = self.outputs.stat(out)
            if st is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._out_attr(self._inode(path), st)
        if path == STATS:
            return self._stats_attr(self._inode(path))
        known = self._ino.get(path)
        entry = self._entries.get(known) if known is not None else None
        if entry is None:
            entry = self.manifest.lookup(path)
            if entry is None:
                raise pyfuse3.FUSEError(errno.ENOENT)  # no inode for what does not exist
        ino = self._inode(path)
        self._entries.setdefault(ino, entry)
        return self._data_attr(ino, entry)

    def _entry(self, inode: int) -> Entry:
        entry = self._entries.get(inode)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return entry

    # ------------------------------------------------------------ name space
    @_fuse_errors
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        parent = self._path_of(parent_inode)
        text = os.fsdecode(name)
        if text == ".":
            path = parent
        elif text == "..":
            path = parent.rpartition("/")[0]
        else:
            path = self._join(parent, text)
        known = self._ino.get(path)
        if known is not None and known in self._entries:  # seen before: no thread hop
            return self._data_attr(known, self._entries[known])
        return await _thread(self._attr_of, path)

    @_fuse_errors
    async def getattr(
        self, inode: int, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        path = self._path_of(inode)
        if inode in self._entries:
            return self._data_attr(inode, self._entries[inode])
        return await _thread(self._attr_of, path)

    @_fuse_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        entry = self._entry(inode)
        if entry.kind != "l":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(entry.target)

    @_fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = BLKSIZE
        st.f_blocks = (self.root.bytes + BLKSIZE - 1) // BLKSIZE
        st.f_bfree = st.f_bavail = 0
        st.f_files = self.root.files + self.root.dirs + 1
        st.f_ffree = st.f_favail = 0
        st.f_namemax = 255
        return st

    # ------------------------------------------------------------ directories
    @_fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self._path_of(inode)
        out = self._out_path(path) if self.outputs else None
        if out is None and self._entry(inode).kind != "d":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = next(self._next_fh)
        self._handles[fh] = _Listing(path)
        return fh

    def _stream(self, path: str) -> Iterator[tuple[str, Entry | OutStat | None]]:
        """(name, what) of a directory's children; ``what`` None means ask later."""
        out = self._out_path(path) if self.outputs else None
        if out is not None:
            assert self.outputs is not None
            for name, kind in self.outputs.listdir(out):
                yield name, OutStat(kind, 0, self.outputs.started_ns)
            return
        if path == "":
            if self.outputs is not None:
                yield OUT, None
            yield STATS, None
        for entry in self.manifest.listdir(path):
            if path == "" and entry.name in (OUT, STATS):
                continue
            yield entry.name, entry

    def _take(self, listing: _Listing, start: int) -> list[tuple[str, Entry | OutStat | None]]:
        """The next batch of children from position ``start`` (blocking)."""
        if listing.names is None or start != listing.pos:
            listing.names, listing.pending = self._stream(listing.path), []
            listing.pos = 0
            for _ in itertools.islice(listing.names, start):
                listing.pos += 1
        if not listing.pending:
            listing.pending = list(itertools.islice(listing.names, DIR_BATCH))
        return listing.pending

    @_fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        listing: _Listing = self._handles[fh]
        while True:
            batch = await _thread(self._take, listing, start_id)
            if not batch:
                return
            while batch:
                name, what = batch[0]
                path = self._join(listing.path, name)
                ino = self._inode(path)
                if isinstance(what, Entry):
                    self._entries.setdefault(ino, what)
                    attr = self._data_attr(ino, what)
                elif isinstance(what, OutStat):
                    attr = self._out_attr(ino, what)
                else:
                    attr = await _thread(self._attr_of, path)
                if not pyfuse3.readdir_reply(token, os.fsencode(name), attr, listing.pos + 1):
                    return
                batch.pop(0)
                listing.pos += 1
                start_id = listing.pos

    @_fuse_errors
    async def releasedir(self, fh: int) -> None:
        self._handles.pop(fh, None)

    # ------------------------------------------------------------------ files
    @_fuse_errors
    async def open(
        self, inode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.FileInfo:
        path = self._path_of(inode)
        write = flags & os.O_ACCMODE != os.O_RDONLY
        out = self._out_path(path) if self.outputs else None
        fh = next(self._next_fh)
        if out is not None:
            assert self.outputs is not None
            handle = await _thread(self.outputs.open, out, write, bool(flags & os.O_TRUNC))
            self._handles[fh] = ("out", handle)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=False)
        if write:
            raise pyfuse3.FUSEError(errno.EROFS)
        if path == STATS:
            data = (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()
            self._handles[fh] = ("stats", data)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        entry = self._entry(inode)
        if entry.kind != "f":
            raise pyfuse3.FUSEError(errno.EISDIR if entry.kind == "d" else errno.ELOOP)
        readahead = Readahead(*self.readahead)
        push = None
        if self.pusher is not None:
            push = self.pusher.bind(inode, lambda: readahead.asked_end)
        self._handles[fh] = _DataFile(entry, readahead, push)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    @_fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles[fh]
        if isinstance(handle, _DataFile):
            cached = self.files.read_cached(handle.entry, off, size)
            if cached is not None:  # a small file's bytes already here: no thread hop
                return cached
            # bytes, or a memoryview into a fetched run: pyfuse3 replies from any buffer
            # (its stub says bytes)
            return cast(bytes, await _thread(
                self.files.read, handle.entry, off, size, handle.readahead, handle.push
            ))
        kind, value = handle
        if kind == "stats":
            return bytes(value[off : off + size])
        assert self.outputs is not None
        return await _thread(self.outputs.read, value, off, size)

    @_fuse_errors
    async def flush(self, fh: int) -> None:
        handle = self._handles.get(fh)
        if isinstance(handle, tuple) and handle[0] == "out":
            assert self.outputs is not None
            await _thread(self.outputs.flush, handle[1])

    @_fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.flush(fh)

    @_fuse_errors
    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, tuple) and handle[0] == "out":
            assert self.outputs is not None
            await _thread(self.outputs.release, handle[1])

    # ----------------------------------------------------------- writing (.out)
    def _out_target(self, parent_inode: int, name: bytes) -> tuple[str, str]:
        """(mount path, path inside .out) of a new name, or EROFS outside ``.out``."""
        path = self._join(self._path_of(parent_inode), os.fsdecode(name))
        out = self._out_path(path) if self.outputs else None
        if out is None or out == "":
            raise pyfuse3.FUSEError(errno.EROFS)
        return path, out

    @_fuse_errors
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path, out = self._out_target(parent_inode, name)
        assert self.outputs is not None
        handle = await _thread(self.outputs.create, out)
        fh = next(self._next_fh)
        self._handles[fh] = ("out", handle)
        attr = self._out_attr(self._inode(path), OutStat("f", 0, self.outputs.started_ns))
        return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=False), attr

    @_fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handles.get(fh)
        if not (isinstance(handle, tuple) and handle[0] == "out"):
            raise pyfuse3.FUSEError(errno.EROFS)
        assert self.outputs is not None
        return await _thread(self.outputs.write, handle[1], off, buf)

    @_fuse_errors
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self._path_of(inode)
        out = self._out_path(path) if self.outputs else None
        if out is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        assert self.outputs is not None
        if fields.update_size:
            handle = self._handles.get(fh) if fh is not None else None
            out_fh = handle[1] if isinstance(handle, tuple) and handle[0] == "out" else None
            await _thread(self.outputs.truncate, out, attr.st_size, out_fh)
        return await _thread(self._attr_of, path)  # modes and times are not kept

    @_fuse_errors
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path, out = self._out_target(parent_inode, name)
        assert self.outputs is not None
        await _thread(self.outputs.mkdir, out)
        return await _thread(self._attr_of, path)

    @_fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        _path, out = self._out_target(parent_inode, name)
        assert self.outputs is not None
        await _thread(self.outputs.unlink, out)

    @_fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        _path, out = self._out_target(parent_inode, name)
        assert self.outputs is not None
        await _thread(self.outputs.rmdir, out)

    @_fuse_errors
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        _old, out_old = self._out_target(parent_inode_old, name_old)
        _new, out_new = self._out_target(parent_inode_new, name_new)
        assert self.outputs is not None
        await _thread(self.outputs.rename, out_old, out_new)

    @_fuse_errors
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._out_target(parent_inode, name)
        raise pyfuse3.FUSEError(errno.EPERM)  # .out holds files and directories only

    @_fuse_errors
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._out_target(new_parent_inode, new_name)
        raise pyfuse3.FUSEError(errno.EPERM)

    @_fuse_errors
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._out_target(parent_inode, name)
        raise pyfuse3.FUSEError(errno.EPERM)

