"""``hypermesh settings`` against a real etcd: defaults, changes that keep the others,
bad values refused with exit 2, and what agents' mirrors read."""

from __future__ import annotations

import json

import pytest

from hypermesh.errors import UsageError
from hypermesh.state.keyspace import Keyspace
from hypermesh.state.mirror import Mirror
from hypermesh.state.settings import (
    DEFAULT_FLUSH_RATE,
    DEFAULT_MAX_WORKFLOW_TASKS,
    DEFAULT_RETENTION_S,
    DEFAULT_WATCH_ALL,
    MeshSettings,
)
from tests.conftest import Mesh


def test_settings_start_at_the_defaults_and_change_one_at_a_time(mesh: Mesh) -> None:
    assert mesh.hm_json("settings") == {
        "max_workflow_tasks": DEFAULT_MAX_WORKFLOW_TASKS,
        "retention": DEFAULT_RETENTION_S,
        "flush_rate": DEFAULT_FLUSH_RATE,
        "watch_all": DEFAULT_WATCH_ALL,
    }
    mesh.hm("settings", "max-workflow-tasks=5000", check=True)
    shown = mesh.hm_json("settings", "retention=2h")  # the cap set before stays
    assert shown == {"max_workflow_tasks": 5000, "retention": 7200.0,
                     "flush_rate": DEFAULT_FLUSH_RATE, "watch_all": DEFAULT_WATCH_ALL}
    assert mesh.hm_json("settings", "flush-rate=1_000") == shown | {"flush_rate": 1000}
    assert mesh.hm_json("settings") == shown | {"flush_rate": 1000}
    table = mesh.hm("settings", check=True).stdout
    assert "max-workflow-tasks  5000" in table and "retention           2h" in table
    assert "flush-rate          1000" in table
    assert mesh.hm_json("settings", "watch-all=0")["watch_all"] == 0  # every auto node own
    assert "watch-all           0" in mesh.hm("settings", check=True).stdout


@pytest.mark.parametrize(
    ("assignment", "named"),
    [
        ("max-workflow-tasks=0", "max-workflow-tasks must be an integer from 1"),
        ("max-workflow-tasks=lots", "max-workflow-tasks"),
        ("retention=-3d", "retention"),
        ("flush-rate=0", "flush-rate must be an integer from 1"),
        ("flush-rate=1.5", "flush-rate"),
        ("watch-all=-1", "watch-all must be an integer from 0"),
        ("colour=blue", "NAME one of max-workflow-tasks, retention, flush-rate, watch-all"),
        ("retention", "expected NAME=VALUE"),
    ],
)
def test_a_bad_setting_is_refused_and_nothing_changes(
    mesh: Mesh, assignment: str, named: str
) -> None:
    mesh.hm("settings", "retention=1d", check=True)
    result = mesh.hm("settings", "max-workflow-tasks=7", assignment)
    assert result.returncode == 2
    assert named in result.stderr
    assert mesh.hm_json("settings")["max_workflow_tasks"] == DEFAULT_MAX_WORKFLOW_TASKS


def test_the_mirror_reads_the_settings_key() -> None:
    ks = Keyspace("s")
    mirror = Mirror(ks)
    assert mirror.settings == MeshSettings()
    mirror.apply(ks.settings, json.dumps({"max_workflow_tasks": 9, "later": 1}).encode(), 1, 1)
    assert mirror.settings.max_workflow_tasks == 9
    assert mirror.settings.retention == DEFAULT_RETENTION_S
    assert mirror.settings.flush_rate == DEFAULT_FLUSH_RATE
    mirror.apply(ks.settings, json.dumps({"flush_rate": 7}).encode(), 1, 2)
    assert mirror.settings.flush_rate == 7
    mirror.apply(ks.settings, None, 0, 3)
    assert mirror.settings == MeshSettings()
    with pytest.raises(UsageError):
        MeshSettings(max_workflow_tasks=True)
    with pytest.raises(UsageError):
        MeshSettings(flush_rate=True)
