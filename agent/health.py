"""The leader's death watch over nodes that hold claims. Pure: no I/O, no clock.

The leader probes every node that holds claims (a ``GetNode`` call) each
probe interval and feeds the outcomes here. A node that fails ``failures``
probes in a row, spanning at least ``min_silence`` seconds, is declared dead
once; the leader then revokes its lease, so its tasks run again without waiting
for the lease TTL. A wrong verdict costs work, never correctness: the node finds
its lease gone, kills its tasks and rejoins, and its late results are fenced off.

This is the stopgap detector until SWIM gossip gives every node a view of
every other; the leader's action on a verdict stays the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Silence:
    failures: int = 0
    since: float = 0.0
    declared: bool = False


@dataclass
class DeathWatch:
    """Counts consecutive failed probes per node; says when a node is dead."""

    failures: int = 3
    min_silence: float = 2.0
    _nodes: dict[str, _Silence] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"failures {self.failures} must be at least 1")
        if self.min_silence < 0:
            raise ValueError(f"min_silence {self.min_silence} must be >= 0")

    def observe(self, node: str, ok: bool, now: float) -> bool:
        """Record one probe of ``node``; True exactly once, when it is declared dead."""
        state = self._nodes.setdefault(node, _Silence())
        if ok:
            self._nodes[node] = _Silence()
            return False
        if state.failures == 0:
            state.since = now
        state.failures += 1
        if (
            not state.declared
            and state.failures >= self.failures
            and now - state.since >= self.min_silence
        ):
            state.declared = True
            return True
        return False

    def keep_only(self, nodes: set[str]) -> None:
        """Forget nodes that are no longer watched (gone, or holding no claims)."""
        for name in list(self._nodes):
            if name not in nodes:
                del self._nodes[name]
