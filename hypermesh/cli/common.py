"""What the commands share: where the mesh is, how a command runs, how it prints.

- ``Mesh`` and ``mesh_options``: the ``--etcd`` and ``--namespace`` options every command
  takes (also accepted before the command name), resolved against the environment;
- ``override_option``: ``--set EXP.FIELD=VALUE``, for the commands that load a recipe;
- ``run_async``: runs an async command and turns hypermesh errors into a message on
  stderr and the exit code (2 bad input, 1 a failure at run time); the agent's loop is
  uvloop's (``agent_loop_runner``);
- ``load_view``: the records of a namespace, or of one workflow, read from etcd;
- ``task_rows`` and ``listed_total``: ``tasks``' rows of a workflow, streamed a batch of
  tasks at a time, and how many there are;
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
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container, Coroutine
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

import click
from etcd3aio._protobuf import RangeRequest, RequestOp

from hypermesh.cli.tls_options import ETCD_PARAMS, TLS_PARAMS, etcd_options, tls_options
from hypermesh.config import ENV_ETCD, ENV_NAMESPACE, default_etcd, default_namespace
from hypermesh.errors import HypermeshError, NotFound, RecipeError, UsageError
from hypermesh.etcd_endpoints import parse_endpoints
from hypermesh.etcd_security import PLAINTEXT, EtcdSecurity
from hypermesh.recipe.recipe import MAX_BLOCK
from hypermesh.state.etcd import MAX_TXN_OPS, Etcd
from hypermesh.state.keyspace import Keyspace, TaskRef
from hypermesh.state.view import BLOCKS_PER_READ, MeshView, load_view  # noqa: F401  (the CLI's import)
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


ENV_EVENT_LOOP = "HYPERMESH_EVENT_LOOP"
"""``asyncio`` runs the agent on asyncio's own event loop instead of uvloop's."""


def agent_loop_runner() -> Callable[[Coroutine[Any, Any, T]], T]:
    """How the agent runs its loop: ``uvloop.run`` (libuv's loop, its bookkeeping in C),
    or ``asyncio.run`` where uvloop is not installed or ``HYPERMESH_EVENT_LOOP=asyncio``.

    An agent wakes for every process exit, etcd reply and gossip message; on uvloop
    each wake-up costs less of the agent's own CPU: 0.92x the CPU per task at 4 x 4,
    0.85x at 32 x 1 (docs/benchmarks.md, "The agents on uvloop"). Any other value
    of the variable is refused: a typo should not silently pick a loop."""
    choice = os.environ.get(ENV_EVENT_LOOP, "uvloop").strip().lower() or "uvloop"
    if choice == "asyncio":
        return asyncio.run
    if choice != "uvloop":
        raise UsageError(f"{ENV_EVENT_LOOP}={choice!r}: expected uvloop or asyncio")
    try:
        import uvloop
    except ImportError:  # an install without it (not a platform uvloop supports)
        return asyncio.run
    return uvloop.run


def run_async(
    fn: Callable[..., Coroutine[Any, Any, T]], *, agent_loop: bool = False
) -> Callable[..., T]:
    """Run an async command; turn hypermesh errors into messages and exit codes.
    ``agent_loop``: on the loop ``agent_loop_runner`` picks (the agent), else asyncio's
    (a command's few round trips gain nothing from uvloop, and skip importing it)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            run = agent_loop_runner() if agent_loop else asyncio.run
            return _profiled(run, fn(*args, **kwargs))
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


TASKS_PER_READ = 2048
"""Tasks ``task_rows`` reads and turns into rows at a time (about 2 KB each in a view):
what a listing holds in memory, whatever the workflow's size."""

_PER_TASK_KINDS = ("task", "claim", "result", "attempt", "metrics", "gang")
_LEAF_KINDS = ("task", "claim", "result", "block", "bclaim")  # one key per task or block


@dataclass
class ReadTally:
    """What ``task_rows`` read: requests made and keys received (tests bound them)."""

    requests: int = 0
    keys: int = 0


class _Reader:
    """Range reads of one workflow at one revision, batched into read-only transactions
    (``MAX_TXN_OPS`` ranges each), counted in ``tally``."""

    def __init__(self, etcd: Etcd, ks: Keyspace, wid: str, tally: ReadTally) -> None:
        self.etcd, self.ks, self.wid, self.tally = etcd, ks, wid, tally
        self.at = 0

    def op(self, key: str, end: str | None = None, *, keys_only: bool = False,
           limit: int = 0) -> Any:
        return RequestOp(request_range=RangeRequest(
            key=key.encode(), range_end=end.encode() if end else b"", revision=self.at,
            keys_only=keys_only, limit=limit))

    def unit_op(self, kind: str, exp: str, index: int) -> Any:
        """The keys of one task (or block) of ``kind``: the key itself, or those below it."""
        key = f"{self.ks.kind_prefix(kind, self.wid)}{exp}/{index}"
        return self.op(key) if kind in _LEAF_KINDS else self.op(f"{key}/", f"{key}0")

    async def read(self, ops: list[Any]) -> list[Any]:
        """The key-values of every range in ``ops``, in order."""
        out: list[Any] = []
        for i in range(0, len(ops), MAX_TXN_OPS):
            done = await self.etcd.txn([], ops[i : i + MAX_TXN_OPS])
            self.tally.requests += 1
            self.at = self.at or done.revision
            for response in done.responses:
                out += response.response_range.kvs
        self.tally.keys += len(out)
        return out

    async def present(self, kind: str, exp: str) -> bool:
        """Whether the experiment has any key of ``kind``."""
        prefix = f"{self.ks.kind_prefix(kind, self.wid)}{exp}/"
        return bool(await self.read([self.op(prefix, _end(prefix), keys_only=True, limit=1)]))

    async def block_firsts(self, exp: str) -> list[int]:
        """The first indices of the experiment's blocks, in order (keys only: a few bytes
        per block of up to 256 tasks)."""
        prefix = f"{self.ks.kind_prefix('block', self.wid)}{exp}/"
        firsts: list[int] = []
        start = prefix
        while True:
            kvs = await self.read([self.op(start, _end(prefix), keys_only=True, limit=4096)])
            firsts += (int(kv.key.decode()[len(prefix):]) for kv in kvs)
            if len(kvs) < 4096:
                return sorted(firsts)
            start = kvs[-1].key.decode() + "\0"


def _end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


async def task_rows(
    etcd: Etcd, ks: Keyspace, wid: str, experiment: str | None = None,
    tally: ReadTally | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """``hypermesh tasks``' rows of a workflow (or of one experiment), ``task_rows`` of
    ``MeshView`` as a stream: in id order (experiments by name, tasks by index), read at
    one revision ``TASKS_PER_READ`` tasks at a time, each batch of rows made from a view
    of its own tasks' records and dropped once yielded. Memory is bounded whatever the
    workflow's size (besides the block starts, a few bytes per block), and a caller that
    stops early (``--limit``) reads no further. Raises NotFound for an unknown workflow.

    Indices sort as numbers, their keys as strings (``task/W/E/10`` before ``.../9``), so
    a range of keys is not a range of tasks: tasks are read by their own keys, batched
    into transactions (per-task kinds the experiment has none of are skipped), and
    blocks (up to 256 tasks each) by theirs, from the list of block starts."""
    reader = _Reader(etcd, ks, wid, tally or ReadTally())
    async for base, exp, count, unwritten in _listed_experiments(reader, experiment):
        async for rows in _experiment_rows(reader, base, exp, count, unwritten):
            for row in rows:
                yield row


async def listed_total(etcd: Etcd, ks: Keyspace, wid: str, experiment: str | None = None) -> int:
    """How many rows ``task_rows`` yields, without reading them: per experiment its task
    count where never-written tasks are listed, else its ``expanded`` count (batched)
    or the number of its task keys (counted by etcd). For ``--limit``'s note."""
    reader = _Reader(etcd, ks, wid, ReadTally())
    total = 0
    async for _, exp, count, unwritten in _listed_experiments(reader, experiment):
        if unwritten or await reader.present("block", exp):
            total += count
        else:
            prefix = f"{ks.kind_prefix('task', wid)}{exp}/"
            done = await etcd.txn([], [RequestOp(request_range=RangeRequest(
                key=prefix.encode(), range_end=_end(prefix).encode(), revision=reader.at,
                count_only=True))])
            total += int(done.responses[0].response_range.count)
    return total


async def _listed_experiments(
    reader: _Reader, experiment: str | None
) -> AsyncIterator[tuple[MeshView, str, int, bool]]:
    """The experiments ``tasks`` lists, by name: a view of the workflow's own records,
    the name, how many tasks it lists (``0..count-1``), and whether those never written
    are listed (as cancelled: its workflow or itself was cancelled, or a dependency
    failed, before they were). Raises NotFound for an unknown workflow."""
    etcd, ks, wid = reader.etcd, reader.ks, reader.wid
    base = MeshView(ks)
    header = [reader.op(ks.workflow(wid)), reader.op(ks.workflow_state(wid))]
    header += [reader.op(p, _end(p)) for p in (ks.kind_prefix("expanded", wid),
                                               ks.kind_prefix("expctl", wid), ks.nodes)]
    for kv in await reader.read(header):
        base.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    if wid not in base.workflows:
        raise NotFound(f"no workflow {wid!r} in namespace {ks.namespace!r}")
    wf = base.workflows[wid]
    summaries: MeshView | None = None  # the folded view, read if a dependency decides
    for exp in sorted(wf.recipe.experiments, key=lambda e: e.name):
        if experiment is not None and exp.name != experiment:
            continue
        expanded = base.expanded.get((wid, exp.name))
        stopped = base.workflow_state(wid) == "cancelled" or base.experiment_cancelled(
            wid, exp.name)
        if expanded is None and not stopped and exp.after:  # blocked by a dependency?
            summaries = summaries or await load_view(etcd, ks, wid, fold=True)
            stopped = any(summaries.experiment_summary(wf, wf.recipe.experiment(d)).state
                          in ("failed", "cancelled") for d in exp.after)
        if expanded is None and not stopped:
            yield base, exp.name, 0, False  # what is written of it so far, if anything
        else:
            yield base, exp.name, max(expanded or 0, base.target_count(wid, exp)), stopped


async def _experiment_rows(
    reader: _Reader, base: MeshView, exp: str, count: int, unwritten: bool
) -> AsyncIterator[list[dict[str, Any]]]:
    """The rows of one experiment's tasks, in index order, a batch of tasks at a time:
    those written (tasks ``0..count-1``, or its blocks' tasks) and, when ``unwritten``,
    those of ``0..count-1`` never written (listed as cancelled)."""
    wid, ks = reader.wid, reader.ks
    kinds = [k for k in _PER_TASK_KINDS if await reader.present(k, exp)]
    firsts = await reader.block_firsts(exp) if await reader.present("block", exp) else []
    per_read = max(1, TASKS_PER_READ // MAX_BLOCK)  # blocks in one read
    batches_first = f"{ks.root}bdone/".encode()
    lo, b = 0, 0  # the next task, the next block
    while lo < count or b < len(firsts):
        mine = firsts[b : b + per_read]
        b += len(mine)
        if b < len(firsts):
            hi = firsts[b]
        elif mine:  # the last blocks: up to the end of the last one, at most
            hi = max(count, mine[-1] + MAX_BLOCK)
        else:
            hi = min(count, lo + TASKS_PER_READ)
        ops = [reader.unit_op(k, exp, i) for i in range(lo, hi) for k in kinds]
        ops += [reader.unit_op(k, exp, f) for f in mine for k in ("block", "bclaim", "bdone")]
        view = MeshView(ks)  # of these tasks, with the workflow's records shared
        for name in ("nodes", "workflows", "workflow_states", "workflow_reasons", "controls",
                     "expanded"):
            setattr(view, name, getattr(base, name))
        kvs = await reader.read(ops)
        kvs.sort(key=lambda kv: not kv.key.startswith(batches_first))  # as load_view does
        for kv in kvs:
            view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
        rows = []
        for index in range(lo, hi):
            ref = TaskRef(wid, exp, index)
            if ref in view.tasks:
                rows.append(view.task_json(ref))
            elif unwritten and index < count:
                rows.append({"id": ref.id, "experiment": exp, "index": index, "params": {},
                             "state": "cancelled", "node": None, "attempts": [],
                             "metrics": {}, "pruned": False})
        yield rows
        lo = hi
