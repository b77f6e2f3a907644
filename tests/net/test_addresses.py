"""Agents reached at an address other than the one they listen on (``--advertise``), by
name as well as by IP, and an agent that comes back at a new address, across hosts in
network namespaces (``hypermesh/local/netns.py``; plaintext, ``--insecure``).

A name is given to a host by a hosts file for the namespaces of the lab: ``ip netns
exec NS`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts`` when it exists, so
every process run in the lab (agents, the CLI) resolves it; the files are removed when
the test ends.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hypermesh.local.netns import AGENT_PORT, HOST_IF, NetLab, NetMesh, ip
from hypermesh.local.processes import wait_for

AGENTS = ("onprem", "cloud-a", "cloud-b")
NETNS_ETC = Path("/etc/netns")

# Six tasks of 3 s on three agents of two slots: every agent runs two of them.
SPREAD_RECIPE = """\
experiments:
  spread:
    samples: 6
    command: ['echo "ran on $HM_NODE"; sleep 3']
"""

POOL_RECIPE = """\
experiments:
  there:
    samples: 2
    pools: [{pool}]
    command: ['echo "ran on $HM_NODE"']
"""


@pytest.fixture
def name_hosts(lab: NetLab) -> Iterator[Callable[[dict[str, str]], None]]:
    """``name_hosts({name: ip})`` gives every host of the lab (and those added later are
    not covered: add them first) a hosts file with those names; removed at the end."""
    made: list[Path] = []
    made_root = not NETNS_ETC.exists()

    def give(names: dict[str, str]) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        lines += [f"{address} {name}" for name, address in names.items()]
        for host in lab.hosts.values():
            folder = NETNS_ETC / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")
            made.append(folder)

    try:
        yield give
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()  # only if empty: another lab may use it


def nodes(mesh: NetMesh, via: str | None = None) -> dict[str, dict[str, Any]]:
    args = ("nodes", "--via", via) if via else ("nodes",)
    return {n["name"]: n for n in mesh.hm_json(*args)}


def seen_alive_at(mesh: NetMesh, addresses: dict[str, str]) -> bool:
    """Whether every agent's gossip view lists each node alive at its address, and etcd
    lists it at that address too."""
    for viewer in mesh.agents:
        try:
            rows = nodes(mesh, via=viewer)
        except RuntimeError:  # the viewer is not registered (yet)
            return False
        for name, address in addresses.items():
            row = rows.get(name)
            if row is None or row["address"] != address or row["gossip"] != "alive":
                return False
            if row["gossip_address"] != address:
                return False
    return True


def run_workflow(mesh: NetMesh, recipe_text: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Submit ``recipe_text``, wait for it to succeed; its tasks."""
    recipe = mesh.root / f"wf-{secrets.token_hex(3)}.yaml"
    recipe.write_text(recipe_text)
    wid = mesh.submit(recipe)

    def finished() -> str | None:
        state: str = mesh.hm_json("status", wid)["state"]
        return state if state in ("succeeded", "failed", "cancelled") else None

    assert wait_for(finished, timeout, f"workflow {wid} to finish", interval=0.5) == "succeeded"
    tasks: list[dict[str, Any]] = mesh.hm_json("tasks", wid)
    return tasks


def log_of(mesh: NetMesh, task: dict[str, Any]) -> str:
    """A task's log, which the CLI streams from the node that ran it (at the address
    that node registered: there is no store to fall back to here)."""
    result = mesh.hm("logs", str(task["id"]), "--json")
    assert result.returncode == 0, result.stderr
    text: str = json.loads(result.stdout)["text"]
    return text


def test_wildcard_listen_with_an_advertised_ip_and_name(
    net_mesh: NetMesh, name_hosts: Callable[[dict[str, str]], None]
) -> None:
    lab = net_mesh.lab
    for name in AGENTS:
        lab.add_host(name)
    name = "cloud-b.mesh.test"
    name_hosts({name: lab.address("cloud-b")})
    wildcard = f"0.0.0.0:{AGENT_PORT}"
    net_mesh.add_agent("onprem")
    net_mesh.add_agent("cloud-a", extra=["--listen", wildcard, "--advertise",
                                         f"{lab.address('cloud-a')}:{AGENT_PORT}"])
    net_mesh.add_agent("cloud-b", extra=["--listen", wildcard, "--advertise",
                                         f"{name}:{AGENT_PORT}"])
    expected = {
        "onprem": f"{lab.address('onprem')}:{AGENT_PORT}",
        "cloud-a": f"{lab.address('cloud-a')}:{AGENT_PORT}",
        "cloud-b": f"{name}:{AGENT_PORT}",
    }
    # etcd and every agent's gossip hold the advertised addresses, and every agent
    # hears every other alive there: they reached each other at those addresses.
    wait_for(lambda: seen_alive_at(net_mesh, expected), 45, "everyone alive where advertised",
             interval=0.5)
    # The CLI reaches each at its advertised address (telemetry comes over gRPC; null
    # until a node's first sample).
    wait_for(lambda: all(r["telemetry"] is not None for r in nodes(net_mesh).values()), 30,
             "every node's telemetry", interval=0.5)
    assert "started at cloud-b.mesh.test:7070 (listening on 0.0.0.0:7070)" in (
        net_mesh.agents["cloud-b"].log_tail(20_000))

    tasks = run_workflow(net_mesh, SPREAD_RECIPE)
    assert all(t["state"] == "succeeded" for t in tasks)
    assert {t["node"] for t in tasks} == set(AGENTS)
    for task in tasks:  # each log read from its node, cloud-b's by name
        assert f"ran on {task['node']}" in log_of(net_mesh, task)


def test_an_agent_back_at_a_new_address(net_mesh: NetMesh) -> None:
    """A spot machine comes back under its name with a new IP: etcd, every peer's gossip
    and the scheduler follow it there."""
    lab = net_mesh.lab
    for name in AGENTS:
        net_mesh.add_agent(name)
    old = {n: f"{lab.address(n)}:{AGENT_PORT}" for n in AGENTS}
    wait_for(lambda: seen_alive_at(net_mesh, old), 30, "everyone alive", interval=0.5)

    net_mesh.agents["cloud-b"].kill()  # the machine is gone, no drain
    wait_for(lambda: "cloud-b" not in nodes(net_mesh), 30, "cloud-b's lease to end",
             interval=0.5)
    ns = lab.hosts["cloud-b"].ns
    new_ip = f"{lab.subnet}.200"
    ip("-n", ns, "addr", "del", f"{lab.address('cloud-b')}/24", "dev", HOST_IF)
    ip("-n", ns, "addr", "add", f"{new_ip}/24", "dev", HOST_IF)
    net_mesh.add_agent("cloud-b", extra=["--listen", f"{new_ip}:{AGENT_PORT}",
                                         "--pool", "moved"])

    now = dict(old, **{"cloud-b": f"{new_ip}:{AGENT_PORT}"})
    wait_for(lambda: seen_alive_at(net_mesh, now), 45, "cloud-b alive at its new address",
             interval=0.5)
    # Only the moved node is in pool "moved": the tasks run there, and their logs are
    # read from it at its new address.
    tasks = run_workflow(net_mesh, POOL_RECIPE.format(pool="moved"))
    assert {t["node"] for t in tasks} == {"cloud-b"}
    assert all(t["state"] == "succeeded" for t in tasks)
    for task in tasks:
        assert "ran on cloud-b" in log_of(net_mesh, task)


def test_an_agent_back_at_once_at_a_new_address(net_mesh: NetMesh) -> None:
    """The same, but back before its peers have declared its old life dead: the verdict
    on the old life (at the old address) must not cost the new one its lease."""
    lab = net_mesh.lab
    for name in AGENTS:
        net_mesh.add_agent(name)
    old = {n: f"{lab.address(n)}:{AGENT_PORT}" for n in AGENTS}
    wait_for(lambda: seen_alive_at(net_mesh, old), 30, "everyone alive", interval=0.5)

    ns = lab.hosts["cloud-b"].ns
    new_ip = f"{lab.subnet}.201"
    # The old address goes silent first (nothing answers there, not even a refusal),
    # as a reclaimed machine's does: its peers suspect it, and no verdict comes before
    # the new life registers.
    ip("-n", ns, "addr", "del", f"{lab.address('cloud-b')}/24", "dev", HOST_IF)
    net_mesh.agents["cloud-b"].kill()
    ip("-n", ns, "addr", "add", f"{new_ip}/24", "dev", HOST_IF)
    back = net_mesh.add_agent("cloud-b", extra=["--listen", f"{new_ip}:{AGENT_PORT}"])
    now = dict(old, **{"cloud-b": f"{new_ip}:{AGENT_PORT}"})
    wait_for(lambda: seen_alive_at(net_mesh, now), 45, "cloud-b alive at its new address",
             interval=0.5)
    tasks = run_workflow(net_mesh, SPREAD_RECIPE)
    assert {t["node"] for t in tasks} == set(AGENTS)
    assert "lost lease" not in back.log_tail(100_000), back.log_tail()
