"""The agent's scheduling loop: what it does every time something may have changed.

It wakes when the mirror applied a batch, an attempt ended, a block was released, a gang
seat was given back or a timer (locality, pool preference, progress) fell due, and then, in
order: checks that the node lease is still fresh (a node that was paused past its TTL
treats it as lost), leads when this node leads and the view changed
(``agent/leader/duty.py``), stops attempts of cancelled work, reads back claims it is
unsure of (``agent/claims/unsure.py``) and claims what fits (``agent/claims/claimer.py``).
A round that fails is retried at the next wake-up; a failing etcd wakes it again in half a
second. The loop ends when the agent drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from hypermesh.errors import EtcdUnavailable, LeaseLost

if TYPE_CHECKING:
    from hypermesh.agent.claims.claimer import Claimer
    from hypermesh.agent.claims.unsure import UnsureClaims
    from hypermesh.agent.leader.duty import LeaderDuty
    from hypermesh.agent.tasks.attempts import Attempts
    from hypermesh.agent.tasks.blocks import BlockDuty
    from hypermesh.config import AgentConfig
    from hypermesh.state.view import MeshView

log = logging.getLogger("hypermesh.agent")


class SchedulerHost(Protocol):
    """What :class:`Scheduler` uses of its agent: it waits on and clears ``wakeup``, and
    sets ``lease_lost`` when the lease is surely gone."""

    cfg: AgentConfig
    view: MeshView
    leader_duty: LeaderDuty
    attempts: Attempts
    unsure: UnsureClaims
    blocks: BlockDuty
    claimer: Claimer
    mirror_ready: asyncio.Event
    wakeup: asyncio.Event
    stopping: asyncio.Event
    lease_lost: asyncio.Event

    @property
    def is_leader(self) -> bool: ...

    def lease_fresh(self) -> bool: ...

    def decide(self, message: str) -> None: ...


class Scheduler:
    """The loop of one agent; see the module docstring. It keeps no state of its own:
    its duties do."""

    def __init__(self, agent: SchedulerHost) -> None:
        self.agent = agent

    async def run(self) -> None:
        a = self.agent
        view, lead = a.view, a.leader_duty
        await a.mirror_ready.wait()
        while not a.stopping.is_set():
            await a.wakeup.wait()
            a.wakeup.clear()
            if a.stopping.is_set() or a.lease_lost.is_set():
                continue
            if not a.lease_fresh():
                a.lease_lost.set()
                continue
            leading = a.is_leader
            if leading == view.defer_batches:  # it took over, or handed over
                # Only the leader (and a node claiming a block) needs every batch of
                # every block applied; the rest wait in the view until asked for.
                view.set_defer_batches(not leading)
                lead.handed_over()  # what another leader published since is unknown
            try:
                if lead.dirty and leading:
                    lead.dirty = False
                    try:
                        await lead.lead()
                    except BaseException:
                        lead.dirty = True  # not done: lead again at the next wake
                        raise
                a.attempts.stop_cancelled()
                if a.unsure:
                    await a.unsure.settle(a.attempts.running, a.blocks.held)
                await a.claimer.claim()
            except LeaseLost:
                a.lease_lost.set()
            except EtcdUnavailable as exc:
                log.warning("%s: %s", a.cfg.name, exc)
                await asyncio.sleep(0.5)
                a.wakeup.set()
            except Exception:  # a round that failed must not end scheduling for good
                log.exception("%s: scheduling round failed; trying again", a.cfg.name)
                a.decide("scheduling round failed (see the log); trying again")
                await asyncio.sleep(0.5)
                a.wakeup.set()
