"""Dispatch throughput: N trivial tasks through one agent against ``xargs -P``.

Each round runs both sides on this machine, alternating, so that both see the
same noise:

* hypermesh: a fresh :class:`~hypermesh.local.mesh.LocalMesh` (a real etcd and
  ``--agents`` agents with ``--slots`` slots each, started with the product's
  default timings, ``--preset lan``, unless ``--preset local`` asks for the test
  suite's fast ones); a recipe with one experiment of ``--tasks``
  samples whose command is ``--command`` (``true``) is submitted with ``hypermesh submit
  --wait``. The end-to-end figure is timed from just before ``submit`` starts to
  the moment it exits (CLI start-up and submit included, mesh start-up
  excluded). The agent-side figure is ``tasks / (last ended_at - first
  started_at)`` over the attempts listed by ``hypermesh tasks --json``.
* baseline: ``xargs -P SLOTS -L 1 -a FILE bash -c`` over a file of N lines
  ``true``, so that every task is one ``bash -c true`` process. The agents run a
  command without shell syntax (``true``) directly, as make does, so they start
  no bash: ``--command 'true;'`` makes them start one per task, as the baseline
  does, and ``--xargs-direct`` makes the baseline exec the command without bash.

The script prints medians and the ratios of medians; it asserts nothing about
speed. Every process it starts is stopped before it returns.

    .venv/bin/python scripts/bench_dispatch.py [--tasks 2000] [--slots 4] [--agents 1]
        [--rounds 3] [--preset lan|local] [--command true] [--xargs-direct] [--no-fsync]
        [--tls] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.etcd import etcd_binary
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for

SUBMIT_TIMEOUT_S = 600.0
"""Upper bound on one ``submit --wait`` (and on one xargs run), in seconds."""

QUERY_TIMEOUT_S = 60.0
"""Upper bound on one read-only CLI call (``nodes``, ``tasks``), in seconds."""

AGENT_READY_TIMEOUT_S = 30.0
"""How long a fresh agent may take to appear as leader in ``hypermesh nodes``."""


@dataclass(frozen=True)
class MeshRound:
    """One hypermesh run: wall time of ``submit --wait`` and the agent's own span.

    The ``*_cpu_s`` fields are CPU seconds (user + system) spent during ``submit
    --wait`` by the agent process itself, by the task processes it reaped, by
    etcd, and by the submitting CLI; 0.0 where ``/proc`` is not available.
    """

    wall_s: float
    agent_span_s: float
    tasks: int
    agent_cpu_s: float = 0.0
    task_cpu_s: float = 0.0
    etcd_cpu_s: float = 0.0
    cli_cpu_s: float = 0.0

    @property
    def end_to_end_tps(self) -> float:
        return self.tasks / self.wall_s

    @property
    def agent_tps(self) -> float:
        return self.tasks / self.agent_span_s


@dataclass(frozen=True)
class XargsRound:
    wall_s: float
    tasks: int

    @property
    def tps(self) -> float:
        return self.tasks / self.wall_s


class BenchError(RuntimeError):
    """A side of the benchmark did not complete; the message says why."""


def recipe_text(tasks: int, command: str = "true", block: int | None = None) -> str:
    """The benchmarks' recipe: ``tasks`` trivial tasks; ``block``: the recipe's ``batch``
    (tasks per block), else the automatic size, which is 1 (per-task keys) once the
    mesh has more than a quarter as many slots as tasks."""
    return (
        "name: dispatch\n"
        "experiments:\n"
        "  noop:\n"
        f"    samples: {tasks}\n"
        + (f"    batch: {block}\n" if block is not None else "")
        + "    command:\n"
        f"      - {json.dumps(command)}\n"
    )


def proc_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children) CPU seconds of ``pid`` from ``/proc``; zeros if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    fields = stat.rpartition(")")[2].split()
    # fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14-17.
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    tick = os.sysconf("SC_CLK_TCK")
    return (utime + stime) / tick, (cutime + cstime) / tick


def children_cpu() -> float:
    """CPU seconds of this process's reaped children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*hypermesh_command(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _wait_for_leader(env: dict[str, str]) -> None:
    """The agent has registered and sees itself as leader, so it will expand the workflow."""

    def leader() -> bool:
        out = _cli(["nodes", "--json"], env, QUERY_TIMEOUT_S)
        return out.returncode == 0 and any(n.get("leader") for n in json.loads(out.stdout or "[]"))

    wait_for(leader, AGENT_READY_TIMEOUT_S, "the agent to lead", interval=0.2)


def agent_span(rows: list[dict[str, Any]], tasks: int) -> float:
    """Seconds from the first attempt's start to the last attempt's end.

    Raises BenchError unless there are exactly ``tasks`` tasks, all succeeded.
    """
    if len(rows) != tasks:
        raise BenchError(f"expected {tasks} tasks, `hypermesh tasks` listed {len(rows)}")
    bad = [r["id"] for r in rows if r["state"] != "succeeded"]
    if bad:
        raise BenchError(f"{len(bad)} task(s) did not succeed, e.g. {bad[:3]}")
    attempts = [a for r in rows for a in r["attempts"]]
    first = min(float(a["started_at"]) for a in attempts)
    last = max(float(a["ended_at"]) for a in attempts)
    if last <= first:
        raise BenchError(f"attempt times make no sense: first start {first}, last end {last}")
    return last - first


def run_mesh_round(
    tasks: int, slots: int, fsync: bool, agents: int = 1, preset: str = "lan",
    command: str = "true", tls: bool = False,
) -> MeshRound:
    with tempfile.TemporaryDirectory(prefix="hm-bench-dispatch-") as tmp:
        root = Path(tmp)
        recipe = root / "dispatch.yaml"
        recipe.write_text(recipe_text(tasks, command))
        mesh = LocalMesh(root / "mesh", agents=agents, slots=slots, fsync=fsync,
                         agent_args=["--preset", preset], tls=tls)
        with mesh:
            env = {**os.environ, **mesh.env()}
            _wait_for_leader(env)
            agent_pids = [a.proc.pid if a.proc else -1 for a in mesh.agents]
            etcd_pid = mesh.etcd.proc.pid if mesh.etcd.proc else -1

            def agents_cpu() -> tuple[float, float]:
                pairs = [proc_cpu(pid) for pid in agent_pids]
                return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

            agent0, etcd0, cli0 = agents_cpu(), proc_cpu(etcd_pid), children_cpu()
            try:
                start = time.perf_counter()
                done = _cli(["submit", str(recipe), "--wait"], env, SUBMIT_TIMEOUT_S)
                wall = time.perf_counter() - start
                agent1, etcd1, cli1 = agents_cpu(), proc_cpu(etcd_pid), children_cpu()
            except subprocess.TimeoutExpired as exc:
                raise BenchError(
                    f"submit --wait ran past {SUBMIT_TIMEOUT_S:g}s\n"
                    f"agent log tail:\n{mesh.agents[0].log_tail()}"
                ) from exc
            if done.returncode != 0:
                raise BenchError(
                    f"submit --wait exited {done.returncode}\nstderr:\n{done.stderr[-2000:]}\n"
                    f"agent log tail:\n{mesh.agents[0].log_tail()}"
                )
            wid = done.stdout.split()[-1]
            listed = _cli(["tasks", wid, "--json"], env, QUERY_TIMEOUT_S)
            if listed.returncode != 0:
                raise BenchError(f"tasks {wid} --json exited {listed.returncode}: {listed.stderr}")
            span = agent_span(json.loads(listed.stdout), tasks)
        return MeshRound(
            wall_s=wall,
            agent_span_s=span,
            tasks=tasks,
            agent_cpu_s=agent1[0] - agent0[0],
            task_cpu_s=agent1[1] - agent0[1],
            etcd_cpu_s=etcd1[0] - etcd0[0],
            cli_cpu_s=cli1 - cli0,
        )


def xargs_command(
    slots: int, lines: Path, direct: bool = False, command: str = "true"
) -> list[str]:
    """``xargs`` running each line as ``bash -c LINE``, or (``direct``) executing
    ``command``'s words itself, without a shell, with the line (the task's number) as
    one more argument. (``xargs`` with no command would run ``echo LINE``.)"""
    run = shlex.split(command) if direct else ["bash", "-c"]
    return ["xargs", "-P", str(slots), "-L", "1", "-a", str(lines), *run]


def run_xargs_round(
    tasks: int, slots: int, command: str = "true", direct: bool = False
) -> XargsRound:
    with tempfile.TemporaryDirectory(prefix="hm-bench-xargs-") as tmp:
        lines = Path(tmp) / "commands.txt"
        lines.write_text(
            "".join(f"{i}\n" for i in range(tasks)) if direct else f"{command}\n" * tasks
        )
        start = time.perf_counter()
        done = subprocess.run(
            xargs_command(slots, lines, direct, command),
            stdin=subprocess.DEVNULL,
            timeout=SUBMIT_TIMEOUT_S,
        )
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"xargs exited {done.returncode}")
    return XargsRound(wall_s=wall, tasks=tasks)


def machine() -> dict[str, Any]:
    version = subprocess.run(
        [etcd_binary(), "--version"], capture_output=True, text=True, timeout=10
    ).stdout.splitlines()
    return {
        "nproc": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "etcd": version[0].split()[-1] if version else "unknown",
    }


def summarize(mesh: list[MeshRound], xargs: list[XargsRound]) -> dict[str, float]:
    e2e = statistics.median(r.end_to_end_tps for r in mesh)
    agent = statistics.median(r.agent_tps for r in mesh)
    base = statistics.median(r.tps for r in xargs)
    return {
        "hypermesh_end_to_end_tps": e2e,
        "hypermesh_agent_tps": agent,
        "xargs_tps": base,
        "ratio_end_to_end": e2e / base,
        "ratio_agent": agent / base,
        # Each round runs both sides back to back: on a machine whose speed drifts, the
        # median of the rounds' own ratios moves less than the ratio of the medians.
        "median_round_ratio_end_to_end": statistics.median(
            m.end_to_end_tps / x.tps for m, x in zip(mesh, xargs, strict=True)
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=2000, help="tasks per side per round [2000]")
    p.add_argument("--slots", type=int, default=4, help="agent slots and xargs -P [4]")
    p.add_argument(
        "--agents", type=int, default=1, help="agents in the mesh; xargs gets agents*slots [1]"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, each runs both sides [3]")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="start etcd with --unsafe-no-fsync (default: fsync on)",
    )
    p.add_argument(
        "--preset",
        choices=("lan", "local"),
        default="lan",
        help="the agents' timing preset: lan (the product's default) or local (the test "
        "suite's fast timers: gossip every 50 ms) [lan]",
    )
    p.add_argument(
        "--command",
        default="true",
        help="each task's command, on both sides [true]. The agents execute a command "
        "without shell syntax directly (as make does), so 'true;' measures them with "
        "bash started per task, as xargs ... bash -c does",
    )
    p.add_argument(
        "--xargs-direct",
        action="store_true",
        help="the baseline executes --command itself, once per line (xargs -L 1 true N, "
        "without bash -c); the agents must then execute it directly too",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="the mesh runs mutual TLS on every gRPC connection, the CLI included "
        "(a CA made in the mesh's directory); default plaintext on loopback",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    for name, low in (("tasks", 1), ("slots", 1), ("rounds", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be at least {low}, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fsync = not args.no_fsync
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    log = sys.stderr if args.json else sys.stdout
    baseline = xargs_command(
        args.slots * args.agents, Path("FILE"), args.xargs_direct, args.command
    )
    print(f"command: {command}", file=log)
    print(
        f"{args.tasks} tasks, {args.agents} agent(s) x {args.slots} slots, {args.rounds} rounds, "
        f"preset {args.preset}, TLS {'on' if args.tls else 'off'}, "
        f"command {args.command!r}, baseline "
        f"{shlex.join(baseline)}, "
        f"etcd fsync {'on' if fsync else 'OFF (--unsafe-no-fsync)'}",
        file=log,
    )

    mesh_rounds: list[MeshRound] = []
    xargs_rounds: list[XargsRound] = []
    try:
        for i in range(1, args.rounds + 1):
            m = run_mesh_round(
                args.tasks, args.slots, fsync, args.agents, args.preset, args.command,
                args.tls,
            )
            mesh_rounds.append(m)
            print(
                f"round {i}: hypermesh {m.wall_s:7.2f}s  {m.end_to_end_tps:7.1f} tasks/s "
                f"end-to-end, {m.agent_tps:7.1f} tasks/s agent-side ({m.agent_span_s:.2f}s)",
                file=log,
                flush=True,
            )
            print(
                f"         CPU s during submit: agent {m.agent_cpu_s:.2f}, its tasks "
                f"{m.task_cpu_s:.2f}, etcd {m.etcd_cpu_s:.2f}, submit CLI {m.cli_cpu_s:.2f}",
                file=log,
                flush=True,
            )
            x = run_xargs_round(
                args.tasks, args.slots * args.agents, args.command, args.xargs_direct
            )
            xargs_rounds.append(x)
            print(
                f"round {i}: xargs     {x.wall_s:7.2f}s  {x.tps:7.1f} tasks/s", file=log, flush=True
            )
    except (BenchError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"bench_dispatch: {exc}", file=sys.stderr)
        return 1

    s = summarize(mesh_rounds, xargs_rounds)
    print(file=log)
    print(f"{'median tasks/s':<28}{'':>10}{'vs xargs':>10}", file=log)
    print(
        f"{'hypermesh end-to-end':<28}{s['hypermesh_end_to_end_tps']:>10.1f}"
        f"{s['ratio_end_to_end']:>10.3f}",
        file=log,
    )
    print(
        f"{'hypermesh agent-side':<28}{s['hypermesh_agent_tps']:>10.1f}{s['ratio_agent']:>10.3f}",
        file=log,
    )
    print(
        f"{'xargs -P ' + str(args.slots * args.agents):<28}{s['xargs_tps']:>10.1f}{1:>10.3f}",
        file=log,
    )
    print(
        f"median of the rounds' end-to-end ratios: {s['median_round_ratio_end_to_end']:.3f}",
        file=log,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "command": command,
                    "tasks": args.tasks,
                    "slots": args.slots,
                    "agents": args.agents,
                    "rounds": args.rounds,
                    "fsync": fsync,
                    "preset": args.preset,
                    "tls": args.tls,
                    "task_command": args.command,
                    "xargs_direct": args.xargs_direct,
                    "machine": machine(),
                    "hypermesh_rounds": [
                        asdict(r) | {"end_to_end_tps": r.end_to_end_tps, "agent_tps": r.agent_tps}
                        for r in mesh_rounds
                    ],
                    "xargs_rounds": [asdict(r) | {"tps": r.tps} for r in xargs_rounds],
                    "medians": s,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
