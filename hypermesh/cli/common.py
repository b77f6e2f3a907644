"""What the commands share: where the mesh is, how a command runs, how it prints.

- ``Mesh`` and ``mesh_options``: the ``--etcd`` and ``--namespace`` options every command
  takes (also accepted before the command name), resolved against the environment;
- ``run_async``: runs an async command and turns hypermesh errors into a message on
  stderr and the exit code (2 bad input, 1 a failure at run time);
- ``load_view``: the records of a namespace, or of one workflow, read from etcd;
- ``err``, ``print_json`` and ``human_size``: a line on stderr, an object on stdout,
  a byte count as people read it;
- ``dump_profile``: the developer's profile (``HYPERMESH_PROFILE_DIR``), written by
  ``run_async`` and by a command that leaves through ``os._exit``.

Command modules import this one; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from functools import wraps
from typing import Any, TypeVar

import click

from hypermesh.config import ENV_ETCD, ENV_NAMESPACE, default_etcd, default_namespace
from hypermesh.errors import HypermeshError, NotFound, RecipeError, UsageError
from hypermesh.state.etcd import Etcd, parse_endpoints
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.view import MeshView

T = TypeVar("T")


def err(message: str) -> None:
    """``hypermesh: MESSAGE`` on stderr (progress, notes, warnings and errors)."""
    click.echo(f"hypermesh: {message}", err=True)


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (what ``--json`` prints)."""
    click.echo(json.dumps(data, indent=2))


def human_size(n: float) -> str:
    """``n`` bytes, rounded, in the largest binary unit that keeps it at least 1."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_profile: Any = None


def _profiled(run: Callable[..., T], *args: Any) -> T:
    """``run(*args)``, under cProfile when ``HYPERMESH_PROFILE_DIR`` names a directory:
    the profile goes to ``DIR/<pid>.prof`` when it returns (a developer's tool)."""
    global _profile
    if not os.environ.get("HYPERMESH_PROFILE_DIR"):
        return run(*args)
    import cProfile

    _profile = cProfile.Profile()
    try:
        return _profile.runcall(run, *args)  # type: ignore[no-any-return]
    finally:
        dump_profile()


def dump_profile() -> None:
    """Write the profile ``_profiled`` is taking, if any (also before ``os._exit``)."""
    out = os.environ.get("HYPERMESH_PROFILE_DIR")
    if _profile is not None and out:
        _profile.disable()
        _profile.dump_stats(os.path.join(out, f"{os.getpid()}.prof"))


def run_async(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """Run an async command; turn hypermesh errors into messages and exit codes."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return _profiled(asyncio.run, fn(*args, **kwargs))
        except RecipeError as exc:
            for problem in exc.problems:
                click.echo(f"error: {problem}", err=True)
            err(f"recipe rejected with {len(exc.problems)} problem(s); nothing was submitted")
            sys.exit(2)
        except UsageError as exc:
            err(f"error: {exc}")
            sys.exit(2)
        except HypermeshError as exc:
            err(f"error: {exc}")
            sys.exit(1)

    return wrapper


class Mesh:
    """Where the CLI finds the mesh: etcd endpoints and namespace."""

    def __init__(self, etcd: str, namespace: str) -> None:
        self.endpoints = parse_endpoints(etcd)
        try:
            self.ks = Keyspace(namespace)
        except ValueError as exc:
            raise UsageError(f"--namespace: {exc}") from exc

    def connect(self) -> Etcd:
        return Etcd(self.endpoints)


def mesh_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--etcd`` and ``--namespace`` on every command (also accepted before it)."""
    fn = click.option(
        "--namespace",
        "namespace",
        default=None,
        metavar="NAME",
        help=f"Mesh namespace in etcd [env {ENV_NAMESPACE}; default 'default'].",
    )(fn)
    fn = click.option(
        "--etcd",
        "etcd",
        default=None,
        metavar="URL[,URL...]",
        help=f"etcd endpoints [env {ENV_ETCD}; default http://127.0.0.1:2379].",
    )(fn)

    @wraps(fn)
    def wrapper(*args: Any, etcd: str | None, namespace: str | None, **kwargs: Any) -> Any:
        root = click.get_current_context().find_root().params
        etcd = etcd or root.get("etcd") or default_etcd()
        namespace = namespace or root.get("namespace") or default_namespace()
        try:
            mesh = Mesh(etcd, namespace)
        except UsageError as exc:
            err(f"error: {exc}")
            sys.exit(2)
        return fn(*args, mesh=mesh, **kwargs)

    return wrapper


async def load_view(etcd: Etcd, ks: Keyspace, wid: str | None = None) -> MeshView:
    """A view of the whole namespace, or of one workflow (raises NotFound)."""
    view = MeshView(ks)
    if wid is None:
        prefixes = [ks.root]
    else:
        prefixes = [p for p in ks.workflow_prefixes(wid) if p.endswith("/")]
        prefixes.append(ks.nodes)  # how many nodes could run a waiting gang
    for prefix in prefixes:
        kvs, _ = await etcd.get_prefix(prefix)
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    if wid is not None:
        for key in (ks.workflow(wid), ks.workflow_state(wid)):
            found = await etcd.get(key)
            if found is not None:
                view.apply(key, found[0], 0, found[1])
        if wid not in view.workflows:
            raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    return view
