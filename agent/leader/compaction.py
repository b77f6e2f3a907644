"""When the leader compacts and defragments etcd. Pure: the timings, the revision to
compact to and whether a member is worth defragmenting; ``agent/leader/housekeeping.py``
does the I/O.

etcd keeps every revision of every key until its history is compacted, and a compacted
database keeps its size on disk until it is defragmented: a mesh that runs and deletes
workflows grows towards etcd's quota (2 GiB by default) unless both happen.

- Compaction drops the history before a revision. The leader compacts to a revision it
  saw ``compact_keep_s`` ago, never the current one: a watch that resumes after a short
  cut (a restarted agent, a broken stream) still finds the changes it missed. One that
  was away longer finds its revision compacted and reloads the namespace (the mirror
  does that by itself), which costs the reload and nothing else.
- Defragmentation gives the space that compaction freed back to the file system, but
  the member answers nothing while it runs (about a second per few hundred MB). So the
  leader defragments one member at a time, at most every ``defrag_every_s``, and only a
  member whose free pages are both a large share of its file (``defrag_free_ratio``)
  and large in bytes (``defrag_min_free``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any

MiB = 1024 * 1024


_TIMINGS = (  # the fields in seconds
    "check_s", "compact_keep_s", "compact_every_s", "defrag_every_s",
    "defrag_timeout_s", "leftover_grace_s")


@dataclass(frozen=True)
class HousekeepingConfig:
    """Timings of the leader's housekeeping. Construct with ``lan()`` or ``local()``."""

    check_s: float = 60.0
    """Seconds between two checks (retention, compaction, the database's size). Each
    reads the workflows' state keys and one status per etcd member."""

    compact_keep_s: float = 600.0
    """History kept by a compaction, in seconds: the leader compacts to the newest
    revision it saw at least this long ago. Longer: watches that were cut for longer
    resume without a reload; the database holds more old revisions."""

    compact_every_s: float = 300.0
    """Least time between two compactions, in seconds. Each costs etcd a pass over
    the revisions it drops."""

    defrag_free_ratio: float = 0.5
    """A member is defragmented only when at least this share of its file is free."""

    defrag_min_free: int = 64 * MiB
    """...and at least this many bytes of it are free. Below, the gain is not worth
    a member that answers nothing meanwhile."""

    defrag_every_s: float = 600.0
    """Least time between two defragmentations (of any member), in seconds."""

    defrag_timeout_s: float = 120.0
    """Longest the leader waits for one defragmentation, in seconds."""

    leftover_grace_s: float = 600.0
    """Keys of a deleted workflow (a deletion cut short) are purged once seen this
    long, in seconds; a ``hypermesh delete`` still purging them finishes first."""

    def __post_init__(self) -> None:
        for name in _TIMINGS:
            if not 0.05 <= getattr(self, name) <= 7 * 86400:
                raise ValueError(f"{name} must be 0.05 s to 7 days, not {getattr(self, name)}")
        if not 0 < self.defrag_free_ratio < 1:
            raise ValueError(f"defrag_free_ratio must be in (0, 1), not {self.defrag_free_ratio}")
        if self.defrag_min_free < 0:
            raise ValueError(f"defrag_min_free must be 0 or more, not {self.defrag_min_free}")

    @classmethod
    def lan(cls) -> HousekeepingConfig:
        return cls()

    @classmethod
    def local(cls) -> HousekeepingConfig:
        """Tight timings for tests and the local mesh (small databases). A minute of
        history still: a read of a large namespace (a mirror's load, ``status`` of a
        workflow of a million tasks) is paged at one revision, which must outlive it. A
        small database keeps much of its file counted in use after a
        compaction (measured: 43 % of 2 MB with no live key left), so 30 % free is enough,
        and a quarter of a MiB (the test of a return to size peaks at 1.5 MB).
        Defragmentation still waits a minute between two: a test suite's etcd, shared by
        every test, holds tens of MB of live keys, and copying them holds every request
        for up to a second on a loaded 2-core machine."""
        return cls(check_s=1.0, compact_keep_s=60.0, compact_every_s=5.0,
                   defrag_free_ratio=0.3, defrag_min_free=MiB // 4, defrag_every_s=60.0,
                   defrag_timeout_s=60.0, leftover_grace_s=5.0)


TEST_TIMINGS_ENV = "HYPERMESH_TEST_HOUSEKEEPING"
"""``NAME=SECONDS,...``: timings that replace the preset's, for a test that owns its etcd
(a return to size in seconds rather than minutes). Only the timings: the thresholds stay."""

def with_test_timings(cfg: HousekeepingConfig, text: str | None) -> HousekeepingConfig:
    """``cfg`` with the timings ``text`` (``TEST_TIMINGS_ENV``'s value) names; a name that
    is not a timing or a value out of range raises ValueError."""
    if not text:
        return cfg
    changes: dict[str, Any] = {}  # floats, for fields that are all floats
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in _TIMINGS:
            raise ValueError(f"{TEST_TIMINGS_ENV}: {name.strip()!r} is not one of {_TIMINGS}")
        changes[name.strip()] = float(value)
    return replace(cfg, **changes)


class RevisionLog:
    """The etcd revisions the leader saw, each with when (monotonic seconds), for as long
    as a compaction may still want them. Forgotten with leadership: a new leader waits
    ``compact_keep_s`` before its first compaction."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()
        self.compacted = 0  # the last revision compacted to
        self.compacted_at = float("-inf")

    def record(self, now: float, revision: int) -> None:
        if not self._seen or revision > self._seen[-1][1]:
            self._seen.append((now, revision))

    def target(self, now: float, cfg: HousekeepingConfig) -> int | None:
        """The revision to compact to now, or None: the newest one seen at least
        ``compact_keep_s`` ago, if above the last compaction and if
        ``compact_every_s`` has passed since it."""
        seen, keep = self._seen, cfg.compact_keep_s
        while len(seen) > 1 and now - seen[1][0] >= keep:
            seen.popleft()  # the head stays the newest revision seen long enough ago
        if now - self.compacted_at < cfg.compact_every_s or not seen or now - seen[0][0] < keep:
            return None
        return seen[0][1] if seen[0][1] > self.compacted else None

    def done(self, now: float, revision: int) -> None:
        self.compacted = max(self.compacted, revision)
        self.compacted_at = now

    def passed(self, revision: int) -> None:
        """History up to ``revision`` needs no compaction (it holds only the leader's own
        record of the last one)."""
        self.compacted = max(self.compacted, revision)


def worth_defragmenting(db_size: int, in_use: int, cfg: HousekeepingConfig) -> bool:
    """Whether a member whose file is ``db_size`` bytes, ``in_use`` of them in use, has
    enough free space to be defragmented."""
    free = db_size - in_use
    return free >= cfg.defrag_min_free and free >= cfg.defrag_free_ratio * db_size
