"""``hypermesh data``: put, list, remove and download data sets in an object store; and
``hypermesh mount``, which mounts one with FUSE (``hypermesh/chunkfs/mount.py`` holds
that command's options and is imported only when it runs).

The ``data`` commands talk only to the object store (``--store URL`` or
``$HYPERMESH_STORE``), never to etcd. Exit codes as for the rest of the CLI: 0 success,
1 a failure at run time (store unavailable, data set missing, corrupt data), 2 bad
input. Results go to stdout (``--json`` for machine-readable output); progress and
errors to stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from hypermesh.cli.common import human_size, print_json
from hypermesh.errors import HypermeshError, UsageError
from hypermesh.recipe.units import UnitError, parse_size

T = TypeVar("T")

STORE_HELP = "Object store: s3://BUCKET[/PREFIX] or file:///PATH [env HYPERMESH_STORE]."


def _fail(message: str, code: int) -> None:
    click.echo(f"hypermesh: error: {message}", err=True)
    sys.exit(code)


def data_command(fn: Callable[..., T]) -> Callable[..., T]:
    """Add ``--store`` and turn hypermesh errors into messages and exit codes."""

    @click.option("--store", "store_url", envvar="HYPERMESH_STORE", metavar="URL", help=STORE_HELP)
    @wraps(fn)
    def wrapper(*args: Any, store_url: str | None, **kwargs: Any) -> T:
        from hypermesh.chunkfs.store import open_store

        try:
            store = open_store(store_url)
        except UsageError as exc:
            _fail(str(exc), 2)
            raise
        try:
            with store:
                return fn(*args, store=store, **kwargs)
        except UsageError as exc:
            _fail(str(exc), 2)
        except HypermeshError as exc:
            _fail(str(exc), 1)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        raise AssertionError("unreachable")

    return wrapper


@click.group()
def data() -> None:
    """Data sets in object storage: put, ls, rm, get."""


# ----------------------------------------------------------------------------- put
class _PutDisplay:
    """Progress of a put on stderr: a live line on a terminal, else one line per 5 s."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.status: Any = None
        self.last = time.monotonic()

    def __call__(self, p: Any) -> None:
        now = time.monotonic()
        if now - self.last < (0.2 if self.live else 5.0):
            return
        self.last = now
        elapsed = max(now - p.started, 1e-6)
        line = (
            f"{p.files} files, {human_size(p.bytes_read)} read "
            f"({human_size(int(p.bytes_read / elapsed))}/s), chunks: {p.chunks_uploaded} "
            f"uploaded, {p.chunks_existing} already stored"
        )
        if self.live:
            if self.status is None:
                self.status = self.console.status(line)
                self.status.start()
            self.status.update(line)
        else:
            click.echo(f"put: {line}", err=True)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except UnitError as exc:
        raise UsageError(f"--chunk-size: {exc}") from exc


@data.command("put")
@click.argument("src", metavar="DIR", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("name")
@click.option("--chunk-size", default="64MiB", show_default=True, help="Target chunk size.")
@click.option("--parallel", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Chunks uploaded at once (memory: about (N+1) x chunk size).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@data_command
def put(store: Any, src: Path, name: str, chunk_size: str, parallel: int, as_json: bool) -> None:
    """Pack DIR into chunks and store it as a new version of data set NAME.

    Prints the new version on stdout. Unchanged chunks of earlier versions are reused.
    """
    from hypermesh.chunkfs.pack import PutProgress, put_dataset

    display = _PutDisplay()
    counters: list[PutProgress] = []

    def progress(p: PutProgress) -> None:
        if not counters:
            counters.append(p)
        display(p)

    try:
        root = put_dataset(
            store, src, name, chunk_size=_size(chunk_size), parallel=parallel, progress=progress
        )
    finally:
        display.close()
    p = counters[0] if counters else PutProgress()
    elapsed = time.monotonic() - p.started
    summary = {
        "name": root.name,
        "version": root.version,
        "spec": f"{root.name}@{root.version}",
        "files": root.files,
        "dirs": root.dirs,
        "bytes": root.bytes,
        "chunks": len(root.chunks),
        "chunks_uploaded": p.chunks_uploaded,
        "chunks_existing": p.chunks_existing,
        "bytes_uploaded": p.bytes_uploaded,
        "seconds": round(elapsed, 3),
    }
    click.echo(
        f"put {root.name}@{root.version}: {root.files} files, {human_size(root.bytes)} in "
        f"{len(root.chunks)} chunks ({p.chunks_uploaded} uploaded, {p.chunks_existing} "
        f"already stored) in {elapsed:.1f}s",
        err=True,
    )
    if as_json:
        print_json(summary)
    else:
        click.echo(root.version)


# ----------------------------------------------------------------------------- ls
def _version_row(root: Any) -> dict[str, Any]:
    return {
        "name": root.name,
        "version": root.version,
        "created_ns": root.created_ns,
        "files": root.files,
        "dirs": root.dirs,
        "bytes": root.bytes,
        "chunks": len(root.chunks),
        "chunk_size": root.chunk_size,
    }


@data.command("ls")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@data_command
def ls(store: Any, name: str | None, as_json: bool) -> None:
    """List data sets with their newest version; with NAME, list its versions."""
    from hypermesh.chunkfs.datasets import (
        list_datasets,
        list_versions,
        load_root,
        parse_spec,
        resolve,
    )
    from hypermesh.errors import NotFound

    if name is None:
        rows = []
        for ds in list_datasets(store):
            row = _version_row(resolve(store, ds))
            row["versions"] = len(list_versions(store, ds))
            rows.append(row)
        if as_json:
            print_json(rows)
            return
        if not rows:
            click.echo("no data sets", err=True)
            return
        click.echo(f"{'NAME':<24}{'NEWEST VERSION':<38}{'VERSIONS':>9}{'FILES':>10}{'SIZE':>12}")
        for r in rows:
            click.echo(
                f"{r['name']:<24}{r['version']:<38}{r['versions']:>9}{r['files']:>10}"
                f"{human_size(r['bytes']):>12}"
            )
        return
    base, version = parse_spec(name)
    versions = [version] if version else list_versions(store, base)
    if not versions:
        raise NotFound(f"data set {base!r} not found in {store.url}")
    rows = [_version_row(load_root(store, base, v)) for v in versions]
    if as_json:
        print_json(rows)
        return
    click.echo(f"{'VERSION':<38}{'FILES':>10}{'DIRS':>8}{'SIZE':>12}{'CHUNKS':>8}")
    for r in rows:
        click.echo(
            f"{r['version']:<38}{r['files']:>10}{r['dirs']:>8}{human_size(r['bytes']):>12}"
            f"{r['chunks']:>8}"
        )


# ----------------------------------------------------------------------------- rm, get
@data.command("rm")
@click.argument("spec", metavar="NAME[@VERSION]")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@data_command
def rm(store: Any, spec: str, as_json: bool) -> None:
    """Remove one version (NAME@VERSION) or every version (NAME) of a data set.

    Chunks and pages no other version uses are deleted too. Do not run it while a
    put to the same store is in progress (see the docs).
    """
    from hypermesh.chunkfs.datasets import remove

    result = remove(store, spec)
    if as_json:
        print_json(
            {
                "removed": list(result.versions),
                "chunks_deleted": result.chunks_deleted,
                "pages_deleted": result.pages_deleted,
            }
        )
        return
    name = spec.partition("@")[0]
    for v in result.versions:
        click.echo(f"removed {name}@{v}", err=True)
    click.echo(
        f"deleted {result.chunks_deleted} unused chunks, {result.pages_deleted} pages", err=True
    )


@data.command("get")
@click.argument("spec", metavar="NAME[@VERSION]")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--parallel", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Chunks downloaded at once.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@data_command
def get(store: Any, spec: str, dest: Path, parallel: int, as_json: bool) -> None:
    """Download a data set version into DEST (new or empty), verifying every byte."""
    from hypermesh.chunkfs.datasets import get_dataset

    started = time.monotonic()
    root = get_dataset(store, spec, dest, parallel=parallel)
    elapsed = time.monotonic() - started
    if as_json:
        print_json({**_version_row(root), "dest": str(dest), "seconds": round(elapsed, 3)})
        return
    click.echo(
        f"got {root.name}@{root.version}: {root.files} files, {human_size(root.bytes)} "
        f"into {dest} in {elapsed:.1f}s",
        err=True,
    )


# ----------------------------------------------------------------------------- mount
@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def mount(args: tuple[str, ...]) -> None:
    """Mount a data set with FUSE (see `hypermesh mount --help`)."""
    # Imported on use: the FUSE and S3 stack would add 0.2 s to every other command.
    from hypermesh.chunkfs.mount import mount as mount_command

    # A command of its own (its own context), so it takes -h only when told, as the others do.
    mount_command.main(
        args=list(args), prog_name="hypermesh mount", help_option_names=["-h", "--help"]
    )
