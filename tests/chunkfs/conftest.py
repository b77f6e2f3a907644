"""Fixtures of the chunkfs tests: real mounts, each a child process stopped (and lazily
unmounted if needed) when the test ends, passed or failed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hypermesh.chunkfs.mount import MountProcess

Mounter = Callable[..., MountProcess]


@pytest.fixture
def mounter(tmp_path: Path, store_url: str) -> Iterator[Mounter]:
    """``mounter(spec="ds", name="", **MountProcess options)``: a started mount of the
    test's store at ``tmp_path / name``, with its own cache directory."""
    started: list[MountProcess] = []

    def mount(spec: str = "ds", name: str = "", **kw: object) -> MountProcess:
        name = name or f"m{len(started)}"
        mountpoint = tmp_path / name
        mountpoint.mkdir(exist_ok=True)
        kw.setdefault("cache_dir", tmp_path / f"cache-{name}")
        m = MountProcess(spec, mountpoint, store_url=store_url, **kw)  # type: ignore[arg-type]
        started.append(m)
        return m.start()

    try:
        yield mount
    finally:
        for m in started:
            code = m.stop()
            if code not in (0, None):
                print(f"--- mount {m.mountpoint} exited {code}:\n{m.log_tail()}")
