"""The local chunk cache: verified 1 MiB blocks of chunks, on disk, bounded in bytes.

Layout under the cache directory (``v1/<shard of the id>/``, one set of files per chunk):

- ``<id>.data``   a sparse file of the chunk's size; only present blocks take space.
  Blocks put with ``direct=True`` are written with ``O_DIRECT`` (where the file system
  takes it): bytes that stream through to a reader are held by the kernel's page cache
  of the *mounted* file already, and a second copy in the cache file's pages would cost
  a pass over every byte, dirty-page writeback and twice the memory.
- ``<id>.blocks`` the chunk's block list (self-certifying: its SHA-256 is the id).
- ``<id>.have``   ``MAGIC``, the chunk size, then one byte per block (1 = written).

What the cache guarantees
-------------------------
- A block is served only if it was verified against its digest *by this process*:
  blocks written by an earlier run are ``CLAIMED`` after a restart and are re-hashed
  against the block list the first time they are asked for (``ready``); a block that
  does not match is forgotten and fetched again. So a crash between writing a block
  and its ``.have`` record, a truncated file or a disk bit flip never reaches a reader.
  A chunk whose ``.blocks`` file does not hash to its id is discarded on start.
- The bytes of present blocks never exceed ``max_bytes``: a block that does not fit
  after evicting every unpinned chunk is not stored (``put_block`` returns False; the
  caller still has the bytes). Eviction is of whole chunks, in the order of
  :func:`keep_rank` (spare copies first, chunks the mesh may hold only here last) and
  least-recently-used within each rank.
- A pinned chunk (``with cache.pin(id):``) is never evicted, so ``read`` of blocks a
  reader saw ``ready`` cannot race an eviction.
- ``on_change(id, True)`` is called when a chunk gains its first block (also for each
  chunk found on disk at start) and ``on_change(id, False)`` when it is evicted. It
  runs without the cache's lock held, in whatever thread caused the change.

Who changes its state: ``ChunkReader`` (fetch.py) admits chunks and puts verified
blocks; everything else only reads. All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hypermesh.chunkfs.buffers import address, aligned_buffer
from hypermesh.chunkfs.format import (
    BLOCK_SIZE,
    block_count,
    block_digest,
    hash_of,
    names,
    shard,
    valid_chunk_id,
)

log = logging.getLogger(__name__)

MAGIC = b"CFC1"
HAVE_HEADER = struct.Struct(">4sQ")
ABSENT, CLAIMED, VERIFIED = 0, 1, 2
#: Seconds between writes of changed ``.have`` records (they are only hints: a lost
#: record loses cached blocks, never correctness).
HAVE_FLUSH_INTERVAL = 2.0
#: Open file descriptors kept for chunk data files before the least recent are closed.
MAX_OPEN_FILES = 256

#: Records kept before those of chunks without blocks (block lists only) are dropped.
MAX_RECORDS = 8192

#: ``O_DIRECT`` writes need buffer addresses, offsets and lengths in multiples of this.
DIRECT_ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0: the platform has none (then never direct)

ChangeCallback = Callable[[str, bool], None]

SPARE, UNSURE, SOLE = 0, 1, 2
"""Ranks of a cached chunk for eviction (lowest evicted first); see :func:`keep_rank`."""
RANK_NAMES = ("spare", "unsure", "sole")


def keep_rank(copy: bool, elsewhere: bool, was_elsewhere: bool) -> int:
    """How much the mesh needs this node's copy of a chunk: evicted lowest rank first.

    - ``copy``: every block of it here came from a peer (not from the store);
    - ``elsewhere``: the node's agent said, last time it was asked, that another alive
      node holds the chunk too; ``was_elsewhere``: it said so at some time before.

    A chunk this node fetched from the store is ``SOLE`` whoever else holds it: the
    node that fetched a chunk keeps it, the nodes that copied it from there hold spares.
    (Ranking own chunks that others copied lower, too, made holder and copier pick the
    same chunks to drop, and lose them together while the view lagged.) A copy another
    node is known to hold is ``SPARE``; a copy nobody is known to hold yet is
    ``UNSURE`` (its source most likely still has it: the agent's view lags a few
    seconds); one whose other holders have all gone since (evicted it, or died) is
    ``SOLE``: it may be the last one.
    """
    if not copy:
        return SOLE
    if elsewhere:
        return SPARE
    return SOLE if was_elsewhere else UNSURE


def block_span(index: int, size: int) -> tuple[int, int]:
    """``(offset, length)`` of block ``index`` in a chunk of ``size`` bytes."""
    start = index * BLOCK_SIZE
    return start, min(BLOCK_SIZE, size - start)


class ReadStats:
    """Counters of where read bytes came from and what the object store was asked.

    ``blocks``/``bytes`` count blocks (and their bytes) handed to readers by source:
    ``cache`` (local disk), ``peer`` and ``store``. ``store_gets``/``store_bytes`` count
    ranged GETs (block lists included) and the bytes they returned, prefetch included.
    ``peer_corrupt_blocks`` counts blocks a peer sent that failed their digest (they
    were fetched from the store instead). ``direct_bytes``: bytes the cache wrote
    around the page cache (``put_block(direct=True)``).
    Anyone may add; ``snapshot`` gives a consistent copy.
    """

    SOURCES = ("cache", "peer", "store")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.blocks = dict.fromkeys(self.SOURCES, 0)
        self.bytes = dict.fromkeys(self.SOURCES, 0)
        self.counters: dict[str, int] = {
            "store_gets": 0,
            "store_bytes": 0,
            "store_retries": 0,
            "peer_bytes": 0,
            "peer_corrupt_blocks": 0,
            "corrupt_blocks": 0,
            "read_errors": 0,
            "prefetched_blocks": 0,
            "file_reads": 0,
            "pushed_bytes": 0,
            "push_dropped": 0,
            "push_errors": 0,
            "push_skipped": 0,
            "evicted_chunks": 0,
            "evicted_sole": 0,
            "direct_bytes": 0,
        }

    def served(self, source: str, blocks: int, nbytes: int) -> None:
        with self._lock:
            self.blocks[source] += blocks
            self.bytes[source] += nbytes

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {"blocks": dict(self.blocks), "bytes": dict(self.bytes), **self.counters}


@dataclass
class _Chunk:
    """One chunk's record. Guarded by the cache lock except ``fd`` I/O while pinned."""

    id: str
    size: int
    block_list: bytes
    state: bytearray
    present_bytes: int = 0
    pins: int = 0
    dirty: bool = False
    fd: int | None = None
    direct_fd: int | None = None  # opened with O_DIRECT, for ``put_block(direct=True)``
    writing: set[int] = field(default_factory=set)
    copy: bool = False  # every block held came from a peer (False after a restart)
    elsewhere: bool = False  # another node holds it too, as the agent said last
    was_elsewhere: bool = False

    @property
    def rank(self) -> int:
        return keep_rank(self.copy, self.elsewhere, self.was_elsewhere)

    @property
    def nblocks(self) -> int:
        return len(self.state)


class ChunkCache:
    """A size-bounded, restart-safe cache of verified chunk blocks (see module doc)."""

    def __init__(
        self, root: Path | str, max_bytes: int, on_change: ChangeCallback | None = None
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_change = on_change
        self.stats = ReadStats()
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # LRU order, oldest first
        self._bytes = 0
        self._elsewhere: frozenset[str] = frozenset()
        self._open_fds = 0
        self._direct = bool(O_DIRECT)  # until the file system refuses a direct write
        self._scratch = threading.local()  # per thread: an aligned block for direct writes
        self._last_flush = time.monotonic()
        (self.root / "v1").mkdir(parents=True, exist_ok=True)
        self._rebuild()

    # ------------------------------------------------------------------ paths
    def _path(self, cid: str, suffix: str) -> Path:
        if not valid_chunk_id(cid):  # an id from a peer or a manifest names a file here
            raise ValueError(f"not a chunk id: {cid[:80]!r}")
        return self.root / "v1" / shard(cid) / f"{cid}.{suffix}"

    # ---------------------------------------------------------------- queries
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def chunk_ids(self) -> list[str]:
        """Chunks holding at least one block, least recently used first."""
        with self._lock:
            return [c.id for c in self._chunks.values() if c.present_bytes]

    def has_room(self, cid: str, length: int) -> bool:
        """Whether ``length`` more bytes of chunk ``cid`` fit without evicting a chunk
        of rank ``SOLE`` (free space and copies of chunks from peers count as room).
        A hint for the cold-segment race: a node without room lets one with room fetch."""
        with self._lock:
            free = self.max_bytes - self._bytes
            for rec in self._chunks.values():
                if free >= length:
                    break
                if rec.id != cid and rec.rank < SOLE and not rec.pins:
                    free += rec.present_bytes
            return free >= length

    def set_elsewhere(self, chunk_ids: frozenset[str]) -> None:
        """The chunks another alive node holds too, as the agent sees them now (ids of
        chunks not cached here are ignored). Replaces the previous set."""
        with self._lock:
            self._elsewhere = chunk_ids
            for rec in self._chunks.values():
                rec.elsewhere = rec.id in chunk_ids
                rec.was_elsewhere = rec.was_elsewhere or rec.elsewhere

    def ranks(self) -> dict[str, int]:
        """Each chunk holding blocks and its :func:`keep_rank` (for tests and tools)."""
        with self._lock:
            return {c.id: c.rank for c in self._chunks.values() if c.present_bytes}

    def rank_counts(self) -> dict[str, int]:
        """How many cached chunks have each rank, by name (``RANK_NAMES``)."""
        counts = dict.fromkeys(RANK_NAMES, 0)
        for rank in self.ranks().values():
            counts[RANK_NAMES[rank]] += 1
        return counts

    def block_list(self, cid: str) -> bytes | None:
        with self._lock:
            rec = self._chunks.get(cid)
            return rec.block_list if rec else None

    def present(self, cid: str) -> list[int]:
        """Indices of the blocks held (verified or claimed) of chunk ``cid``."""
        with self._lock:
            rec = self._chunks.get(cid)
            return [i for i, s in enumerate(rec.state) if s] if rec else []

    def verified(self, cid: str, index: int) -> bool:
        """Whether block ``index`` is held and verified by this process (no I/O)."""
        with self._lock:
            rec = self._chunks.get(cid)
            return rec is not None and rec.state[index] == VERIFIED

    def ready(self, cid: str, index: int) -> bool:
        """Whether block ``index`` can be served: verified, or claimed and re-verified now.

        A claimed block that does not match its digest is forgotten (returns False).
        """
        with self._lock:
            rec = self._chunks.get(cid)
            if rec is None or rec.state[index] == ABSENT:
                return False
            if rec.state[index] == VERIFIED:
                return True
            rec.pins += 1
        try:
            start, length = block_span(index, rec.size)
            data = self._pread(rec, start, length)
            good = len(data) == length and block_digest(data, hash_of(cid)) == _digest(
                rec.block_list, index
            )
        except OSError:
            good = False
        with self._lock:
            rec.pins -= 1
            if rec.state[index] != CLAIMED:
                return rec.state[index] == VERIFIED
            if good:
                rec.state[index] = VERIFIED
            else:
                log.warning("cache: block %d of chunk %s failed re-verification", index, cid)
                self.stats.add("corrupt_blocks")
                rec.state[index] = ABSENT
                rec.present_bytes -= length
                self._bytes -= length
                rec.dirty = True
            return good

    def read(self, cid: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset+length)`` of a chunk whose blocks there are ``ready``.

        The caller pins the chunk and checked ``ready`` for every block of the range.
        """
        with self._lock:
            rec = self._chunks[cid]
            self._chunks.move_to_end(cid)
        return self._pread(rec, offset, length)

    # ---------------------------------------------------------------- changes
    def admit(self, cid: str, size: int, block_list: bytes) -> None:
        """Register a chunk and its block list (verified here against the id)."""
        with self._lock:
            if cid in self._chunks:
                return
        if not names(cid, block_list) or len(block_list) != 32 * block_count(size):
            raise ValueError(f"block list does not match chunk {cid} of {size} bytes")
        with self._lock:
            if cid in self._chunks:
                return
            rec = _Chunk(cid, size, block_list, bytearray(block_count(size)))
            rec.elsewhere = rec.was_elsewhere = cid in self._elsewhere
            self._chunks[cid] = rec
            if len(self._chunks) > MAX_RECORDS:
                for rec in list(self._chunks.values())[: len(self._chunks) - MAX_RECORDS]:
                    if not rec.present_bytes and not rec.pins and not rec.writing:
                        self._drop(rec)
        path = self._path(cid, "blocks")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, block_list)

    @contextlib.contextmanager
    def pin(self, cid: str) -> Iterator[None]:
        """Keep chunk ``cid`` from eviction while the block is open (it may be absent)."""
        with self._lock:
            rec = self._chunks.get(cid)
            if rec is not None:
                rec.pins += 1
                self._chunks.move_to_end(cid)
        try:
            yield
        finally:
            if rec is not None:
                with self._lock:
                    rec.pins -= 1

    def put_block(
        self,
        cid: str,
        index: int,
        data: bytes | memoryview,
        from_peer: bool = False,
        direct: bool = False,
    ) -> bool:
        """Store block ``index`` (already verified by the caller). False: not stored.

        Not stored means the chunk was never admitted, or the block does not fit even
        after evicting every unpinned chunk — or, ``from_peer`` (a peer served it), does
        not fit in the free space: bytes a peer holds too never push out what this node
        holds (evicting even a spare copy for them, while the view of who holds what
        lags, was seen to lose chunks). A chunk whose blocks all came from peers is a
        copy (see :func:`keep_rank`).

        ``direct``: the bytes are on their way to a reader through the mount, so keep
        them out of the page cache (see the module doc). Fastest when ``data`` lies in
        a buffer from ``chunkfs.buffers`` at a block boundary (it is then written as it is);
        other bytes are first copied into an aligned buffer.
        """
        entered = False
        evicted: list[str] = []
        with self._lock:
            rec = self._chunks.get(cid)
            if rec is None or rec.state[index] != ABSENT or index in rec.writing:
                return False
            start, length = block_span(index, rec.size)
            if len(data) != length:
                raise ValueError(f"block {index} of {cid}: {len(data)} bytes, expected {length}")
            evicted = [] if from_peer else self._evict_for(length, keep=cid)
            if self._bytes + length > self.max_bytes:
                self._notify_left(evicted)
                return False
            self._bytes += length  # reserved now so that concurrent puts respect the bound
            rec.copy = from_peer and (rec.copy or not rec.present_bytes)
            rec.present_bytes += length
            rec.writing.add(index)
            rec.pins += 1
        ok = False
        try:
            self._write(rec, data, start, direct)
            ok = True
        except OSError as exc:
            log.warning("cache: writing block %d of chunk %s failed: %s", index, cid, exc)
        finally:
            with self._lock:
                rec.pins -= 1
                rec.writing.discard(index)
                if ok:
                    entered = rec.present_bytes == length
                    rec.state[index] = VERIFIED
                    rec.dirty = True
                else:
                    self._bytes -= length
                    rec.present_bytes -= length
                flush = all(rec.state) or time.monotonic() - self._last_flush > HAVE_FLUSH_INTERVAL
        self._notify_left(evicted)
        if entered and self.on_change:
            self.on_change(cid, True)
        if flush:
            self.flush()
        return ok

    def dirty(self) -> bool:
        """Whether some chunk's blocks changed since its record was last written."""
        with self._lock:
            return any(c.dirty for c in self._chunks.values())

    def flush(self) -> None:
        """Write the ``.have`` record of every chunk whose blocks changed."""
        with self._flush_lock:  # one writer at a time, or an older record could land last
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            self._last_flush = time.monotonic()
            dirty = [(c.id, c.size, bytes(c.state)) for c in self._chunks.values() if c.dirty]
            for c in self._chunks.values():
                c.dirty = False
        for cid, size, state in dirty:
            have = bytes(1 if s else 0 for s in state)
            try:
                _write_atomic(self._path(cid, "have"), HAVE_HEADER.pack(MAGIC, size) + have)
            except FileNotFoundError:
                pass  # evicted meanwhile
            except OSError as exc:
                log.warning("cache: writing the record of chunk %s failed: %s", cid, exc)

    def close(self) -> None:
        """Persist records and close files. The cache must not be used afterwards."""
        self.flush()
        with self._lock:
            for rec in self._chunks.values():
                self._close_fd(rec)

    # --------------------------------------------------------------- internals
    def _fd(self, rec: _Chunk) -> int:
        with self._lock:
            if rec.fd is not None:
                return rec.fd
            path = self._path(rec.id, "data")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_size != rec.size:
                os.ftruncate(fd, rec.size)
            rec.fd = fd
            self._open_fds += 1
            if self._open_fds > MAX_OPEN_FILES:
                for other in self._chunks.values():
                    if self._open_fds <= MAX_OPEN_FILES // 2:
                        break
                    if other.fd is not None and other.pins == 0 and other is not rec:
                        self._close_fd(other)
            return fd

    def _close_fd(self, rec: _Chunk) -> None:
        for name in ("fd", "direct_fd"):
            fd = getattr(rec, name)
            if fd is not None:
                os.close(fd)
                setattr(rec, name, None)
                self._open_fds -= 1

    def _write(self, rec: _Chunk, data: bytes | memoryview, start: int, direct: bool) -> None:
        """Write bytes of a pinned chunk at ``start`` (a block boundary)."""
        if direct and self._direct and len(data) % DIRECT_ALIGN == 0:
            try:
                os.pwrite(self._direct_fd(rec), self._aligned(data), start)
                self.stats.add("direct_bytes", len(data))
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("cache: %s refuses O_DIRECT writes (%s); writing through the "
                         "page cache", self.root, exc)
                self._direct = False
        os.pwrite(self._fd(rec), data, start)

    def _direct_fd(self, rec: _Chunk) -> int:
        self._fd(rec)  # creates the file at its size
        with self._lock:
            if rec.direct_fd is None:
                rec.direct_fd = os.open(
                    self._path(rec.id, "data"), os.O_WRONLY | O_DIRECT | os.O_CLOEXEC
                )
                self._open_fds += 1
            return rec.direct_fd

    def _aligned(self, data: bytes | memoryview) -> memoryview:
        """``data`` itself if it starts on an aligned address, else a copy that does."""
        view = memoryview(data)
        start = address(view)
        if start is not None and start % DIRECT_ALIGN == 0:
            return view
        scratch: memoryview | None = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < len(view):
            scratch = self._scratch.buf = aligned_buffer(max(len(view), BLOCK_SIZE))
        scratch[: len(view)] = view
        return scratch[: len(view)]

    def _pread(self, rec: _Chunk, offset: int, length: int) -> bytes:
        return os.pread(self._fd(rec), length, offset)

    def _evict_for(self, length: int, keep: str) -> list[str]:
        """Evict unpinned chunks, lowest rank first and least recently used within a
        rank, until ``length`` more bytes fit. Lock held."""
        evicted: list[str] = []
        if self._bytes + length <= self.max_bytes:
            return evicted
        candidates = [
            rec for rec in self._chunks.values()
            if not (rec.pins or rec.writing or rec.id == keep or not rec.present_bytes)
        ]
        for rec in sorted(candidates, key=lambda r: r.rank):  # stable: LRU within a rank
            if self._bytes + length <= self.max_bytes:
                break
            rank = rec.rank
            log.debug("cache: evicting chunk %s (rank %d)", rec.id, rank)
            if self._drop(rec):
                evicted.append(rec.id)
                self.stats.add("evicted_chunks")
                if rank == SOLE:
                    self.stats.add("evicted_sole")
        return evicted

    def _drop(self, rec: _Chunk) -> bool:
        """Forget a chunk and delete its files. Lock held. True if it held blocks."""
        self._close_fd(rec)
        del self._chunks[rec.id]
        self._bytes -= rec.present_bytes
        for suffix in ("data", "have", "blocks"):
            with contextlib.suppress(FileNotFoundError):
                self._path(rec.id, suffix).unlink()
        return rec.present_bytes > 0

    def _notify_left(self, evicted: list[str]) -> None:
        if self.on_change:
            for cid in evicted:
                self.on_change(cid, False)

    def _rebuild(self) -> None:
        """Index what an earlier run left on disk; discard what cannot be trusted."""
        found: list[tuple[float, _Chunk]] = []
        for sub in sorted((self.root / "v1").iterdir()):
            if not sub.is_dir():
                continue
            for path in sorted(sub.iterdir()):
                if path.suffix == ".blocks":
                    rec = self._load(path)
                    if rec is not None:
                        found.append((self._path(rec.id, "have").stat().st_mtime, rec))
                elif path.suffix not in (".data", ".have") or not self._path(
                    path.stem, "blocks"
                ).exists():
                    path.unlink(missing_ok=True)  # a temp file, or data without its list
        for _, rec in sorted(found, key=lambda item: item[0]):
            self._chunks[rec.id] = rec
            self._bytes += rec.present_bytes
        evicted = self._evict_for(0, keep="")
        if self.on_change:
            for rec in list(self._chunks.values()):
                if rec.present_bytes:
                    self.on_change(rec.id, True)
        if evicted:
            log.info("cache: evicted %d chunks on start to fit the bound", len(evicted))

    def _load(self, blocks_path: Path) -> _Chunk | None:
        cid = blocks_path.stem
        have_path, data_path = self._path(cid, "have"), self._path(cid, "data")
        try:
            block_list = blocks_path.read_bytes()
            have = have_path.read_bytes()
            magic, size = HAVE_HEADER.unpack_from(have)
            state = bytearray(have[HAVE_HEADER.size :])
            good = (
                magic == MAGIC
                and names(cid, block_list)
                and len(block_list) == 32 * block_count(size)
                and len(state) == block_count(size)
                and set(state) <= {0, 1}
                and data_path.stat().st_size == size
            )
        except (OSError, struct.error):
            good = False
        if not good:
            for path in (blocks_path, have_path, data_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            return None
        rec = _Chunk(cid, size, block_list, state)
        rec.present_bytes = sum(block_span(i, size)[1] for i, s in enumerate(state) if s)
        return rec


def _digest(block_list: bytes, index: int) -> bytes:
    return block_list[32 * index : 32 * index + 32]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
