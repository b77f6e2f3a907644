"""Page-aligned buffers that fetched runs are received into, reused across runs.

A fetched run travels without copies: its GET body is received straight into one of
these buffers, its blocks are verified there, handed to reads and page stores as
slices, and written to the chunk cache from there with ``O_DIRECT`` (which needs
aligned addresses). Fresh anonymous memory costs a fault and a zeroed page per 4 KiB
(measured: about a tenth of the mount's CPU in a cold sequential read), so buffers are
reused: one is free again once no view of it is left anywhere — readers, the page
store queue, the cache — which the pool tells from its reference count. A buffer
never goes back to the pool by hand, so a forgotten view can only cost a fresh
buffer, never bytes handed out twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import time

#: References to an idle pooled buffer while ``BufferPool`` looks at it: the pool's
#: list, a local variable, and ``sys.getrefcount``'s own argument.
_IDLE_REFS = 3
HUGE = 2 << 20  # a transparent huge page
PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (mmap's default for -1 is shared memory)


def aligned_buffer(size: int) -> memoryview:
    """A zeroed, writable buffer of ``size`` bytes at a page-aligned address (anonymous
    memory, given back when the last view of it goes)."""
    mem, offset = _allocate(size)
    return memoryview(mem)[offset : offset + size]


def _allocate(size: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory for ``size`` bytes and the offset they start at in it.

    From 2 MiB up the mapping is padded so the bytes start on a 2 MiB boundary and is
    marked for transparent huge pages: where the kernel allows them, a 16 MiB buffer
    then costs 8 page faults instead of 4,096 (the padding is never touched)."""
    if size < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return mmap.mmap(-1, max(size, 1), flags=PRIVATE), 0
    mem = mmap.mmap(-1, size + HUGE, flags=PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    with contextlib.suppress(OSError):
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem, -address % HUGE


class BufferPool:
    """At most ``most`` buffers of ``size`` bytes, each handed out again once idle.

    ``get(n)`` returns an aligned, writable view of ``n`` bytes: a slice of an idle
    pooled buffer when ``n <= size`` and one is idle, else of a new pooled buffer while
    there are fewer than ``most``, else of a fresh unpooled one. Its contents are
    whatever the buffer held last: the caller overwrites them. Buffers not handed out
    for ``idle_s`` are dropped by ``trim`` (the mount calls it now and then), so an
    idle mount gives its memory back. Thread-safe.
    """

    def __init__(self, size: int, most: int, idle_s: float = 30.0) -> None:
        self.size, self.most, self.idle_s = size, most, idle_s
        self.fresh = 0  # buffers that had to be allocated outside the pool
        self._lock = threading.Lock()
        self._buffers: list[mmap.mmap] = []
        self._offsets: list[int] = []  # where each buffer's aligned bytes start
        self._used: list[float] = []  # when each buffer was last handed out

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)

    def get(self, n: int) -> memoryview:
        now = time.monotonic()
        with self._lock:
            if n > self.size:
                self.fresh += 1
                return aligned_buffer(n)
            for i in range(len(self._buffers)):
                mem = self._buffers[i]  # (enumerate would hold a reference too)
                if sys.getrefcount(mem) <= _IDLE_REFS:
                    self._used[i] = now
                    offset = self._offsets[i]
                    return memoryview(mem)[offset : offset + n]
            if len(self._buffers) < self.most:
                mem, offset = _allocate(self.size)
                self._buffers.append(mem)
                self._offsets.append(offset)
                self._used.append(now)
                return memoryview(mem)[offset : offset + n]
            self.fresh += 1
        return aligned_buffer(n)

    def trim(self) -> int:
        """Drop the buffers idle for ``idle_s``; how many were dropped."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            keep = []
            for i in range(len(self._buffers)):
                mem = self._buffers[i]
                if self._used[i] > cutoff or sys.getrefcount(mem) > _IDLE_REFS:
                    keep.append(i)
            dropped = len(self._buffers) - len(keep)
            self._buffers = [self._buffers[i] for i in keep]
            self._offsets = [self._offsets[i] for i in keep]
            self._used = [self._used[i] for i in keep]
        return dropped
