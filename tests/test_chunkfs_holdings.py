"""Another process's view of a chunk cache directory (what an agent reads of its mounts)."""

from __future__ import annotations

from pathlib import Path

from hypermesh.chunkfs.cache import ChunkCache
from hypermesh.chunkfs.format import MiB
from hypermesh.chunkfs.holdings import read_holding, read_range, scan

from tests.test_chunkfs_cache import Chunk, fill


def test_the_view_follows_the_caches_records(tmp_path: Path) -> None:
    a, b = Chunk(3 * MiB + 10, 1), Chunk(MiB, 2)
    cache = ChunkCache(tmp_path / "c1", 64 * MiB)
    fill(cache, a, [0, 2, 3])
    fill(cache, b)
    cache.flush()
    held = scan([tmp_path / "c1", tmp_path / "missing"])
    assert set(held) == {a.id, b.id}
    assert held[a.id].blocks == {0, 2, 3} and held[a.id].present_bytes == 2 * MiB + 10
    assert held[b.id].present_bytes == MiB

    assert read_range(tmp_path / "c1", a.id, 2 * MiB + 5, MiB) == a.data[2 * MiB + 5 : 3 * MiB + 5]
    assert read_range(tmp_path / "c1", a.id, MiB - 1, 2) is None  # block 1 was never written
    assert read_range(tmp_path / "c1", a.id, 3 * MiB, 11) is None  # past the end
    assert read_range(tmp_path / "c1", "ab" * 32, 0, 1) is None  # not cached at all

    cache.close()
    again = ChunkCache(tmp_path / "c1", MiB)  # a smaller bound: the restart evicts
    again.flush()
    after = scan([tmp_path / "c1"])
    assert sum(h.present_bytes for h in after.values()) <= MiB
    assert all(read_holding(tmp_path / "c1", cid) is not None for cid in after)
    again.close()
