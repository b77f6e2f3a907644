"""Real FUSE mounts of data sets put into the real SeaweedFS server.

Every mount is a child process stopped (and lazily unmounted if needed) by the
fixture, passed or failed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hypermesh.chunkfs.format import MiB, chunk_key
from hypermesh.chunkfs.pack import put_dataset
from hypermesh.chunkfs.store import S3Store
from hypermesh.local.processes import wait_for
from hypermesh.local.s3server import S3Server
from tests.chunkfs.conftest import Mounter
from tests.chunkfs.test_chunkfs_pack import make_tree, make_writable, snapshot

CHUNK = 4 * MiB
SPECIAL = (".out", ".chunkfs-stats")


def visible(tree: dict[str, tuple[object, ...]]) -> dict[str, tuple[object, ...]]:
    return {k: v for k, v in tree.items() if k.split("/")[0] not in SPECIAL}


@pytest.fixture
def src(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "src"
    path.mkdir()
    make_tree(path)
    try:
        yield path
    finally:
        make_writable(path)


def test_every_byte_and_stat_match_the_source(
    src: Path, store: S3Store, mounter: Mounter
) -> None:
    first = put_dataset(store, src, "ds", chunk_size=CHUNK)
    (src / "big" / "half.bin").write_bytes(b"changed")
    (src / "new.txt").write_text("only in v2")
    put_dataset(store, src, "ds", chunk_size=CHUNK)

    latest = mounter("ds")
    mnt = latest.mountpoint
    assert visible(snapshot(mnt)) == snapshot(src)
    for path in (src / "big").iterdir():
        st, ours = path.stat(), (mnt / "big" / path.name).stat()
        assert (ours.st_size, ours.st_mode, ours.st_mtime_ns, ours.st_nlink) == (
            st.st_size, st.st_mode, st.st_mtime_ns, 1)
        assert (ours.st_uid, ours.st_gid) == (os.getuid(), os.getgid())
    assert (mnt / "big").stat().st_ino == (mnt / "big").stat().st_ino
    assert sorted(os.listdir(mnt))[:2] == [".chunkfs-stats", ".out"]

    stats = latest.stats()
    assert stats["dataset"].startswith("ds@")
    assert stats["reads"]["store_bytes"] >= first.bytes // 2
    assert stats["reads"]["blocks"]["store"] > 0

    old = mounter(f"ds@{first.version}")
    assert (old.mountpoint / "big" / "half.bin").stat().st_size == CHUNK // 2 + 1
    assert not (old.mountpoint / "new.txt").exists()
    assert (mnt / "new.txt").read_text() == "only in v2"


@pytest.mark.parametrize("push", [True, False])
def test_a_sequential_read_gets_pushed_pages_and_every_byte_is_right(
    tmp_path: Path, store: S3Store, mounter: Mounter, push: bool
) -> None:
    """A big file that starts mid-page (a small file before it in the chunk), read
    from start to end: the same bytes with or without pushing pages. The reader pauses
    after its first 8 MiB until the prefetched pages ahead of it have been pushed, so
    the rest of the file is read partly from pushed pages. (How many FUSE reads pushing
    saves without a pause depends on who wins the race, the reader or the fetches;
    scripts/bench_chunkfs.py reports it.)"""
    src = tmp_path / "seq"
    src.mkdir()
    (src / "a.txt").write_bytes(b"x" * 5000)
    big = os.urandom(40 * MiB + 123)
    (src / "b.bin").write_bytes(big)
    put_dataset(store, src, "seq", chunk_size=16 * MiB)
    m = mounter("seq", push_pages=push)
    got = bytearray()
    with open(m.mountpoint / "b.bin", "rb", buffering=0) as f:
        while len(got) < 8 * MiB:  # long enough a sequential run to open the window
            got += f.read(MiB)
        if push:
            wait_for(lambda: m.stats()["reads"]["pushed_bytes"] > 0, timeout=30,
                     what="pages pushed ahead of a paused reader")
        while chunk := f.read(MiB):
            got += chunk
    assert got == big
    reads = m.stats()["reads"]
    if push:
        assert reads["pushed_bytes"] > 0
    else:
        assert reads["pushed_bytes"] == 0
        assert reads["file_reads"] >= 40


def test_the_data_set_is_read_only(src: Path, store: S3Store, mounter: Mounter) -> None:
    put_dataset(store, src, "ds", chunk_size=CHUNK)
    mnt = mounter().mountpoint
    for attempt in (
        lambda: (mnt / "empty-file").write_text("x"),
        lambda: (mnt / "new-dir").mkdir(),
        lambda: (mnt / "empty-file").unlink(),
        lambda: (mnt / "big" / "nine.bin").rename(mnt / "nine.bin"),
        lambda: (mnt / "created").write_text("x"),
    ):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    with pytest.raises(FileNotFoundError):
        (mnt / "no" / "such").stat()


def test_a_restarted_mount_reads_from_its_cache(
    src: Path, store: S3Store, mounter: Mounter, tmp_path: Path
) -> None:
    put_dataset(store, src, "ds", chunk_size=CHUNK)
    first = mounter(cache_dir=tmp_path / "shared-cache")
    want = (src / "big" / "nine.bin").read_bytes()
    assert (first.mountpoint / "big" / "nine.bin").read_bytes() == want
    first.stop()
    again = mounter(cache_dir=tmp_path / "shared-cache")
    assert (again.mountpoint / "big" / "nine.bin").read_bytes() == want
    reads = again.stats()["reads"]
    assert reads["blocks"]["store"] == 0
    assert reads["blocks"]["cache"] >= 9


def test_a_corrupt_chunk_gives_eio_never_bad_bytes(
    tmp_path: Path, store: S3Store, mounter: Mounter
) -> None:
    src = tmp_path / "small"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 * MiB))
    (src / "b.bin").write_bytes(os.urandom(MiB))
    root = put_dataset(store, src, "ds", chunk_size=CHUNK)
    key = chunk_key(root.chunks[0].id)
    data = bytearray(store.get(key))
    data[2 * MiB + 5] ^= 0xFF  # inside a.bin's third block
    store.put(key, bytes(data))
    mnt = mounter(deadline="3s").mountpoint
    with open(mnt / "a.bin", "rb") as f:
        assert f.read(MiB) == (src / "a.bin").read_bytes()[:MiB]
        f.seek(2 * MiB)
        with pytest.raises(OSError) as info:
            f.read(MiB)
        assert info.value.errno == errno.EIO
    assert (mnt / "b.bin").read_bytes() == (src / "b.bin").read_bytes()


def test_a_stopped_store_gives_eio_and_the_mount_recovers(
    tmp_path: Path, s3_server: S3Server, store: S3Store, mounter: Mounter
) -> None:
    src = tmp_path / "small"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2 * MiB))
    put_dataset(store, src, "ds", chunk_size=CHUNK)
    mnt = mounter(deadline="2s").mountpoint
    assert (mnt / "a.bin").stat().st_size == 2 * MiB  # the manifest page is loaded
    s3_server.stop()
    try:
        with pytest.raises(OSError) as info:
            (mnt / "a.bin").read_bytes()
        assert info.value.errno == errno.EIO
    finally:
        s3_server.start()
    want = (src / "a.bin").read_bytes()

    def read_back() -> bool:
        try:
            return (mnt / "a.bin").read_bytes() == want
        except OSError:  # the chunk is held for one deadline after it failed
            return False

    wait_for(read_back, 2 + 2, "a.bin to be read once the store is back", interval=0.1)


def test_outputs_closed_on_one_mount_are_read_on_another(
    tmp_path: Path, store: S3Store, mounter: Mounter
) -> None:
    src = tmp_path / "small"
    src.mkdir()
    (src / "x").write_text("x")
    put_dataset(store, src, "ds", chunk_size=CHUNK)
    a, b = mounter().mountpoint / ".out", mounter().mountpoint / ".out"

    (a / "run1").mkdir()
    payload = os.urandom(5 * MiB + 17)
    with open(a / "run1" / "ckpt.tmp", "wb") as f:
        f.write(payload[: 3 * MiB])
        f.write(payload[3 * MiB :])
    assert store.size("outputs/run1/ckpt.tmp") == len(payload)  # durable once closed
    (a / "run1" / "ckpt.tmp").rename(a / "run1" / "ckpt")
    (a / "run1" / "log.txt").write_text("epoch 1\n")
    with open(a / "run1" / "log.txt", "a") as f:
        f.write("epoch 2\n")

    assert sorted(os.listdir(b)) == ["run1"]
    assert sorted(os.listdir(b / "run1")) == ["ckpt", "log.txt"]
    assert (b / "run1" / "ckpt").read_bytes() == payload
    assert (b / "run1" / "log.txt").read_text() == "epoch 1\nepoch 2\n"
    assert (b / "run1" / "ckpt").stat().st_size == len(payload)

    (b / "run1" / "log.txt").unlink()
    assert not (a / "run1" / "log.txt").exists()
    with pytest.raises(OSError) as info:
        (a / "run1").rmdir()
    assert info.value.errno == errno.ENOTEMPTY
    with open(b / "run1" / "ckpt", "r+b") as f:
        f.truncate(10)
    assert (a / "run1" / "ckpt").read_bytes() == payload[:10]


def test_the_command_returns_once_mounted_and_reports_failures(
    tmp_path: Path, src: Path, store: S3Store, store_url: str
) -> None:
    put_dataset(store, src, "ds", chunk_size=CHUNK)
    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def hm(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hypermesh", "mount", *args, "--store", store_url,
             "--cache-dir", str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=120,
        )

    missing = hm("nope", str(mnt))
    assert missing.returncode == 1 and "not found" in missing.stderr
    not_dir = hm("ds", str(tmp_path / "nowhere"))
    assert not_dir.returncode == 2 and "not a directory" in not_dir.stderr

    done = hm("ds", str(mnt))
    assert done.returncode == 0, done.stderr
    pid = int(done.stderr.split("pid ")[1].split(")")[0])
    try:
        assert os.path.ismount(mnt)
        assert (mnt / "empty-file").read_bytes() == b""
        busy = hm("ds", str(tmp_path))
        assert busy.returncode == 2 and "in use" in busy.stderr
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status()
                     == psutil.STATUS_ZOMBIE, 20, "the mount process to exit")
        finally:
            if psutil.pid_exists(pid):
                os.kill(pid, 9)
            if os.path.ismount(mnt):
                subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)
