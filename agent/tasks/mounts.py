"""The data sets an agent has mounted for its tasks: one chunkfs mount per data set.

A task whose experiment names ``data: {ALIAS: DATASET[@VERSION]}`` starts only once
every one of those data sets is mounted on this node; the first task to need a data
set mounts it (in a child process, ``chunkfs/mount.py``), later tasks share the mount.
Mounts live until the agent stops. ``DATASET`` alone is resolved to its newest version
when it is first mounted on this node, and stays that version for the mount's life.

Each mount has its own cache directory under ``WORK_DIR/chunkfs/``. Every mount of one
store shows the same writable ``.out/`` area, which is where checkpoints go
(:meth:`Mounts.checkpoint_dir`): a task preempted here finds its checkpoint on the
node that runs it next.

Owned by the :class:`~hypermesh.agent.daemon.Agent`; only its event loop calls in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hypermesh.channels import is_unix
from hypermesh.chunkfs.holdings import Holding, read_reads, scan, scan_root
from hypermesh.chunkfs.mount import MountProcess
from hypermesh.errors import HypermeshError, UsageError
from hypermesh.tls import TlsFiles

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._@-]")


@dataclass(frozen=True)
class CacheScan:
    """One chunk cache of this node as its records said at one scan: the data set it
    caches (the spec its mount was made for), what it holds, and the blocks its
    mount's reads were served, by source (``cache``, ``peer``, ``store``)."""

    dataset: str
    held: dict[str, Holding]
    reads: dict[str, int]

    @property
    def cached_bytes(self) -> int:
        return sum(h.present_bytes for h in self.held.values())


class Mounts:
    """Mount points by data set spec, created on first use, stopped by :meth:`close`."""

    def __init__(
        self, work_dir: Path, store_url: str | None, cache_size: str, deadline: str
    ) -> None:
        self.root = work_dir / "chunkfs"
        self.store_url = store_url
        self.cache_size = cache_size
        self.deadline = deadline
        # Where mounts ask for chunks from peers, set once serving: the agent's Unix
        # socket (unix:PATH), or its TCP address where it has none.
        self.agent_address = ""
        self.tls: TlsFiles | None = None  # the agent's TLS files, lent to mounts over TCP
        self._mounts: dict[str, asyncio.Task[MountProcess]] = {}

    async def ensure(self, spec: str) -> Path:
        """The mount point of ``spec``, mounting it first if this node has not.

        Raises ``UsageError`` when the agent has no store, and ``HypermeshError`` (with
        the mount's own message) when the mount fails; a failed mount is tried again
        by the next task that needs it.
        """
        if self.store_url is None:
            raise UsageError(
                f"this agent has no object store (--store or HYPERMESH_STORE) to mount {spec!r}"
            )
        task = self._mounts.get(spec)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.create_task(asyncio.to_thread(self._start, spec), name=f"mount {spec}")
            self._mounts[spec] = task
        mount = await asyncio.shield(task)
        return mount.mountpoint

    def _start(self, spec: str) -> MountProcess:
        name = _UNSAFE.sub("_", spec)
        mountpoint = self.root / "mnt" / name
        _clear_stale(mountpoint)
        mountpoint.mkdir(parents=True, exist_ok=True)
        tls = None if is_unix(self.agent_address) else self.tls  # a socket needs none
        mount = MountProcess(
            spec,
            mountpoint,
            cache_dir=self.root / "cache" / name,
            store_url=self.store_url,
            cache_size=self.cache_size,
            deadline=self.deadline,
            agent=self.agent_address or None,
            env=None if tls is None else dict(os.environ, **tls.env()),
        )
        log.info("mounting data set %s at %s", spec, mountpoint)
        return mount.start()

    def mounted(self) -> dict[str, Path]:
        """Mount points of the data sets mounted now, by spec (not those starting
        or failed)."""
        return {
            spec: task.result().mountpoint
            for spec, task in self._mounts.items()
            if task.done() and not task.cancelled() and task.exception() is None
        }

    def has_caches(self) -> bool:
        """Whether this node has chunk caches on disk (it mounted a data set, now or
        in an earlier run in the same work directory)."""
        return (self.root / "cache").is_dir()

    def cache_roots(self) -> list[Path]:
        """The chunk cache directories of this node's mounts, now or of earlier runs
        in the same work directory (blocking: lists a directory)."""
        try:  # see chunkfs.mount: a mount's cache is <cache dir>/chunks
            return [p / "chunks" for p in (self.root / "cache").iterdir() if p.is_dir()]
        except OSError:
            return []

    def scan_caches(self) -> list[CacheScan]:
        """Each chunk cache of this node on its own, by data set (blocking: it reads
        one small file per cached chunk). A cache's folder is named for its spec."""
        return [
            CacheScan(root.parent.name, scan_root(root), read_reads([root]))
            for root in sorted(self.cache_roots())
        ]

    def holdings(self) -> dict[str, Holding]:
        """What every chunk cache of this node holds, as their records say (blocking:
        it reads one small file per cached chunk)."""
        return scan(self.cache_roots())

    @staticmethod
    def checkpoint_dir(mountpoint: Path, task_id: str) -> Path:
        """Where a task keeps its checkpoints: ``.out/checkpoints/<task id>`` in the
        shared writable area, the same path on every node of the mesh."""
        return mountpoint / ".out" / "checkpoints" / task_id

    async def close(self) -> None:
        """Unmount everything (also mounts still starting); never raises."""
        tasks, self._mounts = list(self._mounts.values()), {}
        for task in tasks:
            try:
                mount = await task
            except (HypermeshError, OSError, asyncio.CancelledError):
                continue
            except Exception:
                log.exception("a mount failed while starting")
                continue
            await asyncio.to_thread(mount.stop)


def _clear_stale(mountpoint: Path) -> None:
    """Unmount what an earlier life of this agent left at ``mountpoint`` (a crashed
    agent's mount process may have died with it, leaving a dead FUSE mount)."""
    try:
        stale = os.path.ismount(mountpoint)
    except OSError:  # "transport endpoint is not connected": a dead FUSE mount
        stale = True
    if stale:
        log.warning("unmounting a stale mount at %s", mountpoint)
        subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False, capture_output=True)
