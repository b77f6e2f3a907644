"""Claims whose transaction's answer never came.

``Etcd.txn`` retries while etcd is unreachable and reads back what a retried
transaction writes, so a member that dies after committing a claim does not make
the claim look lost. But when etcd stays away for longer than a transaction waits,
the caller gets ``EtcdUnavailable`` and cannot tell whether the claim was written. A
claim that was is held under this node's lease and run by nobody: its task would
never run while the node lives. So the agent notes each such claim here, and once
etcd answers again reads it back and gives back those that are its own and not in
use: a task claim is closed as a ``node-lost`` attempt (which costs the task no
retry), a block claim is deleted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.records import Attempt
from hypermesh.state.txns import ClaimPlan, finish_attempt


@dataclass(frozen=True)
class _Unsure:
    key: str
    plan: ClaimPlan | None  # a task claim, or None for a block claim (``bref``)
    bref: BlockRef | None
    started_at: float
    slot: int | None = None  # the cap slot a block claim took with it


class UnsureClaims:
    """Claims of this node whose outcome is unknown, until they are read back."""

    def __init__(
        self, etcd: Etcd, ks: Keyspace, node: str, lease: Callable[[], int],
        decide: Callable[[str], None],
    ) -> None:
        self.etcd, self.ks, self.node = etcd, ks, node
        self._lease = lease
        self._decide = decide
        self._pending: dict[str, _Unsure] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def tasks(self, plans: list[ClaimPlan], started_at: float) -> None:
        """``claim_tasks`` for ``plans`` failed without an answer."""
        for plan in plans:
            key = self.ks.claim(plan.ref)
            self._pending[key] = _Unsure(key, plan, None, started_at)

    def block(self, bref: BlockRef, slot: int | None = None) -> None:
        """``claim_block`` for ``bref`` (with cap slot ``slot``) failed without an answer."""
        key = self.ks.block_claim(bref)
        self._pending[key] = _Unsure(key, None, bref, 0.0, slot)

    async def settle(self, running: Container[TaskRef], held: Container[BlockRef]) -> list[str]:
        """Read each claim back; give back those held under this node's lease that are
        neither among ``running`` tasks nor ``held`` blocks (claimed again since,
        successfully, they are in use). Returns the keys given back.
        ``EtcdUnavailable`` leaves the rest for later."""
        given = []
        for key, unsure in list(self._pending.items()):
            got = await self.etcd.get(key)
            in_use = (unsure.plan is not None and unsure.plan.ref in running) or (
                unsure.bref is not None and unsure.bref in held
            )
            if got is not None and not in_use:
                value, revision = got
                claim = json.loads(value)
                mine = claim.get("node") == self.node and claim.get("lease") == self._lease()
                if mine and await self._give_back(unsure, revision):
                    given.append(key)
                    self._decide(f"gave back {key}: the answer to claiming it was lost")
            del self._pending[key]
        return given

    async def _give_back(self, unsure: _Unsure, revision: int) -> bool:
        """Release the claim read back at ``revision``; False when its fence refused (it
        changed since the read: not ours to give back any more)."""
        plan = unsure.plan
        if plan is None:
            key, bref = unsure.key, unsure.bref
            ops = [self.etcd.op_delete(key)]
            if unsure.slot is not None and bref is not None:  # taken with the claim
                ops.append(self.etcd.op_delete(
                    self.ks.block_slot(bref.workflow, bref.experiment, unsure.slot)))
            done = await self.etcd.txn([self.etcd.mod_revision_is(key, revision)], ops)
            return bool(done.succeeded)
        lost = Attempt(plan.attempt, self.node, "failed", reason="node-lost",
                       started_at=unsure.started_at, ended_at=time.time())
        written = await finish_attempt(
            self.etcd, self.ks, plan.ref, revision, plan.slot, lost, None
        )
        return written is not None
