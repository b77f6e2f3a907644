#!/usr/bin/env python3
"""Where the CPU of a cold sequential read through chunkfs goes, mount by mount.

    .venv/bin/python scripts/bench_cold_read.py [--rounds 3] [--size-mib 1024]
        [--variant 'NAME=VALUE,...' ...] [--perf DIR]

Puts one file of random bytes into a local SeaweedFS, then, per round and per variant
(variants alternate within a round so that all see the same machine noise), mounts it
with an empty chunk cache, drops the kernel's caches and reads the file once with 1 MiB
reads. Per read it prints MB/s and CPU seconds per GB of the mount process, of
SeaweedFS, of the reader and of the whole machine (busy share of all cores too), and
the mount's own counters: GETs, pages pushed, FUSE reads, receive buffers. A variant is
a set of environment variables for the mount process (for experiments that read them);
none given, one variant with the environment as it is. ``--perf DIR`` also records
``perf record -g`` of each mount into DIR. Medians per variant at the end. Needs root
(it drops the page cache) and FUSE.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.s3server import S3Server

sys.path.insert(0, str(Path(__file__).parent))
from bench_chunkfs import BUCKET, MiB, drop_caches, read_file

TICK = os.sysconf("SC_CLK_TCK")


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (all but idle and iowait)."""
    fields = [int(x) / TICK for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def cpu_of(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def parse_variant(text: str) -> dict[str, str]:
    env = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant: {item!r} is not NAME=VALUE")
        env[name] = value
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=VALUE,... for the mount's environment (repeatable)")
    ap.add_argument("--perf", type=Path, default=None, help="record perf profiles here")
    args = ap.parse_args()
    variants = args.variant or [""]
    envs = [parse_variant(v) for v in variants]

    work = Path(tempfile.mkdtemp(prefix="bench-cold-read-"))
    server = S3Server(work / "s3", volume_size_limit_mb=1024).start()
    speeds: dict[str, list[float]] = {v: [] for v in variants}
    try:
        server.make_bucket(BUCKET)
        os.environ.update(server.client_env())
        store = S3Store(BUCKET, "bench", endpoint=server.endpoint, max_pool_connections=16)
        src = work / "src"
        src.mkdir()
        with open(src / "one.bin", "wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(MiB))
        put_dataset(store, src, "big")
        (src / "one.bin").unlink()
        url = server.url(BUCKET, "bench")
        weed = [p for p in psutil.process_iter(["name"]) if "weed" in (p.info["name"] or "")]
        n = 0
        for _ in range(args.rounds):
            for variant, env in zip(variants, envs, strict=True):
                mnt, cache = work / f"mnt{n}", work / f"cache{n}"
                mnt.mkdir()
                n += 1
                drop_caches()
                with MountProcess("big", mnt, store_url=url, cache_dir=cache,
                                  env={**os.environ, **env}) as m:
                    assert m.proc is not None
                    mount = psutil.Process(m.proc.pid)
                    perf = None
                    if args.perf is not None:
                        args.perf.mkdir(parents=True, exist_ok=True)
                        perf = subprocess.Popen(
                            ["perf", "record", "-g", "-p", str(mount.pid),
                             "-o", str(args.perf / f"mount-{n}.data")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        time.sleep(0.5)
                    c0 = (cpu_of([mount]), cpu_of(weed), machine_cpu(), os.times())
                    t0 = time.perf_counter()
                    nbytes = read_file(mnt / "one.bin")
                    wall = time.perf_counter() - t0
                    c1 = (cpu_of([mount]), cpu_of(weed), machine_cpu(), os.times())
                    if perf is not None:
                        perf.send_signal(2)
                        perf.wait()
                    stats = m.stats()
                gb = nbytes / 1e9
                reader = (c1[3].user + c1[3].system) - (c0[3].user + c0[3].system)
                reads = stats["reads"]
                mbps = nbytes / wall / 1e6
                speeds[variant].append(mbps)
                print(f"{variant or '-':24s} {mbps:7.1f} MB/s  CPU s/GB: mount "
                      f"{(c1[0] - c0[0]) / gb:.2f} seaweedfs {(c1[1] - c0[1]) / gb:.2f} "
                      f"reader {reader / gb:.2f} machine {(c1[2] - c0[2]) / gb:.2f} "
                      f"(busy {(c1[2] - c0[2]) / wall / (os.cpu_count() or 1):.0%})  "
                      f"GETs {reads['store_gets']} pushed "
                      f"{reads.get('pushed_bytes', 0) / nbytes:.2f} FUSE reads "
                      f"{reads['file_reads']} buffers {stats.get('buffers')}", flush=True)
        for variant, xs in speeds.items():
            print(f"median {variant or '-':24s} {statistics.median(xs):7.1f} MB/s  "
                  f"{[round(x) for x in xs]}")
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
