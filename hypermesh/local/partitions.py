"""Partition rounds on a :class:`~hypermesh.local.netns.NetMesh`: one fault, its heal,
and what the mesh did in between, measured. Shared by ``tests/net/test_partitions.py``
(which asserts the issue's bars on one round) and ``scripts/bench_partition.py`` (which
repeats rounds and reports the spread).

- :func:`partition_round`: an agent holding running tasks is cut as a scenario of
  :data:`SCENARIOS` says; when its tasks ran again elsewhere and when its own task
  processes stopped.
- :func:`leader_round`: the leader's host is cut off; when the client host saw another
  leader, and whether the old one stopped leading (its node lease and its candidacy
  gone) before the heal could let it write again.
- :func:`member_round`: on a three-member etcd cluster, the host of the member leading
  raft is cut off; when the client host saw the others' new leader, and whether any task
  failed, ran again, or any agent lost its lease.

Every round heals what it cut, also when it fails, and returns only once the mesh is
whole again (the cut agent or member back), so rounds repeat on one mesh. Every time is
seconds after the cut; agent logs are stamped by the same clock (:func:`log_time`).
Every round counts the tasks that did not succeed (lost) and those that succeeded more
than once (doubled).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypermesh.errors import EtcdUnavailable
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.local.etcd import etcdctl_binary
from hypermesh.local.netns import NetMesh
from hypermesh.local.processes import wait_for
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.view import MeshView

SCENARIOS = ("whole", "etcd", "peers")
"""whole: the host cut off from everything; etcd: from etcd alone (peers and the CLI
still reach it); peers: from every other agent (etcd and the CLI still reach it)."""

# Each task waits for the file ``go`` before its ``seconds`` start, so that the harness
# sees all of them running however slowly its CLI calls answer on a loaded machine;
# a task run again after the cut finds the file there and only sleeps.
HOLD_RECIPE = """\
experiments:
  hold:
    samples: {tasks}
    command: ['echo $$ > "$HM_ATTEMPT_DIR/pid"; while [ ! -e "{go}" ]; do sleep 0.05; done;
              exec sleep {seconds}']
"""

# A first stage that fills every slot, the leader's too, then a stage the new leader
# must schedule after the cut. The first stage waits for ``go`` as HOLD_RECIPE does.
STAGED_RECIPE = """\
experiments:
  first:
    samples: {tasks}
    command: ['while [ ! -e "{go}" ]; do sleep 0.05; done; exec sleep {seconds}']
  second:
    after: [first]
    samples: 3
    command: ['sleep 0.5']
"""

ENDED = ("succeeded", "failed", "cancelled")


# -- shared helpers -----------------------------------------------------------------------

def log_time(line: str) -> float:
    """The epoch time of an agent log line (``2026-01-02 03:04:05,678 ...``, local time)."""
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(path: Path, offset: int) -> list[str]:
    """The lines of log ``path`` from byte ``offset`` on (none when it is unreadable)."""
    with contextlib.suppress(OSError), open(path, errors="replace") as log:
        log.seek(offset)
        return [line.rstrip() for line in log]
    return []


def _first_line(lines: list[str], *needles: str) -> tuple[float, str] | None:
    """The time and text of the first line holding every needle."""
    for line in lines:
        if all(n in line for n in needles):
            return log_time(line), line
    return None


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _submit(mesh: NetMesh, name: str, text: str) -> str:
    recipe = mesh.root / f"{name}-{secrets.token_hex(3)}.yaml"
    recipe.write_text(text)
    return mesh.submit(recipe)


def end_state(mesh: NetMesh, wid: str) -> str | None:
    """Workflow ``wid``'s state once it ended, else None (also when the CLI's etcd
    endpoint was a cut one: the caller asks again)."""
    try:
        state: str = mesh.hm_json("status", wid)["state"]
    except RuntimeError:
        return None
    return state if state in ENDED else None


def _tally(tasks: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The tasks that did not succeed, and those with more than one succeeded attempt."""
    lost, doubled = [], []
    for t in tasks:
        successes = [a for a in t["attempts"] if a["state"] == "succeeded"]
        if t["state"] != "succeeded" or not successes:
            lost.append(str(t["id"]))
        if len(successes) > 1:
            doubled.append(str(t["id"]))
    return lost, doubled


def settled(mesh: NetMesh) -> bool:
    """Every agent listed alive and healthy in gossip (Lifeguard local health 0). A cut
    raises the local health of the members whose probes it fails, which stretches their
    probes and timeouts until it decays (about a protocol period a step); a round that
    starts before then measures that decay, not a partition of a settled mesh."""
    listed = mesh.hm_json("nodes")
    return len(listed) == len(mesh.agents) and all(
        n["state"] == "alive" and n["gossip"] == "alive"
        and (n["load"] or {}).get("health", 0) == 0 for n in listed)


def leader_of(mesh: NetMesh) -> str | None:
    """The leader ``hypermesh nodes`` names from the client host (None: none, or two)."""
    leaders = [r["name"] for r in mesh.hm_json("nodes") if r["leader"]]
    return leaders[0] if len(leaders) == 1 else None


async def watch_leader(urls: str, namespace: str) -> None:
    """Print ``{"t": EPOCH, "leader": NAME|null}`` at the start and at every change of
    the leader as ``hypermesh nodes`` derives it (the live candidate with the lowest
    create revision), read from etcd every 0.1 s, until killed. :func:`leader_round`
    runs it in the client host (:data:`WATCH_LEADER`): a CLI call costs a second of
    interpreter start, this sees a change within 0.1 s of etcd holding it."""
    ks = Keyspace(namespace)
    last: object = ()  # never a leader's name: the first reading is always printed
    async with Etcd(parse_endpoints(urls), timeout=1.0) as etcd:
        while True:
            view = MeshView(ks)
            try:
                for prefix in (ks.nodes, ks.election):
                    kvs, _ = await etcd.get_prefix(prefix)
                    for kv in kvs:
                        view.apply(kv.key.decode(), kv.value, kv.create_revision,
                                   kv.mod_revision)
            except EtcdUnavailable:
                await asyncio.sleep(0.1)
                continue
            now = view.leader()
            if now != last:
                print(json.dumps({"t": time.time(), "leader": now}), flush=True)
                last = now
            await asyncio.sleep(0.1)


WATCH_LEADER = [sys.executable, "-c", "import asyncio, sys; "
                "from hypermesh.local.partitions import watch_leader; "
                "asyncio.run(watch_leader(*sys.argv[1:]))"]
"""The command that runs :func:`watch_leader`; append the etcd URLs and the namespace."""


# -- an agent cut as a scenario says --------------------------------------------------------

@dataclass
class RoundResult:
    """What one partition round measured; every time is seconds after the cut."""

    scenario: str
    victim: str
    held: list[str]  # the victim's running tasks when it was cut
    cut_at: float = 0.0  # time.time() of the cut
    moved: dict[str, float] = field(default_factory=dict)  # task: its new attempt's start
    kept: list[str] = field(default_factory=list)  # held tasks that never moved
    stopped: float | None = None  # the victim's task processes all gone
    lost: list[str] = field(default_factory=list)  # tasks that did not succeed
    doubled: list[str] = field(default_factory=list)  # tasks with more than one success
    rejoined: float | None = None  # after the heal: listed alive, gossip alive
    seen: list[str] = field(default_factory=list)  # victim's (state/gossip) as listed
    # Every lease revoke any agent logged during the round, "who -> whom at +s".
    revokes: list[str] = field(default_factory=list)
    # Every agent that pushed-pulled a later life of a member gossip held dead, "who ->
    # whom at +s" (its node record in etcd had a new lease: Gossip._reach_new_lives).
    reached: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # the victim's log lines since the cut


def partition_round(mesh: NetMesh, scenario: str, *, tasks: int = 4, seconds: float = 6,
                    timeout: float = 90) -> RoundResult:
    """Run ``tasks`` tasks of ``seconds`` each, cut the agent holding most of them as
    ``scenario`` says, wait for the workflow to finish, heal, wait for the agent to
    rejoin; what happened, measured. Heals also when it fails."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, not {scenario!r}")
    offsets = {name: _log_size(a.log_path) for name, a in mesh.agents.items()}
    go = mesh.root / f"go-{secrets.token_hex(3)}"
    wid = _submit(mesh, "hold", HOLD_RECIPE.format(tasks=tasks, seconds=seconds, go=go))

    def rows() -> list[dict[str, Any]]:
        return mesh.hm_json("tasks", wid)

    def all_running() -> list[dict[str, Any]] | None:
        now = rows()
        return now if len(now) == tasks and all(t["state"] == "running" for t in now) else None

    try:
        now: list[dict[str, Any]] = wait_for(  # type: ignore[assignment]
            all_running, 60, f"{tasks} tasks to run", interval=0.3)
    finally:
        go.touch()  # also when they never all ran: let the ones that did end
    counts: dict[str, int] = {}
    for t in now:
        counts[str(t["node"])] = counts.get(str(t["node"]), 0) + 1
    victim = max(sorted(counts), key=lambda n: counts[n])
    held = {str(t["id"]): len(t["attempts"]) for t in now if t["node"] == victim}
    agent = mesh.agents[victim]
    pids = []
    for task_id in held:
        wf, exp, index = task_id.rsplit(".", 2)
        pid_file = agent.work_dir / "attempts" / wf / f"{exp}.{index}.{held[task_id]}" / "pid"
        wait_for(lambda f=pid_file: f.exists() and f.read_text().strip(),  # type: ignore[misc]
                 10, f"{task_id}'s pid")
        pids.append(int(pid_file.read_text()))
    result = RoundResult(scenario, victim, sorted(held))
    log_offset = _log_size(agent.log_path)
    others = [n for n in mesh.agents if n != victim]

    cut_at = result.cut_at = time.time()
    if scenario == "whole":
        mesh.lab.cut_off(victim)
    elif scenario == "etcd":
        for host in mesh.etcd_hosts:
            mesh.lab.cut(victim, host)
    else:
        for other in others:
            mesh.lab.cut(victim, other)
    watching = threading.Event()

    def watch_pids() -> None:
        while not watching.is_set():
            if all(_pid_gone(p) for p in pids):
                result.stopped = time.time() - cut_at
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_pids, daemon=True)
    watcher.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            current = {str(t["id"]): t for t in rows()}
            for task_id, before in held.items():
                attempts: list[dict[str, Any]] = current[task_id]["attempts"]
                if task_id not in result.moved and len(attempts) > before:
                    for attempt in attempts[before:]:
                        if attempt["node"] != victim:
                            started = float(attempt["started_at"])
                            result.moved[task_id] = started - cut_at
                            break
            with contextlib.suppress(RuntimeError, ValueError):
                listed = {n["name"]: n for n in mesh.hm_json("nodes")}
                node = listed.get(victim)
                seen = "absent" if node is None else f"{node['state']}/{node['gossip']}"
                if not result.seen or result.seen[-1] != seen:
                    result.seen.append(seen)
            status = mesh.hm_json("status", wid)
            if status["state"] in ENDED:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"workflow {wid} still {status['state']} "
                                   f"{timeout:g}s after the cut ({scenario}, {victim})")
            time.sleep(0.3)
    finally:
        mesh.lab.heal_all()
        healed_at = time.time()
        watching.set()
        watcher.join()

    def rejoined() -> bool:
        listed = {n["name"]: n for n in mesh.hm_json("nodes")}
        node = listed.get(victim)
        return node is not None and node["state"] == "alive" and node["gossip"] == "alive"

    with contextlib.suppress(TimeoutError):
        wait_for(rejoined, 30, f"{victim} to rejoin", interval=0.3)
        result.rejoined = time.time() - healed_at
    result.kept = sorted(set(held) - set(result.moved))
    result.lost, result.doubled = _tally(rows())
    result.log = [line for line in log_since(agent.log_path, log_offset)
                  if "WARNING hypermesh.agent: --insecure" not in line]
    for name, a in mesh.agents.items():
        for line in log_since(a.log_path, offsets[name]):
            if "; revoking its lease" in line or "(it cannot reach etcd); revoking" in line:
                when = log_time(line) - cut_at
                whom, why = line.split(" gossip: ", 1)[1].split(" ", 1)
                how = "gave up" if why.startswith("gave up") else "dead"
                result.revokes.append(f"{name} -> {whom} ({how}) at {when:+.1f}s")
            elif line.endswith(": reaching it"):
                whom = line.split(" gossip: ", 1)[1].split(" ", 1)[0]
                result.reached.append(f"{name} -> {whom} at {log_time(line) - cut_at:+.1f}s")
    return result


# -- the leader's host cut off --------------------------------------------------------------

@dataclass
class LeaderResult:
    """What one leader round measured; every time is seconds after the cut."""

    old: str  # the leader whose host was cut off
    cut_at: float = 0.0  # time.time() of the cut
    new: str | None = None  # the next leader the client host saw
    elected: float | None = None  # when the client host's watcher first saw ``new``
    seen: list[tuple[float, str | None]] = field(default_factory=list)  # every change seen
    # ``hypermesh nodes`` from the client host, back to back from the cut until it named
    # a new leader: (call start, call end, leader named)
    polls: list[tuple[float, float, str | None]] = field(default_factory=list)
    lost_lease: float | None = None  # the old leader logged its node lease lost
    lapsed: float | None = None  # the old leader logged its candidacy lapsed
    stood: float | None = None  # the new leader logged it stood
    finished: float | None = None  # the workflow ended (before the heal)
    healed: float | None = None
    # Both the lost lease and the lapse logged before the heal: the old leader could
    # write nothing stale once it reached etcd again.
    stopped_before_heal: bool = False
    # The old leader's lines that tell of a refused leader write or round.
    fenced: list[str] = field(default_factory=list)
    state: str = ""  # the workflow's end state
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    rejoined: float | None = None  # after the heal: the old leader alive, following
    log: list[str] = field(default_factory=list)  # the old leader's log since the cut


def leader_round(mesh: NetMesh, *, tasks: int = 6, seconds: float = 3,
                 timeout: float = 60) -> LeaderResult:
    """Start a workflow whose first stage (``tasks`` tasks of ``seconds``) should fill
    every slot, cut the leader's host off once it runs one of them, watch the leader
    from the client host until another one shows, wait for the workflow to end, heal,
    and wait for the old leader to rejoin as a follower. Raises TimeoutError when no
    other leader shows within 30 s or the workflow does not end within ``timeout``;
    heals also then."""
    old: str = wait_for(lambda: leader_of(mesh), 30, "a leader")  # type: ignore[assignment]
    offsets = {n: _log_size(a.log_path) for n, a in mesh.agents.items()}
    result = LeaderResult(old)
    watch = mesh.lab.popen("client", [*WATCH_LEADER, mesh.etcd_url, mesh.namespace],
                           stdout=subprocess.PIPE, env=mesh.env)
    seen: list[tuple[float, str | None]] = []  # (epoch, leader)

    def read_leaders() -> None:
        assert watch.stdout is not None
        for raw in watch.stdout:
            line = json.loads(raw)
            seen.append((line["t"], line["leader"]))

    polling = threading.Event()

    def poll_nodes() -> None:
        while not polling.is_set():
            start = time.time()
            try:
                now = leader_of(mesh)
            except (RuntimeError, ValueError):
                now = None
            result.polls.append((start - cut_at, time.time() - cut_at, now))
            if now not in (None, old):
                return

    reader = threading.Thread(target=read_leaders, daemon=True)
    poller = threading.Thread(target=poll_nodes, daemon=True)
    reader.start()
    try:
        wait_for(lambda: seen and seen[-1][1] == old, 20, "the watcher to see the leader")
        go = mesh.root / f"go-{secrets.token_hex(3)}"
        wid = _submit(mesh, "staged", STAGED_RECIPE.format(tasks=tasks, seconds=seconds, go=go))

        def old_runs_one() -> bool:
            return any(t["node"] == old and t["state"] == "running"
                       for t in mesh.hm_json("tasks", wid))

        try:
            wait_for(old_runs_one, 30, f"{old} to run a task of {wid}", interval=0.3)
        finally:
            go.touch()  # also when it never ran one: let the tasks end
        cut_at = result.cut_at = time.time()
        mesh.lab.cut_off(old)
        poller.start()
        try:
            wait_for(lambda: seen[-1][1] not in (None, old), 30, "another leader")
            poller.join(30)
            result.state = str(wait_for(lambda: end_state(mesh, wid), timeout,
                                        f"workflow {wid} to end", interval=0.5))
            result.finished = time.time() - cut_at
        finally:
            polling.set()
            mesh.lab.heal_off(old)
            healed = result.healed = time.time() - cut_at
    finally:
        watch.kill()
        watch.wait()
    poller.join(30)
    result.seen = [(t - cut_at, who) for t, who in seen]
    at, new = next(((t, who) for t, who in result.seen if t >= 0 and who not in (None, old)),
                   (None, None))
    result.new, result.elected = new, at

    def follows() -> bool:
        rows = {r["name"]: r for r in mesh.hm_json("nodes")}
        return (old in rows and rows[old]["state"] == "alive"
                and rows[old]["gossip"] == "alive" and not rows[old]["leader"]
                and new in rows and rows[new]["leader"])

    with contextlib.suppress(TimeoutError):
        wait_for(follows, 30, f"{old} to rejoin as a follower", interval=0.3)
        result.rejoined = time.time() - cut_at - healed
    result.lost, result.doubled = _tally(mesh.hm_json("tasks", wid))
    logs = {n: log_since(a.log_path, offsets[n]) for n, a in mesh.agents.items()}
    result.log = [line for line in logs[old] if "WARNING hypermesh.agent: --insecure" not in line]
    for name, needles in (("lost_lease", (f"{old}: lost lease",)),
                          ("lapsed", (f"{old}: candidacy", "lapsed"))):
        found = _first_line(logs[old], *needles)
        setattr(result, name, None if found is None else found[0] - cut_at)
    stood = _first_line(logs.get(str(new), []), f"{new}: stood for leader")
    result.stood = None if stood is None else stood[0] - cut_at
    result.stopped_before_heal = (result.lost_lease is not None and result.lapsed is not None
                                  and max(result.lost_lease, result.lapsed) <= healed)
    result.fenced = [line for line in logs[old]
                     if "LeadershipLost" in line or "no longer stands" in line
                     or "scheduling round failed" in line]
    return result


# -- an etcd member's host cut off ----------------------------------------------------------

@dataclass
class MemberResult:
    """What one etcd member round measured; every time is seconds after the cut."""

    member: str  # the etcd host cut off: the one leading etcd's raft
    cut_at: float = 0.0  # time.time() of the cut
    after: str | None = None  # the member leading after the cut, as the client host saw it
    reelected: float = 0.0  # when the client host first saw it
    finished: float = 0.0  # when the workflow had ended
    state: str = ""  # the workflow's end state
    tasks: list[dict[str, Any]] = field(default_factory=list)  # as ``hypermesh tasks`` lists
    failed: list[str] = field(default_factory=list)  # tasks that ended failed
    rerun: int = 0  # attempts beyond each task's first
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    leases_lost: list[str] = field(default_factory=list)  # "agent at +s", from the logs
    exited: list[str] = field(default_factory=list)  # agents no longer running at the end
    trouble: dict[str, list[str]] = field(default_factory=dict)  # each agent's warnings,
    # errors, lease losses, rejoins and drains, timed
    refused: list[str] = field(default_factory=list)  # CLI calls after the heal, failed
    back: float = 0.0  # s after the heal: the member healthy and the CLI answering


def member_round(mesh: NetMesh, *, tasks: int = 12, seconds: float = 2, running: int = 6,
                 timeout: float = 60) -> MemberResult:
    """Start ``tasks`` tasks of ``seconds``, cut off the host of the etcd member leading
    raft once ``running`` of them run, watch the other members elect a leader (asked
    from the client host), wait for the workflow to end, heal, and wait until the member
    is healthy again and the CLI answers. Raises TimeoutError when no leader shows within
    20 s, the workflow does not end within ``timeout`` or the mesh is not whole again
    within 60 s after the heal; heals also then."""
    if len(mesh.etcd_hosts) < 3:
        raise ValueError("member_round needs a mesh with etcd_members=3 or 5")
    member: str = wait_for(mesh.etcd_leader, 20, "etcd to name its leader")  # type: ignore[assignment]
    result = MemberResult(member)
    offsets = {n: _log_size(a.log_path) for n, a in mesh.agents.items()}
    go = mesh.root / f"go-{secrets.token_hex(3)}"
    wid = _submit(mesh, "hold", HOLD_RECIPE.format(tasks=tasks, seconds=seconds, go=go))

    def enough_running() -> bool:
        return sum(t["state"] == "running" for t in mesh.hm_json("tasks", wid)) >= running

    try:
        wait_for(enough_running, 30, f"{running} tasks to run", interval=0.3)
    finally:
        go.touch()
    cut_at = result.cut_at = time.time()
    mesh.lab.cut_off(member)
    try:
        after = wait_for(lambda: (m := mesh.etcd_leader()) != member and m, 20,
                         "the other members to elect a leader")
        result.after = str(after)
        result.reelected = time.time() - cut_at
        result.state = str(wait_for(lambda: end_state(mesh, wid), timeout,
                                    f"workflow {wid} to end", interval=0.5))
        result.finished = time.time() - cut_at
    finally:
        mesh.lab.heal_off(member)
        healed_at = time.time()

    def listed() -> list[dict[str, Any]] | None:
        try:
            rows: list[dict[str, Any]] = mesh.hm_json("tasks", wid)
        except RuntimeError as exc:
            result.refused.append(f"+{time.time() - cut_at:.1f}s {exc}")
            return None
        return rows

    result.tasks = wait_for(listed, 30, f"{wid}'s tasks")  # type: ignore[assignment]

    def member_healthy() -> bool:
        return mesh.lab.run("client", [
            etcdctl_binary(), "--endpoints", mesh.etcd_member_url(member),
            "--dial-timeout", "1s", "--command-timeout", "2s", "endpoint", "health"],
        ).returncode == 0

    wait_for(member_healthy, 30, f"etcd member {member} to be healthy", interval=0.3)
    result.back = time.time() - healed_at
    result.failed = [str(t["id"]) for t in result.tasks if t["state"] == "failed"]
    result.rerun = sum(len(t["attempts"]) - 1 for t in result.tasks)
    result.lost, result.doubled = _tally(result.tasks)
    for name, a in mesh.agents.items():
        lines = log_since(a.log_path, offsets[name])
        result.trouble[name] = [
            f"{log_time(line) - cut_at:+.2f}s {line[24:220]}" for line in lines
            if " WARNING " in line or " ERROR " in line or "lost lease" in line
            or "rejoined" in line or "drain" in line]
        result.leases_lost += [f"{name} at {log_time(line) - cut_at:+.2f}s" for line in lines
                               if f"{name}: lost lease" in line]
    result.exited = [n for n, a in mesh.agents.items() if not a.alive]
    return result
