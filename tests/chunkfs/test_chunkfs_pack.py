"""put_dataset / get_dataset / rm against a real SeaweedFS S3 server.

The outage cases run twice: against a file store that fails one chunk put (exact, fast),
and against a SeaweedFS server of their own that is stopped in the middle of a put.
"""

from __future__ import annotations

import os
import random
import stat
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hypermesh.chunkfs import format as fmt
from hypermesh.chunkfs.datasets import (
    get_dataset,
    list_datasets,
    list_versions,
    remove,
    resolve,
)
from hypermesh.chunkfs.manifest import Manifest
from hypermesh.chunkfs.pack import PutProgress, put_dataset
from hypermesh.chunkfs.store import FileStore, ObjectStore, S3Store, retry_transient
from hypermesh.errors import CorruptData, NotFound, StoreUnavailable, UsageError
from hypermesh.local.processes import wait_for
from hypermesh.local.s3server import S3Server

MiB = 1 << 20
CHUNK = 4 * MiB
ODD_NAMES = [
    "with space",
    "naïve ☃ café",
    "new\nline",
    "-rf",
    "--help",
    "a@b#c?d",
    "tab\there",
    os.fsdecode(b"latin1-\xe9\xff"),
]


def make_tree(root: Path, seed: int = 1) -> None:
    """Many small files, a few big ones, empty files and dirs, deep paths, odd names."""
    rng = random.Random(seed)
    for d in range(6):
        sub = root / f"dir{d:02d}"
        sub.mkdir(parents=True)
        for i in range(50):
            (sub / f"file{i:03d}.bin").write_bytes(rng.randbytes(rng.randrange(0, 60_000)))
    (root / "big").mkdir()
    (root / "big" / "nine.bin").write_bytes(rng.randbytes(9 * MiB + 123))
    (root / "big" / "exactly-chunk.bin").write_bytes(rng.randbytes(CHUNK))
    (root / "big" / "half.bin").write_bytes(rng.randbytes(CHUNK // 2 + 1))
    (root / "empty-dir" / "nested-empty").mkdir(parents=True)
    (root / "empty-file").write_bytes(b"")
    deep = root.joinpath(*[f"d{i}" for i in range(40)])
    deep.mkdir(parents=True)
    (deep / "leaf.txt").write_text("deep down\n")
    odd = root / "odd names"
    odd.mkdir()
    for name in ODD_NAMES:
        (odd / name).write_bytes(name.encode("utf-8", "surrogateescape") * 3)
    (odd / "dir with space").mkdir()
    os.symlink("../big/nine.bin", root / "odd names" / "link to nine")
    os.symlink("does/not/exist", root / "dangling")
    os.symlink("big", root / "link-to-dir")  # recorded as a link, never followed
    ro = root / "modes" / "readonly-dir"
    ro.mkdir(parents=True)
    (ro / "ro.txt").write_text("read only")
    os.chmod(ro / "ro.txt", 0o444)
    (root / "modes" / "script.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "modes" / "script.sh", 0o750)
    (root / "modes" / "secret").write_text("s")
    os.chmod(root / "modes" / "secret", 0o600)
    os.chmod(ro, 0o555)
    # Fixed, distinct mtimes (nanoseconds), directories last.
    for i, p in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(1_600_000_000_000_000_000 + i * 1_000_001, 1_600_000_000_000_000_000
                        + i * 1_000_001), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``root`` with its kind, mode, mtime and content or target."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p), st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, p.read_bytes())
    return out


def make_writable(root: Path) -> None:
    """Let pytest delete a tree that holds read-only directories."""
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            os.chmod(Path(dirpath) / d, 0o755)


def chunk_objects(store: ObjectStore) -> set[str]:
    return {k for k in store.list("chunks/") if not k.endswith(".blocks")}


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    yield src
    make_writable(src)


def test_round_trip_every_byte_mode_and_mtime(
    store: S3Store, tree: Path, tmp_path: Path
) -> None:
    seen: list[int] = []

    def progress(p: PutProgress) -> None:
        seen.append(p.bytes_read)

    root = put_dataset(store, tree, "mixed", chunk_size=CHUNK, parallel=4, progress=progress)
    want = snapshot(tree)
    assert root.files == sum(1 for v in want.values() if v[0] != "d")
    assert root.dirs == sum(1 for v in want.values() if v[0] == "d")
    assert root.bytes == sum(len(v[3]) for v in want.values() if v[0] == "f")  # type: ignore[misc,arg-type]
    assert all(c.size <= CHUNK for c in root.chunks)
    assert seen and seen[-1] == root.bytes
    assert resolve(store, "mixed") == root
    assert resolve(store, f"mixed@{root.version}") == root

    dest = tmp_path / "out"
    assert get_dataset(store, "mixed", dest, parallel=3) == root
    try:
        got = snapshot(dest)
        assert got.keys() == want.keys()
        for path, value in want.items():
            assert got[path] == value, path
    finally:
        make_writable(dest)


def test_manifest_lookups_on_a_stored_version(store: S3Store, tree: Path) -> None:
    root = put_dataset(store, tree, "paged", chunk_size=CHUNK, page_entries=16)
    assert len(root.pages) > 10
    m = Manifest(root, store.get, cache_pages=4)
    e = m.lookup("odd names/new\nline")
    assert e is not None and e.kind == "f" and e.size == len(b"new\nline") * 3
    assert m.pages_loaded == 1
    assert m.lookup("link-to-dir/nine.bin") is None
    link = m.lookup("odd names/link to nine")
    assert link is not None and link.kind == "l" and link.target == "../big/nine.bin"
    big = m.lookup("big/nine.bin")
    assert big is not None and [x.length for x in big.extents] == [CHUNK, CHUNK, MiB + 123]
    assert [c.name for c in m.listdir("dir03")] == [f"file{i:03d}.bin" for i in range(50)]
    assert m.lookup("dir03/nope") is None


def test_new_version_shares_unchanged_chunks(store: S3Store, tree: Path) -> None:
    v1 = put_dataset(store, tree, "ds", chunk_size=CHUNK)
    before = chunk_objects(store)
    assert len(before) == len({c.id for c in v1.chunks}) >= 8

    # Same content again: nothing new is uploaded.
    counters: list[PutProgress] = []
    v2 = put_dataset(store, tree, "ds", chunk_size=CHUNK, progress=counters.append)
    assert v2.chunks == v1.chunks and chunk_objects(store) == before
    assert counters[-1].chunks_uploaded == 0

    # One small file changed in place (same size) early in the tree: one new chunk.
    victim = tree / "dir00" / "file001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    v3 = put_dataset(store, tree, "ds", chunk_size=CHUNK)
    new = chunk_objects(store) - before
    assert len(new) == 1
    holder = Manifest(v3, store.get).lookup("dir00/file001.bin")
    assert holder is not None
    assert {v3.chunks[x.chunk].id for x in holder.extents} == {k.rpartition("/")[2] for k in new}

    # One byte of a big file: only the chunk holding that offset.
    before = chunk_objects(store)
    big = tree / "big" / "nine.bin"
    with open(big, "r+b") as f:
        f.seek(5 * MiB)
        byte = f.read(1)
        f.seek(5 * MiB)
        f.write(bytes([byte[0] ^ 1]))
    put_dataset(store, tree, "ds", chunk_size=CHUNK)
    assert len(chunk_objects(store) - before) == 1

    # A new small file in the middle: a few chunks near it at most, not all after it.
    before = chunk_objects(store)
    (tree / "dir02" / "file025-new.bin").write_bytes(random.Random(9).randbytes(30_000))
    v5 = put_dataset(store, tree, "ds", chunk_size=CHUNK)
    assert 1 <= len(chunk_objects(store) - before) <= 2
    assert len(v5.chunks) >= 8
    assert len(list_versions(store, "ds")) == 5


def test_chunks_are_blake3_and_sha256_data_sets_still_read(
    store: S3Store, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version put before BLAKE3 (SHA-256 blocks, ids of 64 hex) reads back as it was;
    a put of the same tree now makes BLAKE3 chunks (ids ``b3`` + 64 hex), stored under
    the same two-hex-digit shards."""
    with monkeypatch.context() as m:
        m.setattr(fmt, "BLOCK_HASH", fmt.SHA256)
        old = put_dataset(store, tree, "mixed", chunk_size=CHUNK)
    new = put_dataset(store, tree, "mixed", chunk_size=CHUNK)
    assert all(len(c.id) == 64 and fmt.hash_of(c.id) == fmt.SHA256 for c in old.chunks)
    assert all(c.id.startswith("b3") and len(c.id) == 66 for c in new.chunks)
    assert all(fmt.hash_of(c.id) == fmt.BLAKE3 for c in new.chunks)
    assert not {c.id for c in old.chunks} & {c.id for c in new.chunks}
    for c in new.chunks:
        assert fmt.chunk_key(c.id) == f"chunks/{c.id[2:4]}/{c.id}"
        assert store.size(fmt.blocks_key(c.id)) == 32 * fmt.block_count(c.size)
    for version, out in ((old.version, "old"), (new.version, "new")):
        get_dataset(store, f"mixed@{version}", tmp_path / out)
        assert snapshot(tmp_path / out) == snapshot(tree)


@pytest.mark.parametrize("algo", [fmt.BLAKE3, fmt.SHA256])
def test_corrupt_chunk_never_gives_wrong_bytes(
    store: S3Store, tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algo: str
) -> None:
    monkeypatch.setattr(fmt, "BLOCK_HASH", algo)
    root = put_dataset(store, tree, "c", chunk_size=CHUNK)
    assert fmt.hash_of(root.chunks[0].id) == algo
    cid = root.chunks[0].id
    data = bytearray(store.get(fmt.chunk_key(cid)))
    data[len(data) // 3] ^= 0x01
    store.put(fmt.chunk_key(cid), bytes(data))
    with pytest.raises(CorruptData, match=cid):
        get_dataset(store, "c", tmp_path / "out1")
    store.put(fmt.chunk_key(cid), bytes(data[:-1]))  # truncated
    with pytest.raises(CorruptData, match=cid):
        get_dataset(store, "c", tmp_path / "out2")
    other = root.chunks[1].id  # a forged block list no longer matches the id
    store.put(fmt.blocks_key(other), b"\0" * 32)
    store.put(fmt.chunk_key(cid), store.get(fmt.chunk_key(other)))
    with pytest.raises(CorruptData):
        get_dataset(store, "c", tmp_path / "out3")


def test_rm_collects_only_unreferenced_chunks(
    store: S3Store, tree: Path, tmp_path: Path
) -> None:
    v1 = put_dataset(store, tree, "keep", chunk_size=CHUNK)
    (tree / "dir01" / "file007.bin").write_bytes(b"changed" * 1000)
    v2 = put_dataset(store, tree, "keep", chunk_size=CHUNK)
    other = put_dataset(store, tree / "dir04", "other", chunk_size=CHUNK)
    assert list_datasets(store) == ["keep", "other"]

    result = remove(store, f"keep@{v1.version}")
    assert result.versions == (v1.version,)
    only_v1 = {c.id for c in v1.chunks} - {c.id for c in v2.chunks} - {
        c.id for c in other.chunks
    }
    assert result.chunks_deleted == len(only_v1) >= 1
    assert list_versions(store, "keep") == [v2.version]
    get_dataset(store, "keep", tmp_path / "out")  # everything v2 needs is still there
    assert (tmp_path / "out" / "dir01" / "file007.bin").read_bytes() == b"changed" * 1000
    make_writable(tmp_path / "out")

    with pytest.raises(NotFound, match="keep@nope"):
        remove(store, "keep@nope")
    remove(store, "keep")
    remove(store, "other")
    assert list(store.list()) == []
    with pytest.raises(NotFound, match="'keep'"):
        resolve(store, "keep")


def test_put_rejects_bad_input(store: S3Store, tree: Path) -> None:
    for size in (fmt.MIN_CHUNK_SIZE - 1, fmt.MAX_CHUNK_SIZE + 1):
        with pytest.raises(UsageError, match=r"4 MiB and 256 MiB"):
            put_dataset(store, tree, "x", chunk_size=size)
    for name in ("", "-x", "a/b", "a@b", "x" * 129):
        with pytest.raises(UsageError, match="invalid data set name"):
            put_dataset(store, tree, name)
    with pytest.raises(UsageError, match="not a directory"):
        put_dataset(store, tree / "empty-file", "x")
    with pytest.raises(UsageError):
        resolve(store, "bad/name")
    assert list(store.list()) == []


def test_empty_tree(store: S3Store, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    root = put_dataset(store, tmp_path / "empty", "nothing", chunk_size=CHUNK)
    assert (root.files, root.dirs, root.bytes, root.chunks, root.pages) == (0, 0, 0, (), ())
    get_dataset(store, "nothing", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


class FailingStore(FileStore):
    """Fails the n-th chunk put, as a crash or outage in the middle of a put would."""

    def __init__(self, root: Path, fail_at: int) -> None:
        super().__init__(root, fsync=False)
        self.puts = 0
        self.fail_at = fail_at

    def put(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith("chunks/"):
            self.puts += 1
            if self.puts == self.fail_at:
                raise StoreUnavailable("injected failure")
        super().put(key, data)


def test_put_retries_transient_errors(tree: Path, tmp_path: Path) -> None:
    store = FailingStore(tmp_path / "st", fail_at=3)
    root = put_dataset(store, tree, "retried", chunk_size=CHUNK, parallel=2)
    get_dataset(store, "retried", tmp_path / "out")
    assert (tmp_path / "out" / "big" / "nine.bin").read_bytes() == (
        tree / "big" / "nine.bin"
    ).read_bytes()
    assert root.files > 300
    make_writable(tmp_path / "out")


def test_failed_put_leaves_no_visible_version(tree: Path, tmp_path: Path) -> None:
    store = FailingStore(tmp_path / "st", fail_at=5)
    with pytest.raises(StoreUnavailable, match="injected"):
        put_dataset(store, tree, "half", chunk_size=CHUNK, parallel=2, retry_s=0)
    assert list_datasets(store) == []
    assert list(store.list("datasets/")) == []
    store.fail_at = 0
    root = put_dataset(store, tree, "half", chunk_size=CHUNK, parallel=2)
    assert list_versions(store, "half") == [root.version]


# ------------------------------------------------ a real S3 server stopped mid-put
OWN_BUCKET = "put-outage"


class WatchedS3Store(S3Store):
    """An ``S3Store`` that records the key of every request that failed as unavailable.

    It injects nothing: the failures come from the real server being gone. botocore
    tries each request once, so the retries seen are the put's own (``retry_s``).
    """

    def __init__(self, server: S3Server, prefix: str) -> None:
        super().__init__(
            OWN_BUCKET,
            prefix,
            endpoint=server.endpoint,
            connect_timeout_s=1.0,
            read_timeout_s=5.0,
            max_attempts=1,
        )
        self.failures: list[str] = []  # list.append is atomic: the upload threads share it

    def put(self, key: str, data: bytes | memoryview) -> None:
        try:
            super().put(key, data)
        except StoreUnavailable:
            self.failures.append(key)
            raise

    def size(self, key: str) -> int | None:
        try:
            return super().size(key)
        except StoreUnavailable:
            self.failures.append(key)
            raise


@pytest.fixture(scope="module")
def own_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS server of these tests only: they stop it, so it is not the session's."""
    server = S3Server(tmp_path_factory.mktemp("own-s3"))
    try:
        server.start()
        server.make_bucket(OWN_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_store(own_s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[WatchedS3Store]:
    """A fresh prefix on ``own_s3``, which is running when the test starts."""
    own_s3.start(timeout=30)  # no-op unless an earlier test left it stopped
    for key, value in own_s3.client_env().items():
        monkeypatch.setenv(key, value)
    s = WatchedS3Store(own_s3, f"t{uuid.uuid4().hex[:10]}")
    try:
        yield s
    finally:
        s.close()


class StopMidPut:
    """A put progress callback that stops ``server`` once ``after`` chunks are uploaded,
    then calls ``then``. It runs inside the put (in whichever of its threads reports
    first), so the put is mid-way: more chunks, and the root, are still to come."""

    def __init__(
        self, server: S3Server, after: int, then: Callable[[], None] = lambda: None
    ) -> None:
        self.server, self.after, self.then = server, after, then
        self.stopped_at: float | None = None  # put_dataset serializes its progress calls

    def __call__(self, p: PutProgress) -> None:
        if p.chunks_uploaded >= self.after and self.stopped_at is None:
            self.server.stop()
            self.stopped_at = time.monotonic()
            self.then()


def test_put_to_a_stopped_s3_server_fails_within_its_deadline_and_shows_nothing(
    own_s3: S3Server, own_store: WatchedS3Store, tree: Path, tmp_path: Path
) -> None:
    retry_s = 2.0
    stop = StopMidPut(own_s3, after=2)
    with pytest.raises(StoreUnavailable) as info:
        put_dataset(
            own_store, tree, "half", chunk_size=CHUNK, parallel=2, retry_s=retry_s, progress=stop
        )
    assert stop.stopped_at is not None
    elapsed = time.monotonic() - stop.stopped_at
    # A clear error: it names the store and a key it could not reach, and says why.
    message = str(info.value)
    assert any(message.startswith(f"{own_store.url}: {k}: ") for k in own_store.failures), (
        message
    )
    assert "unavailable" in message or "S3 answered 5" in message, message
    # Each request is retried (one failed more than once), then the put gives up at
    # its deadline rather than the default 60 s.
    assert max(Counter(own_store.failures).values()) >= 2, own_store.failures
    assert elapsed < retry_s + 15

    own_s3.start(timeout=30)
    partial = retry_transient(lambda: chunk_objects(own_store), 20)
    assert partial  # the chunks stored before the stop are there...
    assert list_datasets(own_store) == []  # ...but no version names them
    assert list(own_store.list("datasets/")) == []
    with pytest.raises(NotFound, match="'half'"):
        resolve(own_store, "half")

    root = put_dataset(own_store, tree, "half", chunk_size=CHUNK, parallel=2)
    assert 1 <= len(partial) < len({c.id for c in root.chunks})  # it had stopped mid-way
    assert list_versions(own_store, "half") == [root.version]
    get_dataset(own_store, "half", tmp_path / "out")
    try:
        assert snapshot(tmp_path / "out") == snapshot(tree)
    finally:
        make_writable(tmp_path / "out")


def test_put_rides_out_an_s3_server_restart(
    own_s3: S3Server, own_store: WatchedS3Store, tree: Path, tmp_path: Path
) -> None:
    """With the default retry deadline, a put whose server is stopped mid-way and comes
    back (same ports, same data) completes, as if nothing had happened."""
    errors: list[BaseException] = []
    restarted: list[float] = []

    def restart() -> None:
        try:
            # Only once the put has run into the stopped server: it must retry.
            wait_for(lambda: own_store.failures, 20, "the put to meet the stopped server")
            restarted.append(time.monotonic())  # before: the put may finish before start returns
            own_s3.start(timeout=30)
        except BaseException as exc:
            errors.append(exc)

    restarter = threading.Thread(target=restart, name="restart-s3")
    stop = StopMidPut(own_s3, after=2, then=restarter.start)
    try:
        root = put_dataset(own_store, tree, "back", chunk_size=CHUNK, parallel=2, progress=stop)
        done = time.monotonic()
    except StoreUnavailable as exc:
        if restarter.ident is not None:
            restarter.join(60)
        if errors:  # the server did not come back: say why, not only that the put gave up
            raise AssertionError(f"the S3 server did not restart: {errors[0]!r}") from exc
        raise
    finally:
        if restarter.ident is not None:  # started: a server it starts must not outlive us
            restarter.join(60)
    assert stop.stopped_at is not None
    assert not restarter.is_alive() and errors == []
    assert own_store.failures  # the outage was seen, and retried
    assert restarted and done > restarted[0]  # the put finished only once it was back
    assert list_versions(own_store, "back") == [root.version]
    assert len(root.chunks) >= 8
    get_dataset(own_store, "back", tmp_path / "out")
    try:
        assert snapshot(tmp_path / "out") == snapshot(tree)
    finally:
        make_writable(tmp_path / "out")
