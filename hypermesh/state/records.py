"""The mesh's records: what the keys of a namespace hold, as plain values.

Each record is read from its key's JSON (``from_json``) and written back as the same
JSON (``to_json``, serialised by ``dumps``: compact, keys sorted, so equal records are
equal bytes and a transaction may compare them). Records are immutable (frozen
dataclasses and named tuples, but ``ExperimentSummary``, which the view fills in as it
counts): the mesh changes by writing a key, never by changing a record, so a record
may be shared by any number of readers. Which key holds which record is
``hypermesh.state.keyspace``; the transactions that write them are in ``txns``,
``live``, ``block_txns`` and ``gang_txns``. No I/O, no clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from hypermesh.recipe.recipe import Recipe

State = Literal["pending", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
# Reasons an attempt ended. Only ``exit``, ``timeout``, ``data`` and ``image`` count
# against ``retries``. ``pruned``: the search stopped a trial early; its attempt and task
# end succeeded. ``image``: the node could not pull the task's image (the log says why).
REASONS = ("exit", "node-lost", "preempted", "cancelled", "timeout", "data", "pruned", "image")
LOST_REASONS = ("node-lost", "preempted")  # its node was lost, not the task
# Failures that count against an experiment's retries (a lost or preempted node does not).
COUNTED_REASONS = frozenset({"exit", "timeout", "data", "image"})


def dumps(value: dict[str, Any]) -> bytes:
    """The bytes a record's JSON is stored as: compact, keys sorted."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class NodeRecord:
    """A registered node, as it registered itself (its key lives on its lease)."""

    name: str
    address: str
    pool: str = "default"
    spot: bool = False
    slots: int = 1
    gpus: int = 0
    gpu_type: str = ""
    cpus: float = 1.0
    memory: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    state: str = "alive"
    started_at: float = 0.0
    lease: int = 0
    metrics: str = ""
    """HOST:PORT of the node's Prometheus ``/metrics``; empty when it serves none."""
    http_address: str = ""  # the node's web dashboard, if it serves one
    pulling: dict[str, str] = field(default_factory=dict)
    """``WORKFLOW/EXPERIMENT`` -> image: the experiments whose tasks the node leaves
    unclaimed while it pulls their image (``agent/tasks/images.py``)."""
    offers: bool = False
    """The node chooses blocks from the leader's offers (``offer/<name>``) and watches
    only part of the namespace (``agent start --watch own``)."""

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeRecord:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class WorkflowRecord:
    """A submitted workflow: the parsed recipe plus what submit fixed (id, seed, workdir)."""

    id: str
    name: str
    recipe: Recipe
    seed: int
    submitted_at: float
    workdir: str
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "recipe": self.recipe.to_json(),
            "seed": self.seed,
            "submitted_at": self.submitted_at,
            "workdir": self.workdir,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkflowRecord:
        return cls(
            id=data["id"],
            name=data["name"],
            recipe=Recipe.from_json(data["recipe"]),
            seed=int(data["seed"]),
            submitted_at=float(data["submitted_at"]),
            workdir=data.get("workdir", ""),
            source=data.get("source", ""),
        )


class Claim(NamedTuple):
    """A node's claim on a task for one attempt; ``revision`` fences later writes."""

    node: str
    attempt: int
    slot: int | None
    lease: int
    started_at: float
    revision: int = 0


class Attempt(NamedTuple):
    """One try at running a task. ``state`` is running until the attempt ends."""

    attempt: int
    node: str
    state: str
    exit_code: int | None = None
    reason: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    revision: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "node": self.node,
            "state": self.state,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


class Result(NamedTuple):
    """A task's one final outcome."""

    state: str
    attempt: int
    exit_code: int | None
    ended_at: float


@dataclass(frozen=True)
class ExperimentControl:
    """Live changes to one experiment of a submitted workflow (``expctl/`` key).

    ``workers_set`` tells a changed cap apart from the recipe's: with it,
    ``workers`` replaces the recipe's value (None = no cap, 0 = start nothing new).
    ``extra_samples`` are tasks added on top of the recipe's count. ``revision``
    is the key's mod revision, which writers compare to change it.
    """

    cancelled: bool = False
    workers_set: bool = False
    workers: int | None = None
    extra_samples: int = 0
    revision: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cancelled": self.cancelled, "extra_samples": self.extra_samples}
        if self.workers_set:
            out["workers"] = self.workers
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], revision: int = 0) -> ExperimentControl:
        workers = data.get("workers")
        if workers is not None and (not isinstance(workers, int) or workers < 0):
            raise TypeError(f"workers must be a non-negative integer or null, not {workers!r}")
        return cls(
            cancelled=bool(data.get("cancelled", False)),
            workers_set="workers" in data,
            workers=workers,
            extra_samples=int(data.get("extra_samples", 0)),
            revision=revision,
        )


@dataclass
class ExperimentSummary:
    """How far one experiment of a workflow is: its state and its tasks counted by state
    (one entry of ``hypermesh status``). Built by ``MeshView.experiment_summary``."""

    state: str
    total: int
    pending: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "total": self.total,
            "pending": self.pending,
            "running": self.running,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
        }

