"""Provisioners: where the leader gets more nodes, behind one interface.

A provisioner starts a node that runs ``hypermesh agent start --pool P [--spot]``
under a name the leader chose, stops nodes it started, and never touches a node
it did not start. The leader remembers each node it asked for in etcd
(``inst/<node>``, with the provider's id), so any later leader can release it.

- ``local`` (``agent/burst/local.py``): agent processes on this machine, each
  in its own work directory; what the tests and the local mesh burst with.
- ``ec2`` (``agent/burst/ec2.py``): EC2 instances from a launch template or an
  AMI, spot through the instance market options, tagged as ours.

``agent/burst/kinds.py`` picks the one a pool's ``kind`` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hypermesh.errors import FatalError, TransientError
from hypermesh.state.pools import Pool
from hypermesh.tls import TlsFiles


class CapacityRefused(TransientError):
    """The provider has no capacity of the kind asked for (spot or on-demand) now."""

    def __init__(self, message: str, spot: bool) -> None:
        super().__init__(message)
        self.spot = spot


class ProvisionError(FatalError):
    """The provider rejected the request for a reason capacity does not explain."""


@dataclass(frozen=True)
class Context:
    """What every node a provisioner starts needs to join this mesh."""

    etcd: str
    """etcd endpoints as the new node reaches them (``http://HOST:PORT,...``)."""

    namespace: str
    work_root: Path
    """Where the ``local`` provisioner puts its nodes' work directories."""

    store: str | None = None

    etcd_env: tuple[tuple[str, str], ...] = ()
    """The ``HYPERMESH_ETCD_*`` variables (CA, client certificate, user and password)
    that let a node started on this machine reach etcd as this agent does."""

    tls: TlsFiles | None = None
    """The leader's own gRPC TLS files when the mesh runs mutual TLS (None: plaintext).
    A new node needs a certificate for its own name from the same CA: the ``local``
    provisioner issues one from the pool's ``ca_dir`` option."""


@dataclass(frozen=True)
class NodeSpec:
    """One node to start: the name it registers with, its pool, and the market."""

    name: str
    pool: Pool
    spot: bool

    def agent_args(self) -> list[str]:
        """The ``agent start`` options, besides ``--name`` and ``--slots``, that make
        the node what the pool declares."""
        args = ["--pool", self.pool.name]
        if self.spot:
            args.append("--spot")
        if self.pool.gpus:
            args += ["--gpus", str(self.pool.gpus)]
        if self.pool.gpu_type:
            args += ["--gpu-type", self.pool.gpu_type]
        return args


class Provisioner(Protocol):
    """Starts and stops the nodes of one pool. Methods block (callers use a thread)."""

    def launch(self, spec: NodeSpec) -> str:
        """Start a node; return the provider's id of it. Raises ``CapacityRefused``
        when there is no capacity of that market, ``ProvisionError`` otherwise."""
        ...

    def terminate(self, name: str, provider_id: str) -> bool:
        """Stop a node this provisioner started; False (and nothing done) when the
        id does not name a node of ours. A node already gone counts as stopped. An
        empty ``provider_id`` (the leader died before the provider answered) means:
        find this mesh's node ``name``."""
        ...

    def gone(self, name: str, provider_id: str) -> bool:
        """Whether the provider says the node no longer runs."""
        ...


@dataclass(frozen=True)
class Started:
    provider_id: str
    spot: bool
    refused: str | None
    """Why spot was refused when the node fell back to on-demand; None otherwise."""


def launch_with_fallback(provisioner: Provisioner, spec: NodeSpec) -> Started:
    """Start ``spec``; when spot capacity is refused, start it on-demand instead.

    Raises ``CapacityRefused`` (on-demand refused too) or ``ProvisionError``."""
    try:
        return Started(provisioner.launch(spec), spec.spot, None)
    except CapacityRefused as exc:
        if not exc.spot:
            raise
        on_demand = NodeSpec(spec.name, spec.pool, spot=False)
        return Started(provisioner.launch(on_demand), False, str(exc))

