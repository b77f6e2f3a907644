"""Metrics that tasks report, and their bounded record per attempt.

A task reports metrics without depending on hypermesh, in either of two ways:

- a line on stdout (or stderr): ``HM_METRIC {"val_loss": 0.31, "step": 5}``
- a line of JSON appended to the file named by ``$HM_METRICS_FILE``: ``{"val_loss": 0.31}``

Each report is one JSON object of metric names to finite numbers, plus an optional
``step`` (a non-negative integer). Every report is an intermediate value of each metric it
names, at ``step`` (when absent: the number of earlier reports of that metric); the last
report of a metric is its value. Names are 1-64 letters, digits, ``_ . / -``.

``AttemptMetrics`` keeps, per attempt, the last value of at most ``MAX_METRICS`` metrics
and the last ``MAX_HISTORY`` intermediate values of each, so its etcd value stays small
whatever the task prints. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

LINE_PREFIX = "HM_METRIC "
MAX_METRICS = 32
MAX_HISTORY = 100
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,63}")


class MetricError(ValueError):
    """A report that is not a JSON object of metric names to finite numbers."""


def parse_report(text: str) -> tuple[dict[str, float], int | None]:
    """The metric values and step of one report (the JSON text); raises ``MetricError``."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise MetricError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MetricError("a report is a JSON object of metric names to numbers")
    step = data.pop("step", None)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise MetricError(f"'step' must be a non-negative integer, got {step!r}")
    values: dict[str, float] = {}
    for name, value in data.items():
        if not _NAME.fullmatch(name):
            raise MetricError(f"bad metric name {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MetricError(f"metric {name!r} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise MetricError(f"metric {name!r} must be finite, got {value!r}")
        values[name] = float(value)
    return values, step


def report_in_line(line: str) -> str | None:
    """The JSON text of a ``HM_METRIC`` stdout line, or None for any other line."""
    stripped = line.strip()
    if stripped.startswith(LINE_PREFIX):
        return stripped[len(LINE_PREFIX) :]
    return None


@dataclass
class AttemptMetrics:
    """The metrics of one attempt: last values and bounded intermediate histories.

    Owned by whoever feeds it (the agent running the attempt); ``to_json`` is what is
    stored in etcd and ``from_json`` reads it back.
    """

    last: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    reports: dict[str, int] = field(default_factory=dict)
    ignored: int = 0

    def add(self, values: dict[str, float], step: int | None) -> None:
        for name, value in values.items():
            if name not in self.last and len(self.last) >= MAX_METRICS:
                self.ignored += 1
                continue
            at = step if step is not None else self.reports.get(name, 0)
            self.reports[name] = self.reports.get(name, 0) + 1
            self.last[name] = value
            points = self.history.setdefault(name, [])
            if points and points[-1][0] == at:
                points[-1] = (at, value)  # a step reported again: the newer value counts
            else:
                points.append((at, value))
            del points[:-MAX_HISTORY]

    def add_text(self, text: str) -> bool:
        """Add one report (its JSON text); False (and counted in ``ignored``) if malformed."""
        try:
            values, step = parse_report(text)
        except MetricError:
            self.ignored += 1
            return False
        self.add(values, step)
        return True

    def intermediate(self, name: str) -> dict[int, float]:
        return dict(self.history.get(name, []))

    def __bool__(self) -> bool:
        return bool(self.last) or self.ignored > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "last": dict(self.last),
            "history": {k: [list(p) for p in v] for k, v in self.history.items()},
            "reports": dict(self.reports),
            "ignored": self.ignored,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptMetrics:
        return cls(
            last={str(k): float(v) for k, v in data.get("last", {}).items()},
            history={
                str(k): [(int(s), float(v)) for s, v in points]
                for k, points in data.get("history", {}).items()
            },
            reports={str(k): int(v) for k, v in data.get("reports", {}).items()},
            ignored=int(data.get("ignored", 0)),
        )
