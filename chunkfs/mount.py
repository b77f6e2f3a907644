"""``hypermesh mount``: serve one data set version at a mount point, in its own process.

    hypermesh mount NAME[@VERSION] MOUNTPOINT [--store URL] [--cache-dir DIR]
                    [--cache-size 20GiB] [--deadline 30s] [--agent HOST:PORT|unix:PATH]
                    [--foreground] [--log-file FILE]

Without ``--foreground`` the command starts the file system in a detached process and
returns only once the mount answers (exit 0), or reports why it failed (exit 2 for bad
input — unknown store URL form, mount point not an empty directory, cache directory in
use; exit 1 for failures at run time — the store does not answer, the data set does not
exist, FUSE refused to mount). The detached process logs to ``--log-file`` (default
``<cache-dir>/mount.log``).

To unmount: ``fusermount3 -u MOUNTPOINT`` (or SIGTERM/SIGINT to the mount process, which
unmounts cleanly). A mount process whose mount point was unmounted exits.

With ``--agent`` (mounts an agent starts get it), a chunk missing from the cache is
asked of that agent first, which reads it from a peer that holds it
(``chunkfs/agent_fetch.py``; an agent passes its own Unix socket, ``unix:PATH``);
without, it comes from the store.

Inside the mount: the data set (read-only), ``.out/`` (writable, uploaded to the store
on close: see ``outputs.py``) and ``.chunkfs-stats`` (JSON counters: blocks and bytes
served by source, GETs and bytes fetched from the store, cache bytes, uploads).

For programs (the agent, tests): ``MountProcess(spec, mountpoint, ...).start()`` runs
the mount as a child process, ``.stats()`` reads its counters, ``.stop()`` unmounts
and ends it. One cache directory serves one mount at a time (it is locked).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import click

from hypermesh.channels import is_unix
from hypermesh.chunkfs.agent_fetch import AGENT_TIMEOUT_S, AgentPeerFetch
from hypermesh.chunkfs.buffers import BufferPool
from hypermesh.chunkfs.cache import HAVE_FLUSH_INTERVAL, ChunkCache
from hypermesh.chunkfs.datasets import resolve
from hypermesh.chunkfs.fetch import ChunkReader, FetchConfig, FileReader, PeerFetch
from hypermesh.chunkfs.holdings import ELSEWHERE_FILE, read_elsewhere, write_reads
from hypermesh.chunkfs.manifest import Manifest
from hypermesh.chunkfs.outage import Flights
from hypermesh.chunkfs.outputs import Outputs
from hypermesh.chunkfs.store import open_store, retry_transient
from hypermesh.errors import HypermeshError, UsageError
from hypermesh.recipe.units import parse_duration, parse_size
from hypermesh.tls import TlsFiles

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = "20GiB"
STATS_FILE = ".chunkfs-stats"
OP_THREADS = 64  # threads for blocking FUSE work (reads wait on fetches there)
READAHEAD_KB = 8192  # the kernel's readahead for the mount's device, set after mounting
START_TIMEOUT_S = 120.0  # how long a starter waits for the ready message
PR_SET_PDEATHSIG = 1  # prctl(2)
READY_TIMEOUT_S = 30.0  # how long the mount process waits for its own mount to answer
PAGE_THREADS = 4  # threads that fetch manifest pages


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "hypermesh" / "chunkfs"


def _lock_cache_dir(cache_dir: Path) -> int:
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UsageError(
            f"cache directory {cache_dir} is in use by another mount; pass --cache-dir"
        ) from None
    return fd


def _check_mountpoint(mountpoint: Path) -> None:
    if not mountpoint.is_dir():
        raise UsageError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise UsageError(f"{mountpoint} is already a mount point")


def _tune_readahead(mountpoint: Path, kb: int) -> None:
    """Raise the kernel's readahead for the mount (root only; best effort)."""
    dev = os.stat(mountpoint).st_dev
    path = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    try:
        path.write_text(str(kb))
    except OSError as exc:
        log.info("could not set %s: %s", path, exc)


def serve(
    spec: str,
    mountpoint: Path,
    *,
    store_url: str | None,
    cache_dir: Path,
    cache_size: int,
    fetch: FetchConfig,
    peer_fetch: PeerFetch | None = None,
    ready: Callable[[str], None] | None = None,
    push_pages: bool = True,
) -> None:
    """Mount and serve until unmounted or signalled; ``ready(message)`` once it answers.

    ``push_pages``: store what sequential readahead fetched straight into the kernel's
    page cache (``chunkfs.pagepush``); off, every page is read through a FUSE request.
    """
    import pyfuse3
    import pyfuse3.asyncio

    from hypermesh.chunkfs import fusewait
    from hypermesh.chunkfs.fs import ChunkFS
    from hypermesh.chunkfs.pagepush import PagePusher, Store

    mountpoint = mountpoint.absolute()
    _check_mountpoint(mountpoint)
    lock_fd = _lock_cache_dir(cache_dir)
    store = open_store(
        store_url,
        max_pool_connections=fetch.threads + fetch.prefetch_threads + 8,
        read_timeout_s=max(5.0, fetch.deadline_s / 2),
        connect_timeout_s=min(5.0, fetch.deadline_s / 4),
    )
    root = retry_transient(lambda: resolve(store, spec), fetch.deadline_s)
    cache = ChunkCache(cache_dir / "chunks", cache_size)
    if isinstance(peer_fetch, AgentPeerFetch):
        peer_fetch.room = cache.has_room  # the agent lets a node with room fetch cold runs
    reader = ChunkReader(store, cache, fetch, peer_fetch)
    # manifest pages: one fetch per page at a time, failing fast like chunks do
    pages: Flights[bytes] = Flights("chunkfs-pages", PAGE_THREADS, reader.outages)

    def load_page(key: str) -> bytes:
        def get(deadline: float) -> bytes:
            return retry_transient(lambda: store.get(key), deadline - time.monotonic())

        deadline = time.monotonic() + fetch.deadline_s
        return pages.get(key, get, deadline, f"manifest page {key}")

    manifest = Manifest(root, load_page)
    staging = cache_dir / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    outputs = Outputs(store, staging, retry_s=fetch.deadline_s)

    def stats() -> dict[str, Any]:
        return {
            "dataset": f"{root.name}@{root.version}",
            "store": store.url,
            "pid": os.getpid(),
            "reads": cache.stats.snapshot(),
            "cache": {
                "dir": str(cache.root),
                "bytes": cache.used_bytes,
                "max_bytes": cache.max_bytes,
                "chunks": len(cache.chunk_ids()),
                "ranks": cache.rank_counts(),
            },
            "outputs": {"uploads": outputs.uploads, "upload_bytes": outputs.upload_bytes},
            "manifest_pages_loaded": manifest.pages_loaded,
            "buffers": {"pooled": len(reader.buffers), "fresh": reader.buffers.fresh},
            "outages": reader.outages.snapshot(),
        }

    # pyfuse3's stub says ``bytes``; notify_store takes any buffer (it copies from a view).
    notify_store = cast(Store, pyfuse3.notify_store)
    pusher = PagePusher(notify_store, cache.stats) if push_pages else None
    ops = ChunkFS(
        root,
        manifest,
        FileReader(reader, root.chunks),
        outputs,
        stats,
        readahead=(fetch.readahead_start, fetch.readahead_max, fetch.range_bytes),
        pusher=pusher,
    )
    options = set(pyfuse3.default_options)
    options |= {f"fsname=chunkfs:{root.name}@{root.version}", "subtype=chunkfs"}
    pyfuse3.asyncio.enable()
    fusewait.install()
    try:
        pyfuse3.init(ops, str(mountpoint), options)
    except RuntimeError as exc:
        raise HypermeshError(f"FUSE mount of {mountpoint} failed: {exc}") from exc
    try:
        asyncio.run(_main(mountpoint, ready, cache, reader.buffers))
    finally:
        if pusher is not None:
            pusher.close()  # before the session goes: stores use it
        pyfuse3.close(unmount=True)
        outputs.close()
        reader.close()
        pages.close()
        cache.close()
        store.close()
        os.close(lock_fd)
        log.info("unmounted %s", mountpoint)


async def _flush_records(cache: ChunkCache) -> None:
    """Write changed ``.have`` records every ``HAVE_FLUSH_INTERVAL`` even when no more
    blocks arrive, so the agent's view of this cache (``chunkfs.holdings``) catches up;
    and the blocks served by source (``holdings.READS_FILE``), for the agent's hit rates.
    Read back what the agent recorded of the chunks other nodes hold too
    (``holdings.ELSEWHERE_FILE``), for the cache's eviction order."""
    written: dict[str, int] | None = None
    seen: float | None = None
    while True:
        await asyncio.sleep(HAVE_FLUSH_INTERVAL)
        if cache.dirty():
            await asyncio.to_thread(cache.flush)
        seen = await asyncio.to_thread(_load_elsewhere, cache, seen)
        snap = cache.stats.snapshot()["blocks"]
        blocks = dict(snap) if isinstance(snap, dict) else {}
        if blocks != written:
            try:
                await asyncio.to_thread(write_reads, cache.root, blocks)
                written = blocks
            except OSError as exc:
                log.warning("could not record the reads by source: %s", exc)


def _load_elsewhere(cache: ChunkCache, seen: float | None) -> float | None:
    """Hand the cache the agent's latest "held elsewhere" record if it changed since
    ``seen`` (its modification time); returns the time of the record loaded."""
    try:
        mtime = (cache.root.parent / ELSEWHERE_FILE).stat().st_mtime
    except OSError:
        return seen
    if mtime != seen:
        ids = read_elsewhere(cache.root)
        if ids is not None:
            cache.set_elsewhere(ids)
    return mtime


async def _trim_buffers(buffers: BufferPool) -> None:
    """Give back receive buffers that no read has used for a while."""
    while True:
        await asyncio.sleep(buffers.idle_s / 2)
        buffers.trim()


async def _main(
    mountpoint: Path,
    ready: Callable[[str], None] | None,
    cache: ChunkCache,
    buffers: BufferPool,
) -> None:
    import pyfuse3

    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(OP_THREADS, "chunkfs-op"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pyfuse3.terminate)

    def announce() -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not os.path.ismount(mountpoint):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not mounted after {READY_TIMEOUT_S:g} s")
                time.sleep(0.02)
            os.stat(mountpoint / STATS_FILE)  # one round trip through our own handlers
        except OSError as exc:
            log.error("the mount at %s does not answer: %s", mountpoint, exc)
            if ready is not None:
                ready(f"err 1 the mount at {mountpoint} does not answer: {exc}")
            loop.call_soon_threadsafe(pyfuse3.terminate)
            return
        _tune_readahead(mountpoint, READAHEAD_KB)
        log.info("mounted %s", mountpoint)
        if ready is not None:
            ready(f"ok {os.getpid()}")

    check = loop.run_in_executor(None, announce)
    records = asyncio.create_task(_flush_records(cache))
    trims = asyncio.create_task(_trim_buffers(buffers))
    try:
        await pyfuse3.main()
    finally:
        records.cancel()
        trims.cancel()
    await check


# ----------------------------------------------------------------- processes
def _wait_ready(proc: subprocess.Popen[bytes], read_fd: int, timeout: float) -> str:
    """The child's ready line ("ok PID" or "err CODE MESSAGE"); "" if it died first."""
    deadline = time.monotonic() + timeout
    data = b""
    with contextlib.closing(os.fdopen(read_fd, "rb", buffering=0)) as pipe:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                return f"err 1 the mount did not come up within {timeout:.0f} s"
            readable, _, _ = select.select([pipe], [], [], min(left, 0.5))
            if readable:
                chunk = pipe.read(4096)
                if not chunk:
                    break
                data += chunk
            elif proc.poll() is not None and not data:
                break
    return data.decode(errors="replace").strip()


def spawn_mount(
    args: list[str],
    *,
    log_path: Path,
    env: dict[str, str] | None = None,
    detach: bool = False,
    timeout: float = START_TIMEOUT_S,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``hypermesh mount ARGS --foreground`` as a child; wait until it is ready."""
    read_fd, write_fd = os.pipe()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hypermesh", "-v", "mount", *args, "--foreground",
             "--ready-fd", str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            pass_fds=(write_fd,),
            env=env,
            start_new_session=detach,
        )
    os.close(write_fd)
    return proc, _wait_ready(proc, read_fd, timeout)


def _log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class MountProcess:
    """A mount run as a child process, for the agent and tests.

    ``start`` returns once the mount answers (or raises ``HypermeshError`` with the
    child's message and log). ``stop`` always leaves the mount point unmounted and
    the process gone (SIGTERM, then SIGKILL and a lazy ``fusermount3 -uz``).
    """

    def __init__(
        self,
        spec: str,
        mountpoint: Path,
        *,
        cache_dir: Path,
        store_url: str | None = None,
        cache_size: str = DEFAULT_CACHE_SIZE,
        deadline: str = "30s",
        env: dict[str, str] | None = None,
        push_pages: bool = True,
        agent: str | None = None,
    ) -> None:
        self.spec, self.mountpoint, self.cache_dir = spec, Path(mountpoint), Path(cache_dir)
        self.args = [spec, str(mountpoint), "--cache-dir", str(cache_dir),
                     "--cache-size", cache_size, "--deadline", deadline, "--die-with-parent"]
        if not push_pages:
            self.args.append("--no-push-pages")
        if store_url:
            self.args += ["--store", store_url]
        if agent:
            self.args += ["--agent", agent]
        self.env = env
        self.log_path = self.cache_dir.parent / f"{self.cache_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> MountProcess:
        self.proc, message = spawn_mount(self.args, log_path=self.log_path, env=self.env,
                                         timeout=timeout)
        if not message.startswith("ok"):
            self.stop()
            raise HypermeshError(f"mount of {self.spec} failed: {message}\n{self.log_tail()}")
        return self

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads((self.mountpoint / STATS_FILE).read_text())
        return result

    def log_tail(self, n: int = 3000) -> str:
        return _log_tail(self.log_path, n)

    def stop(self, timeout: float = 20.0) -> int | None:
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-uz", str(self.mountpoint)], check=False,
                           capture_output=True)
        return code

    def __enter__(self) -> MountProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ----------------------------------------------------------------------- CLI
@click.command()
@click.argument("spec", metavar="NAME[@VERSION]")
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--store", "store_url", default=None, metavar="URL",
              help="Object store: s3://BUCKET[/PREFIX] or file:///PATH [env HYPERMESH_STORE].")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Local chunk cache (one mount at a time) [~/.cache/hypermesh/chunkfs].")
@click.option("--cache-size", default=DEFAULT_CACHE_SIZE, show_default=True,
              help="Most bytes the chunk cache holds (e.g. 20GiB).")
@click.option("--deadline", default="30s", show_default=True,
              help="How long a read retries an unavailable store before it fails (EIO).")
@click.option("--push-pages/--no-push-pages", default=True, show_default=True,
              help="Store what sequential readahead fetched straight into the page cache.")
@click.option("--agent", "agent", default=None, metavar="HOST:PORT|unix:PATH",
              help="Ask this agent for chunks from peers before the store (agents pass it: "
                   "their socket, unix:WORK_DIR/run/agent.sock).")
@click.option("--foreground", is_flag=True, help="Serve in this process until unmounted.")
@click.option("--log-file", type=click.Path(path_type=Path), default=None,
              help="Log of the detached mount process [<cache-dir>/mount.log].")
@click.option("--ready-fd", type=int, default=None, hidden=True)
@click.option("--die-with-parent", is_flag=True, hidden=True,
              help="Unmount and exit when the process that started this one dies.")
def mount(
    spec: str,
    mountpoint: Path,
    store_url: str | None,
    cache_dir: Path | None,
    cache_size: str,
    deadline: str,
    push_pages: bool,
    agent: str | None,
    foreground: bool,
    log_file: Path | None,
    ready_fd: int | None,
    die_with_parent: bool,
) -> None:
    """Mount data set NAME (its newest version, or VERSION) read-only at MOUNTPOINT.

    The command returns once the mount works. Files written under MOUNTPOINT/.out/ are
    stored under outputs/ in the object store when closed. Unmount with
    `fusermount3 -u MOUNTPOINT`.
    """
    cache_dir = (cache_dir or default_cache_dir()).absolute()
    report = _reporter(ready_fd)
    try:
        size = parse_size(cache_size)
        fetch = FetchConfig(deadline_s=parse_duration(deadline))
    except (UsageError, ValueError) as exc:
        report(f"err 2 {exc}")
        sys.exit(2)
    if not foreground:
        args = [spec, str(mountpoint.absolute()), "--cache-dir", str(cache_dir),
                "--cache-size", cache_size, "--deadline", deadline]
        if not push_pages:
            args.append("--no-push-pages")
        if store_url:
            args += ["--store", store_url]
        if agent:
            args += ["--agent", agent]
        log_path = (log_file or cache_dir / "mount.log").absolute()
        _proc, message = spawn_mount(args, log_path=log_path, detach=True)
        _exit_with(message, log_path)
        return
    if die_with_parent:
        _die_with_parent()
    # a peer's trouble must leave the read time to reach the store within its deadline
    peer_fetch = None
    if agent:
        try:  # over TCP: the files of the agent that started this mount, in HYPERMESH_TLS_*
            tls = None if is_unix(agent) else TlsFiles.from_options(None, None, None)
        except UsageError as exc:
            report(f"err 2 {exc}")
            sys.exit(2)
        peer_fetch = AgentPeerFetch(agent, min(AGENT_TIMEOUT_S, fetch.deadline_s / 2), tls=tls)
    try:
        serve(spec, mountpoint, store_url=store_url, cache_dir=cache_dir, cache_size=size,
              fetch=fetch, peer_fetch=peer_fetch, ready=report, push_pages=push_pages)
    except UsageError as exc:
        report(f"err 2 {exc}")
        sys.exit(2)
    except HypermeshError as exc:
        report(f"err 1 {exc}")
        sys.exit(1)
    finally:
        if peer_fetch is not None:
            peer_fetch.close()


def _die_with_parent() -> None:
    """Have the kernel send SIGTERM (a clean unmount) when our parent dies: a mount
    an agent started must not outlive the agent (a crashed agent restarts with
    mounts of its own). Linux ties this to the *thread* that started us, so a
    starter must not start mounts from short-lived threads (asyncio's executor
    threads live as long as the loop)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        sys.exit(1)


def _reporter(ready_fd: int | None) -> Callable[[str], None]:
    """Where a foreground mount says it is ready or why it failed."""

    def report(message: str) -> None:
        if ready_fd is None:
            if message.startswith("err"):
                click.echo(f"hypermesh: error: {message.split(' ', 2)[2]}", err=True)
            else:
                click.echo(f"hypermesh: mounted (pid {message.split()[1]})", err=True)
            return
        with contextlib.suppress(OSError):
            os.write(ready_fd, message.encode() + b"\n")
            os.close(ready_fd)

    return report


def _exit_with(message: str, log_path: Path) -> None:
    if message.startswith("ok"):
        click.echo(f"hypermesh: mounted (pid {message.split()[1]}); log: {log_path}", err=True)
        return
    if message.startswith("err"):
        _, code, text = message.split(" ", 2)
        click.echo(f"hypermesh: error: {text}", err=True)
        sys.exit(int(code))
    click.echo(f"hypermesh: error: the mount process exited before the mount was live; "
               f"log {log_path}:\n{_log_tail(log_path)}", err=True)
    sys.exit(1)
