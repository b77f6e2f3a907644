"""Locality: bytes fetched from the object store over two epochs, with and without
peer sharing and locality-aware claims.

One run (per mode, per round) starts a fresh local mesh — etcd, a SeaweedFS S3
server and ``--agents`` agents with ``--slots`` slots each (default one; from 64 slots in
all, an experiment with ``inputs`` runs in one-task blocks) and a chunk cache of
``--cache-shards`` shards per mount — and puts a data set of ``--shards`` shards
(``--shard-mib`` MiB each, two files per shard, ``--chunk-mib`` MiB chunks): larger
than any one node's cache, smaller than all of them together. Then two epochs, each a
workflow of ``--readers`` tasks per shard (default one), each of which reads its shard
fully (``cat`` through the node's chunkfs mount; the recipe's ``inputs`` name the
shard); with several readers, the readers of a shard run at about the same time on
different nodes, as an ensemble's members would. Between the epochs the script
waits until every node's cached bytes, as gossip reports them, have stopped changing
(so the second epoch sees what the first one left).

Modes:

* ``on``: the defaults — peer sharing (mounts fetch through their agent from peers,
  one node per cold chunk goes to the store) and locality-aware claims;
* ``off``: ``--peer-sharing off --locality-delay off``: every miss goes to the store,
  tasks are claimed with no regard to data;
* ``locality`` (``--peer-sharing off``) and ``sharing`` (``--locality-delay off``):
  one of the two alone.

Per epoch it reports the bytes the mounts fetched from the store (``store_bytes`` of
every mount's ``.chunkfs-stats``: chunk data, block lists and prefetch), as a multiple
of the data set's size, the wall time of ``submit --wait``, and which node ran which
shard. The bars of issue 6: epoch 1 <= 1.05x, epoch 2 <= 0.05x with sharing and
locality on. It prints medians over ``--rounds``; it asserts nothing. Everything it
starts is stopped before it returns.

    .venv/bin/python scripts/bench_locality.py [--agents 4] [--slots 1] [--watch auto] [--shards 4]
        [--shard-mib 64] [--chunk-mib 16] [--cache-shards 1.5] [--readers 1] [--rounds 1]
        [--modes on,off] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.mesh import LocalMesh
from hypermesh.local.processes import wait_for

MIB = 1 << 20
EPOCH_TIMEOUT_S = 600.0
"""Upper bound on one epoch's ``submit --wait``, in seconds."""

SETTLE_TIMEOUT_S = 60.0
"""Upper bound on the wait for gossip to report settled caches between epochs."""

SETTLE_POLLS = 3
"""Cached bytes must read the same this many times in a row (1 s apart) to count as settled."""

MODES = {
    "on": [],
    "off": ["--peer-sharing", "off", "--locality-delay", "off"],
    "locality": ["--peer-sharing", "off"],
    "sharing": ["--locality-delay", "off"],
}

RECIPE = """
experiments:
  read:
    data: {{ds: {name}}}
    parameters:
      shard: {{values: [{shards}]}}
      reader: {{values: [{readers}]}}
    inputs: ["ds/shard-{{{{shard}}}}"]
    command:
      - cat "$HM_DATA_DS"/shard-{{{{shard}}}}/* > /dev/null
"""


@dataclass(frozen=True)
class Epoch:
    """One epoch: bytes from the store (all mounts), wall time, shard -> nodes."""

    store_bytes: int
    wall_s: float
    placement: dict[int, list[str]]
    keys: str  # how the tasks were written: "blocks" or "per task"


@dataclass(frozen=True)
class Run:
    mode: str
    dataset_bytes: int
    epochs: tuple[Epoch, Epoch]

    def ratio(self, i: int) -> float:
        return self.epochs[i].store_bytes / self.dataset_bytes


def hm(mesh: LocalMesh, *args: str, timeout: float = 60.0) -> str:
    out = subprocess.run(
        [*hypermesh_command(), *args], env=dict(os.environ, **mesh.env()),
        capture_output=True, text=True, timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"hypermesh {' '.join(args)} exited {out.returncode}: {out.stderr}")
    return out.stdout


def store_bytes(mesh: LocalMesh) -> int:
    """What every agent's mounts have fetched from the store so far."""
    total = 0
    for agent in mesh.agents:
        for stats in (agent.work_dir / "chunkfs" / "mnt").glob("*/.chunkfs-stats"):
            total += int(json.loads(stats.read_text())["reads"]["store_bytes"])
    return total


def make_shards(root: Path, shards: int, shard_mib: int) -> int:
    size = 0
    for s in range(shards):
        folder = root / f"shard-{s}"
        folder.mkdir(parents=True)
        for part in ("a", "b"):
            data = os.urandom(shard_mib * MIB // 2)
            (folder / part).write_bytes(data)
            size += len(data)
    return size


def settle(mesh: LocalMesh) -> None:
    """Wait until gossip's cached bytes of every node read the same several times."""
    seen: list[list[int]] = []

    def steady() -> bool:
        rows = json.loads(hm(mesh, "nodes", "--json"))
        seen.append(sorted((r["cached_bytes"] or 0) for r in rows))
        return len(seen) >= SETTLE_POLLS and all(s == seen[-1] for s in seen[-SETTLE_POLLS:])

    wait_for(steady, SETTLE_TIMEOUT_S, "cached bytes to settle", interval=1.0)


def epoch(mesh: LocalMesh, recipe: Path) -> Epoch:
    before = store_bytes(mesh)
    start = time.perf_counter()
    out = hm(mesh, "submit", str(recipe), "--wait", timeout=EPOCH_TIMEOUT_S)
    wall = time.perf_counter() - start
    wid = out.split()[-1]
    tasks = json.loads(hm(mesh, "tasks", wid, "--json"))
    placement: dict[int, list[str]] = {}
    for t in sorted(tasks, key=lambda t: t["index"]):
        placement.setdefault(int(t["params"]["shard"]), []).append(t["node"])
    blocks = mesh.etcd.etcdctl("get", "--prefix", "--count-only", "--write-out", "fields",
                               f"/hypermesh/{mesh.namespace}/block/{wid}/")
    count = next(int(line.split(":")[1]) for line in blocks.stdout.splitlines()
                 if line.startswith('"Count"'))
    return Epoch(store_bytes(mesh) - before, wall, dict(sorted(placement.items())),
                 "blocks" if count else "per task")


def run_once(args: argparse.Namespace, mode: str, root: Path) -> Run:
    cache = f"{int(args.cache_shards * args.shard_mib)}MiB"
    agent_args = ["--cache-size", cache, "--watch", args.watch, *MODES[mode]]
    with LocalMesh(root, agents=args.agents, slots=args.slots, s3=True, fsync=False,
                   agent_args=agent_args) as mesh:
        size = make_shards(root / "data", args.shards, args.shard_mib)
        hm(mesh, "data", "put", str(root / "data"), "shards", "--chunk-size",
           f"{args.chunk_mib}MiB", timeout=300)
        recipe = root / "epoch.yaml"
        shards = ", ".join(str(s) for s in range(args.shards))
        readers = ", ".join(str(r) for r in range(args.readers))
        recipe.write_text(RECIPE.format(name="shards", shards=shards, readers=readers))
        first = epoch(mesh, recipe)
        settle(mesh)
        second = epoch(mesh, recipe)
    return Run(mode, size, (first, second))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--slots", type=int, default=1,
                        help="slots per agent; from 64 in all, tasks with inputs run in "
                        "one-task blocks the leader offers by their data [1]")
    parser.add_argument("--watch", choices=("all", "own", "auto"), default="auto",
                        help="the agents' --watch [auto]")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--cache-shards", type=float, default=1.5)
    parser.add_argument("--readers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default="on,off")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    counts = (args.agents, args.slots, args.shards, args.readers, args.rounds)
    if min(counts) < 1 or args.cache_shards <= 0:
        parser.error("--agents, --slots, --shards, --readers, --rounds, --cache-shards "
                     "must be positive")
    runs: list[Run] = []
    for r in range(args.rounds):
        for mode in modes:  # alternate, so that both modes see the same noise
            with tempfile.TemporaryDirectory(prefix="bench-locality-") as tmp:
                run = run_once(args, mode, Path(tmp))
            runs.append(run)
            print(f"round {r + 1} {mode}: epoch 1 {run.ratio(0):.3f}x "
                  f"{run.epochs[0].wall_s:.1f}s {run.epochs[0].placement}; epoch 2 "
                  f"{run.ratio(1):.3f}x {run.epochs[1].wall_s:.1f}s "
                  f"{run.epochs[1].placement} ({run.epochs[1].keys})", file=sys.stderr)
    summary: dict[str, Any] = {"config": vars(args), "modes": {}}
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        summary["modes"][mode] = {
            "epoch1_store_x": statistics.median(r.ratio(0) for r in mine),
            "epoch2_store_x": statistics.median(r.ratio(1) for r in mine),
            "epoch1_wall_s": statistics.median(r.epochs[0].wall_s for r in mine),
            "epoch2_wall_s": statistics.median(r.epochs[1].wall_s for r in mine),
            "runs": [asdict(r) for r in mine],
        }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    size = runs[0].dataset_bytes
    print(f"data set {size / MIB:.0f} MiB in {args.shards} shards, {args.readers} reader(s) "
          f"per shard, {args.agents} agents, cache {args.cache_shards:g} shards each; "
          f"medians of {args.rounds} round(s)")
    print(f"{'mode':<6}{'epoch 1 store':>15}{'epoch 2 store':>15}{'epoch 1 wall':>14}"
          f"{'epoch 2 wall':>14}")
    for mode, m in summary["modes"].items():
        print(f"{mode:<6}{m['epoch1_store_x']:>14.3f}x{m['epoch2_store_x']:>14.3f}x"
              f"{m['epoch1_wall_s']:>13.1f}s{m['epoch2_wall_s']:>13.1f}s")
    if "on" in summary["modes"]:
        on = summary["modes"]["on"]
        print(f"bars (on): epoch 1 <= 1.05x: {'met' if on['epoch1_store_x'] <= 1.05 else 'MISSED'}"
              f"; epoch 2 <= 0.05x: {'met' if on['epoch2_store_x'] <= 0.05 else 'MISSED'}")


if __name__ == "__main__":
    main()
