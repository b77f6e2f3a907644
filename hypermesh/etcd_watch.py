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
  gate needs after a write outside its ranges;
- watchers can be added to and cancelled on an open stream: such a follower also follows
  the plan keys of the workflows it works on, for as long as it works on them
  (:class:`Following`), and of no other.

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
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from etcd3aio._protobuf import WatchCancelRequest, WatchCreateRequest, WatchRequest

log = logging.getLogger(__name__)

ALL_WATCHERS = -1
"""The watch id etcd gives a progress report that covers every watcher of the stream."""

ENDED_KEPT = 256
"""Names ``Following`` remembers as ended, so that late keys of them do not follow them
again; a mirror keeps what it last read of those (a workflow ended, no longer watched,
whose deletion it will not see) and forgets the oldest past that many."""


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
    1`` for every range. Use as an async context manager, then iterate; one reader.
    Range ``i`` is watcher ``i``; :meth:`add` gives the ranges it adds the next ids, and
    :meth:`cancel` stops watchers by id."""

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
        seen = list(applied) if applied is not None else [start_revision - 1] * len(ranges)
        if len(seen) != len(self._ranges):
            raise ValueError("applied needs one revision per range")
        self._seen: dict[int, int] = dict(enumerate(seen))  # watcher id -> yielded up to
        self._next_id = len(seen)
        self._cancelled: set[int] = set()  # by cancel(): etcd's late answers are ignored
        self._metadata = tuple(metadata) if metadata else None
        self._call: Any = None
        self._write_lock = asyncio.Lock()

    @property
    def revision(self) -> int:
        """Every event at or below this revision, in every range, has been yielded."""
        return min(self._seen.values())

    @property
    def applied(self) -> list[int]:
        """How far each range given to the constructor has been yielded: pass to the
        next watch of the same ranges on a resume."""
        return [self._seen[i] for i in range(len(self._ranges))]

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

    async def add(self, ranges: Sequence[tuple[bytes, bytes]], read_at: int) -> list[int]:
        """Watch ``ranges`` too, on this stream, from just after ``read_at``: the revision
        their keys were read at, which is at least any this stream yielded, so the
        consistent revision does not go back. Their watcher ids, to :meth:`cancel`."""
        ids = []
        for start, end in ranges:
            watch_id, self._next_id = self._next_id, self._next_id + 1
            self._seen[watch_id] = read_at
            ids.append(watch_id)
            await self._write(WatchRequest(create_request=WatchCreateRequest(
                key=start, range_end=end, start_revision=read_at + 1, watch_id=watch_id)))
        return ids

    async def cancel(self, ids: Sequence[int]) -> None:
        """Stop the watchers ``ids``: nothing more of theirs is yielded, and they no
        longer hold the consistent revision back. The last watcher is never cancelled."""
        for watch_id in ids:
            if watch_id in self._seen and len(self._seen) > 1:
                del self._seen[watch_id]
                self._cancelled.add(watch_id)
                await self._write(WatchRequest(
                    cancel_request=WatchCancelRequest(watch_id=watch_id)))

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
            if resp.canceled and int(resp.watch_id) in self._cancelled:
                self._cancelled.discard(int(resp.watch_id))  # as asked: its last answer
                continue
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
            ids = list(self._seen) if watch_id == ALL_WATCHERS else [watch_id]
            for i in ids:
                if i in self._seen:
                    self._seen[i] = max(self._seen[i], reported)
            return Change(self.revision)
        if watch_id not in self._seen:
            return Change(self.revision)  # a cancelled watcher's events, sent before it ended
        floor = self._seen[watch_id]
        events = [ev for ev in resp.events if ev.kv.mod_revision > floor]
        if events:
            # etcd sends all of one revision's events of a watcher in one answer.
            self._seen[watch_id] = max(floor, int(events[-1].kv.mod_revision))
        return Change(self.revision, events)


class Following:
    """Ranges a partial watch follows by name for as long as it is asked to: a node that
    watches its own part (``Keyspace.own_ranges``) follows a workflow's plan keys
    (``Keyspace.workflow_ranges``) from when a key it receives names the workflow until
    the workflow ends or is deleted, and no other workflow's.

    Whoever applies the watch's keys asks, with :meth:`want` and :meth:`drop`; the watch
    loop (``hypermesh.state.etcd.Etcd.mirror``) reads a wanted name's keys, applies them
    and adds its ranges to the open stream, then watches them until dropped. A name's
    first range is one key, its anchor (the workflow record); while that key is missing
    the name is not followed: it is gone, or was never there."""

    def __init__(self, ranges_of: Callable[[str], Sequence[tuple[str, str]]]) -> None:
        self.ranges_of = ranges_of
        self.followed: dict[str, list[int]] = {}  # name -> its watcher ids on the stream
        self.wanted: set[str] = set()
        self.unwanted: set[str] = set()
        # Names that ended (a workflow in a final state), the last ENDED_KEPT: followed
        # again only when asked ``again`` (its work reopened), not by a late key of it.
        self.ended: OrderedDict[str, None] = OrderedDict()

    def want(self, name: str, again: bool = True) -> None:
        """Follow ``name``; one that ended, only ``again``."""
        if name in self.ended:
            if not again:
                return
            del self.ended[name]
        if name not in self.followed:
            self.wanted.add(name)

    def drop(self, name: str) -> None:
        """Stop following ``name``: it is gone."""
        self.wanted.discard(name)
        self.ended.pop(name, None)
        if name in self.followed:
            self.unwanted.add(name)

    def end(self, name: str) -> list[str]:
        """Stop following ``name`` until it is wanted ``again``: it ended. Returns the
        names no longer remembered as ended (the oldest, past ``ENDED_KEPT``)."""
        self.drop(name)
        self.ended[name] = None
        return [self.ended.popitem(last=False)[0]
                for _ in range(len(self.ended) - ENDED_KEPT)]

    def ranges(self) -> list[tuple[str, str]]:
        """The ranges of every followed name, in ``followed``'s order."""
        return [r for name in self.followed for r in self.ranges_of(name)]

    def reopened(self, first_id: int) -> None:
        """A new stream watches ``ranges()`` from watcher id ``first_id`` on."""
        for name in self.followed:
            count = len(self.ranges_of(name))
            self.followed[name] = list(range(first_id, first_id + count))
            first_id += count

    def forget_absent(self, keys: set[bytes]) -> None:
        """After a reload that read ``keys``: stop following the names whose anchor
        went while no stream was open."""
        for name in [n for n in self.followed if not self.anchored(n, keys)]:
            del self.followed[name]
            self.unwanted.discard(name)

    def anchored(self, name: str, keys: set[bytes]) -> bool:
        """Whether ``keys`` hold the name's anchor: the key its first range starts at (a
        range of that one key). A set lookup: a reload reads the whole namespace."""
        return self.ranges_of(name)[0][0].encode() in keys


def hush_broken_stream_noise(loop: asyncio.AbstractEventLoop) -> None:
    """When a streaming call breaks (etcd3aio's watches feed theirs from an async
    generator), grpc.aio can leave the task that consumes the request iterator pending
    and the generator half-closed (grpc/grpc#29518); asyncio then reports both as
    errors, though nothing was lost and the stream is opened again. Those two go to the
    debug log; every other report to asyncio's default handler."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        what = f"{context.get('task') or context.get('future')!r} {context.get('exception')!r}"
        if "_consume_request_iterator" in what or (
            "asynchronous generator is already running" in what
        ):
            log.debug("grpc.aio stream cleanup: %s %s", context.get("message"), what)
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
