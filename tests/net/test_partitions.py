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
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hypermesh.local.netns import NetLab, NetMesh, RoundResult, log_time, partition_round
from hypermesh.local.processes import wait_for

AGENTS = ("onprem", "cloud-a", "cloud-b")
LEASE_TTL = 3.0  # the local preset's
LEADER_TTL = 5.0  # the local preset's (the lan default: local does not change it)
PROBE = str(Path(__file__).with_name("probe.py"))

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


# -- the leader's host cut off ----------------------------------------------------------

STAGED = """\
experiments:
  first:
    samples: 6
    command: ['sleep 3']
  second:
    after: [first]
    samples: 3
    command: ['sleep 0.5']
"""


def leader_of(mesh: NetMesh) -> str | None:
    leaders = [r["name"] for r in mesh.hm_json("nodes") if r["leader"]]
    return leaders[0] if len(leaders) == 1 else None


def log_since(path: Path, offset: int) -> list[str]:
    with open(path, errors="replace") as log:
        log.seek(offset)
        return [line.rstrip() for line in log]


def first_line(lines: list[str], *needles: str) -> tuple[float, str] | None:
    """The time and text of the first line holding every needle."""
    for line in lines:
        if all(n in line for n in needles):
            return log_time(line), line
    return None


def end_state(mesh: NetMesh, wid: str) -> str | None:
    """Workflow ``wid``'s state once it ended, else None (also when the CLI's etcd
    endpoint was a cut one: the caller asks again)."""
    try:
        state: str = mesh.hm_json("status", wid)["state"]
    except RuntimeError:
        return None
    return state if state in ("succeeded", "failed", "cancelled") else None


def settle(mesh: NetMesh, wid: str, timeout: float) -> list[dict[str, Any]]:
    """Wait for workflow ``wid`` to end; its tasks, each checked: succeeded, once."""
    assert wait_for(lambda: end_state(mesh, wid), timeout, f"workflow {wid} to end",
                    interval=0.5) == "succeeded"
    tasks: list[dict[str, Any]] = mesh.hm_json("tasks", wid)
    for t in tasks:
        successes = [a for a in t["attempts"] if a["state"] == "succeeded"]
        assert t["state"] == "succeeded" and len(successes) == 1, t
    return tasks


def test_leader_host_cut_off(three: NetMesh) -> None:
    """The leader's host loses its link: the majority side elects another leader within
    the leader TTL + 1 s; the old one stops leading first (it gives its node lease up,
    and a node without its lease runs no leader round), a workflow running across the
    cut loses no task and runs none twice, and after the heal the old leader is a
    follower."""
    mesh = three
    old = wait_for(lambda: leader_of(mesh), 30, "a leader")
    assert isinstance(old, str)
    offsets = {n: a.log_path.stat().st_size for n, a in mesh.agents.items()}
    watch = mesh.lab.popen("client", [sys.executable, PROBE, "leader", mesh.etcd_url,
                                      mesh.namespace], stdout=subprocess.PIPE, env=mesh.env)
    seen: list[tuple[float, str | None]] = []

    def read_leaders() -> None:
        assert watch.stdout is not None
        for raw in watch.stdout:
            line = json.loads(raw)
            seen.append((line["t"], line["leader"]))

    reader = threading.Thread(target=read_leaders, daemon=True)
    reader.start()
    wait_for(lambda: seen and seen[-1][1] == old, 20, "the probe to see the leader")
    recipe = mesh.root / "staged.yaml"
    recipe.write_text(STAGED)
    wid = mesh.submit(recipe)

    def first_running() -> bool:
        tasks = mesh.hm_json("tasks", wid)
        return any(t["node"] == old and t["state"] == "running" for t in tasks)

    wait_for(first_running, 30, f"{old} to run a task of {wid}", interval=0.3)
    # `nodes` from the client host, over and over from the cut: (start, end, leader)
    polls: list[tuple[float, float, str | None]] = []
    polling = threading.Event()

    def poll_nodes() -> None:
        while not polling.is_set():
            start = time.time()
            try:
                now = leader_of(mesh)
            except (RuntimeError, ValueError):
                now = None
            polls.append((start - cut_at, time.time() - cut_at, now))
            if now not in (None, old):
                return

    cut_at = time.time()
    mesh.lab.cut_off(old)
    poller = threading.Thread(target=poll_nodes, daemon=True)
    poller.start()
    try:
        wait_for(lambda: seen[-1][1] not in (None, old), 30, "another leader")
        at, new = next(s for s in seen if s[1] not in (None, old))
        elected = at - cut_at
        poller.join(30)
        settle(mesh, wid, 60)
    finally:
        polling.set()
        mesh.lab.heal_off(old)
        healed_at = time.time()
        watch.kill()
        watch.wait()
    assert isinstance(new, str)
    shown = next((p for p in polls if p[2] == new), None)

    def follows() -> bool:
        rows = {r["name"]: r for r in mesh.hm_json("nodes")}
        return (old in rows and rows[old]["state"] == "alive"
                and rows[old]["gossip"] == "alive" and not rows[old]["leader"]
                and rows[new]["leader"])

    wait_for(follows, 30, f"{old} to rejoin as a follower", interval=0.3)
    rejoined = time.time() - healed_at
    logs = {n: log_since(a.log_path, offsets[n]) for n, a in mesh.agents.items()}
    lost = first_line(logs[old], f"{old}: lost lease")
    lapsed = first_line(logs[old], f"{old}: candidacy", "lapsed")
    stood = first_line(logs[new], f"{new}: stood for leader")
    fenced = [line for line in logs[old]
              if "LeadershipLost" in line or "no longer stands" in line
              or "scheduling round failed" in line]
    calls = ", ".join(f"+{a:.1f}..+{b:.1f}s: {who}" for a, b, who in polls)
    print(f"\nleader cut: {old} -> {new}: elected at +{elected:.2f}s (probe); "
          f"`nodes` calls from the cut: {calls}")
    print(f"old leader: lost lease at {lost[0] - cut_at:+.2f}s" if lost else "no lost lease",
          f", candidacy lapsed at {lapsed[0] - cut_at:+.2f}s" if lapsed else "",
          f"; new leader stood at {stood[0] - cut_at:+.2f}s" if stood else "",
          f"; rejoined as follower {rejoined:.2f}s after the heal; fenced: {fenced}")
    assert elected <= LEADER_TTL + 1, (elected, seen)
    assert shown is not None and shown[1] <= LEADER_TTL + 1 + 3.5, polls  # CLI's own waits
    # Cut off, it can write nothing; it stopped leading before the heal let it write
    # again: its node lease given up (no leader round runs without it) and its
    # candidacy lapsed, so after the heal it rejoined as a follower.
    assert lost is not None and stood is not None, logs[old][-20:]
    assert lapsed is not None, logs[old][-20:]
    assert max(lost[0], lapsed[0]) <= healed_at, (lost[1], lapsed[1])


# -- an etcd member's host cut off -------------------------------------------------------

HOLD_12 = """\
experiments:
  hold:
    samples: 12
    command: ['sleep 2']
"""


@dataclasses.dataclass
class MemberCut:
    """One run of the scenario below, for its two tests."""

    member: str  # the etcd host cut off: the one leading etcd's raft
    after: str | None  # the member leading after the cut, as the client host saw it
    reelected: float  # when the client host first saw it, s after the cut
    finished: float  # when the workflow had ended, s after the cut
    state: str  # the workflow's end state
    tasks: list[dict[str, Any]]
    trouble: dict[str, list[str]]  # each agent's warnings and lease losses, timed
    exited: list[str]  # agents no longer running at the end


@pytest.fixture(scope="module")
def member_cut(netns_ok: None, tmp_path_factory: pytest.TempPathFactory) -> MemberCut:
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
            return cut_etcd_leader(mesh)
        except BaseException:
            print(mesh.logs())
            raise
        finally:
            mesh.close()


def cut_etcd_leader(mesh: NetMesh) -> MemberCut:
    member = wait_for(mesh.etcd_leader, 20, "etcd to name its leader")
    assert isinstance(member, str)
    offsets = {n: a.log_path.stat().st_size for n, a in mesh.agents.items()}
    recipe = mesh.root / "hold.yaml"
    recipe.write_text(HOLD_12)
    wid = mesh.submit(recipe)

    def six_running() -> bool:
        return sum(t["state"] == "running" for t in mesh.hm_json("tasks", wid)) == 6

    wait_for(six_running, 30, "6 tasks to run", interval=0.3)
    cut_at = time.time()
    mesh.lab.cut_off(member)
    try:
        after = wait_for(lambda: (m := mesh.etcd_leader()) != member and m, 20,
                         "the other members to elect a leader")
        reelected = time.time() - cut_at
        state = wait_for(lambda: end_state(mesh, wid), 60, f"workflow {wid} to end",
                         interval=0.5)
        finished = time.time() - cut_at
    finally:
        mesh.lab.heal_off(member)
    refused: list[str] = []  # CLI calls that found no etcd answer after the heal

    def listed() -> list[dict[str, Any]] | None:
        try:
            rows: list[dict[str, Any]] = mesh.hm_json("tasks", wid)
        except RuntimeError as exc:
            refused.append(f"+{time.time() - cut_at:.1f}s {exc}")
            return None
        return rows

    tasks: list[dict[str, Any]] = wait_for(listed, 30, f"{wid}'s tasks")  # type: ignore[assignment]
    logs = {n: log_since(a.log_path, offsets[n]) for n, a in mesh.agents.items()}
    trouble = {n: [f"{log_time(line) - cut_at:+.2f}s {line[24:220]}" for line in lines
                   if " WARNING " in line or " ERROR " in line or "lost lease" in line
                   or "rejoined" in line or "drain" in line]
               for n, lines in logs.items()}
    exited = [n for n, a in mesh.agents.items() if not a.alive]
    print(f"\netcd member cut: {member} (leader) -> {after} seen from the client at "
          f"+{reelected:.1f}s; workflow {state} at +{finished:.1f}s; "
          f"{sum(len(t['attempts']) - 1 for t in tasks)} attempts run again; "
          f"agents exited: {exited}; CLI calls refused after the heal: {refused}")
    for name, lines in trouble.items():
        print(f"{name}:", *lines[:14], sep="\n  ")
    return MemberCut(member, after if isinstance(after, str) else None, reelected, finished,
                     str(state), tasks, trouble, exited)


def test_etcd_member_host_cut_off_no_task_fails(member_cut: MemberCut) -> None:
    """The issue's bar: the workflow succeeds, every task exactly once."""
    assert member_cut.after is not None
    assert member_cut.state == "succeeded"
    assert len(member_cut.tasks) == 12
    for t in member_cut.tasks:
        successes = [a for a in t["attempts"] if a["state"] == "succeeded"]
        assert t["state"] == "succeeded" and len(successes) == 1, t


def test_etcd_member_host_cut_off_no_agent_loses_its_lease(member_cut: MemberCut) -> None:
    lost = {n: [x for x in lines if "lost lease" in x] for n, lines in member_cut.trouble.items()}
    assert not member_cut.exited, member_cut.trouble
    assert not any(lost.values()), lost
    assert all(len(t["attempts"]) == 1 for t in member_cut.tasks)
