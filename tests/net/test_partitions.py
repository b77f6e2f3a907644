"""A real mesh across hosts: etcd, a CLI host and three agents in network namespaces of
their own, each agent listening on its own address, plaintext (``--insecure``), lease TTL
3 s (the ``local`` preset). One agent holding running tasks of 6 s is cut off; its
tasks must run again elsewhere, none lost, none succeeding twice, and it rejoins after
the heal. The leader's host is cut off the same way, and, on a three-member etcd cluster, the
host of etcd's own leader. The measured times are printed (``pytest -s``);
docs/architecture.md gives them per scenario.
"""

from __future__ import annotations

import dataclasses

import pytest

from hypermesh.local.netns import NetLab, NetMesh
from hypermesh.local.partitions import (
    MemberResult,
    RoundResult,
    leader_round,
    member_round,
    partition_round,
)
from hypermesh.local.processes import wait_for

AGENTS = ("onprem", "cloud-a", "cloud-b")
LEASE_TTL = 3.0  # the local preset's
LEADER_TTL = 5.0  # the local preset's (the lan default: local does not change it)

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


def test_host_cut_from_its_peers_only(three: NetMesh) -> None:
    result = partition_round(three, "peers")
    check_round(result)
    # Its peers' probes failed: the leader revoked its lease, and it rejoined with a new
    # one while still cut off, dead to gossip; the others then pushed-pulled that later
    # life (Gossip._reach_new_lives) rather than wait for a reconnect round to find it.
    assert any("(dead) at" in r and f"-> {result.victim} " in r for r in result.revokes), (
        result.revokes)
    assert any(r.split(" -> ")[1].startswith(f"{result.victim} ") for r in result.reached), (
        result.reached, result.log[-20:])


# -- the leader's host cut off ----------------------------------------------------------


def test_leader_host_cut_off(three: NetMesh) -> None:
    """The leader's host loses its link: the majority side elects another leader within
    the leader TTL + 1 s; the old one stops leading first (it gives its node lease up,
    and a node without its lease runs no leader round), a workflow running across the
    cut loses no task and runs none twice, and after the heal the old leader is a
    follower."""
    r = leader_round(three)

    def at(t: float | None) -> str:
        return "never" if t is None else f"{t:+.2f}s"

    calls = ", ".join(f"+{a:.1f}..+{b:.1f}s: {who}" for a, b, who in r.polls)
    print(f"\nleader cut: {r.old} -> {r.new}: elected at {at(r.elected)} (watcher); "
          f"`nodes` calls from the cut: {calls}")
    print(f"old leader: lost lease at {at(r.lost_lease)}, candidacy lapsed at {at(r.lapsed)}; "
          f"new leader stood at {at(r.stood)}; healed at {at(r.healed)}; workflow {r.state} "
          f"at {at(r.finished)}; rejoined as follower {at(r.rejoined)[1:]} after the heal; "
          f"fenced: {r.fenced}")
    # The workflow ended before the heal, every task succeeded, once.
    assert r.state == "succeeded", r.state
    assert not r.lost and not r.doubled, (r.lost, r.doubled)
    assert r.elected is not None and r.elected <= LEADER_TTL + 1, (r.elected, r.seen)
    # `nodes` names the new leader, and no call that started a second after the election
    # names another. How long one call takes while the cut leader is still listed (the CLI
    # waits for its answers: 6-8 s quiet, 12 s beside the rest of the suite) is printed
    # above and measured by scripts/bench_partition.py, not asserted here.
    shown = next((p for p in r.polls if p[2] == r.new), None)
    assert shown is not None, r.polls
    stale = [p for p in r.polls if p[0] >= r.elected + 1.0 and p[2] != r.new]
    assert not stale, r.polls
    # Cut off, it can write nothing; it stopped leading before the heal let it write
    # again: its node lease given up (no leader round runs without it) and its
    # candidacy lapsed, so after the heal it rejoined as a follower.
    assert r.lost_lease is not None and r.stood is not None, r.log[-20:]
    assert r.lapsed is not None, r.log[-20:]
    assert r.healed is not None and max(r.lost_lease, r.lapsed) <= r.healed, r.log[-20:]
    assert r.rejoined is not None, f"{r.old} did not rejoin as a follower"


# -- an etcd member's host cut off -------------------------------------------------------


@pytest.fixture(scope="module")
def member_cut(netns_ok: None, tmp_path_factory: pytest.TempPathFactory) -> MemberResult:
    """Three agents on a three-member etcd cluster, each member in its own host; the
    leading member's host is cut off while 12 tasks of 2 s run on 3 x 2 slots."""
    with NetLab() as lab:
        # The lan preset (the default, TTL 10 s): etcd re-elects in about 2 s, longer
        # than the local preset's give-up (2 s of its 3 s TTL) but not lan's (6.7 s).
        mesh = NetMesh(lab, tmp_path_factory.mktemp("member-cut"), etcd_members=3,
                       preset="lan")
        try:
            mesh.start_etcd()
            for name in AGENTS:
                mesh.add_agent(name, slots=2)
            r = member_round(mesh, tasks=12, seconds=2, running=6)
        except BaseException:
            print(mesh.logs())
            raise
        finally:
            mesh.close()
    print(f"\netcd member cut: {r.member} (leader) -> {r.after} seen from the client at "
          f"+{r.reelected:.1f}s; workflow {r.state} at +{r.finished:.1f}s; "
          f"{r.rerun} attempts run again; agents exited: {r.exited}; "
          f"CLI calls refused after the heal: {r.refused}; member back {r.back:.1f}s "
          f"after the heal")
    for name, lines in r.trouble.items():
        print(f"{name}:", *lines[:14], sep="\n  ")
    return r


def test_etcd_member_host_cut_off_no_task_fails(member_cut: MemberResult) -> None:
    """The issue's bar: the workflow succeeds, every task exactly once."""
    assert member_cut.after is not None
    assert member_cut.state == "succeeded"
    assert len(member_cut.tasks) == 12
    for t in member_cut.tasks:
        successes = [a for a in t["attempts"] if a["state"] == "succeeded"]
        assert t["state"] == "succeeded" and len(successes) == 1, t


def test_etcd_member_host_cut_off_no_agent_loses_its_lease(member_cut: MemberResult) -> None:
    lost = {n: [x for x in lines if "lost lease" in x] for n, lines in member_cut.trouble.items()}
    assert not member_cut.exited, member_cut.trouble
    assert not any(lost.values()), lost
    assert all(len(t["attempts"]) == 1 for t in member_cut.tasks)
