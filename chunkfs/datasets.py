"""Data sets in a store: list, resolve a ``NAME[@VERSION]``, remove, and download.

``remove`` deletes version roots, then collects garbage: chunks and pages that no
remaining root names. That is safe against readers of the remaining versions, but only
best effort against a ``put`` into the same store at the same time: a put's chunks are
not named by any root until its root is written, so a collection that runs meanwhile
may delete them (or a put may dedup against a chunk that is being deleted) and leave
that new version with missing chunks. Do not run ``data rm`` during a ``data put`` to
the same store; a version damaged that way fails its reads with ``NoSuchObject`` or
``CorruptData``, never with wrong bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hypermesh.chunkfs import format as fmt
from hypermesh.chunkfs.format import ChunkInfo, Root
from hypermesh.chunkfs.manifest import Manifest, decode_root
from hypermesh.chunkfs.store import ObjectStore, retry_transient
from hypermesh.errors import CorruptData, FatalError, NoSuchObject, NotFound, UsageError

__all__ = [
    "RemoveResult",
    "get_dataset",
    "list_datasets",
    "list_versions",
    "parse_spec",
    "read_chunk",
    "remove",
    "resolve",
    "verify_chunk",
]

_ROOTS = "datasets/"
RETRY_S = 60.0  # how long one chunk read is retried on transient errors


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME@VERSION`` → (name, version or None); ``UsageError`` if malformed."""
    name, sep, version = spec.partition("@")
    if not fmt.valid_dataset_name(name) or (sep and not fmt.valid_version(version)):
        raise UsageError(
            f"invalid data set {spec!r}: use NAME or NAME@VERSION (names: letters, digits, "
            f"'.', '_', '-', starting with a letter or digit)"
        )
    return name, (version or None)


def list_datasets(store: ObjectStore) -> list[str]:
    """Names of the data sets that have at least one version, sorted."""
    names = set()
    for key in store.list(_ROOTS):
        name, _, file = key[len(_ROOTS) :].partition("/")
        if file.endswith(".json") and "/" not in file:
            names.add(name)
    return sorted(names)


def list_versions(store: ObjectStore, name: str) -> list[str]:
    """The versions of data set ``name``, oldest first (empty if there are none)."""
    prefix = f"{_ROOTS}{name}/"
    return [
        key[len(prefix) : -len(".json")]
        for key in store.list(prefix)
        if key.endswith(".json") and "/" not in key[len(prefix) :]
    ]


def load_root(store: ObjectStore, name: str, version: str) -> Root:
    """The root of ``name@version``; ``NotFound`` if there is none."""
    try:
        data = store.get(fmt.root_key(name, version))
    except NoSuchObject as exc:
        raise NotFound(f"data set {name}@{version} not found in {store.url}") from exc
    root = decode_root(data)
    if root.name != name or root.version != version:
        raise CorruptData(
            f"{store.url}: {fmt.root_key(name, version)} holds {root.name}@{root.version}"
        )
    return root


def resolve(store: ObjectStore, spec: str) -> Root:
    """The root of ``NAME@VERSION``, or of the newest version of ``NAME``.

    ``UsageError`` for a malformed spec; ``NotFound`` naming it if it does not exist.
    """
    name, version = parse_spec(spec)
    if version is None:
        versions = list_versions(store, name)
        if not versions:
            raise NotFound(f"data set {name!r} not found in {store.url}")
        version = versions[-1]
    return load_root(store, name, version)


# ----------------------------------------------------------------------------- rm
@dataclass(frozen=True)
class RemoveResult:
    versions: tuple[str, ...]
    chunks_deleted: int
    pages_deleted: int


def remove(store: ObjectStore, spec: str, *, collect: bool = True) -> RemoveResult:
    """Delete ``NAME@VERSION`` (or every version of ``NAME``), then collect garbage.

    See the module notes on running it alongside a put.
    """
    name, version = parse_spec(spec)
    if version is None:
        versions = list_versions(store, name)
        if not versions:
            raise NotFound(f"data set {name!r} not found in {store.url}")
    else:
        load_root(store, name, version)  # NotFound if it is not there
        versions = [version]
    for v in versions:
        store.delete(fmt.root_key(name, v))
    chunks = pages = 0
    if collect:
        chunks, pages = collect_garbage(store)
    return RemoveResult(tuple(versions), chunks, pages)


def collect_garbage(store: ObjectStore) -> tuple[int, int]:
    """Delete chunks and pages that no root names; return how many of each."""
    live_chunks: set[str] = set()
    live_pages: set[str] = set()
    for name in list_datasets(store):
        for version in list_versions(store, name):
            root = load_root(store, name, version)
            live_chunks.update(c.id for c in root.chunks)
            live_pages.update(p.key for p in root.pages)
    chunks = pages = 0
    for key in store.list("chunks/"):
        cid = key.rpartition("/")[2].removesuffix(".blocks")
        if cid not in live_chunks:
            # The block list goes first: without it the chunk no longer counts as stored.
            store.delete(key)
            chunks += not key.endswith(".blocks")
    for key in store.list("pages/"):
        if key not in live_pages:
            store.delete(key)
            pages += 1
    return chunks, pages


# ----------------------------------------------------------------------------- get
def verify_chunk(cid: str, data: bytes, block_list: bytes, where: str = "") -> None:
    """Raise ``CorruptData`` naming chunk ``cid`` unless ``data`` is exactly that chunk."""
    label = f"{where}: chunk {cid}" if where else f"chunk {cid}"
    if not fmt.names(cid, block_list):
        raise CorruptData(f"{label}: its block list does not match the chunk id")
    if len(block_list) != 32 * fmt.block_count(len(data)):
        raise CorruptData(f"{label}: {len(data)} bytes do not match its block list")
    view, algo = memoryview(data), fmt.hash_of(cid)
    for i in range(0, len(data), fmt.BLOCK_SIZE):
        n = i // fmt.BLOCK_SIZE
        digest = fmt.block_digest(view[i : i + fmt.BLOCK_SIZE], algo)
        if digest != block_list[32 * n : 32 * n + 32]:
            raise CorruptData(f"{label}: block {n} does not match its digest")


def read_chunk(store: ObjectStore, chunk: ChunkInfo) -> bytes:
    """A whole chunk, verified against its id and every block digest."""
    block_list = store.get(fmt.blocks_key(chunk.id))
    data = store.get(fmt.chunk_key(chunk.id))
    if len(data) != chunk.size:
        raise CorruptData(
            f"{store.url}: chunk {chunk.id}: {len(data)} bytes, the manifest says {chunk.size}"
        )
    verify_chunk(chunk.id, data, block_list, store.url)
    return data


def get_dataset(
    store: ObjectStore,
    spec: str,
    dest_dir: str | os.PathLike[str],
    *,
    parallel: int = 8,
    retry_s: float = RETRY_S,
) -> Root:
    """Download ``spec`` into ``dest_dir`` (which must not exist or be empty).

    Every byte is verified before it is written: a bad chunk raises ``CorruptData``
    naming it (the files it feeds are left incomplete). Chunk reads are retried on
    transient errors for up to ``retry_s`` seconds each. Modes and mtimes are
    restored; directories get theirs last.
    """
    if parallel < 1:
        raise UsageError(f"parallel must be at least 1, not {parallel}")
    dest = Path(dest_dir)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory")
    root = resolve(store, spec)
    manifest = Manifest(root, store.get, cache_pages=2)
    dest.mkdir(parents=True, exist_ok=True)

    # Pass 1: the tree, with files created empty at full size; what each chunk feeds.
    feeds: dict[int, list[tuple[str, int, int, int]]] = defaultdict(list)
    files: list[tuple[Path, int, int]] = []
    dirs: list[tuple[Path, int, int]] = [(dest, 0o755, root.created_ns)]
    links: list[tuple[Path, int]] = []
    for e in manifest:
        path = dest / e.path
        if e.kind == "d":
            path.mkdir()
            dirs.append((path, e.mode, e.mtime_ns))
        elif e.kind == "l":
            os.symlink(e.target, path)
            links.append((path, e.mtime_ns))
        else:
            with open(path, "wb") as f:
                f.truncate(e.size)
            files.append((path, e.mode, e.mtime_ns))
            for x in e.extents:
                feeds[x.chunk].append((str(path), x.chunk_offset, x.length, x.file_offset))

    # Pass 2: chunks, in parallel, each verified and then written where it belongs.
    def fetch(index: int) -> None:
        data = retry_transient(lambda: read_chunk(store, root.chunks[index]), retry_s)
        view = memoryview(data)
        for path, chunk_offset, length, file_offset in feeds[index]:
            if chunk_offset + length > len(data):
                raise CorruptData(f"chunk {root.chunks[index].id}: extent of {path} past its end")
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, view[chunk_offset : chunk_offset + length], file_offset)
            finally:
                os.close(fd)

    _run_parallel(fetch, iter(sorted(feeds)), parallel)

    # Pass 3: metadata, directories deepest first so writing into them is done.
    for path, mode, mtime_ns in files:
        os.chmod(path, mode)
        os.utime(path, ns=(mtime_ns, mtime_ns))
    for path, mtime_ns in links:
        with contextlib.suppress(NotImplementedError, OSError):
            os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
    for path, mode, mtime_ns in reversed(dirs):
        os.chmod(path, mode)
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return root


def _run_parallel(fn: object, items: Iterator[int], parallel: int) -> None:
    """Run ``fn(item)`` for every item on ``parallel`` threads; stop at the first error."""
    failed: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while not failed:
            with lock:
                item = next(items, None)
            if item is None:
                return
            try:
                fn(item)  # type: ignore[operator]
            except BaseException as exc:
                failed.append(exc)
                return

    with ThreadPoolExecutor(parallel, thread_name_prefix="get") as pool:
        for _ in range(parallel):
            pool.submit(worker)
    if failed:
        err = failed[0]
        if isinstance(err, OSError):
            raise FatalError(f"writing the data set: {err}") from err
        raise err
