"""gRPC health checking and server reflection on the agent's port.

Standard tools work against any agent: ``grpcurl HOST:PORT list`` (reflection) and
``grpc_health_probe`` or a Kubernetes ``grpc`` probe (the ``grpc.health.v1.Health``
service). Services answered by Check and Watch:

- ``""`` (the server as a whole) and ``hypermesh.v1.Agent``: SERVING while the agent
  is alive and holds its etcd lease; NOT_SERVING while it drains or after its lease
  was lost (until it has rejoined with a new one). Use it for readiness.
- ``liveness``: SERVING as long as the process answers at all (the health service
  runs on the agent's event loop, so an answer proves the loop is not stuck). Use it
  for liveness: a draining agent or one rejoining after an etcd outage must not be
  restarted for it.

:func:`serving` is the pure rule; :class:`Health` carries it out. Only the agent's
event loop calls :meth:`Health.refresh`.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from hypermesh._proto import agent_pb2

log = logging.getLogger(__name__)

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name
LIVENESS_SERVICE = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def serving(state: str, lease_lost: bool) -> bool:
    """Whether the agent should be reported SERVING: alive (not draining) and
    holding its etcd lease."""
    return state == "alive" and not lease_lost


class Health:
    """The health servicer of one agent's gRPC server, with reflection beside it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection(
            (
                AGENT_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.serving: bool | None = None
        self._pending: set[asyncio.Task[None]] = set()

    async def serve_plaintext(self, listen: str) -> grpc.aio.Server:
        """Serve this health service alone, without TLS, at ``listen`` (``--health-listen``):
        for probes that cannot show a certificate (Kubernetes' ``grpc`` probes) when the
        agent's own port is mutual TLS. It tells whether the agent serves, nothing more.
        Returns the started server (the caller stops it)."""
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        if server.add_insecure_port(listen) == 0:
            raise OSError(f"cannot listen on {listen} (--health-listen)")
        await server.start()
        return server

    async def start(self) -> None:
        """Liveness SERVING, the rest NOT_SERVING until the first :meth:`refresh`."""
        await self.servicer.set(LIVENESS_SERVICE, SERVING)
        for service in ("", AGENT_SERVICE):
            await self.servicer.set(service, NOT_SERVING)

    def refresh(self, state: str, lease_lost: bool) -> None:
        """Publish the status the agent's state implies, if it changed; Watch
        streams see the change."""
        now = serving(state, lease_lost)
        if now == self.serving:
            return
        self.serving = now
        log.info("health: %s", "SERVING" if now else "NOT_SERVING")
        task = asyncio.create_task(self._publish())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self) -> None:
        # The newest decision, not the one that scheduled this task: a quick
        # NOT_SERVING -> SERVING flip never ends on a stale status.
        status = SERVING if self.serving else NOT_SERVING
        for service in ("", AGENT_SERVICE):
            await self.servicer.set(service, status)
