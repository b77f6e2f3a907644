"""The chunk reader: only needed blocks, shared fetches, verification, deadlines, prefetch.

Faults are injected with an in-memory store; the real SeaweedFS server checks the
same paths end to end (including a server that stops and comes back).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hypermesh.chunkfs.cache import ChunkCache
from hypermesh.chunkfs.fetch import (
    PAGE,
    ChunkReader,
    FetchConfig,
    FileReader,
    Readahead,
    push_pages,
    runs,
)
from hypermesh.chunkfs.format import ChunkInfo, Entry, Extent, blocks_key, chunk_key, hash_of
from hypermesh.chunkfs.store import ObjectStore, S3Store
from hypermesh.errors import CorruptData, NoSuchObject, StoreUnavailable
from hypermesh.local.processes import wait_for
from hypermesh.local.s3server import S3Server
from tests.chunkfs.test_chunkfs_cache import Chunk

MiB = 1 << 20
CONFIG = FetchConfig(deadline_s=3.0, range_bytes=4 * MiB, threads=4, prefetch_threads=2,
                     whole_chunk_after=0, max_delay_s=0.1)


class FakeStore(ObjectStore):
    """Objects in a dict; counts ranged GETs; hooks to corrupt, fail or stall them."""

    url = "mem://"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.ranges: list[tuple[str, int, int]] = []
        self.fail = 0  # how many of the next calls raise StoreUnavailable (-1: all)
        self.mangle: Callable[[str, int, bytes], bytes] | None = None
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def _maybe_fail(self, key: str) -> None:
        with self._lock:
            if self.fail:
                self.fail -= self.fail > 0
                raise StoreUnavailable(f"{key}: injected outage")

    def get(self, key: str) -> bytes:
        self._maybe_fail(key)
        if key not in self.objects:
            raise NoSuchObject(key)
        return self.objects[key]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self._lock:
            self.ranges.append((key, start, length))
        if self.gate is not None:
            assert self.gate.wait(10)
        self._maybe_fail(key)
        data = self.get(key)[start : start + length]
        return self.mangle(key, start, data) if self.mangle else data

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.objects[key] = bytes(data)

    def put_file(self, key: str, path: object) -> None:
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        return len(self.objects[key]) if key in self.objects else None

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from sorted(k for k in self.objects if k.startswith(prefix))


def put_chunk(store: ObjectStore, chunk: Chunk) -> ChunkInfo:
    store.put(chunk_key(chunk.id), chunk.data)
    store.put(blocks_key(chunk.id), chunk.block_list)
    return ChunkInfo(chunk.id, chunk.size)


def read_or_none(reader: ChunkReader, info: ChunkInfo, offset: int, length: int) -> bytes | None:
    """The bytes, or None while the store is unavailable (or the chunk is held after it
    was: for one deadline after a failure)."""
    try:
        return bytes(reader.read(info, offset, length))
    except StoreUnavailable:
        return None


@pytest.fixture
def fake() -> FakeStore:
    return FakeStore()


def make_reader(
    store: ObjectStore, tmp_path: Path, config: FetchConfig = CONFIG, **kw: object
) -> Iterator[ChunkReader]:
    reader = ChunkReader(store, ChunkCache(tmp_path / "cache", 256 * MiB), config, **kw)  # type: ignore[arg-type]
    try:
        yield reader
    finally:
        reader.close()


@pytest.fixture
def reader(fake: FakeStore, tmp_path: Path) -> Iterator[ChunkReader]:
    yield from make_reader(fake, tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("range_bytes", MiB + 1, "range_bytes"), ("threads", 0, "threads"),
     ("buffers", -1, "buffers"), ("readahead_start", 0, "readahead_start")],
)
def test_fetch_config_names_what_is_out_of_range(field: str, value: int, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        FetchConfig(**{field: value})  # type: ignore[arg-type]


def test_runs_coalesce_adjacent_blocks_up_to_a_limit() -> None:
    assert runs([5, 1, 2, 3, 7, 8, 9, 10, 11], 4) == [[1, 2, 3], [5], [7, 8, 9, 10], [11]]
    assert runs([], 4) == []


def test_a_read_fetches_only_the_blocks_it_needs(fake: FakeStore, reader: ChunkReader) -> None:
    chunk = Chunk(8 * MiB + 5, 1)
    info = put_chunk(fake, chunk)
    assert reader.read(info, 3 * MiB + 10, 100) == chunk.data[3 * MiB + 10 : 3 * MiB + 110]
    assert fake.ranges == [(chunk_key(chunk.id), 3 * MiB, MiB)]
    # a range across blocks 3-8 is one 4 MiB run plus one run for the rest, block 3 cached
    assert reader.read(info, 3 * MiB, 6 * MiB) == chunk.data[3 * MiB : 9 * MiB]
    assert fake.ranges[1:] == [(chunk_key(chunk.id), 4 * MiB, 4 * MiB),
                               (chunk_key(chunk.id), 8 * MiB, 5)]
    stats = reader.stats.snapshot()
    assert stats["store_gets"] == 4  # the block list and three ranges
    assert stats["store_bytes"] == MiB + 4 * MiB + 5 + len(chunk.block_list)
    # block 3 came from the cache, or from its fetch if that was still being cached
    assert stats["blocks"]["cache"] + stats["blocks"]["store"] == 7
    assert stats["blocks"]["peer"] == 0
    # everything is cached now: no more GETs
    assert reader.read(info, 0 + 3 * MiB, 5 * MiB + 5) == chunk.data[3 * MiB :]
    assert len(fake.ranges) == 3


def test_concurrent_reads_of_a_block_share_one_get(
    fake: FakeStore, reader: ChunkReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = Chunk(2 * MiB, 2)
    info = put_chunk(fake, chunk)
    fake.gate = threading.Event()
    claimed = []
    claim = reader._claim

    def counting_claim(*args: object) -> object:
        result = claim(*args)  # type: ignore[arg-type]
        claimed.append(1)
        return result

    monkeypatch.setattr(reader, "_claim", counting_claim)
    results: list[bytes] = []
    threads = [
        threading.Thread(
            target=lambda o=o: results.append(bytes(reader.read(info, MiB + o, 1000)))
        )
        for o in range(0, 8000, 1000)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: len(claimed) == 8, 10, "all readers to claim the block")
    fake.gate.set()
    for t in threads:
        t.join(10)
    want = [chunk.data[MiB + o : MiB + o + 1000] for o in range(0, 8000, 1000)]
    assert sorted(results) == sorted(want)
    assert len(fake.ranges) == 1


@pytest.mark.parametrize("algo", ["blake3", "sha256"])
def test_a_corrupt_block_is_never_returned(
    fake: FakeStore, reader: ChunkReader, algo: str
) -> None:
    """For chunks of both digest algorithms (SHA-256: data sets put before BLAKE3)."""
    chunk = Chunk(4 * MiB, 3, algo)
    assert hash_of(chunk.id) == algo
    info = put_chunk(fake, chunk)

    def flip_block_2(key: str, start: int, data: bytes) -> bytes:
        at = 2 * MiB + 77 - start
        if 0 <= at < len(data):
            data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
        return data

    fake.mangle = flip_block_2
    with pytest.raises(CorruptData):
        reader.read(info, 0, 4 * MiB)
    assert reader.read(info, MiB, 100) == chunk.data[MiB : MiB + 100]
    with pytest.raises(CorruptData):
        reader.read(info, 2 * MiB, 10)
    assert not reader.cache.ready(chunk.id, 2)
    assert reader.stats.snapshot()["corrupt_blocks"] >= 2
    fake.mangle = None  # the store heals: the block is fetched again, not remembered as bad
    assert reader.read(info, 2 * MiB, 10) == chunk.data[2 * MiB : 2 * MiB + 10]


def test_wrong_bytes_once_are_fetched_again(fake: FakeStore, reader: ChunkReader) -> None:
    chunk = Chunk(MiB, 4)
    info = put_chunk(fake, chunk)
    bad = [True]

    def once(key: str, start: int, data: bytes) -> bytes:
        if bad.pop() if bad else False:
            return bytes(len(data))
        return data

    fake.mangle = once
    assert reader.read(info, 0, MiB) == chunk.data
    assert len(fake.ranges) == 2


def test_a_bad_block_list_is_rejected(fake: FakeStore, reader: ChunkReader) -> None:
    chunk = Chunk(2 * MiB, 5)
    info = put_chunk(fake, chunk)
    fake.objects[blocks_key(chunk.id)] = Chunk(2 * MiB, 6).block_list
    with pytest.raises(CorruptData):
        reader.read(info, 0, 10)
    del fake.objects[chunk_key(chunk.id)]
    fake.objects[blocks_key(chunk.id)] = chunk.block_list
    with pytest.raises(CorruptData, match="missing"):
        reader.read(info, 0, 10)


def test_transient_errors_are_retried_and_an_outage_fails_at_the_deadline(
    fake: FakeStore, reader: ChunkReader
) -> None:
    chunk = Chunk(2 * MiB, 7)
    info = put_chunk(fake, chunk)
    fake.fail = 3
    assert reader.read(info, 0, 10) == chunk.data[:10]
    assert reader.stats.snapshot()["store_retries"] >= 1
    fake.fail = -1
    with pytest.raises(StoreUnavailable):
        reader.read(info, MiB, 10)
    fake.fail = 0
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):  # the chunk is held for one deadline
        reader.read(info, MiB, 10)
    assert time.monotonic() - start < 0.5
    assert reader.read(info, 0, 10) == chunk.data[:10]  # cached blocks are still served
    got = wait_for(functools.partial(read_or_none, reader, info, MiB, 10),
                   CONFIG.deadline_s + 2, "the hold to end", interval=0.1)
    assert got == chunk.data[MiB : MiB + 10]


def test_peer_bytes_are_used_when_right_and_ignored_when_wrong(
    fake: FakeStore, tmp_path: Path
) -> None:
    chunk = Chunk(3 * MiB, 8)
    info = put_chunk(fake, chunk)
    asked: list[tuple[str, int, int]] = []

    def peer(cid: str, offset: int, length: int) -> bytes | None:
        asked.append((cid, offset, length))
        data = chunk.data[offset : offset + length]
        return data if offset == 0 else bytes(length)  # wrong bytes past block 0

    for reader in make_reader(fake, tmp_path, peer_fetch=peer):
        assert reader.read(info, 0, 10) == chunk.data[:10]
        assert fake.ranges == []
        assert reader.read(info, MiB, 2 * MiB) == chunk.data[MiB:]
        assert fake.ranges == [(chunk_key(chunk.id), MiB, 2 * MiB)]
        assert asked == [(chunk.id, 0, MiB), (chunk.id, MiB, 2 * MiB)]
        assert reader.stats.snapshot()["blocks"] == {"cache": 0, "peer": 1, "store": 2}


def test_a_restarted_reader_uses_the_cache_on_disk(fake: FakeStore, tmp_path: Path) -> None:
    chunk = Chunk(2 * MiB, 9)
    info = put_chunk(fake, chunk)
    for reader in make_reader(fake, tmp_path):
        assert reader.read(info, 0, 2 * MiB) == chunk.data
        reader.close()  # waits for blocks still being written to the cache
        reader.cache.close()
    gets = len(fake.ranges)
    for reader in make_reader(fake, tmp_path):
        assert reader.read(info, 0, 2 * MiB) == chunk.data
        assert reader.stats.snapshot()["store_gets"] == 0
    assert len(fake.ranges) == gets


@pytest.mark.parametrize(
    ("reads", "advice"),
    [
        # (offset, length) of successive reads of a 100 MiB file → prefetch advice
        ([(0, MiB)], [(MiB, 4 * MiB)]),
        ([(0, MiB), (MiB, MiB)], [(MiB, 4 * MiB), None]),  # less than a step is not worth it
        ([(0, MiB), (MiB, MiB), (2 * MiB, MiB)], [(MiB, 4 * MiB), None, (5 * MiB, 14 * MiB)]),
        ([(0, MiB), (50 * MiB, MiB)], [(MiB, 4 * MiB), None]),  # a jump resets
        ([(50 * MiB, MiB), (51 * MiB, MiB)], [None, (52 * MiB, 4 * MiB)]),
        ([(98 * MiB, MiB), (99 * MiB, MiB)], [None, None]),  # nothing left to fetch
        ([(0, 100)], [(100, 4 * MiB)]),
    ],
)
def test_readahead_window(
    reads: list[tuple[int, int]], advice: list[tuple[int, int] | None]
) -> None:
    ra = Readahead(4 * MiB, 64 * MiB)
    assert [ra.advise(o, n, 100 * MiB) for o, n in reads] == advice


def test_readahead_window_grows_to_its_maximum_and_keeps_ahead() -> None:
    ra = Readahead(4 * MiB, 16 * MiB)
    ahead = 0
    for i in range(40):
        advice = ra.advise(i * MiB, MiB, 1 << 40)
        if advice:
            assert advice[0] == max(ahead, (i + 1) * MiB)
            ahead = advice[0] + advice[1]
        assert ahead <= (i + 1) * MiB + 16 * MiB
    assert ra.window == 16 * MiB
    assert ahead >= 40 * MiB + 16 * MiB - 8 * MiB  # within one step of the window


def test_sequential_file_reads_prefetch_across_chunks(fake: FakeStore, reader: ChunkReader) -> None:
    a, b = Chunk(4 * MiB, 10), Chunk(4 * MiB, 11)
    chunks = (put_chunk(fake, a), put_chunk(fake, b))
    entry = Entry("", "big", "f", 0o644, 0, 7 * MiB, (
        Extent(0, 0, 4 * MiB, 0), Extent(1, 0, 3 * MiB, 4 * MiB)))
    files = FileReader(reader, chunks)
    ra = Readahead(4 * MiB, 64 * MiB)
    assert files.read(entry, 0, MiB, ra) == a.data[:MiB]
    wait_for(lambda: reader.cache.ready(b.id, 0), 10, "the next chunk to be prefetched")
    data = b"".join(files.read(entry, o, MiB, ra) for o in range(MiB, 7 * MiB, MiB))
    assert data == a.data[MiB:] + b.data[: 3 * MiB]
    assert files.read(entry, 7 * MiB - 10, 100) == b.data[3 * MiB - 10 : 3 * MiB]
    # A prefetch run counts its blocks after it has handed them to the cache, so a read
    # it unblocked can finish before the count moves: wait for it, do not sample it. How
    # many it counts depends on the race with the reads (a block a read claimed first is
    # skipped by a later run), but b's first block came from one, and no byte of either
    # chunk was fetched twice: reads and prefetch runs shared their fetches.
    wait_for(lambda: reader.stats.snapshot()["prefetched_blocks"] >= 1, 10,
             "the prefetch runs to count their blocks")
    for key in {k for k, _, _ in fake.ranges}:
        spans = sorted((start, start + length) for k, start, length in fake.ranges if k == key)
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans


def test_a_prefetch_hands_blocks_on_before_caching_them_around_the_page_cache(
    fake: FakeStore, reader: ChunkReader
) -> None:
    """What a sequential read prefetched reaches the page-store sink first (a cache
    write must not delay bytes a reader is about to ask for), then the cache, written
    around the page cache (the mount's own pages hold those bytes)."""
    chunk = Chunk(12 * MiB, 13)
    info = put_chunk(fake, chunk)
    entry = Entry("", "big", "f", 0o644, 0, chunk.size, (Extent(0, 0, chunk.size, 0),))
    pushed: list[tuple[int, bytes, bool]] = []

    def push(offset: int, data: memoryview | bytes) -> None:
        cached = reader.cache.verified(chunk.id, offset // MiB)
        pushed.append((offset, bytes(data), cached))

    files = FileReader(reader, (info,))
    ra = Readahead(4 * MiB, 64 * MiB, step=4 * MiB)
    for offset in range(0, chunk.size, MiB):
        assert files.read(entry, offset, MiB, ra, push) == chunk.data[offset : offset + MiB]
    wait_for(lambda: all(reader.cache.verified(chunk.id, i) for i in range(12)), 10,
             "the prefetch to cache every block")
    assert pushed, "nothing was pushed"
    for offset, data, cached in pushed:
        assert data == chunk.data[offset : offset + len(data)]
        assert not cached, f"block at {offset} was cached before it was pushed"
    assert reader.stats.snapshot()["direct_bytes"] >= 8 * MiB
    assert reader.buffers.fresh == 0


# --------------------------------------------------------------- the real server
def test_real_store_reads_and_survives_a_server_restart(
    s3_server: S3Server, store: S3Store, tmp_path: Path
) -> None:
    chunk = Chunk(6 * MiB + 3, 12)
    info = put_chunk(store, chunk)
    for reader in make_reader(store, tmp_path):
        assert reader.read(info, 5 * MiB, MiB + 3) == chunk.data[5 * MiB :]
        assert reader.stats.snapshot()["store_bytes"] == MiB + 3 + len(chunk.block_list)
        s3_server.stop()
        try:
            with pytest.raises(StoreUnavailable):
                reader.read(info, 0, 10)
        finally:
            s3_server.start()
        got = wait_for(functools.partial(read_or_none, reader, info, 0, 5 * MiB),
                       CONFIG.deadline_s + 2, "a read once the server is back", interval=0.1)
        assert got == chunk.data[: 5 * MiB]


def test_read_cached_serves_verified_blocks_only_and_never_fetches(
    fake: FakeStore, reader: ChunkReader
) -> None:
    chunk = Chunk(3 * MiB, 2)
    info = put_chunk(fake, chunk)
    assert reader.read_cached(info, MiB + 7, 100) is None  # nothing cached yet
    assert fake.ranges == []  # ...and asking fetched nothing
    reader.read(info, MiB, 10)  # brings block 1
    wait_for(lambda: reader.cache.verified(info.id, 1), 10, "block 1 to be cached")
    assert reader.read_cached(info, MiB + 7, 100) == chunk.data[MiB + 7 : MiB + 107]
    assert reader.read_cached(info, MiB + 7, MiB) is None  # spills into block 2: not cached
    assert len(fake.ranges) == 1


def _pushed(file: bytes, delta: int, lo: int, hi: int, first: int, chunk: bytes) -> list[int]:
    """Run ``push_pages`` over the blocks of ``chunk`` from ``first``; check every push
    against ``file`` (whole pages, at most a block each) and return their offsets."""
    mib = 1 << 20
    blocks = [memoryview(chunk)[i : i + mib] for i in range(first * mib, len(chunk), mib)]
    got: list[tuple[int, bytes]] = []
    push_pages(lambda off, data: got.append((off, bytes(data))), len(file), delta, lo, hi,
               None, first, blocks)  # type: ignore[arg-type]
    for off, data in got:
        assert off % PAGE == 0 and 0 < len(data) <= mib
        assert len(data) % PAGE == 0 or off + len(data) == len(file)
        assert data == file[off : off + len(data)]
    return [off for off, _ in got]


def test_push_pages_skips_the_runs_first_block_and_shares_aligned_blocks() -> None:
    mib = 1 << 20
    chunk = bytes(range(256)) * (4 * mib // 256) + b"tail" * 25  # 4 MiB + 100 bytes
    offsets = _pushed(chunk, 0, 0, len(chunk), 0, chunk)
    assert offsets == [1 * mib, 2 * mib, 3 * mib, 4 * mib]  # block 0 left to the kernel


def test_push_pages_of_a_file_that_starts_mid_page_pushes_whole_pages_only() -> None:
    mib = 1 << 20
    head = 5000  # another file's bytes before this one in the chunk
    chunk = bytes(head) + bytes((i * 7) % 251 for i in range(3 * mib))
    file = chunk[head:]
    offsets = _pushed(file, -head, head, len(chunk), 0, chunk)
    first_page = -(-(mib - head) // PAGE) * PAGE
    assert offsets[0] == first_page  # the page that straddles blocks 0 and 1 is not pushed
    assert offsets == list(range(first_page, len(file), mib))
    # a file that ends mid-chunk: the last partial page is not pushed either
    offsets = _pushed(file[: 2 * mib + 10], -head, head, head + 2 * mib + 10, 0, chunk)
    assert offsets and offsets[-1] < 2 * mib


def test_push_pages_pushes_nothing_for_a_one_block_run() -> None:
    chunk = bytes(1 << 20)
    assert _pushed(chunk, 0, 0, len(chunk), 0, chunk) == []

