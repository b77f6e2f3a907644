"""``hypermesh tensorboard``: a workflow's TensorBoard event files, one run per trial, served
by the ``tensorboard`` package on this machine.

The event files are where ``HM_TENSORBOARD_DIR`` points (``hypermesh/task_outputs.py``):
in the object store for tasks with data; in the workflow's workdir for the others, which
an agent with a store copies to the same place in the store at each attempt's end. The
command reads both (a file in both: the larger copy) and copies them into one local
folder (the *logdir*), a subfolder per task named for its trial (``sweep.3 lr=0.01,l2=0``,
``run_name``), and copies again every ``--sync`` seconds what grew since, by appending
the new bytes: event files only grow, and a file TensorBoard holds open must keep its
inode for it to see more records.

TensorBoard runs in this process (its own thread, and the ``tensorboard-data-server``
child it may start); the command ends on Ctrl-C or SIGTERM, stops what it started and
removes the temporary logdir. TensorBoard has no login, so like an agent's plaintext
listeners (``hypermesh/exposure.py``) it listens beyond loopback only with ``--insecure``,
and warns then.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from hypermesh.cli.common import Mesh, err, load_view, mesh_options, print_json, run_async
from hypermesh.errors import HypermeshError, UsageError
from hypermesh.exposure import is_loopback
from hypermesh.local.processes import stop_processes
from hypermesh.state.view import MeshView
from hypermesh.task_outputs import STORE_PREFIX, WORKDIR_FOLDER, store_prefix

log = logging.getLogger(__name__)

SYNC_S = 30.0
"""Seconds between two copies of what grew (``--sync``): TensorBoard itself reloads its
logdir every 5 s; a copy lists the store prefix and asks each file's size."""
READ_WINDOW = 8 << 20
"""Bytes fetched per ranged GET of an event file."""
RUN_NAME_CHARS = 200
"""Longest run (folder) name; a longer name is cut, its task id always kept."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+@ -]")
_MARKER = ".chunkfs-dir"  # a directory object of the outputs area, not a file


def run_name(experiment: str, index: int, params: dict[str, Any]) -> str:
    """The folder (TensorBoard run) of one trial: ``EXPERIMENT.INDEX`` and its parameters
    as ``k=v`` joined by commas, with every character but letters, digits and
    ``._=,+@ -`` replaced by ``_`` (a value may hold ``/`` or anything else), at most
    ``RUN_NAME_CHARS`` long. Unique within a workflow: the task index is in it."""
    head = f"{experiment}.{index}"
    if not params:
        return head
    values = ",".join(f"{k}={v}" for k, v in params.items())
    return _UNSAFE.sub("_", f"{head} {values}")[:RUN_NAME_CHARS].rstrip()


def trial_runs(view: MeshView, wid: str, experiment: str | None) -> dict[str, str]:
    """Task id -> run name for every task of ``wid`` (of ``experiment`` only, if given)."""
    names = [e.name for e in view.workflows[wid].recipe.experiments]
    if experiment is not None and experiment not in names:
        raise UsageError(f"workflow {wid} has no experiment {experiment!r} "
                         f"(its experiments: {', '.join(names)})")
    return {
        ref.id: run_name(ref.experiment, ref.index, view.tasks.get(ref, {}).get("params", {}))
        for ref in view.task_refs(wid, experiment)
    }


def _safe_relative(rel: str) -> bool:
    """Whether a path found under a task's folder stays inside it when joined."""
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and parts[-1] != _MARKER


def _grow(local: Path, size: int, read: Callable[[int, int], bytes]) -> int:
    """Make ``local`` hold the ``size`` bytes that ``read(start, length)`` gives: append
    what it lacks (a file that shrank, rewritten, is read again whole). Bytes copied."""
    have = local.stat().st_size if local.exists() else 0
    if have == size:
        return 0
    if have > size:
        have = 0
        local.unlink()
    local.parent.mkdir(parents=True, exist_ok=True)
    copied = 0
    with open(local, "ab") as f:
        while have + copied < size:
            chunk = read(have + copied, min(READ_WINDOW, size - have - copied))
            if not chunk:
                break
            f.write(chunk)
            copied += len(chunk)
    return copied


def _read_file(path: Path) -> Callable[[int, int], bytes]:
    def read(start: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(length)

    return read


def _read_object(store: Any, key: str) -> Callable[[int, int], bytes]:
    def read(start: int, length: int) -> bytes:
        return bytes(store.get_range(key, start, length))

    return read


@dataclass
class Gatherer:
    """Copies the event files of a workflow's trials into ``logdir``, a run per trial.

    ``runs`` maps task ids to run names; ``store`` (an ``ObjectStore``, or None) holds
    the files of tasks with data and the copies of the others' made at attempt ends,
    ``workdir`` (or None where it is not on this machine) the others' as they grow.
    Only ``sync`` changes ``logdir``; one caller at a time."""

    logdir: Path
    wid: str
    runs: dict[str, str]
    store: Any = None
    workdir: Path | None = None
    files: set[Path] = field(default_factory=set)

    def _target(self, task_id: str, rel: str) -> Path | None:
        run = self.runs.get(task_id)
        if run is None or not _safe_relative(rel):
            return None
        return self.logdir / run / rel

    def _store_files(self) -> Iterator[tuple[Path, int, Callable[[int, int], bytes]]]:
        for key in self.store.list(store_prefix(f"{self.wid}.")):
            task_id, _, rel = key[len(STORE_PREFIX):].partition("/")
            target = self._target(task_id, rel)
            size = self.store.size(key) if target is not None else None
            if target is not None and size is not None:
                yield target, size, _read_object(self.store, key)

    def _workdir_files(self) -> Iterator[tuple[Path, int, Callable[[int, int], bytes]]]:
        assert self.workdir is not None
        for task_id in self.runs:
            top = self.workdir / WORKDIR_FOLDER / task_id
            if not top.is_dir():
                continue
            for folder, _, names in os.walk(top):
                for name in names:
                    path = Path(folder) / name
                    target = self._target(task_id, path.relative_to(top).as_posix())
                    if target is not None and path.is_file():
                        yield target, path.stat().st_size, _read_file(path)

    def sync(self) -> int:
        """Copy what is new or grew since the last call; the bytes copied."""
        found: dict[Path, tuple[int, Callable[[int, int], bytes]]] = {}
        sources = []
        if self.store is not None:
            sources.append(self._store_files())
        if self.workdir is not None:
            sources.append(self._workdir_files())
        for source in sources:
            for target, size, read in source:
                # A file of a task without data is in its workdir and, once an attempt
                # ended, in the store too: the larger is the newer (event files grow).
                if target not in found or size > found[target][0]:
                    found[target] = (size, read)
        copied = 0
        for target, (size, read) in found.items():
            copied += _grow(target, size, read)
            self.files.add(target)
        return copied

    def run_folders(self) -> list[str]:
        """The runs that have at least one file, by name."""
        return sorted({p.relative_to(self.logdir).parts[0] for p in self.files})


def _children_stop(timeout: float = 5.0) -> None:
    """Stop the processes this one started (TensorBoard's data server), by pid."""
    import psutil

    stop_processes(psutil.Process().children(recursive=True), timeout)


def _launch(logdir: Path, host: str, port: int) -> str:
    """Start TensorBoard on ``logdir`` in a thread of this process; its URL."""
    try:
        from tensorboard import program
    except ImportError as exc:
        raise HypermeshError(
            "the tensorboard package is not installed here: pip install tensorboard"
        ) from exc
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    tb = program.TensorBoard()
    tb.configure(argv=[
        "tensorboard", "--logdir", str(logdir), "--host", host, "--port", str(port),
        "--reload_interval", "5",
    ])
    try:
        return str(tb.launch())
    except program.TensorBoardServerException as exc:
        raise HypermeshError(f"TensorBoard could not start: {exc.msg}") from exc


def _serve(gatherer: Gatherer, host: str, port: int, sync_s: float, as_json: bool) -> None:
    """Serve until SIGINT or SIGTERM, copying what grew every ``sync_s`` seconds."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        url = _launch(gatherer.logdir, host, port)
        if as_json:  # stdout: what a script or a test reads
            print_json({"url": url, "logdir": str(gatherer.logdir),
                        "runs": gatherer.run_folders()})
        else:
            click.echo(url)
        sys.stdout.flush()
        err(f"TensorBoard on {url} with {len(gatherer.run_folders())} run(s) from "
            f"{gatherer.logdir}; Ctrl-C stops it")
        while not stop.wait(sync_s):
            try:
                gatherer.sync()
            except (HypermeshError, OSError) as exc:  # the store away a while: try again
                log.warning("copying event files: %s", exc)
    finally:
        _children_stop()


@click.command()
@click.argument("workflow")
@click.option("--experiment", default=None, help="Only this experiment's trials.")
@click.option("--store", "store_url", envvar="HYPERMESH_STORE", metavar="URL",
              help="The agents' object store (where their tasks' event files are stored): "
              "s3://BUCKET[/PREFIX] or file:///PATH [env HYPERMESH_STORE].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Where TensorBoard listens; beyond loopback only with --insecure.")
@click.option("--port", default=6006, show_default=True, type=click.IntRange(0, 65535),
              help="TensorBoard's port (0: any free one).")
@click.option("--insecure", is_flag=True,
              help="Let TensorBoard (no login, plain HTTP) listen beyond loopback.")
@click.option("--logdir", "logdir_path", default=None, type=click.Path(path_type=Path),
              help="Copy into this folder, and keep it [default: a temporary folder, "
              "removed at the end].")
@click.option("--logdir-only", is_flag=True,
              help="Copy the event files, print the folder and exit; no server.")
@click.option("--sync", "sync_s", default=SYNC_S, show_default=True,
              type=click.FloatRange(min=1.0), help="Seconds between copies of what grew.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {url, logdir, runs} (with --logdir-only: {logdir, runs}).")
@mesh_options
@run_async
async def tensorboard(
    mesh: Mesh, workflow: str, experiment: str | None, store_url: str | None, host: str,
    port: int, insecure: bool, logdir_path: Path | None, logdir_only: bool, sync_s: float,
    as_json: bool,
) -> None:
    """Serve WORKFLOW's TensorBoard event files ($HM_TENSORBOARD_DIR of its tasks), one
    run per trial named by its parameters. Prints the URL on stdout; Ctrl-C stops it."""
    if not logdir_only and not is_loopback(f"{host}:{port}"):
        if not insecure:
            raise UsageError(f"--host {host}: TensorBoard has no login and speaks plain "
                             "HTTP; it listens beyond loopback only with --insecure")
        err(f"warning: TensorBoard listens on {host}:{port} without login or TLS: "
            "anyone who reaches it reads every run")
    async with mesh.connect() as etcd:
        view = await load_view(etcd, mesh.ks, workflow)  # NotFound: exit 1
    runs = trial_runs(view, workflow, experiment)
    wf = view.workflows[workflow]
    with_data = [e.name for e in wf.recipe.experiments
                 if e.data and experiment in (None, e.name)]
    store = None
    if store_url or os.environ.get("HYPERMESH_STORE"):
        from hypermesh.chunkfs.store import open_store

        store = open_store(store_url)
    elif with_data:
        err(f"warning: no --store: the event files of {', '.join(with_data)} (tasks with "
            "data) are in the agents' object store and are left out")
    workdir = Path(wf.workdir) if wf.workdir and Path(wf.workdir).is_dir() else None
    if store is None and workdir is None:
        err(f"warning: no --store, and the workdir {wf.workdir} is not on this machine: "
            "only the store has the event files of tasks without data")
    temporary = logdir_path is None and not logdir_only
    logdir = logdir_path or Path(tempfile.mkdtemp(prefix=f"hm-tensorboard-{workflow}-"))
    logdir.mkdir(parents=True, exist_ok=True)
    gatherer = Gatherer(logdir, workflow, runs, store, workdir)
    try:
        gatherer.sync()
        if not gatherer.files:
            err(f"warning: no event files of {workflow} yet"
                + ("" if logdir_only else f"; looking again every {sync_s:g} s"))
        if logdir_only:
            if as_json:
                print_json({"logdir": str(logdir), "runs": gatherer.run_folders()})
            else:
                click.echo(str(logdir))
            return
        _serve(gatherer, host, port, sync_s, as_json)
    finally:
        if store is not None:
            store.close()
        if temporary:
            shutil.rmtree(logdir, ignore_errors=True)
