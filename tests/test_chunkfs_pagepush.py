"""The page pusher's queue and thread, with a stand-in for ``pyfuse3.notify_store``
(a real mount's pushes are tested in test_chunkfs_mount.py)."""

from __future__ import annotations

import errno
import threading

from hypermesh.chunkfs.cache import ReadStats
from hypermesh.chunkfs.pagepush import PagePusher

from hypermesh.localmesh import wait_for


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
