"""The longest event-loop stall of a leading agent while it expands a large workflow.

One agent runs in this process (a real etcd on loopback, started here) beside a
heartbeat task that sleeps ``--tick`` seconds in a loop and records how late each wake-up
is: a late wake-up is a stall, time in which the agent's loop ran nothing else (no lease
keep-alive, no claim, no gRPC answer). A workflow of one experiment of ``--tasks``
samples with a continuous parameter (so that every task gets a drawn value) is
submitted as ``hypermesh submit`` would (without ``--wait``), and the heartbeat runs
for ``--seconds`` from the submit on; the agent runs the tasks (``true``) meanwhile,
unless ``--idle`` confines them to a pool no node is in (the expansion alone).

It prints the longest stall, the 99th percentile of the lateness, the stalls over
10 ms, and how many tasks were written (the ``expanded`` marker) and finished at the
end. Every process it starts is stopped before it returns.

    .venv/bin/python scripts/bench_loop_stall.py [--tasks 200000] [--seconds 20]
        [--slots 4] [--tick 0.001] [--idle] [--blame [--blame-ms 20]] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hypermesh.agent.daemon import Agent
from hypermesh.config import AgentConfig
from hypermesh.local.etcd import EtcdServer
from hypermesh.recipe.recipe import parse_recipe
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.records import WorkflowRecord
from hypermesh.state.txns import new_workflow_id, submit_workflow

NAMESPACE = "stall"


def recipe_text(tasks: int, idle: bool = False) -> str:
    return (
        "name: stall\n"
        "experiments:\n"
        "  noop:\n"
        f"    samples: {tasks}\n"
        "    parameters: {lr: {range: [0.0001, 0.1], sampling: loguniform}}\n"
        + ("    pools: [nowhere]\n" if idle else "")
        + "    command: ['true']\n"
    )


async def heartbeat(tick: float, late: list[float], stop: asyncio.Event) -> None:
    """Sleep ``tick`` seconds at a time; record how late each wake-up was."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + tick
        await asyncio.sleep(tick)
        late.append(max(0.0, loop.time() - due))


class SlowCallbacks(logging.Handler):
    """Collects asyncio's debug-mode reports of callbacks that held the loop."""

    def __init__(self, threshold: float = 0.02) -> None:
        super().__init__(logging.WARNING)
        self.threshold = threshold  # seconds a callback holds the loop to be named
        self.slow: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            what, _, took = message.rpartition(" took ")
            self.slow.append((float(took.split()[0]), what.removeprefix("Executing ")[:160]))


async def measure(etcd_url: str, work: Path, tasks: int, seconds: float, slots: int,
                  tick: float, idle: bool = False,
                  blame: SlowCallbacks | None = None) -> dict[str, Any]:
    endpoints = [etcd_url.split("//")[1]]
    if blame is not None:
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        loop.slow_callback_duration = blame.threshold
        logging.getLogger("asyncio").addHandler(blame)
        logging.getLogger("asyncio").setLevel(logging.WARNING)
    cfg = AgentConfig.local(name="stall1", listen="127.0.0.1:0", slots=slots, work_dir=work,
                            http_listen=None)
    agent = Agent(cfg, endpoints, NAMESPACE)
    running = asyncio.create_task(agent.run())
    ks = Keyspace(NAMESPACE)
    try:
        async with Etcd(endpoints) as etcd:
            deadline = time.monotonic() + 30
            while not (agent.mirror_ready.is_set() and agent.is_leader):
                if time.monotonic() > deadline or running.done():
                    raise RuntimeError("the agent did not come up as leader")
                await asyncio.sleep(0.05)
            wf = WorkflowRecord(
                id=new_workflow_id("stall"), name="stall",
                recipe=parse_recipe(recipe_text(tasks, idle)), seed=1,
                submitted_at=time.time(), workdir=str(work),
            )
            late: list[float] = []
            stop = asyncio.Event()
            beat = asyncio.create_task(heartbeat(tick, late, stop))
            started = time.monotonic()
            await submit_workflow(etcd, ks, wf)
            await asyncio.sleep(seconds)
            stop.set()
            await beat
            elapsed = time.monotonic() - started
            marker = await etcd.get(ks.expanded(wf.id, "noop"))
            written = json.loads(marker[0])["count"] if marker else 0
            counts = agent.view.counts.get((wf.id, "noop"), {})
            finished = sum(n for state, n in counts.items() if state not in ("open", "running"))
    finally:
        agent.request_drain(0.5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(running, 30)
    ordered = sorted(late)
    return {
        "tasks": tasks,
        "seconds": round(elapsed, 1),
        "tick_ms": tick * 1000,
        "max_stall_ms": round(ordered[-1] * 1000, 1),
        "p99_late_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
        "median_late_ms": round(statistics.median(ordered) * 1000, 2),
        "stalls_over_10ms": sum(1 for x in ordered if x > 0.010),
        "top_stalls_ms": [round(x * 1000, 1) for x in ordered[-5:][::-1]],
        "written": written,
        "finished": finished,
    } | ({} if blame is None else {
        "callbacks_over_threshold": len(blame.slow),
        "slowest_callbacks": [f"{t * 1000:.0f} ms {what}" for t, what in sorted(blame.slow)[-8:]]
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--tick", type=float, default=0.001)
    parser.add_argument("--idle", action="store_true",
                        help="the experiment may run only in a pool no node is in: nothing "
                             "runs, the loop does the expansion alone")
    parser.add_argument("--blame", action="store_true",
                        help="asyncio debug mode: name the callbacks that held the loop "
                             "over --blame-ms (slows everything down)")
    parser.add_argument("--blame-ms", type=float, default=20.0,
                        help="with --blame: the hold that names a callback (default 20)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    blame = SlowCallbacks(args.blame_ms / 1000) if args.blame else None
    with tempfile.TemporaryDirectory(prefix="hm-bench-stall-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd", fsync=False) as server:
            result = asyncio.run(measure(server.url, root / "agent", args.tasks, args.seconds,
                                         args.slots, args.tick, args.idle, blame))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>18}: {value}")


if __name__ == "__main__":
    main()
