"""No test may leave a container behind (tests/conftest.py runs these after each test and at
the session's end).

A container of a task carries the label ``hypermesh.lifeline`` = its agent's journal, which
lies in the agent's work folder (``agent/tasks/lifeline.py``); a test's agents work under its
``tmp_path``, so a test's containers are those labelled under it, whatever runs beside it
(pytest-xdist's workers, another session). Asking podman costs 50 to 90 ms, so it is
asked only after a test whose ``tmp_path`` holds an agent's lifeline folder (no agent, no
task container), and only when podman's store holds any container at all: its own list,
``containers.json`` (containers/storage), read in well under a millisecond.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from functools import cache
from pathlib import Path
from typing import Any

from hypermesh.agent.tasks.lifeline import CONTAINER_LABEL, FOLDER

GONE_WAIT_S = 15.0
"""How long a test's containers may outlive it, in seconds: a killed agent's watchdog removes
them a moment later (podman calls on a loaded machine)."""

PODMAN = shutil.which("podman")


def agent_ran_under(root: Path, depth: int = 3) -> bool:
    """Whether an agent kept its lifeline folder under ``root``, at most ``depth`` folders
    down (an agent's work folder is ``tmp_path/NAME``, or a folder beneath)."""
    level = [os.fspath(root)]
    for _ in range(depth):
        below: list[str] = []
        for folder in level:
            try:
                with os.scandir(folder) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            if entry.name == FOLDER:
                                return True
                            below.append(entry.path)
            except OSError:  # gone, unreadable, a dead mount
                continue
        level = below
    return False


@cache
def _store_list() -> Path | None:
    """Where podman's store lists its containers (None: not found; podman is asked then)."""
    if PODMAN is None:
        return None
    done = subprocess.run([PODMAN, "info", "--format",
                           "{{.Store.GraphRoot}} {{.Store.GraphDriverName}}"],
                          capture_output=True, text=True, check=False, timeout=60)
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) != 2:
        return None
    path = Path(fields[0]) / f"{fields[1]}-containers" / "containers.json"
    return path if path.is_file() else None


def any_container() -> bool:
    """Whether podman's store may hold a container: False only when its list says none."""
    path = _store_list()
    if path is None:
        return PODMAN is not None
    try:
        return json.loads(path.read_bytes() or b"[]") != []
    except (OSError, ValueError):
        return True


def containers() -> list[dict[str, Any]]:
    """Every container podman holds, running or not ([] without podman)."""
    if PODMAN is None:
        return []
    done = subprocess.run([PODMAN, "ps", "--all", "--format", "json"], capture_output=True,
                          text=True, check=False, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"podman ps: {done.stderr.strip()}")
    found: list[dict[str, Any]] = json.loads(done.stdout or "[]")
    return found


def lifeline_of(container: dict[str, Any]) -> str | None:
    value = (container.get("Labels") or {}).get(CONTAINER_LABEL)
    return str(value) if value is not None else None


def labelled_under(root: Path) -> list[dict[str, Any]]:
    """The containers whose agent worked under ``root``."""
    prefix = f"{root}/"
    return [c for c in containers() if (lifeline_of(c) or "").startswith(prefix)]


def describe(found: list[dict[str, Any]]) -> str:
    return ", ".join(f"{(c.get('Names') or ['?'])[0]} ({c.get('State')}, "
                     f"{CONTAINER_LABEL}={lifeline_of(c)})" for c in found)


def remove(found: list[dict[str, Any]]) -> None:
    if PODMAN is not None and found:
        subprocess.run([PODMAN, "rm", "--force", "--time", "0", "--ignore",
                        *(c["Id"] for c in found)], capture_output=True, check=False, timeout=60)


def left_by_test(root: Path) -> list[dict[str, Any]]:
    """The containers a test under ``root`` left, once its agents had ``GONE_WAIT_S`` to
    remove them; [] at once when no agent ran there. What is returned has been removed."""
    if PODMAN is None or not agent_ran_under(root) or not any_container():
        return []
    deadline = time.monotonic() + GONE_WAIT_S
    while (left := labelled_under(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    remove(left)
    return left


def new_since(before: set[str], basetemp: Path) -> list[dict[str, Any]]:
    """The containers made since ``before`` (their ids) that may be this run's: all but
    those whose lifeline lies outside ``basetemp``, which another session's tests made."""
    prefix = f"{basetemp}/"
    return [c for c in containers() if c["Id"] not in before
            and (lifeline_of(c) or prefix).startswith(prefix)]
