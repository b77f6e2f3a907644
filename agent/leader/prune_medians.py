"""The pruning medians: what a node that sees no metrics prunes by.

A node that watches only its own part (``agent start --watch own``) receives neither
blocks nor metrics, so it cannot ask the median pruner with the experiment's trials as
a node that watches everything does (``agent/tasks/metrics_watch.py``). The pruner only
compares a running trial's intermediate value at its step with the median, at that
step, of the completed trials' values, once enough of them completed. So the leader,
which sees every trial, publishes exactly that for each experiment with ``pruning``
(``prunemed/<wid>/<exp>``: ``{"completed": K, "medians": [[step, median], ...]}``,
``hypermesh.state.search.median_curve``), and such a node reads the one key, whatever
the experiment's size, and asks the same pruner with it
(``search.prune_by_medians``).

While a node that watches only its own part is alive (such nodes register with
``offers``), the leader works it out again when the experiment's count of finished
trials changed, at most every ``PUBLISH_S`` (a change sooner waits for a round then),
with the figures its own pruning checks use (``PruningMedians.from_view``: brought up
to date once per change, from the trials that changed: ``search.MedianCurve``), and
writes it only when it changed, fenced by the workflow's state as every leader write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from hypermesh.errors import HypermeshError
from hypermesh.state import search
from hypermesh.state.records import TERMINAL
from hypermesh.state.txns import state_guard

if TYPE_CHECKING:
    from hypermesh.agent.tasks.metrics_watch import PruningMedians
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")

PUBLISH_S = 2.0
"""Least time between two looks at one experiment's medians (each builds its completed
trials): a pruning check elsewhere reads them at most this much later than here."""


class MediansHost(Protocol):
    etcd: Etcd
    ks: Keyspace
    view: MeshView
    pruning_medians: PruningMedians


class PruneMedians:
    """The leader's publisher of ``prunemed/`` keys; one per leading agent."""

    def __init__(self, agent: MediansHost, wake_at: Callable[[float], None]) -> None:
        self.agent = agent
        self.wake_at = wake_at  # a leader round at this monotonic time
        # (wid, experiment) -> (finished trials then, when looked at, the value written)
        self._seen: dict[tuple[str, str], tuple[int, float, bytes | None]] = {}

    def handed_over(self) -> None:
        """Another leader may have written since: compare with what is there again."""
        self._seen.clear()

    async def publish(self) -> None:
        """Publish what changed; nothing while no node watches only its own part (a
        small mesh, every node with a watch-all seat): none would read it."""
        a = self.agent
        view = a.view
        now = time.monotonic()
        live: set[tuple[str, str]] = set()
        readers = any(n.offers for n in view.nodes.values())
        for wid, wf in list(view.workflows.items()) if readers else ():
            revision = view.workflow_state_revisions.get(wid)
            if revision is None or view.workflow_state(wid) in TERMINAL:
                continue
            for exp in wf.recipe.experiments:
                if exp.pruning is None or exp.objective is None:
                    continue
                key = (wid, exp.name)
                live.add(key)
                ended = search.settle_experiment(view, wid, exp.name)
                seen = self._seen.get(key)
                if seen is not None and seen[0] == ended:
                    continue
                if seen is not None and now - seen[1] < PUBLISH_S:
                    self.wake_at(seen[1] + PUBLISH_S)  # a round then, if none comes sooner
                    continue
                try:
                    completed, medians = await a.pruning_medians.from_view(view, wid, exp)
                except Exception:  # pruning elsewhere waits; the workflow goes on
                    log.exception("working out the pruning medians of %s/%s", wid, exp.name)
                    self._seen[key] = (ended, now, seen[2] if seen is not None else None)
                    continue
                value = search.medians_value(completed, medians)
                written = seen[2] if seen is not None else None
                if value != written and not await self._write(wid, exp.name, value, revision):
                    continue  # not written: looked at again at the next round
                self._seen[key] = (ended, now, value)
        for key in set(self._seen) - live:
            del self._seen[key]

    async def _write(self, wid: str, experiment: str, value: bytes, revision: int) -> bool:
        a = self.agent
        try:
            done = await a.etcd.txn(state_guard(a.etcd, a.ks, wid, revision),
                                    [a.etcd.op_put(a.ks.prune_medians(wid, experiment), value)])
        except HypermeshError as exc:  # best effort: again at the next round
            log.info("publishing the pruning medians of %s/%s: %s", wid, experiment, exc)
            return False
        return done.succeeded

