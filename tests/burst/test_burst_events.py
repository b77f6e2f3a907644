"""The burst event log in a real etcd: bounded by the leader, shown by ``hypermesh events``."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from hypermesh.agent.burst.duty import BurstDuty
from hypermesh.agent.burst.policy import BurstConfig
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.records import dumps
from hypermesh.state.view import MeshView
from tests.conftest import Mesh


async def stand_in_leader(mesh: Mesh, etcd: Etcd) -> SimpleNamespace:
    """What BurstDuty uses of its agent, around a real etcd client, standing with a real
    candidacy key on a lease of its own (``lease``), as a leader does."""
    ks = Keyspace(mesh.namespace)
    lease = await etcd.grant(30)
    stood = await etcd.txn([], [etcd.op_put(ks.candidate(lease), dumps({"node": "lead"}), lease)])
    held = (ks.candidate(lease), stood.revision)
    decisions: list[str] = []
    return SimpleNamespace(ks=ks, etcd=etcd, cfg=SimpleNamespace(name="lead", store=None, tls=None),
                           view=MeshView(ks), work_dir=Path(mesh.root),
                           decide=decisions.append, decisions=decisions, lease=lease,
                           candidacy=lambda: held, is_leader=True, lease_is_lost=False,
                           state="alive")


def test_event_log_keeps_the_last_n_across_leaders(mesh: Mesh) -> None:
    async def scenario() -> list[dict[str, object]]:
        async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
            ks = Keyspace(mesh.namespace)
            for i in range(12):  # a previous leader's events
                await etcd.put(ks.event(1000 + i, "old"), dumps({"action": "launch", "n": i}))
            duty = BurstDuty(await stand_in_leader(mesh, etcd),  # type: ignore[arg-type]
                             BurstConfig.local(events_kept=10))
            await duty._take_over()
            await duty._event("release", "cloud", node="cloud-1", reason="idle for 3s")
            kvs, _ = await etcd.get_prefix(ks.kind_prefix("event"))
            return [json.loads(kv.value) for kv in kvs]

    kept = asyncio.run(scenario())
    assert len(kept) == 10
    assert [e.get("n") for e in kept[:-1]] == list(range(3, 12))  # the oldest three went
    assert kept[-1]["action"] == "release" and kept[-1]["leader"] == "lead"
    assert kept[-1]["reason"] == "idle for 3s" and kept[-1]["node"] == "cloud-1"


def test_events_cli_lists_and_follows(mesh: Mesh) -> None:
    ks = Keyspace(mesh.namespace)

    def put(at_ns: int, event: dict[str, object]) -> None:
        async def go() -> None:
            async with Etcd(parse_endpoints(mesh.etcd.url)) as etcd:
                await etcd.put(ks.event(at_ns, "lead"), dumps(event))
        asyncio.run(go())

    first = {"at": 1.0, "leader": "lead", "action": "launch", "pool": "cloud", "node": None,
             "count": 2, "spot": True, "reason": "backlog: 5 pending"}
    put(1, first)
    listed = mesh.hm("events", "--json", check=True).stdout.splitlines()
    assert [json.loads(line) for line in listed] == [first]
    assert "launch" in mesh.hm("events", check=True).stdout

    follow = subprocess.Popen(
        [sys.executable, "-m", "hypermesh", "events", "--json", "--follow"],
        env=mesh.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    out = follow.stdout
    assert out is not None

    def read() -> None:
        for line in out:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        assert json.loads(lines.get(timeout=30)) == first
        second = first | {"action": "release", "node": "cloud-1", "count": None}
        put(2, second)
        assert json.loads(lines.get(timeout=30)) == second
    finally:
        follow.terminate()
        follow.wait(10)


def test_only_a_live_leader_makes_burst_decisions() -> None:
    leader = SimpleNamespace(ks=None, is_leader=True, lease_is_lost=False, state="alive",
                             candidacy=lambda: ("elect/1", 7))
    duty = BurstDuty(leader, BurstConfig.local())  # type: ignore[arg-type]
    assert duty.acting()
    for change in ({"is_leader": False}, {"lease_is_lost": True}, {"state": "draining"},
                   {"candidacy": lambda: None}):
        duty.agent = SimpleNamespace(**(vars(leader) | change))  # type: ignore[assignment]
        assert not duty.acting(), change
