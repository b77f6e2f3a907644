#!/usr/bin/env python3
"""Reading a chunk from a peer's cache against reading it from the object store.

    .venv/bin/python scripts/bench_peer_share.py [--size-mib 256] [--runs 3] [--json]

Two agents on loopback (one etcd, one SeaweedFS), each with a mount started as an
agent starts it (``--agent`` with the agent's Unix socket, cache in the agent's work
directory). Per run, with
fresh mounts and empty caches on both nodes:

- ``store``: node a reads a ``--size-mib`` file cold (1 MiB reads): every block from
  the store;
- ``peer``: once b knows that a holds every chunk, b reads the same file cold: every
  block from a's cache, through the two agents (``FetchFromPeers`` on b's socket →
  ``ReadChunk``, the one TLS hop with ``--tls``);
- ``together``: both nodes read a second file cold at the same moment (deduplicated
  cold reads), and its wall time;
- ``mesh_store_bytes_per_data_byte``: bytes both nodes fetched from the store in the
  whole run per byte of the two files (1.0: every byte once in the mesh; without
  sharing each node fetches both files: 2.0). Readahead crosses file boundaries, so
  this is counted over the whole run rather than per phase.

Prints medians (MB/s, store GETs and bytes) as JSON. The kernel page cache is dropped
before each cold read where this process may (root); otherwise it says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.server import local_address
from hypermesh.channels import agent_channel
from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.agents import AgentProcess
from hypermesh.local.etcd import EtcdServer
from hypermesh.local.pki import LocalPki
from hypermesh.local.processes import unmount_under, wait_for
from hypermesh.local.s3server import S3Server
from hypermesh.tls import TlsFiles

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chunkfs import drop_caches, read_file

MiB = 1 << 20
CHUNK = 64 * MiB
BUCKET = "bench"


def read_all(path: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = read_file(path)
    return n, time.perf_counter() - t0


AGENT_TLS: dict[str, TlsFiles] = {}
"""With ``--tls``: each agent's own files (it lends them to the mounts it starts only
where it has no Unix socket for them)."""


def holders(agent: AgentProcess, chunks: list[str]) -> list[set[str]]:
    # LocateChunks is for agents and their mounts: ask as the agent's mount would.
    with agent_channel(agent.address, AGENT_TLS.get(agent.name), aio=False) as channel:
        reply = agent_pb2_grpc.AgentStub(channel).LocateChunks(
            agent_pb2.LocateChunksRequest(chunks=chunks), timeout=5
        )
    return [set(c.nodes) for c in reply.chunks]


def mount(agent: AgentProcess, store_url: str, name: str) -> MountProcess:
    work = agent.work_dir / "chunkfs"
    mnt = work / "mnt" / name
    mnt.mkdir(parents=True, exist_ok=True)
    socket = local_address(agent.work_dir)  # as the agent's own mounts reach it
    tls = AGENT_TLS.get(agent.name) if socket is None else None
    return MountProcess(
        name, mnt, cache_dir=work / "cache" / name, store_url=store_url,
        cache_size="4GiB", agent=socket or agent.address,
        env=None if tls is None else dict(os.environ, **tls.env()),
    ).start()


def put_files(store_url: str, endpoint: str, src: Path, name: str, size_mib: int) -> list[str]:
    """A fresh data set ``name`` of two random files; the chunk ids of the first."""
    src.mkdir()
    for file in ("one.bin", "two.bin"):
        with open(src / file, "wb") as f:
            for _ in range(size_mib):
                f.write(os.urandom(MiB))
    store = S3Store(BUCKET, store_url.removeprefix(f"s3://{BUCKET}/"), endpoint=endpoint)
    try:
        ds = put_dataset(store, src, name, chunk_size=CHUNK)
    finally:
        store.close()
        shutil.rmtree(src)
    return [c.id for c in ds.chunks][: -(-size_mib * MiB // CHUNK)]


def one_run(agents: dict[str, AgentProcess], store_url: str, endpoint: str, root: Path,
            size_mib: int, run: int) -> dict[str, Any]:
    """One measurement on a data set of its own (earlier runs' caches hold others)."""
    a, b = agents["a"], agents["b"]
    name = f"bench{run}"
    first = put_files(store_url, endpoint, root / f"src{run}", name, size_mib)
    ma, mb = mount(a, store_url, name), mount(b, store_url, name)
    try:
        out: dict[str, Any] = {"page_cache_dropped": drop_caches()}
        n, t = read_all(ma.mountpoint / "one.bin")
        sa = ma.stats()["reads"]
        out["store_MBps"] = n / t / 1e6
        out["store_gets"] = sa["store_gets"]
        wait_for(lambda: all("a" in h for h in holders(b, first)), 60,
                 "b to learn a's chunks")
        drop_caches()
        n, t = read_all(mb.mountpoint / "one.bin")
        sb = mb.stats()["reads"]
        out["peer_MBps"] = n / t / 1e6
        out["peer_run_store_bytes"] = sb["store_bytes"]
        out["peer_blocks"] = sb["blocks"]["peer"]
        drop_caches()
        start = threading.Barrier(2)
        times: dict[str, float] = {}

        def read(name: str, m: MountProcess) -> None:
            start.wait(30)
            times[name] = read_all(m.mountpoint / "two.bin")[1]

        threads = [threading.Thread(target=read, args=x) for x in (("a", ma), ("b", mb))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        fetched = sum(m.stats()["reads"]["store_bytes"] for m in (ma, mb))
        out["mesh_store_bytes_per_data_byte"] = fetched / (2 * n or 1)
        out["together_wall_s"] = max(times.values())
        return out
    finally:
        ma.stop()
        mb.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="only the JSON summary")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS between the agents (a mesh CA made for the run); "
                             "each mount reaches its agent on the agent's Unix socket")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-share-") as tmp:
        root = Path(tmp)
        etcd = EtcdServer(root / "etcd", fsync=False)
        s3 = S3Server(root / "s3")
        agents: dict[str, AgentProcess] = {}
        try:
            etcd.start()
            s3.start()
            s3.make_bucket(BUCKET)
            os.environ.update(s3.client_env())
            store_url = s3.url(BUCKET, "share")
            pki = LocalPki(root / "tls") if args.tls else None
            for name in ("a", "b"):
                extra = ["--store", store_url]
                if pki is not None:
                    files = AGENT_TLS[name] = pki.member(name, agent=True)
                    extra += ["--tls-ca", str(files.ca), "--tls-cert", str(files.cert),
                              "--tls-key", str(files.key)]
                agents[name] = AgentProcess(name, etcd.url, "bench", root / name,
                                            extra=extra).start()
            runs = [one_run(agents, store_url, s3.endpoint, root, args.size_mib, i)
                    for i in range(args.runs)]
        finally:
            for agent in agents.values():
                agent.terminate(timeout=20)
            unmount_under(root)
            s3.stop()
            etcd.stop()
    summary: dict[str, Any] = {"size_mib": args.size_mib, "runs": args.runs, "tls": args.tls}
    for key in runs[0]:
        values = [r[key] for r in runs]
        summary[key] = (statistics.median(values)
                        if all(isinstance(v, int | float) and not isinstance(v, bool)
                               for v in values) else values)
    json.dump(summary, sys.stdout, indent=None if args.json else 2)
    print()


if __name__ == "__main__":
    main()
