"""The FUSE device wait (chunkfs/fusewait.py) on a real pipe: wakes, stale events, idling."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator

import pytest

from hypermesh.chunkfs import fusewait
from hypermesh.chunkfs.fusewait import DeviceWait


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))  # type: ignore[arg-type]


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Let the event loop run until ``condition()`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.001)


@contextlib.contextmanager
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def test_a_waiting_task_wakes_per_request_and_the_device_stays_registered() -> None:
    async def main() -> None:
        with pipe() as (r, w):
            dev = DeviceWait(asyncio.get_running_loop(), r)
            for _ in range(5):
                waiting = asyncio.ensure_future(dev.wait())
                await asyncio.sleep(0.01)
                assert not waiting.done()  # nothing to read yet
                os.write(w, b"x")
                await waiting
                assert os.read(r, 1) == b"x"  # the woken task reads its request
            assert dev.registrations == 1 and dev.watching

    run(main())


def test_a_stale_event_never_wakes_a_task_when_nothing_is_readable() -> None:
    """An event seen before the last request was read must not wake the next waiter:
    on the real device that waiter would block the loop in its read."""

    async def main() -> None:
        with pipe() as (r, w):
            dev = DeviceWait(asyncio.get_running_loop(), r)
            waiting = asyncio.ensure_future(dev.wait())
            await asyncio.sleep(0)
            os.write(w, b"x")
            await waiting
            assert os.read(r, 1) == b"x"
            second = asyncio.ensure_future(dev.wait())
            await asyncio.sleep(0)
            dev._readable()  # what a stale readiness event calls
            await asyncio.sleep(0.05)
            assert not second.done()
            os.write(w, b"y")
            await second
            assert os.read(r, 1) == b"y"

    run(main())


def test_unread_requests_with_nobody_waiting_unregister_the_device() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pipe() as (r, w):
            dev = DeviceWait(loop, r)
            waiting = asyncio.ensure_future(dev.wait())
            await asyncio.sleep(0)
            os.write(w, b"ab")
            await waiting  # woken, and the task "stays busy": nobody reads or waits
            # unregistered after IDLE_FIRES events: no spinning
            await until(lambda: not dev.watching, "the idle device to be unregistered")
            assert dev.idle == fusewait.IDLE_FIRES
            again = asyncio.ensure_future(dev.wait())
            await again  # registered again and woken for the request still there
            assert dev.registrations == 2
            assert os.read(r, 2) == b"ab"

    run(main())


def test_closing_fails_the_waiting_task_and_one_waiter_at_a_time() -> None:
    import pyfuse3.asyncio

    async def main() -> None:
        with pipe() as (r, _w):
            waiting = asyncio.ensure_future(fusewait.wait_readable(r))
            await asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="already waits"):
                await fusewait._waits[r].wait()
            fusewait.notify_closing(r)
            with pytest.raises(pyfuse3.asyncio.ClosedResourceError):
                await waiting
            assert r not in fusewait._waits

    run(main())


def test_install_makes_pyfuse3_wait_through_this_module() -> None:
    import pyfuse3.asyncio

    stock = pyfuse3.asyncio.wait_readable, pyfuse3.asyncio.notify_closing
    try:
        fusewait.install()
        assert pyfuse3.asyncio.wait_readable is fusewait.wait_readable
        assert pyfuse3.asyncio.notify_closing is fusewait.notify_closing
    finally:
        pyfuse3.asyncio.wait_readable, pyfuse3.asyncio.notify_closing = stock
