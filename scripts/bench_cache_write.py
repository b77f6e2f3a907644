"""Chunk-cache writes: buffered ``pwrite`` against ``O_DIRECT``.

Buffered: ``pwrite`` of GET-body-like ``bytes`` objects, as ``chunkfs/cache.py`` does
today. Direct: a copy into one page-aligned buffer, then an ``O_DIRECT`` ``pwrite`` (what
a direct-write chunk cache would do: no second copy of the data in the page cache, no
writeback). 512 MiB in 1 MiB blocks into a file under /var/tmp, the page cache dropped
before each run (needs root). Prints CPU seconds per GB of this process, and of the
whole machine during the writes and until ``sync`` returns. Asserts nothing.

    python3 scripts/bench_cache_write.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import time
from collections.abc import Callable

MiB = 1 << 20
BLOCKS = 512
SOURCES = [os.urandom(MiB) for _ in range(8)]  # bytes objects, like GET bodies


def process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (not idle, not iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def buffered(path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, BLOCKS * MiB)
        for i in range(BLOCKS):
            os.pwrite(fd, SOURCES[i % len(SOURCES)], i * MiB)
    finally:
        os.close(fd)


def direct(path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        os.ftruncate(fd, BLOCKS * MiB)
        with mmap.mmap(-1, MiB) as buf:  # page-aligned, as O_DIRECT needs
            view = memoryview(buf)
            for i in range(BLOCKS):
                view[:] = SOURCES[i % len(SOURCES)]
                os.pwrite(fd, view, i * MiB)
            view.release()
    finally:
        os.close(fd)


def measure(name: str, write: Callable[[str], None]) -> None:
    path = f"/var/tmp/hm-bench-cache-write-{name}"
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    c0, m0, t0 = process_cpu(), machine_cpu(), time.perf_counter()
    try:
        write(path)
        c1, m1, t1 = process_cpu(), machine_cpu(), time.perf_counter()
        subprocess.run(["sync"], check=True)
        m2 = machine_cpu()
    finally:
        os.unlink(path)
    gb = BLOCKS * MiB / 1e9
    print(f"{name:9s} process {(c1 - c0) / gb:.2f} s/GB  machine {(m1 - m0) / gb:.2f} s/GB"
          f"  with sync {(m2 - m0) / gb:.2f} s/GB  wall {t1 - t0:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        measure("buffered", buffered)
        measure("direct", direct)


if __name__ == "__main__":
    main()
