"""Gang claims for distributed training: the pure policy. ``agent/gang/duty.py`` does the I/O.

A task of an experiment with ``nodes: N`` (N > 1) runs only while N distinct agents
each hold one rank (a *seat*, see ``hypermesh.state.gangs``) of it at once: all or nothing.

**Forming a gang.** An agent with a free slot joins only the *oldest open gang*: gang
tasks are ordered like ordinary claims (oldest workflow first, experiments in
dependency order, tasks by index), a gang is open while it has a free seat and no
result, and the agent takes the lowest free rank of the first open gang it may run
(hardware, pools, ``workers`` cap), in one transaction that fails if that rank was
taken. While it waits in a gang that has not filled, it joins no other. Because every
agent fills the same gang first, two gangs never each hold half of the mesh: the
older one fills before anyone sits in the younger one (an agent that cannot run the
older one, or that gave up on it, may sit in a younger one; then the waiting bound
below undoes any stand-off). An agent does not join a gang at all while fewer live
nodes than N could run it ("waiting for 4 nodes, 2 in mesh").

**Waiting is bounded.** A member whose gang has not filled within ``wait_s`` gives its
seat back and does not join that gang again for ``backoff_s``, so a gang that cannot
fill (its other candidates are busy) does not hold capacity forever; the task stays
pending and ``status``/``tasks`` say why.

**Starting.** When all N seats are held, the member of rank 0 picks a free port,
claims the task and publishes the rendezvous (attempt, master address and port, the
seats) in one transaction that requires every seat to be unchanged. Every member,
rank 0 included, starts its process when it sees a rendezvous naming its own seat;
the process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK`` (``rendezvous_env``).

**Ending.** A member other than rank 0 records how its process ended; rank 0 records
the attempt once its own process ended and every other member's end is known (at
once if its own failed), with one outcome for the gang (``hypermesh.state.gangs.combine``):
a result only while every seat of the attempt is still held.

**Restart.** When a seat of a running attempt vanishes (its agent died: its lease and
with it the seat went), or the rendezvous does (rank 0 died), or a member failed,
every other member stops its process (SIGTERM, SIGKILL after the grace period); rank
0 records the attempt ``node-lost`` (not counted against ``retries``; a dead rank 0's
attempt is closed ``node-lost`` by the next start). The surviving members keep their
seats, a new member takes the free one, and the gang runs again as a new attempt with
the same ``HM_CHECKPOINT_DIR``, from which the training resumes.

``plan`` takes the view, this node's members and a monotonic time, and returns
actions; it does no I/O and reads no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hypermesh.state.fit import fits
from hypermesh.state.gangs import MemberEnd, Rendezvous, combine, live_nodes_for
from hypermesh.state.keyspace import TaskRef
from hypermesh.state.records import TERMINAL, NodeRecord
from hypermesh.state.txns import ClaimPlan
from hypermesh.state.view import MeshView


@dataclass(frozen=True)
class GangConfig:
    """Timings of gang forming; validated at construction.

    ``wait_s``: seconds a member holds its seat while the gang does not fill. Longer
    lets a gang wait out busy nodes; shorter frees capacity sooner when it cannot fill.
    ``backoff_s``: seconds a member that gave its seat back for waiting too long stays
    out of that gang, so that it can run other work (or a younger gang) meanwhile.
    """

    wait_s: float = 60.0
    backoff_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("wait_s", "backoff_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"GangConfig.{name} must be > 0 seconds, got {value}")

    @classmethod
    def lan(cls) -> GangConfig:
        return cls(wait_s=60.0, backoff_s=30.0)

    @classmethod
    def local(cls) -> GangConfig:
        """Tight timings for tests and a local mesh."""
        return cls(wait_s=4.0, backoff_s=4.0)


@dataclass
class Member:
    """This node's seat in one gang. Owned (changed) by the gang duty; ``plan`` reads it."""

    ref: TaskRef
    rank: int
    seat_revision: int
    since: float  # monotonic time it began waiting for the gang to fill
    attempt: int = 0  # newest attempt it started a process for (0: none yet)
    running: bool = False  # its process of ``attempt`` is alive
    stopping: bool = False  # a stop was asked for that process
    outcome: MemberEnd | None = None  # rank 0: its own end of ``attempt``, until recorded
    started_at: float = 0.0  # wall time its process of ``attempt`` started


@dataclass(frozen=True)
class Join:
    ref: TaskRef
    rank: int


@dataclass(frozen=True)
class Leave:
    """Give the seat back (``why``: timeout, done) or, ``why == "lost"``, forget a seat
    that is already gone."""

    ref: TaskRef
    why: str


@dataclass(frozen=True)
class Start:
    plan: ClaimPlan
    seats: dict[int, tuple[str, int]]


@dataclass(frozen=True)
class Launch:
    ref: TaskRef
    rdv: Rendezvous


@dataclass(frozen=True)
class Stop:
    ref: TaskRef
    reason: str


@dataclass(frozen=True)
class Record:
    """Rank 0 records the attempt of ``rdv`` as ``end``, with the task's result ``final``."""

    ref: TaskRef
    rdv: Rendezvous
    end: MemberEnd
    final: str | None


@dataclass(frozen=True)
class Drop:
    """Rank 0's own end belongs to an attempt that is no longer running: forget it."""

    ref: TaskRef


Action = Join | Leave | Start | Launch | Stop | Record | Drop


def rendezvous_env(ref: TaskRef, rank: int, rdv: Rendezvous) -> dict[str, str]:
    """The standard ``torch.distributed`` environment of one member (one process per
    node), plus hypermesh's own names for it (``torchrun`` overwrites ``RANK`` and
    ``WORLD_SIZE`` per process; ``HM_GANG_RANK``/``HM_GANG_SIZE`` stay per node)."""
    size = str(len(rdv.seats))
    return {
        "MASTER_ADDR": rdv.master_addr,
        "MASTER_PORT": str(rdv.master_port),
        "WORLD_SIZE": size,
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "HM_GANG_ID": f"{ref.id}.{rdv.attempt}",
        "HM_GANG_ATTEMPT": str(rdv.attempt),
        "HM_GANG_RANK": str(rank),
        "HM_GANG_SIZE": size,
    }


def _stopped(view: MeshView, ref: TaskRef) -> bool:
    return (
        ref.workflow not in view.workflows
        or view.workflow_state(ref.workflow) in TERMINAL
        or view.experiment_cancelled(ref.workflow, ref.experiment)
    )


def _member(view: MeshView, node: NodeRecord, m: Member, now: float,
            cfg: GangConfig, accepting: bool) -> Action | None:
    """What to do next about one seat of this node."""
    ref = m.ref
    seat = view.gangs.seats_of(ref).get(m.rank)
    if seat is None or seat.revision != m.seat_revision:  # our lease lapsed or was revoked
        if m.running:
            return None if m.stopping else Stop(ref, "node-lost")
        return Leave(ref, "lost")
    rdv = view.gangs.rendezvous.get(ref)
    ours = rdv is not None and rdv.attempt == m.attempt
    if m.running:
        if m.stopping:
            return None
        if _stopped(view, ref) or ref in view.results:
            return Stop(ref, "cancelled")
        if rdv is None or not ours or not view.gangs.intact(ref, rdv):
            return Stop(ref, "node-lost")
        ends = view.gangs.ends.get(ref, {}).get(m.attempt, {})
        if any(e.state != "succeeded" for rank, e in ends.items() if rank != m.rank):
            return Stop(ref, "peer-failed")
        return None
    if m.outcome is not None:  # rank 0's process ended: record the attempt
        if rdv is None or not ours:
            return Drop(ref)
        if not view.gangs.intact(ref, rdv):
            return Record(ref, rdv, MemberEnd("failed", None, "node-lost"), None)
        ends = dict(view.gangs.ends.get(ref, {}).get(m.attempt, {}))
        ends[m.rank] = m.outcome
        if m.outcome.state == "succeeded" and len(ends) < len(rdv.seats):
            return None  # the others are still running
        end = combine(ends)
        exp = view.workflows[ref.workflow].recipe.experiment(ref.experiment)
        return Record(ref, rdv, end, view.final_state(ref, end.state, end.reason, exp.retries))
    if ours:
        return None  # our process ended: rank 0 records the attempt while we hold the seat
    if ref in view.results or _stopped(view, ref):
        return Leave(ref, "done")
    if rdv is not None:
        mine = rdv.seats.get(m.rank) == (node.name, m.seat_revision)
        if accepting and rdv.attempt > m.attempt and mine:
            return Launch(ref, rdv)
        return None  # an attempt runs (it may not include us): wait for its end
    seats = view.gangs.seats_of(ref)
    exp = view.workflows[ref.workflow].recipe.experiment(ref.experiment)
    if len(seats) < exp.nodes:
        return Leave(ref, "timeout") if now - m.since > cfg.wait_s else None
    if now - m.since > 2 * cfg.wait_s:
        return Leave(ref, "timeout")  # full, yet it did not start (no workers slot free)
    if m.rank != 0 or ref in view.claims or not accepting:
        return None
    attempts = view.attempts.get(ref, {})
    last = attempts[max(attempts)] if attempts else None
    lost = last if last is not None and last.state == "running" else None
    slot = None
    workers = view.workers(ref.workflow, exp)
    if workers is not None:
        taken = view.slots.get((ref.workflow, ref.experiment), set())
        free = [k for k in range(workers) if k not in taken]
        if not free:
            return None
        slot = free[0]
    plan = ClaimPlan(ref, (last.attempt if last else 0) + 1, slot, lost)
    return Start(plan, {rank: (s.node, s.revision) for rank, s in seats.items()})


def _join(view: MeshView, node: NodeRecord, members: dict[TaskRef, Member],
          backoff: dict[TaskRef, float], now: float) -> Join | None:
    """A seat in the oldest open gang this node may run, if any."""
    for wf in sorted(view.workflows.values(), key=lambda w: (w.submitted_at, w.id)):
        if view.workflow_state(wf.id) in TERMINAL:
            continue
        for name in wf.recipe.topological_order():
            exp = wf.recipe.experiment(name)
            if exp.nodes <= 1 or (wf.id, name) not in view.expanded:
                continue
            if view.experiment_cancelled(wf.id, name) or not fits(exp.hardware, node):
                continue
            if exp.pools and node.pool not in exp.pools:
                continue
            if live_nodes_for(view.nodes, exp, partial(fits, exp.hardware)) < exp.nodes:
                continue  # it could never fill now
            workers = view.workers(wf.id, exp)
            if workers is not None and len(view.slots.get((wf.id, name), ())) >= workers:
                continue
            for index in sorted(view.open.get((wf.id, name), ())):
                ref = TaskRef(wf.id, name, index)
                seats = view.gangs.seats_of(ref)
                if ref in members or backoff.get(ref, 0.0) > now or len(seats) >= exp.nodes:
                    continue
                if any(s.node == node.name for s in seats.values()):
                    continue  # a seat of ours the view still shows: not yet gone
                return Join(ref, min(r for r in range(exp.nodes) if r not in seats))
    return None


def plan(
    view: MeshView,
    node: NodeRecord,
    members: dict[TaskRef, Member],
    backoff: dict[TaskRef, float],
    free_slots: int,
    now: float,
    cfg: GangConfig,
    accepting: bool = True,
) -> list[Action]:
    """This node's next gang actions: one per seat it holds, then at most one join
    (only with a free slot, and only while it waits in no gang that has not filled).
    A node that is not ``accepting`` (it drains) starts, launches and joins nothing;
    it still stops, records and leaves."""
    actions: list[Action] = []
    for m in members.values():
        action = _member(view, node, m, now, cfg, accepting)
        if action is not None:
            actions.append(action)
    waiting = any(
        not m.running and m.outcome is None and m.ref not in view.gangs.rendezvous
        for m in members.values()
    )
    if accepting and free_slots > 0 and not waiting:
        join = _join(view, node, members, backoff, now)
        if join is not None:
            actions.append(join)
    return actions
