"""Gangs: the etcd records of tasks that need N agents at once, and their transactions.

An experiment with ``nodes: N`` (N > 1) runs each task as a *gang* of N members, one
per agent. The records (keys in ``hypermesh.state.keyspace``), and who writes them:

- **seat** ``gang/<task>/seat/<rank>``: a member holds rank ``rank``; written by the
  member on its own node lease, only if the rank is free (``join``). A dead agent's
  seats vanish with its lease. Seats outlive attempts: the members of a gang that lost
  one of its nodes keep theirs and wait for a new member.
- **rendezvous** ``gang/<task>/rdv``: written by rank 0, when all N seats are held,
  in the same transaction as the task's ordinary claim and attempt record (``start``),
  both on rank 0's lease. It names the attempt, the master address and port (chosen
  by rank 0 before anyone starts) and the revision of every seat it started with. A
  member starts its process only when it sees a rendezvous naming its own seat.
- **end** ``gang/<task>/end/<n>/<rank>``: how a member's process of attempt n ended;
  written by that member while the attempt's claim is unchanged (``member_end``).

Rank 0 records the attempt (``finish``): a result only while the claim *and every
seat the attempt started with* are unchanged, so a gang that lost a member can never
record a success; a lost member makes it record the attempt ``node-lost`` (no result,
not counted against retries) and the gang forms again as a new attempt.

The transactions are in ``hypermesh.state.gang_txns``. ``GangTable`` is the mirror of these
keys inside ``hypermesh.state.mirror.Mirror``; ``waiting_reason`` explains a pending gang
task to ``status`` and ``tasks``. Both are given the tables they read (the mirror's nodes,
claims and results), so this module knows nothing of the view around them. No clock is
read here.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hypermesh.state.keyspace import TaskRef

if TYPE_CHECKING:
    from hypermesh.recipe.recipe import Experiment
    from hypermesh.state.records import NodeRecord


@dataclass(frozen=True)
class Seat:
    """A member's hold on one rank of a gang; ``revision`` (its key's) identifies it."""

    node: str
    host: str
    revision: int


@dataclass(frozen=True)
class Rendezvous:
    """A started gang attempt: who its members are and where rank 0 listens.
    ``revision`` is the start transaction's, which is also the claim's revision."""

    attempt: int
    master_addr: str
    master_port: int
    seats: dict[int, tuple[str, int]]  # rank -> (node, seat revision)
    revision: int

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "seats": {str(k): list(v) for k, v in self.seats.items()},
        }


@dataclass(frozen=True)
class MemberEnd:
    """How one member's process of an attempt ended."""

    state: str
    exit_code: int | None
    reason: str


@dataclass
class GangTable:
    """Mirror of the ``gang/`` keys. Fed by ``Mirror.apply``; everyone else reads."""

    seats: dict[TaskRef, dict[int, Seat]] = field(default_factory=dict)
    rendezvous: dict[TaskRef, Rendezvous] = field(default_factory=dict)
    ends: dict[TaskRef, dict[int, dict[int, MemberEnd]]] = field(default_factory=dict)

    def apply(self, ref: TaskRef, parts: list[str], data: dict[str, Any] | None, mrev: int) -> None:
        kind = parts[0]
        if kind == "seat":
            seats = self.seats.setdefault(ref, {})
            if data is None:
                seats.pop(int(parts[1]), None)
                if not seats:
                    del self.seats[ref]
            else:
                seats[int(parts[1])] = Seat(str(data["node"]), str(data.get("host", "")), mrev)
        elif kind == "rdv":
            if data is None:
                self.rendezvous.pop(ref, None)
            else:
                self.rendezvous[ref] = Rendezvous(
                    attempt=int(data["attempt"]),
                    master_addr=str(data["master_addr"]),
                    master_port=int(data["master_port"]),
                    seats={int(k): (str(v[0]), int(v[1])) for k, v in data["seats"].items()},
                    revision=mrev,
                )
        elif kind == "end":
            attempt, rank = int(parts[1]), int(parts[2])
            by_attempt = self.ends.setdefault(ref, {}).setdefault(attempt, {})
            if data is None:
                by_attempt.pop(rank, None)
            else:
                by_attempt[rank] = MemberEnd(
                    str(data["state"]), data.get("exit_code"), str(data["reason"])
                )
        else:
            raise ValueError(f"unknown gang key kind {kind!r}")

    def seats_of(self, ref: TaskRef) -> dict[int, Seat]:
        return self.seats.get(ref, {})

    def intact(self, ref: TaskRef, rdv: Rendezvous) -> bool:
        """Whether every seat the attempt started with is still held by the same member."""
        seats = self.seats_of(ref)
        return all(
            rank in seats and seats[rank].revision == revision
            for rank, (_, revision) in rdv.seats.items()
        )


def combine(ends: dict[int, MemberEnd]) -> MemberEnd:
    """One outcome for a gang attempt from its members' ends: the first counted failure
    (a failed exit or a timeout, lowest rank first), else any other failure, else
    cancelled, else succeeded (every member exited 0)."""
    ordered = [ends[rank] for rank in sorted(ends)]
    for end in ordered:
        if end.state == "failed" and end.reason in ("exit", "timeout", "data"):
            return end
    for end in ordered:
        if end.state == "failed":
            return MemberEnd("failed", end.exit_code, "node-lost")
    for end in ordered:
        if end.state == "cancelled":
            return end
    return MemberEnd("succeeded", 0, "exit")


def live_nodes_for(
    nodes: Mapping[str, NodeRecord],
    exp: Experiment,
    can_run: Callable[[NodeRecord], bool] | None = None,
) -> int:
    """Live nodes (of ``nodes``, the mirror's table) that may run a member of ``exp``:
    alive, in an allowed pool, and (with ``can_run``, the agent's hardware check) able
    to run it."""
    return sum(
        1
        for n in nodes.values()
        if n.state == "alive"
        and (not exp.pools or n.pool in exp.pools)
        and (can_run is None or can_run(n))
    )


def waiting_reason(
    ref: TaskRef,
    exp: Experiment,
    gangs: GangTable,
    nodes: Mapping[str, NodeRecord],
    claims: Container[TaskRef],
    results: Container[TaskRef],
) -> str | None:
    """Why a pending gang task is not running, for ``status`` and ``tasks``; None
    when it is not a pending gang task (``claims`` and ``results``: the tasks that
    run or are decided)."""
    if exp.nodes <= 1 or ref in results or ref in claims:
        return None
    held = len(gangs.seats_of(ref))
    live = live_nodes_for(nodes, exp)
    if live < exp.nodes:
        return f"waiting for {exp.nodes} nodes, {live} in mesh"
    return f"waiting for {exp.nodes} nodes, {held} of {exp.nodes} ranks held"
