"""What gossip refuses to believe, and the count of what it refused. Pure.

Anyone who can reach an agent's port can send it gossip, so every field that
arrives is checked before it can touch the member table:

* names full-match the node-name pattern
  (:data:`~hypermesh.state.keyspace.NODE_NAME_RE`), addresses are ``host:port``
  with a port in 1-65535 (:func:`check_name`, :func:`check_address`);
* incarnations, meta versions and sequence numbers are integers in
  ``0 .. MAX_COUNTER`` (:func:`check_counter`): they must fit the ``int64`` of
  the agent API's ``Member`` message, which one incarnation of 2**64 once broke
  for good.

The rules about what a well-formed row may claim (only a member raises its own
incarnation, a member leaves only by its own word, a bounded table) are applied
where rows are merged, in :mod:`~hypermesh.agent.gossip.dissemination`; every
refusal, here or there, is counted in one :class:`Refusals` per member, which
the agent logs at most once per ``REPORT_PERIOD_S`` and exports as a metric.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from hypermesh.state.keyspace import NODE_NAME_RE

__all__ = [
    "MAX_COUNTER",
    "REASONS",
    "REPORT_PERIOD_S",
    "Refusals",
    "brief",
    "check_address",
    "check_counter",
    "check_name",
]

MAX_COUNTER = 2**63 - 1
"""The largest incarnation, meta version or sequence number gossip accepts (int64)."""

REPORT_PERIOD_S = 60.0
"""Seconds between two log lines about refused gossip (the counts keep growing)."""

# Why something was refused (the metric's ``reason`` label).
MALFORMED = "malformed"  # a message or row that does not decode
OVERSIZED = "oversized"  # a row whose meta exceeds max_meta_bytes
NOT_PEER = "sender-not-peer"  # the sender is not the authenticated peer
INCARNATION = "incarnation"  # suspect/dead above the incarnation the member announced
LEFT_BY_OTHER = "left-by-other"  # a left above the known incarnation, not from the member
TABLE_FULL = "table-full"  # a new member beyond max_members
REASONS = (MALFORMED, OVERSIZED, NOT_PEER, INCARNATION, LEFT_BY_OTHER, TABLE_FULL)

_HOST = re.compile(r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]{1,253}")


def check_name(value: Any, what: str) -> str:
    """``value`` if it is a node name (a full match of ``NODE_NAME_RE``), else ValueError."""
    if not isinstance(value, str) or not NODE_NAME_RE.fullmatch(value):
        raise ValueError(f"{what} must be a node name, got {brief(value)}")
    return value


def check_address(value: Any, what: str) -> str:
    """``value`` if it is ``host:port`` (a host name, IPv4 or bracketed IPv6 address and a
    port in 1-65535), else ValueError."""
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if (
            sep
            and _HOST.fullmatch(host)
            and port.isascii()
            and port.isdigit()
            and len(port) <= 5
            and 1 <= int(port) <= 65535
        ):
            return value
    raise ValueError(f"{what} must be host:port, got {brief(value)}")


def check_counter(value: Any, what: str) -> int:
    """``value`` if it is an integer in ``0 .. MAX_COUNTER``, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
        raise ValueError(f"{what} must be an integer in [0, 2**63), got {brief(value)}")
    return value


def brief(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (for error messages about what arrived)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Refusals:
    """What one member refused, by reason: totals since it started, and what is new
    since the last report. Changed only by its owner (the member's ``Swim`` and the
    agent's gossip duty, on one event loop)."""

    def __init__(self, period: float = REPORT_PERIOD_S) -> None:
        self.period = period
        self.totals: Counter[str] = Counter()
        self._new: Counter[str] = Counter()
        self._example: dict[str, str] = {}
        self._next_report = -math.inf

    def add(self, reason: str, detail: str) -> None:
        """Count one refusal; ``detail`` says what was refused (the first one of each
        reason in a period is quoted in the next report)."""
        self.totals[reason] += 1
        self._new[reason] += 1
        self._example.setdefault(reason, detail)

    def report(self, now: float) -> str | None:
        """A summary of the refusals since the last report, at most once per ``period``
        (None when there is nothing new or the period has not passed)."""
        if not self._new or now < self._next_report:
            return None
        parts = [f"{n} {why} (e.g. {self._example[why]})" for why, n in sorted(self._new.items())]
        self._new.clear()
        self._example.clear()
        self._next_report = now + self.period
        return "refused gossip: " + "; ".join(parts)
