"""Empty folders kept for reuse, because making a folder is the dearest thing an
attempt of a trivial task does.

Every attempt gets a scratch folder (``HM_ATTEMPT_DIR``) and every task a checkpoint
folder, and most trivial tasks leave both empty. On ext4 a ``mkdir`` allocates an
inode, and once many inodes were deleted recently (an agent cleaning up, a test suite
tearing down its trees) the allocator walks past each of them: 0.2-0.5 ms per
``mkdir`` on the machines we measure on, against about 0.01 ms for a ``rename``.
So a folder an attempt left empty is renamed into the pool, and the next attempt
renames it out to its own path instead of making one; a folder that holds anything
stays where it is, for whoever wants to read it.

A pooled folder is checked to be empty again when it is taken (a process of a
finished attempt could have written into it after the check), and one that is not
is left out. The pool lives in one folder of the agent's work dir; at start the
agent adopts the empty folders a previous run left there. Only the agent's event
loop uses a pool.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

KEEP = 64
"""Most folders kept: more than a node's slots, far fewer than its attempts."""


def is_empty_dir(path: str | Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:  # gone, or not a folder
        return False


class DirPool:
    def __init__(self, root: Path, keep: int = KEEP) -> None:
        self.root = root
        self._root = str(root)
        self.keep = keep
        self._free: list[str] = []
        self._next = 0

    def open(self) -> None:
        """Make the pool's folder, adopting the empty folders a previous run left."""
        self.root.mkdir(parents=True, exist_ok=True)
        with os.scandir(self.root) as entries:
            names = [e.name for e in entries]
        for name in names:
            path = self.root / name
            if name.isdigit() and len(self._free) < self.keep and is_empty_dir(path):
                self._free.append(str(path))
                self._next = max(self._next, int(name) + 1)
            else:  # more than we keep, or something a stray process wrote
                _remove(path)

    def __len__(self) -> int:
        return len(self._free)

    def make(self, path: str | Path) -> None:
        """Make ``path`` (whose parent exists) an empty folder: a pooled one when
        there is one, else a new one. A folder already there is kept as it is."""
        while self._free:
            spare = self._free.pop()
            if not is_empty_dir(spare):
                _remove(Path(spare))
                continue
            try:
                os.rename(spare, path)
                return
            except OSError:  # path exists (renaming onto a folder needs it empty)
                self._free.append(spare)
                break
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)

    def recycle(self, path: str | Path) -> bool:
        """Move ``path`` into the pool if it is an empty folder and the pool has room;
        whether it moved."""
        if len(self._free) >= self.keep or not is_empty_dir(path):
            return False
        spare = f"{self._root}/{self._next}"
        try:
            os.rename(path, spare)
        except OSError:
            return False
        self._next += 1
        self._free.append(spare)
        return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()
