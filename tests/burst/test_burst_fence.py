"""The fence on the leader's burst writes (``agent/burst/fence.py``) in a real etcd: a
write under a candidacy that still stands goes through; one under a candidacy whose
lease was revoked (or whose key was put again since) writes nothing, and the duty
stops acting and says so once."""

from __future__ import annotations

import asyncio

import pytest

from hypermesh.agent.burst.duty import BurstDuty
from hypermesh.agent.burst.fence import leader_txn
from hypermesh.agent.burst.policy import BurstConfig
from hypermesh.errors import LeadershipLost
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.state.etcd import Etcd
from hypermesh.state.records import dumps
from tests.burst.test_burst_events import stand_in_leader
from tests.conftest import Mesh


def test_a_write_goes_through_only_while_the_candidacy_stands(mesh: Mesh) -> None:
    async def scenario() -> None:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            leader = await stand_in_leader(mesh, etcd)
            held = leader.candidacy()
            key = leader.ks.instance("cloud-a")
            assert await leader_txn(etcd, held, [], [etcd.op_put(key, b"1")])
            assert await etcd.get(key) is not None
            # the caller's own compare failing is not lost leadership
            assert not await leader_txn(etcd, held, [etcd.absent(key)], [etcd.op_put(key, b"2")])
            assert (await etcd.get(key) or (b"",))[0] == b"1"

            await etcd.revoke(leader.lease)  # lapsed: the key went with the lease
            other = leader.ks.instance("cloud-b")
            with pytest.raises(LeadershipLost, match="no longer stands"):
                await leader_txn(etcd, held, [], [etcd.op_put(other, b"1"),
                                                  etcd.op_delete(key)])
            assert await etcd.get(other) is None and await etcd.get(key) is not None
            # the same key put again (say by a node reusing the lease id) is not ours
            await etcd.put(held[0], dumps({"node": "someone"}))
            with pytest.raises(LeadershipLost):
                await leader_txn(etcd, held, [], [etcd.op_put(other, b"1")])
            with pytest.raises(LeadershipLost, match="holds no candidacy"):
                await leader_txn(etcd, None, [], [etcd.op_put(other, b"1")])
            assert await etcd.get(other) is None

    asyncio.run(scenario())


def test_a_deposed_leader_writes_no_records_and_stops_acting(mesh: Mesh) -> None:
    async def scenario() -> None:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            leader = await stand_in_leader(mesh, etcd)
            duty = BurstDuty(leader, BurstConfig.local())  # type: ignore[arg-type]
            await duty._take_over()
            await duty._put_record("cloud-a", {"pool": "cloud", "state": "starting"})
            assert await etcd.get(leader.ks.instance("cloud-a")) is not None
            assert duty.acting()

            await etcd.revoke(leader.lease)  # deposed while it still thinks it leads
            with pytest.raises(LeadershipLost):
                await duty._drop_record("cloud-a")
            with pytest.raises(LeadershipLost):
                await duty._put_record("cloud-b", {"pool": "cloud", "state": "starting"})
            with pytest.raises(LeadershipLost):
                await duty._event("launch", "cloud", count=1, reason="backlog")
            assert await etcd.get(leader.ks.instance("cloud-a")) is not None
            assert await etcd.get(leader.ks.instance("cloud-b")) is None
            kvs, _ = await etcd.get_prefix(leader.ks.kind_prefix("event"))
            assert kvs == []
            assert not duty.acting() and not duty.leading
            assert [d for d in leader.decisions if "no longer leader" in d] == [
                f"burst: no longer leader, stopped acting (candidacy "
                f"{leader.candidacy()[0].rsplit('/', 1)[1]} (created at revision "
                f"{leader.candidacy()[1]}) no longer stands)"
            ]
            # standing again (a new candidacy) lifts it
            again = await stand_in_leader(mesh, etcd)
            leader.candidacy = again.candidacy
            assert duty.acting()
            await duty._put_record("cloud-b", {"pool": "cloud", "state": "starting"})
            assert await etcd.get(leader.ks.instance("cloud-b")) is not None

    asyncio.run(scenario())
