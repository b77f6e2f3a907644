"""The on-store format of chunkfs: chunk names, block hashes, manifests, key layout.

This module is the contract between the writer (``hypermesh data put``) and every
reader (the FUSE mount, ``data get``, peer chunk fetch). It holds no I/O.

Chunks and blocks
-----------------
A *chunk* is up to ``chunk_size`` bytes (default 64 MiB) of packed file data. It is
verified in *blocks* of ``BLOCK_SIZE`` bytes (1 MiB; the last block may be short) so
that a reader can fetch and verify only the ranges it needs:

- ``block_digest(data, algo)`` is the 32-byte digest of one block.
- The chunk's *block list* is the concatenation of its block digests.
- The chunk's *id* is ``chunk_id(block_list, algo)``: the hex digest of the block list.

So the block list object is self-certifying against the chunk id, and each block of
the chunk data is then verified against its digest. Wrong bytes never pass.

Two digest algorithms exist, and a chunk's id says which one its blocks use
(``hash_of(id)``): ``blake3`` (ids ``b3`` + 64 hex; what ``data put`` writes, about
three times less CPU per byte than SHA-256 here) and ``sha256`` (ids of 64 hex: data
sets put before BLAKE3 was adopted, still read). Chunks of the two kinds never share
an id, so a put after the change uploads its chunks again once.

Object keys (all under the store's prefix)
------------------------------------------
- ``chunks/<hh>/<id>``            the chunk's bytes (``hh``: the first two of the
                                  id's last 64 hex digits).
- ``chunks/<hh>/<id>.blocks``     its block list (32 bytes per block).
- ``pages/<sha256>``              one page of manifest entries (zlib-compressed JSON),
                                  named by the SHA-256 of its stored bytes.
- ``datasets/<name>/<version>.json``  a version's root manifest (JSON).

A data set's versions sort by name; the newest is the last. A version name is
``<UTC time YYYYmmddTHHMMSSffffffZ>-<first 12 hex of the root's content hash>``.
Nothing is ever overwritten: versions, pages and chunks are immutable. ``data rm``
deletes a version's root; chunks and pages no longer named by any root are garbage
that ``data rm`` may delete after checking every remaining root.

Manifest
--------
The root manifest is small at any file count: it lists the chunks (id and size) and
an index of entry pages. Entries are sorted by ``(parent, name)`` where ``parent`` is
the directory path relative to the data set root ("" for the root itself) and
``name`` the last path component, so one directory's children are contiguous and a
lookup is a binary search over the page index followed by one page fetch. A mount
keeps only the root and the pages it has touched in memory.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import blake3

BLOCK_SIZE = 1 << 20
MiB = 1 << 20
DEFAULT_CHUNK_SIZE = 64 * MiB
MIN_CHUNK_SIZE = 4 * MiB
MAX_CHUNK_SIZE = 256 * MiB
PAGE_ENTRIES = 4096
FORMAT_VERSION = 1

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # also a version's form
_CHUNK_ID_RE = re.compile(r"(?:b3)?[0-9a-f]{64}")


SHA256 = "sha256"
BLAKE3 = "blake3"
BLOCK_HASH = BLAKE3
"""The digest algorithm of the chunks ``data put`` writes."""
_B3 = "b3"


def hash_of(cid: str) -> str:
    """The digest algorithm of chunk ``cid``'s blocks, from the form of its id."""
    return BLAKE3 if len(cid) == 66 and cid.startswith(_B3) else SHA256


def block_digest(data: bytes | memoryview, algo: str = SHA256) -> bytes:
    """The digest of one block (32 raw bytes) with ``algo`` (see ``hash_of``)."""
    if algo == BLAKE3:
        return blake3.blake3(data).digest()
    return hashlib.sha256(data).digest()


def chunk_id(block_list: bytes, algo: str = SHA256) -> str:
    """A chunk's id: the hex digest of its block list (its block digests, in order),
    prefixed with ``b3`` for BLAKE3 chunks."""
    if algo == BLAKE3:
        return _B3 + blake3.blake3(block_list).hexdigest()
    return hashlib.sha256(block_list).hexdigest()


def names(cid: str, block_list: bytes) -> bool:
    """Whether ``block_list`` is the block list chunk ``cid`` names."""
    return chunk_id(block_list, hash_of(cid)) == cid


def block_count(size: int) -> int:
    """How many blocks a chunk of ``size`` bytes has (an empty chunk has none)."""
    return (size + BLOCK_SIZE - 1) // BLOCK_SIZE


def shard(cid: str) -> str:
    """The two hex digits that spread chunks over folders: the first of the id's last 64
    (the id's first two for SHA-256 ids; after the ``b3`` of BLAKE3 ids)."""
    return cid[-64:-62]


def chunk_key(cid: str) -> str:
    return f"chunks/{shard(cid)}/{cid}"


def blocks_key(cid: str) -> str:
    return f"chunks/{shard(cid)}/{cid}.blocks"


def page_key(digest: str) -> str:
    return f"pages/{digest}"


def root_key(name: str, version: str) -> str:
    return f"datasets/{name}/{version}.json"


def valid_dataset_name(name: str) -> bool:
    """Data set names: letters, digits, ``.``, ``_``, ``-``; start alphanumeric; ≤128."""
    return bool(_NAME_RE.fullmatch(name))


def valid_version(version: str) -> bool:
    """Versions take the form of names (so never ``..`` nor a path)."""
    return bool(_NAME_RE.fullmatch(version))


def valid_chunk_id(cid: str) -> bool:
    """A chunk id as ``chunk_id`` makes them: 64 lower-case hex digits, after ``b3`` for
    BLAKE3 chunks. Checked wherever an id from outside names a file or an object."""
    return bool(_CHUNK_ID_RE.fullmatch(cid))


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One chunk named by a root manifest."""

    id: str
    size: int


@dataclass(frozen=True, slots=True)
class Extent:
    """A piece of a file: ``length`` bytes at ``chunk_offset`` in chunk ``chunk``
    (an index into the root's chunk list), placed at ``file_offset`` in the file."""

    chunk: int
    chunk_offset: int
    length: int
    file_offset: int


@dataclass(frozen=True, slots=True)
class Entry:
    """One path in a data set version.

    ``kind`` is ``"f"`` (regular file), ``"d"`` (directory) or ``"l"`` (symlink, with
    ``target``). ``mode`` holds the permission bits only. A file's extents are in
    file order, cover it exactly, and an empty file has none.
    """

    parent: str
    name: str
    kind: str
    mode: int
    mtime_ns: int
    size: int
    extents: tuple[Extent, ...] = ()
    target: str = ""

    @property
    def path(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    @property
    def sort_key(self) -> tuple[str, str]:
        return (self.parent, self.name)


@dataclass(frozen=True, slots=True)
class PageRef:
    """An entry page named by the root: its key, entry count and first sort key."""

    key: str
    count: int
    first_parent: str
    first_name: str


@dataclass(frozen=True, slots=True)
class Root:
    """A data set version's root manifest.

    ``files``/``dirs``/``bytes`` are totals for ``data ls``; ``chunks`` is the chunk
    table extents index into; ``pages`` the entry pages in sort order. The root
    directory itself has no entry; its mode is 0o755 and its mtime ``created_ns``.
    """

    format: int
    name: str
    version: str
    created_ns: int
    chunk_size: int
    files: int
    dirs: int
    bytes: int
    chunks: tuple[ChunkInfo, ...]
    pages: tuple[PageRef, ...]
