#!/usr/bin/env python3
"""A local mesh on loopback: a real etcd plus N agents, each in its own work directory.

    local_mesh.py up  [--agents N] [--slots S] [--dir .mesh]   # run until Ctrl-C
    local_mesh.py run RECIPE [--agents N] [--slots S]          # start, submit --wait, stop

``up`` prints the environment to point the CLI at the mesh
(``HYPERMESH_ETCD``, ``HYPERMESH_NAMESPACE``). Everything it started is stopped
on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hypermesh.localmesh import LocalMesh, hypermesh_command

ROOT = Path(__file__).resolve().parent.parent


def _start(opts: argparse.Namespace) -> LocalMesh:
    root = Path(opts.dir).resolve()
    if root.exists() and opts.fresh:
        shutil.rmtree(root)
    print(f"local mesh: starting etcd and {opts.agents} agent(s) under {root}", file=sys.stderr)
    mesh = LocalMesh(root, agents=opts.agents, slots=opts.slots, namespace=opts.namespace)
    mesh.start()
    for agent in mesh.agents:
        print(
            f"local mesh: agent {agent.name} at {agent.address} (log {agent.log_path})",
            file=sys.stderr,
        )
    return mesh


def cmd_up(opts: argparse.Namespace) -> int:
    mesh = _start(opts)
    try:
        for key, value in mesh.env().items():
            print(f"export {key}={value}")
        sys.stdout.flush()
        print("local mesh: up; Ctrl-C stops it", file=sys.stderr)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.is_set():
                if not all(a.alive for a in mesh.agents):
                    print("local mesh: an agent exited; stopping", file=sys.stderr)
                    return 1
                stop.wait(1)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        mesh.close()
        print("local mesh: stopped", file=sys.stderr)


def cmd_run(opts: argparse.Namespace) -> int:
    mesh = _start(opts)
    try:
        env = dict(os.environ, **mesh.env())
        started = time.monotonic()
        submit = subprocess.run(
            [*hypermesh_command(), "submit", opts.recipe, "--wait"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        elapsed = time.monotonic() - started
        wid = submit.stdout.split()[-1] if submit.stdout.split() else ""
        if wid:
            subprocess.run([*hypermesh_command(), "status", wid], env=env)
            subprocess.run([*hypermesh_command(), "nodes"], env=env)
            print(
                f"\nworkflow {wid} finished in {elapsed:.1f}s "
                f"(exit {submit.returncode}); outputs of the example are under "
                f"{Path(opts.recipe).resolve().parent / 'runs' / wid}",
                file=sys.stderr,
            )
        return submit.returncode
    finally:
        mesh.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "run"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("recipe")
        p.add_argument("--agents", type=int, default=2)
        p.add_argument("--slots", type=int, default=2)
        p.add_argument("--namespace", default="default")
        p.add_argument("--dir", default=str(ROOT / ".mesh"))
        p.add_argument(
            "--keep",
            dest="fresh",
            action="store_false",
            help="keep the etcd data and work directories of a previous run",
        )
    opts = parser.parse_args()
    return cmd_up(opts) if opts.command == "up" else cmd_run(opts)


if __name__ == "__main__":
    sys.exit(main())
