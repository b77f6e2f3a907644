"""Timing formulas of the gossip protocol, and the Lifeguard suspicion record. Pure.

Every formula is a named function whose docstring states it; the table tests in
``tests/gossip/test_suspicion.py`` check docstring and code against each other. ``N`` is
the number of live members (alive or suspect, this member included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypermesh.agent.gossip.config import GossipConfig


def suspicion_timeout(n_members: int, cfg: GossipConfig) -> float:
    """Shortest suspicion timeout, in seconds.

    ``alpha * max(1, log10(max(1, N))) * protocol_period`` with alpha =
    ``cfg.suspicion_mult``. It grows with log10(N) because gossip needs about
    log N rounds to tell a suspected member, and its refutation needs as long to
    come back.
    """
    scale = max(1.0, math.log10(max(1, n_members)))
    return cfg.suspicion_mult * scale * cfg.protocol_period


def probe_deadline(cfg: GossipConfig) -> float:
    """Seconds from the start of a probe until an unanswered one makes its target suspect.

    ``min(protocol_period, 3 * probe_timeout)``: the direct ping's timeout, then twice
    that for the indirect round (a ping relayed there and back). Tied to round trips,
    not to the period, so a longer period (fewer messages) does not delay suspicion.
    """
    return min(cfg.protocol_period, 3 * cfg.probe_timeout)


def suspicion_bounds(n_members: int, cfg: GossipConfig) -> tuple[float, float]:
    """(min, max) suspicion timeout in seconds: ``(t, beta * t)``, t = suspicion_timeout(N)."""
    low = suspicion_timeout(n_members, cfg)
    return low, cfg.suspicion_max_mult * low


def expected_confirmations(n_members: int, cfg: GossipConfig) -> int:
    """k, the confirmations that bring a suspicion to its shortest timeout.

    ``min(K, max(0, N - 2))`` with K = ``cfg.suspicion_confirmations``: apart from
    the suspect and this member, no more than N - 2 members can confirm.
    """
    return min(cfg.suspicion_confirmations, max(0, n_members - 2))


def lifeguard_timeout(confirmations: int, k: int, low: float, high: float) -> float:
    """Suspicion timeout after ``c`` independent confirmations (Lifeguard).

    ``max(low, high - (high - low) * log(c + 1) / log(k + 1))``; ``low`` when k < 1.
    It starts at ``high`` and falls fast with the first confirmations, reaching
    ``low`` at c = k.
    """
    if k < 1:
        return low
    frac = math.log(confirmations + 1) / math.log(k + 1)
    return max(low, high - (high - low) * frac)


def retransmit_limit(n_members: int, cfg: GossipConfig) -> int:
    """Times each member sends one update: ``lambda * ceil(log10(N + 1))``, lambda =
    ``cfg.retransmit_mult``."""
    return cfg.retransmit_mult * math.ceil(math.log10(n_members + 1))


def health_scaled(seconds: float, awareness: int) -> float:
    """A probe timeout or period stretched by local health: ``seconds * (awareness + 1)``."""
    return seconds * (awareness + 1)


def push_pull_period(n_members: int, cfg: GossipConfig) -> float:
    """Seconds between push-pull exchanges; 0 when turned off.

    With R = ``min(N, push_pull_rows)``, the rows one exchange carries: ``interval``
    up to R = 32, then ``interval * (ceil(log2(R) - log2(32)) + 1)``. The period
    grows with the size of an exchange, as memberlist's does with the whole table's,
    so push-pull bytes per second stay about those of a 32-member mesh; past
    ``push_pull_rows`` members an exchange no longer grows (see
    :mod:`~hypermesh.agent.gossip.antientropy`), nor does the period: a member's
    push-pull cost is then the same at any N.
    """
    base = cfg.push_pull_interval
    rows = min(n_members, cfg.push_pull_rows)
    if base <= 0 or rows <= 32:
        return base
    return base * (math.ceil(math.log2(rows) - math.log2(32)) + 1)


@dataclass
class Suspicion:
    """One member's suspicion of another: when it started and who confirmed it.

    Owned by the :class:`~hypermesh.agent.gossip.swim.Swim` that holds it. The accuser
    (the member whose suspect message started it) never counts as a confirmation,
    and neither does anyone twice.
    """

    start: float
    accuser: str
    k: int
    min_timeout: float
    max_timeout: float
    confirmers: set[str] = field(default_factory=set)

    def confirm(self, who: str) -> bool:
        """Count ``who`` as an independent confirmation; True if it was a new one."""
        if who == self.accuser or who in self.confirmers or len(self.confirmers) >= self.k:
            return False
        self.confirmers.add(who)
        return True

    def timeout(self) -> float:
        """The current timeout, from the start (see :func:`lifeguard_timeout`)."""
        return lifeguard_timeout(len(self.confirmers), self.k, self.min_timeout, self.max_timeout)

    def deadline(self) -> float:
        """When the suspect is declared dead unless it refutes first."""
        return self.start + self.timeout()

    def remaining(self, now: float) -> float:
        """Seconds left before the deadline (negative once it passed)."""
        return self.deadline() - now
