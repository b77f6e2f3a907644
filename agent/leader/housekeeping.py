"""The leader's housekeeping: deletes workflows past their retention, compacts and
defragments etcd, and notes a database near its quota.

It runs beside the scheduling loop, in a loop of its own (a purge or a defragmentation
takes seconds, which a leader round must not wait for), every ``check_s``, and acts only
while this agent leads. Each check:

1. reads every workflow's state key and deletes the finished workflows that
   ``Retention`` says are due (``MeshSettings.retention``), then the leftovers of
   deletions cut short; each deletion is fenced on the state key's revision it read, so
   a workflow reopened meanwhile (``retry``) stays (``hypermesh/state/cleanup.py``);
2. compacts etcd to the revision ``RevisionLog`` picks, some minutes old;
3. every ``compact_every_s``, reads each member's database size: notes one near its
   quota, and defragments the one member most worth it, if any is and none was
   defragmented for ``defrag_every_s``; then clears a NOSPACE alarm the space freed
   makes stale (``agent/leader/compaction.py``).

Nothing here must survive a change of leader: what it remembers (when it first saw a
workflow end, the revisions it saw) the next leader learns again, later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Protocol

from hypermesh.agent.leader.compaction import HousekeepingConfig, RevisionLog, worth_defragmenting
from hypermesh.agent.leader.retention import Ended, Retention, leftover_wids
from hypermesh.errors import EtcdPermissionDenied, EtcdUnavailable, LeaseLost
from hypermesh.state.cleanup import forget_workflow, purge_workflow
from hypermesh.state.etcd import Etcd
from hypermesh.state.etcd_size import QUOTA_WARN, DbSize, db_size, quota_warning
from hypermesh.state.records import TERMINAL

if TYPE_CHECKING:
    from hypermesh.config import AgentConfig
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger(__name__)

NOTE_PAUSE_S = 0.3
"""Between the two records of a compaction: three of etcd's batch intervals (100 ms)."""


class HousekeepingHost(Protocol):
    """What :class:`Housekeeping` uses of its agent (it changes none of it)."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd
    view: MeshView
    state: str

    @property
    def is_leader(self) -> bool: ...

    @property
    def lease_is_lost(self) -> bool: ...

    def decide(self, message: str) -> None: ...


class Housekeeping:
    """Owned by one agent; acts only while that agent leads. Only its own loop changes
    its state, which it forgets when it stops leading."""

    def __init__(self, agent: HousekeepingHost, cfg: HousekeepingConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self._not_permitted: set[str] = set()  # what etcd refuses this agent's user
        self._forget()

    def _forget(self) -> None:
        self.retention = Retention()
        self.revisions = RevisionLog()
        self._sizes_at = time.monotonic()  # a new leader's first look comes a period later
        self._defragmented_at = float("-inf")
        self._near_quota: set[str] = set()  # members noted near their quota

    def acting(self) -> bool:
        agent = self.agent
        return agent.is_leader and not agent.lease_is_lost and agent.state == "alive"

    async def run(self) -> None:
        leading = False
        while True:
            await asyncio.sleep(self.cfg.check_s)
            if not self.acting():
                if leading:
                    self._forget()
                leading = False
                continue
            leading = True
            try:
                await self.check(time.time(), time.monotonic())
            except (EtcdUnavailable, LeaseLost, EtcdPermissionDenied) as exc:
                log.warning("%s: housekeeping: %s", self.agent.cfg.name, exc)
            except Exception:  # a bug here must not take the agent down
                log.exception("%s: housekeeping failed", self.agent.cfg.name)

    async def check(self, now: float, mono: float) -> None:
        """One check (see the module docstring); ``now`` is wall-clock time, ``mono``
        monotonic."""
        self.revisions.record(mono, self.agent.view.revision)
        await self.retain(now)
        target = self.revisions.target(mono, self.cfg)
        if target is not None and self.acting() and "compaction" not in self._not_permitted:
            try:
                compacted = await self.agent.etcd.compact(target)
            except EtcdPermissionDenied as exc:
                self.refused("compaction", exc)
                return
            self.revisions.done(mono, target)
            log.info("%s: compacted etcd to revision %d%s", self.agent.cfg.name, target,
                     "" if compacted else " (it already was)")
            await self.note_compaction(target, now)
        if mono - self._sizes_at >= self.cfg.compact_every_s and self.acting():
            self._sizes_at = mono
            await self.look_after_members(mono)

    async def note_compaction(self, target: int, now: float) -> None:
        """Record the compaction in etcd, twice, a few of etcd's batch intervals apart.

        The pages a compaction frees stay reserved (bbolt's pending pages) until write
        transactions that begin after it, and after etcd's shared read transaction of
        that time is retired, commit: in an idle mesh none would come, the space would
        never show as free, and it would never be defragmented (seen: a database of
        1.5 MB with 2 keys left, 1.2 MB of it "in use", until the next write). When
        these records are the only change since the compaction, their revisions are not
        worth one of their own: an idle mesh is compacted once, not every
        ``compact_every_s`` for ever."""
        value = json.dumps({"revision": target, "at": now, "by": self.agent.cfg.name}).encode()
        written = 0
        for pause in (NOTE_PAUSE_S, 0.0):
            written = await self.agent.etcd.put(self.agent.ks.compacted, value)
            await asyncio.sleep(pause)
        if written == target + 2:
            self.revisions.passed(written)

    def refused(self, what: str, exc: EtcdPermissionDenied) -> None:
        """Note, once, that etcd refuses ``what`` to this agent's user (a role limited
        to the namespace's prefix, docs/operations.md); it is not tried again while
        this agent lives. The mesh keeps working without it."""
        if what not in self._not_permitted:
            self._not_permitted.add(what)
            self.agent.decide(f"warning: etcd refuses {what} to this agent's user ({exc}); "
                              "not trying it again: an operator with the root role must "
                              "see to it (docs/operations.md)")

    # ------------------------------------------------------------------ retention
    async def retain(self, now: float) -> None:
        """Delete the finished workflows due, then the leftovers due."""
        a = self.agent
        kvs, _ = await a.etcd.get_prefix(a.ks.kind_prefix("wfstate"))
        finished: dict[str, Ended] = {}
        for kv in kvs:
            try:
                data = json.loads(kv.value)
                if data["state"] in TERMINAL:
                    at = data.get("ended_at")
                    finished[kv.key.decode().rsplit("/", 1)[1]] = Ended(
                        data["state"], float(at) if at is not None else None, kv.mod_revision)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("housekeeping: ignoring malformed %s: %s", kv.key, exc)
        for wid in self.retention.due(finished, now, a.view.settings.retention):
            if not self.acting():
                return
            ended = finished[wid]
            forgotten = await forget_workflow(a.etcd, a.ks, wid, ended.revision)
            if forgotten is None:
                continue  # reopened (retry) or deleted since it was read
            purged = await purge_workflow(a.etcd, a.ks, wid)
            a.decide(f"deleted workflow {wid} ({ended.state}; kept for "
                     f"{a.view.settings.retention:.0f}s): {forgotten + purged} keys")
        view = a.view
        with_keys = {wid for wid, _ in view.expanded} | {wid for wid, _ in view.controls} | {
            ref.workflow for ref in view.claims} | {ref.workflow for ref in view.block_claims}
        leftovers = leftover_wids(set(view.workflows) | set(finished), with_keys)
        for wid in self.retention.leftovers_due(leftovers, now, self.cfg.leftover_grace_s):
            if not self.acting():
                return
            purged = await purge_workflow(a.etcd, a.ks, wid)
            a.decide(f"purged {purged} keys left of deleted workflow {wid}")

    # ------------------------------------------------------------------ members
    async def look_after_members(self, mono: float) -> None:
        """Read each member's database size; note one near its quota; defragment the
        one most worth it when the time has come; clear a stale NOSPACE alarm."""
        a = self.agent
        sizes: list[DbSize] = []
        for endpoint in a.etcd.endpoints:
            try:
                async with Etcd([endpoint], timeout=a.etcd.timeout,
                                security=a.etcd.security) as member:
                    sizes.append(await db_size(member, endpoint))
            except EtcdUnavailable as exc:  # a member down: the others still count
                log.warning("%s: housekeeping: %s", a.cfg.name, exc)
            except EtcdPermissionDenied as exc:
                self.refused("maintenance status", exc)
                return
        for db in sizes:
            warning = quota_warning(db)
            if warning is not None and db.endpoint not in self._near_quota:
                a.decide(f"warning: {warning}")
            if warning is None:
                self._near_quota.discard(db.endpoint)
            else:
                self._near_quota.add(db.endpoint)
        worth = [db for db in sizes if worth_defragmenting(db.size, db.in_use, self.cfg)]
        if (worth and mono - self._defragmented_at >= self.cfg.defrag_every_s
                and "defragmentation" not in self._not_permitted):
            db = max(worth, key=lambda d: d.size - d.in_use)
            self._defragmented_at = mono
            try:
                async with Etcd([db.endpoint], timeout=a.etcd.timeout,
                                security=a.etcd.security) as member:
                    started = time.monotonic()
                    await member.defragment(self.cfg.defrag_timeout_s)
                    after = await db_size(member, db.endpoint)
                a.decide(f"defragmented etcd member {db.endpoint} in "
                         f"{time.monotonic() - started:.2f}s: {db.size} -> {after.size} bytes")
                sizes = [after if d.endpoint == db.endpoint else d for d in sizes]
            except EtcdPermissionDenied as exc:
                self.refused("defragmentation", exc)
        if (sizes and all(d.size < QUOTA_WARN * d.quota for d in sizes)
                and "alarm disarm" not in self._not_permitted):
            try:
                if await a.etcd.disarm_nospace():
                    a.decide("cleared etcd's NOSPACE alarm: the database is below its "
                             "quota again")
            except EtcdPermissionDenied as exc:
                self.refused("alarm disarm", exc)
