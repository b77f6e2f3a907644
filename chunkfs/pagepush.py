"""Prefetched file bytes into the kernel's page cache, so sequential readers never ask.

A FUSE read costs the mount a request round trip: the kernel's message, a Python
handler, a hop to a worker thread, a reply. For a file read from start to end, the
fetch threads already hold the verified bytes the kernel will ask for next, so the
mount *stores* them into the page cache (``notify_store``) as they arrive; the reader's
``read`` then finds them there. The data set is immutable and its files are opened
with ``keep_cache``, so stored pages stay valid for the life of the mount.

``notify_store`` locks each page it fills, and the kernel holds a page locked while a
read of it is pending — a read that may be waiting for a fetch. Fetch threads
therefore only enqueue here; one thread of its own does the stores, so a locked page
delays that thread and never a fetch. The queue is bounded and a full queue drops the
bytes: a page not stored is read the normal way.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
from collections.abc import Callable

from hypermesh.chunkfs.cache import ReadStats

log = logging.getLogger(__name__)

PAGE = 4096
Store = Callable[[int, int, "memoryview | bytes"], None]
"""``store(inode, offset, data)``: ``pyfuse3.notify_store`` in a mount."""
_Item = tuple[int, int, "memoryview | bytes", "Callable[[], int] | None"]


class PagePusher:
    """A bounded queue of page-cache stores, carried out by one thread.

    ``push`` never blocks and may be called from any thread; after ``close`` (or once
    the kernel says it cannot store) it does nothing. Counts ``pushed_bytes``,
    ``push_dropped`` (queue full) and ``push_errors`` in ``stats``.
    """

    def __init__(self, store: Store, stats: ReadStats, max_queued: int = 64) -> None:
        self._store = store
        self.stats = stats
        self._queue: queue.Queue[_Item | None] = queue.Queue(max_queued)
        self._open = True
        self._thread = threading.Thread(target=self._run, name="chunkfs-push", daemon=True)
        self._thread.start()

    def push(
        self,
        inode: int,
        offset: int,
        data: memoryview | bytes,
        asked_end: Callable[[], int] | None = None,
    ) -> None:
        """Queue a store. ``asked_end``: how far the kernel has asked for the file
        already; pages before it are cut off when the store's turn comes (they are on
        their way through reads, and storing them again would be waste)."""
        if not self._open:
            return
        try:
            self._queue.put_nowait((inode, offset, data, asked_end))
        except queue.Full:
            self.stats.add("push_dropped")

    def bind(
        self, inode: int, asked_end: Callable[[], int] | None = None
    ) -> Callable[[int, memoryview | bytes], None]:
        """``push`` for one file: ``(offset, data)``."""

        def push(offset: int, data: memoryview | bytes) -> None:
            self.push(inode, offset, data, asked_end)

        return push

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            inode, offset, data, asked_end = item
            if asked_end is not None:
                asked = -(-asked_end() // PAGE) * PAGE
                if offset + len(data) <= asked:
                    self.stats.add("push_skipped")
                    continue
                if offset < asked:
                    data, offset = data[asked - offset :], asked
            try:
                self._store(inode, offset, data)
            except OSError as exc:
                self.stats.add("push_errors")
                if exc.errno == errno.ENOSYS:
                    log.info("the kernel cannot store pages (ENOSYS): reads go the normal way")
                    self._open = False
                else:
                    log.debug("page store of inode %d at %d failed: %s", inode, offset, exc)
            else:
                self.stats.add("pushed_bytes", len(data))

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking pushes, drop what is queued, and wait for the thread to end."""
        self._open = False
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:  # pragma: no cover - only if pushes raced close
            return
        self._thread.join(timeout)
