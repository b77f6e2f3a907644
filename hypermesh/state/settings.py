"""Mesh-wide settings: one key (``settings``) that ``submit``, the CLI and the leader read.

A mesh that never set it runs with the defaults below. ``hypermesh settings`` shows
and changes them; each change is a compare-and-swap on the key, so two people
changing different settings at once both land.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from hypermesh.errors import UsageError
from hypermesh.recipe.units import UnitError, parse_duration
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace

DEFAULT_MAX_WORKFLOW_TASKS = 1_000_000
DEFAULT_RETENTION_S = 7 * 86400.0
MAX_WORKFLOW_TASKS_LIMIT = 10**9  # what the setting itself may be raised to


@dataclass(frozen=True)
class MeshSettings:
    max_workflow_tasks: int = DEFAULT_MAX_WORKFLOW_TASKS
    """Tasks one workflow may plan, all experiments together; ``submit`` refuses more."""

    retention: float = DEFAULT_RETENTION_S
    """Seconds a finished workflow is kept before the leader deletes it; 0 keeps it."""

    def __post_init__(self) -> None:
        if isinstance(self.max_workflow_tasks, bool) or not isinstance(
            self.max_workflow_tasks, int
        ) or not 1 <= self.max_workflow_tasks <= MAX_WORKFLOW_TASKS_LIMIT:
            raise UsageError(
                f"max-workflow-tasks must be an integer from 1 to {MAX_WORKFLOW_TASKS_LIMIT}, "
                f"not {self.max_workflow_tasks!r}"
            )
        if not 0 <= self.retention <= 100 * 365 * 86400:
            raise UsageError(f"retention must be 0 (keep) to 100 years, not {self.retention!r}")

    def to_json(self) -> dict[str, Any]:
        return {"max_workflow_tasks": self.max_workflow_tasks, "retention": self.retention}

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
        ``max-workflow-tasks=5000``, ``retention=3d``; ``retention=0`` keeps forever)."""
        changes: dict[str, Any] = {}
        for assignment in assignments:
            name, sep, value = assignment.partition("=")
            field = name.strip().replace("-", "_")
            if not sep or field not in {f.name for f in dataclasses.fields(self)}:
                raise UsageError(
                    f"{assignment!r}: expected NAME=VALUE with NAME one of "
                    "max-workflow-tasks, retention"
                )
            try:
                if field == "max_workflow_tasks":
                    changes[field] = int(value.strip().replace("_", ""))
                else:
                    changes[field] = parse_duration(value.strip())
            except (ValueError, UnitError) as exc:
                raise UsageError(f"{name}: {exc}") from exc
        return dataclasses.replace(self, **changes)


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
