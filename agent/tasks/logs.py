"""Attempt logs that outlive their node: copies in the object store, and one reader.

An agent writes each attempt's output to ``WORK_DIR/attempts/WID/EXPERIMENT.INDEX.N.log``.
With an object store (``--store``) it also copies the log there: every
``log_upload_s`` seconds while the attempt runs (only when the log grew), and
once more when it ends. The copy is at ``logs/<namespace>/<wid>/<exp>/<index>/<n>.log``
under the store's prefix, beside the data sets, so that any node (or the CLI,
or the dashboard) can read a log after the attempt's node died. Without a store
a log lives only on its node's disk and is gone with it.

``stream_log`` is the one reader: it asks the node that ran the attempt (which
also follows a running attempt live) and falls back to the stored copy when the
node is gone, does not answer or no longer has the file.

The shipper also copies, at an attempt's end, the TensorBoard event files of a task
without data (``HM_TENSORBOARD_DIR`` in the workflow's workdir, which may be on this
node only) to where a mount stores those of tasks with data,
``outputs/tensorboard/<task id>/`` (``hypermesh/task_outputs.py``): ``hypermesh
tensorboard`` reads both there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from hypermesh._proto import agent_pb2, agent_pb2_grpc
from hypermesh.channels import agent_channel
from hypermesh.errors import HypermeshError, NoSuchObject, NotFound
from hypermesh.state.block_txns import block_view, read_block
from hypermesh.state.etcd import Etcd
from hypermesh.state.keyspace import BlockRef, Keyspace, TaskRef
from hypermesh.state.view import MeshView
from hypermesh.task_outputs import store_prefix

if TYPE_CHECKING:
    from hypermesh.chunkfs.store import ObjectStore
    from hypermesh.tls import TlsFiles

log = logging.getLogger(__name__)

ENV_STORE = "HYPERMESH_STORE"
# gRPC codes after which the stored copy is the best there is.
_NODE_GONE = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


EVENT_FILES_MAX = 1 << 30
"""Bytes of a task's event files that one attempt's end copies to the store at most
(1 GiB): a run of scalars is kilobytes to megabytes, so more is most likely images or
histograms written every step; the files beyond it stay on the node, and a warning
names them. Each attempt copies again the whole folder, skipping files stored at
their size already, so the cost is one listing and what grew."""


def copy_event_files(
    store: ObjectStore, folder: str | Path, task_id: str, limit: int = EVENT_FILES_MAX
) -> tuple[int, list[str]]:
    """Copy the files under ``folder`` (a task's ``HM_TENSORBOARD_DIR``) to
    ``outputs/tensorboard/<task_id>/<path in folder>`` in ``store``, in name order, a
    file the store has at the same size skipped. Those past ``limit`` bytes in all are
    left out (and warned of). Returns (bytes uploaded, paths left out). Blocking."""
    top = Path(folder)
    files = sorted(p for p in top.rglob("*") if p.is_file() and not p.is_symlink())
    total, copied, left_out = 0, 0, []
    for path in files:
        rel = path.relative_to(top).as_posix()
        size = path.stat().st_size
        total += size
        if total > limit:
            left_out.append(rel)
            continue
        key = f"{store_prefix(task_id)}/{rel}"
        if store.size(key) != size:
            store.put_file(key, path)
            copied += size
    if left_out:
        log.warning("%s: its event files in %s are over %d MiB (EVENT_FILES_MAX): %d "
                    "file(s) not copied to the store, and not served by hypermesh "
                    "tensorboard from there: %s", task_id, top, limit >> 20,
                    len(left_out), ", ".join(left_out[:5])
                    + (" ..." if len(left_out) > 5 else ""))
    return copied, left_out


def log_key(namespace: str, ref: TaskRef, attempt: int) -> str:
    """Where an attempt's log is copied in the object store (under its prefix)."""
    return f"logs/{namespace}/{ref.path}/{attempt}.log"


class LogShipper:
    """Copies attempt logs to the object store. Owned by the agent's event loop;
    uploads run in threads. Does nothing (and costs nothing) without a store."""

    def __init__(
        self, store_url: str | None, namespace: str, interval: float,
        event_files_max: int = EVENT_FILES_MAX,
    ) -> None:
        self.store_url = store_url
        self.namespace = namespace
        self.interval = interval
        self.event_files_max = event_files_max
        self._store: ObjectStore | None = None
        self._lock = threading.Lock()
        self._pending: set[asyncio.Task[bool]] = set()

    @property
    def enabled(self) -> bool:
        return self.store_url is not None

    def _open(self) -> ObjectStore:
        with self._lock:  # the first uploads may race to open it
            if self._store is None:
                from hypermesh.chunkfs.store import open_store

                self._store = open_store(self.store_url)
            return self._store

    async def copy(self, ref: TaskRef, attempt: int, path: str | Path) -> bool:
        """Upload the log as it is now; False (and a warning) if that failed."""
        key = log_key(self.namespace, ref, attempt)
        try:
            await asyncio.to_thread(lambda: self._open().put_file(key, Path(path)))
            return True
        except (HypermeshError, OSError) as exc:
            log.warning("copying the log of %s attempt %d to the store: %s", ref, attempt, exc)
            return False

    def while_running(
        self, ref: TaskRef, attempt: int, path: str | Path
    ) -> asyncio.Task[None] | None:
        """A task that copies the log every ``interval`` seconds while it grows;
        the caller cancels it when the attempt ends."""
        if not self.enabled:
            return None
        return asyncio.create_task(self._periodic(ref, attempt, path), name=f"log copy {ref}")

    async def _periodic(self, ref: TaskRef, attempt: int, path: str | Path) -> None:
        copied = -1
        while True:
            await asyncio.sleep(self.interval)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            if size != copied and await self.copy(ref, attempt, path):
                copied = size

    def after_end(self, ref: TaskRef, attempt: int, path: str | Path) -> None:
        """Copy the finished log in the background (``flush`` waits for it)."""
        if not self.enabled or not os.path.exists(path):
            return
        task = asyncio.create_task(self.copy(ref, attempt, path))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def events_after_end(self, ref: TaskRef, folder: str) -> None:
        """Copy the event files a task without data left in ``folder`` (its
        ``HM_TENSORBOARD_DIR``) to the store, in a thread (``flush`` waits for it)."""
        if not self.enabled or not os.path.isdir(folder):
            return
        task = asyncio.create_task(self._copy_events(ref, folder))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _copy_events(self, ref: TaskRef, folder: str) -> bool:
        try:
            await asyncio.to_thread(
                lambda: copy_event_files(self._open(), folder, ref.id, self.event_files_max))
            return True
        except (HypermeshError, OSError) as exc:
            log.warning("copying the event files of %s to the store: %s", ref, exc)
            return False

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for final copies still in flight, then close."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout)
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()


# ----------------------------------------------------------------------------- reading
KEYS_PER_READ = 4096
"""Block keys read at a time while looking for the block of a task."""


async def _block_of(etcd: Etcd, ks: Keyspace, ref: TaskRef) -> BlockRef | None:
    """The block holding task ``ref``, if its experiment was written in blocks: the one
    with the highest first index at or below the task's (read by keys, a page at a time:
    block keys sort as strings, not by number)."""
    prefix = ks.kind_prefix("block", ref.workflow) + ref.experiment + "/"
    best: int | None = None
    start: str | None = None
    while True:
        keys = await etcd.keys(prefix, KEYS_PER_READ, start)
        for key in keys:
            first = int(key.decode()[len(prefix):])
            if first <= ref.index and (best is None or first > best):
                best = first
        if len(keys) < KEYS_PER_READ:
            break
        start = keys[-1].decode() + "\0"
    return None if best is None else BlockRef(ref.workflow, ref.experiment, best)


async def locate_attempt(
    etcd: Etcd, ks: Keyspace, ref: TaskRef, attempt: int
) -> tuple[int, str, str | None]:
    """(attempt number, node that ran it, its address if it is still registered)."""
    kvs, _ = await etcd.get_prefix(ks.kind_prefix("attempt") + ref.path + "/")
    view = MeshView(ks)
    for kv in kvs:
        view.apply(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision)
    attempts = view.attempts.get(ref, {})
    if not attempts:  # a task of a block: its attempts are in the block's batches
        bref = await _block_of(etcd, ks, ref)
        if bref is not None:
            view = block_view(ks, await read_block(etcd, ks, bref))
            attempts = view.attempts.get(ref, {})
    if not attempts:
        wid, exp = ref.workflow, ref.experiment
        for key in (ks.workflow(wid), ks.expanded(wid, exp), ks.experiment_control(wid, exp)):
            found = await etcd.get(key)
            if found is not None:
                view.apply(key, found[0], 0, found[1])
        raise NotFound(view.no_such_task(ref) or f"task {ref} has not run yet (no attempts)")
    n = attempt or max(attempts)
    if n not in attempts:
        raise NotFound(f"task {ref} has no attempt {n} (attempts: {sorted(attempts)})")
    node = attempts[n].node
    found = await etcd.get(ks.node(node))
    return n, node, json.loads(found[0])["address"] if found else None


async def stream_log(
    etcd: Etcd,
    ks: Keyspace,
    ref: TaskRef,
    attempt: int = 0,
    follow: bool = False,
    store_url: str | None = None,
    note: Callable[[str], None] = lambda message: None,
    offset: int = 0,
    tls: TlsFiles | None = None,
) -> AsyncIterator[bytes]:
    """An attempt's log (``attempt`` 0: the latest), from its node or the stored copy.

    With ``follow``, keeps streaming from the node until the attempt ends; if the
    node dies meanwhile, the rest comes from the stored copy. ``note`` hears why
    the stored copy was used. ``offset`` skips that many bytes of the log; ``tls``:
    the files a connection to the node shows (None: plaintext). Raises
    ``NotFound`` when neither has the log.
    """
    n, node, address = await locate_attempt(etcd, ks, ref, attempt)
    sent = offset
    why = f"node {node}, which ran {ref} attempt {n}, is gone"
    if address is not None:
        async with agent_channel(address, tls) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            request = agent_pb2.ReadLogsRequest(
                task_id=ref.id, attempt=n, follow=follow, offset=offset
            )
            try:
                async for chunk in stub.ReadLogs(request):
                    sent += len(chunk.data)
                    yield chunk.data
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _NODE_GONE:
                    raise HypermeshError(f"node {node} at {address}: {exc.details()}") from exc
                why = f"node {node} at {address}: {exc.details() or exc.code().name}"
    store_url = store_url or os.environ.get(ENV_STORE) or None
    if store_url is None:
        raise NotFound(f"{why}; the log was only on its disk (no --store to read a copy from)")
    from hypermesh.chunkfs.store import open_store

    key = log_key(ks.namespace, ref, n)

    def read() -> bytes:
        with open_store(store_url) as store:
            return store.get(key)

    try:
        data = await asyncio.to_thread(read)
    except NoSuchObject as exc:
        raise NotFound(f"{why}; the store has no copy of its log ({key})") from exc
    note(f"{why}; showing the copy in the store")
    if len(data) > sent:
        yield data[sent:]
