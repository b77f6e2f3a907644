"""``put_dataset``: pack a directory tree into chunks and manifest pages in a store.

The walk
--------
Entries are produced in ``(parent, name)`` order without holding the tree in memory:
directories are visited in path order from a heap (a directory's path sorts after its
parent's, so the order holds), each one's children sorted by name. Symlinks are
recorded, never followed; sockets, FIFOs and devices are skipped (logged). Hard links
are stored as separate files. File data is packed in the same order.

Where chunks are cut
--------------------
Chunk boundaries depend on each file alone, not on what came before it, so a changed
file changes only the chunk(s) that hold it (and at most the next chunk when its size
changes) and every other chunk of a new version dedups against the old one:

- A *big* file (``size >= chunk_size / 2``) gets chunks of its own: the current chunk
  is cut before it, and it is split at file offsets that are multiples of
  ``chunk_size`` (the last piece may be short).
- *Small* files are appended to the current chunk. The chunk is cut before a small file
  that would overflow ``chunk_size``, and after a small file when a number derived
  from the SHA-256 of its path, uniform in [0, 1), is below ``size / (chunk_size / 2)``:
  on average a cut every ``chunk_size / 2`` bytes, at places that are the same in every
  version (content-defined chunking at file granularity).

So every chunk is at most ``chunk_size`` bytes.

Uploads and memory
------------------
Files are read in the calling thread; each finished chunk goes to a thread pool that
hashes its blocks, names it and uploads the chunk then its block list — unless the
block list is in the store already (the block list is written last, so its presence
means the chunk is complete). At most ``parallel`` chunks are in flight, so memory is
bounded by ``(parallel + 1) * chunk_size``. Entry pages are written as they fill, and
the root last: a version becomes visible only once everything it names is stored.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from hypermesh.chunkfs import format as fmt
from hypermesh.chunkfs.format import (
    DEFAULT_CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    ChunkInfo,
    Entry,
    Extent,
    PageRef,
    Root,
)
from hypermesh.chunkfs.manifest import encode_page, encode_root, page_digest, version_name
from hypermesh.chunkfs.store import ObjectStore, retry_transient
from hypermesh.errors import FatalError, UsageError

__all__ = ["PutProgress", "block_list_of", "put_dataset", "walk_entries"]

log = logging.getLogger(__name__)

_READ_SIZE = 8 << 20
# How long one store request is retried on transient errors (refused, 5xx, timeouts)
# before the put fails: long enough to ride out an S3 server restart.
RETRY_S = 60.0
T = TypeVar("T")


@dataclass
class PutProgress:
    """Counters a ``put_dataset`` progress callback sees (updated as work is done)."""

    files: int = 0
    dirs: int = 0
    bytes_read: int = 0
    chunks: int = 0
    chunks_uploaded: int = 0
    chunks_existing: int = 0
    bytes_uploaded: int = 0
    started: float = field(default_factory=time.monotonic)


def block_list_of(data: bytes | memoryview, algo: str = fmt.BLOCK_HASH) -> bytes:
    """The concatenated block digests (with ``algo``) of a chunk's bytes."""
    view = memoryview(data)
    return b"".join(
        fmt.block_digest(view[i : i + fmt.BLOCK_SIZE], algo)
        for i in range(0, len(view), fmt.BLOCK_SIZE)
    )


# ----------------------------------------------------------------------------- walk
def walk_entries(src: Path) -> Iterator[tuple[Entry, Path | None]]:
    """Every path under ``src`` as an entry without extents, in ``(parent, name)`` order,
    with the absolute path of each regular file (None for the other kinds)."""
    pending: list[str] = [""]
    while pending:
        rel = heapq.heappop(pending)
        base = src / rel if rel else src
        try:
            with os.scandir(base) as it:
                children = sorted(it, key=lambda d: d.name)
        except OSError as exc:
            raise FatalError(f"cannot read directory {base}: {exc.strerror or exc}") from exc
        for d in children:
            try:
                st = d.stat(follow_symlinks=False)
            except OSError as exc:
                raise FatalError(f"cannot stat {d.path}: {exc.strerror or exc}") from exc
            mode = stat.S_IMODE(st.st_mode)
            child = f"{rel}/{d.name}" if rel else d.name
            if stat.S_ISDIR(st.st_mode):
                heapq.heappush(pending, child)
                yield Entry(rel, d.name, "d", mode, st.st_mtime_ns, 0), None
            elif stat.S_ISREG(st.st_mode):
                yield Entry(rel, d.name, "f", mode, st.st_mtime_ns, st.st_size), Path(d.path)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(d.path)
                yield Entry(
                    rel, d.name, "l", mode, st.st_mtime_ns, len(os.fsencode(target)), (), target
                ), None
            else:
                log.warning("put: skipping %s: not a file, directory or symlink", d.path)


def _path_fraction(path: str) -> float:
    """A number in [0, 1) fixed by ``path``: where the content-defined cuts fall."""
    digest = hashlib.sha256(os.fsencode(path)).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ----------------------------------------------------------------------------- packer
class _Packer:
    """Cuts chunks and hands them to the upload pool; owns the chunk table."""

    def __init__(
        self,
        store: ObjectStore,
        chunk_size: int,
        parallel: int,
        progress: PutProgress,
        report: Callable[[], None],
        retry_s: float,
    ) -> None:
        self.store = store
        self.retry_s = retry_s
        self.chunk_size = chunk_size
        self.progress = progress
        self.report = report
        self.buf = bytearray()
        self.table: list[ChunkInfo | None] = []
        self.futures: list[Future[None]] = []
        self.slots = threading.BoundedSemaphore(parallel)
        self.pool = ThreadPoolExecutor(parallel, thread_name_prefix="put")
        self.lock = threading.Lock()
        self.failed: BaseException | None = None

    @property
    def index(self) -> int:
        """The chunk index that bytes appended now will land in."""
        return len(self.table)

    def cut(self) -> None:
        if self.buf:
            self._submit(bytes(self.buf))
            self.buf = bytearray()

    def _submit(self, data: bytes) -> None:
        if self.failed is not None:
            raise self.failed
        index = len(self.table)
        self.table.append(None)
        self.progress.chunks += 1
        self.slots.acquire()  # bounds the chunks held in memory
        # An upload failed while we waited for the slot: start no new one, whose own
        # retries ``abort`` would have to wait out (a failed put took twice its deadline).
        if self.failed is not None:
            self.slots.release()
            raise self.failed
        try:
            future = self.pool.submit(self._upload, index, data)
        except BaseException:
            self.slots.release()
            raise
        self.futures.append(future)

    def _upload(self, index: int, data: bytes) -> None:
        try:
            blocks = block_list_of(data, fmt.BLOCK_HASH)
            cid = fmt.chunk_id(blocks, fmt.BLOCK_HASH)
            if self._retry(lambda: self.store.size(fmt.blocks_key(cid))) == len(blocks):
                with self.lock:
                    self.progress.chunks_existing += 1
            else:
                self._retry(lambda: self.store.put(fmt.chunk_key(cid), data))
                self._retry(lambda: self.store.put(fmt.blocks_key(cid), blocks))
                with self.lock:
                    self.progress.chunks_uploaded += 1
                    self.progress.bytes_uploaded += len(data)
            self.table[index] = ChunkInfo(cid, len(data))
        except BaseException as exc:
            self.failed = exc
            raise
        finally:
            self.slots.release()
        self.report()

    def _retry(self, fn: Callable[[], T]) -> T:
        return retry_transient(fn, self.retry_s)

    def add_file(self, entry: Entry, path: Path) -> Entry:
        """Pack one regular file; return its entry with extents."""
        size = entry.size
        if size == 0:
            return entry
        big = size >= self.chunk_size // 2
        extents: list[Extent] = []
        try:
            with open(path, "rb") as f:
                if big:
                    self.cut()
                    for offset in range(0, size, self.chunk_size):
                        piece = _read_exactly(f, min(self.chunk_size, size - offset), path)
                        extents.append(Extent(self.index, 0, len(piece), offset))
                        self._submit(piece)
                        self.progress.bytes_read += len(piece)
                        self.report()
                else:
                    if len(self.buf) + size > self.chunk_size:
                        self.cut()
                    extents.append(Extent(self.index, len(self.buf), size, 0))
                    self.buf += _read_exactly(f, size, path)
                    self.progress.bytes_read += size
                    if _path_fraction(entry.path) < size / (self.chunk_size / 2):
                        self.cut()
        except OSError as exc:
            raise FatalError(f"cannot read {path}: {exc.strerror or exc}") from exc
        return Entry(
            entry.parent, entry.name, "f", entry.mode, entry.mtime_ns, size, tuple(extents)
        )

    def finish(self) -> tuple[ChunkInfo, ...]:
        self.cut()
        self.pool.shutdown(wait=True)
        for future in self.futures:
            future.result()  # raises the first upload error
        assert all(c is not None for c in self.table)
        return tuple(c for c in self.table if c is not None)

    def abort(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _read_exactly(f: object, n: int, path: Path) -> bytes:
    chunks = []
    left = n
    while left:
        data = f.read(min(left, _READ_SIZE))  # type: ignore[attr-defined]
        if not data:
            raise FatalError(f"{path} shrank while it was being packed")
        chunks.append(data)
        left -= len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# ----------------------------------------------------------------------------- put
def check_chunk_size(chunk_size: int) -> None:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(
            f"chunk size {chunk_size} bytes is out of range: it must be between "
            f"{MIN_CHUNK_SIZE >> 20} MiB and {MAX_CHUNK_SIZE >> 20} MiB"
        )


def put_dataset(
    store: ObjectStore,
    src_dir: str | os.PathLike[str],
    name: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    parallel: int = 8,
    progress: Callable[[PutProgress], None] | None = None,
    page_entries: int = fmt.PAGE_ENTRIES,
    retry_s: float = RETRY_S,
) -> Root:
    """Store the tree at ``src_dir`` as a new version of data set ``name``; return its root.

    The root is written last, so a failed or interrupted put leaves no visible version
    (only unreferenced chunks and pages, which ``data rm`` collects). Each store
    request is retried on transient errors for up to ``retry_s`` seconds. Raises
    ``UsageError`` for a bad name, chunk size or source directory.
    """
    src = Path(src_dir)
    if not fmt.valid_dataset_name(name):
        raise UsageError(
            f"invalid data set name {name!r}: use letters, digits, '.', '_' and '-', "
            f"starting with a letter or digit, at most 128 characters"
        )
    check_chunk_size(chunk_size)
    if parallel < 1:
        raise UsageError(f"parallel must be at least 1, not {parallel}")
    if not src.is_dir():
        raise UsageError(f"{src} is not a directory")
    counters = PutProgress()
    report_lock = threading.Lock()

    def report() -> None:
        if progress is not None:
            with report_lock:
                progress(counters)

    created_ns = time.time_ns()
    packer = _Packer(store, chunk_size, parallel, counters, report, retry_s)
    pages: list[PageRef] = []
    page: list[Entry] = []

    def flush_page() -> None:
        data = encode_page(page)
        key = fmt.page_key(page_digest(data))
        if retry_transient(lambda: store.size(key), retry_s) != len(data):
            retry_transient(lambda: store.put(key, data), retry_s)
        pages.append(PageRef(key, len(page), page[0].parent, page[0].name))
        page.clear()

    try:
        for entry, path in walk_entries(src):
            if path is not None:
                entry = packer.add_file(entry, path)
                counters.files += 1
            elif entry.kind == "d":
                counters.dirs += 1
            else:
                counters.files += 1
            page.append(entry)
            if len(page) >= page_entries:
                flush_page()
            report()
        chunks = packer.finish()
        if page:
            flush_page()
    except BaseException:
        packer.abort()
        raise
    root = Root(
        format=fmt.FORMAT_VERSION,
        name=name,
        version="",
        created_ns=created_ns,
        chunk_size=chunk_size,
        files=counters.files,
        dirs=counters.dirs,
        bytes=counters.bytes_read,
        chunks=chunks,
        pages=tuple(pages),
    )
    root = replace(root, version=version_name(root))
    retry_transient(
        lambda: store.put(fmt.root_key(name, root.version), encode_root(root)), retry_s
    )
    report()
    return root

