"""Which chunks a path of a data set version covers, and how many of its bytes are in each.

A task's inputs (``hypermesh/recipe/inputs.py``) name paths; placing the task near its data
needs the chunks under them. ``covered_chunks`` answers through the manifest's own
lookups: a file is one ``lookup``; a directory is walked with ``listdir``, which loads
only the pages holding that subtree, so the answer never needs the whole file list in
memory (only the chunk totals, one number per chunk, and a stack of directory names).
The whole data set (path ``""``) is every chunk, straight from the root.

``CoverageCache`` keeps answers per ``(data set, version, path)``: versions are
immutable, so an answer never goes stale. Not thread-safe by itself; its owner calls
it from one thread at a time.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from hypermesh.chunkfs.format import Entry
from hypermesh.chunkfs.manifest import Manifest

__all__ = ["CoverageCache", "covered_chunks"]


def _add_file(entry: Entry, manifest: Manifest, out: dict[str, int]) -> None:
    chunks = manifest.root.chunks
    for x in entry.extents:
        out[chunks[x.chunk].id] += x.length


def covered_chunks(manifest: Manifest, path: str) -> dict[str, int]:
    """Chunk id → bytes of the files at or below ``path`` that lie in that chunk.

    Empty when ``path`` does not exist, is a symlink (not followed) or holds no data.
    """
    if path == "":
        return {c.id: c.size for c in manifest.root.chunks if c.size}
    entry = manifest.lookup(path)
    out: dict[str, int] = defaultdict(int)
    if entry is None or entry.kind == "l":
        return {}
    if entry.kind == "f":
        _add_file(entry, manifest, out)
        return dict(out)
    todo = [path]
    while todo:
        directory = todo.pop()
        for child in manifest.listdir(directory):
            if child.kind == "f":
                _add_file(child, manifest, out)
            elif child.kind == "d":
                todo.append(child.path)
    return dict(out)


class CoverageCache:
    """``covered_chunks`` answers by ``(name, version, path)``, the ``limit`` most
    recently used kept, with one ``Manifest`` (and its page cache) per version."""

    def __init__(self, limit: int = 4096, manifests: int = 16) -> None:
        self.limit = limit
        self.manifest_limit = manifests
        self._answers: OrderedDict[tuple[str, str, str], dict[str, int]] = OrderedDict()
        self._manifests: OrderedDict[tuple[str, str], Manifest] = OrderedDict()

    def manifest(self, key: tuple[str, str]) -> Manifest | None:
        """The cached manifest of ``(name, version)``, if any."""
        found = self._manifests.get(key)
        if found is not None:
            self._manifests.move_to_end(key)
        return found

    def add_manifest(self, manifest: Manifest) -> None:
        key = (manifest.root.name, manifest.root.version)
        self._manifests[key] = manifest
        while len(self._manifests) > self.manifest_limit:
            self._manifests.popitem(last=False)

    def covered(self, manifest: Manifest, path: str) -> dict[str, int]:
        """``covered_chunks(manifest, path)``, computed once per version and path."""
        key = (manifest.root.name, manifest.root.version, path)
        found = self._answers.get(key)
        if found is None:
            found = self._answers[key] = covered_chunks(manifest, path)
            while len(self._answers) > self.limit:
                self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(key)
        return found
