"""Small observers the tests across hosts run inside a lab host (``python probe.py WHAT``):
they reach what only that host reaches (etcd, agents, the store at their 10.x addresses)
and print one JSON object a line, flushed, for the test to read.

- ``chunks STORE_URL NAME``: ``{"chunks": [ID, ...]}`` of the data set's newest version.
- ``locate ADDRESS CHUNK``: ``{"holders": [NODE, ...], "counters": {...}}`` as the agent
  at ADDRESS answers ``LocateChunks`` (its peer-sharing counters are node-wide).
- ``first-piece ADDRESS``: ``{"ready": COUNTERS}``, then, once the agent's
  ``peer_bytes`` grew (a peer's first piece reached it), ``{"piece": EPOCH}``; polls
  every 10 ms for at most 30 s.
- ``idle-channels ADDRESS TIME TIMEOUT``: two idle channels to the agent at ADDRESS, one
  with the agents' keep-alive options at TIME / TIMEOUT s (``hypermesh/keepalive.py``),
  one with gRPC's defaults; ``{"ready": EPOCH}`` once both are connected, then
  ``{"channel": "keepalive"|"plain", "state": STATE, "t": EPOCH}`` at each change of
  their connectivity, for at most 90 s.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from typing import Any

import grpc


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def chunks(store_url: str, name: str) -> None:
    from hypermesh.chunkfs.datasets import list_versions, load_root
    from hypermesh.chunkfs.store import open_store

    with open_store(store_url) as store:
        root = load_root(store, name, list_versions(store, name)[-1])
        say({"chunks": [c.id for c in root.chunks]})


def _locate(address: str, chunk_ids: list[str]) -> Any:
    from hypermesh._proto import agent_pb2, agent_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return agent_pb2_grpc.AgentStub(channel).LocateChunks(
            agent_pb2.LocateChunksRequest(chunks=chunk_ids), timeout=5)


def locate(address: str, chunk: str) -> None:
    reply = _locate(address, [chunk])
    say({"holders": sorted(reply.chunks[0].nodes), "counters": dict(reply.counters)})


def first_piece(address: str) -> None:
    from hypermesh._proto import agent_pb2, agent_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentStub(channel)
        before = dict(stub.LocateChunks(agent_pb2.LocateChunksRequest(), timeout=5).counters)
        say({"ready": before})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = stub.LocateChunks(agent_pb2.LocateChunksRequest(), timeout=5).counters
            if now["peer_bytes"] > before.get("peer_bytes", 0):
                say({"piece": time.time()})
                return
            time.sleep(0.01)
    sys.exit("no peer piece arrived within 30 s")


def idle_channels(address: str, time_s: str, timeout_s: str) -> None:
    from hypermesh import keepalive
    from hypermesh._proto import agent_pb2, agent_pb2_grpc

    options = keepalive.client_options(float(time_s), float(timeout_s))
    channels = {"keepalive": grpc.insecure_channel(address, options=options),
                "plain": grpc.insecure_channel(address)}
    for channel in channels.values():  # one call each: connected, then idle
        agent_pb2_grpc.AgentStub(channel).LocateChunks(agent_pb2.LocateChunksRequest(),
                                                       timeout=10)
    say({"ready": time.time()})
    lock = threading.Lock()  # gRPC calls back from threads of its own: a line at a time

    def report(name: str, state: grpc.ChannelConnectivity) -> None:
        with lock:
            say({"channel": name, "state": state.name, "t": time.time()})

    for name, channel in channels.items():
        channel.subscribe(functools.partial(report, name))
    time.sleep(90)


def main(argv: list[str]) -> None:
    what, *args = argv
    if what == "chunks":
        chunks(*args)
    elif what == "locate":
        locate(*args)
    elif what == "first-piece":
        first_piece(*args)
    elif what == "idle-channels":
        idle_channels(*args)
    else:
        sys.exit(f"unknown probe {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
