"""An agent's Unix socket for its own mounts: real agents under mutual TLS, real FUSE.

A mount an agent starts reaches it on ``WORK_DIR/run/agent.sock`` in plaintext, which
only the agent's user may open (folder 0700, socket 0600) and which serves
``FetchFromPeers`` and nothing else; a block read from a peer's cache then crosses one
TLS hop, agent to agent.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.server import LOCAL_SOCKET, UNIX_PATH_MAX, local_address, local_socket_path
from hypermesh.channels import agent_channel
from hypermesh.chunkfs.mount import STATS_FILE
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.pki import CLI_USER, LocalPki
from hypermesh.local.processes import wait_for
from hypermesh.tls import TlsFiles
from tests.conftest import Mesh

MiB = 1 << 20


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    return LocalPki(tmp_path_factory.mktemp("pki"))


def tls_args(tls: TlsFiles) -> tuple[str, ...]:
    return ("--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))


def tls_agent(mesh: Mesh, pki: LocalPki, name: str, *extra: str) -> AgentProcess:
    return mesh.agent(name, extra=(*extra, *tls_args(pki.member(name, agent=True))))


def code_of(call: Callable[[], Any]) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return None


def test_the_socket_path_falls_back_to_tcp_when_too_long(tmp_path: Path) -> None:
    assert local_socket_path(tmp_path) == tmp_path / LOCAL_SOCKET
    longest = Path("/" + "d" * (UNIX_PATH_MAX - len(f"/{LOCAL_SOCKET}") - 1))
    assert len(str(longest / LOCAL_SOCKET)) == UNIX_PATH_MAX
    assert local_socket_path(longest) == longest / LOCAL_SOCKET
    assert local_socket_path(Path(f"{longest}d")) is None
    assert local_address(tmp_path) is None  # no agent serves there


def test_an_agent_that_cannot_serve_the_socket_gives_its_mounts_its_tcp_address(
    mesh: Mesh, tmp_path: Path
) -> None:
    work = tmp_path / "node1"
    work.mkdir()
    (work / LOCAL_SOCKET.parent).write_text("not a folder\n")
    agent = mesh.agent("node1")  # it starts all the same
    wait_for(lambda: f"reach this agent at {agent.address}" in agent.log_tail(), 10,
             "the agent to say its mounts reach it over TCP")
    assert local_address(agent.work_dir) is None


def test_a_tls_agents_socket_is_its_users_alone_serves_only_fetch_and_goes_with_it(
    mesh: Mesh, pki: LocalPki
) -> None:
    agent = tls_agent(mesh, pki, "node1")
    sock = agent.work_dir / LOCAL_SOCKET
    info = sock.lstat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    assert stat.S_IMODE(sock.parent.lstat().st_mode) == 0o700
    address = local_address(agent.work_dir)
    assert address == f"unix:{sock}"

    def check_served() -> None:
        with agent_channel(address, None, aio=False) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            # the one node wins the cold race for the chunk: no bytes, read the store
            fetch = agent_pb2.ReadChunkRequest(chunk="ab" * 32, offset=0, length=MiB)
            assert list(stub.FetchFromPeers(fetch, timeout=10)) == []
            bad = agent_pb2.ReadChunkRequest(chunk="x", offset=0, length=MiB)
            assert code_of(lambda: list(stub.FetchFromPeers(bad, timeout=10))) == (
                grpc.StatusCode.INVALID_ARGUMENT  # the main server's handler answers
            )
            ping = json.dumps({"k": "ping", "from": "node9"}).encode()
            refused = {
                "Drain": lambda: stub.Drain(agent_pb2.DrainRequest(), timeout=5),
                "ReadLogs": lambda: list(stub.ReadLogs(
                    agent_pb2.ReadLogsRequest(task_id="w.e.0"), timeout=5)),
                "GetNode": lambda: stub.GetNode(agent_pb2.GetNodeRequest(), timeout=5),
                "Gossip": lambda: stub.Gossip(agent_pb2.GossipPacket(payload=ping), timeout=5),
                "ReadChunk": lambda: list(stub.ReadChunk(
                    agent_pb2.ReadChunkRequest(chunk="ab" * 32, offset=0, length=1), timeout=5)),
                "LocateChunks": lambda: stub.LocateChunks(
                    agent_pb2.LocateChunksRequest(), timeout=5),
                "ChunkSet": lambda: stub.ChunkSet(agent_pb2.ChunkSetRequest(), timeout=5),
            }
            for rpc, call in refused.items():
                assert code_of(call) == grpc.StatusCode.UNIMPLEMENTED, rpc
        assert agent.alive  # Drain was not carried out

    check_served()
    agent.kill()  # a crash leaves the socket file; the next agent here replaces it
    assert sock.exists()
    agent.start()
    check_served()
    agent.terminate()
    assert not sock.exists() and local_address(agent.work_dir) is None


def test_an_agents_mount_reads_a_peers_chunk_through_its_socket(
    mesh: Mesh, pki: LocalPki, store: S3Store, store_url: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tasks read a data set on node1 (from the store), then on node2: node2's mount,
    which its agent started with its socket and no TLS files, gets every block from
    node1's cache, agent to agent over mutual TLS."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(3 * MiB)
    (src / "a.bin").write_bytes(data)
    (chunk,) = put_dataset(store, src, "toy", chunk_size=4 * MiB).chunks
    for name in ("node1", "node2"):
        tls_agent(mesh, pki, name, "--store", store_url, "--pool", name)
    for key, value in pki.member(CLI_USER).env().items():
        monkeypatch.setenv(key, value)  # the CLI's, set after the agents started

    def read_on(pool: str) -> None:
        recipe = mesh.write_recipe(
            f"experiments:\n  read:\n    data: {{toy: toy}}\n    pools: [{pool}]\n"
            "    command: ['sha256sum \"$HM_DATA_TOY/a.bin\"']\n", name=f"{pool}.yaml")
        wid = mesh.submit(recipe)
        assert mesh.wait_state(wid, {"succeeded", "failed"}, 90)["state"] == "succeeded"
        assert hashlib.sha256(data).hexdigest() in mesh.hm("logs", f"{wid}.read.0").stdout

    read_on("node1")

    def locate_on_node2() -> agent_pb2.LocateChunksReply:
        node2 = mesh.agents["node2"].address
        with agent_channel(node2, pki.member("node1", agent=True), aio=False) as channel:
            reply: agent_pb2.LocateChunksReply = agent_pb2_grpc.AgentStub(channel).LocateChunks(
                agent_pb2.LocateChunksRequest(chunks=[chunk.id]), timeout=5)
        return reply

    wait_for(lambda: "node1" in locate_on_node2().chunks[0].nodes, 30,
             "node2 to learn over TLS gossip that node1 holds the chunk")
    read_on("node2")
    node2 = mesh.agents["node2"]
    mountpoint = node2.work_dir / "chunkfs" / "mnt" / "toy"
    reads = json.loads((mountpoint / STATS_FILE).read_text())["reads"]
    # readahead may take a run of blocks in one fetch: the rest are then cache hits
    assert reads["blocks"].get("peer", 0) >= 1 and reads["blocks"].get("store", 0) == 0, reads
    assert reads["bytes"].get("store", 0) == 0, reads
    assert locate_on_node2().counters["peer_bytes"] >= len(data)  # node2's agent fetched them
    (mount,) = [p for p in psutil.process_iter(["cmdline"])
                if str(mountpoint) in (p.info["cmdline"] or [])]
    args = mount.info["cmdline"]
    assert args[args.index("--agent") + 1] == f"unix:{node2.work_dir / LOCAL_SOCKET}"
    assert not any(k.startswith("HYPERMESH_TLS_") for k in mount.environ())
