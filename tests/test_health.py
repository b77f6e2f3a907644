"""The leader's death watch: table tests of when a node is declared dead."""

from __future__ import annotations

import pytest
from hypermesh.agent.health import DeathWatch


@pytest.mark.parametrize(
    ("failures", "min_silence", "probes", "dead_at"),
    [
        # (ok?, time) probes; dead_at = index of the probe that declares death, or None
        (3, 2.0, [(False, 0.0), (False, 1.0), (False, 2.0)], 2),
        (3, 2.0, [(False, 0.0), (False, 0.5), (False, 1.0), (False, 2.0)], 3),  # too soon at 3rd
        (3, 2.0, [(False, 0.0), (False, 1.0), (True, 2.0), (False, 3.0), (False, 4.0)], None),
        (1, 0.0, [(False, 0.0)], 0),
        (2, 1.0, [(True, 0.0), (False, 1.0), (False, 2.0), (False, 3.0)], 2),
    ],
)
def test_declared_dead_once_after_consecutive_failures(
    failures: int, min_silence: float, probes: list[tuple[bool, float]], dead_at: int | None
) -> None:
    watch = DeathWatch(failures, min_silence)
    verdicts = [watch.observe("n", ok, now) for ok, now in probes]
    assert verdicts == [i == dead_at for i in range(len(probes))]


def test_a_declared_node_is_not_declared_again_until_it_answers() -> None:
    watch = DeathWatch(1, 0.0)
    assert watch.observe("n", False, 0.0)
    assert not watch.observe("n", False, 1.0)
    assert not watch.observe("n", True, 2.0)
    assert watch.observe("n", False, 3.0)


def test_nodes_are_independent_and_can_be_forgotten() -> None:
    watch = DeathWatch(2, 0.0)
    assert not watch.observe("a", False, 0.0)
    assert not watch.observe("b", False, 0.0)
    watch.keep_only({"b"})
    assert not watch.observe("a", False, 1.0)  # a's count started over
    assert watch.observe("b", False, 1.0)


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="failures"):
        DeathWatch(0, 1.0)
    with pytest.raises(ValueError, match="min_silence"):
        DeathWatch(1, -1.0)
