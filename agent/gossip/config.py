"""Tuning of the SWIM/Lifeguard gossip protocol: one frozen record, validated once.

Every field says its unit and what turning it up or down costs. The timing
formulas that combine these fields (suspicion timeouts, retransmit limit,
push-pull scaling) are named functions in :mod:`suspicion`; this module only
holds the numbers.

Presets:

* :meth:`GossipConfig.lan` — the default for machines on one network: a dead
  member is known everywhere within about 2-4 s in a small mesh (1 s protocol
  period, a shortest suspicion of one period), within 15 periods at 1,000 members
  and 20 at 10,000 (see ``docs/benchmarks.md``); a member whose port refuses
  connections is known dead within about one period. The period is 1 s, not
  shorter, because gossip messages are most of what an idle agent costs (its
  gRPC stack's hand-offs per message): at 0.5 s an idle agent spent about 0.73 % of
  a core, at 1 s about 0.5 % (before the other idle savings of 2026-11-24).
* :meth:`GossipConfig.local` — much faster timers (a 0.05 s period), for tests
  that drive the protocol with a virtual clock or run agents on loopback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class GossipConfig:
    """How one member probes, suspects and gossips. Immutable; checked at construction."""

    protocol_period: float = 1.0
    """Seconds between two probes started by this member (one member probed per period).

    Every member is probed about once per period by someone, so detection time is a
    small multiple of this. Shorter: faster detection, proportionally more pings
    (two messages per member per period, and as many answered) and idle CPU: about
    0.25 % of a core per probe a second on the 2-core machines of
    ``docs/benchmarks.md``."""

    probe_timeout: float = 0.2
    """Seconds to wait for a direct ack before asking ``indirect_checks`` members to probe.

    Must exceed the round trip time at high percentiles, else healthy members are
    probed indirectly for nothing. It also sets when an unanswered probe makes its
    target suspect: ``suspicion.probe_deadline``, three times this (the indirect round
    gets twice the direct one), at most ``protocol_period``."""

    indirect_checks: int = 5
    """k: members asked to probe the target when the direct probe failed.

    More: fewer false suspicions when messages get lost (the chance that all k
    indirect paths fail falls geometrically: at 10% loss a probe of a live member
    fails with 0.19 * 0.34^k, 0.8% for k = 3, 0.09% for k = 5), more messages per
    failed probe (four per indirect prober). Each false suspicion costs a
    suspicion and a refutation sent ``retransmit_limit`` times by every member, so
    under loss a larger k is much cheaper than the gossip it saves: with k = 3,
    1,000 members at 10% loss make more updates than gossip can carry."""

    suspicion_mult: float = 1.0
    """alpha: the shortest suspicion timeout is alpha * max(1, log10 N) protocol periods.

    Larger: more time for a suspected live member to hear of it and refute, so
    fewer false deaths under loss; a dead member is declared dead later. 1 with the
    1 s period keeps a small mesh's shortest suspicion at 1 s (as 2 did with 0.5 s);
    at 1,000 members it is 3 periods, and 10 % message loss still killed no live
    member in the simulation (``docs/benchmarks.md``)."""

    suspicion_max_mult: float = 4.0
    """beta: the longest suspicion timeout is beta times the shortest.

    A suspicion starts at the longest timeout and shrinks to the shortest as
    independent members confirm it (Lifeguard). Larger: a lone, possibly wrong,
    accuser needs longer to get a member declared dead."""

    suspicion_confirmations: int = 4
    """K: independent confirmations after which the suspicion timeout reaches its minimum.

    Capped at N - 2 (there are not more members who could confirm). Larger: a few
    coincidental false suspicions under loss shorten the timeout less."""

    retransmit_mult: int = 5
    """lambda: each update is sent lambda * ceil(log10(N + 1)) times by each member.

    A member misses an update only if none of the ~N * limit copies reaches it:
    about exp(-limit) (times the delivery rate) per member. lambda = 4 (memberlist's
    choice) leaves a small mesh (N <= 99: limit 8) a 3e-4 chance per member to miss
    each update; 5 makes it 5e-5. Push-pull repairs misses later. Larger: fewer
    misses, more bytes per message while updates are in flight."""

    gossip_interval: float = 0.25
    """Seconds between gossip rounds (only while there are updates to spread).

    Each round sends the queued updates to ``gossip_fanout`` random members, in
    addition to what rides on pings and acks. Shorter: updates spread faster,
    more messages while they do."""

    gossip_fanout: int = 3
    """Members that each gossip round sends to. Larger: faster spread, more messages."""

    max_piggyback: int = 16
    """Most updates carried by one message (pings, acks and gossip alike).

    With about ten messages per member per period, gossip carries up to
    ``10 * max_piggyback / retransmit_limit(N)`` fresh updates per period per
    member; more news than that and the queues grow. Larger: more headroom for
    bursts (joins, partitions, loss), larger messages (an update is 40-200 bytes)."""

    push_pull_interval: float = 30.0
    """Seconds between member-table exchanges (push-pull) with one random member (0: never).

    Scaled up with the rows an exchange carries, ``min(N, push_pull_rows)``, not
    with N (see ``suspicion.push_pull_period``): 30 s up to 32 members, 60 s from
    33 on with the default 64 rows. Repairs anything gossip lost; each exchange
    costs two messages of up to ``push_pull_rows`` rows each."""

    push_pull_rows: int = 64
    """Most member rows one push-pull message carries (request or reply), the sender's
    own row included.

    What keeps gossip's cost per member independent of N: a mesh of up to this many
    members exchanges its whole table, as before; a larger one sends the rows that
    changed membership most recently, then the next rows of a cursor that walks the
    table, so every row goes out within about ``N / (push_pull_rows / 2)`` exchanges
    (see :mod:`~hypermesh.agent.gossip.antientropy`). A joining member pages through
    its seed's table in messages of this many rows. Larger: anti-entropy sweeps the
    table faster, each exchange is bigger (a row is 40-200 bytes, up to
    ``max_meta_bytes`` more with meta); at least ``max_members``: whole tables, as
    memberlist sends them."""

    awareness_max: int = 8
    """Highest Lifeguard local-health score (0: local health is not tracked).

    A member whose own probes fail without nacks, that has to refute suspicions of
    itself, or whose ticks arrive late, raises its score; its probe timeout and
    period are multiplied by (score + 1). Larger: a sick member backs off further
    before it accuses others."""

    late_tick_threshold: float = 0.5
    """Seconds a tick may arrive after it was due before the member counts itself slow.

    A late tick raises local health by one and voids the probe in flight: a member
    whose event loop stalled cannot tell a silent peer from its own stall."""

    refused_quorum: int = 2
    """Members that must see the target refuse connections to declare it dead at once.

    The direct prober counts as one and each indirect prober that reports a refused
    connection as one more. A refused connection means the port is closed: the
    process is gone (a stopped or partitioned process times out instead). 0 turns
    the fast path off (a refusal then only hastens suspicion); 1 trusts a single
    refusal."""

    reconnect_interval: float = 10.0
    """Seconds between push-pull attempts with one random dead member (0: never).

    Heals a partition after both sides declared each other dead: the first
    exchange across the healed link makes both ends refute, and gossip does the
    rest."""

    dead_retention: float = 300.0
    """Seconds a dead or left member is remembered (for refutation and reconnects).

    Forgotten at the start of the next probe pass after that. Longer: a member back
    from a long partition is found by reconnect push-pulls for longer; the table
    holds the departed longer."""

    max_members: int = 10_000
    """Most members this member's table holds, itself and the dead and left included.

    A bound against a flood of made-up members (anyone who can reach the port can
    announce names), well above any real mesh. When the table is full, a new member
    takes the place of the member longest dead or left, if any; otherwise it is
    refused (counted, see ``trust.Refusals``) until members leave the table. Each
    member costs up to ``max_meta_bytes`` plus about 1 KB here. Larger: room for
    larger meshes, more memory a flood can take."""

    max_meta_bytes: int = 2048
    """Largest serialized meta (JSON) a member may publish about itself.

    Meta rides on alive updates: load, free slots and GPUs, chunk-summary digests."""

    quiet_meta: frozenset[str] = frozenset({"running", "free_slots", "free_gpus"})
    """Meta keys whose changes alone are quiet news: they ride on the messages the
    protocol sends anyway (pings, acks, and gossip rounds started by other news) and
    start no gossip round.

    A busy member's task counts change with every task; as loud news, each change
    kept every member gossiping to ``gossip_fanout`` others every ``gossip_interval``
    while it spread, so the mesh sent messages in proportion to N for every member's
    load. Quiet, they cost a few bytes on messages sent anyway and reach everyone
    within about log N periods. Loud news (states, other meta) goes first in every
    message."""

    def __post_init__(self) -> None:
        if not isinstance(self.quiet_meta, frozenset) or not all(
            isinstance(k, str) for k in self.quiet_meta
        ):
            raise ValueError(
                f"quiet_meta must be a frozenset of meta keys, got {self.quiet_meta!r}"
            )
        _check_range("protocol_period", self.protocol_period, 0.001, 60.0)
        _check_range("probe_timeout", self.probe_timeout, 0.0001, self.protocol_period * 0.9)
        _check_range("indirect_checks", self.indirect_checks, 0, 16, integer=True)
        _check_range("suspicion_mult", self.suspicion_mult, 0.5, 100.0)
        _check_range("suspicion_max_mult", self.suspicion_max_mult, 1.0, 100.0)
        _check_range("suspicion_confirmations", self.suspicion_confirmations, 0, 32, integer=True)
        _check_range("retransmit_mult", self.retransmit_mult, 1, 100, integer=True)
        _check_range("gossip_interval", self.gossip_interval, 0.001, 60.0)
        _check_range("gossip_fanout", self.gossip_fanout, 0, 64, integer=True)
        _check_range("max_piggyback", self.max_piggyback, 1, 1024, integer=True)
        _check_range("push_pull_interval", self.push_pull_interval, 0.0, 86400.0)
        _check_range("push_pull_rows", self.push_pull_rows, 4, 10_000_000, integer=True)
        _check_range("awareness_max", self.awareness_max, 0, 64, integer=True)
        _check_range("late_tick_threshold", self.late_tick_threshold, 0.001, 3600.0)
        quorum_max = 1 + self.indirect_checks
        _check_range("refused_quorum", self.refused_quorum, 0, quorum_max, integer=True)
        _check_range("reconnect_interval", self.reconnect_interval, 0.0, 86400.0)
        _check_range("dead_retention", self.dead_retention, 0.0, 30 * 86400.0)
        _check_range("max_meta_bytes", self.max_meta_bytes, 16, 1 << 20, integer=True)
        _check_range("max_members", self.max_members, 2, 10_000_000, integer=True)

    @classmethod
    def lan(cls, **overrides: Any) -> GossipConfig:
        """The default: members on one network, round trips well under 100 ms."""
        return replace(cls(), **overrides)

    @classmethod
    def local(cls, **overrides: Any) -> GossipConfig:
        """Much faster timers (a 0.05 s period), for tests on a virtual clock or on loopback."""
        base = cls(
            protocol_period=0.05,
            probe_timeout=0.02,
            suspicion_mult=2.0,  # timers this short need more slack on a busy test machine
            gossip_interval=0.025,
            push_pull_interval=3.0,
            late_tick_threshold=0.05,
            reconnect_interval=1.0,
            dead_retention=30.0,
        )
        return replace(base, **overrides)

    def describe(self) -> dict[str, Any]:
        """All fields as a plain dict (for reports and logs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_range(
    name: str, value: float, low: float, high: float, *, integer: bool = False
) -> None:
    kind = "an integer" if integer else "a number"
    wrong_type = not isinstance(value, int) if integer else not isinstance(value, int | float)
    if isinstance(value, bool) or wrong_type or math.isnan(value):
        raise ValueError(f"{name} must be {kind} in [{low:g}, {high:g}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value:g}")
