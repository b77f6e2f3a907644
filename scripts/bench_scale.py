"""Scale harness: what a task and an idle agent cost as the mesh grows (issue 23).

Two subcommands; both start everything they measure on this machine and stop every
process they start, also when a run fails.

``mesh``: a real etcd (fsync off) and ``--agents`` real agent processes with ``--slots``
slots each (``--preset lan`` unless asked otherwise); ``--tasks`` trivial tasks
(``true``) submitted with ``hypermesh submit --wait``. Over the submit window it
reports, per task: the agents' CPU summed over all agents (and the leader's share),
etcd's CPU, the watch events etcd delivered (``etcd_debugging_mvcc_events_total``:
one per event per watcher), the gRPC bytes etcd sent to its clients, etcd's puts and
txns; and tasks/s end to end. Then an idle phase (``--idle-seconds``, after
``--settle``): each agent's CPU in % of a core, etcd's writes (mvcc puts + deletes,
and Put/Txn/DeleteRange RPCs) and lease keep-alives per second per agent, and the
agent-to-agent gRPC bytes (gossip's streams, TCP payload with HTTP/2 framing, read
from the kernel's ``tcp_info`` with ``ss``) sent per agent per second.

``compare``: the figure the issue's bar is about, measured in one run: ``--pairs``
pairs of ``mesh`` runs of two shapes (``--a 4x4 --b 32x1``: agents x slots), each a
fresh mesh, no idle phase, the order alternating from pair to pair (A B, B A, ...) so
that drift of the machine weighs on both. It prints each pair's agents' CPU per task
and the ratio B/A, then the median of the ratios and the ratio of the medians.

``watchers``: etcd alone, as a load generator for watch fan-out. ``--watchers`` watch
streams on one prefix (etcd3aio opens one gRPC Watch stream per watch; the streams are
spread over ``--connections`` client channels, i.e. HTTP/2 connections), and one writer
on its own channel puts ``--writes`` keys under the prefix at ``--rate`` per second,
each value its send time. It reports etcd's CPU per write, events delivered per write
(should equal the watchers), etcd's watch messages and bytes sent per write, the
watcher process's own CPU per write, and p50/p99 delivery latency (send to the
watcher's callback, same process and clock: it includes the watchers' own event-loop
backlog).

    .venv/bin/python scripts/bench_scale.py mesh --agents 32 --slots 1 --tasks 4000
        [--rounds 1] [--idle-seconds 20] [--settle 5] [--preset lan|local]
        [--flush-rate N] [--json]
    .venv/bin/python scripts/bench_scale.py compare --a 4x4 --b 32x1 --pairs 5
        [--tasks 4000] [--watch own] [--settle 3] [--json]
    .venv/bin/python scripts/bench_scale.py watchers --watchers 1000 --writes 200
        [--connections 4] [--rate 10] [--json]

Past a few dozen agent processes, ``scripts/bench_scale_inproc.py`` runs hundreds of
real agents on one event loop in one process (no task processes).

It asserts nothing about speed; it prints a table (and with ``--json`` a JSON summary
on stdout, the table going to stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dispatch import (
    QUERY_TIMEOUT_S,
    SUBMIT_TIMEOUT_S,
    BenchError,
    _cli,
    _wait_for_leader,
    agent_span,
    children_cpu,
    machine,
    proc_cpu,
    recipe_text,
)

from hypermesh.local.agents import stop_all
from hypermesh.local.etcd import EtcdCluster, EtcdServer
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for

MEMBERS_TIMEOUT_S = 120.0
"""How long all agents may take to appear in ``hypermesh nodes``."""

LIST_TIMEOUT_S = 240.0
"""Upper bound on ``hypermesh tasks --json`` after a run (slow on an overloaded machine)."""

DELIVERY_TIMEOUT_S = 60.0
"""How long the watchers may take to receive every write after the last one."""

METRIC_PREFIXES = (
    "etcd_debugging_mvcc_",
    "etcd_mvcc_",
    "etcd_network_client_grpc_",
    "grpc_server_msg_sent_total",
    "grpc_server_msg_received_total",
    "grpc_server_started_total",
    "process_cpu_seconds_total",
)
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


# ---------------------------------------------------------------- etcd's /metrics


def etcd_metrics(url: str) -> dict[str, float]:
    """The series of etcd's Prometheus ``/metrics`` this harness reads, keyed by
    ``name{labels}`` as etcd writes them."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC_PREFIXES):
            continue
        m = _SERIES.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def etcd_servers(mesh: LocalMesh) -> list[EtcdServer]:
    """The mesh's etcd members (one, or each of a cluster's)."""
    etcd = mesh.etcd
    return list(etcd.members) if isinstance(etcd, EtcdCluster) else [etcd]


def cluster_metrics(mesh: LocalMesh) -> dict[str, float]:
    """:func:`etcd_metrics` summed over the mesh's etcd members."""
    total: dict[str, float] = {}
    for server in etcd_servers(mesh):
        for k, v in etcd_metrics(server.url).items():
            total[k] = total.get(k, 0.0) + v
    return total


def cluster_cpu(mesh: LocalMesh) -> float:
    """CPU seconds of the mesh's etcd members, summed."""
    return sum(proc_cpu(s.proc.pid)[0] for s in etcd_servers(mesh) if s.proc is not None)


def metric(series: dict[str, float], name: str, method: str | None = None) -> float:
    """Sum of ``name``'s series (only those of gRPC method ``method`` if given)."""
    total = 0.0
    for key, value in series.items():
        base, _, labels = key.partition("{")
        if base != name:
            continue
        if method is not None and f'grpc_method="{method}"' not in labels:
            continue
        if method == "Watch" and "etcdserverpb.Watch" not in labels:
            continue  # not grpc.health.v1.Health's Watch
        total += value
    return total


@dataclass(frozen=True)
class EtcdDelta:
    """What etcd did between two scrapes of its ``/metrics``."""

    events: float  # watch events sent to watchers (one per event per watcher)
    watch_msgs: float  # WatchResponse messages sent
    sent_bytes: float  # gRPC bytes sent to clients
    received_bytes: float
    puts: float  # mvcc puts
    deletes: float
    txns: float  # mvcc txns
    write_rpcs: float  # Put + Txn + DeleteRange RPCs started
    range_rpcs: float
    keepalives: float  # LeaseKeepAlive messages received

    @classmethod
    def between(cls, a: dict[str, float], b: dict[str, float]) -> EtcdDelta:
        def d(name: str, method: str | None = None) -> float:
            return metric(b, name, method) - metric(a, name, method)

        return cls(
            events=d("etcd_debugging_mvcc_events_total"),
            watch_msgs=d("grpc_server_msg_sent_total", "Watch"),
            sent_bytes=d("etcd_network_client_grpc_sent_bytes_total"),
            received_bytes=d("etcd_network_client_grpc_received_bytes_total"),
            puts=d("etcd_mvcc_put_total"),
            deletes=d("etcd_mvcc_delete_total"),
            txns=d("etcd_mvcc_txn_total"),
            write_rpcs=sum(d("grpc_server_started_total", m)
                           for m in ("Put", "Txn", "DeleteRange")),
            range_rpcs=d("grpc_server_started_total", "Range"),
            keepalives=d("grpc_server_msg_received_total", "LeaseKeepAlive"),
        )

    def per_task(self, tasks: int) -> dict[str, float]:
        """What etcd did per task of a run, keyed as the harnesses report it."""
        return {
            "watch_events": self.events / tasks,
            "watch_msgs": self.watch_msgs / tasks,
            "etcd_sent_bytes": self.sent_bytes / tasks,
            "etcd_received_bytes": self.received_bytes / tasks,
            "puts": self.puts / tasks,
            "deletes": self.deletes / tasks,
            "txns": self.txns / tasks,
            "write_rpcs": self.write_rpcs / tasks,
            "range_rpcs": self.range_rpcs / tasks,
        }

    def per_agent_second(self, agent_seconds: float) -> dict[str, float]:
        """What etcd did while idle, per agent per second."""
        return {
            "mvcc_writes_per_s_per_agent": (self.puts + self.deletes) / agent_seconds,
            "write_rpcs_per_s_per_agent": self.write_rpcs / agent_seconds,
            "range_rpcs_per_s_per_agent": self.range_rpcs / agent_seconds,
            "keepalives_per_s_per_agent": self.keepalives / agent_seconds,
            "watch_events_per_s_per_agent": self.events / agent_seconds,
            "etcd_sent_bytes_per_s_per_agent": self.sent_bytes / agent_seconds,
        }


ETCD_TASK_ROWS = [
    ("etcd watch events sent", "watch_events", "{:.1f}"),
    ("etcd watch messages sent", "watch_msgs", "{:.1f}"),
    ("etcd bytes sent to clients", "etcd_sent_bytes", "{:.0f}"),
    ("etcd bytes received", "etcd_received_bytes", "{:.0f}"),
    ("etcd mvcc puts", "puts", "{:.2f}"),
    ("etcd mvcc deletes", "deletes", "{:.2f}"),
    ("etcd mvcc txns", "txns", "{:.2f}"),
    ("etcd Put/Txn/Delete RPCs", "write_rpcs", "{:.2f}"),
    ("etcd Range RPCs", "range_rpcs", "{:.2f}"),
]
"""How both harnesses print :meth:`EtcdDelta.per_task` (label, key, format)."""

ETCD_IDLE_ROWS = [
    ("etcd mvcc writes /s", "mvcc_writes_per_s_per_agent", "{:.4f}"),
    ("etcd Put/Txn/Delete RPCs /s", "write_rpcs_per_s_per_agent", "{:.4f}"),
    ("etcd Range RPCs /s", "range_rpcs_per_s_per_agent", "{:.4f}"),
    ("lease keep-alives /s", "keepalives_per_s_per_agent", "{:.3f}"),
    ("etcd watch events /s", "watch_events_per_s_per_agent", "{:.2f}"),
    ("etcd bytes sent /s", "etcd_sent_bytes_per_s_per_agent", "{:.0f}"),
]
"""How both harnesses print :meth:`EtcdDelta.per_agent_second`."""


def print_rows(rows: list[tuple[str, str, str]], values: dict[str, Any], out: Any) -> None:
    """One line per (label, key, format) of ``rows``: the label, then ``values[key]``
    formatted, or n/a where it is None or missing."""
    for label, key, fmt in rows:
        v = values.get(key)
        print(f"  {label:<32}{'n/a' if v is None else fmt.format(v):>14}", file=out)


# ---------------------------------------------------------------- agent-to-agent bytes


def tcp_bytes_by_local_port(ports: set[int]) -> dict[tuple[str, str], float]:
    """Bytes moved (acked sent + received) by each established loopback TCP socket
    whose local port is one of ``ports`` (the agents' gRPC ports: the server side of
    every agent-to-agent stream), keyed by (local, peer) address. From ``ss -tin``."""
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    result: dict[tuple[str, str], float] = {}
    current: tuple[str, str] | None = None
    for line in out.splitlines():
        if not line.startswith(("\t", " ")):
            parts = line.split()
            current = None
            if len(parts) >= 4:
                local, peer = parts[-2], parts[-1]
                port = local.rpartition(":")[2]
                if port.isdigit() and int(port) in ports:
                    current = (local, peer)
            continue
        if current is None:
            continue
        acked = re.search(r"bytes_acked:(\d+)", line)
        received = re.search(r"bytes_received:(\d+)", line)
        result[current] = float(acked.group(1) if acked else 0) + float(
            received.group(1) if received else 0)
        current = None
    return result


def agent_ports(mesh: LocalMesh) -> set[int]:
    """The agents' gRPC ports: the server side of every agent-to-agent stream."""
    return {int(a.address.rpartition(":")[2]) for a in mesh.agents if a.address}


def tcp_delta(a: dict[tuple[str, str], float], b: dict[tuple[str, str], float]) -> float:
    """Bytes moved between two readings; sockets opened in between count from zero
    (sockets closed in between are lost: an undercount)."""
    return sum(v - a.get(k, 0.0) for k, v in b.items())


# ---------------------------------------------------------------- mesh


def slot_gaps(rows: list[dict[str, Any]], slots: int) -> list[float]:
    """Seconds each slot stood free before its next attempt started, over every node:
    the claim latency a task meets while the backlog lasts (a trivial task's slot is
    free again at once, so the gap is what the claim path costs). Per node the attempts
    are taken in start order and each is given the slot that freed first; a slot's first
    attempt has no gap."""
    by_node: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for a in row["attempts"]:
            if a.get("started_at") and a.get("ended_at"):
                by_node.setdefault(str(a["node"]), []).append(
                    (float(a["started_at"]), float(a["ended_at"])))
    gaps: list[float] = []
    for spans in by_node.values():
        free: list[float] = []  # a heap of the times busy slots free up
        for start, end in sorted(spans):
            if len(free) >= slots:
                gaps.append(max(0.0, start - heapq.heappop(free)))
            heapq.heappush(free, end)
    return gaps


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def lease_losses(mesh: LocalMesh) -> int:
    """Lease losses the agents logged (``lost lease``): the churn of an overloaded mesh."""
    lost = 0
    for a in mesh.agents:
        with contextlib.suppress(OSError):
            lost += a.log_path.read_text(errors="replace").count(" lost lease ")
    return lost


@dataclass
class MeshResult:
    """One ``mesh`` round. CPU in seconds, figures per task derived in ``per_task``."""

    agents: int
    slots: int
    tasks: int
    wall_s: float
    agent_span_s: float
    agents_cpu_s: float
    leader_cpu_s: float
    tasks_cpu_s: float  # CPU of the task processes the agents reaped
    etcd_cpu_s: float
    cli_cpu_s: float
    etcd: EtcdDelta
    idle_s: float = 0.0
    idle_agent_cpu_pct: list[float] = field(default_factory=list)
    idle_etcd_cpu_pct: float = 0.0
    idle_etcd: EtcdDelta | None = None
    idle_gossip_bytes: float | None = None
    idle_rss_mb: list[float] = field(default_factory=list)
    gap_p50_s: float = float("nan")  # slot gaps (claim latency), see slot_gaps
    gap_p99_s: float = float("nan")
    gap_max_s: float = float("nan")
    leases_lost: int = 0  # during the run and its idle phase, summed over the agents
    peer_bytes: float = float("nan")  # agent-to-agent streams (gossip) during the run

    def per_task(self) -> dict[str, float]:
        t = self.tasks
        return {
            "tasks_per_s": t / self.wall_s,
            "agent_side_tasks_per_s": t / self.agent_span_s,
            "agents_cpu_ms": 1e3 * self.agents_cpu_s / t,
            "leader_cpu_ms": 1e3 * self.leader_cpu_s / t,
            "followers_cpu_ms": 1e3 * (self.agents_cpu_s - self.leader_cpu_s) / t,
            "etcd_cpu_ms": 1e3 * self.etcd_cpu_s / t,
            "cli_cpu_ms": 1e3 * self.cli_cpu_s / t,
            **self.etcd.per_task(t),
            "gap_p50_ms": 1e3 * self.gap_p50_s,
            "gap_p99_ms": 1e3 * self.gap_p99_s,
            "gap_max_ms": 1e3 * self.gap_max_s,
            "leases_lost": float(self.leases_lost),
            "peer_bytes": self.peer_bytes / t,
        }

    def idle(self) -> dict[str, float | None]:
        if self.idle_etcd is None or self.idle_s <= 0:
            return {}
        per = self.agents * self.idle_s
        cpu = self.idle_agent_cpu_pct
        return {
            "agent_cpu_pct_median": statistics.median(cpu),
            "agent_cpu_pct_mean": statistics.fmean(cpu),
            "agent_cpu_pct_max": max(cpu),
            "etcd_cpu_pct": self.idle_etcd_cpu_pct,
            **self.idle_etcd.per_agent_second(per),
            "gossip_bytes_sent_per_s_per_agent": (
                None if self.idle_gossip_bytes is None else self.idle_gossip_bytes / per),
            "rss_mb_median": statistics.median(self.idle_rss_mb) if self.idle_rss_mb else 0.0,
        }


def _wait_for_members(env: dict[str, str], n: int) -> None:
    def all_there() -> bool:
        out = _cli(["nodes", "--json"], env, QUERY_TIMEOUT_S)
        return out.returncode == 0 and len(json.loads(out.stdout or "[]")) >= n

    wait_for(all_there, MEMBERS_TIMEOUT_S, f"{n} agents in `hypermesh nodes`", interval=0.5)


def _leader_name(env: dict[str, str]) -> str | None:
    out = _cli(["nodes", "--json"], env, QUERY_TIMEOUT_S)
    if out.returncode != 0:
        return None
    for node in json.loads(out.stdout or "[]"):
        if node.get("leader"):
            return str(node.get("name"))
    return None


def run_mesh(args: argparse.Namespace, log: Any) -> MeshResult:
    with tempfile.TemporaryDirectory(prefix="hm-bench-scale-") as tmp:
        root = Path(tmp)
        recipe = root / "scale.yaml"
        recipe.write_text(recipe_text(args.tasks, block=args.block))
        mesh = LocalMesh(root / "mesh", agents=args.agents, slots=args.slots, fsync=False,
                         agent_args=["--preset", args.preset, "--watch", args.watch],
                         etcd_members=args.etcd_members)
        started = time.perf_counter()
        try:
            mesh.start()
            env = {**os.environ, **mesh.env()}
            _wait_for_leader(env)
            _wait_for_members(env, args.agents)
            print(f"  {args.agents} agents up in {time.perf_counter() - started:.1f}s",
                  file=log, flush=True)
            time.sleep(args.settle)
            return _measure_mesh(args, mesh, env, recipe, log)
        finally:
            # SIGTERM every agent at once (each drains), then close() reaps them and etcd.
            procs = []
            for a in mesh.agents:
                if a.proc is not None:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        procs.append(psutil.Process(a.proc.pid))
            stop_all(procs, timeout=30)
            mesh.close()


def _measure_mesh(
    args: argparse.Namespace, mesh: LocalMesh, env: dict[str, str], recipe: Path, log: Any
) -> MeshResult:
    names = [a.name for a in mesh.agents]
    pids = [a.proc.pid if a.proc else -1 for a in mesh.agents]
    leader = _leader_name(env)

    def cpu() -> list[tuple[float, float]]:
        return [proc_cpu(pid) for pid in pids]

    if args.flush_rate is not None:
        done = _cli(["settings", f"flush-rate={args.flush_rate}"], env, 60)
        if done.returncode:
            raise BenchError(f"settings flush-rate exited {done.returncode}: {done.stderr}")
    ports = agent_ports(mesh)
    g0 = tcp_bytes_by_local_port(ports)
    m0, a0, e0, c0 = cluster_metrics(mesh), cpu(), cluster_cpu(mesh), children_cpu()
    start = time.perf_counter()
    try:
        done = _cli(["submit", str(recipe), "--wait"], env, SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"submit --wait ran past {SUBMIT_TIMEOUT_S:g}s") from exc
    wall = time.perf_counter() - start
    a1, e1, c1, m1 = cpu(), cluster_cpu(mesh), children_cpu(), cluster_metrics(mesh)
    g1 = tcp_bytes_by_local_port(ports)
    if done.returncode != 0:
        raise BenchError(f"submit --wait exited {done.returncode}: {done.stderr[-2000:]}\n"
                         f"agent log tail:\n{mesh.agents[0].log_tail()}")
    print(f"  submit --wait: {wall:.2f}s, {args.tasks / wall:.1f} tasks/s", file=log,
          flush=True)
    wid = done.stdout.split()[-1]
    try:  # checks every task succeeded; on an overloaded machine the listing may time out
        listed = _cli(["tasks", wid, "--json"], env, LIST_TIMEOUT_S)
        if listed.returncode != 0:
            raise BenchError(f"tasks {wid} --json exited {listed.returncode}: {listed.stderr}")
        listing = json.loads(listed.stdout)
        span = agent_span(listing, args.tasks)
        gaps = slot_gaps(listing, args.slots)
    except subprocess.TimeoutExpired:
        print(f"  `tasks {wid} --json` timed out: agent-side span not measured "
              "(submit --wait did report success)", file=log, flush=True)
        span, gaps = float("nan"), []
    own = [b[0] - a[0] for a, b in zip(a0, a1, strict=True)]
    result = MeshResult(
        agents=args.agents, slots=args.slots, tasks=args.tasks, wall_s=wall,
        agent_span_s=span, agents_cpu_s=sum(own),
        leader_cpu_s=sum(c for n, c in zip(names, own, strict=True) if n == leader),
        tasks_cpu_s=sum(b[1] - a[1] for a, b in zip(a0, a1, strict=True)),
        etcd_cpu_s=e1 - e0, cli_cpu_s=c1 - c0, etcd=EtcdDelta.between(m0, m1),
        gap_p50_s=quantile(gaps, 0.5), gap_p99_s=quantile(gaps, 0.99),
        gap_max_s=max(gaps, default=float("nan")),
        peer_bytes=tcp_delta(g0, g1) if (g0 or g1) else float("nan"),
    )
    print(f"  per task: {json.dumps({k: round(v, 4) for k, v in result.per_task().items()})}",
          file=log, flush=True)
    if args.idle_seconds > 0:
        _measure_idle(args, mesh, result, log)
    result.leases_lost = lease_losses(mesh)
    return result


def _measure_idle(args: argparse.Namespace, mesh: LocalMesh, result: MeshResult,
                  log: Any) -> None:
    print(f"  idle phase: {args.settle:g}s settle, {args.idle_seconds:g}s measured",
          file=log, flush=True)
    time.sleep(args.settle)
    pids = [a.proc.pid if a.proc else -1 for a in mesh.agents]
    ports = agent_ports(mesh)
    t0 = time.perf_counter()
    m0, e0, g0 = cluster_metrics(mesh), cluster_cpu(mesh), tcp_bytes_by_local_port(ports)
    a0 = [proc_cpu(pid)[0] for pid in pids]
    time.sleep(args.idle_seconds)
    a1 = [proc_cpu(pid)[0] for pid in pids]
    m1, e1, g1 = cluster_metrics(mesh), cluster_cpu(mesh), tcp_bytes_by_local_port(ports)
    secs = time.perf_counter() - t0
    result.idle_s = secs
    result.idle_agent_cpu_pct = [100 * (b - a) / secs for a, b in zip(a0, a1, strict=True)]
    result.idle_etcd_cpu_pct = 100 * (e1 - e0) / secs
    result.idle_etcd = EtcdDelta.between(m0, m1)
    result.idle_gossip_bytes = tcp_delta(g0, g1) if (g0 or g1) else None
    rss = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            rss.append(psutil.Process(pid).memory_info().rss / 2**20)
    result.idle_rss_mb = rss


def print_mesh(rounds: list[MeshResult], log: Any) -> dict[str, Any]:
    per = [r.per_task() for r in rounds]
    idle = [r.idle() for r in rounds if r.idle()]
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    print(file=log)
    print(f"per task (median of {len(rounds)} round(s)), {rounds[0].agents} agents x "
          f"{rounds[0].slots} slots, {rounds[0].tasks} tasks:", file=log)
    rows = [
        ("tasks/s end to end", "tasks_per_s", "{:.1f}"),
        ("tasks/s agent side", "agent_side_tasks_per_s", "{:.1f}"),
        ("agents' CPU, summed (ms)", "agents_cpu_ms", "{:.3f}"),
        ("  of which the leader (ms)", "leader_cpu_ms", "{:.3f}"),
        ("  the followers (ms)", "followers_cpu_ms", "{:.3f}"),
        ("etcd CPU (ms)", "etcd_cpu_ms", "{:.3f}"),
        ("submit CLI CPU (ms)", "cli_cpu_ms", "{:.3f}"),
        *ETCD_TASK_ROWS,
        ("slot gap p50 (ms)", "gap_p50_ms", "{:.1f}"),
        ("slot gap p99 (ms)", "gap_p99_ms", "{:.1f}"),
        ("slot gap max (ms)", "gap_max_ms", "{:.1f}"),
        ("leases lost (per round)", "leases_lost", "{:.0f}"),
        ("agent-to-agent bytes (gossip)", "peer_bytes", "{:.0f}"),
    ]
    print_rows(rows, med, log)
    idle_med: dict[str, float | None] = {}
    if idle:
        for k in idle[0]:
            vals = [i[k] for i in idle if i[k] is not None]
            idle_med[k] = statistics.median(v for v in vals if v is not None) if vals else None
        print(f"idle ({rounds[-1].idle_s:.0f}s), per agent:", file=log)
        print_rows([
            ("CPU, % of a core (median)", "agent_cpu_pct_median", "{:.2f}"),
            ("CPU, % of a core (mean)", "agent_cpu_pct_mean", "{:.2f}"),
            ("CPU, % of a core (max)", "agent_cpu_pct_max", "{:.2f}"),
            *ETCD_IDLE_ROWS,
            ("gossip bytes sent /s", "gossip_bytes_sent_per_s_per_agent", "{:.0f}"),
            ("RSS MB (median)", "rss_mb_median", "{:.1f}"),
        ], idle_med, log)
        print(f"  {'etcd CPU, % of a core':<32}{idle_med['etcd_cpu_pct'] or 0:>14.2f}",
              file=log)
    return {
        "per_task_median": med,
        "idle_median": idle_med,
        "rounds": [asdict(r) | {"per_task": r.per_task(), "idle": r.idle()} for r in rounds],
    }


def cmd_mesh(args: argparse.Namespace) -> int:
    log = sys.stderr if args.json else sys.stdout
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    print(f"command: {command}", file=log)
    print(f"{args.agents} agents x {args.slots} slots, {args.tasks} tasks, {args.rounds} "
          f"round(s), preset {args.preset}, etcd fsync OFF", file=log, flush=True)
    rounds = []
    try:
        for i in range(1, args.rounds + 1):
            print(f"round {i}:", file=log, flush=True)
            rounds.append(run_mesh(args, log))
    except (BenchError, TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench_scale: {exc}", file=sys.stderr)
        return 1
    summary = print_mesh(rounds, log)
    if args.json:
        print(json.dumps({"command": command, "agents": args.agents, "slots": args.slots,
                          "tasks": args.tasks, "preset": args.preset, "machine": machine(),
                          **summary}, indent=2, default=str))
    return 0


# ---------------------------------------------------------------- compare


def parse_shape(text: str) -> tuple[int, int]:
    """``"32x1"`` -> (32 agents, 1 slot each); ValueError naming what is wrong."""
    agents, sep, slots = text.lower().partition("x")
    if not sep or not agents.isdigit() or not slots.isdigit():
        raise ValueError(f"a mesh shape is AGENTSxSLOTS, like 32x1; got {text!r}")
    if int(agents) < 1 or int(slots) < 1:
        raise ValueError(f"a mesh shape needs at least 1 agent and 1 slot; got {text!r}")
    return int(agents), int(slots)


def pair_order(pair: int) -> tuple[str, str]:
    """Which shape runs first in pair ``pair`` (0-based): A B, then B A, and so on."""
    return ("a", "b") if pair % 2 == 0 else ("b", "a")


def summarize_pairs(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """The medians of A's and B's figure over ``pairs`` of (A, B), the median of the
    pairs' ratios B/A and the ratio of the medians."""
    a = statistics.median(p[0] for p in pairs)
    b = statistics.median(p[1] for p in pairs)
    return {"a_median": a, "b_median": b,
            "ratio_median": statistics.median(p[1] / p[0] for p in pairs),
            "ratio_of_medians": b / a}


def cmd_compare(args: argparse.Namespace) -> int:
    log = sys.stderr if args.json else sys.stdout
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    shapes = {"a": args.a, "b": args.b}
    print(f"command: {command}", file=log)
    print(f"A = {args.a[0]} x {args.a[1]}, B = {args.b[0]} x {args.b[1]}, {args.pairs} "
          f"pair(s), {args.tasks} tasks, watch {args.watch}, etcd fsync OFF", file=log,
          flush=True)
    results: list[dict[str, MeshResult]] = []
    try:
        for pair in range(args.pairs):
            results.append({})
            for which in pair_order(pair):
                agents, slots = shapes[which]
                print(f"pair {pair + 1}, {which.upper()} ({agents} x {slots}):", file=log,
                      flush=True)
                run_args = argparse.Namespace(**{**vars(args), "agents": agents,
                                                 "slots": slots, "idle_seconds": 0.0})
                results[-1][which] = run_mesh(run_args, log)
    except (BenchError, TimeoutError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench_scale: {exc}", file=sys.stderr)
        return 1
    cpu = [(r["a"].per_task()["agents_cpu_ms"], r["b"].per_task()["agents_cpu_ms"])
           for r in results]
    print(file=log)
    print(f"{'pair':>4} {'A tasks/s':>10} {'A CPU ms':>9} {'B tasks/s':>10} {'B CPU ms':>9} "
          f"{'B/A':>6}", file=log)
    for i, r in enumerate(results):
        a, b = r["a"].per_task(), r["b"].per_task()
        print(f"{i + 1:>4} {a['tasks_per_s']:>10.1f} {a['agents_cpu_ms']:>9.3f} "
              f"{b['tasks_per_s']:>10.1f} {b['agents_cpu_ms']:>9.3f} "
              f"{b['agents_cpu_ms'] / a['agents_cpu_ms']:>6.2f}", file=log)
    summary = summarize_pairs(cpu)
    print(f"agents' CPU per task: A {summary['a_median']:.3f} ms, B {summary['b_median']:.3f}"
          f" ms (medians); B/A: median of the pairs' ratios {summary['ratio_median']:.2f}, "
          f"ratio of the medians {summary['ratio_of_medians']:.2f}", file=log)
    if args.json:
        print(json.dumps({
            "command": command, "a": list(args.a), "b": list(args.b), "tasks": args.tasks,
            "machine": machine(), "agents_cpu_ms": summary,
            "pairs": [{w: asdict(r[w]) | {"per_task": r[w].per_task()} for w in "ab"}
                      for r in results],
        }, indent=2, default=str))
    return 0


# ---------------------------------------------------------------- watchers


PREFIX = b"/bench-scale/watch/"


async def _watch_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from etcd3aio import Etcd3Client
    from etcd3aio.kv import prefix_range_end

    endpoint = url.removeprefix("http://")
    clients = [Etcd3Client([endpoint]) for _ in range(args.connections)]
    writer = Etcd3Client([endpoint])
    for c in [*clients, writer]:
        await c.connect()
    latencies: list[float] = []
    created = 0
    delivered = 0
    all_created = asyncio.Event()
    end = prefix_range_end(PREFIX)

    async def watcher(client: Etcd3Client) -> None:
        nonlocal created, delivered
        assert client.watch is not None
        async for resp in client.watch.watch(PREFIX, end):
            if resp.created:
                created += 1
                if created == args.watchers:
                    all_created.set()
            now = time.perf_counter_ns()
            for ev in resp.events:
                latencies.append((now - int(ev.kv.value)) / 1e6)
                delivered += 1

    tasks = [asyncio.create_task(watcher(clients[i % len(clients)]))
             for i in range(args.watchers)]
    me = psutil.Process()
    try:
        await asyncio.wait_for(all_created.wait(), 120)
        await asyncio.sleep(1.0)
        m0, e0 = etcd_metrics(url), proc_cpu(_etcd_pid)[0]
        c0 = me.cpu_times()
        t0 = time.perf_counter()
        assert writer.kv is not None
        for i in range(args.writes):
            due = t0 + i / args.rate
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await writer.kv.put(PREFIX + b"%08d" % i, str(time.perf_counter_ns()).encode())
        wanted = args.writes * args.watchers
        deadline = time.perf_counter() + DELIVERY_TIMEOUT_S
        while delivered < wanted and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        secs = time.perf_counter() - t0
        m1, e1 = etcd_metrics(url), proc_cpu(_etcd_pid)[0]
        c1 = me.cpu_times()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in [*clients, writer]:
            with contextlib.suppress(Exception):
                await c.close()
    delta = EtcdDelta.between(m0, m1)
    k = args.writes
    lat = sorted(latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    return {
        "watchers": args.watchers,
        "connections": args.connections,
        "writes": k,
        "rate_per_s": args.rate,
        "seconds": secs,
        "delivered": delivered,
        "expected": wanted,
        "etcd_cpu_ms_per_write": 1e3 * (e1 - e0) / k,
        "events_per_write": delta.events / k,
        "watch_msgs_per_write": delta.watch_msgs / k,
        "etcd_sent_bytes_per_write": delta.sent_bytes / k,
        "watcher_process_cpu_ms_per_write": 1e3 * ((c1.user + c1.system)
                                                   - (c0.user + c0.system)) / k,
        "latency_ms_p50": pct(0.50),
        "latency_ms_p99": pct(0.99),
        "latency_ms_max": lat[-1] if lat else float("nan"),
    }


_etcd_pid = -1


def cmd_watchers(args: argparse.Namespace) -> int:
    global _etcd_pid
    log = sys.stderr if args.json else sys.stdout
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    print(f"command: {command}", file=log)
    print(f"{args.watchers} watch streams on one prefix over {args.connections} channel(s), "
          f"{args.writes} puts at {args.rate:g}/s from a separate channel, etcd fsync OFF",
          file=log, flush=True)
    with tempfile.TemporaryDirectory(prefix="hm-bench-watch-") as tmp:
        etcd = EtcdServer(Path(tmp), fsync=False)
        try:
            etcd.start()
            _etcd_pid = etcd.proc.pid if etcd.proc else -1
            out = asyncio.run(_watch_load(etcd.url, args))
        except (TimeoutError, RuntimeError) as exc:
            print(f"bench_scale: {exc}", file=sys.stderr)
            return 1
        finally:
            etcd.stop()
    for key, value in out.items():
        print(f"  {key:<36}{value:>14.3f}" if isinstance(value, float) else
              f"  {key:<36}{value:>14}", file=log)
    if out["delivered"] < out["expected"]:
        print(f"bench_scale: only {out['delivered']} of {out['expected']} events arrived",
              file=sys.stderr)
    if args.json:
        print(json.dumps({"command": command, "machine": machine(), **out}, indent=2))
    return 0 if out["delivered"] >= out["expected"] else 1


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mesh", help="N real agents on one etcd: per-task and idle costs")
    m.add_argument("--agents", type=int, required=True)
    m.add_argument("--slots", type=int, default=1, help="slots per agent [1]")
    m.add_argument("--tasks", type=int, default=4000, help="trivial tasks per round [4000]")
    m.add_argument("--rounds", type=int, default=1, help="rounds, each a fresh mesh [1]")
    m.add_argument("--idle-seconds", type=float, default=20.0,
                   help="idle phase after each run; 0 skips it [20]")
    m.add_argument("--settle", type=float, default=5.0,
                   help="seconds to wait before the run and before the idle phase [5]")
    m.add_argument("--preset", choices=("lan", "local"), default="lan",
                   help="the agents' timing preset [lan]")
    m.add_argument("--etcd-members", type=int, default=1,
                   help="etcd members: 1, or a cluster of 3 or 5 on loopback [1]")
    m.add_argument("--watch", choices=("all", "own", "auto"), default="all",
                   help="the agents' --watch: own = blocks from the leader's offers; "
                   "auto = own past the mesh's watch-all seats [all]")
    m.add_argument("--block", type=int, default=None,
                   help="the recipe's batch (tasks per block) [automatic]")
    m.add_argument("--flush-rate", type=int, default=None,
                   help="the mesh setting flush-rate, set before the submit [its default]")
    m.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    c = sub.add_parser("compare", help="two mesh shapes in alternating pairs: CPU per task "
                       "and its ratio")

    def shape(text: str) -> tuple[int, int]:
        try:
            return parse_shape(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    c.add_argument("--a", type=shape, required=True, help="the baseline shape, e.g. 4x4")
    c.add_argument("--b", type=shape, required=True, help="the shape compared, e.g. 32x1")
    c.add_argument("--pairs", type=int, default=5, help="pairs of runs [5]")
    c.add_argument("--tasks", type=int, default=4000, help="trivial tasks per run [4000]")
    c.add_argument("--settle", type=float, default=3.0,
                   help="seconds to wait before each run [3]")
    c.add_argument("--preset", choices=("lan", "local"), default="lan")
    c.add_argument("--etcd-members", type=int, default=1)
    c.add_argument("--watch", choices=("all", "own", "auto"), default="own",
                   help="the agents' --watch [own]")
    c.add_argument("--block", type=int, default=None)
    c.add_argument("--flush-rate", type=int, default=None)
    c.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    w = sub.add_parser("watchers", help="etcd alone: watch fan-out to W watchers")
    w.add_argument("--watchers", type=int, required=True)
    w.add_argument("--writes", type=int, default=200, help="puts under the prefix [200]")
    w.add_argument("--connections", type=int, default=4,
                   help="client channels the watch streams share [4]")
    w.add_argument("--rate", type=float, default=10.0, help="puts per second [10]")
    w.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    checks = {
        "mesh": (("agents", 1), ("slots", 1), ("tasks", 1), ("rounds", 1)),
        "compare": (("pairs", 1), ("tasks", 1)),
        "watchers": (("watchers", 1), ("writes", 1), ("connections", 1)),
    }[args.cmd]
    for name, low in checks:
        if getattr(args, name) < low:
            p.error(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.cmd == "watchers" and args.rate <= 0:
        p.error(f"--rate must be positive, got {args.rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return {"mesh": cmd_mesh, "compare": cmd_compare, "watchers": cmd_watchers}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
