"""A real mesh across hosts: etcd, a CLI host and three agents in network namespaces of
their own, each agent listening on its own address, plaintext (``--insecure``), lease TTL
3 s (the ``local`` preset). One agent holding running tasks of 6 s is cut off; its
tasks must run again elsewhere, none lost, none succeeding twice, and it rejoins after
the heal. The measured times are printed (``pytest -s``); docs/architecture.md gives
them per scenario.
"""

from __future__ import annotations

import dataclasses

import pytest

from hypermesh.local.netns import NetMesh, RoundResult, partition_round
from hypermesh.local.processes import wait_for

AGENTS = ("onprem", "cloud-a", "cloud-b")
LEASE_TTL = 3.0  # the local preset's

RECIPE = """\
experiments:
  prep:
    samples: 4
    command: ['echo "$HM_NODE" > "$HM_ATTEMPT_DIR/node"']
  train:
    after: [prep]
    samples: 6
    command: ['sleep 1']
"""


@pytest.fixture
def three(net_mesh: NetMesh) -> NetMesh:
    for name in AGENTS:
        net_mesh.add_agent(name, slots=2)
    return net_mesh


def report(result: RoundResult) -> None:
    fields = dataclasses.asdict(result)
    fields.pop("log")
    print(f"\n{result.scenario}: {fields}")


def test_workflow_runs_across_hosts(three: NetMesh) -> None:
    nodes = {n["name"]: n for n in three.hm_json("nodes")}
    assert set(nodes) == set(AGENTS)
    for name in AGENTS:  # each agent is reached on its own host's address
        assert nodes[name]["address"] == f"{three.lab.address(name)}:7070"
        assert nodes[name]["gossip"] == "alive"
    recipe = three.root / "wf.yaml"
    recipe.write_text(RECIPE)
    wid = three.submit(recipe)

    def finished() -> str | None:
        state: str = three.hm_json("status", wid)["state"]
        return state if state in ("succeeded", "failed") else None

    assert wait_for(finished, 60, f"workflow {wid} to finish", interval=0.5) == "succeeded"
    tasks = three.hm_json("tasks", wid)
    assert len(tasks) == 10
    assert all(t["state"] == "succeeded" for t in tasks)
    assert len({t["node"] for t in tasks}) >= 2  # spread


def check_round(result: RoundResult) -> None:
    report(result)
    assert not result.lost, f"tasks lost: {result.lost}"
    assert not result.doubled, f"tasks that succeeded twice: {result.doubled}"
    assert not result.kept and set(result.moved) == set(result.held)
    # The bar: its tasks run again elsewhere within the lease TTL + 2 s.
    assert max(result.moved.values()) <= LEASE_TTL + 2, result.moved
    # Measured here 5.0-5.4 s against the TTL + 3 s (6 s): asserted with a
    # second of room for a loaded 2-core machine.
    assert result.stopped is not None and result.stopped <= LEASE_TTL + 4, result.stopped
    assert result.rejoined is not None, "the agent did not rejoin after the heal"


def test_host_cut_off_entirely(three: NetMesh) -> None:
    check_round(partition_round(three, "whole"))


def test_host_cut_from_etcd_only(three: NetMesh) -> None:
    result = partition_round(three, "etcd")
    check_round(result)
    # It gave its lease up and stopped its tasks before a peer revoked the lease for
    # it (gossip still reaches it): no moment with two attempts of a task running.
    assert any(f"{result.victim} (gave up)" in r for r in result.revokes), result.revokes
    assert result.stopped is not None
    assert result.stopped <= min(result.moved.values()) + 0.1, (result.stopped, result.moved)
