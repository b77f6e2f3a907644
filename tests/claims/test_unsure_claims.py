"""Claims whose transaction's answer was lost, read back and given back (agent/claims/unsure.py),
against a real etcd."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from hypermesh.agent.claims.unsure import UnsureClaims
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.block_txns import claim_block
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.txns import ClaimPlan, claim_tasks


def test_claims_of_unknown_outcome_are_read_back_and_given_back(
    etcd_server: EtcdServer,
) -> None:
    ks = Keyspace(f"u{uuid.uuid4().hex[:8]}")

    async def scenario() -> None:
        async with Etcd([etcd_server.url.split("//")[1]]) as etcd:
            lease = await etcd.grant(30)
            decided: list[str] = []
            unsure = UnsureClaims(etcd, ks, "node1", lambda: lease, decided.append)
            written, never, in_use, others = (
                ClaimPlan(TaskRef("wf", "e", i), 1, slot=i) for i in range(4)
            )
            now = time.time()
            # Written (the answer was lost), never written, and written but claimed
            # again since: all three are unsure, one is run here.
            assert await claim_tasks(etcd, ks, [written, in_use], "node1", lease, now)
            # Someone else's claim (another node's lease) of a task we tried.
            other_lease = await etcd.grant(30)
            assert await claim_tasks(etcd, ks, [others], "node2", other_lease, now)
            bref = BlockRef("wf", "b", 0)
            batch = ks.block_batch(bref, lease, 1)
            assert await claim_block(etcd, ks, bref, "node1", lease, 0, batch)
            unsure.tasks([written, never, in_use, others], now)
            unsure.block(bref)
            assert unsure

            given = await unsure.settle({in_use.ref}, set())

            assert sorted(given) == sorted([ks.claim(written.ref), ks.block_claim(bref)])
            assert not unsure  # settled: nothing left to read back
            assert await etcd.get(ks.claim(written.ref)) is None
            assert await etcd.get(ks.slot("wf", "e", written.slot)) is None  # type: ignore[arg-type]
            assert await etcd.get(ks.block_claim(bref)) is None
            assert await etcd.get(ks.claim(in_use.ref)) is not None
            assert await etcd.get(ks.claim(others.ref)) is not None
            # The attempt that never ran is closed as lost: it costs the task no retry,
            # and the task is open again (no result).
            value, _ = await etcd.get(ks.attempt(written.ref, 1))  # type: ignore[misc]
            attempt = json.loads(value)
            assert (attempt["state"], attempt["reason"], attempt["node"]) == (
                "failed", "node-lost", "node1"
            )
            assert await etcd.get(ks.result(written.ref)) is None
            assert len(decided) == 2

    asyncio.run(scenario())
