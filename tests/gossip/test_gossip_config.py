"""The gossip configuration: presets, validation with the allowed range named."""

from __future__ import annotations

import dataclasses

import pytest

from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.suspicion import suspicion_timeout


def test_lan_is_the_default_and_overrides_keep_the_rest() -> None:
    assert GossipConfig.lan() == GossipConfig()
    cfg = GossipConfig.lan(indirect_checks=5)
    assert cfg.indirect_checks == 5 and cfg.protocol_period == GossipConfig().protocol_period


def test_lan_timings_fit_a_two_to_four_second_detection_in_a_small_mesh() -> None:
    cfg = GossipConfig.lan()
    # at most one probe a second: gossip is most of an idle agent's CPU
    assert 0.5 <= cfg.protocol_period <= 1.0
    assert cfg.probe_timeout < cfg.protocol_period / 2
    # probe, one period to give up, then at least the shortest suspicion timeout
    assert cfg.protocol_period + suspicion_timeout(10, cfg) <= 2.0


def test_local_is_faster_than_lan_for_every_timer() -> None:
    lan, local = GossipConfig.lan(), GossipConfig.local()
    for name in (
        "protocol_period",
        "probe_timeout",
        "gossip_interval",
        "push_pull_interval",
        "late_tick_threshold",
        "reconnect_interval",
    ):
        assert getattr(local, name) < getattr(lan, name), name
    assert GossipConfig.local(indirect_checks=1).indirect_checks == 1


def test_describe_lists_every_field() -> None:
    d = GossipConfig.lan().describe()
    assert (
        d["protocol_period"] == 1.0
        and "max_piggyback" in d
        and len(d) == len(dataclasses.fields(GossipConfig))
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("protocol_period", 0.0, r"protocol_period must be in \[0.001, 60\], got 0"),
        ("probe_timeout", 0.95, r"probe_timeout must be in \[0.0001, 0.9\], got 0.95"),
        ("indirect_checks", -1, r"indirect_checks must be in \[0, 16\]"),
        ("indirect_checks", 2.5, r"indirect_checks must be an integer in \[0, 16\]"),
        ("suspicion_mult", float("nan"), r"suspicion_mult must be a number"),
        ("suspicion_max_mult", 0.5, r"suspicion_max_mult must be in \[1, 100\]"),
        ("retransmit_mult", 0, r"retransmit_mult must be in \[1, 100\]"),
        ("gossip_fanout", True, r"gossip_fanout must be an integer"),
        ("max_piggyback", 0, r"max_piggyback must be in \[1, 1024\]"),
        ("push_pull_interval", -1.0, r"push_pull_interval must be in \[0, 86400\]"),
        ("push_pull_rows", 3, r"push_pull_rows must be in \[4, 1e\+07\]"),
        ("push_pull_rows", 64.0, r"push_pull_rows must be an integer"),
        ("awareness_max", 65, r"awareness_max must be in \[0, 64\]"),
        ("refused_quorum", 7, r"refused_quorum must be in \[0, 6\]"),
        ("max_meta_bytes", 8, r"max_meta_bytes must be in \[16, 1.04858e\+06\]"),
        ("late_tick_threshold", "1", r"late_tick_threshold must be a number"),
        ("quiet_meta", {"running"}, r"quiet_meta must be a frozenset of meta keys"),
        ("quiet_meta", frozenset({1}), r"quiet_meta must be a frozenset of meta keys"),
    ],
)
def test_invalid_values_name_the_allowed_range(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GossipConfig(**{field: value})  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    cfg = GossipConfig()
    with pytest.raises(AttributeError):
        cfg.protocol_period = 1.0  # type: ignore[misc]
