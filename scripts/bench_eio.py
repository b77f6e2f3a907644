#!/usr/bin/env python3
"""Time to EIO of reads through a mount whose object store hangs, and time to recover.

    bench_eio.py [--deadline 6s] [--sizes 4096,1048576] [--runs 5] [--cold] [--json]

A real SeaweedFS server holds one data set (one 16 MiB file in one chunk). Each run
mounts it afresh (an empty cache: every read needs the store), loads the manifest
page (a ``stat``; not with ``--cold``), then SIGSTOPs the server — it accepts
connections and never answers — and times, for each read size:

- ``first``: an ``open`` and a ``pread`` of that size at offset 0, from the call to
  its EIO (with ``--cold``, the ``open`` looks the file up in the manifest first);
- ``second``: a ``pread`` of that size at 8 MiB (another block of the same chunk),
  right after the first failed;
- ``recover``: after SIGCONT, from the resume to the first ``pread`` at 0 that
  returns the file's bytes (retried every 0.1 s).

Every size gets its own mount and its own pause. Medians are printed with every
run's figure (``--json`` gives them all). Only APIs older than the change it measures
are used, so the script also runs against an earlier tree (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from hypermesh.chunkfs.mount import MountProcess
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.s3server import S3Server
from hypermesh.recipe.units import parse_duration

MiB = 1 << 20
BUCKET = "bench-eio"
FILE = "data.bin"
FILE_SIZE = 16 * MiB
SECOND_AT = 8 * MiB
RECOVER_LIMIT_S = 120.0


def timed_pread(path: Path, size: int, offset: int) -> tuple[float, int | None]:
    """Seconds a fresh open and ``pread`` took, and the errno it failed with (None: read)."""
    start = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, size, offset)
        finally:
            os.close(fd)
    except OSError as exc:
        return time.monotonic() - start, exc.errno
    return time.monotonic() - start, None


def one_run(
    server: S3Server, url: str, work: Path, deadline: str, size: int, want: bytes, cold: bool
) -> dict[str, Any]:
    name = f"m{uuid.uuid4().hex[:6]}"
    mountpoint = work / name
    mountpoint.mkdir()
    mount = MountProcess("bench", mountpoint, cache_dir=work / f"cache-{name}",
                         store_url=url, deadline=deadline)
    mount.start()
    path = mountpoint / FILE
    try:
        if not cold:
            path.stat()  # the manifest page is loaded: the reads below need only the chunk
        server.pause()
        try:
            first, first_err = timed_pread(path, size, 0)
            second, second_err = timed_pread(path, size, SECOND_AT)
        finally:
            server.resume()
        resumed = time.monotonic()
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    got = os.pread(fd, size, 0)
                finally:
                    os.close(fd)
                if got == want[:size]:
                    break
            except OSError:
                pass
            if time.monotonic() - resumed > RECOVER_LIMIT_S:
                raise TimeoutError(f"no good read {RECOVER_LIMIT_S:g} s after the resume")
            time.sleep(0.1)
        recover = time.monotonic() - resumed
    finally:
        server.resume()
        mount.stop()
    return {
        "first": round(first, 3), "first_errno": errno.errorcode.get(first_err or 0, first_err),
        "second": round(second, 3),
        "second_errno": errno.errorcode.get(second_err or 0, second_err),
        "recover": round(recover, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline", default="6s", help="the mount's --deadline")
    ap.add_argument("--sizes", default=f"4096,{MiB}", help="read sizes in bytes, comma-separated")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true",
                    help="no stat before the pause: the first open looks the file up too")
    ap.add_argument("--json", action="store_true", help="every run's figures as JSON")
    args = ap.parse_args()
    parse_duration(args.deadline)  # fail early on a bad duration
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-eio-") as tmp:
        work = Path(tmp)
        with S3Server(work / "s3") as server:
            os.environ.update(server.client_env())
            server.make_bucket(BUCKET)
            src = work / "src"
            src.mkdir()
            want = os.urandom(FILE_SIZE)
            (src / FILE).write_bytes(want)
            prefix = f"p{uuid.uuid4().hex[:8]}"
            with S3Store(BUCKET, prefix, endpoint=server.endpoint) as store:
                put_dataset(store, src, "bench", chunk_size=FILE_SIZE)
            url = server.url(BUCKET, prefix)
            results: dict[str, list[dict[str, Any]]] = {str(s): [] for s in sizes}
            for run in range(args.runs):
                for size in sizes:
                    result = one_run(server, url, work, args.deadline, size, want, args.cold)
                    results[str(size)].append(result)
                    print(f"run {run + 1} size {size}: {result}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"deadline": args.deadline, "cold": args.cold, "results": results},
                         indent=1))
        return
    print(f"deadline {args.deadline}{', cold' if args.cold else ''}, {args.runs} runs; "
          f"seconds, median (runs)")
    print("| read | first EIO | second EIO | readable after resume |")
    print("| --- | --- | --- | --- |")
    for size, runs in results.items():
        cells = []
        for key in ("first", "second", "recover"):
            values = [r[key] for r in runs]
            listed = ", ".join(f"{v:.3f}" for v in values)
            cells.append(f"{statistics.median(values):.3f} ({listed})")
        print(f"| {int(size) // 1024} KiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
