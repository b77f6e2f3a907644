"""Which workflows the leader deletes: finished ones kept long enough, and leftovers.

Pure: the leader's housekeeping (``agent/leader/housekeeping.py``) reads the workflows'
state keys and its view, asks :class:`Retention` which are due, and deletes them
(``hypermesh/state/cleanup.py``).

- A finished workflow is due once ``retention`` seconds (``MeshSettings.retention``; 0
  keeps every workflow) have passed since it ended. The end is the ``ended_at`` its
  final state records; a state written before states recorded it counts from when this
  leader first saw it ended, so a change of leader only ever keeps a workflow longer.
- Leftovers are keys of a workflow whose own record is gone: a deletion cut short (the
  CLI killed, etcd lost mid-purge). They are due once seen for ``grace`` seconds, which
  leaves a ``hypermesh delete`` that is still purging them the time to finish.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Ended:
    """A finished workflow as its state key says: the state, when it ended (None when
    the value does not say) and the key's mod revision, which the deletion is fenced on."""

    state: str
    ended_at: float | None
    revision: int


def due(ended_at: Mapping[str, float], now: float, retention: float) -> list[str]:
    """The workflows (id -> when it ended) that ended at least ``retention`` seconds
    before ``now``, longest ago first; none when ``retention`` is 0 (keep forever)."""
    if retention <= 0:
        return []
    old = [(at, wid) for wid, at in ended_at.items() if now - at >= retention]
    return [wid for _, wid in sorted(old)]


class Retention:
    """What the leader remembers between two checks: when it first saw each finished
    workflow that records no end, and each leftover. Owned by the housekeeping duty;
    forgotten with leadership (a new leader starts the clocks again, later)."""

    def __init__(self) -> None:
        self._first_seen: dict[str, float] = {}
        self._leftover_since: dict[str, float] = {}

    def ended_at(self, finished: Mapping[str, Ended], now: float) -> dict[str, float]:
        """When each finished workflow ended: as recorded, else when first seen ended."""
        self._first_seen = {
            wid: self._first_seen.get(wid, now)
            for wid, e in finished.items() if e.ended_at is None
        }
        return {
            wid: e.ended_at if e.ended_at is not None else self._first_seen[wid]
            for wid, e in finished.items()
        }

    def due(self, finished: Mapping[str, Ended], now: float, retention: float) -> list[str]:
        """The finished workflows to delete now (see ``due``)."""
        return due(self.ended_at(finished, now), now, retention)

    def leftovers_due(self, leftovers: Iterable[str], now: float, grace: float) -> list[str]:
        """The leftovers seen for at least ``grace`` seconds (in sorted order); those
        no longer seen are forgotten."""
        self._leftover_since = {
            wid: self._leftover_since.get(wid, now) for wid in leftovers
        }
        return sorted(w for w, since in self._leftover_since.items() if now - since >= grace)


def leftover_wids(stored: Iterable[str], with_keys: Iterable[str]) -> set[str]:
    """Workflows that have keys (``with_keys``) but no record (``stored``)."""
    return set(with_keys) - set(stored)
