"""An agent killed and started again at once at the same address, within its lease TTL
(a crashed process coming back fast), against real agents on loopback (issue 24): its
peers take the new life back alive with its new lease in its gossip meta, and the death
verdict on the old life costs the new life nothing: its lease is never revoked.

Before a member back from the dead got a new gossip connection, its peers declared the
new life dead again at once (3 runs in 4), on the refusals of the old life that their
gRPC channels to the address still answered calls with, and revoked its new lease.
The other harmful order, the verdict on the old life acted on after the new life
registered, loopback does not produce: a killed agent's peers see its port refuse
within milliseconds, long before a new process registers; ``test_gossip_new_life.py``
drives that order directly."""

from __future__ import annotations

import json
import re
import time

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import free_port, wait_for
from tests.conftest import Mesh

QUIET_S = 3.0  # three lan protocol periods, the local preset's whole lease TTL


def lease_of(agent: AgentProcess, life: int) -> int:
    """The lease ``agent``'s ``life``-th start (1, 2...) registered with, once logged."""

    def started() -> list[str]:
        found = re.findall(r"started at \S+ with lease ([0-9a-f]+)", agent.log_tail(100_000))
        return found if len(found) >= life else []

    leases = wait_for(started, 10, f"{agent.name}'s start number {life}")
    return int(leases[life - 1], 16)  # type: ignore[index]


def test_a_restart_at_the_same_address_keeps_its_new_lease(mesh: Mesh) -> None:
    node1 = mesh.agent("node1")
    wait_for(lambda: any(n["leader"] for n in mesh.hm_json("nodes")), 30, "a leader")
    node3 = mesh.agent("node3")
    node2 = mesh.agent("node2", extra=("--listen", f"127.0.0.1:{free_port()}"))
    peers = (node1, node3)
    old = lease_of(node2, 1)

    def meta_lease(agent_name: str) -> str | None:
        """The lease in node2's gossip meta as ``agent_name`` holds it (while alive)."""
        with grpc.insecure_channel(mesh.agents[agent_name].address) as channel:
            reply = agent_pb2_grpc.AgentStub(channel).GetMembers(
                agent_pb2.GetMembersRequest(), timeout=10
            )
        row = next((m for m in reply.members if m.name == "node2"), None)
        if row is None or row.state != "alive":
            return None
        return str(json.loads(row.meta_json).get("lease"))

    def everyone_has(lease: int) -> bool:
        return all(meta_lease(p.name) == f"{lease:x}" for p in peers)

    wait_for(lambda: everyone_has(old), 30, "node2's lease in its peers' gossip")

    node2.crash()
    # On loopback the verdict on the old life comes within milliseconds (its port
    # refuses); on a loaded machine a new process once came up and refuted the peers'
    # suspicion first, leaving no verdict to test. The new life starts once there is one.
    wait_for(
        lambda: any(re.search(r"gossip: node2 \w+ -> dead", p.log_tail(100_000)) for p in peers),
        15,
        "a peer to declare node2's old life dead",
    )
    node2.start()  # the same name, work directory and --listen: the same address
    new = lease_of(node2, 2)
    assert new != old
    # The new life is alive again to its peers, its new lease in its meta.
    wait_for(lambda: everyone_has(new), 30, "node2's new lease in its peers' gossip")
    # A peer acted on the verdict on the old life (its port refused at once): it revoked
    # the old lease, or, had the verdict come after the new life registered, spared
    # the new one.
    acted = (f"revoking its lease {old:x}", "node2 died holding lease")
    wait_for(
        lambda: any(a in p.log_tail(100_000) for p in peers for a in acted),
        15,
        "a peer to act on node2's old life's death",
    )
    time.sleep(QUIET_S)  # room for a late verdict, and for a revoke to reach node2
    for peer in peers:
        assert f"revoking its lease {new:x}" not in peer.log_tail(100_000), peer.name
    since_restart = node2.log_tail(100_000).rpartition("node2: started at")[2]
    assert "lost lease" not in since_restart, since_restart
    rows = {r["name"]: r for r in mesh.hm_json("nodes")}
    assert rows["node2"]["gossip"] == "alive" and rows["node2"]["load"]["lease"] == f"{new:x}"
