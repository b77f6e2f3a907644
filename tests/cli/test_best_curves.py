"""How `hypermesh best` draws a trial's curve: the sparkline, the first/best/last summary,
the plain lines and the rich table, against tables of values (pure; the end-to-end runs
are in test_compare.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hypermesh.cli.ml import CURVE_WIDTH, plain_lines, print_table, sparkline
from hypermesh.state.search import curve_summary


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([], ""),
        ([3.0], "▄"),
        ([1.0, 1.0, 1.0], "▄▄▄"),  # flat: no rise or fall to show
        ([0.0, 7.0], "▁█"),
        ([7.0, 0.0], "█▁"),
        ([float(i) for i in range(8)], "▁▂▃▄▅▆▇█"),
        ([8.0, 4.0, 8 / 3, 2.0], "█▃▂▁"),  # a falling loss
        ([-1.0, 1.0, 0.0], "▁█▅"),  # 0 is half way: rounds to the 5th block
    ],
)
def test_sparkline_maps_the_lowest_value_to_the_lowest_block(values: list[float],
                                                            line: str) -> None:
    assert sparkline(values) == line


def test_a_long_curve_is_averaged_into_the_width() -> None:
    rising = [float(i) for i in range(100)]
    line = sparkline(rising)
    assert len(line) == CURVE_WIDTH and line[0] == "▁" and line[-1] == "█"
    assert list(line) == sorted(line)  # still rising, never a step down
    assert sparkline([0.0] * 50 + [1.0] * 50, width=4) == "▁▁██"


def test_curve_summary_picks_the_best_by_goal() -> None:
    curve = [[0, 3.0], [1, 1.0], [2, 2.0]]
    assert curve_summary(curve, "minimize") == {"first": 3.0, "best": 1.0, "last": 2.0,
                                                "steps": 3}
    assert curve_summary(curve, "maximize")["best"] == 3.0
    assert curve_summary([], "minimize") == {"first": None, "best": None, "last": None,
                                             "steps": 0}


def _row(rank: int | None, state: str, value: float | None, curve: list[list[float]],
         **params: Any) -> dict[str, Any]:
    return {"rank": rank, "task": f"wf-1.sweep.{len(params)}", "experiment": "sweep",
            "metric": "loss", "goal": "minimize", "value": value, "params": params,
            "state": state, "curve": curve}


ROWS = [
    _row(1, "complete", 0.25, [[0, 1.0], [1, 0.5], [2, 0.25]], lr=0.1),
    _row(None, "pruned", 0.9, [[0, 1.0], [1, 0.9]], lr=0.5, bs=64),
    _row(None, "running", None, []),
]


def test_plain_lines_mark_trials_that_did_not_complete() -> None:
    lines = plain_lines(ROWS)
    assert lines[0].split() == ["1", "loss=0.25", "wf-1.sweep.1", "█▃▁", "first=1",
                                "best=0.25", "last=0.25", "steps=3", "lr=0.1"]
    assert lines[1].split()[:4] == ["pruned", "loss=0.9", "wf-1.sweep.2", "█▁"]
    assert lines[2].split() == ["running", "loss=-", "wf-1.sweep.0", "-", "first=-", "best=-",
                                "last=-", "steps=0"]
    assert len({line.index("loss=") for line in lines}) == 1  # the rank column is aligned


def test_the_rich_table_shows_the_curves_and_the_states(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    print_table(ROWS)
    out = capsys.readouterr().out
    assert "wf-1 sweep: loss (minimize)" in out
    assert "█▃▁" in out and "pruned" in out and "running" in out and "bs=64" in out
