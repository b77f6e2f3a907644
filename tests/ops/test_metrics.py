"""Prometheus metrics: families from a snapshot (pure), and scrapes of real agents
parsed with the Prometheus parser after real workflows."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypermesh.agent.ops.gpus import GpuSample
from hypermesh.agent.ops.metrics import Snapshot, count_attempts, exposition
from hypermesh.agent.ops.usage import NodeSample, TaskUsage
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.processes import wait_for
from hypermesh.state.records import Attempt
from tests.conftest import Mesh, task_pid
from tests.tasks.test_data_tasks import _dataset  # toy: big.bin (3 MiB) and a small file

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample as {(name, sorted labels without 'node'): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "node"))
            out[(s.name, labels)] = s.value
    return out


def scrape(address: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


def test_count_attempts() -> None:
    snap = Snapshot(node="b")
    count_attempts(
        snap,
        [
            {1: Attempt(1, "a", "failed", None, "node-lost"), 2: Attempt(2, "b", "succeeded",
                                                                          0, "exit")},
            {1: Attempt(1, "b", "failed", 1, "exit"), 2: Attempt(2, "b", "running")},
            {1: Attempt(1, "b", "failed", None, "preempted"), 2: Attempt(2, "b", "running")},
            {1: Attempt(1, "a", "succeeded", 0, "exit")},
        ],
    )
    assert snap.node_attempts == Counter(
        {("succeeded", "exit"): 1, ("failed", "exit"): 1, ("running", ""): 2,
         ("failed", "preempted"): 1}
    )
    assert snap.node_recoveries == 2  # took over after node-lost and after preempted
    assert snap.mesh_lost_attempts == Counter({"node-lost": 1, "preempted": 1})


def test_exposition_of_a_snapshot() -> None:
    snap = Snapshot(
        node="n1",
        slots=4,
        running=1,
        tasks_by_state=Counter({"succeeded": 3, "running": 1}),
        gossip_members=Counter({"alive": 2, "suspect": 1}),
        mounts={
            "toy@v1": {
                "reads": {
                    "blocks": {"cache": 5, "peer": 0, "store": 2},
                    "bytes": {"cache": 5 << 20, "peer": 0, "store": 2 << 20},
                    "store_bytes": 2 << 20,
                    "store_gets": 3,
                },
                "cache": {"bytes": 7 << 20, "max_bytes": 1 << 30},
            }
        },
        nvml=True,
        telemetry=NodeSample(
            1.0, 37.5, 0.5, 1, 2, 3, 4, 0.0, 0.0, 10.0, 20.0, 0.4, 99,
            gpus=(GpuSample(0, "A100", None, 5, 10, 40.0),),
        ),
        task_usage=[TaskUsage("w.e.0", 2, 3, 150.0, 1000, 5)],
    )
    m = parse(exposition(snap).decode())
    assert m[("hypermesh_mesh_tasks", (("state", "succeeded"),))] == 3
    assert m[("hypermesh_gossip_members", (("state", "suspect"),))] == 1
    assert m[("hypermesh_gossip_members", (("state", "dead"),))] == 0
    ds = ("dataset", "toy@v1")
    assert m[("hypermesh_chunkfs_read_blocks_total", (ds, ("source", "cache")))] == 5
    assert m[("hypermesh_chunkfs_read_bytes_total", (ds, ("source", "store")))] == 2 << 20
    assert m[("hypermesh_chunkfs_store_bytes_total", (ds,))] == 2 << 20
    assert m[("hypermesh_chunkfs_cache_bytes", (ds,))] == 7 << 20
    assert m[("hypermesh_node_cpu_percent", ())] == 37.5
    gpu = (("gpu", "0"), ("name", "A100"))
    assert m[("hypermesh_gpu_temperature_celsius", gpu)] == 40.0
    assert ("hypermesh_gpu_utilization_percent", gpu) not in m  # not reported: absent
    task = (("attempt", "2"), ("task", "w.e.0"))
    assert m[("hypermesh_task_cpu_percent", task)] == 150.0
    assert m[("hypermesh_task_gpu_memory_bytes", task)] == 5
    assert m[("hypermesh_node_nvml", ())] == 1


def test_scrape_after_a_workflow(
    mesh: Mesh, store: S3Store, store_url: str, tmp_path: Path
) -> None:
    _dataset(store, tmp_path)
    agent = mesh.agent("node1", extra=("--store", store_url, "--cache-size", "64MiB"))
    recipe = mesh.write_recipe(
        """
experiments:
  ok:
    samples: 3
    command: ['true']
  bad:
    command: ['exit 3']
  read:
    data: {toy: toy}
    command: ['cat "$HM_DATA/big.bin" > /dev/null']
"""
    )
    wid = mesh.submit(recipe)
    assert mesh.wait_state(wid, {"succeeded", "failed"})["state"] == "failed"
    (node,) = mesh.hm_json("nodes")
    address = node["metrics"]
    assert address == (agent.work_dir / "agent.metrics").read_text().strip()
    m = parse(scrape(address))
    assert m[("hypermesh_mesh_tasks", (("state", "succeeded"),))] == 4
    assert m[("hypermesh_mesh_tasks", (("state", "failed"),))] == 1
    assert m[("hypermesh_mesh_workflows", (("state", "failed"),))] == 1
    attempts = (("reason", "exit"), ("state", "succeeded"))
    assert m[("hypermesh_node_attempts_total", attempts)] == 4
    assert m[("hypermesh_node_attempts_total", (("reason", "exit"), ("state", "failed")))] == 1
    assert m[("hypermesh_node_claims_total", ())] == 5
    assert m[("hypermesh_node_recoveries_total", ())] == 0
    assert m[("hypermesh_node_serving", ())] == 1
    assert m[("hypermesh_node_leader", ())] == 1
    assert m[("hypermesh_node_running_tasks", ())] == 0
    assert m[("hypermesh_gossip_members", (("state", "alive"),))] == 1
    (spec,) = {dict(labels)["dataset"] for name, labels in m
               if name == "hypermesh_chunkfs_store_bytes_total"}
    assert spec == "toy"
    ds = ("dataset", "toy")
    # The cache was cold: every byte of big.bin was fetched from the store, and
    # served straight from the fetch, from the cache a prefetch filled, or stored
    # into the kernel's page cache before the reader asked (not a read at all).
    served = {dict(labels)["source"]: v for (name, labels), v in m.items()
              if name == "hypermesh_chunkfs_read_bytes_total"}
    assert set(served) == {"cache", "peer", "store"}
    assert served["store"] + served["cache"] > 0
    assert m[("hypermesh_chunkfs_store_bytes_total", (ds,))] >= 3 << 20
    assert m[("hypermesh_chunkfs_cache_bytes", (ds,))] >= 3 << 20

    # Node telemetry from the agent's sampler (the first sample may still be due).
    def sampled() -> Samples | None:
        found = parse(scrape(address))
        return found if ("hypermesh_node_memory_total_bytes", ()) in found else None

    t = cast(Samples, wait_for(sampled, 30, "the first telemetry sample in /metrics",
                               interval=0.3))
    total, used = (t[(f"hypermesh_node_memory_{k}_bytes", ())] for k in ("total", "used"))
    assert total > used > 0
    assert 0 <= t[("hypermesh_node_cpu_percent", ())] <= 100
    assert t[("hypermesh_node_agent_rss_bytes", ())] > 10 << 20
    assert t[("hypermesh_node_nvml", ())] in (0, 1)  # no GPU: 0, and not an error


def test_http_edges_and_metrics_off(mesh: Mesh) -> None:
    on = mesh.agent("node1")
    address = (on.work_dir / "agent.metrics").read_text().strip()
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(address, "/nope")
    assert err.value.code == 404
    request = urllib.request.Request(f"http://{address}/metrics", method="HEAD")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200 and reply.read() == b""
    off = mesh.agent("node2", extra=("--metrics-listen", "off"))
    assert not (off.work_dir / "agent.metrics").exists()
    nodes = {n["name"]: n for n in mesh.hm_json("nodes")}
    assert nodes["node2"]["metrics"] is None and nodes["node1"]["metrics"] == address


def test_bad_metrics_address_is_a_usage_error(mesh: Mesh) -> None:
    result = mesh.hm("agent", "start", "--name", "x", "--metrics-listen", "nowhere")
    assert result.returncode == 2
    assert "--metrics-listen 'nowhere': expected HOST:PORT" in result.stderr


def test_metrics_port_in_use_fails_before_registering(mesh: Mesh) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = mesh.hm(
            "agent", "start", "--name", "x", "--listen", "127.0.0.1:0", "--work-dir",
            str(mesh.root / "x"), "--metrics-listen", f"127.0.0.1:{port}", timeout=30,
        )
    assert result.returncode == 1
    assert f"--metrics-listen 127.0.0.1:{port}: cannot listen" in result.stderr
    assert mesh.hm_json("nodes") == []  # it never registered


def test_recovery_is_counted_by_the_node_that_took_over(mesh: Mesh) -> None:
    first = mesh.agent("node1", slots=1)
    recipe = mesh.write_recipe(
        """
experiments:
  long:
    command: ['if [ "$HM_ATTEMPT" = 1 ]; then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120; fi']
"""
    )
    wid = mesh.submit(recipe)
    pid = task_pid(first, f"{wid}.long.0")
    second = mesh.agent("node2", slots=1)
    first.kill()  # the machine died: no drain, no lease revoke
    with contextlib.suppress(ProcessLookupError):  # its lifeline may have been first
        os.kill(pid, signal.SIGKILL)  # and its processes with it
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    m = parse(scrape((second.work_dir / "agent.metrics").read_text().strip()))
    assert m[("hypermesh_node_recoveries_total", ())] == 1
    assert m[("hypermesh_mesh_lost_attempts_total", (("reason", "node-lost"),))] == 1
    assert m[("hypermesh_node_attempts_total", (("reason", "exit"), ("state", "succeeded")))] == 1


def test_a_node_that_watches_its_own_part_counts_the_blocks_it_ran(mesh: Mesh) -> None:
    """``--watch own``: a follower's view has no block, so its attempt figures come from
    its own flushes, and it leaves the mesh-wide families to the leader, whose view is
    whole. A block taken over from a killed holder counts as the taker's recovery."""
    own = ("--watch", "own")
    lead = mesh.agent("node1", slots=1, extra=(*own, "--pool", "lead"))  # runs nothing
    wait_for(lambda: [n["name"] for n in mesh.hm_json("nodes") if n["leader"]] == ["node1"],
             30, "node1 to lead")
    followers = {n: mesh.agent(n, slots=1, extra=own) for n in ("node2", "node3")}
    recipe = mesh.write_recipe(
        """
experiments:
  hold:
    samples: 2
    batch: 2
    pools: [default]
    command:
      - >-
        if [ "$HM_ATTEMPT" = 1 ] && [ {{task_index}} = 0 ];
        then echo $$ > "$HM_ATTEMPT_DIR/pid"; exec sleep 120; fi
"""
    )
    wid = mesh.submit(recipe)

    def holder() -> str | None:
        task = next(t for t in mesh.hm_json("tasks", wid) if t["index"] == 0)
        return task["node"] if task["state"] == "running" else None

    first = followers[cast(str, wait_for(holder, 30, "task 0 to run"))]
    pid = task_pid(first, f"{wid}.hold.0")
    first.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    assert mesh.wait_state(wid, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"
    taker = next(a for n, a in followers.items() if a is not first)
    m = parse(scrape((taker.work_dir / "agent.metrics").read_text().strip()))
    assert m[("hypermesh_node_recoveries_total", ())] == 1
    assert m[("hypermesh_node_attempts_total", (("reason", "exit"), ("state", "succeeded")))] == 2
    assert m[("hypermesh_node_claims_total", ())] == 2
    assert not any(name.startswith("hypermesh_mesh_") for name, _ in m)
    led = parse(scrape((lead.work_dir / "agent.metrics").read_text().strip()))
    assert led[("hypermesh_mesh_tasks", (("state", "succeeded"),))] == 2
    assert led[("hypermesh_mesh_lost_attempts_total", (("reason", "node-lost"),))] == 1
    assert led[("hypermesh_node_claims_total", ())] == 0
