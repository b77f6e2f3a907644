"""Standing for leader: an agent leads when no live node does.

A candidacy is a key under ``elect/`` on a short lease of its own (``--leader-ttl``), and
only the leader holds one: the others watch, and when the leader's key goes (its lease
lapsed or was revoked) or its node does, they race with one transaction each that stands
only if no one stood since their view (:meth:`Campaign._stand`). So the followers keep no
second lease alive, and a silent leader is still replaced within the leader TTL. Who leads
is read from the mirrored view (``MeshView.leader``), never from here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from hypermesh.errors import EtcdUnavailable, LeaseLost
from hypermesh.state.records import dumps

if TYPE_CHECKING:
    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")


class CampaignHost(Protocol):
    """What :class:`Campaign` uses of its agent: it waits for ``mirror_ready`` and clears
    ``view_changed`` (set by the agent on every batch the mirror applies)."""

    cfg: AgentConfig
    etcd: Etcd
    ks: Keyspace
    view: MeshView
    mirror_ready: asyncio.Event
    view_changed: asyncio.Event
    stopping: asyncio.Event

    @property
    def lease_is_lost(self) -> bool: ...

    def decide(self, message: str) -> None: ...


class Campaign:
    """One agent's candidacy. ``lease`` is the candidacy's lease while this node holds one
    (0 otherwise) and ``stood_at`` the create revision of its key; only :meth:`run`
    changes them, and the agent revokes the lease when it stops."""

    def __init__(self, agent: CampaignHost) -> None:
        self.agent = agent
        self.lease = 0
        self.stood_at = 0

    def held(self) -> tuple[str, int] | None:
        """The candidacy key this node stands with and the revision it was created at
        (None: it holds none). Leader-only writes compare both (``agent/burst/fence.py``):
        a key that lapsed, or was cleared by a node that stood since, fails them."""
        if not self.lease or not self.stood_at:
            return None
        return self.agent.ks.candidate(self.lease), self.stood_at

    async def run(self) -> None:
        """Lead when no live node does (see the module docstring)."""
        a = self.agent
        await a.mirror_ready.wait()
        while True:
            a.view_changed.clear()
            vacant = a.view.vacant_candidacies()
            if vacant is None or not self._may_lead():
                await a.view_changed.wait()
                continue
            try:
                stood_at = await self._stand(vacant, a.view.revision)
            except (EtcdUnavailable, LeaseLost) as exc:
                log.warning("%s: campaign: %s", a.cfg.name, exc)
                await asyncio.sleep(0.5)
                continue
            if stood_at:
                await self._hold_candidacy(stood_at)

    def _may_lead(self) -> bool:
        a = self.agent
        return (
            not a.stopping.is_set()
            and not a.lease_is_lost
            and a.cfg.name in a.view.nodes
        )

    async def _stand(self, vacant: list[str], seen: int) -> int:
        """Put this node's candidacy, clearing the keys of ``vacant`` (as of the view's
        revision ``seen``), in one transaction that fails if any candidacy was put
        after ``seen``: of the nodes that saw the same vacancy, one wins. Returns the
        revision of the candidacy, or 0 when another node stood first."""
        a = self.agent
        lease = await a.etcd.grant(a.cfg.leader_ttl)
        done = await a.etcd.txn(
            [a.etcd.none_created_since(a.ks.election, seen)],
            [
                *(a.etcd.op_delete(a.ks.election + key) for key in vacant),
                a.etcd.op_put(
                    a.ks.candidate(lease), dumps({"node": a.cfg.name}), lease
                ),
            ],
        )
        if not done.succeeded:
            await a.etcd.revoke(lease)
            return 0
        self.lease, self.stood_at = lease, done.revision
        a.decide(f"stood for leader with candidacy {lease:x}")
        return done.revision

    async def _hold_candidacy(self, stood_at: int) -> None:
        """Keep the candidacy's lease alive until it lapses or its key is gone (a
        node that stood while this node's own node key was gone cleared it)."""
        a = self.agent
        lease, key = self.lease, f"{self.lease:016x}"
        keeper = asyncio.create_task(
            a.etcd.keep_lease(lease, a.cfg.leader_ttl, lambda: None)
        )
        try:
            while True:
                changed = asyncio.ensure_future(a.view_changed.wait())
                await asyncio.wait([keeper, changed], return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if keeper.done():
                    a.decide(f"candidacy {lease:x} lapsed")
                    break
                a.view_changed.clear()
                if a.view.revision >= stood_at and key not in a.view.candidates:
                    a.decide(f"candidacy {lease:x} was cleared")
                    break
        finally:
            keeper.cancel()
            await a.etcd.revoke(lease)
            self.lease = self.stood_at = 0
