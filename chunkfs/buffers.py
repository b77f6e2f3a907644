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
import mmap
import sys
import threading
import time

#: References to an idle pooled buffer while ``BufferPool`` looks at it: the pool's
#: list, a local variable, and ``sys.getrefcount``'s own argument.
_IDLE_REFS = 3


def aligned_buffer(size: int) -> memoryview:
    """A zeroed, writable buffer of ``size`` bytes at a page-aligned address (anonymous
    memory, given back when the last view of it goes)."""
    mem = mmap.mmap(-1, max(size, 1))
    if size >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mem.madvise(mmap.MADV_HUGEPAGE)  # where allowed: a few faults, not one per page
    return memoryview(mem)[:size]


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
        self._used: list[float] = []  # when each buffer was last handed out

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)

    def get(self, n: int) -> memoryview:
        if n > self.size:
            self.fresh += 1
            return aligned_buffer(n)
        now = time.monotonic()
        with self._lock:
            for i in range(len(self._buffers)):
                mem = self._buffers[i]  # (enumerate would hold a reference too)
                if sys.getrefcount(mem) <= _IDLE_REFS:
                    self._used[i] = now
                    return memoryview(mem)[:n]
            if len(self._buffers) < self.most:
                view = aligned_buffer(self.size)
                self._buffers.append(view.obj)  # type: ignore[arg-type]
                self._used.append(now)
                return view[:n]
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
            self._used = [self._used[i] for i in keep]
        return dropped
