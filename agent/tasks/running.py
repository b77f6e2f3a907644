"""An attempt this node runs, as the parts of the agent that start, watch and stop it see it.

The claim loop (``agent/claims/claimer.py``) makes one for every task it claimed and every
task it starts from a held block; the gang duty makes one for rank 0's process, so that its
metrics are watched as a task's are. :class:`~hypermesh.agent.tasks.attempts.Attempts` runs
it and keeps it in ``running`` until its end is recorded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from hypermesh.agent.tasks.runner import AttemptProcess
from hypermesh.state.keyspace import BlockRef
from hypermesh.state.txns import ClaimPlan


@dataclass
class Running:
    """An attempt this node is running; owned by the agent's event loop. Its claim
    (``plan``, ``claim_revision``, ``block``) never changes; the attempt's own task sets
    ``process`` once the process is made, and anyone on the loop may stop that process."""

    plan: ClaimPlan
    claim_revision: int
    gpus: float
    devices: list[int] = field(default_factory=list)  # GPU indices booked for it
    process: AttemptProcess | None = None
    task: asyncio.Task[None] | None = None
    block: BlockRef | None = None  # the held block it belongs to (agent/tasks/blocks.py)
    params: dict[str, Any] | None = None  # the task's, when the view has none (a block's)
    started_at: float | None = None
