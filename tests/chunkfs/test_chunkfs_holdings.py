"""Another process's view of a chunk cache directory (what an agent reads of its mounts)."""

from __future__ import annotations

from pathlib import Path

from hypermesh.chunkfs.cache import ChunkCache
from hypermesh.chunkfs.format import MiB
from hypermesh.chunkfs.holdings import read_holding, read_range, read_reads, scan, write_reads
from tests.chunkfs.test_chunkfs_cache import Chunk, fill


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


def test_reads_by_source_are_summed_over_caches(tmp_path: Path) -> None:
    roots = [tmp_path / "m1" / "chunks", tmp_path / "m2" / "chunks", tmp_path / "m3" / "chunks"]
    for root in roots:
        root.mkdir(parents=True)
    write_reads(roots[0], {"cache": 5, "store": 2})
    write_reads(roots[1], {"cache": 1, "peer": 4, "store": 0, "other": 9})
    (roots[2].parent / "reads.json").write_text("{not json")  # a torn or foreign file: skipped
    assert read_reads(roots) == {"cache": 6, "peer": 4, "store": 2}
    assert read_reads([]) == {"cache": 0, "peer": 0, "store": 0}
