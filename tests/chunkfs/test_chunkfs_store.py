"""Object stores against a real SeaweedFS S3 server and a local directory."""

from __future__ import annotations

import os
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.chunkfs.store import (
    FileStore,
    ObjectStore,
    S3Store,
    open_store,
    retry_transient,
)
from hypermesh.errors import (
    CorruptData,
    FatalError,
    NoSuchObject,
    NotFound,
    StoreUnavailable,
    TransientError,
    UsageError,
)
from hypermesh.local.s3server import S3Server

MiB = 1 << 20


@pytest.fixture(params=["s3", "file"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "s3":
        yield request.getfixturevalue("store")
    else:
        with FileStore(tmp_path / "store") as s:
            yield s


def test_put_get_size_delete(any_store: ObjectStore) -> None:
    s = any_store
    assert s.size("a/b") is None
    assert not s.exists("a/b")
    s.put("a/b", b"hello world")
    assert s.get("a/b") == b"hello world"
    assert s.size("a/b") == 11
    s.put("a/b", memoryview(b"replaced"))  # a put replaces the whole object
    assert s.get("a/b") == b"replaced"
    s.put("empty", b"")
    assert s.get("empty") == b""
    assert s.size("empty") == 0
    s.delete("a/b")
    assert s.size("a/b") is None
    s.delete("a/b")  # deleting a missing key is not an error


def test_missing_key_is_no_such_object(any_store: ObjectStore) -> None:
    with pytest.raises(NoSuchObject, match="nope"):
        any_store.get("nope/x")
    with pytest.raises(NotFound):
        any_store.get_range("nope", 0, 1)


def test_get_range_edges(any_store: ObjectStore) -> None:
    s = any_store
    data = bytes(range(256)) * 40  # 10240 bytes
    s.put("r", data)
    assert s.get_range("r", 0, 1) == data[:1]
    assert s.get_range("r", 0, len(data)) == data
    assert s.get_range("r", 100, 1000) == data[100:1100]
    assert s.get_range("r", len(data) - 1, 1) == data[-1:]
    assert s.get_range("r", 5, 0) == b""
    with pytest.raises(CorruptData):  # runs past the end: never a short answer
        s.get_range("r", len(data) - 10, 11)
    with pytest.raises(CorruptData):
        s.get_range("r", len(data), 1)
    with pytest.raises(ValueError):
        s.get_range("r", -1, 1)


def test_get_range_into_fills_the_buffer_or_raises(any_store: ObjectStore) -> None:
    s = any_store
    data = os.urandom(3 << 20)
    s.put("r", data)
    for start, length in [(0, len(data)), (1, 1), (MiB - 7, MiB + 9), (len(data) - 1, 1)]:
        buf = memoryview(bytearray(length + 2))
        s.get_range_into("r", start, buf[1:-1])
        assert buf[1:-1] == data[start : start + length]
        assert buf[0] == 0 and buf[-1] == 0  # nothing written outside the view
    s.get_range_into("r", 5, memoryview(bytearray(0)))
    with pytest.raises(CorruptData):  # runs past the end: never a short fill
        s.get_range_into("r", len(data) - 10, memoryview(bytearray(11)))
    with pytest.raises(NoSuchObject):
        s.get_range_into("nope", 0, memoryview(bytearray(1)))


def test_s3_ranged_gets_land_in_the_buffer_and_keep_their_connection(
    s3_server: S3Server, store_url: str
) -> None:
    """The body goes from the socket into the caller's buffer (no botocore copy), and the
    connection goes back to the pool: with a pool of one, many GETs in a row finish."""
    bucket, _, prefix = store_url.removeprefix("s3://").partition("/")
    with S3Store(bucket, prefix, endpoint=s3_server.endpoint, max_pool_connections=1) as s:
        data = os.urandom(2 << 20)
        s.put("k", data)
        buf = memoryview(bytearray(MiB))
        for i in range(40):
            start = (i * 4099) % MiB
            s.get_range_into("k", start, buf)
            assert buf == data[start : start + MiB]
        assert s.received_into == 40


def test_put_file_large(any_store: ObjectStore, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    data = os.urandom(9 << 20)  # over the 8 MiB multipart threshold
    big.write_bytes(data)
    any_store.put_file("big/one", big)
    assert any_store.size("big/one") == len(data)
    assert any_store.get("big/one") == data
    assert any_store.get_range("big/one", (8 << 20) - 3, 10) == data[(8 << 20) - 3 : (8 << 20) + 7]


def test_list_sorted_with_prefix(any_store: ObjectStore) -> None:
    s = any_store
    keys = ["a.b", "a/b", "a/c/d", "ab", "b/x", "a/a", "chunks/00/x", "chunks/ff/y"]
    for k in keys:
        s.put(k, k.encode())
    assert list(s.list()) == sorted(keys)
    assert list(s.list("a/")) == ["a/a", "a/b", "a/c/d"]
    assert list(s.list("a")) == sorted(k for k in keys if k.startswith("a"))
    assert list(s.list("chunks/")) == ["chunks/00/x", "chunks/ff/y"]
    assert list(s.list("zz")) == []


def test_file_store_rejects_escaping_keys(tmp_path: Path) -> None:
    s = FileStore(tmp_path / "st")
    for bad in ["", "/abs", "a/../b", "a//b", "..", "a/./b"]:
        with pytest.raises(UsageError):
            s.put(bad, b"x")


def test_file_store_put_is_atomic_and_list_skips_temporaries(tmp_path: Path) -> None:
    s = FileStore(tmp_path / "st")
    s.put("d/k", b"v")
    (tmp_path / "st" / "d" / ".k.tmp-deadbeef").write_bytes(b"partial")
    assert list(s.list()) == ["d/k"]
    assert [p.name for p in (tmp_path / "st" / "d").iterdir()] != []


def test_open_store_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = open_store("s3://bucket/some/prefix/")
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.url) == ("bucket", "some/prefix/", "s3://bucket/some/prefix")
    assert isinstance(open_store("s3://bucket"), S3Store)
    fs = open_store(f"file://{tmp_path}/st")
    assert isinstance(fs, FileStore) and fs.root == tmp_path / "st"
    monkeypatch.setenv("HYPERMESH_STORE", f"file://{tmp_path}/env")
    assert open_store(None).url == f"file://{tmp_path}/env"
    for bad in ["", "bucket/x", "http://x/y", "s3://", "s3:///prefix", "file://relative", "/tmp/x"]:
        with pytest.raises(UsageError) as info:
            open_store(bad)
        assert "s3://BUCKET" in str(info.value) and "file:///" in str(info.value)
    monkeypatch.delenv("HYPERMESH_STORE")
    with pytest.raises(UsageError, match="HYPERMESH_STORE"):
        open_store(None)


def test_missing_bucket_is_not_found(s3_server: S3Server) -> None:
    s = S3Store("no-such-bucket-here", endpoint=s3_server.endpoint)
    with s, pytest.raises(NotFound, match="no-such-bucket-here"):
        s.get("x")


def test_stopped_or_hung_server_is_unavailable_then_comes_back(tmp_path: Path) -> None:
    """Its own server: stopping the session's would disturb the other tests."""
    with S3Server(tmp_path / "s3") as server:
        server.make_bucket("bkt")
        env = server.client_env()
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            s = S3Store("bkt", "p", connect_timeout_s=1, read_timeout_s=1, max_attempts=1)
            s.put("k", b"value")
            server.pause()  # hangs: the read timeout bounds the wait
            with pytest.raises(StoreUnavailable):
                s.get("k")
            server.resume()
            assert retry_transient(lambda: s.get("k"), 30) == b"value"
            server.stop()
            for op in (lambda: s.get("k"), lambda: s.put("k2", b"x"), lambda: s.size("k")):
                with pytest.raises(StoreUnavailable) as info:
                    op()
                assert isinstance(info.value, TransientError)
                assert server.endpoint in str(info.value)
            server.start()
            assert retry_transient(lambda: s.get("k"), 30) == b"value"
            s.close()


class _BrokenBodies(socketserver.ThreadingTCPServer):
    """Answers every GET with a 206 promising 1,000 bytes and sends 500 of them; then
    hangs up (``hang_up``) or goes silent until ``release`` is set."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, hang_up: bool) -> None:
        self.hang_up = hang_up
        self.release = threading.Event()
        super().__init__(("127.0.0.1", 0), _BrokenBodyHandler)


class _BrokenBodyHandler(socketserver.StreamRequestHandler):
    server: _BrokenBodies

    def handle(self) -> None:
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        self.wfile.write(
            b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\n"
            b"Content-Range: bytes 0-999/5000\r\nContent-Type: application/octet-stream\r\n"
            b"\r\n" + b"x" * 500
        )
        self.wfile.flush()
        if not self.server.hang_up:
            self.server.release.wait(30)


@pytest.mark.parametrize("hang_up", [True, False], ids=["hangs-up", "goes-silent"])
def test_a_body_cut_short_is_unavailable_not_corrupt(
    hang_up: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer that breaks after the headers is a transient store problem, found
    within the read timeout; and the broken connection is not used again."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    with _BrokenBodies(hang_up) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            host, port = server.server_address[:2]
            s = S3Store("bkt", endpoint=f"http://{host}:{port}", read_timeout_s=1,
                        max_attempts=1, max_pool_connections=1)
            for _ in range(2):
                start = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    s.get_range_into("k", 0, memoryview(bytearray(1000)))
                assert time.monotonic() - start < 10
            assert s.received_into == 0
            s.close()
        finally:
            server.release.set()
            server.shutdown()


def test_retry_transient_deadline() -> None:
    now = [0.0]
    calls = []

    def clock() -> float:
        return now[0]

    def sleep(d: float) -> None:
        now[0] += d

    def flaky() -> str:
        calls.append(now[0])
        if len(calls) < 4:
            raise StoreUnavailable("down")
        return "ok"

    assert retry_transient(flaky, 10, sleep=sleep, clock=clock) == "ok"
    assert len(calls) == 4

    def always() -> None:
        calls.append(now[0])
        raise StoreUnavailable("down")

    now[0] = 100.0
    calls.clear()
    with pytest.raises(StoreUnavailable):
        retry_transient(always, 5, sleep=sleep, clock=clock)
    assert calls[-1] <= 105.0 and len(calls) > 1

    def fatal() -> None:
        calls.append(now[0])
        raise FatalError("no")

    calls.clear()
    with pytest.raises(FatalError):
        retry_transient(fatal, 5, sleep=sleep, clock=clock)
    assert len(calls) == 1
