"""The leader's burst duty: runs the bursting policy every tick and carries it out.

Only the leader acts. Each tick it builds a snapshot from its mirror of etcd
(``agent/burst/view.py``), asks ``policy.decide`` what to do, starts and
releases nodes through the pools' provisioners, keeps the records of the nodes
it started (``inst/<node>``), writes every decision to the event log
(``event/...``, the last ``events_kept``), and integrates node-seconds per pool
and per workflow into the usage counters (``usage/<pool>``, ``wfusage/<wid>``).
Each of those writes is fenced on the leader's candidacy (``agent/burst/fence.py``):
a deposed leader's write fails, writing nothing, and the duty stops acting.

Nothing here is needed to continue after a leader change: records, events and
counters live in etcd; what a new leader does not know (how long the backlog
has waited, recent preemptions) it learns again within a few ticks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from hypermesh.agent.burst import view as burst_view
from hypermesh.agent.burst.fence import Candidacy, leader_txn
from hypermesh.agent.burst.kinds import make_provisioner
from hypermesh.agent.burst.policy import (
    BurstConfig,
    Forget,
    Launch,
    PoolHistory,
    Release,
    Snapshot,
    decide,
)
from hypermesh.agent.burst.provisioner import (
    CapacityRefused,
    Context,
    NodeSpec,
    Provisioner,
    ProvisionError,
    launch_with_fallback,
)
from hypermesh.errors import (
    EtcdUnavailable,
    HypermeshError,
    LeadershipLost,
    LeaseLost,
    UsageError,
)
from hypermesh.state.pools import Pool
from hypermesh.state.records import dumps

if TYPE_CHECKING:
    from pathlib import Path

    from hypermesh.config import AgentConfig
    from hypermesh.state.etcd import Etcd
    from hypermesh.state.keyspace import Keyspace
    from hypermesh.state.view import MeshView

log = logging.getLogger(__name__)

LAUNCH_PARALLEL = 8  # provider calls in flight at once when a tick starts many nodes


class BurstHost(Protocol):
    """What :class:`BurstDuty` uses of its agent (it changes none of it)."""

    cfg: AgentConfig
    ks: Keyspace
    etcd: Etcd
    view: MeshView
    work_dir: Path
    state: str

    @property
    def is_leader(self) -> bool: ...

    @property
    def lease_is_lost(self) -> bool: ...

    def full_view(self) -> MeshView: ...

    def decide(self, message: str) -> None: ...

    def candidacy(self) -> Candidacy | None:
        """The election key this agent stands with and its create revision (None:
        it holds none); every burst write is fenced on it."""


class BurstDuty:
    """Owned by one agent; acts only while that agent leads. Only its own loop changes
    its state (what it learned as leader: backlog times, preemptions, usage not yet
    written)."""

    def __init__(self, agent: BurstHost, cfg: BurstConfig) -> None:
        self.agent = agent
        self.cfg = cfg
        self.ks = agent.ks
        self.leading = False
        self._provisioners: dict[str, tuple[Pool, Provisioner]] = {}
        self._backlog_since: dict[str, float] = {}
        self._busy_at: dict[str, float] = {}
        self._preempted: dict[str, deque[float]] = {}
        self._refused: dict[str, float] = {}
        self._events: deque[str] = deque()
        self._last_tick: float | None = None
        self._last_flush = 0.0
        self._pool_delta: dict[str, dict[str, float]] = {}
        self._wf_delta: dict[str, dict[str, dict[str, float]]] = {}
        self._fenced: list[Candidacy | None] = []  # the candidacy a write was refused under

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            if not self.acting():
                self.leading = False
                continue
            try:
                if not self.leading:
                    await self._take_over()
                await self.tick(time.time())
            except LeadershipLost:
                self.leading = False  # _write logged it; acting() is False from now on
            except (EtcdUnavailable, LeaseLost) as exc:
                log.warning("%s: burst: %s", self.agent.cfg.name, exc)
            except Exception:  # a bug here must not take the agent down
                log.exception("%s: burst duty failed", self.agent.cfg.name)

    def acting(self) -> bool:
        """Whether this agent makes burst decisions now: it leads, holds its lease and
        is not draining. A draining leader is about to hand over: it does not count
        itself as capacity, so it would start a node to replace itself, as a child
        of a process that is exiting; the next leader decides instead (and replaces
        it at once if work remains). It must also hold a candidacy (its writes are
        fenced on it), one no write was refused under."""
        agent = self.agent
        held = agent.candidacy()
        if held is None or (self._fenced and held == self._fenced[0]):
            return False  # none, or deposed under this one: only standing again lifts it
        return agent.is_leader and not agent.lease_is_lost and agent.state == "alive"

    async def _take_over(self) -> None:
        kvs, _ = await self.agent.etcd.get_prefix(self.ks.kind_prefix("event"))
        self._events = deque(kv.key.decode() for kv in kvs)
        self._last_tick = None
        self.leading = True

    def _declared(self) -> dict[str, Pool]:
        pools = {}
        for name, data in self.agent.view.pools.items():
            try:
                pools[name] = Pool.from_json(data)
            except (UsageError, TypeError) as exc:
                log.warning("ignoring pool %s: %s", name, exc)
        return pools

    async def tick(self, now: float) -> None:
        if not self._declared() and not self.agent.view.instances:
            self._last_tick = now
            return  # nothing to scale and no prices: no work, no writes
        await self._mark_registered()
        snap = self._snapshot(now)
        for action in decide(snap, self.cfg):
            if isinstance(action, Launch):
                await self._launch(action, snap.pools[action.pool], now)
            elif isinstance(action, Release):
                await self._release(action, snap.pools.get(action.pool))
            elif isinstance(action, Forget):
                if action.node not in snap.on_demand_lost:  # the spot preemption rate
                    self._preempted.setdefault(action.pool, deque()).append(now)
                await self._drop_record(action.node)
                await self._event("forget", action.pool, node=action.node, reason=action.reason)
        await self._release_orphans()
        if now - self._last_flush >= self.cfg.usage_flush_s:
            await self._flush_usage()
            self._last_flush = now

    def _snapshot(self, now: float) -> Snapshot:
        """What the policy decides on, read from the mirror in one step: no await in
        here, so no event lands half-way (a node that registers between reading the
        nodes and reading the starting ones would be counted in neither, and the
        pool would grow past its max)."""
        view = self.agent.full_view()
        pools = burst_view.pools_in_use(view, self._declared())
        self._integrate(now)
        backlog, self._backlog_since = burst_view.backlog(
            view, pools, self._backlog_since, now, self.cfg.default_task_s
        )
        nodes, self._busy_at = burst_view.nodes(view, self._busy_at, now)
        preempted = tuple(v for v in burst_view.vanished(view) if v[1] in pools)
        return Snapshot(
            pools=pools,
            nodes=nodes,
            starting=burst_view.starting(view, now),
            backlog=backlog,
            history=self._history(now),
            preempted=preempted,
            on_demand_lost=frozenset(
                node for node, _ in preempted if not view.instances[node].get("spot")
            ),
            leaving=burst_view.leaving(view),
        )

    def _history(self, now: float) -> dict[str, PoolHistory]:
        history = {}
        for pool in set(self._preempted) | set(self._refused):
            times = self._preempted.get(pool, deque())
            while times and now - times[0] > self.cfg.preemption_window_s:
                times.popleft()
            refused = self._refused.get(pool)
            history[pool] = PoolHistory(
                tuple(now - t for t in times), None if refused is None else now - refused
            )
        return history

    # ------------------------------------------------------------------ nodes
    def _provisioner(self, pool: Pool) -> Provisioner:
        known = self._provisioners.get(pool.name)
        if known is None or known[0] != pool:
            scheme = "https" if self.agent.etcd.security.tls else "http"
            endpoints = ",".join(f"{scheme}://{e}" for e in self.agent.etcd.endpoints)
            ctx = Context(endpoints, self.ks.namespace, self.agent.work_dir / "burst",
                          self.agent.cfg.store,
                          tuple(self.agent.etcd.security.env().items()), self.agent.cfg.tls)
            known = (pool, make_provisioner(pool, ctx))
            self._provisioners[pool.name] = known
        return known[1]

    async def _write(self, compare: list[Any], ops: list[Any]) -> bool:
        """Every leader-only write goes through here: ``ops`` apply only while this
        agent's candidacy stands (and ``compare`` holds; False when it does not). A
        deposed leader writes nothing: it logs that once, stops acting until it
        stands again, and raises :class:`LeadershipLost` to end the tick."""
        held = self.agent.candidacy()
        try:
            return await leader_txn(self.agent.etcd, held, compare, ops)
        except LeadershipLost as exc:
            if not self._fenced or self._fenced[0] != held:
                self._fenced = [held]
                self.leading = False
                self.agent.decide(f"burst: no longer leader, stopped acting ({exc})")
            raise

    async def _put_record(self, node: str, record: dict[str, Any]) -> None:
        await self._write([], [self.agent.etcd.op_put(self.ks.instance(node), dumps(record))])

    async def _drop_record(self, node: str) -> None:
        await self._write([], [self.agent.etcd.op_delete(self.ks.instance(node))])

    async def _mark_registered(self) -> None:
        view = self.agent.view
        for name, record in list(view.instances.items()):
            if record.get("state") == "starting" and name in view.nodes:  # still up
                await self._put_record(name, record | {"state": "running"})

    async def _launch(self, action: Launch, pool: Pool, now: float) -> None:
        reason = f"{action.reason}; {action.market}" if action.market else action.reason
        await self._event("launch", pool.name, count=action.count, spot=action.spot,
                          reason=reason)
        records = {}
        for _ in range(action.count):
            name = f"{pool.name}-{secrets.token_hex(3)}"
            records[name] = {"pool": pool.name, "spot": action.spot, "provider_id": "",
                             "requested_at": now, "state": "starting",
                             "by": self.agent.cfg.name}
            await self._put_record(name, records[name])  # first: a crash leaves a trace
        gate = asyncio.Semaphore(LAUNCH_PARALLEL)

        async def start(name: str) -> None:
            async with gate:
                await self._start(name, records[name], NodeSpec(name, pool, action.spot), now)

        await asyncio.gather(*(start(name) for name in records))

    async def _start(self, name: str, record: dict[str, Any], spec: NodeSpec,
                     now: float) -> None:
        pool = spec.pool
        try:
            started = await asyncio.to_thread(launch_with_fallback, self._provisioner(pool), spec)
        except (CapacityRefused, ProvisionError) as exc:
            refused = isinstance(exc, CapacityRefused)
            if refused and spec.spot:  # spot and on-demand both refused
                self._refused[pool.name] = now
            await self._drop_record(name)
            await self._event("refused" if refused else "failed", pool.name, node=name,
                              spot=spec.spot, reason=str(exc))
            return
        if started.refused is not None:
            self._refused[pool.name] = now
            await self._event("refused", pool.name, node=name, spot=True,
                              reason=f"{started.refused}; started on-demand instead")
        await self._put_record(
            name, record | {"provider_id": started.provider_id, "spot": started.spot}
        )
        self.agent.decide(f"burst: started {name} in pool {pool.name} "
                          f"({'spot' if started.spot else 'on-demand'})")

    async def _release(self, action: Release, pool: Pool | None) -> None:
        record = self.agent.view.instances.get(action.node)
        if record is None or record.get("state") == "releasing":
            return
        provider_id = str(record.get("provider_id", ""))
        stopped = True
        if pool is not None and pool.provisioned:
            await self._write([], [])  # a deposed leader terminates nothing
            try:
                stopped = await asyncio.to_thread(
                    self._provisioner(pool).terminate, action.node, provider_id
                )
            except HypermeshError as exc:
                log.warning("releasing %s: %s", action.node, exc)
                return  # tried again next tick
        if not stopped:
            # Not ours after all (the record is wrong): forget it, touch nothing.
            await self._drop_record(action.node)
            await self._event("forget", action.pool, node=action.node,
                              reason=f"{provider_id} is not a node this mesh started")
            return
        await self._put_record(action.node, record | {"state": "releasing"})
        await self._event("release", action.pool, node=action.node, reason=action.reason)
        self.agent.decide(f"burst: released {action.node} ({action.reason})")

    async def _release_orphans(self) -> None:
        """Drop the records of released nodes once they have deregistered."""
        view = self.agent.view
        for name, record in list(view.instances.items()):
            if record.get("state") == "releasing" and name not in view.nodes:
                await self._drop_record(name)

    # ------------------------------------------------------------------ events
    async def _event(self, action: str, pool: str, *, node: str | None = None,
                     count: int | None = None, spot: bool | None = None, reason: str) -> None:
        at = time.time()
        event = {"at": at, "leader": self.agent.cfg.name, "action": action, "pool": pool,
                 "node": node, "count": count, "spot": spot, "reason": reason}
        key = self.ks.event(time.time_ns(), self.agent.cfg.name)
        etcd = self.agent.etcd
        ops = [etcd.op_put(key, dumps(event))]
        self._events.append(key)
        while len(self._events) > self.cfg.events_kept and len(ops) < 100:
            ops.append(etcd.op_delete(self._events.popleft()))
        await self._write([], ops)
        self.agent.decide(f"burst event: {json.dumps(event, sort_keys=True)}")

    # ------------------------------------------------------------------ usage
    def _integrate(self, now: float) -> None:
        """Add the node-seconds since the last tick (at most a few ticks' worth: a
        stalled or new leader does not bill time it did not watch)."""
        last, self._last_tick = self._last_tick, now
        if last is None:
            return
        dt = min(now - last, 4 * self.cfg.tick_s)
        if dt <= 0:
            return
        per_pool, per_wf = burst_view.node_seconds(self.agent.view, dt)
        _add(self._pool_delta, per_pool)
        for wid, used in per_wf.items():
            _add(self._wf_delta.setdefault(wid, {}), used)

    async def _flush_usage(self) -> None:
        view = self.agent.view
        for pool, delta in list(self._pool_delta.items()):
            current = view.usage.get(pool)
            if await self._add_to(self.ks.usage(pool), current, lambda d, x=delta: _sum(d, x)):
                del self._pool_delta[pool]
        for wid, delta_wf in list(self._wf_delta.items()):
            if wid not in view.workflows:  # deleted: its usage went with it
                del self._wf_delta[wid]
                continue
            current = view.workflow_usage.get(wid)

            def merged(d: dict[str, Any], x: dict[str, dict[str, float]] = delta_wf) -> Any:
                return {p: _sum(d.get(p, {}), x.get(p, {})) for p in set(d) | set(x)}

            # Only while the workflow is stored: a deletion racing this write wins.
            if await self._add_to(self.ks.workflow_usage(wid), current, merged,
                                  self.ks.workflow(wid)):
                del self._wf_delta[wid]

    async def _add_to(self, key: str, current: tuple[dict[str, Any], int] | None,
                      merge: Any, owner: str | None = None) -> bool:
        """Write ``merge(current)`` if the key is still at the revision we saw (and the
        ``owner`` key exists)."""
        etcd = self.agent.etcd
        data, revision = current if current is not None else ({}, 0)
        compare = [etcd.mod_revision_is(key, revision) if revision else etcd.absent(key)]
        if owner is not None:
            compare.append(etcd.present(owner))
        return await self._write(compare, [etcd.op_put(key, dumps(merge(data)))])


def _sum(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: round(float(a.get(k, 0.0)) + float(b.get(k, 0.0)), 3) for k in set(a) | set(b)}


def _add(into: dict[str, dict[str, float]], more: dict[str, dict[str, float]]) -> None:
    for key, values in more.items():
        into[key] = _sum(into.get(key, {}), values)
