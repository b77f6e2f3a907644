"""Configuration of an agent: one frozen dataclass, validated once, with presets.

Every field states its unit and trade-off. ``AgentConfig.lan()`` is the default
for real machines; ``AgentConfig.local()`` has tight timings for tests and the
local mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hypermesh.addresses import check_advertise, check_listen_reachable
from hypermesh.errors import UsageError
from hypermesh.exposure import check_exposure, check_token
from hypermesh.recipe.units import UnitError, parse_duration, parse_size
from hypermesh.state.keyspace import NODE_NAME_RE

if TYPE_CHECKING:
    from hypermesh.etcd_security import EtcdSecurity
    from hypermesh.tls import TlsFiles

ENV_ETCD = "HYPERMESH_ETCD"
ENV_NAMESPACE = "HYPERMESH_NAMESPACE"
DEFAULT_NAMESPACE = "default"
SPOT_NOTICE_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
TASK_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
CONTAINER_RUNTIMES = ("auto", "docker", "podman", "none")
"""The values of ``--container-runtime`` (``AgentConfig.container_runtime``)."""
"""``--task-env``: a variable name, or a prefix ending in ``*``."""
DASHBOARD_HOST_RE = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,252})(?::[0-9]{1,5})?")
"""``--dashboard-host``: a host name (lower case), optionally with ``:PORT``."""

# gRPC options of connections that carry only small messages (gossip, etcd, the
# agent's server, which receives only requests). gRPC's BDP probe answers received
# data with an HTTP/2 PING to size flow-control windows for bulk transfers; on these
# connections it only adds work: with it off an idle agent's gRPC threads used about
# 40 % less CPU (docs/benchmarks.md, idle agents). Bulk transfers (peer chunk
# streams) use channels that keep it.
SMALL_MESSAGE_GRPC_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.http2.bdp_probe", 0),)


@dataclass(frozen=True)
class AgentConfig:
    """How one agent runs. Construct with ``lan(...)`` or ``local(...)``."""

    name: str = field(default_factory=socket.gethostname)
    """Node name, unique in the mesh; its registration key and log lines use it."""

    listen: str = "127.0.0.1:7070"
    """HOST:PORT the gRPC server binds; port 0 picks a free port. Peers and the CLI
    reach the node at the address it registers: ``advertise``, else the bound one.
    A wildcard host (``0.0.0.0``, ``[::]``) needs ``advertise``."""

    advertise: str | None = None
    """HOST:PORT peers and the CLI reach this agent at, when not ``listen`` (behind NAT,
    in a container, listening on every interface; ``--advertise``, env
    ``HYPERMESH_ADVERTISE``). HOST is an IP address or a DNS name each peer resolves
    when it connects; it is what the node record in etcd and gossip carry, and its
    host is that of the dashboard and metrics addresses registered when those listen
    on every interface (``hypermesh/addresses.py``). None: the bound ``listen``."""

    work_dir: Path = Path("hypermesh-work")
    """Where attempt logs and per-attempt scratch directories live."""

    slots: int = 1
    """Tasks run at once on this node (1-4096)."""

    pool: str = "default"
    spot: bool = False
    gpus: int | None = None
    """GPU count; None = ask NVML (0 when NVML is absent)."""

    gpu_type: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    lease_ttl: int = 10
    """Seconds of silence after which etcd drops this node and its claims (2-3600).
    Lower: a dead node's tasks run again sooner. Higher: an etcd hiccup or a long
    GC pause is less likely to cost the node its claims. Recovery never waits
    longer than one TTL after a death."""

    kill_grace: float = 10.0
    """Seconds a task has between SIGTERM and SIGKILL when cancelled, timed out or
    drained (0-3600)."""

    leader_ttl: int = 5
    """Seconds after which a silent leader's candidacy expires and the next agent
    leads (2-60; etcd's smallest lease is about 2 s). Leadership sits on its own
    short lease, apart from the node lease. Usually gossip replaces a dead leader
    sooner: its node lease is revoked on the verdict, and a candidate whose node
    is not registered does not lead; this TTL is the bound when gossip cannot
    decide. Lower: that bound shrinks, and every agent renews more often (an idle
    cost). Every leader action is a guarded, idempotent transaction, so two agents
    that briefly both believe they lead cannot break an invariant."""

    spot_notice_url: str = SPOT_NOTICE_URL
    """Where a ``--spot`` agent polls for the cloud's interruption notice (EC2's
    instance metadata by default; tests point it at a local server)."""

    spot_poll: float = 2.0
    """Seconds between polls of the interruption notice (0.1-60). EC2 gives two
    minutes' notice, so a few seconds of polling delay costs little."""

    preset: str = "lan"
    """Which timing preset built this config (``lan`` or ``local``); components
    with configs of their own (gossip) pick the matching preset."""

    store: str | None = None
    """Object store of the data sets tasks read (``s3://BUCKET/PREFIX`` or
    ``file:///PATH``; ``--store``, env ``HYPERMESH_STORE``). Without one, a task whose
    experiment names ``data`` fails with reason ``data``."""

    cache_size: str = "20GiB"
    """Most bytes each data set mount's local chunk cache holds (``--cache-size``)."""

    data_deadline: str = "30s"
    """How long a read from a mounted data set retries an unavailable store before
    it fails with EIO."""

    image_budget: str = "20GiB"
    """Most bytes the container images this agent pulled may take (``--image-budget``);
    past it the least recently used ones that no running task uses and no open
    experiment wants are removed (``agent/tasks/images.py``). Images it did not pull
    are never removed."""

    image_pull_deadline: str | None = None
    """How long one image pull may take, retries of a registry that is down included
    (``--image-pull-deadline``); None: the preset's (lan 5 minutes, local 20 s)."""

    log_upload_s: float = 10.0
    """Seconds between copies of a running attempt's log to the object store (``store``;
    0.5-3600). Each copy re-uploads the whole log (object stores do not append), only
    if it grew, and only while attempts run; the final copy is made when the attempt
    ends. Lower: less of a log is lost with a dead node. Higher: fewer PUTs."""

    http_listen: str | None = "127.0.0.1:7071"
    """HOST:PORT of the web dashboard (``--http-listen``; port 0 picks a free one,
    None turns it off). Loopback by default; beyond loopback it needs a
    ``dashboard_token`` and ``tls`` (HTTPS), or ``insecure`` (``hypermesh/exposure.py``)."""

    dashboard_token: str | None = field(default=None, repr=False)
    """The dashboard's login token (``--dashboard-token-file``, env
    ``HYPERMESH_DASHBOARD_TOKEN``; at least 16 characters). Given: every dashboard page
    and ``/api`` request needs a session cookie from ``/login`` or ``Authorization:
    Bearer TOKEN`` (``agent/ops/dashboard_auth.py``), on loopback too. None: no login,
    allowed only on loopback unless ``insecure``."""

    dashboard_hosts: tuple[str, ...] = ()
    """Host names (``NAME`` or ``NAME:PORT``) the dashboard answers to besides IP
    addresses, ``localhost`` and this machine's host name (``--dashboard-host``, env
    ``HYPERMESH_DASHBOARD_HOSTS``): the names browsers use to reach it. Every other
    ``Host`` header is refused (403), which defeats DNS rebinding."""

    claim_batch: int = 32
    """Most tasks claimed in one etcd transaction (1-100). Larger batches cost
    fewer round trips when many tasks are pending, but conflict more often when
    many agents race for the same tasks."""

    metrics_listen: str | None = "127.0.0.1:0"
    """HOST:PORT where the agent serves Prometheus ``/metrics`` over HTTP; port 0
    picks a free port; None (``--metrics-listen off``) serves none. The bound
    address is registered (``hypermesh nodes --json``: ``metrics``) and written to
    ``WORK_DIR/agent.metrics``. The default keeps it on loopback: give a routable
    address and a fixed port (e.g. ``0.0.0.0:9464``) for a Prometheus server."""

    telemetry_period: float = 5.0
    """Seconds between telemetry samples (0.2-3600). Each sample reads /proc in a
    worker thread (about 0.6 ms of CPU on an idle node, more with many task
    processes). Shorter: finer figures, more idle CPU."""

    telemetry_history: int = 120
    """Samples of node telemetry kept in memory (1-100000; 120 x 5 s = 10 minutes)."""

    locality_delay: float | None = 3.0
    """Seconds (0-600) an agent leaves a claimable task to another live node that holds
    more of its input data (the recipe's ``inputs``) before it claims the task itself
    (delay scheduling; ``--locality-delay``). Longer: more tasks run where their data is
    cached, at the cost of idle slots while a busy holder finishes. 0: prefer tasks
    whose data this node holds, never wait. None (``off``): place tasks without
    regard to data, as if no task had inputs."""

    pool_delay: float = 5.0
    """Seconds (0-600) an agent leaves a claimable task to a live node of a pool the
    task's experiment prefers (the recipe's ``prefer_pools``) that has a free slot,
    before it claims the task itself (``--pool-delay``). Longer: more tasks run in the
    preferred pools when their nodes are slow to claim; shorter: less idle time when a
    preferred node looks free but cannot take the task. 0: never wait."""

    watch: str = "auto"
    """What of the namespace the agent watches (``--watch``). ``all``: everything, and it
    chooses blocks of batched experiments itself. ``own``: everything but the blocks
    and the other nodes' offers; it claims the blocks the leader offers it
    (``offer/<name>``) and reads a block from etcd once it holds it, so a task costs
    it nothing unless it runs it. It watches everything once it leads. Its dashboard
    reads what it shows from etcd on request. ``auto``: ``all`` while the mesh has a
    seat free for a node that watches everything (the mesh setting ``watch-all``,
    ``hypermesh.state.settings.take_watch_seat``), ``own`` once they are all taken;
    decided when the agent registers."""

    peer_sharing: bool = True
    """Whether this node's data set mounts ask the agent for chunks that peers hold
    (and share cold reads with them) before the object store (``--peer-sharing``).
    Off: every miss goes to the store; the node still advertises what it holds."""

    task_env: tuple[str, ...] = ()
    """Names of the agent's environment variables every task gets besides the built-in
    allow-list (``agent/tasks/task_env.py``: PATH, HOME, the locale...; ``--task-env``,
    repeatable). A name ending in ``*`` is a prefix (``NCCL_*``). Wider: a site's settings
    reach tasks without each recipe's ``pass_env``; every name added is a variable any
    recipe's tasks, and their logs, can read, so never add a credential here."""

    container_runtime: str = "auto"
    """What runs the tasks of experiments that name an ``image`` or ``framework``
    (``--container-runtime``): ``auto`` asks docker, then podman, whether it answers (a
    CLI without its daemon does not) at the first such task; ``docker`` or ``podman``
    asks that one only; ``none`` runs them with the process runtime, as it does when no
    runtime answers (each attempt's log says so)."""

    tls: TlsFiles | None = None
    """The mesh CA and this agent's certificate and key (``--tls-ca/--tls-cert/--tls-key``
    or ``HYPERMESH_TLS_*``; the certificate issued with ``hypermesh tls issue --agent``
    for the node's name). With them every gRPC connection, served or opened, is mutual
    TLS; None: plaintext, allowed only on loopback unless ``insecure``."""

    etcd_security: EtcdSecurity | None = None
    """How the agent reaches etcd: its CA, client certificate and user (``--etcd-ca``,
    ``--etcd-cert``, ``--etcd-key``, ``--etcd-user`` with ``HYPERMESH_ETCD_PASSWORD``;
    ``hypermesh/etcd_security.py``). None: plaintext, no user."""

    health_listen: str | None = None
    """HOST:PORT of a plaintext port serving only gRPC health (``--health-listen``), for
    probes that cannot do mutual TLS (Kubernetes' ``grpc`` probes); None: health is
    served on ``listen`` only. It reveals whether the agent serves, nothing else, so
    it may listen beyond loopback without ``insecure``."""

    insecure: bool = False
    """``--insecure``: let plaintext gRPC, the dashboard and metrics listen beyond
    loopback (``hypermesh/exposure.py``); the agent warns at every start."""

    def __post_init__(self) -> None:
        if not NODE_NAME_RE.fullmatch(self.name):
            raise UsageError(
                f"--name {self.name!r}: 1-253 letters, digits, '.', '-' or '_', "
                "starting with a letter or digit"
            )
        _check_range("--slots", self.slots, 1, 4096)
        _check_range("--lease-ttl", self.lease_ttl, 2, 3600)
        _check_range("--grace", self.kill_grace, 0, 3600)
        _check_range("claim_batch", self.claim_batch, 1, 100)
        if self.watch not in ("all", "own", "auto"):
            raise UsageError(f"watch: expected all, own or auto, got {self.watch!r}")
        _check_range("--leader-ttl", self.leader_ttl, 2, 60)
        _check_range("--spot-poll", self.spot_poll, 0.1, 60)
        _check_range("log_upload_s", self.log_upload_s, 0.5, 3600)
        try:
            parse_size(self.cache_size)
            parse_duration(self.data_deadline)
        except UnitError as exc:
            raise UsageError(f"--cache-size {self.cache_size!r}: {exc}") from exc
        try:
            parse_size(self.image_budget)
        except UnitError as exc:
            raise UsageError(f"--image-budget {self.image_budget!r}: {exc}") from exc
        if self.image_pull_deadline is not None:
            try:
                deadline = parse_duration(self.image_pull_deadline)
            except UnitError as exc:
                raise UsageError(
                    f"--image-pull-deadline {self.image_pull_deadline!r}: {exc}") from exc
            _check_range("--image-pull-deadline", deadline, 1, 86400)
        if self.store is not None and not self.store.startswith(("s3://", "file:///")):
            raise UsageError(
                f"--store {self.store!r}: expected s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH"
            )
        if self.preset not in ("lan", "local"):
            raise UsageError(f"preset {self.preset!r}: expected 'lan' or 'local'")
        if self.gpus is not None:
            _check_range("--gpus", self.gpus, 0, 1024)
        _check_range("--telemetry-period", self.telemetry_period, 0.2, 3600)
        _check_range("telemetry_history", self.telemetry_history, 1, 100_000)
        if self.locality_delay is not None:
            _check_range("--locality-delay", self.locality_delay, 0, 600)
        _check_range("--pool-delay", self.pool_delay, 0, 600)
        _check_address("--listen", self.listen)
        if self.advertise is not None:
            check_advertise("--advertise", self.advertise)
        object.__setattr__(self, "task_env", tuple(self.task_env))
        for name in self.task_env:
            if not TASK_ENV_RE.fullmatch(name):
                raise UsageError(f"--task-env {name!r}: expected a variable name "
                                 "(letters, digits, '_') or a prefix ending in '*'")
        if self.container_runtime not in CONTAINER_RUNTIMES:
            raise UsageError(f"--container-runtime {self.container_runtime!r}: expected one "
                             f"of {', '.join(CONTAINER_RUNTIMES)}")
        if self.metrics_listen is not None:
            _check_address("--metrics-listen", self.metrics_listen)
        if self.http_listen is not None:
            _check_address("--http-listen", self.http_listen)
        if self.health_listen is not None:
            _check_address("--health-listen", self.health_listen)
        check_token(self.dashboard_token)
        object.__setattr__(self, "dashboard_hosts",
                           tuple(h.lower() for h in self.dashboard_hosts))
        for host in self.dashboard_hosts:
            if not DASHBOARD_HOST_RE.fullmatch(host):
                raise UsageError(f"--dashboard-host {host!r}: expected a host name, "
                                 "optionally with :PORT")
        check_exposure(self.listen, self.tls is not None, self.insecure,
                       self.metrics_listen, self.http_listen, self.dashboard_token is not None)
        check_listen_reachable(self.listen, self.advertise)  # after: safety speaks first

    @classmethod
    def lan(cls, **overrides: object) -> AgentConfig:
        """Defaults for machines on one network."""
        return cls(**overrides)  # type: ignore[arg-type]

    @classmethod
    def local(cls, **overrides: object) -> AgentConfig:
        """Tight timings for tests and the local mesh: fast death detection and kills."""
        base: dict[str, object] = {
            "lease_ttl": 3,
            "kill_grace": 2.0,
            "spot_poll": 0.2,
            "log_upload_s": 1.0,
            "http_listen": "127.0.0.1:0",
            "preset": "local",
            "pool_delay": 2.0,
        }
        return cls(**(base | overrides))  # type: ignore[arg-type]

    def replace(self, **changes: object) -> AgentConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise UsageError(f"{name} {value} is out of range: allowed {low}..{high}")


def _check_address(name: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{name} {address!r}: expected HOST:PORT")


def parse_locality_delay(text: str) -> float | None:
    """``--locality-delay``: seconds, or ``off`` (None); ``UsageError`` otherwise."""
    if text.strip().lower() == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise UsageError(
            f"--locality-delay {text!r}: expected seconds (0-600) or 'off'"
        ) from None


def default_etcd() -> str:
    return os.environ.get(ENV_ETCD, "http://127.0.0.1:2379")


def default_namespace() -> str:
    return os.environ.get(ENV_NAMESPACE, DEFAULT_NAMESPACE)
