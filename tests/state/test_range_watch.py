"""hypermesh.etcd_watch against a real etcd: several ranges on one stream, progress
reports that carry the revision past changes outside the ranges, resumes that neither
repeat nor skip an event, compaction."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from hypermesh.etcd_watch import RangeWatch, WatchCompacted, WatchEnded
from hypermesh.local.etcd import EtcdServer
from hypermesh.state.etcd import Etcd

DEADLINE_S = 10.0


def ranges_of(root: str) -> list[tuple[bytes, bytes]]:
    """The follower's cut: everything under ``root`` but the keys under ``b``."""
    return [(root.encode(), f"{root}b".encode()), (f"{root}c".encode(), f"{root}~".encode())]


class Reader:
    """Reads a watch in the background: its events as (key, mod revision), and its
    consistent revision after each change."""

    def __init__(self, watch: RangeWatch) -> None:
        self.watch = watch
        self.events: list[tuple[str, int]] = []
        self.revision = 0
        self.error: BaseException | None = None
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            async for change in self.watch:
                self.events += [(ev.kv.key.decode(), ev.kv.mod_revision) for ev in change.events]
                self.revision = change.revision
        except (WatchEnded, WatchCompacted, Exception) as exc:
            self.error = exc

    async def until(self, done: Callable[[], bool], what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        while not done():
            if self.error is not None:
                raise AssertionError(f"watch failed while waiting for {what}: {self.error!r}")
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; events {self.events}, "
                                     f"revision {self.revision}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def run(server: EtcdServer, scenario: Callable[[Etcd], Awaitable[None]]) -> None:
    async def main() -> None:
        async with Etcd([server.url.split("//")[1]]) as etcd:
            await scenario(etcd)

    asyncio.run(main())


def stub(etcd: Etcd) -> Any:
    assert etcd.client.watch is not None
    return etcd.client.watch._stub


@contextlib.asynccontextmanager
async def watched(
    etcd: Etcd, root: str, start: int, applied: Sequence[int] | None = None
) -> AsyncIterator[tuple[RangeWatch, Reader]]:
    """A watch of ``ranges_of(root)`` from ``start``, read in the background."""
    async with RangeWatch(stub(etcd), ranges_of(root), start, applied=applied) as watch:
        reader = Reader(watch)
        try:
            yield watch, reader
        finally:
            await reader.stop()


def test_two_ranges_on_one_stream_and_a_progress_report_past_changes_outside_them(
    etcd_server: EtcdServer,
) -> None:
    root = f"/rw-{uuid.uuid4().hex[:8]}/"

    async def scenario(etcd: Etcd) -> None:
        start = await etcd.put(f"{root}zz-start", b"")
        async with watched(etcd, root, start + 1) as (watch, reader):
            outside = [await etcd.put(f"{root}b/{i}", b"x") for i in range(3)]
            first = await etcd.put(f"{root}a/1", b"x")
            second = await etcd.put(f"{root}c/1", b"x")
            last_outside = await etcd.put(f"{root}b/9", b"x")
            await reader.until(lambda: len(reader.events) == 2, "both ranges' events")
            assert reader.events == [(f"{root}a/1", first), (f"{root}c/1", second)]
            assert max(outside) < first < second < last_outside
            # Nothing in the ranges changed at last_outside: only a report gets there.
            assert reader.revision < last_outside
            await watch.request_progress()
            await reader.until(lambda: reader.revision >= last_outside, "the progress report")
            assert len(reader.events) == 2

    run(etcd_server, scenario)


def test_the_consistent_revision_waits_for_every_range(etcd_server: EtcdServer) -> None:
    """Events in one range do not carry the revision past an idle range's last report;
    one transaction writing in both ranges is seen whole once the revision passes it."""
    root = f"/rw-{uuid.uuid4().hex[:8]}/"

    async def scenario(etcd: Etcd) -> None:
        start = await etcd.put(f"{root}zz-start", b"")
        async with watched(etcd, root, start + 1) as (watch, reader):
            await watch.request_progress()
            await reader.until(lambda: reader.revision >= start, "the first report")
            busy = [await etcd.put(f"{root}c/{i}", b"x") for i in range(5)]
            await reader.until(lambda: len(reader.events) == 5, "the busy range's events")
            assert reader.revision < busy[0]  # range a said nothing past start
            both = await etcd.txn([], [etcd.op_put(f"{root}a/t", b"1"),
                                       etcd.op_put(f"{root}c/t", b"1")])
            assert both.succeeded
            await reader.until(lambda: len(reader.events) == 7, "the transaction's events")
            assert {(f"{root}a/t", both.revision), (f"{root}c/t", both.revision)} <= set(
                reader.events)
            await watch.request_progress()
            await reader.until(lambda: reader.revision >= both.revision, "the report")

    run(etcd_server, scenario)


def test_a_resume_after_an_etcd_restart_neither_repeats_nor_skips(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    root = "/resume/"
    written: list[tuple[str, int]] = []

    async def write(etcd: Etcd, key: str) -> None:
        written.append((key, await etcd.put(key, b"x")))

    async def scenario(etcd: Etcd) -> None:
        start = await etcd.put(f"{root}zz-start", b"")
        async with RangeWatch(stub(etcd), ranges_of(root), start + 1) as watch:
            reader = Reader(watch)
            for i in range(4):
                await write(etcd, f"{root}a/{i}")
                await write(etcd, f"{root}c/{i}")
            await reader.until(lambda: len(reader.events) == 8, "the first events")
            seen, applied, revision = list(reader.events), watch.applied, watch.revision
            server.stop()
            await reader.until(lambda: reader.error is not None, "the stream to break")
            await reader.stop()
        server.start()
        for i in range(4, 8):  # while no watch is open
            await write(etcd, f"{root}c/{i}")
        await write(etcd, f"{root}a/9")
        # Resume at the consistent revision; each range drops what it already gave.
        async with watched(etcd, root, revision + 1, applied) as (watch, reader):
            await reader.until(lambda: len(seen) + len(reader.events) >= len(written),
                               "the events written while no watch was open")
            await watch.request_progress()
            await reader.until(lambda: reader.revision >= written[-1][1], "the report")
            assert sorted(seen + reader.events, key=lambda e: e[1]) == written

    try:
        run(server, scenario)
    finally:
        server.stop()


def test_a_watch_from_a_compacted_revision_says_where_etcd_kept_from(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", fsync=False).start()
    root = "/compacted/"

    async def scenario(etcd: Etcd) -> None:
        first = await etcd.put(f"{root}a/1", b"x")
        last = 0
        for i in range(5):
            last = await etcd.put(f"{root}c/{i}", b"x")
        await etcd.compact(last)
        async with RangeWatch(stub(etcd), ranges_of(root), first) as watch:
            with pytest.raises(WatchCompacted) as caught:
                async for _ in watch:
                    pass
        assert caught.value.compact_revision == last

    try:
        run(server, scenario)
    finally:
        server.stop()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one range"):
        RangeWatch(object(), [], 1)
    with pytest.raises(ValueError, match="start_revision"):
        RangeWatch(object(), [(b"a", b"b")], 0)
    with pytest.raises(ValueError, match="one revision per range"):
        RangeWatch(object(), [(b"a", b"b"), (b"c", b"d")], 5, applied=[4])


def test_ranges_added_to_and_cancelled_on_an_open_stream(etcd_server: EtcdServer) -> None:
    """A range added from the revision its keys were read at gets every later change of
    it, and none from before; a cancelled one gets none, and its cancellation neither
    ends the stream nor holds its consistent revision back."""
    root = f"/rw-{uuid.uuid4().hex[:8]}/"
    extra = [(f"{root}b/x".encode(), f"{root}b/x\0".encode())]

    async def scenario(etcd: Etcd) -> None:
        start = await etcd.put(f"{root}zz-start", b"")
        async with watched(etcd, root, start + 1) as (watch, reader):
            before = await etcd.put(f"{root}b/x", b"old")
            _, read_at = await etcd.get_prefix(f"{root}b/")
            ids = await watch.add(extra, read_at)
            assert ids == [2]  # after the two ranges the watch was opened with
            mine = await etcd.put(f"{root}b/x", b"new")
            await etcd.put(f"{root}b/y", b"not watched")
            marker = await etcd.put(f"{root}a/1", b"x")
            await reader.until(lambda: (f"{root}a/1", marker) in reader.events, "the marker")
            assert reader.events == [(f"{root}b/x", mine), (f"{root}a/1", marker)]
            assert before <= read_at < mine
            await watch.cancel(ids)
            await etcd.put(f"{root}b/x", b"after the cancel")
            last = await etcd.put(f"{root}c/1", b"x")
            await reader.until(lambda: (f"{root}c/1", last) in reader.events, "the last marker")
            assert [e for e in reader.events if e[0] == f"{root}b/x"] == [(f"{root}b/x", mine)]
            await watch.request_progress()
            await reader.until(lambda: reader.revision >= last, "the revision past the cancel")
            assert reader.error is None

    run(etcd_server, scenario)
