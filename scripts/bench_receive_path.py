#!/usr/bin/env python3
"""Receive path of a cold chunk read, alone: bytes from a socket to a verified cache file.

    bench_receive_path.py [copy|splice ...]   (default: copy splice copy splice copy splice)

A second process sends 64 blocks of 16 MiB over loopback TCP; this process receives
each and puts it into a cache file, two ways, and prints the CPU seconds per GB of the
receiving thread and its rate:

- ``copy`` (what the mount does today, less boto3): ``recv_into`` a reused buffer,
  BLAKE3 of the buffer, ``pwrite`` into the cache file (two copies: socket to buffer,
  buffer to the file's pages);
- ``splice``: ``splice`` from the socket through a pipe into the cache file (one
  copy, in the kernel), then BLAKE3 of the file's pages through a populated ``mmap``.

Not a figure of an issue: it tells how much one copy fewer per byte would save.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

import blake3

BLOCKS = 64
SIZE = 16 << 20
F_SETPIPE_SZ = 1031


def send(port: int) -> None:
    data = os.urandom(SIZE)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(BLOCKS):
            s.sendall(data)


def thread_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def receive(conn: socket.socket, fd: int, mode: str) -> None:
    buf = memoryview(bytearray(SIZE))
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 1 << 20)
    try:
        for i in range(BLOCKS):
            offset = (i % 4) * SIZE  # a cache file of 4 blocks, rewritten
            if mode == "copy":
                got = 0
                while got < SIZE:
                    got += conn.recv_into(buf[got:], SIZE - got)
                blake3.blake3(buf).digest()
                os.pwrite(fd, buf, offset)
                continue
            left, pos = SIZE, offset
            while left:
                n = os.splice(conn.fileno(), w, min(left, 1 << 20))
                while n:
                    k = os.splice(r, fd, n, offset_dst=pos)
                    pos, n, left = pos + k, n - k, left - k
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0x8000)
            with mmap.mmap(fd, SIZE, flags=flags, prot=mmap.PROT_READ, offset=offset) as m:
                blake3.blake3(memoryview(m)).digest()
    finally:
        os.close(r)
        os.close(w)


def run(mode: str, work: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = str(listener.getsockname()[1])
        sender = subprocess.Popen([sys.executable, __file__, "--send", port])
        conn, _ = listener.accept()
    fd = os.open(os.path.join(work, "cache"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, 4 * SIZE)
        cpu, start = thread_cpu(), time.perf_counter()
        receive(conn, fd, mode)
        seconds, used = time.perf_counter() - start, thread_cpu() - cpu
    finally:
        conn.close()
        os.close(fd)
        sender.wait(30)
    gb = BLOCKS * SIZE / 1e9
    rate = gb / seconds * 1000
    print(f"{mode}: {used / gb:.2f} CPU-s/GB in the receiving thread, {rate:.0f} MB/s")


def main() -> None:
    if sys.argv[1:2] == ["--send"]:
        send(int(sys.argv[2]))
        return
    print(f"command: {' '.join(sys.argv)}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-receive-") as work:
        for mode in sys.argv[1:] or ["copy", "splice"] * 3:
            run(mode, work)


if __name__ == "__main__":
    main()
