"""agent/tasks/spawn.py: the fast start (``fork_exec``) gives the child that ``Popen`` gives.

Every case runs twice, through the fast path and through the ``Popen`` fallback, and
checks what the child itself sees (its session, descriptors, environment, folder,
signal dispositions) and what the caller gets back (exit codes, the same ``OSError``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypermesh.agent.tasks import spawn as spawn_mod
from hypermesh.agent.tasks.spawn import Child, spawn

PY = sys.executable


@pytest.fixture(params=["fork_exec", "popen"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "popen":
        monkeypatch.setattr(spawn_mod, "_FAST", False)
    else:
        assert spawn_mod._FAST, "this Python should take the fast path"
    return str(request.param)


@pytest.fixture()
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def run(argv: list[str], *, env: dict[str, str] | None = None, cwd: str = "/",
        stdin: int, path: str) -> tuple[int, str]:
    """Spawn, wait, and return the exit code and everything written to stdout/stderr."""
    read, write = os.pipe2(os.O_CLOEXEC)
    try:
        child = spawn(argv, cwd=cwd, env=env if env is not None else dict(os.environ),
                      stdin=stdin, stdout=write)
        assert isinstance(child, Child if path == "fork_exec" else subprocess.Popen)
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as out:
        data = out.read()
    return child.wait(), data.decode()


def test_exit_codes_and_signals(path: str, devnull: int) -> None:
    assert run(["true"], stdin=devnull, path=path)[0] == 0
    assert run(["sh", "-c", "exit 3"], stdin=devnull, path=path)[0] == 3
    assert run(["sh", "-c", "kill -9 $$"], stdin=devnull, path=path)[0] == -signal.SIGKILL


def test_child_leads_its_own_session(path: str, devnull: int) -> None:
    code, out = run(
        [PY, "-c", "import os; print(os.getsid(0), os.getpgid(0), os.getpid())"],
        stdin=devnull, path=path,
    )
    sid, pgid, pid = out.split()
    assert code == 0 and sid == pgid == pid


def test_stdin_and_both_outputs(path: str) -> None:
    read, write = os.pipe2(os.O_CLOEXEC)
    os.write(write, b"from stdin\n")
    os.close(write)
    try:
        code, out = run(["sh", "-c", "cat; echo to-err >&2; echo to-out"], stdin=read, path=path)
    finally:
        os.close(read)
    assert code == 0
    assert out.splitlines() == ["from stdin", "to-err", "to-out"]


def test_exactly_the_given_environment_and_folder(path: str, devnull: int,
                                                   tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HM_X": "a b=c", "EMPTY": "", "UNICODE": "é✓"}
    code, out = run(["env", "-0"], env=env, stdin=devnull, path=path)
    assert code == 0
    assert dict(line.split("=", 1) for line in out.split("\0") if line) == env
    code, out = run(["pwd", "-P"], cwd=str(tmp_path), stdin=devnull, path=path)
    assert (code, out) == (0, f"{tmp_path.resolve()}\n")


def test_no_other_descriptor_is_inherited(path: str, devnull: int) -> None:
    read, write = os.pipe()
    high = os.dup2(read, 77, inheritable=True)
    try:
        code, _ = run(
            [PY, "-c", "import os, sys; sys.exit(5 if os.path.exists('/proc/self/fd/77') else 0)"],
            stdin=devnull, path=path,
        )
    finally:
        for fd in (read, write, high):
            os.close(fd)
    assert code == 0


def test_signals_the_interpreter_ignores_are_restored(path: str, devnull: int) -> None:
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # Python's own setting
    code, out = run(["grep", "SigIgn", "/proc/self/status"], stdin=devnull, path=path)
    ignored = int(out.split()[1], 16)
    assert code == 0
    assert not ignored & (1 << (signal.SIGPIPE - 1))


def test_path_of_the_given_environment_is_searched(path: str, devnull: int,
                                                   tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "mytool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho found $1\n")
    tool.chmod(0o755)
    env = {"PATH": f"/nonexistent:{tool.parent}"}
    assert run(["mytool", "it"], env=env, stdin=devnull, path=path) == (0, "found it\n")
    with pytest.raises(FileNotFoundError) as missing:
        run(["mytool"], env={"PATH": "/nonexistent"}, stdin=devnull, path=path)
    assert missing.value.filename == "mytool"


def test_start_failures_raise_what_popen_raises(path: str, devnull: int,
                                                tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\ntrue\n")
    with pytest.raises(PermissionError) as denied:
        run([str(script)], stdin=devnull, path=path)
    assert denied.value.filename == str(script)
    gone = tmp_path / "no-such-folder"
    with pytest.raises(FileNotFoundError) as no_cwd:
        run(["true"], cwd=str(gone), stdin=devnull, path=path)
    assert no_cwd.value.filename == str(gone)
    with pytest.raises(ValueError):
        run(["true"], env={"A=B": "x"}, stdin=devnull, path=path)


def test_a_refused_call_falls_back_to_popen_for_good(
    monkeypatch: pytest.MonkeyPatch, devnull: int
) -> None:
    class Refusing:
        calls = 0

        def fork_exec(self, *args: object) -> int:
            Refusing.calls += 1
            raise TypeError(f"fork_exec expected 22 arguments, got {len(args)}")

    monkeypatch.setattr(spawn_mod, "_FAST", True)
    monkeypatch.setattr(spawn_mod, "_posixsubprocess", Refusing())
    first = run(["sh", "-c", "exit 4"], stdin=devnull, path="popen")
    second = run(["true"], stdin=devnull, path="popen")
    assert (first[0], second[0]) == (4, 0)
    assert Refusing.calls == 1 and spawn_mod._FAST is False
