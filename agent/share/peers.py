"""Who holds which chunk: this node's own chunk summary and its replicas of its peers'.

Pure: no gRPC, no etcd, no clock. The I/O layer (``agent/share/duty.py`` and
``agent/gossip/duty.py``) hands it what it learns — this node's cache scans, peers' gossiped
meta, snapshots fetched from peers, membership changes — and carries out what it answers
(fetch a snapshot from a peer).

What a node gossips about its chunks (its meta's ``chunks`` entry, :meth:`ChunkPeers.meta`):
``{"v": version, "d": digest, "delta": last delta}``; the delta only when it is small
(see ``max_delta_bytes``). A peer whose replica is at the delta's base applies it; any
other peer (a gap, a restarted node, a missed delta) compares digests and asks for a
snapshot. Push-pull exchanges whole member tables, metas included, so a replica that
fell behind is noticed on the next push-pull at the latest.

:meth:`ChunkPeers.holders` is the read-only question the rest of the agent asks (also
locality-aware claims): which alive members, this node included, hold a chunk. Its
signature is stable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from hypermesh.agent.share.summary import ChunkDelta, ChunkSummary

__all__ = ["ChunkPeers", "HoldersView", "holder_order", "race_delay"]

META_KEY = "chunks"
ALIVE = "alive"

HoldersView = Callable[[str], frozenset[str]]
"""What pure logic elsewhere (locality-aware claims) may take instead of a whole
:class:`ChunkPeers`: ``ChunkPeers.holders`` (on an agent: ``agent.share.peers.holders``)."""


def holder_order(chunk_id: str, holders: Iterable[str]) -> list[str]:
    """The order in which to ask ``holders`` for ``chunk_id``: rendezvous hashing.

    Each holder's rank is a hash of (chunk, holder), so the nodes that miss one chunk
    all ask the same first holder (its page cache stays warm), different chunks spread
    over all holders, and a holder joining or leaving moves only the chunks it ranks
    first for. Ties cannot decide anything: names are unique.
    """

    def rank(node: str) -> bytes:
        return hashlib.blake2b(f"{chunk_id}\0{node}".encode(), digest_size=8).digest()

    return sorted(set(holders), key=rank, reverse=True)


def race_delay(cache_full: bool, won_here: bool, defer_s: float) -> float:
    """Seconds a node waits before it races for a cold segment it misses.

    A node whose cache cannot take the segment without evicting a chunk only it may
    hold (``cache_full``) waits ``defer_s``, so that a node with room that misses the
    segment at about the same time wins and keeps it; it then reads the segment from
    that node without caching it. Every other node, and one that has just won this
    segment (``won_here``: its key still names it), races at once: a node with free
    space, or one reading alone with room, pays no delay.
    """
    return defer_s if cache_full and not won_here else 0.0


class ChunkPeers:
    """This node's chunk summary and its replicas of every peer's; answers ``holders``.

    Owned by the agent's event loop: only it calls the mutating methods
    (:meth:`update_own`, :meth:`observe`, :meth:`load_snapshot`, :meth:`member_state`).
    """

    def __init__(self, name: str, max_delta_bytes: int = 1024) -> None:
        if max_delta_bytes < 0:
            raise ValueError(f"max_delta_bytes must be >= 0, got {max_delta_bytes}")
        self.name = name
        self.max_delta_bytes = max_delta_bytes
        self.own = ChunkSummary()
        self._meta: dict[str, Any] = {"v": 0, "d": self.own.digest()}
        self._replicas: dict[str, ChunkSummary] = {}
        self._advertised: dict[str, str] = {}  # member -> the digest it gossips
        self._stale: set[str] = set()  # members whose replica differs from their digest
        self._states: dict[str, str] = {}

    # ----------------------------------------------------------------- own
    def update_own(self, held: Iterable[str]) -> ChunkDelta | None:
        """Make the own summary the chunks ``held`` now (one scan); the scan's changes
        as one delta (None when nothing changed)."""
        held_set = set(held)
        base = self.own.version
        self.own.add(held_set - self.own.chunks())
        self.own.remove(self.own.chunks() - held_set)
        if self.own.version == base:
            return None
        delta = self.own.deltas_since(base)
        assert delta is not None  # the log holds at least this scan's two deltas
        self._meta = {"v": self.own.version, "d": self.own.digest()}
        as_json = delta.to_json()
        if len(json.dumps(as_json, separators=(",", ":"))) <= self.max_delta_bytes:
            self._meta["delta"] = as_json
        return delta

    def meta(self) -> dict[str, Any]:
        """The ``chunks`` entry of this node's gossip meta (computed once per change)."""
        return dict(self._meta)

    def snapshot(self) -> dict[str, Any]:
        """The own summary whole, for a peer that asks (``{"v": ..., "c": [...]}``)."""
        return self.own.snapshot()

    # ----------------------------------------------------------------- peers
    def member_state(self, member: str, state: str) -> None:
        """A member's gossip state changed (alive, suspect, dead, left). A member that
        is gone is forgotten: when it comes back it is synced afresh."""
        if member == self.name:
            return
        self._states[member] = state
        if state not in (ALIVE, "suspect"):
            self._replicas.pop(member, None)
            self._advertised.pop(member, None)
            self._stale.discard(member)

    def observe(self, member: str, meta: dict[str, Any]) -> bool:
        """A member's gossiped meta; True when its replica needs a snapshot.

        Applies an in-order delta; a delta that does not fit, or a digest that still
        differs afterwards, means a snapshot. Malformed entries, and members not alive
        or suspect (see :meth:`member_state`), are ignored (False)."""
        if member == self.name or self._states.get(member) not in (ALIVE, "suspect"):
            return False
        entry = meta.get(META_KEY)
        if not isinstance(entry, dict):
            return False
        version, digest = entry.get("v"), entry.get("d")
        if not isinstance(version, int) or not isinstance(digest, str):
            return False
        if self._advertised.get(member) == digest and member not in self._stale:
            return False  # nothing new (another field of its meta changed)
        self._advertised[member] = digest
        replica = self._replicas.setdefault(member, ChunkSummary(max_log=0))
        delta = entry.get("delta")
        if isinstance(delta, dict) and replica.digest() != digest:
            # a gap or a duplicate leaves the digest different: a snapshot then
            with contextlib.suppress(ValueError):
                replica.apply_delta(ChunkDelta.from_json(delta))
        return self._check(member)

    def _check(self, member: str) -> bool:
        """Whether ``member``'s replica still differs from its advertised digest."""
        replica = self._replicas.get(member)
        if replica is not None and replica.digest() == self._advertised.get(member):
            self._stale.discard(member)
            return False
        self._stale.add(member)
        return True

    def load_snapshot(self, member: str, snapshot: dict[str, Any]) -> None:
        """A snapshot fetched from ``member`` (raises ValueError when malformed)."""
        if member == self.name:
            return
        replica = ChunkSummary.from_snapshot(snapshot, max_log=0)
        if self._states.get(member, ALIVE) in (ALIVE, "suspect"):
            self._replicas[member] = replica
            if member in self._advertised:
                self._check(member)

    def stale(self) -> list[str]:
        """Members whose replica differs from what they last advertised."""
        return sorted(self._stale)

    # ----------------------------------------------------------------- questions
    def holders(self, chunk_id: str) -> frozenset[str]:
        """Alive members (this node included) that hold ``chunk_id``, as this node's
        replicas say. Suspect, dead and left members are left out."""
        out = {
            m
            for m, replica in self._replicas.items()
            if chunk_id in replica and self._states.get(m) == ALIVE
        }
        if chunk_id in self.own:
            out.add(self.name)
        return frozenset(out)

    def held_elsewhere(self, chunk_ids: Iterable[str]) -> frozenset[str]:
        """Those of ``chunk_ids`` that another alive member holds too (for this node's
        caches: they evict those first)."""
        return frozenset(c for c in chunk_ids if self.holders(c) - {self.name})

    def peer_holders(self, chunk_id: str) -> list[str]:
        """Alive peers (not this node) holding ``chunk_id``, in the order to ask them."""
        return holder_order(chunk_id, self.holders(chunk_id) - {self.name})

    def replica_size(self, member: str) -> int:
        """How many chunks this node believes ``member`` holds (0 if it knows none)."""
        replica = self._replicas.get(member)
        return len(replica) if replica is not None else 0
