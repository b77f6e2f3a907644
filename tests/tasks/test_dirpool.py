"""The agent's pool of empty folders (agent/tasks/dirpool.py), on the real file system."""

from __future__ import annotations

import os
from pathlib import Path

from hypermesh.agent.tasks.dirpool import DirPool


def pool(tmp_path: Path, keep: int = 4) -> DirPool:
    p = DirPool(tmp_path / "spare", keep)
    p.open()
    return p


def test_an_empty_folder_is_renamed_back_out_instead_of_made_again(tmp_path: Path) -> None:
    p = pool(tmp_path)
    first = tmp_path / "a"
    p.make(first)
    assert first.is_dir() and len(p) == 0
    inode = first.stat().st_ino
    assert p.recycle(first)
    assert not first.exists() and len(p) == 1
    second = tmp_path / "b"
    p.make(second)
    assert second.stat().st_ino == inode  # the same folder, renamed: no new inode
    assert len(p) == 0 and list(second.iterdir()) == []


def test_a_folder_with_anything_in_it_stays_where_it_is(tmp_path: Path) -> None:
    p = pool(tmp_path)
    used = tmp_path / "used"
    p.make(used)
    (used / "pid").write_text("1")
    assert not p.recycle(used)
    assert (used / "pid").read_text() == "1" and len(p) == 0
    assert not p.recycle(tmp_path / "never-made")


def test_the_pool_keeps_at_most_its_bound(tmp_path: Path) -> None:
    p = pool(tmp_path, keep=2)
    folders = [tmp_path / f"f{i}" for i in range(3)]
    for f in folders:
        p.make(f)
    assert [p.recycle(f) for f in folders] == [True, True, False]
    assert len(p) == 2 and folders[2].is_dir()


def test_a_pooled_folder_written_to_later_is_never_handed_out(tmp_path: Path) -> None:
    p = pool(tmp_path)
    f = tmp_path / "f"
    p.make(f)
    assert p.recycle(f)
    (spare,) = (tmp_path / "spare").iterdir()
    (spare / "late").write_text("a finished attempt's straggler wrote this")
    target = tmp_path / "fresh"
    p.make(target)
    assert target.is_dir() and list(target.iterdir()) == []
    assert not spare.exists() and len(p) == 0


def test_making_a_folder_that_exists_keeps_its_contents(tmp_path: Path) -> None:
    p = pool(tmp_path)
    spare = tmp_path / "s"
    p.make(spare)
    assert p.recycle(spare)
    kept = tmp_path / "checkpoints"
    kept.mkdir()
    (kept / "step-10").write_text("weights")
    p.make(kept)
    assert (kept / "step-10").read_text() == "weights"
    assert len(p) == 1  # the spare went back to the pool


def test_a_new_run_adopts_the_empty_folders_and_clears_the_rest(tmp_path: Path) -> None:
    p = pool(tmp_path, keep=3)
    folders = [tmp_path / f"f{i}" for i in range(3)]
    for f in folders:
        p.make(f)
    assert all(p.recycle(f) for f in folders)
    spares = sorted((tmp_path / "spare").iterdir())
    (spares[0] / "junk").write_text("x")
    os.mkdir(tmp_path / "spare" / "not-a-number")
    again = pool(tmp_path, keep=3)
    assert len(again) == 2
    assert sorted(os.listdir(tmp_path / "spare")) == sorted(s.name for s in spares[1:])
    # new names never collide with the adopted ones
    target = tmp_path / "g"
    again.make(target)
    again.make(tmp_path / "h")
    assert again.recycle(target) and len(again) == 1
    assert len(os.listdir(tmp_path / "spare")) == 1
