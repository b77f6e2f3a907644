"""Progress of a workflow on stderr: live bars on a terminal, plain lines otherwise.

Rich draws the bars (it handles terminal width, redraws and colour); when stderr
is not a terminal (CI logs, pipes) a line is printed whenever the counts change, and
rich is not even imported (that alone costs a short ``submit --wait`` 80 ms of CPU).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

# What makes rich draw on stderr that is no terminal (see its Console).
_FORCE_TERMINAL = ("FORCE_COLOR", "TTY_INTERACTIVE")


class ProgressDisplay:
    def __init__(self, wid: str) -> None:
        self.wid = wid
        self.live = False
        if sys.stderr.isatty() or any(os.environ.get(name) for name in _FORCE_TERMINAL):
            from rich.console import Console

            self.console = Console(stderr=True)
            self.live = self.console.is_terminal
        self.progress: Progress | None = None
        self.bars: dict[str, TaskID] = {}
        self.last_line = ""
        self.started = time.monotonic()

    def update(self, summary: dict[str, Any]) -> None:
        exps = summary["experiments"]
        if not self.live:
            line = " | ".join(
                f"{name} {e['succeeded'] + e['failed'] + e['cancelled']}/{e['total']} {e['state']}"
                + (f" ({e['running']} running)" if e["running"] else "")
                + (f" ({e['failed']} failed)" if e["failed"] else "")
                + (f" (waiting: {e['waiting']})" if e.get("waiting") else "")
                for name, e in exps.items()
            )
            if line != self.last_line:
                self.last_line = line
                elapsed = time.monotonic() - self.started
                print(
                    f"[{elapsed:6.1f}s] {self.wid} {summary['state']}: {line}",
                    file=sys.stderr,
                    flush=True,
                )
            return
        if self.progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                TextColumn("{task.description:<24}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.progress.start()
        for name, e in exps.items():
            done = e["succeeded"] + e["failed"] + e["cancelled"]
            detail = f"{e['state']}, {e['running']} running" + (
                f", {e['failed']} failed" if e["failed"] else ""
            ) + (f", waiting: {e['waiting']}" if e.get("waiting") else "")
            if name not in self.bars:
                self.bars[name] = self.progress.add_task(name, total=e["total"], detail=detail)
            self.progress.update(self.bars[name], completed=done, total=e["total"], detail=detail)

    def close(self, summary: dict[str, Any] | None) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if summary is not None:
            print(f"{self.wid}: {summary['state']}", file=sys.stderr, flush=True)
