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
from dataclasses import dataclass

#: References to an idle pooled buffer's memory while ``BufferPool`` looks at it: its
#: slot and ``sys.getrefcount``'s own argument (every view of it adds one).
_IDLE_REFS = 2
HUGE = 2 << 20  # a transparent huge page
PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (mmap's default for -1 is shared memory)


def address(buffer: memoryview | mmap.mmap) -> int | None:
    """The address of a writable buffer's first byte; None if it is read-only or empty."""
    view = memoryview(buffer)
    if view.readonly or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


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
    with contextlib.suppress(OSError):
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem, -(address(mem) or 0) % HUGE


@dataclass
class _Slot:
    mem: mmap.mmap
    offset: int  # where the aligned bytes start in ``mem``
    used: float  # when it was last handed out

    def idle(self) -> bool:
        return sys.getrefcount(self.mem) <= _IDLE_REFS


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
        self._slots: list[_Slot] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def get(self, n: int) -> memoryview:
        now = time.monotonic()
        with self._lock:
            slot = next((s for s in self._slots if s.idle()), None) if n <= self.size else None
            if slot is None and n <= self.size and len(self._slots) < self.most:
                slot = _Slot(*_allocate(self.size), now)
                self._slots.append(slot)
            if slot is None:
                self.fresh += 1
            else:
                slot.used = now
                return memoryview(slot.mem)[slot.offset : slot.offset + n]
        return aligned_buffer(n)

    def trim(self) -> int:
        """Drop the buffers idle for ``idle_s``; how many were dropped."""
        cutoff = time.monotonic() - self.idle_s
        with self._lock:
            before = len(self._slots)
            self._slots = [s for s in self._slots if s.used > cutoff or not s.idle()]
            return before - len(self._slots)
