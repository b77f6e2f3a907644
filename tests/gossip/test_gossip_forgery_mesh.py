"""Forged gossip against real agents on loopback (issue 21): a forged death of a busy
member and a flood of made-up members, sent over gRPC as a peer would, neither get
the member's lease revoked nor break ``GetMembers`` and the dashboard; nor do the
made-up members, which never answer, make the agents too unhealthy to act on deaths."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.gossip.broadcast import DEAD, Message, Update
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import wait_for
from tests.conftest import Mesh, process_gone, task_pid

QUIET_S = 3.0  # a window of three lan protocol periods; the lease used to go in 0.2 s
HOLES = 8  # black holes the ghosts' addresses point at (one gossip link per address)


class _Silent(agent_pb2_grpc.AgentServicer):
    """Reads every gossip message sent on a stream and answers none."""

    def GossipStream(
        self, request_iterator: Iterator[agent_pb2.GossipPacket], context: grpc.ServicerContext
    ) -> Iterator[agent_pb2.GossipAck]:
        for _ in request_iterator:
            pass
        yield from ()


@pytest.fixture
def black_holes() -> Iterator[list[str]]:
    """The addresses of ``HOLES`` black holes on 127.0.0.1, open for the test: gRPC
    servers that take every gossip message and never answer, so that a ghost's
    silence looks like that of a member that stopped answering, not like a failed
    send (which, to an indirect prober, counts as its answer)."""
    servers: list[grpc.Server] = []
    addresses: list[str] = []
    try:
        for _ in range(HOLES):
            server = grpc.server(ThreadPoolExecutor(max_workers=16))
            agent_pb2_grpc.add_AgentServicer_to_server(_Silent(), server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            servers.append(server)
        yield addresses
    finally:
        for server in servers:
            server.stop(grace=None).wait(5)


def stub(agent: AgentProcess) -> agent_pb2_grpc.AgentStub:
    return agent_pb2_grpc.AgentStub(grpc.insecure_channel(agent.address))


def members(agent: AgentProcess) -> dict[str, Any]:
    reply = stub(agent).GetMembers(agent_pb2.GetMembersRequest(), timeout=10)
    return {m.name: m for m in reply.members}


def send(agent: AgentProcess, message: dict[str, Any]) -> None:
    """One packet, encoded as ``agent/gossip/duty.py`` encodes what it sends."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    stub(agent).Gossip(agent_pb2.GossipPacket(payload=payload), timeout=10)


def local_health(agent: AgentProcess) -> int:
    reply = stub(agent).GetMembers(agent_pb2.GetMembersRequest(), timeout=10)
    return int(reply.local_health)


def api_nodes(agent: AgentProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{agent.http_address}/api/nodes", timeout=10) as r:
        assert r.status == 200
        return dict(json.load(r))


def test_forged_deaths_and_ghosts_neither_kill_a_busy_member_nor_break_the_tables(
    mesh: Mesh, black_holes: list[str]
) -> None:
    node1 = mesh.agent("node1")
    wait_for(lambda: any(n["leader"] for n in mesh.hm_json("nodes")), 30, "a leader")
    busy = mesh.agent("node2", extra=("--gpus", "1"))
    node3 = mesh.agent("node3")
    others = [node1, node3]
    wait_for(
        lambda: all(
            m.get("node2") is not None and m["node2"].state == "alive"
            for m in (members(a) for a in others)
        ),
        30,
        "node2 alive in everyone's gossip",
    )
    wid = mesh.submit(
        mesh.write_recipe(
            "experiments:\n  long:\n    hardware: {gpus: 1}\n"
            "    command: ['echo $$ > \"$HM_ATTEMPT_DIR/pid\"; exec sleep 120']\n"
        )
    )
    pid = task_pid(busy, f"{wid}.long.0")
    incarnation = members(node1)["node2"].incarnation

    # 1. A death far above node2's incarnation, and 200 ghosts (one at 2**64), in node3's
    # name, at addresses that accept connections and never answer.
    ghosts: list[list[Any]] = [
        Update.alive(f"ghost{i}", black_holes[i % HOLES], 0, 0, {"x": i}).to_wire()
        for i in range(199)
    ]
    ghosts.append(["ghost-big", black_holes[0], 0, 2**64])
    forged = Message("gossip", "node3", node3.address).to_json()
    forged["u"] = [
        Update("node2", busy.address, DEAD, incarnation + 1000, source="node3").to_wire(),
        *ghosts,
    ]
    for agent in others:
        send(agent, forged)
    for agent in others:
        wait_for(lambda a=agent: "refused gossip" in a.log_tail(20000), 10, "the refusal logged")
    time.sleep(QUIET_S)
    for agent in others:
        table = members(agent)  # answers: nothing beyond int64 got in
        assert table["node2"].state == "alive", agent.name
        assert "ghost-big" not in table and sum(n.startswith("ghost") for n in table) == 199
        log = agent.log_tail(50000)
        assert "node2 alive -> dead" not in log and "revoking its lease" not in log
        nodes = api_nodes(agent)  # the dashboard still answers, node2 alive in it
        node2 = next(n for n in nodes["nodes"] if n["name"] == "node2")
        assert node2["gossip"] == "alive"

    # The ghosts never answer, but only members heard directly serve as indirect
    # probers and count against local health: the leader stays healthy enough to act.
    leader = next(a for a in others if a.name == mesh_leader(mesh))
    wait_for(lambda: local_health(leader) == 0, 15, "the leader's local health at 0")

    # 2. A death at node2's own incarnation is believed as news, but the leader
    # probes node2 before acting: node2 answers, refutes, and keeps its lease.
    incarnation = members(leader)["node2"].incarnation  # it may have refuted meanwhile
    forged["u"] = [Update("node2", busy.address, DEAD, incarnation, source="node3").to_wire()]
    send(leader, forged)
    stood_down = "not acting on node2's death: our probe did not confirm it"
    wait_for(
        lambda: stood_down in leader.log_tail(20000),
        45,
        "the leader to probe node2 and stand down",
    )
    wait_for(
        lambda: all(members(a)["node2"].state == "alive" for a in others),
        45,
        "node2 to refute the death everywhere",
    )
    time.sleep(QUIET_S)
    assert "node2" in {n["name"] for n in mesh.hm_json("nodes")}  # still registered
    for agent in (*others, busy):
        assert "revoking its lease" not in agent.log_tail(50000)
    assert not process_gone(pid)  # its task keeps running...
    (task,) = mesh.hm_json("tasks", wid)
    assert [(a["node"], a["state"]) for a in task["attempts"]] == [("node2", "running")]


def mesh_leader(mesh: Mesh) -> str:
    return str(next(n["name"] for n in mesh.hm_json("nodes") if n["leader"]))
