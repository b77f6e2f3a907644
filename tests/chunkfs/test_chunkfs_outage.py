"""A hung store fails a read within one deadline, once; later reads fail at once.

The hold and the shared fetches (chunkfs/outage.py) are checked on their own first;
then real FUSE mounts of a data set on the real SeaweedFS server, SIGSTOPped (it
accepts connections and never answers) and always SIGCONTed again, even on failure.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from hypermesh.chunkfs.format import MiB
from hypermesh.chunkfs.outage import Flights, Outages
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.errors import CorruptData, StoreUnavailable
from hypermesh.local.processes import wait_for
from hypermesh.local.s3server import S3Server
from tests.chunkfs.conftest import Mounter

DEADLINE_S = 3.0
DEADLINE = "3s"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- the hold
@pytest.mark.parametrize(
    ("after", "held"), [(0.0, 3.0), (1.0, 2.0), (2.5, 0.5), (3.0, 0.0), (60.0, 0.0)]
)
def test_a_failed_key_is_held_for_one_deadline(after: float, held: float) -> None:
    clock = Clock()
    outages = Outages(3.0, clock)
    outages.note("c1", "timed out")
    clock.now += after
    assert outages.held("c1") == pytest.approx(held)
    assert outages.held("c2") == 0.0
    outages.check("c2", "chunk c2")
    if held:
        with pytest.raises(StoreUnavailable, match=r"chunk c1: .*timed out.*at once"):
            outages.check("c1", "chunk c1")
    else:
        outages.check("c1", "chunk c1")
    assert outages.snapshot() == {"held": int(held > 0), "noted": 1,
                                  "failed_fast": int(held > 0)}


def test_a_success_ends_the_hold_and_expired_keys_are_dropped() -> None:
    clock = Clock()
    outages = Outages(3.0, clock)
    outages.note("c1", "timed out")
    outages.forget("c1")
    outages.check("c1", "chunk c1")
    for i in range(100):
        outages.note(f"k{i}", "timed out")
    clock.now += 2.0
    outages.note("k0", "again")  # a failure noted again is held from then
    clock.now += 1.5
    outages.note("last", "timed out")
    assert outages.kept() == 2  # k1..k99 expired; k0 (held 1.5 s more) and last remain
    assert outages.held("k0") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="hold_s"):
        Outages(0)


# ---------------------------------------------------------------- flights
@pytest.fixture
def callers() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # the test looks at what was raised
        value = exc
    return time.monotonic() - start, value


def test_callers_of_a_key_share_one_fetch_and_the_first_callers_deadline(
    callers: ThreadPoolExecutor,
) -> None:
    outages = Outages(2.0)
    flights: Flights[bytes] = Flights("test-flights", 2, outages)
    gate = threading.Event()
    calls: list[float] = []

    def fetch(deadline: float) -> bytes:
        calls.append(deadline)
        gate.wait(10)
        return b"late"

    try:
        first_deadline = time.monotonic() + 1.0
        first = callers.submit(timed, lambda: flights.get("k", fetch, first_deadline, "k"))
        time.sleep(0.4)
        second = callers.submit(
            timed, lambda: flights.get("k", fetch, time.monotonic() + 1.0, "k"))
        (t1, e1), (t2, e2) = first.result(10), second.result(10)
        assert isinstance(e1, StoreUnavailable) and isinstance(e2, StoreUnavailable)
        assert 0.8 < t1 < 1.5
        assert t2 < 0.9  # it ended with the first caller's deadline, not its own
        assert calls == [first_deadline]
        t3, e3 = timed(lambda: flights.get("k", fetch, time.monotonic() + 1.0, "k"))
        assert isinstance(e3, StoreUnavailable) and t3 < 0.2  # the flight is past its deadline
        gate.set()  # the store answers: the late result ends the hold
        wait_for(lambda: outages.held("k") == 0, 5, "the late fetch to end the hold")
        assert flights.get("k", fetch, time.monotonic() + 1.0, "k") == b"late"
        assert len(calls) == 2
    finally:
        gate.set()
        flights.close()


def test_a_transient_failure_is_held_and_a_fatal_one_is_not() -> None:
    outages = Outages(5.0)
    flights: Flights[bytes] = Flights("test-flights", 1, outages)
    errors: list[Exception] = [StoreUnavailable("503"), CorruptData("bad bytes")]

    def fetch(deadline: float) -> bytes:
        raise errors.pop(0)

    try:
        with pytest.raises(StoreUnavailable, match="503"):
            flights.get("a", fetch, time.monotonic() + 1, "a")
        with pytest.raises(StoreUnavailable, match="at once"):
            flights.get("a", fetch, time.monotonic() + 1, "a")
        with pytest.raises(CorruptData):
            flights.get("b", fetch, time.monotonic() + 1, "b")
        assert outages.held("b") == 0
    finally:
        flights.close()


# ---------------------------------------------------------------- mounts
@pytest.fixture
def dataset(tmp_path: Path, store: S3Store) -> dict[str, bytes]:
    """One chunk: a.txt (in block 0), then b.bin and c.bin (6 MiB each, small files for
    a 64 MiB chunk size, packed together)."""
    src = tmp_path / "src"
    src.mkdir()
    files = {"a.txt": os.urandom(5000), "b.bin": os.urandom(6 * MiB),
             "c.bin": os.urandom(6 * MiB)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    root = put_dataset(store, src, "ds", chunk_size=64 * MiB)
    assert len(root.chunks) == 1
    return files


def pread_timed(path: Path, size: int, offset: int) -> tuple[float, bytes | OSError]:
    start = time.monotonic()
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            got: bytes | OSError = os.pread(fd, size, offset)
        finally:
            os.close(fd)
    except OSError as exc:
        got = exc
    return time.monotonic() - start, got


def assert_eio(got: bytes | OSError) -> None:
    assert isinstance(got, OSError), f"read {len(got)} bytes from a hung store"
    assert got.errno == errno.EIO


def readable(path: Path, want: bytes) -> bool:
    try:
        return path.read_bytes() == want
    except OSError:
        return False


def found(path: Path) -> bool:
    try:
        path.stat()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("size", [4096, MiB], ids=["4KiB", "1MiB"])
def test_a_hung_store_fails_a_read_within_one_deadline_then_at_once_until_it_answers(
    s3_server: S3Server, dataset: dict[str, bytes], mounter: Mounter, size: int
) -> None:
    m = mounter(deadline=DEADLINE)
    path = m.mountpoint / "b.bin"
    assert path.stat().st_size == 6 * MiB  # the manifest page is loaded
    s3_server.pause()
    try:
        took, got = pread_timed(path, size, 0)
        assert_eio(got)
        assert 0.5 * DEADLINE_S < took < 1.5 * DEADLINE_S  # once, not once per request
        for name, offset in (("b.bin", 0), ("b.bin", 3 * MiB), ("c.bin", MiB)):
            took, got = pread_timed(m.mountpoint / name, size, offset)
            assert_eio(got)
            assert took < 1.0, f"{name} at {offset}: {took:.2f} s"
        outages = m.stats()["outages"]
        assert outages["held"] >= 1 and outages["failed_fast"] >= 1
    finally:
        s3_server.resume()
    resumed = time.monotonic()
    wait_for(lambda: readable(path, dataset["b.bin"]), 2 * DEADLINE_S,
             "b.bin to be read after the store resumed", interval=0.1)
    assert time.monotonic() - resumed < DEADLINE_S + 1.0
    assert (m.mountpoint / "c.bin").read_bytes() == dataset["c.bin"]


def test_readers_of_a_chunk_share_the_first_ones_deadline_and_cached_blocks_still_serve(
    s3_server: S3Server, dataset: dict[str, bytes], mounter: Mounter
) -> None:
    m = mounter(deadline=DEADLINE)
    assert (m.mountpoint / "a.txt").read_bytes() == dataset["a.txt"]  # block 0, block list
    s3_server.pause()
    try:
        first: Future[tuple[float, bytes | OSError]] = Future()

        def read_first() -> None:
            first.set_result(pread_timed(m.mountpoint / "b.bin", 4096, 3 * MiB))

        thread = threading.Thread(target=read_first)
        thread.start()
        time.sleep(1.5)
        took_second, second = pread_timed(m.mountpoint / "c.bin", 4096, 3 * MiB)
        took_first, got_first = first.result(3 * DEADLINE_S)
        thread.join(DEADLINE_S)
        assert_eio(got_first)
        assert_eio(second)
        assert 0.5 * DEADLINE_S < took_first < 1.5 * DEADLINE_S
        assert took_second < DEADLINE_S - 0.5  # it ended with the first reader's deadline
        # b.bin's first bytes are in block 0, cached: served while the chunk is held
        took, got = pread_timed(m.mountpoint / "b.bin", 4096, 0)
        assert got == dataset["b.bin"][:4096]
        assert took < 1.0
    finally:
        s3_server.resume()
    wait_for(lambda: readable(m.mountpoint / "c.bin", dataset["c.bin"]), 2 * DEADLINE_S,
             "c.bin to be read after the store resumed", interval=0.1)


def test_a_hung_store_fails_a_lookup_within_one_deadline_then_at_once(
    s3_server: S3Server, dataset: dict[str, bytes], mounter: Mounter
) -> None:
    m = mounter(deadline=DEADLINE)
    s3_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(OSError) as info:
            (m.mountpoint / "b.bin").stat()
        assert info.value.errno == errno.EIO
        assert 0.5 * DEADLINE_S < time.monotonic() - start < 1.5 * DEADLINE_S
        start = time.monotonic()
        with pytest.raises(OSError) as info:
            (m.mountpoint / "c.bin").stat()  # the same manifest page
        assert info.value.errno == errno.EIO
        assert time.monotonic() - start < 1.0
    finally:
        s3_server.resume()
    resumed = time.monotonic()
    wait_for(lambda: found(m.mountpoint / "c.bin"), 2 * DEADLINE_S,
             "a lookup to work after the store resumed", interval=0.1)
    assert time.monotonic() - resumed < DEADLINE_S + 1.0
    assert (m.mountpoint / "c.bin").read_bytes() == dataset["c.bin"]
