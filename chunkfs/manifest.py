"""Manifests in bytes and in memory: root and page codecs, and ``Manifest`` for lookups.

Encodings (the shapes behind ``format.py``'s key layout):

- A root (``datasets/<name>/<version>.json``) is UTF-8 JSON: an object with the fields
  of ``format.Root``; ``chunks`` as ``[[id, size], ...]`` and ``pages`` as
  ``[[key, count, first_parent, first_name], ...]``. ``format`` is checked on decode.
- A page (``pages/<sha256 of the stored bytes>``) is zlib-compressed compact JSON: a
  list of entries in ``(parent, name)`` order, each an array whose length depends on
  its kind::

      ["parent", "name", "d", mode, mtime_ns]
      ["parent", "name", "f", mode, mtime_ns, size, [chunk, chunk_offset, length,
                                                     file_offset, chunk, ...]]
      ["parent", "name", "l", mode, mtime_ns, size, "target"]

  (a file's extents flattened, four numbers each).

Names that are not valid UTF-8 are carried as Python does (surrogate escapes, which
JSON writes as ``\\udcXX``); ``os.fsencode`` gives the original bytes back.

A version's name is derived from its root: ``version_name(root)``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from hypermesh.chunkfs.format import (
    FORMAT_VERSION,
    ChunkInfo,
    Entry,
    Extent,
    PageRef,
    Root,
    page_key,
)
from hypermesh.errors import CorruptData, FatalError

__all__ = [
    "Manifest",
    "UnsupportedFormat",
    "decode_page",
    "decode_root",
    "encode_page",
    "encode_root",
    "page_digest",
    "version_name",
]

ROOT_DIR_MODE = 0o755


class UnsupportedFormat(FatalError):
    """A root written in a format this version of hypermesh does not read."""


# ----------------------------------------------------------------------------- roots
def encode_root(root: Root) -> bytes:
    """The root's stored bytes (JSON, keys in a fixed order)."""
    doc = {
        "format": root.format,
        "name": root.name,
        "version": root.version,
        "created_ns": root.created_ns,
        "chunk_size": root.chunk_size,
        "files": root.files,
        "dirs": root.dirs,
        "bytes": root.bytes,
        "chunks": [[c.id, c.size] for c in root.chunks],
        "pages": [[p.key, p.count, p.first_parent, p.first_name] for p in root.pages],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_root(data: bytes) -> Root:
    """A root from its stored bytes; ``UnsupportedFormat`` or ``CorruptData`` if it is not one."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptData(f"data set root is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or "format" not in doc:
        raise CorruptData("data set root has no 'format' field")
    fmt = doc["format"]
    if fmt != FORMAT_VERSION:
        newer = isinstance(fmt, int) and fmt > FORMAT_VERSION
        raise UnsupportedFormat(
            f"data set root has format {fmt!r}; this hypermesh reads format {FORMAT_VERSION}"
            + (" (it was written by a newer hypermesh: upgrade)" if newer else "")
        )
    try:
        return Root(
            format=fmt,
            name=str(doc["name"]),
            version=str(doc["version"]),
            created_ns=int(doc["created_ns"]),
            chunk_size=int(doc["chunk_size"]),
            files=int(doc["files"]),
            dirs=int(doc["dirs"]),
            bytes=int(doc["bytes"]),
            chunks=tuple(ChunkInfo(str(c[0]), int(c[1])) for c in doc["chunks"]),
            pages=tuple(
                PageRef(str(p[0]), int(p[1]), str(p[2]), str(p[3])) for p in doc["pages"]
            ),
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptData(f"data set root is malformed: {exc!r}") from exc


def version_name(root: Root) -> str:
    """``<UTC time of created_ns>-<12 hex>``: the hex is the SHA-256 of the root's bytes
    with ``version`` empty, so the name certifies the root's content."""
    digest = hashlib.sha256(encode_root(replace(root, version=""))).hexdigest()
    secs, ns = divmod(root.created_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs)) + f"{ns // 1000:06d}Z"
    return f"{stamp}-{digest[:12]}"


# ----------------------------------------------------------------------------- pages
def _entry_row(e: Entry) -> list[Any]:
    row: list[Any] = [e.parent, e.name, e.kind, e.mode, e.mtime_ns]
    if e.kind == "f":
        flat: list[int] = []
        for x in e.extents:
            flat += (x.chunk, x.chunk_offset, x.length, x.file_offset)
        row += (e.size, flat)
    elif e.kind == "l":
        row += (e.size, e.target)
    return row


def _row_entry(row: list[Any]) -> Entry:
    parent, name, kind, mode, mtime_ns = row[:5]
    if kind == "d":
        return Entry(parent, name, kind, mode, mtime_ns, 0)
    if kind == "f":
        flat = row[6]
        extents = tuple(Extent(*flat[i : i + 4]) for i in range(0, len(flat), 4))
        return Entry(parent, name, kind, mode, mtime_ns, row[5], extents)
    if kind == "l":
        return Entry(parent, name, kind, mode, mtime_ns, row[5], (), row[6])
    raise ValueError(f"unknown entry kind {kind!r}")


def encode_page(entries: Iterable[Entry]) -> bytes:
    """A page's stored bytes: zlib-compressed compact JSON of the entries' rows."""
    rows = [_entry_row(e) for e in entries]
    return zlib.compress(json.dumps(rows, separators=(",", ":")).encode(), 6)


def decode_page(data: bytes) -> list[Entry]:
    """The entries of a page; ``CorruptData`` if the bytes are not a page."""
    try:
        rows = json.loads(zlib.decompress(data))
        return [_row_entry(r) for r in rows]
    except (zlib.error, UnicodeDecodeError, ValueError, TypeError, IndexError) as exc:
        raise CorruptData(f"manifest page is malformed: {exc!r}") from exc


def page_digest(data: bytes) -> str:
    """The hex SHA-256 that names a page's stored bytes (``pages/<digest>``)."""
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- Manifest
class Manifest:
    """Path lookups in one data set version, loading entry pages on demand.

    Guarantees: a ``lookup`` loads at most one page (binary search over the root's page
    index, then over the page); ``listdir`` loads only the pages that hold the
    directory's children. At most ``cache_pages`` decoded pages stay in memory (least
    recently used go first). Every page is checked against its content-hash key when
    loaded: ``CorruptData`` rather than a wrong answer. Safe to call from many threads;
    concurrent requests for the same page load it once. Errors of ``load_page``
    (``StoreUnavailable``, ``NoSuchObject``) propagate unchanged; nothing is cached then.

    Paths are relative to the data set root, ``/``-separated, without a leading slash.
    ``lookup("")`` returns a synthetic entry for the root directory (kind ``"d"``, mode
    0o755, mtime ``root.created_ns``, empty name and parent).
    """

    def __init__(
        self, root: Root, load_page: Callable[[str], bytes], *, cache_pages: int = 64
    ) -> None:
        if cache_pages < 1:
            raise ValueError("cache_pages must be at least 1")
        self.root = root
        self._load_page = load_page
        self._cache_pages = cache_pages
        self._firsts = [(p.first_parent, p.first_name) for p in root.pages]
        self._cache: OrderedDict[int, tuple[list[Entry], list[tuple[str, str]]]] = OrderedDict()
        self._loading: dict[int, Future[tuple[list[Entry], list[tuple[str, str]]]]] = {}
        self._lock = threading.Lock()
        self.pages_loaded = 0  # how many page loads were made (for tests and stats)

    @property
    def entry_count(self) -> int:
        return sum(p.count for p in self.root.pages)

    @property
    def root_entry(self) -> Entry:
        return Entry("", "", "d", ROOT_DIR_MODE, self.root.created_ns, 0)

    def lookup(self, path: str) -> Entry | None:
        """The entry at ``path``, or None if the version has no such path."""
        if path == "":
            return self.root_entry
        parent, _, name = path.rpartition("/")
        want = (parent, name)
        index = bisect.bisect_right(self._firsts, want) - 1
        if index < 0:
            return None
        entries, keys = self._page(index)
        i = bisect.bisect_left(keys, want)
        return entries[i] if i < len(keys) and keys[i] == want else None

    def listdir(self, path: str) -> Iterator[Entry]:
        """The children of directory ``path`` in name order (none if it has none).

        It does not check that ``path`` is a directory: ``lookup`` does that.
        """
        start = (path, "")
        index = max(0, bisect.bisect_right(self._firsts, start) - 1)
        while index < len(self._firsts):
            if self._firsts[index][0] > path:
                return
            entries, keys = self._page(index)
            for i in range(bisect.bisect_left(keys, start), len(keys)):
                if keys[i][0] != path:
                    return
                yield entries[i]
            index += 1

    def __iter__(self) -> Iterator[Entry]:
        """Every entry, in ``(parent, name)`` order (pages pass through the cache)."""
        for index in range(len(self._firsts)):
            yield from self._page(index)[0]

    def _page(self, index: int) -> tuple[list[Entry], list[tuple[str, str]]]:
        with self._lock:
            cached = self._cache.get(index)
            if cached is not None:
                self._cache.move_to_end(index)
                return cached
            future = self._loading.get(index)
            owner = future is None
            if future is None:
                future = self._loading[index] = Future()
        if not owner:
            return future.result()
        try:
            page = self._fetch(index)
        except BaseException as exc:
            with self._lock:
                del self._loading[index]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._loading[index]
            self._cache[index] = page
            while len(self._cache) > self._cache_pages:
                self._cache.popitem(last=False)
            self.pages_loaded += 1
        future.set_result(page)
        return page

    def _fetch(self, index: int) -> tuple[list[Entry], list[tuple[str, str]]]:
        ref = self.root.pages[index]
        data = self._load_page(ref.key)
        if page_key(page_digest(data)) != ref.key:
            raise CorruptData(
                f"manifest page {ref.key} of {self.root.name}@{self.root.version}: "
                f"content does not match its hash"
            )
        entries = decode_page(data)
        keys = [(e.parent, e.name) for e in entries]
        if (
            len(entries) != ref.count
            or not entries
            or keys[0] != (ref.first_parent, ref.first_name)
        ):
            raise CorruptData(
                f"manifest page {ref.key} of {self.root.name}@{self.root.version}: "
                f"does not match the root's page index"
            )
        return entries, keys
