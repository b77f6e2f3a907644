"""Prometheus metrics of one agent, served over HTTP at ``/metrics``.

Nothing is counted on a hot path: a scrape takes a :class:`Snapshot` of what the
agent already holds (its mirror of etcd, its gossip table, its telemetry, the
``.chunkfs-stats`` of its mounts) and :func:`families` turns it into metric
families (pure: no I/O, table-testable). Figures derived from etcd's records are
exposed as counters: they only grow while the records exist.

Mesh-wide families (``hypermesh_mesh_*``) are the same on every agent that mirrors
the whole namespace: aggregate them with ``max``, not ``sum``. ``hypermesh_node_*``
families are this node's own. A node started with ``--watch own`` exports the mesh-wide
families only while it leads (its view is then whole), and its attempt figures add what
its own flushes recorded of the blocks it ran, which its view does not hold. Tasks
and workflows by state are counted as ``hypermesh status`` counts them (tasks of
experiments not yet expanded are pending or cancelled), from per-experiment counts the
mirror keeps; the attempt figures scan every
attempt in the mirror (about 60 ms per 100,000 attempts on the test machine, once per
scrape).

The HTTP side is a small asyncio server on the agent's event loop (GET or HEAD of
``/metrics``, HTTP/1.0, one response per connection): an idle agent pays nothing for
it, where ``prometheus_client``'s threaded server would wake twice a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from hypermesh.agent.ops.health import serving
from hypermesh.agent.ops.usage import NodeSample, TaskUsage
from hypermesh.chunkfs.mount import STATS_FILE
from hypermesh.errors import HypermeshError
from hypermesh.state.folding import AttemptKey
from hypermesh.state.records import LOST_REASONS, Attempt

if TYPE_CHECKING:
    from hypermesh.agent.gossip.duty import Gossip
    from hypermesh.agent.ops.telemetry import Telemetry
    from hypermesh.agent.tasks.mounts import Mounts
    from hypermesh.config import AgentConfig
    from hypermesh.state.view import MeshView

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0
MOUNT_STATS_TIMEOUT_S = 3.0
MAX_REQUEST_BYTES = 16 * 1024


@dataclass
class Snapshot:
    """What one scrape reports, taken on the agent's event loop (mount stats in a
    worker thread). Plain data: :func:`families` needs nothing else."""

    node: str
    state: str = "alive"
    serving: bool = True
    leader: bool = False
    whole: bool = True  # the node's view holds the whole namespace (not --watch own)
    followed: int = 0  # workflows whose own keys the node's view follows
    slots: int = 0
    running: int = 0
    tasks_by_state: Counter[str] = field(default_factory=Counter)
    workflows_by_state: Counter[str] = field(default_factory=Counter)
    node_attempts: Counter[tuple[str, str]] = field(default_factory=Counter)
    node_recoveries: int = 0
    mesh_lost_attempts: Counter[str] = field(default_factory=Counter)
    gossip_members: Counter[str] = field(default_factory=Counter)
    gossip_local_health: int = 0
    gossip_refused: Counter[str] = field(default_factory=Counter)
    mounts: dict[str, dict[str, Any]] = field(default_factory=dict)
    nvml: bool = False
    telemetry: NodeSample | None = None
    task_usage: list[TaskUsage] = field(default_factory=list)


class BlockCounts(Protocol):
    """What a node recorded of the blocks it ran (``agent/tasks/blocks.py``)."""

    recoveries: int

    def own_attempts(self) -> Counter[tuple[str, str]]: ...


class MeteredAgent(Protocol):
    """What a scrape reads of the agent (it changes none of it)."""

    cfg: AgentConfig
    state: str
    telemetry: Telemetry
    gossip: Gossip
    mounts: Mounts
    view_whole: asyncio.Event

    @property
    def blocks(self) -> BlockCounts: ...

    @property
    def running(self) -> Sized: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def lease_is_lost(self) -> bool: ...

    def full_view(self) -> MeshView: ...


def snapshot(agent: MeteredAgent) -> Snapshot:
    """This agent's state now. Call on the agent's event loop."""
    view = agent.full_view()
    snap = Snapshot(
        node=agent.cfg.name,
        state=agent.state,
        serving=serving(agent.state, agent.lease_is_lost),
        leader=agent.is_leader,
        slots=agent.cfg.slots,
        running=len(agent.running),
        nvml=agent.telemetry.nvml,
        telemetry=agent.telemetry.latest(),
        task_usage=list(agent.telemetry.tasks),
    )
    snap.whole = agent.view_whole.is_set()
    following = view.following  # None: the view holds every workflow
    snap.followed = len(view.workflows if following is None else following.followed)
    if snap.whole:
        for wid in view.workflows:  # as `hypermesh status` counts them, at O(experiments)
            summary = view.workflow_summary(wid)
            snap.workflows_by_state[summary["state"]] += 1
            for exp in summary["experiments"].values():
                for state in ("pending", "running", "succeeded", "failed", "cancelled"):
                    snap.tasks_by_state[state] += exp[state]
    count_attempts(snap, view.attempts.values())
    count_folded_attempts(snap, view.folded_attempts())
    if not snap.whole:
        # It sees no block: what it ran of them is what its own flushes recorded, and
        # the mesh-wide families are left to nodes that see everything (the leader).
        snap.node_attempts.update(agent.blocks.own_attempts())
        snap.node_recoveries += agent.blocks.recoveries
        snap.mesh_lost_attempts.clear()
    members = agent.gossip.members()
    snap.gossip_members.update(m.state for m in members.members)
    snap.gossip_local_health = members.local_health
    snap.gossip_refused.update(agent.gossip.refused())
    return snap


def count_attempts(snap: Snapshot, tasks: Iterable[Mapping[int, Attempt]]) -> None:
    """Fill ``snap``'s attempt figures from every task's attempts (by number): this
    node's attempts by state and reason, the tasks it took over after a lost or
    preempted attempt, and the mesh's lost attempts by reason."""
    for attempts in tasks:
        for n, a in attempts.items():
            if a.reason in LOST_REASONS:
                snap.mesh_lost_attempts[a.reason] += 1
            if a.node != snap.node:
                continue
            snap.node_attempts[(a.state, a.reason or "")] += 1
            before = attempts.get(n - 1)
            if before is not None and before.reason in LOST_REASONS:
                snap.node_recoveries += 1


def count_folded_attempts(snap: Snapshot, tally: Mapping[AttemptKey, int]) -> None:
    """Add the attempts of folded blocks (``hypermesh/state/folding.py``), kept as counts
    by (node, state, reason, the reason of the attempt before), as ``count_attempts``
    counts them: a counter must not fall when the records behind it are folded."""
    for (node, state, reason, before), n in tally.items():
        if reason in LOST_REASONS:
            snap.mesh_lost_attempts[reason] += n
        if node != snap.node:
            continue
        snap.node_attempts[(state, reason)] += n
        if before in LOST_REASONS:
            snap.node_recoveries += n


def read_mount_stats(mountpoints: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Each mount's ``.chunkfs-stats`` (blocking: run it in a worker thread); a mount
    that does not answer is left out."""
    out = {}
    for spec, mountpoint in mountpoints.items():
        try:
            out[spec] = json.loads((mountpoint / STATS_FILE).read_text())
        except (OSError, ValueError) as exc:
            log.debug("stats of mount %s: %s", spec, exc)
    return out


def families(s: Snapshot) -> list[Metric]:
    """The metric families of a snapshot."""
    node = ["node"]
    out: list[Metric] = []

    def gauge(name: str, doc: str, value: float) -> None:
        g = GaugeMetricFamily(name, doc, labels=node)
        g.add_metric([s.node], value)
        out.append(g)

    gauge("hypermesh_node_serving", "1 while alive with its etcd lease held, else 0.", s.serving)
    gauge("hypermesh_node_draining", "1 while the node drains.", s.state == "draining")
    gauge("hypermesh_node_leader", "1 on the mesh's leader.", s.leader)
    gauge("hypermesh_node_slots", "Tasks the node runs at once.", s.slots)
    gauge("hypermesh_node_running_tasks", "Attempts running on the node now.", s.running)
    gauge("hypermesh_node_followed_workflows",
          "Workflows whose keys the node receives: every one where it watches the whole "
          "namespace, those it works on where it watches its own part.", s.followed)

    attempts = CounterMetricFamily(
        "hypermesh_node_attempts",
        "Attempts this node claimed (each began with a claim), by state and reason.",
        labels=["node", "state", "reason"],
    )
    for (state, reason), n in sorted(s.node_attempts.items()):
        attempts.add_metric([s.node, state, reason], n)
    out.append(attempts)
    claims = CounterMetricFamily(
        "hypermesh_node_claims", "Task claims this node won.", labels=node
    )
    claims.add_metric([s.node], sum(s.node_attempts.values()))
    out.append(claims)
    recoveries = CounterMetricFamily(
        "hypermesh_node_recoveries",
        "Tasks this node took over after their previous attempt was lost or preempted.",
        labels=node,
    )
    recoveries.add_metric([s.node], s.node_recoveries)
    out.append(recoveries)

    if s.whole:  # a node that watches only its own part cannot count the mesh's
        out.append(_by_label("hypermesh_mesh_tasks", "Tasks in the mesh by state.", "state",
                             s.tasks_by_state, gauge_type=True))
        out.append(_by_label("hypermesh_mesh_workflows", "Workflows in the mesh by state.",
                             "state", s.workflows_by_state, gauge_type=True))
        out.append(_by_label("hypermesh_mesh_lost_attempts",
                             "Attempts that ended because their node was lost or preempted.",
                             "reason", s.mesh_lost_attempts, gauge_type=False))

    members = GaugeMetricFamily(
        "hypermesh_gossip_members", "Gossip members by state, as this node sees them.",
        labels=["node", "state"],
    )
    for state in sorted({"alive", "suspect", "dead", "left", *s.gossip_members}):
        members.add_metric([s.node, state], s.gossip_members.get(state, 0))
    out.append(members)
    gauge("hypermesh_gossip_local_health", "Lifeguard local health score (0 = healthy).",
          s.gossip_local_health)
    refused = CounterMetricFamily(
        "hypermesh_gossip_refused",
        "Gossip messages and rows this node refused to believe, by reason.",
        labels=["node", "reason"],
    )
    for reason, n in sorted(s.gossip_refused.items()):
        refused.add_metric([s.node, reason], n)
    out.append(refused)

    out.extend(_mount_families(s.node, s.mounts))
    out.extend(_telemetry_families(s))
    return out


def _by_label(
    name: str, doc: str, label: str, counts: Counter[str], *, gauge_type: bool
) -> Metric:
    family: GaugeMetricFamily | CounterMetricFamily = (
        GaugeMetricFamily(name, doc, labels=[label])
        if gauge_type
        else CounterMetricFamily(name, doc, labels=[label])
    )
    for key, n in sorted(counts.items()):
        family.add_metric([key], n)
    return family


def _mount_families(node: str, mounts: dict[str, dict[str, Any]]) -> Iterable[Metric]:
    labels = ["node", "dataset"]
    blocks = CounterMetricFamily(
        "hypermesh_chunkfs_read_blocks", "Blocks served to readers, by where they came from.",
        labels=[*labels, "source"],
    )
    read_bytes = CounterMetricFamily(
        "hypermesh_chunkfs_read_bytes", "Bytes served to readers, by where they came from.",
        labels=[*labels, "source"],
    )
    store_bytes = CounterMetricFamily(
        "hypermesh_chunkfs_store_bytes", "Bytes fetched from object storage.", labels=labels
    )
    store_gets = CounterMetricFamily(
        "hypermesh_chunkfs_store_gets", "GET requests to object storage.", labels=labels
    )
    cache_bytes = GaugeMetricFamily(
        "hypermesh_chunkfs_cache_bytes", "Bytes in the mount's chunk cache.", labels=labels
    )
    cache_max = GaugeMetricFamily(
        "hypermesh_chunkfs_cache_max_bytes", "Most bytes the chunk cache holds.", labels=labels
    )
    for spec, stats in sorted(mounts.items()):
        reads = stats.get("reads", {})
        for source, n in sorted(reads.get("blocks", {}).items()):
            blocks.add_metric([node, spec, source], n)
        for source, n in sorted(reads.get("bytes", {}).items()):
            read_bytes.add_metric([node, spec, source], n)
        store_bytes.add_metric([node, spec], reads.get("store_bytes", 0))
        store_gets.add_metric([node, spec], reads.get("store_gets", 0))
        cache = stats.get("cache", {})
        cache_bytes.add_metric([node, spec], cache.get("bytes", 0))
        cache_max.add_metric([node, spec], cache.get("max_bytes", 0))
    return [blocks, read_bytes, store_bytes, store_gets, cache_bytes, cache_max]


def _telemetry_families(s: Snapshot) -> Iterable[Metric]:
    out: list[Metric] = []
    nvml = GaugeMetricFamily("hypermesh_node_nvml", "1 when NVML answers.", labels=["node"])
    nvml.add_metric([s.node], s.nvml)
    out.append(nvml)
    t = s.telemetry
    if t is not None:
        for name, doc, value in (
            ("cpu_percent", "Busy share of all cores (0-100).", t.cpu_percent),
            ("load1", "One-minute load average.", t.load1),
            ("memory_used_bytes", "Memory in use (total - available).", t.memory_used),
            ("memory_total_bytes", "Total memory.", t.memory_total),
            ("disk_used_bytes", "Used bytes of the work directory's file system.", t.disk_used),
            ("disk_total_bytes", "Size of the work directory's file system.", t.disk_total),
            ("disk_read_bytes_per_second", "Disk reads.", t.disk_read_per_s),
            ("disk_write_bytes_per_second", "Disk writes.", t.disk_write_per_s),
            ("network_receive_bytes_per_second", "Network bytes received.", t.net_recv_per_s),
            ("network_transmit_bytes_per_second", "Network bytes sent.", t.net_sent_per_s),
            ("agent_cpu_percent", "The agent process's CPU (100 = one core).",
             t.agent_cpu_percent),
            ("agent_rss_bytes", "The agent process's resident memory.", t.agent_rss),
        ):
            g = GaugeMetricFamily(f"hypermesh_node_{name}", doc, labels=["node"])
            g.add_metric([s.node], value)
            out.append(g)
        gpu_labels = ["node", "gpu", "name"]
        util = GaugeMetricFamily("hypermesh_gpu_utilization_percent", "GPU utilisation.",
                                 labels=gpu_labels)
        used = GaugeMetricFamily("hypermesh_gpu_memory_used_bytes", "GPU memory in use.",
                                 labels=gpu_labels)
        total = GaugeMetricFamily("hypermesh_gpu_memory_total_bytes", "GPU memory.",
                                  labels=gpu_labels)
        temp = GaugeMetricFamily("hypermesh_gpu_temperature_celsius", "GPU temperature.",
                                 labels=gpu_labels)
        for gpu in t.gpus:
            key = [s.node, str(gpu.index), gpu.name]
            figures: tuple[tuple[GaugeMetricFamily, float | None], ...] = (
                (util, gpu.utilization_percent),
                (used, gpu.memory_used),
                (total, gpu.memory_total),
                (temp, gpu.temperature_c),
            )
            for family, figure in figures:
                if figure is not None:  # a figure the GPU does not report is absent
                    family.add_metric(key, figure)
        out += [util, used, total, temp]
    task_labels = ["node", "task", "attempt"]
    cpu = GaugeMetricFamily("hypermesh_task_cpu_percent",
                            "A running attempt's processes' CPU (100 = one core).",
                            labels=task_labels)
    rss = GaugeMetricFamily("hypermesh_task_rss_bytes",
                            "A running attempt's processes' resident memory.", labels=task_labels)
    gpu_mem = GaugeMetricFamily("hypermesh_task_gpu_memory_bytes",
                                "A running attempt's processes' GPU memory.", labels=task_labels)
    for u in s.task_usage:
        key = [s.node, u.task_id, str(u.attempt)]
        cpu.add_metric(key, u.cpu_percent)
        rss.add_metric(key, u.rss)
        gpu_mem.add_metric(key, u.gpu_memory)
    return [*out, cpu, rss, gpu_mem]


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def exposition(s: Snapshot) -> bytes:
    """The Prometheus text format of a snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families(s)))
    return generate_latest(registry)


# ---------------------------------------------------------------------- HTTP
class MetricsServer:
    """``/metrics`` of one agent on an asyncio server. Only the agent's loop uses it."""

    def __init__(self, agent: MeteredAgent) -> None:
        self.agent = agent
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self, listen: str) -> str:
        """Bind ``listen`` (HOST:PORT, port 0 = a free one); returns the bound HOST:PORT."""
        host, _, port = listen.rpartition(":")
        try:
            self._server = await asyncio.start_server(
                self._serve, host.strip("[]"), int(port), limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            raise HypermeshError(f"--metrics-listen {listen}: cannot listen: {exc}") from exc
        bound = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{bound}"
        return self.address

    async def body(self) -> bytes:
        snap = snapshot(self.agent)
        mounted = self.agent.mounts.mounted()
        if mounted:
            try:  # a hung mount must not hang the scrape; its figures are left out
                snap.mounts = await asyncio.wait_for(
                    asyncio.to_thread(read_mount_stats, mounted), MOUNT_STATS_TIMEOUT_S
                )
            except TimeoutError:
                log.warning("mount statistics did not answer in %gs", MOUNT_STATS_TIMEOUT_S)
        return exposition(snap)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            method, path, *_ = [*head.split(b"\r\n", 1)[0].decode("latin-1").split(" "), "", ""]
            if method not in ("GET", "HEAD"):
                await _respond(writer, 405, b"only GET and HEAD\n")
            elif path.split("?", 1)[0] != "/metrics":
                await _respond(writer, 404, b"metrics are at /metrics\n")
            else:
                body = await self.body()
                await _respond(writer, 200, body, CONTENT_TYPE_LATEST, head_only=method == "HEAD")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError):
            pass  # a client that went away or sent no request: nothing to answer
        except Exception:
            log.exception("serving /metrics")
            with contextlib.suppress(Exception):
                await _respond(writer, 500, b"internal error\n")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
) -> None:
    reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Error"}[status]
    writer.write(
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    )
    if not head_only:
        writer.write(body)
    await writer.drain()
