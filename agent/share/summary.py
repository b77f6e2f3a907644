"""Which chunks a node has cached: a versioned set, its deltas and its digest. Pure.

The owner keeps a :class:`ChunkSummary` of its own cache; each ``add``/``remove``
that changes the set bumps the version by one and returns a :class:`ChunkDelta`.
Gossip carries small things: the version and :meth:`~ChunkSummary.digest` in the
node's meta, and deltas. A peer keeps a replica and applies deltas strictly in
order: a delta that does not start at the replica's version is a gap, and the
peer asks for a full snapshot instead. Equal digests mean equal (version, set).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeGuard


class DeltaResult(Enum):
    """What :meth:`ChunkSummary.apply_delta` did."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # already at or past the delta's version: nothing to do
    GAP = "gap"  # the delta does not start at our version: fetch a full snapshot


@dataclass(frozen=True)
class ChunkDelta:
    """The change from version ``base`` to version ``version``: ids added and removed."""

    base: int
    version: int
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """``{"b": base, "v": version, "a": [...], "r": [...]}`` (empty lists left out)."""
        out: dict[str, Any] = {"b": self.base, "v": self.version}
        if self.added:
            out["a"] = list(self.added)
        if self.removed:
            out["r"] = list(self.removed)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkDelta:
        """Inverse of :meth:`to_json`; raises ValueError on anything malformed."""
        base, version = data.get("b"), data.get("v")
        if not (_is_int(base) and _is_int(version)) or not 0 <= base <= version:
            raise ValueError(f"a delta needs integer versions 0 <= b <= v, got {data!r}")
        return cls(base, version, _ids(data.get("a", [])), _ids(data.get("r", [])))


class ChunkSummary:
    """A versioned set of chunk ids; either its owner's own, or a replica of a peer's.

    Only its holder mutates it. The owner changes it with :meth:`add` and
    :meth:`remove` and keeps the last ``max_log`` deltas, so that it can answer
    :meth:`deltas_since`; a replica changes only through :meth:`apply_delta` and
    :meth:`load_snapshot`.
    """

    def __init__(self, max_log: int = 64) -> None:
        if max_log < 0:
            raise ValueError(f"max_log must be >= 0, got {max_log}")
        self.version = 0
        self._chunks: set[str] = set()
        self._log: deque[ChunkDelta] = deque(maxlen=max_log)

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._chunks

    def chunks(self) -> frozenset[str]:
        """The current set."""
        return frozenset(self._chunks)

    def add(self, ids: Iterable[str]) -> ChunkDelta | None:
        """Add ``ids``; the delta, or None if all were already there (no new version)."""
        new = tuple(sorted(set(_ids(ids)) - self._chunks))
        return self._commit(ChunkDelta(self.version, self.version + 1, added=new)) if new else None

    def remove(self, ids: Iterable[str]) -> ChunkDelta | None:
        """Remove ``ids``; the delta, or None if none was there (no new version)."""
        gone = tuple(sorted(set(_ids(ids)) & self._chunks))
        if not gone:
            return None
        return self._commit(ChunkDelta(self.version, self.version + 1, removed=gone))

    def digest(self) -> str:
        """16 hex digits of SHA-256 over the version and the sorted ids: equal digests,
        equal summaries (barring a 64-bit collision)."""
        h = hashlib.sha256(str(self.version).encode())
        for chunk in sorted(self._chunks):
            h.update(b"\n")
            h.update(chunk.encode())
        return h.hexdigest()[:16]

    def deltas_since(self, version: int) -> ChunkDelta | None:
        """One delta from ``version`` to now (the logged deltas folded together), or None
        when the log no longer reaches back that far (send a snapshot then)."""
        if version == self.version:
            return ChunkDelta(version, version)
        if version > self.version or not self._log or self._log[0].base > version:
            return None
        added: set[str] = set()
        removed: set[str] = set()
        for delta in self._log:
            if delta.base < version:
                continue
            for chunk in delta.added:
                if chunk in removed:
                    removed.discard(chunk)
                else:
                    added.add(chunk)
            for chunk in delta.removed:
                if chunk in added:
                    added.discard(chunk)
                else:
                    removed.add(chunk)
        return ChunkDelta(version, self.version, tuple(sorted(added)), tuple(sorted(removed)))

    def apply_delta(self, delta: ChunkDelta) -> DeltaResult:
        """Apply a peer's delta to this replica, strictly in order (see :class:`DeltaResult`)."""
        if delta.version <= self.version:
            return DeltaResult.DUPLICATE
        if delta.base != self.version:
            return DeltaResult.GAP
        self._chunks.difference_update(delta.removed)
        self._chunks.update(delta.added)
        self.version = delta.version
        return DeltaResult.APPLIED

    def snapshot(self) -> dict[str, Any]:
        """The whole summary as JSON-able data: ``{"v": version, "c": sorted ids}``."""
        return {"v": self.version, "c": sorted(self._chunks)}

    def load_snapshot(self, data: dict[str, Any]) -> None:
        """Replace this replica's content with a snapshot (and forget the delta log)."""
        version = data.get("v")
        if not _is_int(version) or version < 0:
            raise ValueError(f"a snapshot needs an integer version >= 0, got {data!r}")
        self._chunks = set(_ids(data.get("c", [])))
        self.version = version
        self._log.clear()

    @classmethod
    def from_snapshot(cls, data: dict[str, Any], max_log: int = 64) -> ChunkSummary:
        """A new summary holding ``data`` (see :meth:`snapshot`)."""
        summary = cls(max_log)
        summary.load_snapshot(data)
        return summary

    def _commit(self, delta: ChunkDelta) -> ChunkDelta:
        self.apply_delta(delta)
        self._log.append(delta)
        return delta


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):
        raise ValueError("chunk ids must be given as a collection, not one string")
    ids = tuple(values)
    for chunk in ids:
        if not isinstance(chunk, str) or not chunk:
            raise ValueError(f"a chunk id is a non-empty string, got {chunk!r}")
    return ids
