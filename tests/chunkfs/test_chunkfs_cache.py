"""The chunk cache on its own: bound, LRU, pinning, restart, distrust of old data."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from hypermesh.chunkfs.buffers import aligned_buffer
from hypermesh.chunkfs.cache import (
    SOLE,
    SPARE,
    UNSURE,
    ChunkCache,
    block_span,
    keep_rank,
)
from hypermesh.chunkfs.datasets import parse_spec
from hypermesh.chunkfs.format import (
    BLAKE3,
    BLOCK_SIZE,
    block_count,
    block_digest,
    chunk_id,
    shard,
    valid_chunk_id,
    valid_dataset_name,
)
from hypermesh.chunkfs.holdings import read_holding, read_range
from hypermesh.errors import UsageError

MiB = 1 << 20


class Chunk:
    """A chunk of deterministic pseudo-random bytes with its block list and id
    (BLAKE3 digests, as ``data put`` writes them, unless ``algo`` says otherwise)."""

    def __init__(self, size: int, seed: int, algo: str = BLAKE3) -> None:
        self.size = size
        self.data = random.Random(seed).randbytes(size)
        self.block_list = b"".join(
            block_digest(self.data[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE], algo)
            for i in range(block_count(size))
        )
        self.id = chunk_id(self.block_list, algo)

    def block(self, index: int) -> bytes:
        start, length = block_span(index, self.size)
        return self.data[start : start + length]


def fill(cache: ChunkCache, chunk: Chunk, blocks: range | list[int] | None = None) -> None:
    cache.admit(chunk.id, chunk.size, chunk.block_list)
    for i in blocks if blocks is not None else range(block_count(chunk.size)):
        assert cache.put_block(chunk.id, i, chunk.block(i))


def test_put_then_read_any_range(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 * MiB)
    chunk = Chunk(3 * MiB + 123, 1)
    fill(cache, chunk)
    assert all(cache.ready(chunk.id, i) for i in range(4))
    with cache.pin(chunk.id):
        assert cache.read(chunk.id, 0, chunk.size) == chunk.data
        assert cache.read(chunk.id, MiB - 5, 10) == chunk.data[MiB - 5 : MiB + 5]
    assert cache.used_bytes == chunk.size
    # sparse: only written blocks take space
    other = Chunk(8 * MiB, 2)
    fill(cache, other, [5])
    assert cache.present(other.id) == [5]
    assert not cache.ready(other.id, 4)
    assert os.stat(tmp_path / "v1" / shard(other.id) / f"{other.id}.data").st_blocks * 512 < 2 * MiB


def test_direct_writes_read_back_whatever_the_alignment(tmp_path: Path) -> None:
    """Blocks put ``direct`` (around the page cache) from an aligned buffer, from plain
    bytes (copied into an aligned one) and a chunk's short last block (too short for
    O_DIRECT: written the normal way) all read back, also after a restart."""
    cache = ChunkCache(tmp_path, 16 * MiB)
    chunk = Chunk(3 * MiB + 4096 + 123, 3)
    cache.admit(chunk.id, chunk.size, chunk.block_list)
    buf = aligned_buffer(2 * MiB)
    buf[:] = chunk.data[: 2 * MiB]
    assert cache.put_block(chunk.id, 0, buf[:MiB], direct=True)
    assert cache.put_block(chunk.id, 1, buf[MiB:], direct=True)
    assert cache.put_block(chunk.id, 2, chunk.block(2), direct=True)
    assert cache.put_block(chunk.id, 3, chunk.block(3), direct=True)
    assert cache.stats.snapshot()["direct_bytes"] == 3 * MiB
    with cache.pin(chunk.id):
        assert cache.read(chunk.id, 0, chunk.size) == chunk.data
    cache.close()
    again = ChunkCache(tmp_path, 16 * MiB)
    assert all(again.ready(chunk.id, i) for i in range(4))
    with again.pin(chunk.id):
        assert again.read(chunk.id, 0, chunk.size) == chunk.data


def test_a_file_system_that_refuses_direct_writes_gets_normal_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ChunkCache(tmp_path, 16 * MiB)
    chunk = Chunk(2 * MiB, 4)
    cache.admit(chunk.id, chunk.size, chunk.block_list)
    tries = []

    def refuse(rec: object) -> int:
        tries.append(rec)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(cache, "_direct_fd", refuse)
    assert cache.put_block(chunk.id, 0, chunk.block(0), direct=True)
    assert cache.put_block(chunk.id, 1, chunk.block(1), direct=True)
    assert len(tries) == 1  # refused once: not asked again
    assert cache.stats.snapshot()["direct_bytes"] == 0
    with cache.pin(chunk.id):
        assert cache.read(chunk.id, 0, chunk.size) == chunk.data


def test_admit_rejects_a_block_list_that_is_not_the_chunks(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 16 * MiB)
    chunk = Chunk(2 * MiB, 1)
    with pytest.raises(ValueError):
        cache.admit(chunk.id, chunk.size, chunk.block_list[:-1] + b"x")
    with pytest.raises(ValueError):
        cache.admit(chunk.id, chunk.size + MiB, chunk.block_list)


def test_bound_evicts_least_recently_used_whole_chunks(tmp_path: Path) -> None:
    events: list[tuple[str, bool]] = []
    cache = ChunkCache(tmp_path, 6 * MiB, on_change=lambda c, e: events.append((c, e)))
    a, b, c = Chunk(2 * MiB, 1), Chunk(2 * MiB, 2), Chunk(2 * MiB, 3)
    fill(cache, a)
    fill(cache, b)
    fill(cache, c)
    assert cache.used_bytes == 6 * MiB
    with cache.pin(a.id):  # touch a: b is now the least recently used
        pass
    d = Chunk(MiB, 4)
    fill(cache, d)
    assert cache.used_bytes <= 6 * MiB
    assert b.id not in cache.chunk_ids()
    assert set(cache.chunk_ids()) == {a.id, c.id, d.id}
    assert events == [(a.id, True), (b.id, True), (c.id, True), (b.id, False), (d.id, True)]
    assert not (tmp_path / "v1" / shard(b.id) / f"{b.id}.data").exists()


def test_pinned_chunks_are_not_evicted_and_a_block_that_does_not_fit_is_refused(
    tmp_path: Path,
) -> None:
    cache = ChunkCache(tmp_path, 4 * MiB)
    a, b = Chunk(2 * MiB, 1), Chunk(2 * MiB, 2)
    fill(cache, a)
    fill(cache, b)
    c = Chunk(2 * MiB, 3)
    cache.admit(c.id, c.size, c.block_list)
    with cache.pin(a.id), cache.pin(b.id):
        assert not cache.put_block(c.id, 0, c.block(0))
        assert cache.used_bytes == 4 * MiB
    with cache.pin(a.id):
        assert cache.put_block(c.id, 0, c.block(0))
    assert set(cache.chunk_ids()) == {a.id, c.id}
    assert cache.used_bytes <= 4 * MiB


def test_restart_keeps_blocks_and_reverifies_them(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 64 * MiB)
    a, b = Chunk(3 * MiB, 1), Chunk(2 * MiB + 7, 2)
    fill(cache, a)
    fill(cache, b, [0, 2])
    cache.close()

    events: list[tuple[str, bool]] = []
    again = ChunkCache(tmp_path, 64 * MiB, on_change=lambda c, e: events.append((c, e)))
    assert sorted(events) == sorted([(a.id, True), (b.id, True)])
    assert again.used_bytes == a.size + MiB + 7
    assert again.present(b.id) == [0, 2]
    assert not again.verified(a.id, 0)  # claimed, not yet verified by this process
    assert all(again.ready(a.id, i) for i in range(3))
    assert again.verified(a.id, 0)
    with again.pin(b.id):
        assert again.ready(b.id, 2)
        assert again.read(b.id, 2 * MiB, 7) == b.data[2 * MiB :]


def test_restart_discards_blocks_that_do_not_verify(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 64 * MiB)
    a = Chunk(3 * MiB, 1)
    fill(cache, a)
    cache.close()
    data = tmp_path / "v1" / shard(a.id) / f"{a.id}.data"
    with open(data, "r+b") as f:  # a bit flip in block 1, a crash-lost write in block 2
        f.seek(MiB + 10)
        f.write(b"\xff")
        f.seek(2 * MiB)
        f.write(bytes(MiB))

    again = ChunkCache(tmp_path, 64 * MiB)
    assert again.ready(a.id, 0)
    assert not again.ready(a.id, 1)
    assert not again.ready(a.id, 2)
    assert again.present(a.id) == [0]
    assert again.used_bytes == MiB
    assert again.stats.snapshot()["corrupt_blocks"] == 2
    # the forgotten blocks can be fetched and stored again
    assert again.put_block(a.id, 1, a.block(1))
    with again.pin(a.id):
        assert again.read(a.id, 0, 2 * MiB) == a.data[: 2 * MiB]


def test_restart_drops_chunks_whose_records_cannot_be_trusted(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 64 * MiB)
    a, b, c = Chunk(MiB, 1), Chunk(MiB, 2), Chunk(MiB, 3)
    for chunk in (a, b, c):
        fill(cache, chunk)
    cache.close()
    folder = tmp_path / "v1"
    (folder / shard(a.id) / f"{a.id}.blocks").write_bytes(b"not the block list")
    (folder / shard(b.id) / f"{b.id}.have").unlink()
    (folder / shard(c.id) / f"{c.id}.have.tmp1").write_bytes(b"half-written")

    again = ChunkCache(tmp_path, 64 * MiB)
    assert again.chunk_ids() == [c.id]
    assert sorted(p.name for p in (folder / shard(a.id)).iterdir()) == []
    assert sorted(p.name for p in (folder / shard(c.id)).iterdir()) == [
        f"{c.id}.blocks",
        f"{c.id}.data",
        f"{c.id}.have",
    ]


def test_restart_with_a_smaller_bound_evicts_the_oldest(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 64 * MiB)
    chunks = [Chunk(MiB, i) for i in range(4)]
    for i, chunk in enumerate(chunks):
        fill(cache, chunk)
        cache.flush()
        have = tmp_path / "v1" / shard(chunk.id) / f"{chunk.id}.have"
        os.utime(have, (1_000_000 + i, 1_000_000 + i))
    cache.close()
    again = ChunkCache(tmp_path, 2 * MiB)
    assert again.chunk_ids() == [chunks[2].id, chunks[3].id]
    assert again.used_bytes == 2 * MiB


def test_a_block_that_must_not_evict_is_stored_only_into_free_space(tmp_path: Path) -> None:
    """Blocks a peer served (``from_peer=True``) never push out what the cache holds."""
    cache = ChunkCache(tmp_path, 2 * MiB)
    own, peer = Chunk(2 * MiB, 1), Chunk(2 * MiB, 2)
    fill(cache, own)
    cache.admit(peer.id, peer.size, peer.block_list)
    assert not cache.put_block(peer.id, 0, peer.block(0), from_peer=True)
    assert cache.present(own.id) == [0, 1] and cache.present(peer.id) == []
    assert cache.put_block(peer.id, 0, peer.block(0))  # an own fetch may evict
    assert cache.present(peer.id) == [0] and cache.used_bytes <= 2 * MiB


@pytest.mark.parametrize(
    ("copy", "elsewhere", "was_elsewhere", "rank"),
    [
        (True, True, True, SPARE),  # a copy another node holds too
        (True, False, False, UNSURE),  # a copy nobody is known to hold yet
        (True, False, True, SOLE),  # a copy whose other holders have gone
        (False, True, True, SOLE),  # fetched here from the store: kept, copies or not
        (False, False, False, SOLE),
        (False, False, True, SOLE),
    ],
)
def test_keep_rank(copy: bool, elsewhere: bool, was_elsewhere: bool, rank: int) -> None:
    assert keep_rank(copy, elsewhere, was_elsewhere) == rank


def test_eviction_drops_what_other_nodes_hold_before_what_only_this_node_holds(
    tmp_path: Path,
) -> None:
    """Lowest rank first, least recently used within a rank; a store fetch may evict
    anything, a peer's block only free space."""
    cache = ChunkCache(tmp_path, 4 * MiB)
    old_own, own, spare, unsure = (Chunk(MiB, i) for i in range(4))
    for chunk, from_peer in ((old_own, False), (own, False), (spare, True), (unsure, True)):
        cache.admit(chunk.id, chunk.size, chunk.block_list)
        assert cache.put_block(chunk.id, 0, chunk.block(0), from_peer=from_peer)
    # own is copied elsewhere too, spare is held elsewhere; unknown ids are ignored
    cache.set_elsewhere(frozenset({own.id, spare.id, "f" * 64}))
    assert cache.ranks() == {old_own.id: SOLE, own.id: SOLE, spare.id: SPARE,
                             unsure.id: UNSURE}
    peer = Chunk(MiB, 9)  # a peer's block never evicts
    cache.admit(peer.id, peer.size, peer.block_list)
    assert not cache.put_block(peer.id, 0, peer.block(0), from_peer=True)
    order: list[str] = []
    for seed in range(10, 14):
        fill(cache, Chunk(MiB, seed))
        left = {old_own.id, own.id, spare.id, unsure.id} - set(cache.chunk_ids())
        order += sorted(left - set(order))
    # the copies first although they are the most recently used; then own chunks, LRU
    assert order == [spare.id, unsure.id, old_own.id, own.id]
    assert cache.stats.snapshot()["evicted_sole"] == 2


def test_a_copy_turns_sole_when_its_other_holders_go_and_a_store_block_makes_it_own(
    tmp_path: Path,
) -> None:
    cache = ChunkCache(tmp_path, 8 * MiB)
    a, b = Chunk(2 * MiB, 1), Chunk(2 * MiB, 2)
    for chunk in (a, b):
        cache.admit(chunk.id, chunk.size, chunk.block_list)
        assert cache.put_block(chunk.id, 0, chunk.block(0), from_peer=True)
    cache.set_elsewhere(frozenset({a.id, b.id}))
    assert cache.ranks() == {a.id: SPARE, b.id: SPARE}
    cache.set_elsewhere(frozenset({b.id}))  # a's other holders evicted it or died
    assert cache.ranks()[a.id] == SOLE
    assert cache.put_block(b.id, 1, b.block(1))  # a block from the store: b is ours now
    assert cache.ranks()[b.id] == SOLE


def test_room_counts_free_space_and_chunks_other_nodes_hold(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 4 * MiB)
    own, copy = Chunk(2 * MiB, 1), Chunk(2 * MiB, 2)
    fill(cache, own)
    assert cache.has_room("x" * 64, 2 * MiB) and not cache.has_room("x" * 64, 3 * MiB)
    cache.admit(copy.id, copy.size, copy.block_list)
    for i in range(2):
        assert cache.put_block(copy.id, i, copy.block(i), from_peer=True)
    assert cache.has_room("x" * 64, 2 * MiB)  # an unsure copy may go
    cache.set_elsewhere(frozenset())  # nobody else is known to hold either
    assert cache.has_room("x" * 64, 2 * MiB)
    cache.set_elsewhere(frozenset({copy.id}))
    cache.set_elsewhere(frozenset())  # the copy's other holders are gone: it is sole
    assert not cache.has_room("x" * 64, MiB)
    assert not cache.has_room(copy.id, MiB)  # a chunk's own bytes are not room for it


@pytest.mark.parametrize(
    "cid",
    ["../../../etc/passwd", "ab/../" + "0" * 58, "0" * 63, "0" * 64 + "\n", "B3" + "0" * 64,
     "/" + "0" * 64, "0" * 64 + ".data"],
)
def test_an_id_that_is_not_a_chunk_id_names_no_file(tmp_path: Path, cid: str) -> None:
    (tmp_path / "v1").mkdir()
    with pytest.raises(ValueError, match="not a chunk id"):
        read_range(tmp_path, cid, 0, 10)
    with pytest.raises(ValueError, match="not a chunk id"):
        read_holding(tmp_path, cid)
    assert valid_chunk_id("0" * 64) and valid_chunk_id("b3" + "f" * 64)
    assert not valid_dataset_name("imagenet\n") and valid_dataset_name("imagenet-1k.v2")


@pytest.mark.parametrize("spec", ["imagenet@..", "imagenet@../x", "imagenet\n", "im/agenet",
                                  "imagenet@", "imagenet@v1\n", ".hidden@v1"])
def test_a_data_set_spec_that_could_name_a_path_is_refused(spec: str) -> None:
    with pytest.raises(UsageError, match="invalid data set"):
        parse_spec(spec)
    assert parse_spec("imagenet-1k@2024.06") == ("imagenet-1k", "2024.06")
