"""Manifest codecs and on-demand page lookups (pure: pages live in a dict)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import zlib
from dataclasses import replace

import pytest

from hypermesh.chunkfs.format import (
    FORMAT_VERSION,
    ChunkInfo,
    Entry,
    Extent,
    PageRef,
    Root,
    page_key,
)
from hypermesh.chunkfs.manifest import (
    Manifest,
    UnsupportedFormat,
    decode_page,
    decode_root,
    encode_page,
    encode_root,
    page_digest,
    version_name,
)
from hypermesh.errors import CorruptData, StoreUnavailable

ODD = ["with space", "naïve ☃", "new\nline", "-rf", os.fsdecode(b"bad\xff\xfebytes"), "a@b"]


def make_entries() -> list[Entry]:
    """A tree with several directories, wide and deep, sorted by (parent, name)."""
    entries = []
    dirs = ["", "a", "a/b", "a/b/c", "b", "zz"]
    for d in dirs:
        for sub in dirs:
            if sub and sub.rpartition("/")[0] == d:
                entries.append(Entry(d, sub.rpartition("/")[2], "d", 0o755, 1, 0))
        for i in range(7):
            entries.append(
                Entry(d, f"f{i:02d}", "f", 0o644, 10**18 + i, 5, (Extent(i % 3, i * 5, 5, 0),))
            )
    for name in ODD:
        entries.append(Entry("b", name, "l", 0o777, 2, 3, (), "f00"))
    return sorted(entries, key=lambda e: e.sort_key)


def build(entries: list[Entry], per_page: int) -> tuple[Root, dict[str, bytes]]:
    pages: dict[str, bytes] = {}
    refs = []
    for i in range(0, len(entries), per_page):
        chunk = entries[i : i + per_page]
        data = encode_page(chunk)
        key = page_key(page_digest(data))
        pages[key] = data
        refs.append(PageRef(key, len(chunk), chunk[0].parent, chunk[0].name))
    root = Root(
        FORMAT_VERSION, "ds", "", 1_700_000_000_123_456_789, 4 << 20, 10, 3, 50,
        (ChunkInfo("ab" * 32, 10), ChunkInfo("cd" * 32, 20), ChunkInfo("ef" * 32, 30)),
        tuple(refs),
    )
    return replace(root, version=version_name(root)), pages


def test_root_round_trip_and_version_name() -> None:
    root, _ = build(make_entries(), 4)
    assert decode_root(encode_root(root)) == root
    assert re.fullmatch(r"20231114T221320123456Z-[0-9a-f]{12}", root.version)
    # The hex part certifies the content: any change gives another name.
    assert version_name(replace(root, files=11)) != root.version
    assert version_name(root) == root.version


def test_root_format_checked() -> None:
    root, _ = build(make_entries(), 4)
    doc = json.loads(encode_root(root))
    doc["format"] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormat, match="newer"):
        decode_root(json.dumps(doc).encode())
    del doc["format"]
    with pytest.raises(CorruptData, match="format"):
        decode_root(json.dumps(doc).encode())
    with pytest.raises(CorruptData):
        decode_root(b"{not json")
    doc["format"] = FORMAT_VERSION
    del doc["chunks"]
    with pytest.raises(CorruptData, match="malformed"):
        decode_root(json.dumps(doc).encode())


def test_page_round_trip_all_kinds() -> None:
    entries = make_entries()
    data = encode_page(entries)
    assert decode_page(data) == entries
    # Compact: arrays, not objects; one file entry costs a few bytes compressed.
    assert b'"parent"' not in zlib.decompress(data)
    with pytest.raises(CorruptData):
        decode_page(b"garbage")
    with pytest.raises(CorruptData):
        decode_page(zlib.compress(b'[["a","b","x",1,2]]'))


@pytest.mark.parametrize("per_page", [1, 3, 5, 1000])
def test_lookup_and_listdir_across_pages(per_page: int) -> None:
    entries = make_entries()
    root, pages = build(entries, per_page)
    m = Manifest(root, pages.__getitem__, cache_pages=2)
    assert m.entry_count == len(entries)
    for e in entries:
        assert m.lookup(e.path) == e
    for missing in ["0", "a/a", "a/b/c/zzz", "zzz", "zz/zz", "b/f", "nope/f00", "a/f00/x"]:
        assert m.lookup(missing) is None
    top = m.lookup("")
    assert top is not None and top.kind == "d" and top.mtime_ns == root.created_ns
    for d in ["", "a", "a/b", "a/b/c", "b", "zz", "nope", "a/f00"]:
        expected = [e for e in entries if e.parent == d]
        assert list(m.listdir(d)) == expected
    assert list(m) == entries
    assert len(m._cache) <= 2


def test_lookup_loads_one_page() -> None:
    entries = make_entries()
    root, pages = build(entries, 3)
    assert len(pages) > 10
    loads: list[str] = []

    def load(key: str) -> bytes:
        loads.append(key)
        return pages[key]

    m = Manifest(root, load, cache_pages=4)
    assert loads == []  # nothing loaded to start
    target = entries[len(entries) // 2]
    assert m.lookup(target.path) == target
    assert len(loads) == 1
    assert m.lookup(target.path) == target  # cached
    assert len(loads) == 1
    assert m.lookup("a/b/c/nothing") is None
    assert len(loads) == 2
    assert m.pages_loaded == 2


def test_bad_page_is_corrupt_data() -> None:
    entries = make_entries()
    root, pages = build(entries, 5)
    victim = root.pages[2].key
    bad = dict(pages)
    bad[victim] = encode_page(entries[:5])  # a valid page, but not the one named
    m = Manifest(root, bad.__getitem__)
    with pytest.raises(CorruptData, match=victim):
        m.lookup(entries[11].path)
    assert m.lookup(entries[0].path) == entries[0]


def test_load_errors_propagate_and_are_not_cached() -> None:
    root, pages = build(make_entries(), 5)
    fail = [True]

    def load(key: str) -> bytes:
        if fail[0]:
            raise StoreUnavailable("down")
        return pages[key]

    m = Manifest(root, load)
    with pytest.raises(StoreUnavailable):
        m.lookup("a")
    fail[0] = False
    assert m.lookup("a") is not None


def test_concurrent_lookups_load_each_page_once() -> None:
    entries = make_entries()
    root, pages = build(entries, 4)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def slow_load(key: str) -> bytes:
        with lock:
            counts[key] = counts.get(key, 0) + 1
        time.sleep(0.01)
        return pages[key]

    m = Manifest(root, slow_load, cache_pages=len(pages))
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for e in entries:
                assert m.lookup(e.path) == e
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert set(counts) == set(pages) and set(counts.values()) == {1}


def test_empty_manifest() -> None:
    root, _ = build([], 5)
    m = Manifest(root, lambda k: b"")
    assert m.lookup("x") is None
    assert list(m.listdir("")) == []
    assert m.entry_count == 0
