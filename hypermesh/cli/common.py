"""What the commands share: where the mesh is, how a command runs, how it prints.

- ``Mesh`` and ``mesh_options``: the ``--etcd`` and ``--namespace`` options every command
  takes (also accepted before the command name), resolved against the environment;
- ``override_option``: ``--set EXP.FIELD=VALUE``, for the commands that load a recipe;
- ``run_async``: runs an async command and turns hypermesh errors into a message on
  stderr and the exit code (2 bad input, 1 a failure at run time);
- ``load_view``: the records of a namespace, or of one workflow, read from etcd;
- ``err``, ``print_json``, ``human_size`` and ``aligned``: a line on stderr, an object on
  stdout, a byte count as people read it, a table whose columns fit their content;
- ``dump_profile``: the developer's profile (``HYPERMESH_PROFILE_DIR``), written by
  ``run_async`` and by a command that leaves through ``os._exit``.

Command modules import this one; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Container, Coroutine
from functools import wraps
from typing import Any, TypeVar

import click

from hypermesh.cli.tls_options import ETCD_PARAMS, TLS_PARAMS, etcd_options, tls_options
from hypermesh.config import ENV_ETCD, ENV_NAMESPACE, default_etcd, default_namespace
from hypermesh.errors import HypermeshError, NotFound, RecipeError, UsageError
from hypermesh.etcd_security import PLAINTEXT, EtcdSecurity
from hypermesh.state.etcd import Etcd, parse_endpoints
from hypermesh.state.folding import FOLD_AFTER_TASKS
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.view import MeshView
from hypermesh.tls import TlsFiles

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


def aligned(rows: list[list[str]], right: Container[int] = ()) -> list[str]:
    """``rows`` of cells (the first one the header) as lines whose columns are as wide as
    their widest cell, two spaces apart; the columns numbered in ``right`` (counts) are
    right-aligned. Large numbers never run into their neighbours."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))] if rows else []
    return [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


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
    """Where the CLI finds the mesh: etcd endpoints and namespace, how etcd is reached
    (``--etcd-*``), and the TLS files (``--tls-*``; None: plaintext) its connections to
    agents use."""

    def __init__(
        self, etcd: str, namespace: str, tls: TlsFiles | None = None,
        etcd_security: EtcdSecurity = PLAINTEXT,
    ) -> None:
        self.tls = tls
        self.endpoints = parse_endpoints(etcd)
        etcd_security.check_scheme(etcd)
        self.etcd_security = etcd_security
        try:
            self.ks = Keyspace(namespace)
        except ValueError as exc:
            raise UsageError(f"--namespace: {exc}") from exc

    def connect(self, timeout: float = 5.0) -> Etcd:
        return Etcd(self.endpoints, timeout=timeout, security=self.etcd_security)


override_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="EXP.FIELD=VALUE",
    help="Override a recipe field (repeatable), e.g. mnist.samples=10.",
)
"""``--set``: the ``overrides`` ``load_recipe`` applies (``submit``, ``validate``)."""


def mesh_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--etcd``, ``--namespace``, ``--etcd-*`` and ``--tls-*`` on every command (the
    first two also accepted before it)."""
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

    fn = tls_options(fn)
    fn = etcd_options(fn)

    @wraps(fn)
    def wrapper(*args: Any, etcd: str | None, namespace: str | None, **kwargs: Any) -> Any:
        root = click.get_current_context().find_root().params
        etcd = etcd or root.get("etcd") or default_etcd()
        namespace = namespace or root.get("namespace") or default_namespace()
        try:
            tls = TlsFiles.from_options(*(kwargs.pop(k) for k in TLS_PARAMS))
            security = EtcdSecurity.from_options(*(kwargs.pop(k) for k in ETCD_PARAMS))
            mesh = Mesh(etcd, namespace, tls, security)
        except UsageError as exc:
            err(f"error: {exc}")
            sys.exit(2)
        return fn(*args, mesh=mesh, **kwargs)

    return wrapper


BLOCKS_PER_READ = 64
"""Blocks ``load_view`` reads at a time, each time with their batches: what it holds of
a large workflow before folding it (64 blocks: at most 16,384 tasks)."""


async def load_view(
    etcd: Etcd, ks: Keyspace, wid: str | None = None, *, fold: bool = False
) -> MeshView:
    """A view of the whole namespace, or of one workflow (raises NotFound), read in pages
    at one revision.

    With ``fold`` (``status``), settled blocks past ``FOLD_AFTER_TASKS`` are kept as
    counts (``hypermesh/state/folding.py``): enough for every summary, in memory
    bounded whatever the workflow's size. For that, blocks are read a page at a time,
    each page after the batches of its blocks (``bdone`` keys sort as ``block`` keys
    do), so that a settled block folds as it arrives, without per-task records."""
    view = MeshView(ks)
    if fold:
        view.fold_after = FOLD_AFTER_TASKS
        view.defer_batches = True  # a batch waits for its block, then folds with it
    blocks, batches = ks.kind_prefix("block", wid), ks.kind_prefix("bdone", wid)
    done: tuple[str, ...] = (blocks, batches)  # read first, skipped in the rest
    if wid is None:
        done += (ks.kind_prefix("wf"),)  # what folding needs to know of an experiment
        rest = [ks.kind_prefix("wf"), ks.root]
    else:
        for key in (ks.workflow(wid), ks.workflow_state(wid)):
            found = await etcd.get(key)
            if found is not None:
                view.apply(key, found[0], 0, found[1])
        if wid not in view.workflows:
            raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
        rest = [p for p in ks.workflow_prefixes(wid) if p.endswith("/") and p not in done]
        rest.append(ks.nodes)  # how many nodes could run a waiting gang

    def apply(kvs: list[Any], skip: tuple[str, ...] = ()) -> None:
        for kv in kvs:
            key = kv.key.decode()
            if not (skip and key.startswith(skip)):
                view.apply(key, kv.value, kv.create_revision, kv.mod_revision)
        view.fold_settled()

    at = 0  # every range read at the revision of the first page
    if wid is None:  # workflows first
        async for kvs, read_at in etcd.pages(rest.pop(0), at):
            at = read_at
            apply(kvs)
    cursor = batches
    async for kvs, read_at in etcd.pages(blocks, at, most=BLOCKS_PER_READ):
        at = read_at
        if kvs:  # first the batches of these blocks: up to the last one's, "S/..." < "S0"
            upto = batches + kvs[-1].key.decode()[len(blocks):] + "0"
            async for more, _ in etcd.pages(batches, at, start=cursor, end=upto):
                apply(more)
            cursor = upto
        apply(kvs)  # a settled block folds as it arrives, its batches in hand
    async for more, _ in etcd.pages(batches, at, start=cursor):  # batches of no block
        apply(more)
    for prefix in rest:  # page by page, each applied and dropped
        async for kvs, _ in etcd.pages(prefix, at):
            apply(kvs, done)
    view.set_defer_batches(False)
    return view
