#!/usr/bin/env python3
"""Read performance of the chunkfs peers, JuiceFS and s3fs-fuse, on one local SeaweedFS.

    .venv/bin/python scripts/bench_peer_fs.py [--size-mib 1024] [--files 10000]
        [--file-kib 100] [--rounds 3] [--only juicefs,s3fs] [--json]

For each file system, medians over ``--rounds``:
- ``cold_MBps``: one process reads the big file with 1 MiB reads after the file
  system's local cache was emptied (unmount, delete, mount) and the kernel's page
  cache dropped; ``hot_MBps``: the same file again at once (page cache warm);
- ``files_per_s``: ``--files`` files of ``--file-kib`` KiB read whole, cold, in a
  shuffled order by 2 reader processes;
- ``cpu_s_per_GB`` (cold big read) and ``files_cpu_s_per_GB``: CPU seconds of the FUSE
  daemon (with its children) per GB read; the GETs per GiB and the bytes fetched from
  S3 per byte read: JuiceFS counts its own; s3fs has no counters, so after its timed
  rounds one more cold pass of each read goes through a counting proxy
  (``hypermesh.local.s3proxy``; counted only, not timed).
Baselines: ``raw_s3`` (boto3 ranged GETs of the big file's plain object, 8 x 8 MiB at
a time, page cache dropped first) and ``local`` (the source files on local disk after
dropping the page cache). Whether the page cache could be dropped is reported: without
it the "cold" figures are not cold.

Everything runs on 127.0.0.1 and is stopped at the end, also on failure or SIGTERM.
The measurement functions live in ``peer_fs.py`` for ``bench_chunkfs.py`` to reuse.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_fs import (
    S3FS,
    FuseMount,
    JuiceFS,
    MiB,
    S3Target,
    daemon_cpu,
    drop_page_cache,
    exit_on_signals,
    read_files_shuffled,
    read_s3_ranged,
    read_sequential,
    tree_files,
    upload_tree,
)

from hypermesh.local.s3proxy import CountingS3Proxy
from hypermesh.local.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server

SYSTEMS = ("juicefs", "s3fs")
BIG = "big"  # the big file's directory, in the source tree, the mounts and the buckets
SMALL = "small"


class Samples:
    """Per-system lists of samples, reported as medians."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, list[float]]] = {}

    def add(self, system: str, metric: str, value: float | None) -> None:
        if value is not None:
            self.data.setdefault(system, {}).setdefault(metric, []).append(value)

    def medians(self) -> dict[str, dict[str, float]]:
        return {
            system: {m: round(statistics.median(v), 3) for m, v in metrics.items()}
            for system, metrics in self.data.items()
        }


def make_sources(root: Path, size_mib: int, files: int, file_kib: int) -> tuple[Path, Path]:
    """``root/big/big.bin`` of random bytes and ``root/small/dNN/fNNNNN.bin`` files."""
    big, small = root / BIG, root / SMALL
    big.mkdir(parents=True)
    with open(big / "big.bin", "wb") as f:
        for _ in range(size_mib):
            f.write(os.urandom(MiB))
    rng = random.Random(1)
    for i in range(files):
        d = small / f"d{i // 1000:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:05d}.bin").write_bytes(rng.randbytes(file_kib * 1024))
    return big, small


def per_gb(cpu_s: float, n_bytes: int) -> float:
    return cpu_s / (n_bytes / 1e9)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_mount(
    name: str,
    fs: FuseMount,
    write: Callable[[Path], list[Path]],
    big_src: Path,
    small_src: Path,
    rounds: int,
    samples: Samples,
) -> None:
    """Write the sources in through ``write``, then time cold, hot and small-file reads."""
    t0 = time.perf_counter()
    [big] = write(big_src)
    small = write(small_src)
    progress(f"{name}: wrote the sources in {time.perf_counter() - t0:.1f} s")
    big_bytes = big_src.joinpath("big.bin").stat().st_size
    small_bytes = sum(p.stat().st_size for p in tree_files(small_src))
    for r in range(rounds):
        fs.drop_cache()
        drop_page_cache()
        cpu0, st0 = daemon_cpu(fs.pid), fs.stats()
        samples.add(name, "cold_MBps", read_sequential(big))
        cpu1, st1 = daemon_cpu(fs.pid), fs.stats()
        samples.add(name, "hot_MBps", read_sequential(big))
        samples.add(name, "cpu_s_per_GB", per_gb(cpu1 - cpu0, big_bytes))
        if st0 and st1:
            samples.add(name, "gets_per_GiB", (st1["gets"] - st0["gets"]) * (1 << 30) / big_bytes)
            samples.add(name, "fetched_per_byte", (st1["get_bytes"] - st0["get_bytes"]) / big_bytes)

        fs.drop_cache()
        drop_page_cache()
        cpu0, st0 = daemon_cpu(fs.pid), fs.stats()
        samples.add(name, "files_per_s", read_files_shuffled(small, procs=2, seed=r))
        cpu1, st1 = daemon_cpu(fs.pid), fs.stats()
        samples.add(name, "files_cpu_s_per_GB", per_gb(cpu1 - cpu0, small_bytes))
        if st0 and st1:
            samples.add(name, "files_gets_per_file", (st1["gets"] - st0["gets"]) / len(small))
            samples.add(name, "files_fetched_per_byte",
                        (st1["get_bytes"] - st0["get_bytes"]) / small_bytes)
        progress(f"{name} round {r + 1}: " + ", ".join(
            f"{k}={v[-1]:.3g}" for k, v in samples.data[name].items()))


def count_s3fs(
    target: S3Target, work_dir: Path, big_src: Path, small_src: Path, samples: Samples
) -> None:
    """One cold pass of the big file and of the small files through s3fs on a fresh
    mount behind a counting proxy: GETs and bytes fetched, which s3fs does not count.
    Not timed (the proxy adds a hop); the objects are those the timed rounds read."""
    big_bytes = big_src.joinpath("big.bin").stat().st_size
    small = tree_files(small_src)
    small_bytes = sum(p.stat().st_size for p in small)
    with CountingS3Proxy(target.endpoint) as proxy, S3FS(
        replace(target, endpoint=proxy.endpoint), work_dir
    ) as fs:
        drop_page_cache()
        read_sequential(fs.mountpoint / BIG / "big.bin")
        gets, got = proxy.object_gets, proxy.object_get_bytes
        samples.add("s3fs", "gets_per_GiB", gets * (1 << 30) / big_bytes)
        samples.add("s3fs", "fetched_per_byte", got / big_bytes)
        paths = [fs.mountpoint / SMALL / p.relative_to(small_src) for p in small]
        drop_page_cache()
        read_files_shuffled(paths, procs=2, seed=0)
        samples.add("s3fs", "files_gets_per_file", (proxy.object_gets - gets) / len(small))
        samples.add("s3fs", "files_fetched_per_byte",
                    (proxy.object_get_bytes - got) / small_bytes)
    progress("s3fs counted: " + json.dumps(samples.medians().get("s3fs", {})))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="big file size (MiB)")
    ap.add_argument("--files", type=int, default=10_000, help="number of small files")
    ap.add_argument("--file-kib", type=int, default=100, help="small file size (KiB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; medians are reported")
    ap.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="parent of the (removed) work dir; on local disk, not tmpfs")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SYSTEMS)
    if unknown:
        ap.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")

    exit_on_signals()
    work = Path(tempfile.mkdtemp(prefix="bench-peer-fs-", dir=args.work_dir))
    server = S3Server(work / "s3", volume_size_limit_mb=1024)
    samples = Samples()
    load_before = os.getloadavg()
    try:
        server.start()
        progress(f"S3 at {server.endpoint}; writing sources in {work}")
        big_src, small_src = make_sources(work / "src", args.size_mib, args.files,
                                          args.file_kib)
        small_local = tree_files(small_src)
        dropped = drop_page_cache()

        def target(bucket: str) -> S3Target:
            server.make_bucket(bucket)
            return S3Target(server.endpoint, bucket, ACCESS_KEY, SECRET_KEY, REGION)

        plain = target("bench-plain")  # plain objects: s3fs's bucket and the raw ceiling
        upload_tree(plain, big_src, BIG)
        client = plain.client()
        for r in range(args.rounds):
            drop_page_cache()
            samples.add("local", "cold_MBps", read_sequential(big_src / "big.bin"))
            samples.add("local", "hot_MBps", read_sequential(big_src / "big.bin"))
            drop_page_cache()
            samples.add("local", "files_per_s",
                        read_files_shuffled(small_local, procs=2, seed=r))
            drop_page_cache()
            samples.add("raw_s3", "cold_MBps",
                        read_s3_ranged(client, plain.bucket, f"{BIG}/big.bin"))
        progress("baselines: " + json.dumps(samples.medians()))

        for name in only:
            if name == "juicefs":
                with JuiceFS(target("bench-juicefs"), work / "juicefs") as jfs:

                    def write_jfs(d: Path, fs: JuiceFS = jfs) -> list[Path]:
                        return fs.write_tree(d, d.name)

                    measure_mount(name, jfs, write_jfs, big_src, small_src, args.rounds,
                                  samples)
            else:
                with S3FS(plain, work / "s3fs") as s3fs:
                    # The big object is there already (uploaded for the raw ceiling).
                    def write(d: Path, fs: S3FS = s3fs) -> list[Path]:
                        if d == big_src:
                            return [fs.mountpoint / BIG / "big.bin"]
                        return fs.write_tree(d, d.name)

                    measure_mount(name, s3fs, write, big_src, small_src, args.rounds,
                                  samples)
                count_s3fs(plain, work / "s3fs-counted", big_src, small_src, samples)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    result: dict[str, Any] = {
        "config": {
            "size_mib": args.size_mib, "files": args.files, "file_kib": args.file_kib,
            "rounds": args.rounds, "reader_procs": 2, "read_size": MiB,
        },
        "page_cache_dropped": dropped,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "medians": samples.medians(),
        "samples": samples.data,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"page cache dropped: {'yes' if dropped else 'NO (cold figures are not cold)'}; "
          f"{os.cpu_count()} CPUs; load {result['loadavg_before']} -> "
          f"{result['loadavg_after']}; medians of {args.rounds} round(s)")
    for system, metrics in result["medians"].items():
        print(f"{system:8} " + "  ".join(f"{k}={v:g}" for k, v in metrics.items()))


if __name__ == "__main__":
    main()
