"""Object stores: one synchronous interface, an S3 backend and a local-directory backend.

Every backend speaks in keys relative to the store's prefix and raises only
hypermesh errors, translated here at the edge:

- ``NoSuchObject`` (a ``NotFound``): no object under that key.
- ``StoreUnavailable`` (a ``TransientError``): refused, timed out, 5xx or throttled —
  trying again later may help (``retry_transient`` does that under a deadline).
- ``CorruptData`` (a ``FatalError``): a ranged read that cannot return exactly the bytes
  asked for (the object is shorter than the manifest says it is).
- ``FatalError``: anything else (access denied, a missing bucket, a disk error).

The API is synchronous; callers that need parallelism use threads. One store object is
safe to share between threads.

URLs (``open_store``): ``s3://BUCKET[/PREFIX]`` or ``file:///ABSOLUTE/PATH``; with no URL,
the environment variable ``HYPERMESH_STORE``. The S3 endpoint comes from
``HYPERMESH_S3_ENDPOINT`` (else ``AWS_ENDPOINT_URL``, else AWS itself) and credentials the
usual AWS way (environment, ``~/.aws``, instance role).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hypermesh.errors import (
    CorruptData,
    FatalError,
    NoSuchObject,
    NotFound,
    StoreUnavailable,
    TransientError,
    UsageError,
)

__all__ = [
    "ENV_S3_ENDPOINT",
    "ENV_STORE",
    "URL_FORMS",
    "CorruptData",
    "FileStore",
    "NoSuchObject",
    "ObjectStore",
    "S3Store",
    "StoreUnavailable",
    "open_store",
    "retry_transient",
]

ENV_STORE = "HYPERMESH_STORE"
ENV_S3_ENDPOINT = "HYPERMESH_S3_ENDPOINT"
URL_FORMS = "s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH"

T = TypeVar("T")


class ObjectStore(ABC):
    """A flat key space of immutable-by-convention objects.

    Guarantees of every backend: ``put`` is atomic (a reader sees the old object, no
    object, or the whole new one, never a part); ``get_range`` returns exactly
    ``length`` bytes or raises; ``list`` yields keys in sorted order; ``delete`` of a
    missing key succeeds. Keys are relative to the store's prefix and use ``/``.
    """

    url: str

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; ``NoSuchObject`` if there is none."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``start``; ``CorruptData`` if the object is shorter."""

    def get_range_into(self, key: str, start: int, buf: memoryview) -> None:
        """Fill ``buf`` with the ``len(buf)`` bytes from ``start``, as ``get_range`` would
        return them; backends that can receive straight into ``buf`` do (no copy)."""
        buf[:] = self.get_range(key, start, len(buf))

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any object there."""

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Store the contents of the local file ``path`` under ``key``."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size in bytes, or None if there is no object under ``key``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object under ``key`` (no error if it is already gone)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys that start with ``prefix``, sorted (by code point)."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the store must not be used afterwards."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_range(key: str, start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise ValueError(f"{key}: bad range start={start} length={length}")


def _readinto_all(fp: http.client.HTTPResponse, buf: memoryview) -> int:
    """Read the response body into ``buf`` until it is full or the body ends."""
    got = 0
    while got < len(buf):
        n = fp.readinto(buf[got:])
        if not n:
            break
        got += n
    return got


def _short_read(url: str, key: str, start: int, length: int, got: int) -> CorruptData:
    return CorruptData(
        f"{url}: {key}: asked for {length} bytes at offset {start}, the object has only "
        f"{got} there (truncated or not the object the manifest names)"
    )


# ----------------------------------------------------------------------------- retry
def retry_transient(
    fn: Callable[[], T],
    deadline_s: float,
    *,
    first_delay_s: float = 0.1,
    max_delay_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call ``fn`` until it returns, retrying ``TransientError`` for ``deadline_s`` seconds.

    Delays grow exponentially from ``first_delay_s`` up to ``max_delay_s`` with full
    jitter, and never sleep past the deadline. Fatal errors propagate at once; when the
    deadline passes, the last transient error propagates.
    """
    deadline = clock() + deadline_s
    delay = first_delay_s
    while True:
        try:
            return fn()
        except TransientError:
            left = deadline - clock()
            if left <= 0:
                raise
            sleep(min(left, random.uniform(0, delay)))
            delay = min(max_delay_s, delay * 2)


# ----------------------------------------------------------------------------- S3
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_UNAVAILABLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "ServiceUnavailable",
    "InternalError",
    "503",
    "500",
}


class S3Store(ObjectStore):
    """Objects under ``s3://BUCKET/PREFIX`` on any S3-compatible server, through boto3.

    One boto3 client is created on first use (under a lock: creating boto3 clients
    concurrently is not safe) and shared by all threads (which is). Its connection
    pool holds ``max_pool_connections``: size it to the number of threads that use the
    store at once. Requests use path-style addressing, bounded connect/read timeouts
    and at most ``max_attempts`` tries, so a dead server gives ``StoreUnavailable``
    in bounded time rather than a hang.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        max_pool_connections: int = 32,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
        multipart_threshold: int = 8 << 20,
        multipart_chunksize: int = 16 << 20,
    ) -> None:
        if not bucket:
            raise UsageError(f"S3 store needs a bucket: {URL_FORMS}")
        prefix = prefix.strip("/")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint = endpoint or os.environ.get(ENV_S3_ENDPOINT) or os.environ.get(
            "AWS_ENDPOINT_URL"
        )
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self.max_pool_connections = max_pool_connections
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_attempts = max_attempts
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self._client: Any = None
        self._lock = threading.Lock()
        self.received_into = 0
        """Ranged GETs whose bodies went straight into the caller's buffer (see
        ``get_range_into``); the others were read by botocore and copied."""

    # boto3 is imported lazily: it costs ~0.3 s, and many CLI commands never need it.
    @property
    def client(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import boto3
                    from botocore.config import Config

                    config = Config(
                        max_pool_connections=self.max_pool_connections,
                        connect_timeout=self.connect_timeout_s,
                        read_timeout=self.read_timeout_s,
                        retries={"max_attempts": self.max_attempts, "mode": "standard"},
                        s3={"addressing_style": "path"},
                        # Plain checksums: most S3-compatible servers do not all speak the
                        # newer streaming CRC trailers. We verify content by hash ourselves.
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                    )
                    session = boto3.session.Session()
                    region = session.region_name or "us-east-1"
                    self._client = session.client(
                        "s3", endpoint_url=self.endpoint, region_name=region, config=config
                    )
        return self._client

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _translate(self, exc: Exception, key: str) -> Exception:
        """A hypermesh error for a botocore exception raised while working on ``key``."""
        from botocore import exceptions as bce

        where = f"{self.url}: {key}" if key else self.url
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code == "NoSuchBucket":
                return NotFound(f"{self.url}: bucket {self.bucket!r} does not exist")
            if code in _NOT_FOUND_CODES or status == 404:
                return NoSuchObject(f"{where}: no such object")
            if code in _UNAVAILABLE_CODES or status >= 500 or status == 429:
                return StoreUnavailable(f"{where}: S3 answered {status} {code}")
            if code == "InvalidRange" or status == 416:
                return CorruptData(f"{where}: range is past the end of the object")
            return FatalError(f"{where}: S3 answered {status} {code}: {err.get('Message', '')}")
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return FatalError(
                f"{self.url}: no S3 credentials (set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, or configure an AWS profile)"
            )
        if isinstance(
            exc,
            bce.EndpointConnectionError
            | bce.ConnectTimeoutError
            | bce.ReadTimeoutError
            | bce.ConnectionClosedError
            | bce.ConnectionError
            | bce.HTTPClientError
            | bce.IncompleteReadError
            | bce.ResponseStreamingError
            | ConnectionError
            | TimeoutError
            | http.client.HTTPException,
        ):
            return StoreUnavailable(
                f"{where}: S3 endpoint {self.endpoint or 'AWS'} unavailable: {exc}"
            )
        if isinstance(exc, bce.BotoCoreError):
            return FatalError(f"{where}: {exc}")
        return exc

    def _call(self, key: str, fn: Callable[[], T]) -> T:
        from botocore import exceptions as bce

        try:
            return fn()
        except (
            bce.BotoCoreError, bce.ClientError, ConnectionError, TimeoutError,
            http.client.HTTPException,
        ) as exc:
            raise self._translate(exc, key) from exc

    def get(self, key: str) -> bytes:
        def do() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            with contextlib.closing(resp["Body"]) as body:
                return bytes(body.read())

        return self._call(key, do)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(key, start, length)
        if length == 0:
            return b""

        def do() -> bytes:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            with contextlib.closing(resp["Body"]) as body:
                return bytes(body.read())

        data = self._call(key, do)
        if len(data) != length:
            raise _short_read(self.url, key, start, length, len(data))
        return data

    def get_range_into(self, key: str, start: int, buf: memoryview) -> None:
        """``get_range`` into ``buf``. The body is read from the response's socket
        straight into ``buf`` when botocore hands back a plain ``http.client`` response
        of exactly that length (no content encoding); otherwise botocore reads it and it
        is copied. Saves a pass over every byte of bulk reads."""
        length = len(buf)
        _check_range(key, start, length)
        if length == 0:
            return

        def do() -> int:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
            body = resp["Body"]
            raw = getattr(body, "_raw_stream", None)  # urllib3's response
            fp = getattr(raw, "_fp", None)  # the http.client response under it
            if (
                raw is None
                or not isinstance(fp, http.client.HTTPResponse)
                or fp.chunked
                or fp.length != length
                or fp.getheader("Content-Encoding", "identity") != "identity"
            ):
                with contextlib.closing(body):
                    data = body.read()
                n = min(len(data), length)
                buf[:n] = memoryview(data)[:n]
                return len(data)
            done = False
            try:
                n = _readinto_all(fp, buf)
                if n != length:  # the server promised `length` bytes: the transfer broke
                    raise http.client.IncompleteRead(b"", length - n)
                done = fp.isclosed()  # all read: the connection is reusable
            finally:
                if done:
                    raw.release_conn()
                else:
                    body.close()
            self.received_into += 1
            return n

        got = self._call(key, do)
        if got != length:
            raise _short_read(self.url, key, start, length, got)

    def put(self, key: str, data: bytes | memoryview) -> None:
        body = bytes(data) if isinstance(data, memoryview) else data
        self._call(
            key,
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=body),
        )

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            max_concurrency=4,
        )
        self._call(
            key,
            lambda: self.client.upload_file(
                os.fspath(path), self.bucket, self._key(key), Config=config
            ),
        )

    def size(self, key: str) -> int | None:
        try:
            resp = self._call(
                key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            )
        except NoSuchObject:
            return None
        return int(resp["ContentLength"])

    def delete(self, key: str) -> None:
        self._call(
            key, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        )

    def list(self, prefix: str = "") -> Iterator[str]:
        # S3 lists in UTF-8 byte order, but not every compatible server does (SeaweedFS
        # walks directories), so the keys are collected and sorted here.
        def do() -> list[str]:
            keys = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for obj in page.get("Contents", ()):
                    full = obj["Key"]
                    if full.startswith(self.prefix) and not full.endswith("/"):
                        keys.append(full[len(self.prefix) :])
            return keys

        yield from sorted(self._call(prefix, do))

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


# ----------------------------------------------------------------------------- files
_TMP_MARK = ".tmp-"


class FileStore(ObjectStore):
    """Objects as files under a local directory (``file:///PATH``).

    A put writes a temporary file beside the target, flushes it to disk and renames
    it into place, so readers never see a partial object and a crash leaves at most
    a stray temporary file (named ``.<name>.tmp-<random>``, which ``list`` skips).
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or key.startswith("/"):
            raise UsageError(f"{self.url}: invalid object key {key!r}")
        return self.root.joinpath(*parts)

    def _os_error(self, exc: OSError, key: str) -> Exception:
        if isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
            return NoSuchObject(f"{self.url}: {key}: no such object")
        return FatalError(f"{self.url}: {key}: {exc.strerror or exc}")

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        _check_range(key, start, length)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                data = f.read(length)
        except OSError as exc:
            raise self._os_error(exc, key) from exc
        if len(data) != length:
            raise _short_read(self.url, key, start, length, len(data))
        return data

    def get_range_into(self, key: str, start: int, buf: memoryview) -> None:
        _check_range(key, start, len(buf))
        got = 0
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                while got < len(buf):
                    n = os.preadv(fd, [buf[got:]], start + got)
                    if n == 0:
                        break
                    got += n
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._os_error(exc, key) from exc
        if got != len(buf):
            raise _short_read(self.url, key, start, len(buf), got)

    def _write_atomic(self, key: str, write: Callable[[Any], None]) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                write(f)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise self._os_error(exc, key) from exc

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._write_atomic(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        import shutil

        def copy(f: Any) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, f, 8 << 20)

        self._write_atomic(key, copy)

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._os_error(exc, key) from exc
        return None if not _is_file(st.st_mode) else st.st_size

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise self._os_error(exc, key) from exc

    def list(self, prefix: str = "") -> Iterator[str]:
        base_dir = prefix.rpartition("/")[0]
        top = self.root.joinpath(*base_dir.split("/")) if base_dir else self.root
        keys = []
        for dirpath, _dirnames, filenames in os.walk(top):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            rel = "" if rel == "." else rel + "/"
            for name in filenames:
                if name.startswith(".") and _TMP_MARK in name:
                    continue
                key = rel + name
                if key.startswith(prefix):
                    keys.append(key)
        yield from sorted(keys)


def _is_file(mode: int) -> bool:
    import stat

    return stat.S_ISREG(mode)


# ----------------------------------------------------------------------------- URLs
def open_store(url: str | None = None, **s3_options: Any) -> ObjectStore:
    """The store named by ``url`` (or by ``$HYPERMESH_STORE`` when ``url`` is None).

    ``s3://BUCKET[/PREFIX]`` gives an ``S3Store`` (``s3_options`` go to it), and
    ``file:///ABSOLUTE/PATH`` a ``FileStore``. Anything else raises ``UsageError``
    naming the URL and the accepted forms.
    """
    if url is None:
        url = os.environ.get(ENV_STORE)
        if not url:
            raise UsageError(f"no object store given: pass --store URL or set {ENV_STORE} "
                             f"({URL_FORMS})")
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket or any(c in bucket for c in "?#"):
            raise UsageError(f"invalid store URL {url!r}: no bucket; use {URL_FORMS}")
        return S3Store(bucket, prefix, **s3_options)
    if url.startswith("file://"):
        path = url[len("file://") :]
        if not path.startswith("/") or path.strip("/") == "":
            raise UsageError(f"invalid store URL {url!r}: need an absolute path; use {URL_FORMS}")
        return FileStore(path)
    raise UsageError(f"invalid store URL {url!r}: use {URL_FORMS}")
