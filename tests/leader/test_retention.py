"""The leader's housekeeping decisions, pure: which workflows are due for deletion
(``agent/leader/retention.py``), which revision to compact to and whether a member is
worth defragmenting (``agent/leader/compaction.py``), and when etcd nears its quota
(``hypermesh/state/etcd_size.py``)."""

from __future__ import annotations

import pytest

from hypermesh.agent.leader.compaction import (
    HousekeepingConfig,
    MiB,
    RevisionLog,
    with_test_timings,
    worth_defragmenting,
)
from hypermesh.agent.leader.retention import Ended, Retention, due, leftover_wids
from hypermesh.state.etcd_size import DbSize, parse_quota, quota_warning

DAY = 86400.0


# ---------------------------------------------------------------- retention
@pytest.mark.parametrize(
    ("ended", "now", "retention", "expected"),
    [
        ({"a": 0.0, "b": 50.0}, 100.0, 0.0, []),  # 0 keeps every workflow
        ({"a": 0.0, "b": 50.0}, 100.0, 100.0, ["a"]),  # exactly the retention: due
        ({"a": 0.0, "b": 50.0}, 100.0, 100.5, []),
        ({"a": 10.0, "b": 0.0, "c": 99.0}, 100.0, 50.0, ["b", "a"]),  # longest ago first
        ({}, 100.0, 1.0, []),
    ],
)
def test_due_counts_from_the_end(
    ended: dict[str, float], now: float, retention: float, expected: list[str]
) -> None:
    assert due(ended, now, retention) == expected


def test_a_state_without_its_end_counts_from_when_the_leader_first_saw_it() -> None:
    r = Retention()
    old = {"old": Ended("succeeded", None, 5), "new": Ended("failed", 1000.0, 6)}
    assert r.due(old, now=1000.0, retention=DAY) == []  # "old" first seen now
    assert r.due(old, now=1000.0 + DAY - 1, retention=DAY) == []
    assert r.due(old, now=1000.0 + DAY, retention=DAY) == ["new", "old"]
    # Gone from the states (deleted, or reopened): forgotten, so seen afresh if it ends again.
    assert r.due({}, now=1000.0 + DAY, retention=DAY) == []
    assert r.due(old, now=2000.0 + DAY, retention=DAY) == ["new"]


def test_leftovers_are_due_after_the_grace_and_forgotten_once_gone() -> None:
    assert leftover_wids({"a", "b"}, ["a", "c", "c", "d"]) == {"c", "d"}
    r = Retention()
    assert r.leftovers_due({"c", "d"}, now=0.0, grace=10.0) == []
    assert r.leftovers_due({"c"}, now=5.0, grace=10.0) == []  # d purged by someone else
    assert r.leftovers_due({"c", "d"}, now=10.0, grace=10.0) == ["c"]  # d seen afresh at 10
    assert r.leftovers_due({"c", "d"}, now=20.0, grace=10.0) == ["c", "d"]


# ---------------------------------------------------------------- compaction
def test_compaction_goes_to_a_revision_seen_keep_seconds_ago() -> None:
    cfg = HousekeepingConfig(compact_keep_s=60.0, compact_every_s=30.0)
    log = RevisionLog()
    for t, rev in [(0.0, 100), (20.0, 150), (40.0, 150), (50.0, 180), (70.0, 200)]:
        log.record(t, rev)
    assert log.target(59.0, cfg) is None  # nothing seen 60 s ago yet
    assert log.target(60.0, cfg) == 100
    assert log.target(85.0, cfg) == 150  # the newest seen at least 60 s ago (at 20 s)
    log.done(85.0, 150)
    assert log.target(112.0, cfg) is None  # compacted 27 s ago
    assert log.target(115.0, cfg) == 180
    log.done(115.0, 180)
    assert log.target(200.0, cfg) == 200
    log.done(200.0, 200)
    assert log.target(400.0, cfg) is None  # nothing new since the last compaction


def test_the_leader_s_own_record_of_a_compaction_is_not_compacted_again() -> None:
    cfg = HousekeepingConfig(compact_keep_s=60.0, compact_every_s=30.0)
    log = RevisionLog()
    log.record(0.0, 100)
    assert log.target(60.0, cfg) == 100
    log.done(60.0, 100)
    log.passed(101)  # the record of that compaction, written at 101
    log.record(61.0, 101)
    assert log.target(500.0, cfg) is None  # an idle mesh: nothing more to compact
    log.record(510.0, 102)  # a change of the mesh's own
    assert log.target(570.0, cfg) == 102


def test_test_timings_replace_the_preset_s_and_only_timings() -> None:
    cfg = with_test_timings(HousekeepingConfig.local(), "compact_keep_s=3, defrag_every_s=4")
    assert (cfg.compact_keep_s, cfg.defrag_every_s) == (3.0, 4.0)
    assert cfg.defrag_min_free == HousekeepingConfig.local().defrag_min_free
    assert with_test_timings(cfg, None) is cfg
    with pytest.raises(ValueError, match="defrag_min_free"):
        with_test_timings(cfg, "defrag_min_free=0")
    with pytest.raises(ValueError, match="compact_keep_s"):
        with_test_timings(cfg, "compact_keep_s=0")


def test_a_new_leader_compacts_only_after_keeping_its_own_history() -> None:
    cfg = HousekeepingConfig.local()
    log = RevisionLog()
    log.record(1000.0, 5_000)
    assert log.target(1000.0 + cfg.compact_keep_s - 0.1, cfg) is None
    assert log.target(1000.0 + cfg.compact_keep_s, cfg) == 5_000


@pytest.mark.parametrize(
    ("size", "in_use", "worth"),
    [
        (1024 * MiB, 100 * MiB, True),
        (1024 * MiB, 600 * MiB, False),  # less than half of it free
        (100 * MiB, 40 * MiB, False),  # half free, but only 60 MiB: not worth a pause
        (200 * MiB, 100 * MiB, True),
        (0, 0, False),
    ],
)
def test_worth_defragmenting(size: int, in_use: int, worth: bool) -> None:
    assert worth_defragmenting(size, in_use, HousekeepingConfig.lan()) is worth


def test_the_config_names_what_is_out_of_range() -> None:
    with pytest.raises(ValueError, match="compact_keep_s"):
        HousekeepingConfig(compact_keep_s=0.0)
    with pytest.raises(ValueError, match="defrag_free_ratio"):
        HousekeepingConfig(defrag_free_ratio=1.0)
    local, lan = HousekeepingConfig.local(), HousekeepingConfig.lan()
    assert local.check_s < lan.check_s and local.compact_keep_s < lan.compact_keep_s


# ---------------------------------------------------------------- quota
def test_the_quota_is_read_from_the_metrics_page() -> None:
    page = (b"# HELP etcd_server_quota_backend_bytes Current backend storage quota size.\n"
            b"# TYPE etcd_server_quota_backend_bytes gauge\n"
            b"etcd_server_quota_backend_bytes 2.147483648e+09\n")
    assert parse_quota(page) == 2 * 1024**3
    assert parse_quota(b"etcd_server_quota_backend_bytes_other 5\n") is None


@pytest.mark.parametrize(
    ("size", "warned"), [(0, False), (799, False), (800, True), (1000, True), (1200, True)]
)
def test_a_warning_from_80_percent_of_the_quota(size: int, warned: bool) -> None:
    warning = quota_warning(DbSize("h:1", size, size // 2, 1000))
    assert (warning is not None) is warned
    if warning:
        assert "hypermesh delete" in warning and "%" in warning
