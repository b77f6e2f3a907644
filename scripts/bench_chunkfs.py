#!/usr/bin/env python3
"""Benchmark chunkfs reads against raw S3 GETs, on one local SeaweedFS server.

    .venv/bin/python scripts/bench_chunkfs.py [--runs 3] [--big-mib 1024] [--files 10000]

Measures, medians over ``--runs``:
- raw boto3 GETs of the big file's chunk objects (8 threads, whole objects);
- a cold sequential read of the big file (1 MiB reads) through a fresh mount with an
  empty chunk cache and dropped kernel caches, then a hot re-read (page cache);
- a cold read of ``--files`` files of 100 KB in shuffled order by 2 reader processes;
- CPU seconds of the mount process per GB read, store GETs and bytes per byte read.
Prints a JSON summary (and a Markdown table with ``--markdown``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from hypermesh.chunkfs.format import chunk_key
from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.s3server import S3Server

MiB = 1 << 20
BUCKET = "bench"


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def read_file(path: Path, bufsize: int = MiB) -> int:
    buf = bytearray(bufsize)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                return n
            n += got


def mount_cpu(m: MountProcess) -> float:
    assert m.proc is not None
    t = psutil.Process(m.proc.pid).cpu_times()
    return float(t.user + t.system)


def raw_get(store: S3Store, keys: list[str]) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(lambda k: len(store.get(k)), keys))
    return total / (time.perf_counter() - start) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-chunkfs-"))
    server = S3Server(work / "s3", volume_size_limit_mb=1024).start()
    try:
        server.make_bucket(BUCKET)
        os.environ.update(server.client_env())
        store = S3Store(BUCKET, "bench", endpoint=server.endpoint, max_pool_connections=16)
        src_big, src_small = work / "big", work / "small"
        src_big.mkdir()
        with open(src_big / "one.bin", "wb") as f:
            for _ in range(args.big_mib):
                f.write(os.urandom(MiB))
        rng = random.Random(1)
        for i in range(args.files):
            d = src_small / f"d{i // 1000:02d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"f{i:05d}.bin").write_bytes(rng.randbytes(100_000))
        big = put_dataset(store, src_big, "big")
        put_dataset(store, src_small, "small")
        keys = [chunk_key(c.id) for c in big.chunks]
        url = server.url(BUCKET, "bench")

        results: dict[str, list[float]] = {}

        def add(name: str, value: float) -> None:
            results.setdefault(name, []).append(value)

        dropped = False
        for run in range(args.runs):
            add("raw_get_MBps", raw_get(store, keys))

            cache = work / f"cache-big-{run}"
            mnt = work / f"mnt-big-{run}"
            mnt.mkdir()
            dropped = drop_caches()
            with MountProcess("big", mnt, store_url=url, cache_dir=cache) as m:
                cpu0, t0 = mount_cpu(m), time.perf_counter()
                n = read_file(mnt / "one.bin")
                cold = time.perf_counter() - t0
                cpu = mount_cpu(m) - cpu0
                stats = m.stats()["reads"]
                t0 = time.perf_counter()
                read_file(mnt / "one.bin")
                hot = time.perf_counter() - t0
            add("cold_seq_MBps", n / cold / 1e6)
            add("hot_reread_MBps", n / hot / 1e6)
            add("fuse_cpu_s_per_GB", cpu / (n / 1e9))
            add("read_amplification", stats["store_bytes"] / n)
            add("store_gets_per_GiB", stats["store_gets"] / (n / (1 << 30)))
            add("fuse_reads_per_GiB", stats["file_reads"] / (n / (1 << 30)))
            add("pushed_fraction", stats.get("pushed_bytes", 0) / n)

            cache = work / f"cache-small-{run}"
            mnt = work / f"mnt-small-{run}"
            mnt.mkdir()
            drop_caches()
            with MountProcess("small", mnt, store_url=url, cache_dir=cache) as m:
                paths = [str(p) for p in mnt.rglob("*.bin")]  # the listing is not timed
                random.Random(run).shuffle(paths)
                halves = [paths[0::2], paths[1::2]]
                cpu0, t0 = mount_cpu(m), time.perf_counter()
                with ThreadPoolExecutor(2) as starter:
                    done = list(starter.map(_reader_process, halves))
                small = time.perf_counter() - t0
                cpu = mount_cpu(m) - cpu0
                stats = m.stats()["reads"]
                total = sum(done)
            add("small_files_per_s", len(paths) / small)
            add("small_MBps", total / small / 1e6)
            add("small_fuse_cpu_s_per_GB", cpu / (total / 1e9))
            add("small_read_amplification", stats["store_bytes"] / total)
            print(f"run {run}: " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in results.items()),
                  file=sys.stderr)

        summary: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in results.items()}
        summary["runs"] = args.runs
        summary["kernel_caches_dropped"] = dropped
        summary["cpus"] = os.cpu_count()
        print(json.dumps(summary, indent=1))
        if args.markdown:
            for k, v in summary.items():
                print(f"| {k} | {v} |")
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def _reader_process(paths: list[str]) -> int:
    """Read ``paths`` in a separate process (one of the two readers); bytes read."""
    code = (
        "import sys, json, pathlib\n"
        "paths = json.load(sys.stdin)\n"
        "print(sum(len(pathlib.Path(p).read_bytes()) for p in paths))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(paths),
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


if __name__ == "__main__":
    main()
