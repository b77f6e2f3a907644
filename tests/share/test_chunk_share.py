"""Peers share chunk caches: real agents, real SeaweedFS, real FUSE mounts.

Each node's mount is started as an agent starts it (``--agent``, its cache under the
agent's work directory, so the agent advertises and serves it) and reaches the store
through its own counting proxy: a GET of a chunk is seen, and attributed to a node.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.share.duty import SERVE_PAUSE_ENV, SERVE_PIECE_ENV
from hypermesh.chunkfs.agent_fetch import AgentPeerFetch
from hypermesh.chunkfs.format import ChunkInfo, chunk_key
from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.processes import wait_for
from hypermesh.local.s3proxy import CountingS3Proxy
from hypermesh.local.s3server import S3Server
from tests.conftest import TEST_BUCKET, Mesh

MiB = 1 << 20
FILES = ("a.bin", "b.bin", "c.bin")  # 3 MiB each, one 4 MiB chunk each


@dataclass
class Node:
    agent: AgentProcess
    proxy: CountingS3Proxy
    mount: MountProcess

    def read(self, name: str) -> bytes:
        return (self.mount.mountpoint / name).read_bytes()

    def gets(self, chunk: ChunkInfo) -> int:
        return self.proxy.count("/" + chunk_key(chunk.id))

    def blocks(self, source: str) -> int:
        return int(self.mount.stats()["reads"]["blocks"].get(source, 0))


@dataclass
class Pair:
    a: Node
    b: Node
    chunks: tuple[ChunkInfo, ...]
    data: dict[str, bytes]
    mesh: Mesh


def locate(node: Node, chunk: ChunkInfo) -> agent_pb2.LocateChunksReply:
    with grpc.insecure_channel(node.agent.address) as channel:
        reply: agent_pb2.LocateChunksReply = agent_pb2_grpc.AgentStub(channel).LocateChunks(
            agent_pb2.LocateChunksRequest(chunks=[chunk.id]), timeout=5
        )
    return reply


def holders(node: Node, chunk: ChunkInfo) -> set[str]:
    return set(locate(node, chunk).chunks[0].nodes)


def reads(mesh: Mesh) -> dict[str, dict[str, int]]:
    """Blocks each node's mounts read, by source, as gossip tells ``nodes --json``."""
    zero = {"cache": 0, "peer": 0, "store": 0}
    return {r["name"]: (r["load"] or {}).get("reads") or zero for r in mesh.hm_json("nodes")}


@pytest.fixture(scope="module")
def agents(
    etcd_server: EtcdServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, str]]:
    """Two agents for the whole module (each test mounts its own data set)."""
    mesh = Mesh(etcd_server, tmp_path_factory.mktemp("share"))
    store_url = s3_server.url(TEST_BUCKET, f"t{uuid.uuid4().hex[:10]}")
    try:
        for name in ("a", "b"):
            mesh.agent(name, extra=("--store", store_url))
        yield mesh, store_url
    finally:
        mesh.close()


@pytest.fixture
def pair(agents: tuple[Mesh, str], s3_server: S3Server, tmp_path: Path) -> Iterator[Pair]:
    mesh, store_url = agents
    name = f"shared-{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src"
    src.mkdir()
    data = {f: os.urandom(3 * MiB) for f in FILES}
    for f, content in data.items():
        (src / f).write_bytes(content)
    store = S3Store(TEST_BUCKET, store_url.removeprefix(f"s3://{TEST_BUCKET}/"),
                    endpoint=s3_server.endpoint)
    try:
        root = put_dataset(store, src, name, chunk_size=4 * MiB)
    finally:
        store.close()
    assert len(root.chunks) == len(FILES)
    nodes: list[Node] = []
    with CountingS3Proxy(s3_server.endpoint) as pa, CountingS3Proxy(s3_server.endpoint) as pb:
        try:
            for agent, proxy in ((mesh.agents["a"], pa), (mesh.agents["b"], pb)):
                if not agent.alive:  # an earlier test killed it
                    agent.start()
                work = agent.work_dir / "chunkfs"
                (work / "mnt" / name).mkdir(parents=True)
                mount = MountProcess(
                    name,
                    work / "mnt" / name,
                    cache_dir=work / "cache" / name,
                    store_url=store_url,
                    deadline="20s",
                    agent=agent.address,
                    env=dict(os.environ, HYPERMESH_S3_ENDPOINT=proxy.endpoint),
                )
                nodes.append(Node(agent, proxy, mount.start()))
            yield Pair(nodes[0], nodes[1], root.chunks, data, mesh)
        finally:
            for node in nodes:
                node.mount.stop()


def test_a_chunk_cached_on_one_node_is_read_on_another_without_a_store_get(
    pair: Pair,
) -> None:
    a, b, first = pair.a, pair.b, pair.chunks[0]
    before = reads(pair.mesh)
    assert a.read("a.bin") == pair.data["a.bin"]
    assert a.gets(first) >= 1
    wait_for(lambda: "a" in holders(b, first), 20, "b to learn that a holds the chunk")
    with grpc.insecure_channel(a.agent.address) as channel:  # what a peer would fetch whole
        whole = agent_pb2_grpc.AgentStub(channel).ChunkSet(agent_pb2.ChunkSetRequest(), timeout=5)
    assert whole.node == "a" and first.id in whole.chunks and whole.version >= 1
    assert b.read("a.bin") == pair.data["a.bin"]
    assert b.gets(first) == 0
    assert b.blocks("peer") == 3 and b.blocks("store") == 0
    # b advertises it too now; a peer's cache counts like any other
    wait_for(lambda: holders(a, first) == {"a", "b"}, 20, "a to learn that b holds it")
    # each node publishes its counts when it next scans its caches: wait for both
    wait_for(lambda: reads(pair.mesh)["b"]["peer"] > before["b"]["peer"], 20,
             "b's reads from a peer in gossip")
    wait_for(lambda: reads(pair.mesh)["a"]["store"] > before["a"]["store"], 20,
             "a's reads from the store in gossip")

    # blocks read by source reach `hypermesh nodes` (counts in the gossiped meta,
    # shares in hit_rates): this read of b's came from a peer, not from the store
    now = reads(pair.mesh)
    assert now["a"]["peer"] == before["a"]["peer"]
    assert now["b"]["store"] == before["b"]["store"]
    rows = {r["name"]: r for r in pair.mesh.hm_json("nodes")}
    assert all(rows[n]["hit_rates"] for n in "ab") and rows["b"]["hit_rates"]["peer"] > 0
    assert "HITS C/P/S %" in pair.mesh.hm("nodes", check=True).stdout


def test_a_node_learns_which_of_its_chunks_another_node_holds_and_ranks_them(
    pair: Pair,
) -> None:
    """a fetched the chunk from the store, b copied it from a: through gossip and the
    agents' records, b's mount ranks its copy spare (a keeps it: sole there)."""
    a, b, first = pair.a, pair.b, pair.chunks[0]

    def ranks(node: Node) -> dict[str, int]:
        return {k: v for k, v in node.mount.stats()["cache"]["ranks"].items() if v}

    assert a.read("a.bin") == pair.data["a.bin"]
    assert ranks(a) == {"sole": 1}
    wait_for(lambda: "a" in holders(b, first), 20, "b to learn that a holds the chunk")
    assert b.read("a.bin") == pair.data["a.bin"] and b.blocks("peer") == 3
    assert ranks(b) in ({"unsure": 1}, {"spare": 1})
    wait_for(lambda: ranks(b) == {"spare": 1}, 20, "b's copy to rank spare")
    assert first.id in (b.mount.cache_dir / "elsewhere").read_text().split()
    wait_for(lambda: first.id in (a.mount.cache_dir / "elsewhere").read_text().split(), 20,
             "a to learn that b holds it too")
    assert ranks(a) == {"sole": 1}  # the node that fetched it keeps it


def test_a_peer_serving_corrupt_bytes_is_bypassed(pair: Pair) -> None:
    a, b, first = pair.a, pair.b, pair.chunks[0]
    assert a.read("a.bin") == pair.data["a.bin"]
    wait_for(lambda: "a" in holders(b, first), 20, "b to learn that a holds the chunk")
    (data_file,) = (a.mount.cache_dir / "chunks").rglob(f"{first.id}.data")
    with open(data_file, "r+b") as f:  # a's cache goes bad under it: one byte of block 1
        f.seek(MiB + 5)
        byte = f.read(1)
        f.seek(MiB + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert b.read("a.bin") == pair.data["a.bin"]
    assert b.blocks("peer") == 2 and b.blocks("store") == 1  # block 1 from the store
    assert b.mount.stats()["reads"]["peer_corrupt_blocks"] == 1
    assert b.gets(first) == 1


def test_a_frozen_then_killed_peer_costs_the_reader_only_time(pair: Pair) -> None:
    a, b = pair.a, pair.b
    for name in FILES:
        assert a.read(name) == pair.data[name]
    wait_for(
        lambda: all("a" in holders(b, c) for c in pair.chunks), 20, "b to learn a's chunks"
    )
    assert b.read("a.bin") == pair.data["a.bin"]  # from a
    assert a.agent.proc is not None
    os.kill(a.agent.proc.pid, signal.SIGSTOP)  # a hangs mid-conversation
    try:
        assert b.read("b.bin") == pair.data["b.bin"]  # a's deadline passes: the store
    finally:
        os.kill(a.agent.proc.pid, signal.SIGCONT)
    a.agent.kill()  # and now a is gone (the next test starts it again)
    assert b.read("c.bin") == pair.data["c.bin"]
    assert b.gets(pair.chunks[0]) == 0
    assert b.gets(pair.chunks[1]) >= 1 and b.gets(pair.chunks[2]) >= 1


def _held_by_a_serving_slowly(
    pair: Pair, pause: str, piece: int | None = None
) -> dict[str, int]:
    """Start a again with the test-only pause of ``pause`` seconds after each piece it
    serves (pieces of ``piece`` bytes, if given); a reads a.bin (into its cache, from
    the store) and b learns that a holds it. b's agent's counters then."""
    a, b, first = pair.a, pair.b, pair.chunks[0]
    a.agent.kill()
    env = {SERVE_PAUSE_ENV: pause} | ({SERVE_PIECE_ENV: str(piece)} if piece else {})
    a.agent.env = dict(os.environ, **env)
    try:
        a.agent.start()
    finally:
        a.agent.env = None  # the next test starts it as usual
    assert a.read("a.bin") == pair.data["a.bin"]
    wait_for(lambda: "a" in holders(b, first), 20, "b to learn that a holds the chunk")
    return dict(locate(b, first).counters)


def test_a_peer_killed_half_way_through_a_transfer_costs_the_reader_only_time(
    pair: Pair,
) -> None:
    """a streams to b slowly (a test-only pause after each piece, pieces of a quarter
    block); a is SIGKILLed once it has started to serve, and b's read still returns the
    right bytes."""
    a, b, first = pair.a, pair.b, pair.chunks[0]
    # Quarter-block pieces make every range a transfer of several, whichever blocks the
    # mount asks for together: three ranges of one block each, one of three, or one and
    # one of two (with whole blocks, a kill could land between two one-block ranges and
    # break no transfer: CI saw that once). 2 s a piece leaves room for the kill to land
    # half-way on a loaded machine.
    before = _held_by_a_serving_slowly(pair, "2.0", piece=MiB // 4)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(b.read("a.bin")))
    reader.start()
    try:
        wait_for(lambda: locate(b, first).counters["peer_bytes"] > before["peer_bytes"], 20,
                 "a's first piece to reach b", interval=0.01)
        a.agent.kill()
    finally:
        reader.join(60)
    assert got == [pair.data["a.bin"]]
    # Every transfer broke off before its end (the reader waits 1 s for a next piece, a
    # paused 2 s, then was killed), and b read its blocks from the store instead.
    after = locate(b, first).counters
    assert after["peer_lost"] > before["peer_lost"], (before, after)
    assert b.blocks("store") == 3 and b.blocks("peer") == 0 and b.gets(first) >= 1


def test_a_holder_slow_to_end_its_stream_costs_the_reader_nothing(pair: Pair) -> None:
    """a pauses 2 s after every piece it serves, the last one too (the test-only pause),
    longer than a reader waits for a next piece (1 s). A range of one piece is all in
    before that pause: b takes it without waiting for the stream's end. (Under a loaded
    suite, a holder's late end once cost a reader a block it had, read again from the
    store.)"""
    a, b, first = pair.a, pair.b, pair.chunks[0]
    try:
        before = _held_by_a_serving_slowly(pair, "2.0")
        at = 2 * MiB + 100  # in the file's last block, away from 0: no read-ahead
        with open(b.mount.mountpoint / "a.bin", "rb") as f:
            assert os.pread(f.fileno(), 4096, at) == pair.data["a.bin"][at : at + 4096]
        after = locate(b, first).counters
        assert after["peer_bytes"] - before["peer_bytes"] == MiB, (before, after)
        assert after["peer_lost"] == before["peer_lost"], (before, after)
        assert b.blocks("peer") == 1 and b.blocks("store") == 0 and b.gets(first) == 0
    finally:
        a.agent.kill()  # the next test starts it without the pause


def test_two_nodes_missing_a_chunk_together_fetch_it_from_the_store_once(pair: Pair) -> None:
    a, b, first = pair.a, pair.b, pair.chunks[0]
    start = threading.Barrier(2)
    got: dict[str, bytes] = {}

    def read(node: Node) -> None:
        start.wait(10)
        got[node.agent.name] = node.read("a.bin")

    threads = [threading.Thread(target=read, args=(n,)) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {"a": pair.data["a.bin"], "b": pair.data["a.bin"]}
    # one node fetched the chunk from the store (in as many GETs as it would alone),
    # the other waited for it and read every block from it
    fetched, waited = sorted((a, b), key=lambda n: n.gets(first), reverse=True)
    assert fetched.gets(first) >= 1 and waited.gets(first) == 0
    assert waited.blocks("peer") == 3 and fetched.blocks("peer") == 0
    assert locate(waited, first).counters["cold_from_winner"] >= 1
    assert locate(fetched, first).counters["cold_won"] >= 1


def test_a_mount_whose_agent_does_not_answer_reads_the_store() -> None:
    fetch = AgentPeerFetch("127.0.0.1:1", timeout_s=2.0)  # nothing listens on port 1
    try:
        assert fetch("ab" * 32, 0, MiB) is None
    finally:
        fetch.close()
    with pytest.raises(ValueError, match="timeout_s"):
        AgentPeerFetch("127.0.0.1:1", timeout_s=0)
