"""A cheaper wait for the FUSE device under asyncio than pyfuse3's own.

pyfuse3 (asyncio mode) waits for each request with ``wait_readable(fd)``, which
registers the device with the event loop and removes it again once it fired: two
``epoll_ctl`` calls and the selector bookkeeping around them for every request, about a
tenth of the mount's event-loop time on a cold read of many small files. pyfuse3 only
ever has one task waiting on the device at a time (its workers take a lock first), so
here the device stays registered while requests keep coming:

- a readable device wakes the one waiting task, if any;
- the readiness is checked again (a zero-timeout ``poll``) when the event is handled:
  the event may come from a poll made before the last task read the last request, and
  a task woken for nothing would block the whole loop in its read of the device;
- with none waiting (the woken task has not read its request yet, or every worker is
  busy), it is left registered once — the next poll usually finds the request read —
  and unregistered the second time in a row, so a level-triggered device that nobody
  reads never makes the loop spin; the next wait registers it again.

``install()`` swaps the two functions pyfuse3 calls (``wait_readable`` and
``notify_closing`` of ``pyfuse3.asyncio``); call it after ``pyfuse3.asyncio.enable()``.
"""

from __future__ import annotations

import asyncio
import select
from typing import Any

IDLE_FIRES = 2
"""Readable events in a row with nobody waiting after which the device is unregistered."""


class DeviceWait:
    """The waiting task (at most one) and the registration of one file descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop, self.fd = loop, fd
        self.waiter: asyncio.Future[None] | None = None
        self.watching = False
        self.idle = 0
        self.registrations = 0  # how often the device was registered (for tests)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    async def wait(self) -> None:
        if self.waiter is not None:
            raise RuntimeError(f"another task already waits for fd {self.fd}")
        waiter: asyncio.Future[None] = self.loop.create_future()
        self.waiter = waiter
        if not self.watching:
            self.loop.add_reader(self.fd, self._readable)
            self.watching = True
            self.registrations += 1
        self.idle = 0
        try:
            await waiter
        finally:
            if self.waiter is waiter:
                self.waiter = None

    def _readable(self) -> None:
        if not self._poll.poll(0):
            return  # a stale event: the request it saw was read already
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(None)
            return
        self.idle += 1
        if self.idle >= IDLE_FIRES:
            self.stop()

    def stop(self) -> None:
        if self.watching:
            self.loop.remove_reader(self.fd)
            self.watching = False

    def close(self, exc: BaseException) -> None:
        """The descriptor is about to close: the waiting task gets ``exc``."""
        self.stop()
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


_waits: dict[int, DeviceWait] = {}


async def wait_readable(fd: Any) -> None:
    key = fd if isinstance(fd, int) else fd.fileno()
    wait = _waits.get(key)
    loop = asyncio.get_running_loop()
    if wait is None or wait.loop is not loop:
        wait = _waits[key] = DeviceWait(loop, key)
    await wait.wait()


def notify_closing(fd: Any) -> None:
    import pyfuse3.asyncio

    key = fd if isinstance(fd, int) else fd.fileno()
    wait = _waits.pop(key, None)
    if wait is not None:
        wait.close(pyfuse3.asyncio.ClosedResourceError())


def install() -> None:
    """Make pyfuse3 (in asyncio mode) wait for the FUSE device through this module."""
    import pyfuse3.asyncio

    pyfuse3.asyncio.wait_readable = wait_readable  # type: ignore[assignment]
    pyfuse3.asyncio.notify_closing = notify_closing  # type: ignore[assignment]
