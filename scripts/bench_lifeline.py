"""What tying tasks to their agent costs, and how fast they die with it.

Two measurements, each printed as medians with the rounds in brackets:

* start overhead (always): the agent-side CPU of running one trivial attempt
  (``AttemptProcess(["true"]).run()``, the runner's full path: pipe, spawn, pidfd
  wait, reap) in this process, per attempt, in microseconds, for each variant:

  - ``off``: no lifeline (the code before issue 22, item 4);
  - ``lifeline``: a :class:`~hypermesh.agent.tasks.lifeline.Lifeline` open: the
    marker in the environment, a journal line at each start and each end;
  - ``cgroup``: the lifeline, and each task's process moved into a cgroup of its own
    agent just after it starts (one write to ``cgroup.procs``), the alternative this
    replaced; only where a writable cgroup2 hierarchy is mounted;
  - ``pdeathsig``: no lifeline, each process started by ``Popen`` with a
    ``preexec_fn`` that sets ``PR_SET_PDEATHSIG`` (a fork, no vfork, Python in the
    child), the other alternative.

  Variants alternate within each round so that they see the same noise; the
  journal's two writes per attempt are also timed alone (20,000 pairs a round), a
  figure the noise of a shared machine does not drown. This
  process holds ``--ballast-mb`` of touched memory, as an agent does (a fork
  copies page tables in proportion).

* kill latency (``--kill``): a real etcd and one real agent (``--preset local``)
  run ``--trees`` tasks, each ``sleep 300 & setsid sleep 300 & sleep 300; wait``
  (four processes, one of them in a session of its own); the agent is SIGKILLed and
  the time from the kill to the moment the last of those processes is gone is
  measured (polled every millisecond; a zombie counts as gone). A fresh mesh per
  round. ``--cgroup-probe`` also times ``cgroup.kill`` on the same trees in a
  cgroup (no agent), for comparison.

Every process the script starts is stopped before it returns; it asserts nothing
about speed.

    .venv/bin/python scripts/bench_lifeline.py [--tasks 400] [--rounds 5]
        [--variants off,lifeline,cgroup,pdeathsig] [--ballast-mb 120]
        [--kill] [--trees 4] [--kill-rounds 3] [--cgroup-probe]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from hypermesh.agent.tasks import runner
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for

TREE = "sleep 300 & setsid sleep 300 & sleep 300; wait"
PROCESSES_PER_TREE = 4  # bash and its three sleeps
KILL_DEADLINE_S = 30.0  # a round whose processes outlive this is reported as such
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------- start overhead
def cgroup2_root() -> str | None:
    """Where a cgroup2 hierarchy is mounted read-write, or None."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            if fstype == "cgroup2" and "rw" in fields[5].split(","):
                return fields[4]
    return None


@contextlib.contextmanager
def variant(name: str, work: Path) -> Iterator[None]:
    """Install one variant for the attempts run inside the block."""
    if name == "off":
        yield
        return
    if name == "pdeathsig":
        with _pdeathsig_spawn():
            yield
        return
    from hypermesh.agent.tasks.lifeline import Lifeline

    line = Lifeline.open(work, lambda _msg: None)
    try:
        if name == "cgroup":
            with _cgroup_moves(line):
                yield
        else:
            yield
    finally:
        line.close()


@contextlib.contextmanager
def _pdeathsig_spawn() -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)

    def die_with_parent() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def spawn(argv: list[str], *, cwd: str, env: Any, stdin: int, stdout: int) -> Any:
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent,
        )

    saved = runner.spawn
    runner.spawn = spawn  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.spawn = saved


@contextlib.contextmanager
def _cgroup_moves(line: Any) -> Iterator[None]:
    root = cgroup2_root()
    if root is None:
        raise SystemExit("no writable cgroup2 hierarchy here: leave out the cgroup variant")
    group = os.path.join(root, f"hypermesh-bench-{os.getpid()}")
    os.mkdir(group)
    procs = os.open(os.path.join(group, "cgroup.procs"), os.O_WRONLY)
    started = line.journal.started

    def started_and_moved(pid: int) -> None:
        started(pid)
        os.write(procs, str(pid).encode())

    line.journal.started = started_and_moved
    try:
        yield
    finally:
        line.journal.started = started
        os.close(procs)
        with open(os.path.join(group, "cgroup.kill"), "w") as f:
            f.write("1")
        wait_for(lambda: not Path(group, "cgroup.procs").read_text().strip(), 10, "cgroup empty")
        os.rmdir(group)


def cpu_per_attempt(tasks: int, work: Path) -> float:
    """Microseconds of this process's CPU per trivial attempt, over ``tasks`` in a row."""

    async def main() -> float:
        runner.use_pidfd_child_watcher()
        env = dict(os.environ)
        began = time.process_time()
        for i in range(tasks):
            process = runner.AttemptProcess(
                ["true"], env=env, cwd=str(work), log_path=str(work / f"{i}.log"),
                timeout=None, grace=1.0,
            )
            outcome = await process.run()
            if outcome.state != "succeeded":
                raise SystemExit(f"attempt {i} {outcome}")
        return (time.process_time() - began) / tasks * 1e6

    return asyncio.run(main())


def journal_cost(pairs: int = 20_000, rounds: int = 5) -> list[float]:
    """Microseconds of CPU per journal ``started`` + ``ended`` pair (what the lifeline adds
    per attempt but the marker, an entry of an environment built anyway)."""
    from hypermesh.agent.tasks.lifeline import Journal

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-lifeline-") as tmp:
        journal = Journal(os.path.join(tmp, "journal"))
        for _ in range(rounds):
            began = time.process_time()
            for pid in range(pairs):
                journal.started(pid)
                journal.ended(pid)
            results.append((time.process_time() - began) / pairs * 1e6)
        journal.close()
    return results


def start_overhead(args: argparse.Namespace) -> None:
    variants = args.variants.split(",")
    ballast = bytearray(args.ballast_mb << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    results: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-lifeline-") as tmp:
        for _ in range(args.rounds):
            for name in variants:
                work = Path(tmp, name)
                work.mkdir(exist_ok=True)
                with variant(name, work):
                    results[name].append(cpu_per_attempt(args.tasks, work))
    base = statistics.median(results[variants[0]])
    print(f"start overhead: agent CPU per trivial attempt, {args.tasks} attempts x "
          f"{args.rounds} rounds, ballast {args.ballast_mb} MiB")
    for name, values in results.items():
        med = statistics.median(values)
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {name:10s} {med:8.1f} us  ({rounds})  {med - base:+.1f} us vs {variants[0]}")
    if "lifeline" in variants:
        pairs = journal_cost()
        print(f"  journal start+end pair alone: {statistics.median(pairs):.2f} us "
              f"({', '.join(f'{v:.2f}' for v in pairs)})")


# ---------------------------------------------------------------- kill latency
def tree_processes(agent_pid: int) -> list[psutil.Process]:
    """The agent's task processes: its descendants but the lifeline's watchdog."""
    found = []
    for proc in psutil.Process(agent_pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "hypermesh.agent.tasks.lifeline" not in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def time_until_gone(procs: list[psutil.Process], kill: Callable[[], None]) -> float:
    """Seconds from ``kill()`` until every one of ``procs`` is gone (inf: not in time)."""
    began = time.monotonic()
    kill()
    left = list(procs)
    while left:
        left = [p for p in left if not gone(p)]
        if time.monotonic() - began > KILL_DEADLINE_S:
            for p in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            return float("inf")
        time.sleep(0.001)
    return time.monotonic() - began


def kill_round(trees: int) -> float:
    recipe = (f"experiments:\n  tree:\n    samples: {trees}\n"
              f"    command: [{TREE!r}]\n")
    with tempfile.TemporaryDirectory(prefix="bench-lifeline-kill-") as tmp, LocalMesh(
        Path(tmp), slots=trees, fsync=False, agent_args=["--preset", "local"]
    ) as mesh:
        path = Path(tmp, "recipe.yaml")
        path.write_text(recipe)
        env = dict(os.environ, **mesh.env())
        subprocess.run([sys.executable, "-m", "hypermesh", "submit", str(path)], env=env,
                       check=True, capture_output=True, timeout=60)
        agent = mesh.agents[0]
        assert agent.proc is not None
        pid = agent.proc.pid
        want = trees * PROCESSES_PER_TREE
        procs = wait_for(lambda: (lambda ps: ps if len(ps) >= want else None)(tree_processes(pid)),
                         60, f"{want} task processes", interval=0.05)
        return time_until_gone(procs, agent.kill)


def cgroup_probe(trees: int) -> float:
    root = cgroup2_root()
    if root is None:
        raise SystemExit("no writable cgroup2 hierarchy here")
    group = os.path.join(root, f"hypermesh-bench-{os.getpid()}")
    os.mkdir(group)
    shells = []
    try:
        # Each shell moves itself in before it forks: moved from here just after it
        # started, a loaded machine lets it fork first, and its children stay outside.
        enter = f"echo $$ > {group}/cgroup.procs && exec /bin/bash -c {shlex.quote(TREE)}"
        for _ in range(trees):
            shells.append(subprocess.Popen(["/bin/bash", "-c", enter], start_new_session=True))
        procs = wait_for(
            lambda: (lambda ps: ps if len(ps) >= trees * PROCESSES_PER_TREE else None)(
                [psutil.Process(int(p)) for p in Path(group, "cgroup.procs").read_text().split()]),
            10, "the trees", interval=0.01)

        def kill() -> None:
            Path(group, "cgroup.kill").write_text("1")

        return time_until_gone(procs, kill)
    finally:
        Path(group, "cgroup.kill").write_text("1")
        for shell in shells:
            shell.wait()
        # Orphans (the sleeps) are reaped by init, in its own time.
        wait_for(lambda: not Path(group, "cgroup.procs").read_text().strip(), 60, "cgroup empty")
        os.rmdir(group)


def kill_latency(args: argparse.Namespace) -> None:
    times = [kill_round(args.trees) for _ in range(args.kill_rounds)]
    print(f"kill latency, SIGKILL of the agent to the last of {args.trees} x "
          f"{PROCESSES_PER_TREE} task processes gone: {statistics.median(times) * 1e3:.0f} ms "
          f"({', '.join(f'{t * 1e3:.0f}' for t in times)})")
    if args.cgroup_probe:
        probes = [cgroup_probe(args.trees) for _ in range(args.kill_rounds)]
        print(f"cgroup.kill of the same trees, to the last gone: "
              f"{statistics.median(probes) * 1e3:.1f} ms "
              f"({', '.join(f'{t * 1e3:.1f}' for t in probes)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", default="off,lifeline,cgroup,pdeathsig")
    parser.add_argument("--ballast-mb", type=int, default=120)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--trees", type=int, default=4)
    parser.add_argument("--kill-rounds", type=int, default=3)
    parser.add_argument("--cgroup-probe", action="store_true")
    args = parser.parse_args()
    start_overhead(args)
    if args.kill:
        kill_latency(args)


if __name__ == "__main__":
    main()
