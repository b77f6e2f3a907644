"""The page pusher's queue and thread, with a stand-in for ``pyfuse3.notify_store``
(a real mount's pushes are tested in test_chunkfs_mount.py)."""

from __future__ import annotations

import errno
import threading

from hypermesh.chunkfs.cache import ReadStats
from hypermesh.chunkfs.fetch import Readahead
from hypermesh.chunkfs.pagepush import PAGE, PagePusher
from hypermesh.local.processes import wait_for


def test_pushes_are_stored_in_order_and_counted() -> None:
    stored: list[tuple[int, int, bytes]] = []
    pusher = PagePusher(lambda ino, off, data: stored.append((ino, off, bytes(data))), ReadStats())
    push = pusher.bind(7)
    push(0, b"a" * 10)
    push(4096, memoryview(b"b" * 5))
    wait_for(lambda: len(stored) == 2, 5, "two stores")
    assert stored == [(7, 0, b"a" * 10), (7, 4096, b"bbbbb")]
    assert pusher.stats.snapshot()["pushed_bytes"] == 15
    pusher.close()
    push(8192, b"late")  # after close: ignored, never raised
    assert len(stored) == 2


def test_a_full_queue_drops_and_a_blocked_store_never_blocks_push() -> None:
    release = threading.Event()
    pusher = PagePusher(lambda *_: release.wait(10), ReadStats(), max_queued=2)
    for i in range(10):  # the first is taken by the thread (blocked), two queue, rest drop
        pusher.push(1, i, b"x")
    assert pusher.stats.snapshot()["push_dropped"] >= 7
    release.set()
    pusher.close()


def test_a_kernel_without_stores_turns_pushing_off() -> None:
    calls: list[int] = []

    def store(ino: int, off: int, data: object) -> None:
        calls.append(off)
        raise OSError(errno.ENOSYS, "not supported")

    pusher = PagePusher(store, ReadStats())
    pusher.push(1, 0, b"x")
    wait_for(lambda: pusher.stats.snapshot()["push_errors"] == 1, 5, "the failed store")
    pusher.push(1, 4096, b"y")
    pusher.close()
    assert calls == [0]


def test_pages_the_kernel_asked_for_are_not_stored_again() -> None:
    ra = Readahead(4 << 20, 64 << 20)
    ra.advise(0, 1 << 20, 100 << 20)  # the kernel asked for the first MiB
    stored: list[tuple[int, int]] = []
    pusher = PagePusher(lambda ino, off, data: stored.append((off, len(data))), ReadStats())
    push = pusher.bind(1, lambda: ra.asked_end)
    push(0, bytes(1 << 20))  # all asked: dropped
    push((1 << 20) - PAGE, bytes(3 * PAGE))  # the asked page is cut off
    push(2 << 20, bytes(PAGE))  # beyond: stored whole
    wait_for(lambda: len(stored) == 2, 5, "two stores")
    assert stored == [(1 << 20, 2 * PAGE), (2 << 20, PAGE)]
    assert pusher.stats.snapshot()["push_skipped"] == 1
    pusher.close()
