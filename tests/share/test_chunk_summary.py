"""The versioned chunk set: deltas in order, gaps, folding, digests and snapshots."""

from __future__ import annotations

import json
import random

import pytest

from hypermesh.agent.share.summary import ChunkDelta, ChunkSummary, DeltaResult


def test_add_and_remove_produce_numbered_deltas_and_no_op_changes_none() -> None:
    s = ChunkSummary()
    assert s.add(["c2", "c1"]) == ChunkDelta(0, 1, added=("c1", "c2"))
    assert s.add(["c1"]) is None
    assert s.remove(["c9"]) is None
    assert s.remove(["c1", "c9"]) == ChunkDelta(1, 2, removed=("c1",))
    assert s.version == 2 and s.chunks() == {"c2"} and "c2" in s and len(s) == 1


def test_a_replica_applies_deltas_in_order_and_reports_duplicates_and_gaps() -> None:
    owner, replica = ChunkSummary(), ChunkSummary()
    d1 = owner.add(["a", "b"])
    d2 = owner.remove(["a"])
    d3 = owner.add(["c"])
    assert d1 and d2 and d3
    assert replica.apply_delta(d1) is DeltaResult.APPLIED
    assert replica.apply_delta(d1) is DeltaResult.DUPLICATE
    assert replica.apply_delta(d3) is DeltaResult.GAP
    assert replica.version == 1 and replica.chunks() == {"a", "b"}
    assert replica.apply_delta(d2) is DeltaResult.APPLIED
    assert replica.apply_delta(d3) is DeltaResult.APPLIED
    assert replica.chunks() == owner.chunks() and replica.digest() == owner.digest()


def test_digest_is_stable_and_covers_the_version_and_the_set() -> None:
    a, b = ChunkSummary(), ChunkSummary()
    a.add(["x", "y"])
    b.add(["y"])
    assert a.digest() != b.digest()
    b.add(["x"])  # same set, but version 2
    assert a.chunks() == b.chunks() and a.digest() != b.digest()
    c = ChunkSummary.from_snapshot({"v": 2, "c": ["y", "x"]})
    assert c.digest() == b.digest()
    assert len(c.digest()) == 16 and int(c.digest(), 16) >= 0


def test_deltas_since_folds_the_log_and_gives_up_beyond_it() -> None:
    s = ChunkSummary(max_log=3)
    s.add(["a"])  # v1
    s.add(["b"])  # v2
    s.remove(["a"])  # v3
    s.add(["a", "c"])  # v4
    s.remove(["c"])  # v5
    assert s.deltas_since(5) == ChunkDelta(5, 5)
    assert s.deltas_since(2) == ChunkDelta(2, 5)  # a removed, then added back; c came and went
    assert s.deltas_since(3) == ChunkDelta(3, 5, added=("a",))
    assert s.deltas_since(1) is None  # the log holds deltas from v2 on
    assert s.deltas_since(6) is None


def test_folded_deltas_bring_any_replica_in_the_window_up_to_date() -> None:
    rng = random.Random(5)
    owner = ChunkSummary(max_log=200)
    history = [ChunkSummary.from_snapshot(owner.snapshot())]
    for _ in range(150):
        ids = [f"c{rng.randrange(20)}" for _ in range(rng.randrange(1, 4))]
        delta = owner.add(ids) if rng.random() < 0.6 else owner.remove(ids)
        if delta:
            history.append(ChunkSummary.from_snapshot(owner.snapshot()))
    for replica in history:
        delta = owner.deltas_since(replica.version)
        assert delta is not None
        wire = ChunkDelta.from_json(json.loads(json.dumps(delta.to_json())))
        result = replica.apply_delta(wire)
        assert result is (
            DeltaResult.DUPLICATE if wire.base == wire.version else DeltaResult.APPLIED
        )
        assert replica.digest() == owner.digest()


def test_snapshot_round_trip_replaces_a_replica() -> None:
    owner = ChunkSummary()
    owner.add(["k1", "k2"])
    owner.remove(["k1"])
    replica = ChunkSummary()
    replica.add(["junk"])
    replica.load_snapshot(json.loads(json.dumps(owner.snapshot())))
    assert replica.version == 2 and replica.chunks() == {"k2"}
    assert replica.digest() == owner.digest()
    assert replica.deltas_since(1) is None  # a replica has no log to serve


@pytest.mark.parametrize(
    "bad",
    [
        {"b": 2, "v": 1},
        {"b": "0", "v": 1},
        {"b": 0, "v": 1, "a": [""]},
        {"b": 0, "v": 1, "r": [3]},
        {"b": -1, "v": 0},
        {"b": True, "v": 1},
    ],
)
def test_malformed_deltas_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ChunkDelta.from_json(bad)


def test_malformed_ids_and_snapshots_are_rejected() -> None:
    s = ChunkSummary()
    with pytest.raises(ValueError, match="collection"):
        s.add("abc")
    with pytest.raises(ValueError, match="non-empty"):
        s.add([""])
    with pytest.raises(ValueError, match="version"):
        s.load_snapshot({"v": -1, "c": []})
    with pytest.raises(ValueError):
        ChunkSummary(max_log=-1)
