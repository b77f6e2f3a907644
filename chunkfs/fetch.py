"""Reading chunk bytes: from the local cache, a peer, or the object store, always verified.

``ChunkReader.read(chunk, offset, length)`` returns exactly the bytes of the chunk in that
range, or raises; it never returns bytes that did not match their block digest.

How a read proceeds
-------------------
1. The chunk's block list (``chunks/<shard>/<id>.blocks``) is loaded once — from
   memory, the cache directory or the store — and checked against the chunk id.
2. The 1 MiB blocks that cover the range and are not in the cache are *claimed*: a
   block already being fetched (by another read or by prefetch) is waited for, not
   fetched twice. Newly claimed blocks are coalesced into runs of adjacent blocks of
   at most ``range_bytes`` and fetched in parallel on a thread pool, each run by one
   ranged GET (after asking ``peer_fetch``, when set).
3. A run's GET body is received straight into a reused page-aligned buffer
   (``chunkfs.buffers``), and each block is verified there against its digest. A
   wrong block is fetched once more from the store; wrong again, it fails with
   ``CorruptData``. Good blocks go to the waiting reads (as slices of the buffer, not
   copies), then to the cache. A read waits only for its own blocks.
4. Transient store errors are retried with backoff; every read has an overall
   deadline (``deadline_s``) after which it raises ``StoreUnavailable`` — it never hangs.
   Reads that join a claim share the deadline of the read that made it; when one
   times out, every pending claim of the chunk fails and ``outages``
   (``chunkfs.outage``) holds the chunk for one deadline, so a hung store costs a
   read one deadline, once. Block lists are fetched so too (``Flights``).

Prefetch (``prefetch``) fetches blocks in the background on a separate, smaller pool
with a bounded queue; a block is claimed only when its prefetch run starts, so a
queued prefetch never delays a read. ``Readahead`` decides, per open file, when and
how far to prefetch; ``FileReader`` maps file ranges to chunk ranges and drives both.
The reader also prefetches the rest of a chunk once ``whole_chunk_after`` distinct
blocks of it were missed by reads (many small files read in any order).

A prefetch may name a *sink* that gets the blocks it fetched, verified, as they arrive
(the FUSE layer puts them into the kernel's page cache, so the reader never asks).

The peer hook: ``peer_fetch(chunk_id, offset, length) -> bytes | None`` is called
before the store for every run to be fetched. It returns the chunk's bytes in that
range (exactly ``length`` of them) or None; its bytes are verified like the store's,
and any block it gets wrong or does not give is fetched from the store. It is called
from fetch threads, must be thread-safe and should answer within a second or two.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from hypermesh.chunkfs.buffers import BufferPool
from hypermesh.chunkfs.cache import ChunkCache, block_span
from hypermesh.chunkfs.format import (
    BLOCK_SIZE,
    ChunkInfo,
    Entry,
    block_count,
    block_digest,
    blocks_key,
    chunk_key,
    hash_of,
    names,
)
from hypermesh.chunkfs.outage import Flights, Outages, set_once
from hypermesh.chunkfs.store import ObjectStore, retry_transient
from hypermesh.errors import CorruptData, HypermeshError, NoSuchObject, StoreUnavailable

log = logging.getLogger(__name__)

MiB = 1 << 20
PeerFetch = Callable[[str, int, int], "bytes | None"]
BlockSink = Callable[[ChunkInfo, int, "list[memoryview]"], None]
"""Gets what a prefetch fetched, verified: (chunk, first block index, adjacent blocks)."""
PagePush = Callable[[int, "memoryview | bytes"], None]
"""Gets verified bytes of one file at a page-aligned file offset: (offset, data)."""
PAGE = 4096
T = TypeVar("T")
_Result = tuple[memoryview, str]  # a verified block and where it came from
LIST_THREADS = 4  # threads that fetch block lists


class _Claim(Future[_Result]):
    """A block being fetched: its result, and the deadline of the read that claimed it
    (no read waits for it past that)."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline


@dataclass(frozen=True)
class FetchConfig:
    """How the reader fetches. Presets: ``FetchConfig()`` (defaults) and ``local()``.

    - ``deadline_s``: the longest one read may take, retries of transient store errors
      included; then ``StoreUnavailable``. Longer rides out store hiccups, shorter fails
      a job sooner when the store is really gone. A chunk that failed so fails at once
      for as long again.
    - ``range_bytes``: the most one ranged GET asks for (a multiple of 1 MiB). Larger
      means fewer requests and more bytes per request latency, but a read waits for its
      whole run.
    - ``threads``: fetch threads for reads; size the store's connection pool to at least
      ``threads + prefetch_threads``.
    - ``prefetch_threads``/``prefetch_queue``: background fetch threads and the most
      prefetch runs queued; memory for prefetch is bounded by
      ``(prefetch_threads + prefetch_queue)``-ish runs of ``range_bytes`` in flight.
    - ``readahead_start``/``readahead_max``: the sequential window starts at the first
      and doubles on each sequential read up to the second.
    - ``whole_chunk_after``: prefetch the rest of a chunk after this many distinct blocks
      of it were missed by reads (0: never).
    - ``first_delay_s``/``max_delay_s``: backoff between retries of transient errors.
    - ``block_lists``: block lists kept in memory (32 bytes per MiB of chunk each).
    - ``buffers``: receive buffers of ``range_bytes`` kept for reuse (``chunkfs.buffers``;
      resident while reads stream, given back after 30 s idle); more runs in flight
      than this get fresh memory, which costs page faults.
    """

    deadline_s: float = 30.0
    range_bytes: int = 16 * MiB
    threads: int = 16
    prefetch_threads: int = 8
    prefetch_queue: int = 48
    readahead_start: int = 4 * MiB
    readahead_max: int = 64 * MiB
    whole_chunk_after: int = 4
    first_delay_s: float = 0.05
    max_delay_s: float = 1.0
    block_lists: int = 4096
    buffers: int = 16

    def __post_init__(self) -> None:
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.range_bytes < BLOCK_SIZE or self.range_bytes % BLOCK_SIZE:
            raise ValueError(f"range_bytes must be a positive multiple of 1 MiB, got "
                             f"{self.range_bytes}")
        if self.threads < 1 or self.prefetch_threads < 1 or self.prefetch_queue < 0:
            raise ValueError("threads and prefetch_threads must be >= 1, prefetch_queue >= 0")
        if self.buffers < 0:
            raise ValueError(f"buffers must be >= 0, got {self.buffers}")
        if not 0 < self.readahead_start <= self.readahead_max:
            raise ValueError("need 0 < readahead_start <= readahead_max")

    @classmethod
    def local(cls) -> FetchConfig:
        """Tight timeouts for tests: failures show within seconds."""
        return cls(deadline_s=4.0, threads=4, prefetch_threads=2, max_delay_s=0.2)

    @property
    def run_blocks(self) -> int:
        return self.range_bytes // BLOCK_SIZE


def runs(indices: Iterable[int], most: int) -> list[list[int]]:
    """Sorted block indices grouped into runs of adjacent blocks, at most ``most`` each."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][-1] == i - 1 and len(out[-1]) < most:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class ChunkReader:
    """Verified reads of chunk ranges with shared in-flight fetches (see module doc).

    Thread-safe; ``read`` blocks the calling thread. The reader owns its thread pools
    and adds to ``cache.stats``; ``close`` stops the pools (reads then fail).
    ``outages``: chunks held after a fetch failed (the mount's page fetches share it).
    """

    def __init__(
        self,
        store: ObjectStore,
        cache: ChunkCache,
        config: FetchConfig | None = None,
        peer_fetch: PeerFetch | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.config = config or FetchConfig()
        self.peer_fetch = peer_fetch
        self.stats = cache.stats
        self._pool = ThreadPoolExecutor(self.config.threads, "chunkfs-fetch")
        self._prefetch_pool = ThreadPoolExecutor(self.config.prefetch_threads, "chunkfs-ahead")
        self.buffers = BufferPool(self.config.range_bytes, self.config.buffers)
        self.outages = Outages(self.config.deadline_s)
        self._list_flights: Flights[bytes] = Flights("chunkfs-lists", LIST_THREADS, self.outages)
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, int], _Claim] = {}
        self._lists: OrderedDict[str, bytes] = OrderedDict()
        self._prefetch_pending = 0
        self._missed: OrderedDict[str, set[int]] = OrderedDict()

    # ---------------------------------------------------------------- reading
    def read(self, chunk: ChunkInfo, offset: int, length: int, sequential: bool = False,
             deadline: float | None = None) -> bytes | memoryview:
        """Bytes ``[offset, offset+length)`` of ``chunk`` (cut at its end), verified. A
        memoryview when they are a slice of one fetched run (not copied out of it).

        ``sequential``: the caller reads on from here; a miss then also fetches the
        blocks after the range (up to one run) that nobody fetches yet, in the same GET.
        ``deadline`` (``time.monotonic()``): when to give up, if not ``deadline_s`` from
        now (a caller reading several chunks for one request gives them one).
        """
        length = min(length, chunk.size - offset)
        if length <= 0:
            return b""
        if deadline is None:
            deadline = time.monotonic() + self.config.deadline_s
        try:
            return self._read(chunk, offset, length, deadline, sequential)
        except HypermeshError:
            self.stats.add("read_errors")
            raise

    def read_cached(self, chunk: ChunkInfo, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset+length)`` of ``chunk`` if every block they need is
        already verified in the cache, else None. Never fetches or waits (a ``pread``
        of the cache file, normally in the page cache), so the FUSE layer may call it
        on its event loop and skip a thread hop for most small-file reads."""
        length = min(length, chunk.size - offset)
        if length <= 0:
            return b""
        cid = chunk.id
        first, last = offset // BLOCK_SIZE, (offset + length - 1) // BLOCK_SIZE
        with self.cache.pin(cid):
            if not all(self.cache.verified(cid, i) for i in range(first, last + 1)):
                return None
            data = self.cache.read(cid, offset, length)
        self.stats.served("cache", last - first + 1, length)
        return data

    def _read(
        self, chunk: ChunkInfo, offset: int, length: int, deadline: float, sequential: bool
    ) -> bytes | memoryview:
        cid = chunk.id
        block_list = self._block_list(chunk, deadline)
        first, last = offset // BLOCK_SIZE, (offset + length - 1) // BLOCK_SIZE
        with self.cache.pin(cid):
            waits, new = self._claim(chunk, range(first, last + 1), deadline)
            if new and sequential and new[-1] == last:
                more_end = min(block_count(chunk.size), new[-1] + self.config.run_blocks)
                new += self._claim(chunk, range(last + 1, more_end), deadline, False)[1]
            self._start(chunk, block_list, new, deadline, self._pool, sequential)
            if new:
                self._note_misses(chunk, new)
            if not waits:
                self.stats.served("cache", last - first + 1, length)
                return self.cache.read(cid, offset, length)
            pieces: list[bytes | memoryview] = []
            for i in range(first, last + 1):
                lo, hi = max(offset, i * BLOCK_SIZE), min(offset + length, (i + 1) * BLOCK_SIZE)
                fut = waits.get(i)
                if fut is None:
                    pieces.append(self.cache.read(cid, lo, hi - lo))
                    source = "cache"
                else:
                    data, source = self._wait(fut, deadline, chunk, i)
                    pieces.append(data[lo - i * BLOCK_SIZE : hi - i * BLOCK_SIZE])
                self.stats.served(source, 1, hi - lo)
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _claim(
        self, chunk: ChunkInfo, indices: Iterable[int], deadline: float, fail_fast: bool = True
    ) -> tuple[dict[int, _Claim], list[int]]:
        """Claims of the blocks not ready in the cache, and which of them are new (their
        fetch ends by ``deadline``). ``fail_fast``: raise ``StoreUnavailable`` rather than
        claim a block of a chunk ``outages`` holds, or join a claim given up on (nothing
        is claimed then)."""
        cid = chunk.id
        missing = [i for i in indices if not self.cache.ready(cid, i)]
        waits: dict[int, _Claim] = {}
        new: list[int] = []
        if not missing:
            return waits, new
        with self._lock:
            for i in missing:
                fut = self._inflight.get((cid, i))
                if fut is not None:
                    waits[i] = fut
                elif not self.cache.verified(cid, i):  # else it landed since we looked
                    new.append(i)
            if fail_fast and (new or any(f.done() and f.exception() for f in waits.values())):
                self.outages.check(cid, f"chunk {cid}")
            for i in new:
                waits[i] = self._inflight[(cid, i)] = _Claim(deadline)
        return waits, new

    def _start(
        self,
        chunk: ChunkInfo,
        block_list: bytes,
        new: list[int],
        deadline: float,
        pool: ThreadPoolExecutor,
        stream: bool = False,
    ) -> None:
        for run in runs(new, self.config.run_blocks):
            try:
                pool.submit(self._fetch_run, chunk, block_list, run, deadline, None, stream)
            except RuntimeError as exc:  # the pool is shut down
                self._resolve(chunk.id, {i: StoreUnavailable(f"reader closed: {exc}") for i in run})

    def _wait(self, fut: _Claim, deadline: float, chunk: ChunkInfo, index: int) -> _Result:
        until = min(deadline, fut.deadline)
        try:
            return fut.result(timeout=max(0.0, until - time.monotonic()))
        except TimeoutError:
            self._give_up(chunk.id, f"block {index} not fetched within the deadline")
            raise StoreUnavailable(
                f"block {index} of chunk {chunk.id} not fetched within "
                f"{self.config.deadline_s:g} s"
            ) from None

    def _give_up(self, cid: str, cause: str) -> None:
        """A fetch of chunk ``cid`` outlived its deadline: hold the chunk and fail its
        pending claims now. The fetches go on; blocks they still get are cached."""
        self.outages.note(cid, cause)
        error = StoreUnavailable(f"chunk {cid}: the store did not answer in time ({cause})")
        with self._lock:  # claims in _inflight get their results under this lock only
            for (c, _i), fut in self._inflight.items():
                if c == cid:
                    set_once(fut, error)

    # --------------------------------------------------------------- fetching
    def _fetch_run(
        self,
        chunk: ChunkInfo,
        block_list: bytes,
        run: list[int],
        deadline: float,
        sink: BlockSink | None = None,
        stream: bool = False,
    ) -> dict[int, _Result]:
        """Fetch and verify one run of claimed blocks, hand them to waiting reads and
        ``sink``, cache them.

        Waiting reads and the sink get their blocks before the blocks are written to the
        cache (a write must not delay the bytes a reader is about to ask for); the
        claims are released only after, so no read fetches a block a second time.
        ``stream``: the run is part of a sequential read through the mount, so the
        cache writes it around the page cache (``put_block(direct=True)``).
        Returns the good blocks.
        """
        results: dict[int, _Result | BaseException] = {}
        try:
            results = self._fetch_blocks(chunk, block_list, run, deadline)
        except BaseException as exc:
            results = dict.fromkeys(run, exc)
            if not isinstance(exc, HypermeshError):
                log.exception("fetch of chunk %s blocks %s failed", chunk.id, run)
        for i in run:
            results.setdefault(i, CorruptData(f"block {i} of chunk {chunk.id}: not fetched"))
        good: dict[int, _Result] = {i: r for i, r in results.items() if isinstance(r, tuple)}
        if good:
            self.outages.forget(chunk.id)  # the store (or a peer) answers again
        elif any(isinstance(r, StoreUnavailable) for r in results.values()):
            self.outages.note(chunk.id, f"blocks {run[0]}-{run[-1]}: the store did not answer")
        self._resolve(chunk.id, {i: r for i, r in results.items() if i not in good})
        with self._lock:
            _settle({i: self._inflight.get((chunk.id, i)) for i in good}, results)
        if sink is not None:
            for part in runs(good, len(good) or 1):
                try:
                    sink(chunk, part[0], [good[i][0] for i in part])
                except Exception:
                    log.exception("the sink of chunk %s blocks %s failed", chunk.id, part)
        try:
            self.cache.admit(chunk.id, chunk.size, block_list)  # again, if it was evicted
            for i, result in good.items():
                # A block a peer served is cached only into free space: the peer keeps
                # its copy, and evicting what this node fetched from the store for it
                # would leave the mesh holding fewer distinct chunks.
                self.cache.put_block(
                    chunk.id, i, result[0], from_peer=result[1] == "peer", direct=stream
                )
        except Exception:
            log.exception("caching chunk %s blocks %s failed", chunk.id, run)
        finally:
            self._resolve(chunk.id, dict(good))
        return good

    def _resolve(self, cid: str, results: dict[int, _Result | BaseException]) -> None:
        """Release the claims of these blocks (their futures get ``results`` if not done)."""
        with self._lock:
            futures = {i: self._inflight.pop((cid, i), None) for i in results}
        _settle(futures, results)

    def _fetch_blocks(
        self, chunk: ChunkInfo, block_list: bytes, run: list[int], deadline: float
    ) -> dict[int, _Result | BaseException]:
        out: dict[int, _Result | BaseException] = {}
        todo = list(run)
        if self.peer_fetch is not None:
            todo = self._from_peer(chunk, block_list, todo, out)
        for sub in runs(todo, len(todo) or 1):
            try:
                data = self._get(chunk, sub, deadline)
            except HypermeshError as exc:
                out.update(dict.fromkeys(sub, exc))
                continue
            for i in sub:
                block = _verified(chunk, block_list, data, sub[0], i)
                if block is None:  # wrong bytes: once more, on its own, from the store
                    self.stats.add("corrupt_blocks")
                    log.warning("chunk %s block %d: bad bytes from the store, retrying",
                                chunk.id, i)
                    try:
                        block = _verified(chunk, block_list, self._get(chunk, [i], deadline), i, i)
                    except HypermeshError as exc:
                        out[i] = exc
                        continue
                    if block is None:
                        self.stats.add("corrupt_blocks")
                        out[i] = CorruptData(
                            f"block {i} of chunk {chunk.id}: the store's bytes do not match "
                            f"their digest (twice)"
                        )
                        continue
                out[i] = (block, "store")
        return out

    def _from_peer(
        self,
        chunk: ChunkInfo,
        block_list: bytes,
        todo: list[int],
        out: dict[int, _Result | BaseException],
    ) -> list[int]:
        """Ask the peer hook for the run; verified blocks go to ``out``; the rest returned."""
        assert self.peer_fetch is not None
        start = block_span(todo[0], chunk.size)[0]
        end = sum(block_span(todo[-1], chunk.size))
        try:
            data = self.peer_fetch(chunk.id, start, end - start)
        except Exception as exc:  # a peer's trouble is never the reader's
            log.debug("peer fetch of chunk %s failed: %s", chunk.id, exc)
            data = None
        if data is None or len(data) != end - start:
            return todo
        self.stats.add("peer_bytes", len(data))
        view = memoryview(data)
        left = []
        for i in todo:
            block = _verified(chunk, block_list, view, todo[0], i)
            if block is None:
                left.append(i)
            else:
                out[i] = (block, "peer")
        if left:
            self.stats.add("peer_corrupt_blocks", len(left))
            log.warning("chunk %s blocks %s: bad bytes from a peer, reading the store",
                        chunk.id, left)
        return left

    def _get(self, chunk: ChunkInfo, run: list[int], deadline: float) -> memoryview:
        """One ranged GET of a run of blocks, transient errors retried until the deadline."""
        start = block_span(run[0], chunk.size)[0]
        end = sum(block_span(run[-1], chunk.size))
        buf = self.buffers.get(end - start)  # aligned blocks: cached without a copy
        try:
            self._retry(lambda: self.store.get_range_into(chunk_key(chunk.id), start, buf),
                        deadline)
        except NoSuchObject as exc:
            raise CorruptData(f"chunk {chunk.id} is missing from {self.store.url}") from exc
        self.stats.add("store_bytes", len(buf))
        return buf

    def _retry(self, get: Callable[[], T], deadline: float) -> T:
        """``get()`` with transient errors retried until ``deadline`` (not even tried
        past it: a fetch queued so long has no reader left); GETs counted."""
        if time.monotonic() >= deadline:
            raise StoreUnavailable("the deadline passed before the fetch started")
        attempts = 0

        def once() -> T:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self.stats.add("store_retries")
            self.stats.add("store_gets")
            return get()

        return retry_transient(
            once,
            max(0.0, deadline - time.monotonic()),
            first_delay_s=self.config.first_delay_s,
            max_delay_s=self.config.max_delay_s,
        )

    # ------------------------------------------------------------- block lists
    def _block_list(self, chunk: ChunkInfo, deadline: float) -> bytes:
        """The chunk's block list: in memory, in the cache's records, or fetched."""
        cid = chunk.id
        with self._lock:
            found = self._lists.get(cid)
            if found is not None:
                self._lists.move_to_end(cid)
                return found
        found = self.cache.block_list(cid)
        if found is not None:
            return self._keep_list(chunk, found)
        return self._list_flights.get(
            cid, lambda dl: self._keep_list(chunk, self._load_block_list(chunk, dl)),
            deadline, f"block list of chunk {cid}",
        )

    def _keep_list(self, chunk: ChunkInfo, block_list: bytes) -> bytes:
        self.cache.admit(chunk.id, chunk.size, block_list)
        with self._lock:
            self._lists[chunk.id] = block_list
            while len(self._lists) > self.config.block_lists:
                self._lists.popitem(last=False)
        return block_list

    def _load_block_list(self, chunk: ChunkInfo, deadline: float) -> bytes:
        for _attempt in range(2):
            try:
                data = self._retry(lambda: self.store.get(blocks_key(chunk.id)), deadline)
            except NoSuchObject as exc:
                raise CorruptData(
                    f"block list of chunk {chunk.id} is missing from {self.store.url}"
                ) from exc
            self.stats.add("store_bytes", len(data))
            if names(chunk.id, data) and len(data) == 32 * block_count(chunk.size):
                return data
            self.stats.add("corrupt_blocks")
            log.warning("block list of chunk %s: bad bytes from the store", chunk.id)
        raise CorruptData(f"block list of chunk {chunk.id}: does not match the chunk id (twice)")

    # --------------------------------------------------------------- prefetch
    def prefetch(
        self, chunk: ChunkInfo, offset: int, length: int, sink: BlockSink | None = None
    ) -> None:
        """Fetch the blocks of a range in the background; returns at once.

        Blocks cached or in flight are skipped; runs that do not fit the queue are
        dropped (prefetch is advice). Errors are logged, never raised. ``sink`` gets
        the blocks this prefetch fetched (not those it skipped), from a fetch thread;
        it must not block.
        """
        length = min(length, chunk.size - offset)
        if length <= 0:
            return
        first, last = offset // BLOCK_SIZE, (offset + length - 1) // BLOCK_SIZE
        step = self.config.run_blocks
        for start in range(first, last + 1, step):
            with self._lock:
                if self._prefetch_pending >= self.config.prefetch_queue:
                    return
                self._prefetch_pending += 1
            blocks = range(start, min(last + 1, start + step))
            try:
                self._prefetch_pool.submit(self._prefetch_run, chunk, blocks, sink)
            except RuntimeError:
                with self._lock:
                    self._prefetch_pending -= 1
                return

    def _prefetch_run(self, chunk: ChunkInfo, blocks: range, sink: BlockSink | None) -> None:
        try:
            deadline = time.monotonic() + self.config.deadline_s
            block_list = self._block_list(chunk, deadline)
            _waits, new = self._claim(chunk, blocks, deadline)
            for run in runs(new, self.config.run_blocks):
                self._fetch_run(chunk, block_list, run, deadline, sink, stream=sink is not None)
                self.stats.add("prefetched_blocks", len(run))
        except HypermeshError as exc:
            log.debug("prefetch of chunk %s blocks %s failed: %s", chunk.id, blocks, exc)
        except Exception:
            log.exception("prefetch of chunk %s failed", chunk.id)
        finally:
            with self._lock:
                self._prefetch_pending -= 1

    def _note_misses(self, chunk: ChunkInfo, blocks: list[int]) -> None:
        """Prefetch the rest of a chunk once enough distinct blocks of it were missed."""
        want = self.config.whole_chunk_after
        if not want:
            return
        with self._lock:
            seen = self._missed.get(chunk.id)
            if seen is None:
                seen = self._missed[chunk.id] = set()
                while len(self._missed) > 1024:
                    self._missed.popitem(last=False)
            if len(seen) >= want:
                return
            seen.update(blocks)
            whole = len(seen) >= want
        if whole:
            self.prefetch(chunk, 0, chunk.size)

    def close(self) -> None:
        """Drop queued fetches and wait for running ones (each bounded by its deadline)."""
        self._prefetch_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prefetch_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._list_flights.close()


def _settle(
    futures: dict[int, _Claim | None], results: dict[int, _Result | BaseException]
) -> None:
    """Give each future that is not done yet its block's result or error."""
    for i, fut in futures.items():
        if fut is not None:
            set_once(fut, results[i])


def _verified(
    chunk: ChunkInfo, block_list: bytes, data: memoryview, first: int, index: int
) -> memoryview | None:
    """Block ``index`` out of ``data`` (which starts at block ``first``) if it verifies."""
    start, length = block_span(index, chunk.size)
    base = block_span(first, chunk.size)[0]
    block = data[start - base : start - base + length]
    digest = block_digest(block, hash_of(chunk.id)) if len(block) == length else b""
    if digest != block_list[32 * index : 32 * index + 32]:
        return None
    return block


# ------------------------------------------------------------------------- files
class Readahead:
    """Per open file: tells sequential reads apart and says how far ahead to fetch.

    A read that starts at offset 0, or near where the last one ended (within
    ``slack``, two steps by default: the kernel may have several reads of one file in
    flight, and pages pushed into its cache are never asked for), is sequential;
    each one doubles the window (from ``start`` up to ``maximum``). Anything else resets
    it. Advice comes in pieces of at least ``step`` bytes (one ranged GET's worth) once
    the window is that large. Pure logic; the caller serialises calls.
    """

    def __init__(
        self, start: int, maximum: int, step: int = 8 * MiB, slack: int | None = None
    ) -> None:
        self.start, self.maximum, self.step = start, maximum, step
        self.slack = 2 * step if slack is None else slack
        self.lock = threading.Lock()  # for callers that share one between threads
        self.window = 0
        self._next: int | None = None
        self._ahead = 0

    @property
    def asked_end(self) -> int:
        """The end of the furthest read of the file seen (0 before any)."""
        return self._next or 0

    def advise(self, offset: int, length: int, size: int) -> tuple[int, int] | None:
        """The file range ``(offset, length)`` to prefetch after this read, if any."""
        end = offset + length
        sequential = offset == 0 or (
            self._next is not None and self._next - self.slack <= offset <= self._next + self.slack
        )
        if sequential:
            self.window = min(self.maximum, max(self.start, self.window * 2))
            self._next = max(end, self._next or 0) if offset else end
            if offset == 0:
                self._ahead = 0
        else:
            self.window, self._next, self._ahead = 0, end, 0
            return None
        target = min(size, self._next + self.window)
        begin = max(self._next, self._ahead)
        if target <= begin or (target - begin < min(self.step, self.window) and target < size):
            return None
        self._ahead = target
        return begin, target - begin


class FileReader:
    """Reads of files of one data set version: file ranges → chunk ranges.

    Guarantees the bytes returned are the file's bytes (or an error); ``readahead``,
    when given, is consulted and its advice handed to the reader's prefetch. With
    ``push`` too, what that prefetch fetches is handed to ``push`` as page-aligned file
    ranges (see :func:`push_pages`), so the kernel need not ask for it.
    """

    def __init__(self, reader: ChunkReader, chunks: tuple[ChunkInfo, ...]) -> None:
        self.reader = reader
        self.chunks = chunks

    def _pieces(
        self, entry: Entry, offset: int, length: int
    ) -> list[tuple[ChunkInfo, int, int, int]]:
        """``(chunk, chunk offset, length, file offset)`` of the extents under a file range."""
        end = min(entry.size, offset + length)
        out: list[tuple[ChunkInfo, int, int, int]] = []
        extents = entry.extents
        i = max(0, bisect.bisect_right(extents, offset, key=lambda e: e.file_offset) - 1)
        while i < len(extents) and offset < end:
            ext = extents[i]
            lo, hi = max(offset, ext.file_offset), min(end, ext.file_offset + ext.length)
            if hi > lo:
                chunk_offset = ext.chunk_offset + lo - ext.file_offset
                out.append((self.chunks[ext.chunk], chunk_offset, hi - lo, lo))
                offset = hi
            i += 1
        return out

    def read_cached(self, entry: Entry, offset: int, length: int) -> bytes | None:
        """Like :meth:`read` for a file of at most one block, when all its bytes are
        in the cache already; None otherwise (then call :meth:`read` in a thread).
        Larger files always go through :meth:`read`, which drives their prefetch."""
        if entry.size > BLOCK_SIZE:
            return None
        data = []
        for chunk, start, size, _ in self._pieces(entry, offset, length):
            piece = self.reader.read_cached(chunk, start, size)
            if piece is None:
                return None
            data.append(piece)
        self.reader.stats.add("file_reads")
        return data[0] if len(data) == 1 else b"".join(data)

    def read(
        self,
        entry: Entry,
        offset: int,
        length: int,
        readahead: Readahead | None = None,
        push: PagePush | None = None,
    ) -> bytes | memoryview:
        """Bytes ``[offset, offset+length)`` of file ``entry`` (cut at its end)."""
        self.reader.stats.add("file_reads")
        pieces = self._pieces(entry, offset, length)
        if readahead is not None:
            with readahead.lock:
                advice = readahead.advise(offset, length, entry.size)
            if advice is not None:
                for chunk, start, size, at in self._pieces(entry, *advice):
                    sink = None
                    if push is not None:
                        sink = functools.partial(
                            push_pages, push, entry.size, at - start, start, start + size
                        )
                    self.reader.prefetch(chunk, start, size, sink)
        sequential = (
            readahead is not None and readahead.window > 0 and offset + length < entry.size
        )
        deadline = time.monotonic() + self.reader.config.deadline_s  # one for all pieces
        data = [
            self.reader.read(chunk, start, size, sequential, deadline)
            for chunk, start, size, _ in pieces
        ]
        return data[0] if len(data) == 1 else b"".join(data)


def push_pages(
    push: PagePush,
    file_size: int,
    delta: int,
    lo: int,
    hi: int,
    chunk: ChunkInfo,
    first: int,
    blocks: list[memoryview],
) -> None:
    """Hand prefetched blocks to ``push`` as file ranges the page cache can take whole.

    The blocks (from block ``first`` of ``chunk``) cover chunk bytes; the file's bytes
    are chunk range ``[lo, hi)`` at file offset ``chunk offset + delta``. Pushed:
    whole pages only (the end of the file may end one), in pieces of at most a block,
    and never the run's first block — the kernel still asks for that one, and its
    read keeps the file's readahead going (a clock read every run, not every MiB).
    Zero-copy when block and page boundaries coincide; otherwise the run is joined once.
    """
    if len(blocks) < 2:
        return
    base = (first + 1) * BLOCK_SIZE
    blocks = blocks[1:]
    start = max(lo, base)
    end = min(hi, base + sum(len(b) for b in blocks))
    a = -(-(start + delta) // PAGE) * PAGE - delta  # chunk offsets of whole file pages
    b = end if end + delta == file_size else (end + delta) // PAGE * PAGE - delta
    if b <= a:
        return
    if delta % PAGE == 0:
        for k, block in enumerate(blocks):
            c0 = base + k * BLOCK_SIZE
            s, e = max(a, c0), min(b, c0 + len(block))
            if e > s:
                push(s + delta, block[s - c0 : e - c0])
        return
    joined = memoryview(b"".join(blocks))
    for s in range(a, b, BLOCK_SIZE):
        push(s + delta, joined[s - base : min(s + BLOCK_SIZE, b) - base])
