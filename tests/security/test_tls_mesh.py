"""A mesh under mutual TLS: two real agents on loopback, the CLI with its own certificate.

The agents serve only mutual TLS and gossip, share chunks and run a workflow with
each other over it; the CLI (a user's certificate, not an agent's) submits and reads
logs, nodes and top. Every RPC kind refuses plaintext, a client without a certificate
and one from another CA; gossip and chunk reads refuse a user's certificate; a gossip
message over TLS in another node's name is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.gossip.broadcast import Message
from hypermesh.channels import agent_channel
from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.processes import free_port, wait_for
from hypermesh.local.s3server import S3Server
from hypermesh.tls import AGENT_NAME, TlsFiles, channel_options
from tests.conftest import Mesh


def hm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hypermesh", *args], capture_output=True,
                          text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mesh CA with agent certificates for node1 and node2 and a user's for
    alice; a foreign CA with an agent certificate of its own for node1."""
    root = tmp_path_factory.mktemp("pki")
    for args in (
        ("init", str(root / "mesh")),
        ("issue", str(root / "mesh"), "node1", "--agent", "--host", "127.0.0.1"),
        ("issue", str(root / "mesh"), "node2", "--agent", "--host", "127.0.0.1"),
        ("issue", str(root / "mesh"), "alice"),
        ("init", str(root / "other")),
        ("issue", str(root / "other"), "node1", "--agent"),
    ):
        result = hm("tls", *args)
        assert result.returncode == 0, result.stderr
    return root


def files(pki: Path, name: str, ca: str = "mesh") -> TlsFiles:
    return TlsFiles(pki / ca / "ca.pem", pki / ca / f"{name}.pem", pki / ca / f"{name}-key.pem")


def tls_args(tls: TlsFiles) -> tuple[str, ...]:
    return ("--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key))


def test_an_agent_certificate_names_the_node_and_agent_hypermesh(pki: Path) -> None:
    def dns_names(name: str) -> list[str]:
        cert = x509.load_pem_x509_certificate((pki / "mesh" / f"{name}.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return list(san.get_values_for_type(x509.DNSName))

    assert dns_names("node1") == ["node1", AGENT_NAME]  # the first is its gossip name
    assert dns_names("alice") == ["alice"]


@pytest.fixture
def tls_mesh(mesh: Mesh, pki: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Mesh]:
    """Two agents serving mutual TLS; the CLI (``mesh.hm``) runs as alice."""
    for name in ("node1", "node2"):
        mesh.agent(name, slots=2, extra=tls_args(files(pki, name)))
    for key, value in files(pki, "alice").env().items():
        monkeypatch.setenv(key, value)  # the CLI's; the agents' options take precedence
    yield mesh


def test_a_workflow_logs_nodes_and_top_over_mutual_tls(tls_mesh: Mesh) -> None:
    mesh = tls_mesh
    def gossip_sees_both() -> bool:
        rows = mesh.hm_json("nodes")  # the leader's gossip view, asked over TLS
        return len(rows) == 2 and all(row["gossip"] == "alive" for row in rows)

    wait_for(gossip_sees_both, 30, "both agents alive in gossip over TLS")
    recipe = mesh.write_recipe(
        "experiments:\n  hello:\n    samples: 4\n    command: ['echo hello {sample}']\n"
    )
    wid = mesh.submit(recipe)
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    tasks = mesh.hm_json("tasks", wid)
    assert {t["node"] for t in tasks} <= {"node1", "node2"}
    first = sorted(t["id"] for t in tasks)[0]
    logs = mesh.hm("logs", first, check=True)
    assert "hello" in logs.stdout
    top = mesh.hm_json("top")
    assert {row["name"] for row in top} == {"node1", "node2"}
    assert all(row["telemetry"] is not None for row in top)
    # Without the CLI's certificate the agents answer nothing: no telemetry.
    plain = dict(mesh.env)
    for key in files(Path("."), "x").env():
        plain.pop(key, None)
    result = subprocess.run([sys.executable, "-m", "hypermesh", "top", "--json"], env=plain,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert all(row["telemetry"] is None for row in json.loads(result.stdout))


# ------------------------------------------------------------------ refusals
def _calls(stub: agent_pb2_grpc.AgentStub, sender: str = "node9") -> dict[str, Any]:
    gossip = json.dumps(_ping(sender)).encode()
    return {
        "GetNode": lambda: stub.GetNode(agent_pb2.GetNodeRequest(), timeout=5),
        "GetMembers": lambda: stub.GetMembers(agent_pb2.GetMembersRequest(), timeout=5),
        "GetTelemetry": lambda: stub.GetTelemetry(agent_pb2.GetTelemetryRequest(), timeout=5),
        "ChunkSet": lambda: stub.ChunkSet(agent_pb2.ChunkSetRequest(), timeout=5),
        "Gossip": lambda: stub.Gossip(agent_pb2.GossipPacket(payload=gossip), timeout=5),
        "GossipStream": lambda: list(
            stub.GossipStream(iter([agent_pb2.GossipPacket(payload=gossip)]), timeout=5)
        ),
        "LocateChunks": lambda: stub.LocateChunks(agent_pb2.LocateChunksRequest(), timeout=5),
        "ReadChunk": lambda: list(stub.ReadChunk(
            agent_pb2.ReadChunkRequest(chunk="0" * 64, offset=0, length=1), timeout=5
        )),
        "ReadLogs": lambda: list(stub.ReadLogs(
            agent_pb2.ReadLogsRequest(task_id="w.e.0"), timeout=5
        )),
    }


AGENT_ONLY = {"Gossip", "GossipStream", "LocateChunks", "ReadChunk"}


def _ping(sender: str) -> dict[str, Any]:
    return Message("ping", sender, "127.0.0.1:1", seq=1).to_json()


def _code(call: Any) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return None


def _stub(channel: grpc.Channel) -> agent_pb2_grpc.AgentStub:
    return agent_pb2_grpc.AgentStub(channel)


def test_every_rpc_refuses_plaintext_no_certificate_and_a_foreign_ca(
    tls_mesh: Mesh, pki: Path
) -> None:
    address = tls_mesh.agents["node1"].address
    mesh_ca = (pki / "mesh" / "ca.pem").read_bytes()
    _, foreign_cert, foreign_key = files(pki, "node1", "other").read()
    no_cert = grpc.ssl_channel_credentials(root_certificates=mesh_ca)
    foreign = grpc.ssl_channel_credentials(mesh_ca, foreign_key, foreign_cert)
    target = channel_options(AGENT_NAME)
    clients = {
        "plaintext": grpc.insecure_channel(address),
        "no certificate": grpc.secure_channel(address, no_cert, target),
        "foreign CA": grpc.secure_channel(address, foreign, target),
    }
    for what, channel in clients.items():
        with channel:
            for rpc, call in _calls(_stub(channel)).items():
                assert _code(call) == grpc.StatusCode.UNAVAILABLE, (what, rpc)


def test_a_users_certificate_may_not_gossip_or_read_chunks(tls_mesh: Mesh, pki: Path) -> None:
    address = tls_mesh.agents["node1"].address
    with agent_channel(address, files(pki, "alice"), aio=False) as channel:
        for rpc, call in _calls(_stub(channel)).items():
            code = _code(call)
            if rpc in AGENT_ONLY:
                assert code == grpc.StatusCode.PERMISSION_DENIED, rpc
            else:
                assert code != grpc.StatusCode.PERMISSION_DENIED, (rpc, code)
                assert code != grpc.StatusCode.UNAVAILABLE, (rpc, code)


def test_gossip_in_another_nodes_name_is_refused(tls_mesh: Mesh, pki: Path) -> None:
    """node2's certificate speaks for node2 only: a ping it sends as node7 is refused
    (and counted), one in its own name is answered."""
    address = tls_mesh.agents["node1"].address
    with agent_channel(address, files(pki, "node2"), aio=False) as channel:
        stub = _stub(channel)
        forged = stub.Gossip(agent_pb2.GossipPacket(payload=json.dumps(_ping("node7")).encode()),
                             timeout=5)
        own = stub.Gossip(agent_pb2.GossipPacket(payload=json.dumps(_ping("node2")).encode()),
                          timeout=5)
    assert list(forged.replies) == []
    assert [json.loads(r)["k"] for r in own.replies] == ["ack"]


# ------------------------------------------------------------------ safe defaults
def test_plaintext_beyond_loopback_needs_insecure(mesh: Mesh, tmp_path: Path) -> None:
    base = ("agent", "start", "--name", "exposed", "--preset", "local",
            "--work-dir", str(tmp_path / "w"), "--etcd", mesh.etcd.url,
            "--namespace", mesh.namespace)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPERMESH_TLS_")}
    refused = hm(*base, "--listen", "0.0.0.0:0", env=env)
    assert refused.returncode == 2
    assert "--tls-ca" in refused.stderr and "--insecure" in refused.stderr
    dashboard = hm(*base, "--http-listen", "0.0.0.0:0", env=env)
    assert dashboard.returncode == 2 and "--http-listen" in dashboard.stderr
    port = free_port()
    agent = AgentProcess("exposed", mesh.etcd.url, mesh.namespace, tmp_path / "a",
                         extra=["--listen", f"0.0.0.0:{port}", "--insecure",
                                "--advertise", f"127.0.0.1:{port}"], env=env)
    mesh.agents["exposed"] = agent
    agent.start()
    wait_for(lambda: f"--insecure: --listen 0.0.0.0:{port}" in agent.log_tail(), 10,
             "the --insecure warning")


# ------------------------------------------------------------------ a mount through its agent
def test_a_mount_reads_a_chunk_from_a_peer_through_its_agent_over_tls(
    mesh: Mesh, pki: Path, s3_server: S3Server, store_url: str, store: S3Store,
    tmp_path: Path,
) -> None:
    """Mount on a reads from the store; mount on b then gets every block from a's cache:
    mount to agent, agent to agent and the locate call all over mutual TLS."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(3 << 20)
    (src / "a.bin").write_bytes(data)
    (chunk,) = put_dataset(store, src, "toy", chunk_size=4 << 20).chunks
    mounts = {}
    try:
        for name in ("node1", "node2"):
            tls = files(pki, name)
            agent = mesh.agent(name, extra=("--store", store_url, *tls_args(tls)))
            work = agent.work_dir / "chunkfs"
            (work / "mnt" / "toy").mkdir(parents=True)
            mounts[name] = MountProcess(
                "toy", work / "mnt" / "toy", cache_dir=work / "cache" / "toy",
                store_url=store_url, deadline="20s", agent=agent.address,
                env=dict(os.environ, **tls.env()),  # what the agent gives the mounts it starts
            ).start()
        assert (mounts["node1"].mountpoint / "a.bin").read_bytes() == data

        def node2_knows() -> bool:
            with agent_channel(mesh.agents["node2"].address, files(pki, "node1"),
                               aio=False) as channel:
                reply = _stub(channel).LocateChunks(
                    agent_pb2.LocateChunksRequest(chunks=[chunk.id]), timeout=5
                )
            return "node1" in reply.chunks[0].nodes

        wait_for(node2_knows, 20, "node2 to learn over TLS gossip that node1 holds the chunk")
        assert (mounts["node2"].mountpoint / "a.bin").read_bytes() == data
        blocks = mounts["node2"].stats()["reads"]["blocks"]
        assert blocks.get("peer", 0) == 3 and blocks.get("store", 0) == 0, blocks
    finally:
        for mount in mounts.values():
            mount.stop()
