"""Table tests of the timing formulas: each docstring's formula against the code."""

from __future__ import annotations

import math

import pytest

from hypermesh.agent.gossip.config import GossipConfig
from hypermesh.agent.gossip.suspicion import (
    Suspicion,
    expected_confirmations,
    health_scaled,
    lifeguard_timeout,
    probe_deadline,
    push_pull_period,
    retransmit_limit,
    suspicion_bounds,
    suspicion_timeout,
)


@pytest.mark.parametrize(
    ("n", "alpha", "period", "expected"),
    [
        (0, 2.0, 0.5, 1.0),  # log10 floored at 1
        (1, 2.0, 0.5, 1.0),
        (10, 2.0, 0.5, 1.0),
        (100, 2.0, 0.5, 2.0),
        (1000, 2.0, 0.5, 3.0),
        (10_000, 2.0, 0.5, 4.0),
        (1000, 4.0, 1.0, 12.0),  # memberlist's LAN numbers
        (316, 5.0, 0.2, 5.0 * math.log10(316) * 0.2),
    ],
)
def test_suspicion_timeout(n: int, alpha: float, period: float, expected: float) -> None:
    cfg = GossipConfig(protocol_period=period, probe_timeout=period / 4, suspicion_mult=alpha)
    assert suspicion_timeout(n, cfg) == pytest.approx(expected)
    low, high = suspicion_bounds(n, cfg)
    assert (low, high) == pytest.approx((expected, cfg.suspicion_max_mult * expected))


@pytest.mark.parametrize(
    ("period", "probe_timeout", "expected"),
    [
        (1.0, 0.2, 0.6),  # lan: suspect 0.6 s after an unanswered probe, not a period
        (0.5, 0.2, 0.5),  # never beyond the period
        (0.05, 0.02, 0.05),  # local
        (2.0, 0.1, 0.3),
    ],
)
def test_probe_deadline(period: float, probe_timeout: float, expected: float) -> None:
    cfg = GossipConfig(protocol_period=period, probe_timeout=probe_timeout)
    assert probe_deadline(cfg) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("c", "k", "low", "high", "expected"),
    [
        (0, 3, 2.0, 8.0, 8.0),
        (1, 3, 2.0, 8.0, 8.0 - 6.0 * math.log(2) / math.log(4)),  # = 5.0
        (2, 3, 2.0, 8.0, 8.0 - 6.0 * math.log(3) / math.log(4)),
        (3, 3, 2.0, 8.0, 2.0),
        (9, 3, 2.0, 8.0, 2.0),  # never below the minimum
        (0, 0, 2.0, 8.0, 2.0),  # nobody could confirm: the minimum at once
        (5, 4, 3.0, 3.0, 3.0),
    ],
)
def test_lifeguard_timeout(c: int, k: int, low: float, high: float, expected: float) -> None:
    assert lifeguard_timeout(c, k, low, high) == pytest.approx(expected)


def test_lifeguard_timeout_falls_monotonically_from_max_to_min() -> None:
    values = [lifeguard_timeout(c, 5, 1.0, 6.0) for c in range(8)]
    assert values == sorted(values, reverse=True)
    assert values[0] == 6.0 and values[5] == values[7] == 1.0
    assert values[0] - values[1] > values[3] - values[4]  # the first confirmations count most


@pytest.mark.parametrize(
    ("n", "k_cfg", "expected"),
    [(0, 4, 0), (2, 4, 0), (3, 4, 1), (5, 4, 3), (6, 4, 4), (1000, 4, 4), (1000, 0, 0)],
)
def test_expected_confirmations(n: int, k_cfg: int, expected: int) -> None:
    cfg = GossipConfig(suspicion_confirmations=k_cfg)
    assert expected_confirmations(n, cfg) == expected


@pytest.mark.parametrize(
    ("n", "mult", "expected"),
    [
        (0, 4, 0),
        (1, 4, 4),
        (9, 4, 4),
        (10, 4, 8),
        (99, 4, 8),
        (100, 4, 12),
        (1000, 4, 16),
        (9999, 4, 16),
        (10_000, 4, 20),
        (10_000, 3, 15),
    ],
)
def test_retransmit_limit(n: int, mult: int, expected: int) -> None:
    cfg = GossipConfig(retransmit_mult=mult)
    assert retransmit_limit(n, cfg) == expected == mult * math.ceil(math.log10(n + 1))


@pytest.mark.parametrize(
    ("seconds", "score", "expected"), [(0.5, 0, 0.5), (0.5, 1, 1.0), (0.2, 7, 1.6)]
)
def test_health_scaled(seconds: float, score: int, expected: float) -> None:
    assert health_scaled(seconds, score) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("n", "interval", "rows", "expected"),
    [
        (1, 30.0, 64, 30.0),
        (32, 30.0, 64, 30.0),
        (33, 30.0, 64, 60.0),
        (64, 30.0, 64, 60.0),
        (65, 30.0, 64, 60.0),  # past push_pull_rows an exchange no longer grows, nor the period
        (1000, 30.0, 64, 60.0),
        (10_000, 30.0, 64, 60.0),
        (10_000, 0.0, 64, 0.0),
        (1000, 30.0, 32, 30.0),
        (65, 30.0, 10_000, 90.0),  # whole tables (rows >= N): grows like log N, as memberlist
        (1000, 30.0, 10_000, 180.0),
        (10_000, 30.0, 10_000, 300.0),
    ],
)
def test_push_pull_period(n: int, interval: float, rows: int, expected: float) -> None:
    cfg = GossipConfig(push_pull_interval=interval, push_pull_rows=rows)
    assert push_pull_period(n, cfg) == pytest.approx(expected)


def test_suspicion_record_counts_each_independent_confirmer_once() -> None:
    s = Suspicion(start=10.0, accuser="a", k=2, min_timeout=1.0, max_timeout=4.0)
    assert s.deadline() == 14.0 and s.remaining(11.0) == 3.0
    assert not s.confirm("a")  # the accuser is not a confirmation
    assert s.confirm("b") and not s.confirm("b")
    assert s.timeout() == pytest.approx(lifeguard_timeout(1, 2, 1.0, 4.0))
    assert s.confirm("c") and not s.confirm("d")  # k reached: no more needed
    assert s.deadline() == 11.0 and s.remaining(12.0) == -1.0
