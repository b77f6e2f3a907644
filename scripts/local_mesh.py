#!/usr/bin/env python3
"""A local mesh on loopback: a real etcd plus N agents, each in its own work directory.

    local_mesh.py up  [--agents N] [--slots S] [--dir .mesh] [--s3] [--data NAME=DIR ...]
    local_mesh.py run RECIPE [--agents N] [--slots S] [--s3] [--data NAME=DIR ...]
                             [--set [EXP.]FIELD=VALUE ...] [--in-container]

``up`` runs until Ctrl-C (or SIGTERM) and prints the environment to point the CLI at the mesh
(``HYPERMESH_ETCD``, ``HYPERMESH_NAMESPACE``, ``HYPERMESH_TLS_*`` naming the CLI's
certificate; with ``--s3`` also ``HYPERMESH_STORE`` and the S3 client variables).
Every gRPC connection is mutual TLS with a CA the mesh makes in ``DIR/tls``
(``--no-tls``: plaintext on loopback). ``run`` starts the mesh, runs
``submit RECIPE --wait`` (with ``--set`` passed on) and stops; ``--in-container`` builds the
local Python image (``hypermesh.local.images``) and runs every experiment of the recipe in it
(``--set image=...``). ``--s3`` starts a SeaweedFS S3 server as the
mesh's object store (agents get ``--store``); ``--data NAME=DIR`` puts DIR there
as data set NAME before anything runs (implies ``--s3``). Everything it started
is stopped on exit, also on Ctrl-C or SIGTERM at any point.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hypermesh.local.agents import hypermesh_command
from hypermesh.local.images import python_image
from hypermesh.local.mesh import LocalMesh

ROOT = Path(__file__).resolve().parent.parent


def _start(opts: argparse.Namespace) -> LocalMesh:
    root = Path(opts.dir).resolve()
    if root.exists() and opts.fresh:
        shutil.rmtree(root)
    print(f"local mesh: starting etcd and {opts.agents} agent(s) under {root}", file=sys.stderr)
    s3 = opts.s3 or bool(opts.data)
    mesh = LocalMesh(
        root, agents=opts.agents, slots=opts.slots, namespace=opts.namespace, s3=s3,
        tls=opts.tls,
    )
    mesh.start()
    for agent in mesh.agents:
        print(
            f"local mesh: agent {agent.name} at {agent.address} (log {agent.log_path}), "
            f"dashboard http://{agent.http_address}/",
            file=sys.stderr,
        )
    if mesh.s3 is not None:
        print(f"local mesh: object store {mesh.store_url} at {mesh.s3.endpoint}", file=sys.stderr)
    try:
        for spec in opts.data:
            name, _, folder = spec.partition("=")
            subprocess.run(
                [*hypermesh_command(), "data", "put", folder, name],
                env=dict(os.environ, **mesh.env()),
                stdout=subprocess.DEVNULL,
                check=True,
            )
            print(f"local mesh: data set {name} put from {folder}", file=sys.stderr)
    except BaseException:
        mesh.close()
        raise
    return mesh


def cmd_up(opts: argparse.Namespace) -> int:
    mesh = _start(opts)
    try:
        for key, value in mesh.env().items():
            print(f"export {key}={value}")
        sys.stdout.flush()
        print("local mesh: up; Ctrl-C or SIGTERM stops it", file=sys.stderr)
        while True:
            if not all(a.alive for a in mesh.agents):
                print("local mesh: an agent exited; stopping", file=sys.stderr)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see _terminate), once the mesh is up
        return 0
    finally:
        mesh.close()
        print("local mesh: stopped", file=sys.stderr)


def cmd_run(opts: argparse.Namespace) -> int:
    mesh = _start(opts)
    try:
        env = dict(os.environ, **mesh.env())
        overrides = list(opts.overrides)
        if opts.in_container:
            overrides.append(f"image={python_image()}")
        started = time.monotonic()
        submit = subprocess.run(
            [*hypermesh_command(), "submit", opts.recipe, "--wait",
             *(arg for o in overrides for arg in ("--set", o))],
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


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM does what Ctrl-C does: everything started so far is stopped, whatever
    the mesh was doing (starting, up, running a recipe). A second SIGTERM is ignored so
    that it cannot cut the clean-up short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _terminate)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "run"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("recipe")
            p.add_argument("--set", dest="overrides", action="append", default=[],
                           metavar="[EXP.]FIELD=VALUE", help="passed on to submit (repeatable)")
            p.add_argument("--in-container", action="store_true",
                           help="run every experiment in the local Python image "
                                "(hypermesh.local.images; needs podman)")
        p.add_argument("--agents", type=int, default=2)
        p.add_argument("--slots", type=int, default=2)
        p.add_argument("--namespace", default="default")
        p.add_argument("--dir", default=str(ROOT / ".mesh"))
        p.add_argument("--s3", action="store_true", help="run an S3 server as the object store")
        p.add_argument(
            "--data",
            action="append",
            default=[],
            metavar="NAME=DIR",
            help="put DIR into the store as data set NAME first (repeatable; implies --s3)",
        )
        p.add_argument(
            "--no-tls",
            dest="tls",
            action="store_false",
            help="plaintext gRPC (default: mutual TLS with a CA made in DIR/tls)",
        )
        p.add_argument(
            "--keep",
            dest="fresh",
            action="store_false",
            help="keep the etcd data and work directories of a previous run",
        )
    opts = parser.parse_args()
    try:
        return cmd_up(opts) if opts.command == "up" else cmd_run(opts)
    except KeyboardInterrupt:
        print("local mesh: interrupted; everything it started is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
