"""Receive buffers: aligned, reused only once no view of them is left, given back when idle."""

from __future__ import annotations

import ctypes
import os

from hypermesh.chunkfs.buffers import HUGE, BufferPool, aligned_buffer

MiB = 1 << 20


def address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_aligned_buffers_are_page_aligned_writable_and_zeroed() -> None:
    for size in (1, 4096, 3 * MiB + 5):
        buf = aligned_buffer(size)
        assert len(buf) == size and not buf.readonly
        assert address(buf) % 4096 == 0
        assert buf == bytes(size)


def test_large_buffers_start_on_a_huge_page_boundary_and_are_private() -> None:
    """From 2 MiB up, buffers start on a 2 MiB boundary (so the kernel can back them
    with transparent huge pages), pooled ones too; and the memory is private to the
    process (mmap's default for anonymous memory is shared, which no huge page backs
    and which a forked child would share)."""
    pool = BufferPool(16 * MiB, most=2)
    for buf in (aligned_buffer(16 * MiB), aligned_buffer(3 * MiB), pool.get(16 * MiB),
                pool.get(5 * MiB)):
        assert address(buf) % HUGE == 0
    buf = aligned_buffer(2 * MiB)
    buf[:4] = b"mine"
    pid = os.fork()
    if pid == 0:  # the child scribbles on its copy and leaves at once
        buf[:4] = b"kids"
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert buf[:4] == b"mine"


def test_a_buffer_is_handed_out_again_only_when_no_view_of_it_is_left() -> None:
    pool = BufferPool(MiB, most=2)
    a = pool.get(MiB)
    a[:5] = b"first"
    block = a[4096:8192]  # a slice a reader still holds keeps the buffer busy
    del a
    b = pool.get(MiB)
    assert address(b) != address(block) - 4096
    del b
    c = pool.get(100)  # b's buffer is idle again and is reused
    assert len(c) == 100 and len(pool) == 2
    del block
    d = pool.get(MiB)
    assert d[:5] == b"first"  # the first buffer, unchanged: contents are not cleared
    assert pool.fresh == 0
    assert address(c) % 4096 == 0 and address(d) % 4096 == 0


def test_past_its_bound_or_size_the_pool_gives_fresh_buffers() -> None:
    pool = BufferPool(MiB, most=1)
    held = pool.get(MiB)
    extra = pool.get(MiB)
    big = pool.get(2 * MiB)
    assert len(pool) == 1 and pool.fresh == 2
    assert len(big) == 2 * MiB and address(extra) % 4096 == 0
    del held, extra, big


def test_trim_drops_idle_buffers_and_keeps_busy_ones() -> None:
    pool = BufferPool(MiB, most=3, idle_s=0.0)
    busy = pool.get(MiB)
    idle = pool.get(MiB)
    del idle
    assert pool.trim() == 1
    assert len(pool) == 1
    busy[0] = 1  # still usable
    del busy
    assert pool.trim() == 1 and len(pool) == 0
