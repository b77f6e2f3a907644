"""Mesh-wide settings: one key (``settings``) that ``submit``, the CLI and the agents read,
and the seats of the nodes that watch the whole namespace (``take_watch_seat``).

A mesh that never set it runs with the defaults below. ``hypermesh settings`` shows
and changes them; each change is a compare-and-swap on the key, so two people
changing different settings at once both land.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any

from hypermesh.errors import UsageError
from hypermesh.recipe.units import UnitError, parse_duration
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace

DEFAULT_MAX_WORKFLOW_TASKS = 1_000_000
DEFAULT_RETENTION_S = 7 * 86400.0
DEFAULT_FLUSH_RATE = 200
DEFAULT_WATCH_ALL = 4
MAX_WORKFLOW_TASKS_LIMIT = 10**9  # what the setting itself may be raised to
MAX_FLUSH_RATE = 1_000_000
MAX_WATCH_ALL = 10_000


@dataclass(frozen=True)
class MeshSettings:
    max_workflow_tasks: int = DEFAULT_MAX_WORKFLOW_TASKS
    """Tasks one workflow may plan, all experiments together; ``submit`` refuses more."""

    retention: float = DEFAULT_RETENTION_S
    """Seconds a finished workflow is kept before the leader deletes it; 0 keeps it."""

    flush_rate: int = DEFAULT_FLUSH_RATE
    """Batches of block results a second that the mesh's nodes write, all together, when
    every node is ending tasks all the time: each node writes its own at most every
    ``members / flush_rate`` seconds (``hypermesh.agent.tasks.blocks.flush_window``)."""

    watch_all: int = DEFAULT_WATCH_ALL
    """Nodes started with ``--watch auto`` that watch the whole namespace, at most (each
    holds a seat, ``take_watch_seat``); the others watch their own part (``own``). So a
    small mesh runs as ``all`` and what a task costs a large one grows with these seats,
    not with its members. 0: every ``auto`` node watches its own part."""

    def __post_init__(self) -> None:
        _check_count("max-workflow-tasks", self.max_workflow_tasks, 1, MAX_WORKFLOW_TASKS_LIMIT)
        if not 0 <= self.retention <= 100 * 365 * 86400:
            raise UsageError(f"retention must be 0 (keep) to 100 years, not {self.retention!r}")
        _check_count("flush-rate", self.flush_rate, 1, MAX_FLUSH_RATE)
        _check_count("watch-all", self.watch_all, 0, MAX_WATCH_ALL)

    def to_json(self) -> dict[str, Any]:
        return {"max_workflow_tasks": self.max_workflow_tasks, "retention": self.retention,
                "flush_rate": self.flush_rate, "watch_all": self.watch_all}

    @classmethod
    def from_json(cls, data: Any) -> MeshSettings:
        """Settings from the stored JSON; unknown fields (a newer version's) are ignored,
        missing ones take their defaults."""
        if not isinstance(data, dict):
            raise UsageError(f"stored mesh settings are not an object: {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def changed(self, assignments: list[str]) -> MeshSettings:
        """These settings with ``NAME=VALUE`` assignments applied (CLI spelling, e.g.
        ``max-workflow-tasks=5000``, ``retention=3d``, ``flush-rate=500``, ``watch-all=8``;
        ``retention=0`` keeps forever)."""
        kinds = {f.name: f.type for f in dataclasses.fields(self)}  # "int" or "float"
        changes: dict[str, Any] = {}
        for assignment in assignments:
            name, sep, value = assignment.partition("=")
            field = name.strip().replace("-", "_")
            if not sep or field not in kinds:
                names = ", ".join(k.replace("_", "-") for k in kinds)
                raise UsageError(f"{assignment!r}: expected NAME=VALUE with NAME one of {names}")
            try:
                if kinds[field] == "int":
                    changes[field] = int(value.strip().replace("_", ""))
                else:
                    changes[field] = parse_duration(value.strip())
            except (ValueError, UnitError) as exc:
                raise UsageError(f"{name}: {exc}") from exc
        return dataclasses.replace(self, **changes)


def _check_count(name: str, value: Any, least: int, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise UsageError(f"{name} must be an integer from {least} to {most}, not {value!r}")


async def load_settings(etcd: Etcd, ks: Keyspace) -> tuple[MeshSettings, int]:
    """The mesh's settings and the key's mod revision (0: never set, the defaults)."""
    got = await etcd.get(ks.settings)
    if got is None:
        return MeshSettings(), 0
    return MeshSettings.from_json(json.loads(got[0])), got[1]


async def change_settings(etcd: Etcd, ks: Keyspace, assignments: list[str]) -> MeshSettings:
    """Apply ``assignments`` to the stored settings (compare-and-swap, retried)."""
    for _ in range(20):
        current, revision = await load_settings(etcd, ks)
        new = current.changed(assignments)
        guard = etcd.mod_revision_is(ks.settings, revision) if revision else etcd.absent(
            ks.settings
        )
        value = json.dumps(new.to_json(), separators=(",", ":")).encode()
        if (await etcd.txn([guard], [etcd.op_put(ks.settings, value)])).succeeded:
            return new
    raise UsageError("the mesh settings kept changing; try again")


async def take_watch_seat(etcd: Etcd, ks: Keyspace, node: str, lease: int) -> int | None:
    """Take a free seat of the nodes that watch the whole namespace (``watchall/<seat>``,
    on ``lease``, so a dead holder's seat frees itself): the seat, or None when the
    mesh's ``watch-all`` seats are all taken. Each take is a create-if-absent, so nodes
    that start at once never share a seat, and never more than ``watch-all`` hold one
    (seats past a lowered setting stay with their holders until they leave)."""
    settings, _ = await load_settings(etcd, ks)
    for _ in range(5):
        kvs, _ = await etcd.get_prefix(ks.watch_seats)
        taken = {kv.key.decode().rpartition("/")[2] for kv in kvs}
        free = [seat for seat in range(settings.watch_all) if f"{seat:05d}" not in taken]
        if not free:
            return None
        seat = random.choice(free)  # nodes starting at once mostly try different seats
        key = ks.watch_seat(seat)
        done = await etcd.txn([etcd.absent(key)], [etcd.op_put(key, node.encode(), lease)])
        if done.succeeded:
            return seat
    return None
