"""Live progress of ``submit --wait`` and ``status --watch`` on a terminal (rich's
bars, read back through a pseudo terminal) and in a pipe (one plain line per change),
against a real mesh (real etcd, a real agent)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from dataclasses import dataclass

from hypermesh.local.agents import hypermesh_command
from tests.conftest import Mesh

GATED = "until [ -f gate ]; do sleep 0.05; done"
# Rich redraws its bars in place: cursor moves and erases (and \r) end a drawn line,
# other escape sequences (colours, cursor hiding) are dropped.
REDRAW = re.compile(r"\x1b\[[0-9;]*[ABEFGHJK]|\r")
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][A-Z0-9]")


@dataclass
class Terminal:
    """A CLI run whose stderr is a pseudo terminal (80x24 unless told), stdout a pipe."""

    proc: subprocess.Popen[bytes]
    master: int
    seen: bytes = b""

    @classmethod
    def run(cls, mesh: Mesh, *args: str, columns: int = 120) -> Terminal:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        env = dict(mesh.env, TERM="xterm-256color", COLUMNS=str(columns))
        for name in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
            env.pop(name, None)
        try:
            proc = subprocess.Popen(
                [*hypermesh_command(), *args], env=env, stdout=subprocess.PIPE,
                stderr=slave, stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(slave)
        return cls(proc, master)

    @property
    def text(self) -> str:
        """What the terminal received so far: each drawn line on a line of its own,
        without escape sequences."""
        text = REDRAW.sub("\n", self.seen.decode("utf-8", errors="replace"))
        return ESCAPE.sub("", text)

    def read_until(self, pattern: str, timeout: float) -> str:
        """Read until the text matches ``pattern`` (or the terminal closes: then
        AssertionError); returns the text."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r} on the terminal:\n{self.text}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: the other side closed
                    data = b""
                assert data, f"terminal closed before {pattern!r}:\n{self.text}"
                self.seen += data
        return self.text

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait for the exit; (exit code, stdout). Reads the terminal to its end."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().decode()  # closes when the process exits
        self.proc.wait(timeout)
        while select.select([self.master], [], [], 0.2)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                break
            if not data:
                break
            self.seen += data
        return self.proc.returncode, out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def bar_line(text: str, experiment: str, done: int, total: int) -> bool:
    """Whether a line of rich's output shows ``experiment``'s bar at ``done/total``."""
    return any(
        line.lstrip().startswith(experiment) and f" {done}/{total} " in f" {line} "
        for line in text.splitlines()
    )


def test_status_watch_draws_bars_on_a_terminal(mesh: Mesh) -> None:
    mesh.agent(slots=3)
    recipe = mesh.write_recipe(
        f"experiments:\n  trainer: {{samples: 3, command: ['{GATED}']}}\n"
        "  reporter: {after: [trainer], command: ['true']}\n"
    )
    wid = mesh.submit(recipe)
    term = Terminal.run(mesh, "status", wid, "--watch")
    try:
        text = term.read_until(r"trainer.*0/3", 30)
        assert bar_line(text, "trainer", 0, 3), text
        term.read_until(r"3 running", 30)  # the detail column follows the tasks
        (mesh.root / "gate").touch()
        code, out = term.finish(60)
    finally:
        term.close()
    text = term.text
    assert code == 0, text
    assert bar_line(text, "trainer", 3, 3) and bar_line(text, "reporter", 1, 1), text
    assert "━" in text  # rich's bar, not a plain line
    assert f"{wid}: succeeded" in text
    assert not re.search(r"\[\s*\d+\.\ds\] ", text)  # none of the plain lines
    assert out == ""


def test_submit_wait_draws_bars_on_a_terminal_and_lines_in_a_pipe(mesh: Mesh) -> None:
    mesh.agent(slots=2)
    recipe = mesh.write_recipe("experiments:\n  quick: {samples: 2, command: ['true']}\n")
    term = Terminal.run(mesh, "submit", str(recipe), "--wait")
    try:
        code, out = term.finish(60)
    finally:
        term.close()
    wid = out.split()[-1]
    assert code == 0, term.text
    assert bar_line(term.text, "quick", 2, 2), term.text
    assert f"submitted {wid}" in term.text and f"{wid}: succeeded" in term.text
    # Not a terminal: one plain line per change, the last one the end.
    piped = mesh.hm("submit", str(recipe), "--wait", check=True)
    wid = piped.stdout.split()[-1]
    lines = [line for line in piped.stderr.splitlines() if line.startswith("[")]
    assert lines, piped.stderr
    for line in lines:
        assert re.fullmatch(rf"\[\s*\d+\.\ds\] {wid} \w+: quick \d/2 \w+.*", line), line
    assert re.fullmatch(rf"\[\s*\d+\.\ds\] {wid} succeeded: quick 2/2 succeeded", lines[-1])
    assert "━" not in piped.stderr and "\x1b[" not in piped.stderr
    assert piped.stderr.rstrip().endswith(f"{wid}: succeeded")
