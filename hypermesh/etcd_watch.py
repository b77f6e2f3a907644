"""One etcd watch stream over several key ranges, which can be asked how far it has come.

A follower that mirrors only part of the namespace (the plan in docs/architecture.md,
"What grows with the mesh") watches two ranges: everything before the block kinds and
everything after them. Two things of etcd's Watch API make that as good as one watch of
the whole prefix, and etcd3aio's watch (one range, no way to write on its stream) offers
neither, hence this module:

- one stream carries one watcher per range (ids chosen here), so the ranges are opened,
  resumed and closed together;
- a *progress request* on the stream is answered, once every watcher on it has been sent
  everything up to etcd's current revision, with that revision: a reader whose ranges
  saw no change still learns how far the namespace has come, which a read-your-writes
  gate needs after a write outside its ranges.

:class:`RangeWatch` yields :class:`Change` s. ``Change.revision`` is the *consistent*
revision: every event at or below it, in every range, has been yielded. Events of one
range come in revision order; while a stream catches up after a resume, one range's
events may come before older events of another, so only ``revision`` promises anything
across ranges. A watch never reconnects by itself: an error or an ended stream goes to
the caller, which opens a new one at ``revision + 1`` and passes how far each range had
got (``applied``), so that no event is yielded twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest

ALL_WATCHERS = -1
"""The watch id etcd gives a progress report that covers every watcher of the stream."""


class WatchCompacted(Exception):
    """The watch started below etcd's compaction: reload, then watch from the load."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (etcd kept from {compact_revision})")
        self.compact_revision = compact_revision


class WatchEnded(Exception):
    """etcd cancelled a watcher (``cancelled``, with its reason) or closed the stream:
    open a new watch."""

    def __init__(self, message: str, cancelled: bool = False) -> None:
        super().__init__(message)
        self.cancelled = cancelled


@dataclass
class Change:
    """What one answer of etcd brought: ``events`` (etcd's mvcc events, in revision order
    within each range) and the consistent revision after them."""

    revision: int
    events: list[Any] = field(default_factory=list)


class RangeWatch:
    """Watch ``ranges`` (each ``(start, end)``, end exclusive) from ``start_revision``.

    ``stub`` is a Watch stub on an etcd channel, ``metadata`` what its calls carry (the
    auth token). ``applied[i]``: the revision up to which range ``i`` was already applied
    by an earlier watch (its events at or below are dropped); default ``start_revision -
    1`` for every range. Use as an async context manager, then iterate; one reader."""

    def __init__(
        self,
        stub: Any,
        ranges: Sequence[tuple[bytes, bytes]],
        start_revision: int,
        *,
        applied: Sequence[int] | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        if not ranges:
            raise ValueError("a watch needs at least one range")
        if start_revision < 1:
            raise ValueError("start_revision must be 1 or more")
        self._stub = stub
        self._ranges = list(ranges)
        self._start = start_revision
        self._seen = list(applied) if applied is not None else [start_revision - 1] * len(ranges)
        if len(self._seen) != len(self._ranges):
            raise ValueError("applied needs one revision per range")
        self._metadata = tuple(metadata) if metadata else None
        self._call: Any = None
        self._write_lock = asyncio.Lock()

    @property
    def revision(self) -> int:
        """Every event at or below this revision, in every range, has been yielded."""
        return min(self._seen)

    @property
    def applied(self) -> list[int]:
        """How far each range has been yielded: pass to the next watch on a resume."""
        return list(self._seen)

    async def __aenter__(self) -> RangeWatch:
        self._call = self._stub.Watch(metadata=self._metadata)
        for watch_id, (start, end) in enumerate(self._ranges):
            await self._write(WatchRequest(create_request=WatchCreateRequest(
                key=start, range_end=end, start_revision=self._start, watch_id=watch_id)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def _write(self, request: WatchRequest) -> None:
        async with self._write_lock:
            await self._call.write(request)

    async def request_progress(self) -> None:
        """Ask etcd for a progress report: the next :class:`Change` without events
        brings ``revision`` up to etcd's revision at the time it answered, once every
        watcher has caught up with it."""
        request = WatchRequest()
        request.progress_request.SetInParent()  # the message has no fields: set it empty
        await self._write(request)

    async def __aiter__(self) -> AsyncIterator[Change]:
        while True:
            resp = await self._call.read()
            if resp is grpc.aio.EOF:
                raise WatchEnded("etcd closed the watch stream")
            if resp.compact_revision:
                raise WatchCompacted(int(resp.compact_revision))
            if resp.canceled:
                raise WatchEnded(f"etcd cancelled the watch: {resp.cancel_reason or 'no reason'}",
                                 cancelled=True)
            if resp.created:
                continue
            yield self._take(resp)

    def _take(self, resp: Any) -> Change:
        """The change one answer brings, with the revisions it settles."""
        watch_id = int(resp.watch_id)
        if not resp.events:
            # A progress report: of every watcher (etcd 3.5), or of this one (3.4).
            reported = int(resp.header.revision)
            ids = range(len(self._seen)) if watch_id == ALL_WATCHERS else [watch_id]
            for i in ids:
                self._seen[i] = max(self._seen[i], reported)
            return Change(self.revision)
        floor = self._seen[watch_id]
        events = [ev for ev in resp.events if ev.kv.mod_revision > floor]
        if events:
            # etcd sends all of one revision's events of a watcher in one answer.
            self._seen[watch_id] = max(floor, int(events[-1].kv.mod_revision))
        return Change(self.revision, events)
