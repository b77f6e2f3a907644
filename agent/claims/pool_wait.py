"""The I/O around soft pool preference in claims (``pool_preference.py``): when each
open task became claimable, which peers are live, and a timer that wakes the claim loop
when a wait ends.

Per claim round the agent asks :meth:`PoolWait.round` for a ``PoolPreference`` and hands
it to ``choose_claims``; afterwards :meth:`PoolWait.after_round` writes what it left to
whom in the decision log (once per task) and arms the timer. Owned by the agent's
event loop.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from hypermesh.agent.claims.placement import prune_since
from hypermesh.agent.claims.pool_preference import PoolPreference
from hypermesh.agent.claims.wake_timer import WakeTimer
from hypermesh.state.fit import allowed_on
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import NodeRecord
from hypermesh.state.view import MeshView


class PoolWait:
    """Claimable-since times and the wake-up timer for one agent's claim loop."""

    def __init__(
        self,
        delay_s: float,
        wake: Callable[[], None],
        decide: Callable[[str], None],
        alive: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.delay_s = delay_s
        self.wake = wake
        self.decide = decide
        self.alive = alive  # gossip's verdict on a peer
        self.since: dict[TaskRef, float] = {}
        self._told: set[TaskRef] = set()
        self._timer = WakeTimer(wake)

    def round(self, view: MeshView, me: NodeRecord, now: float | None = None) -> PoolPreference:
        """This round's preference. Peers: the other registered, not draining nodes
        that gossip has alive; their free slots (counted only when an experiment
        prefers pools): slots less the claims they hold."""
        now = time.monotonic() if now is None else now
        prune_since(self.since, lambda r: r.index in view.open.get((r.workflow, r.experiment), ()))
        self._told &= self.since.keys()
        peers = {n: rec for n, rec in view.nodes.items()
                 if n != me.name and rec.state == "alive" and self.alive(n)}

        def free() -> dict[str, int]:
            view.settle()  # block tasks run under their holders' claims too
            held = Counter(claim.node for claim in view.claims.values())
            return {n: rec.slots - held[n] for n, rec in peers.items()}

        return PoolPreference(
            me=me,
            peers=peers,
            free=free,
            now=now,
            since=self.since,
            delay_s=self.delay_s,
            fits=allowed_on,
        )

    def after_round(self, preference: PoolPreference) -> None:
        """Log what was left to whom (once per task) and wake the loop when a wait ends."""
        for ref, holder in preference.deferred.items():
            if ref not in self._told:
                self._told.add(ref)
                self.decide(f"leaving {ref} to {holder}, a node of a preferred pool with "
                            f"room (for up to {self.delay_s:g}s)")
        if preference.next_deadline is not None:
            self._timer.at(preference.next_deadline)

    def close(self) -> None:
        self._timer.cancel()
