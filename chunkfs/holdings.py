"""What a chunk cache directory holds, read by another process (its mount's agent).

A mount owns its cache directory (``cache.ChunkCache``, under a file lock); the agent
that started the mount only *reads* it, to say what the node holds — bytes cached, and
(for peers) which chunks — and to serve ranges of them. It reads the cache's own
records: a chunk's ``<id>.have`` file lists which blocks were written, and is written
by the mount a couple of seconds after its blocks change (``HAVE_FLUSH_INTERVAL``). So
this view lags the mount slightly and may name a block that was evicted since: readers
of :func:`read_range` get bytes that *may* be wrong, and must verify them against the
chunk's digests before use, as every chunkfs reader does with every source.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hypermesh.chunkfs.cache import HAVE_HEADER, MAGIC, block_span
from hypermesh.chunkfs.format import BLOCK_SIZE, block_count, shard, valid_chunk_id

READS_FILE = "reads.json"
"""Beside a mount's ``chunks`` cache root: blocks its reads were served, by source
(``cache``, ``peer``, ``store``), since the mount started; written by the mount with
its ``.have`` records."""

SOURCES = ("cache", "peer", "store")

ELSEWHERE_FILE = "elsewhere"
"""Beside a mount's ``chunks`` cache root: the chunks this node holds that another alive
node holds too, as the agent's gossip view says (one id a line), written by the agent
after its cache scans when the set changed and read by the mount every couple of
seconds: its cache evicts those first (``cache.keep_rank``). Only a hint: a missing or
stale file costs store reads, never correctness."""


@dataclass(frozen=True)
class Holding:
    """One cached chunk as its ``.have`` record tells: its size and written blocks."""

    chunk_id: str
    size: int
    blocks: frozenset[int]

    @property
    def present_bytes(self) -> int:
        return sum(block_span(i, self.size)[1] for i in self.blocks)

    def covers(self, offset: int, length: int) -> bool:
        """Whether every block under ``[offset, offset+length)`` was written."""
        if length <= 0 or offset < 0 or offset + length > self.size:
            return False
        first, last = offset // BLOCK_SIZE, (offset + length - 1) // BLOCK_SIZE
        return all(i in self.blocks for i in range(first, last + 1))


def _have_path(cache_root: Path, chunk_id: str) -> Path:
    _check_id(chunk_id)
    return cache_root / "v1" / shard(chunk_id) / f"{chunk_id}.have"


def read_holding(cache_root: Path, chunk_id: str) -> Holding | None:
    """The chunk's record in the cache at ``cache_root``, or None (absent or unreadable)."""
    try:
        have = _have_path(cache_root, chunk_id).read_bytes()
        magic, size = HAVE_HEADER.unpack_from(have)
    except (OSError, struct.error):
        return None
    state = have[HAVE_HEADER.size :]
    if magic != MAGIC or len(state) != block_count(size):
        return None
    return Holding(chunk_id, size, frozenset(i for i, s in enumerate(state) if s == 1))


def scan(cache_roots: Iterable[Path]) -> dict[str, Holding]:
    """Every chunk with at least one written block in any of these caches."""
    return merge(scan_root(root) for root in cache_roots)


def scan_root(root: Path) -> dict[str, Holding]:
    """Every chunk with at least one written block in the cache at ``root``."""
    out: dict[str, Holding] = {}
    try:
        shards = list(os.scandir(root / "v1"))
    except OSError:
        return out
    for folder in shards:
        try:
            names = [
                e.name for e in os.scandir(folder.path)
                if e.name.endswith(".have") and valid_chunk_id(e.name[: -len(".have")])
            ]
        except OSError:
            continue
        for name in names:
            holding = read_holding(root, name[: -len(".have")])
            if holding is not None and holding.blocks:
                out[holding.chunk_id] = holding
    return out


def merge(parts: Iterable[dict[str, Holding]]) -> dict[str, Holding]:
    """Several caches' holdings as one: a chunk held by more than one counts once,
    as the record with the most written blocks."""
    out: dict[str, Holding] = {}
    for part in parts:
        for chunk_id, holding in part.items():
            old = out.get(chunk_id)
            if old is None or len(holding.blocks) > len(old.blocks):
                out[chunk_id] = holding
    return out


def write_reads(cache_root: Path, blocks: dict[str, int]) -> None:
    """Record a mount's blocks served by source (atomically: a reader sees all or none)."""
    path = cache_root.parent / READS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({s: int(blocks.get(s, 0)) for s in SOURCES}))
    os.replace(tmp, path)


def read_reads(cache_roots: Iterable[Path]) -> dict[str, int]:
    """Blocks served by source, summed over these caches' mounts (0 each when none)."""
    total = dict.fromkeys(SOURCES, 0)
    for root in cache_roots:
        try:
            data = json.loads((root.parent / READS_FILE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            for s in SOURCES:
                value = data.get(s)
                if isinstance(value, int) and value >= 0:
                    total[s] += value
    return total


def write_elsewhere(cache_root: Path, chunk_ids: Iterable[str]) -> None:
    """Record the chunks another node holds too, for the mount of this cache
    (atomically: the mount reads all of a set or none)."""
    path = cache_root.parent / ELSEWHERE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{c}\n" for c in sorted(chunk_ids)))
    os.replace(tmp, path)


def read_elsewhere(cache_root: Path) -> frozenset[str] | None:
    """What :func:`write_elsewhere` last recorded for this cache; None when nothing."""
    try:
        text = (cache_root.parent / ELSEWHERE_FILE).read_text()
    except OSError:
        return None
    return frozenset(line for line in text.split() if line)


def read_range(cache_root: Path, chunk_id: str, offset: int, length: int) -> bytes | None:
    """Chunk bytes ``[offset, offset+length)`` from the cache if its record says every
    block under them was written, else None. Unverified: the caller checks digests."""
    _check_id(chunk_id)  # a peer's request names this file
    holding = read_holding(cache_root, chunk_id)
    if holding is None or not holding.covers(offset, length):
        return None
    path = cache_root / "v1" / shard(chunk_id) / f"{chunk_id}.data"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, length, offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == length else None


def _check_id(chunk_id: str) -> None:
    if not valid_chunk_id(chunk_id):
        raise ValueError(f"not a chunk id: {chunk_id[:80]!r}")
