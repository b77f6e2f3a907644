"""Failing reads once, within the deadline, while the object store does not answer.

A hung store (one that accepts connections and never answers) must cost a reader one
deadline, once — not a deadline per FUSE request. The kernel splits one ``read()``
into requests of at most 128 KiB, keeps some of them queued behind others, and asks
again for a page whose readahead failed; each of those requests would otherwise wait
a deadline of its own. Two pieces prevent that:

- ``Outages`` remembers, per key (a chunk id, a manifest page key), that a fetch of it
  failed for want of the store. For one deadline after the failure, a read that would
  need the store for that key fails at once (what is cached is still served). A fetch
  of the key that succeeds — such as one still in flight when the store answers
  again — forgets the failure, so reads work again as soon as the store does.
- ``Flights`` runs one fetch per key at a time on threads of its own. Every caller
  waits for that fetch until the deadline of the caller that started it (or its own,
  if that is earlier): callers that join late share the first one's deadline. A
  fetch still running at its deadline is noted in ``Outages``; it goes on, and its
  late result still counts.

The chunk reader keeps its block fetches as claims with the same rule (``fetch.py``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Generic, TypeVar

from hypermesh.errors import StoreUnavailable, TransientError

V = TypeVar("V")
Clock = Callable[[], float]


class Outages:
    """Keys whose last fetch failed for want of the store, each for ``hold_s`` seconds.

    Anyone may ``note`` or ``forget`` a key; ``check`` raises while a key is held.
    Thread-safe. Memory: one entry per key that failed within the last ``hold_s``.
    """

    def __init__(self, hold_s: float, clock: Clock = time.monotonic) -> None:
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        self.hold_s = hold_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[float, str]] = OrderedDict()  # key: (at, cause)
        self.noted = 0  # failures noted
        self.failed_fast = 0  # checks that failed at once

    def note(self, key: str, cause: str) -> None:
        """A fetch of ``key`` failed now because the store did not answer."""
        now = self.clock()
        with self._lock:
            self._held.pop(key, None)
            self._held[key] = (now, cause)  # held keys stay in the order they expire
            while self._held:
                at, _ = next(iter(self._held.values()))
                if now < at + self.hold_s:
                    break
                self._held.popitem(last=False)
            self.noted += 1

    def forget(self, key: str) -> None:
        """A fetch of ``key`` succeeded: reads of it may use the store again."""
        with self._lock:
            self._held.pop(key, None)

    def held(self, key: str) -> float:
        """Seconds for which reads of ``key`` still fail at once (0: not held)."""
        with self._lock:
            found = self._held.get(key)
        return max(0.0, found[0] + self.hold_s - self.clock()) if found else 0.0

    def check(self, key: str, what: str) -> None:
        """Raise ``StoreUnavailable`` at once while ``key`` is held; else return."""
        with self._lock:
            found = self._held.get(key)
            now = self.clock()
            if found is None or now >= found[0] + self.hold_s:
                return
            self.failed_fast += 1
        at, cause = found
        raise StoreUnavailable(
            f"{what}: the store did not answer {now - at:.1f} s ago ({cause}); failing "
            f"at once for {at + self.hold_s - now:.1f} s more"
        )

    def kept(self) -> int:
        """Entries kept (expired ones are dropped as later failures are noted)."""
        with self._lock:
            return len(self._held)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            now = self.clock()
            held = sum(1 for at, _ in self._held.values() if now < at + self.hold_s)
            return {"held": held, "noted": self.noted, "failed_fast": self.failed_fast}


def set_once(fut: Future[V], result: V | BaseException) -> None:
    """Give ``fut`` its result or error unless it has one already."""
    try:
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class Flights(Generic[V]):
    """One fetch per key at a time, on ``threads`` threads of its own (see module doc).

    ``get(key, fetch, deadline, what)`` returns ``fetch(deadline)``'s value or raises
    its error; ``StoreUnavailable`` once the flight's deadline has passed, and at once
    while ``outages`` holds the key, unless a flight of it is running within its
    deadline (then the caller joins it). Thread-safe.
    """

    def __init__(self, name: str, threads: int, outages: Outages) -> None:
        self.outages = outages
        self._pool = ThreadPoolExecutor(threads, name)
        self._lock = threading.Lock()
        self._flying: dict[str, tuple[Future[V], float]] = {}

    def get(self, key: str, fetch: Callable[[float], V], deadline: float, what: str) -> V:
        clock = self.outages.clock
        with self._lock:
            flight = self._flying.get(key)
            if flight is None or clock() >= flight[1]:  # none, or one past its deadline
                self.outages.check(key, what)
            if flight is None:
                flight = self._flying[key] = (Future(), deadline)
                try:
                    self._pool.submit(self._run, key, flight[0], fetch, deadline)
                except RuntimeError:  # shut down
                    del self._flying[key]
                    raise StoreUnavailable(f"{what}: the reader is closed") from None
        fut, until = flight
        try:
            return fut.result(timeout=max(0.0, min(deadline, until) - clock()))
        except TimeoutError:
            if clock() >= until:
                self.outages.note(key, f"{what} not fetched within the deadline")
            raise StoreUnavailable(
                f"{what}: not fetched within {self.outages.hold_s:g} s"
            ) from None

    def _run(self, key: str, fut: Future[V], fetch: Callable[[float], V], deadline: float) -> None:
        result: V | BaseException
        try:
            if self.outages.clock() >= deadline:  # it waited in the queue past it
                raise StoreUnavailable(f"{key}: its deadline passed before it started")
            result = fetch(deadline)
        except BaseException as exc:
            result = exc
            if isinstance(exc, TransientError):
                self.outages.note(key, str(exc))
        else:
            self.outages.forget(key)
        with self._lock:
            del self._flying[key]
        set_once(fut, result)

    def close(self) -> None:
        """Drop queued fetches (their callers fail at their deadline); wait for the rest."""
        self._pool.shutdown(wait=True, cancel_futures=True)
