"""Folded blocks: what a mirror keeps of a settled block instead of its per-task records.

A block of a batched experiment (``hypermesh.state.blocks``) is *settled* once nobody
holds it and every one of its tasks has a result. The mirror expands a block into
per-task records (a task's parameters, its attempts, its result) of a few hundred
bytes to a few kilobytes each, so a million finished tasks would cost every agent
gigabytes for records nothing schedules from. Past a threshold of settled tasks
(``Mirror.fold_after``) the mirror therefore *folds* its oldest settled blocks: it keeps,
per block, the counts that summaries and metrics need (:class:`FoldedBlock`) and the
block's keys as etcd holds them, compressed (:func:`pack`), about 30 bytes a task, and
drops its per-task records. Any later change of the block (``hypermesh retry``, a new
claim) unfolds it first: its keys are applied again from the packed copy, exactly as
they first arrived, so the tables are what they would have been without folding.

Pure: no I/O, no clock. The tables are ``hypermesh.state.mirror.Mirror``'s.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

FOLD_AFTER_TASKS = 20_000
"""Tasks of settled blocks an agent's mirror (and ``hypermesh status``) keeps as records
before it folds the oldest: about 2 KB each on the leader, against about 30 bytes
folded. Recent work stays inspectable in full (logs, the dashboard's task list)."""

Batches = list[tuple[str, int, dict[str, Any]]]  # (bdone key, its mod revision, its value)

AttemptKey = tuple[str, str, str, str]
"""An attempt as the metrics count it: (node, state, reason, the reason the attempt
before it on the same task ended, '' if none)."""


@dataclass
class FoldedBlock:
    """A settled block without its per-task records: ``size`` tasks whose results are
    ``states`` (counts by state), ``attempts`` (counts by :data:`AttemptKey`), and the
    packed keys to unfold it from. ``dropped``: batch keys deleted since it was folded
    (a workflow being deleted), left out if it is ever unfolded."""

    size: int
    states: Counter[str]
    attempts: Counter[AttemptKey]
    packed: bytes
    dropped: set[str] = field(default_factory=set)


def decided_states(batches: Batches) -> dict[int, str]:
    """Each task's result state after ``batches`` (in any order): the state of its
    newest result, unless a retry reopened it later."""
    results: dict[int, tuple[int, str]] = {}
    reopened: dict[int, int] = {}
    for _, mrev, data in batches:
        for index, _since in data.get("o", ()):
            reopened[int(index)] = max(reopened.get(int(index), 0), mrev)
        for row in data.get("r", ()):
            index = int(row[0])
            if results.get(index, (0, ""))[0] <= mrev:
                results[index] = (mrev, str(row[1]))
    return {i: state for i, (rev, state) in results.items() if rev > reopened.get(i, 0)}


def attempt_tally(batches: Batches) -> Counter[AttemptKey]:
    """The attempts ``batches`` record, each in its newest form, counted by
    :data:`AttemptKey`."""
    newest: dict[tuple[int, int], tuple[int, str, str, str]] = {}
    for _, mrev, data in batches:
        writer = str(data["node"])
        for index, n, state, _code, reason, _start, _end, *node in data.get("a", ()):
            key = (int(index), int(n))
            if newest.get(key, (0,))[0] <= mrev:
                newest[key] = (mrev, str(node[0]) if node else writer, str(state), reason or "")
    tally: Counter[AttemptKey] = Counter()
    for (index, n), (_, node, state, reason) in newest.items():
        before = newest.get((index, n - 1))
        tally[(node, state, reason, before[3] if before else "")] += 1
    return tally


def pack(params: list[dict[str, Any]], batches: Batches) -> bytes:
    """A block's value and batches, compressed (they are repetitive: about 30 bytes a
    task for trivial tasks)."""
    return zlib.compress(json.dumps([params, batches], separators=(",", ":")).encode(), 1)


def unpack(packed: bytes) -> tuple[list[dict[str, Any]], Batches]:
    params, batches = json.loads(zlib.decompress(packed))
    return params, [(str(key), int(mrev), data) for key, mrev, data in batches]
