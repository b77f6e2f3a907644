"""Tuning of peer chunk sharing (advertising, serving, fetching through the agent).

One frozen record, validated once. Presets: :meth:`ShareConfig.lan` (the default)
and :meth:`ShareConfig.local` (tests on loopback: caches rescanned every second).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hypermesh.agent.gossip.config import _check_range

MIN_PEER_RATE = 4 << 20
"""Bytes per second a peer's transfer must average at least (see :func:`transfer_deadline`)."""


def transfer_deadline(first_piece_s: float, length: int) -> float:
    """The deadline of a whole ``ReadChunk`` transfer of ``length`` bytes whose first
    piece may take ``first_piece_s``: that plus ``length`` at ``MIN_PEER_RATE``. A
    busy peer that streams steadily is not cut off half-way (its bytes would then be
    read from the store a second time); one that stalls is, by the per-piece timeout."""
    return first_piece_s + length / MIN_PEER_RATE


@dataclass(frozen=True)
class ShareConfig:
    """How an agent advertises its chunk caches and fetches chunks from peers."""

    scan_period_s: float = 5.0
    """Seconds between two scans of this node's chunk caches (their ``.have`` records,
    one small file per cached chunk). A chunk is advertised up to this long (plus the
    mount's 2 s record flush and a gossip round) after it was cached. Shorter: peers
    learn sooner, at one file read per cached chunk per scan."""

    peer_timeout_s: float = 1.0
    """Deadline of one ``ReadChunk`` call to a peer. A slow or frozen peer costs the
    reader at most this (per holder tried) before it goes to the object store."""

    peer_tries: int = 2
    """Holders asked, in turn, for one run before giving up (each with its own
    ``peer_timeout_s``)."""

    dedup_wait_s: float = 8.0
    """A cold run: how long a node that lost the race to fetch it from the store waits
    for the winner to hold it before it goes to the store itself. Also the TTL of the
    etcd key that names the winner. Longer: fewer duplicate GETs when the store is
    slow; a winner that dies makes the others wait this long."""

    dedup_segment_bytes: int = 16 << 20
    """Nodes race for a cold chunk per aligned segment of this size: the one that wins a
    segment fetches its runs there, the others wait to read them from it. Larger: fewer
    keys, but a loser may wait for bytes the winner never reads (at most
    ``dedup_wait_s``)."""

    full_defer_s: float = 0.5
    """A cold segment: how long a node whose cache is full of chunks it may hold alone
    waits before it races for the segment, so that a node with room missing it at about
    the same time fetches it (and keeps it) instead. Only nodes in that state wait.
    Longer: more skew between readers is covered, at this cost per cold segment on a
    full node that reads alone. 0: race at once."""

    dedup_poll_s: float = 0.25
    """Seconds between two asks of the winner while waiting for it."""

    snapshot_retry_s: float = 1.0
    """Least seconds between two snapshot requests to one peer."""

    max_delta_bytes: int = 1024
    """Largest delta (as JSON) carried in gossip meta; a larger one is left out and
    peers fetch a snapshot (a chunk id takes about 67 bytes)."""

    def __post_init__(self) -> None:
        _check_range("scan_period_s", self.scan_period_s, 0.1, 3600)
        _check_range("peer_timeout_s", self.peer_timeout_s, 0.05, 60)
        _check_range("peer_tries", self.peer_tries, 1, 16, integer=True)
        _check_range("dedup_wait_s", self.dedup_wait_s, 0, 600)
        _check_range("dedup_segment_bytes", self.dedup_segment_bytes, 1 << 20, 1 << 34,
                     integer=True)
        _check_range("full_defer_s", self.full_defer_s, 0, 60)
        _check_range("dedup_poll_s", self.dedup_poll_s, 0.01, 10)
        _check_range("snapshot_retry_s", self.snapshot_retry_s, 0.05, 600)
        _check_range("max_delta_bytes", self.max_delta_bytes, 0, 1 << 16, integer=True)

    @property
    def mount_timeout_s(self) -> float:
        """How long a mount waits for its agent's answer to one fetch: every holder
        tried, or a full dedup wait and one more peer call, plus a margin."""
        return max(self.peer_tries * self.peer_timeout_s, self.full_defer_s
                   + self.dedup_wait_s + self.peer_timeout_s) + 2.0

    @classmethod
    def lan(cls, **overrides: Any) -> ShareConfig:
        """The default: machines on one network."""
        return replace(cls(), **overrides)

    @classmethod
    def local(cls, **overrides: Any) -> ShareConfig:
        """Loopback tests: rescans every second, shorter waits."""
        return replace(cls(scan_period_s=1.0, dedup_wait_s=6.0, dedup_poll_s=0.1), **overrides)
