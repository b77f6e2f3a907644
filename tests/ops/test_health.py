"""gRPC health checking and reflection on a real agent, through a real gRPC client."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.agent.ops.health import serving
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from tests.conftest import Mesh

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize(
    ("state", "lease_lost", "expected"),
    [
        ("alive", False, True),
        ("alive", True, False),
        ("draining", False, False),
        ("draining", True, False),
    ],
)
def test_serving_rule(state: str, lease_lost: bool, expected: bool) -> None:
    assert serving(state, lease_lost) is expected


def check(channel: grpc.Channel, service: str) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=5
    )
    return int(reply.status)


class Watcher:
    """A Health.Watch stream read by a thread; statuses arrive on a queue."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.statuses: queue.Queue[int] = queue.Queue()
        self.call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service)
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.statuses.put(int(reply.status))
        except grpc.RpcError:
            pass  # cancelled by the test or the server went away

    def next(self, timeout: float = 20) -> int:
        return self.statuses.get(timeout=timeout)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)


@pytest.fixture
def channel(mesh: Mesh) -> Iterator[grpc.Channel]:
    agent = mesh.agent("node1")
    with grpc.insecure_channel(agent.address) as ch:
        wait_for(lambda: check(ch, "") == SERVING, 10, "the agent to report SERVING")
        yield ch


def test_health_check_per_service(channel: grpc.Channel) -> None:
    assert check(channel, "") == SERVING
    assert check(channel, "hypermesh.v1.Agent") == SERVING
    assert check(channel, "liveness") == SERVING
    with pytest.raises(grpc.RpcError) as err:
        check(channel, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(channel: grpc.Channel) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {
        "hypermesh.v1.Agent",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    pool = DescriptorPool(db)
    agent = pool.FindServiceByName("hypermesh.v1.Agent")
    methods = {m.name for m in agent.methods}
    assert {"GetNode", "ReadLogs", "Drain", "GetTelemetry"} <= methods
    telemetry = pool.FindMessageTypeByName("hypermesh.v1.Telemetry")
    assert "latest" in telemetry.fields_by_name


def test_watch_sees_a_lost_lease_and_the_rejoin(mesh: Mesh, channel: grpc.Channel) -> None:
    watcher = Watcher(channel, "")
    try:
        assert watcher.next() == SERVING

        async def revoke() -> None:
            async with Etcd([mesh.etcd.url.split("//")[1]]) as etcd:
                found = await etcd.get(Keyspace(mesh.namespace).node("node1"))
                assert found is not None
                await etcd.revoke(json.loads(found[0])["lease"])

        asyncio.run(revoke())
        assert watcher.next() == NOT_SERVING  # lease lost: not ready
        assert check(channel, "liveness") == SERVING  # but alive: no restart wanted
        assert watcher.next() == SERVING  # rejoined with a new lease
    finally:
        watcher.close()


def test_watch_sees_a_drain(channel: grpc.Channel) -> None:
    watcher = Watcher(channel, "hypermesh.v1.Agent")
    try:
        assert watcher.next() == SERVING
        agent_pb2_grpc.AgentStub(channel).Drain(agent_pb2.DrainRequest(), timeout=5)
        assert watcher.next() == NOT_SERVING
    finally:
        watcher.close()


def test_watch_of_an_unknown_service_says_so(channel: grpc.Channel) -> None:
    watcher = Watcher(channel, "no.such.Service")
    try:
        assert watcher.next() == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    finally:
        watcher.close()
