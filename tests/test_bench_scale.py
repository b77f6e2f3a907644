"""scripts/bench_scale.py's ``compare``: the shapes it parses, the order of each pair's
runs and the ratios it reports. (Its runs themselves are benchmarks, not tests.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_scale.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("text", "shape"), [("4x4", (4, 4)), ("32x1", (32, 1)),
                                             ("256X2", (256, 2))])
def test_a_shape_is_agents_by_slots(bench: ModuleType, text: str, shape: tuple[int, int]) -> None:
    assert bench.parse_shape(text) == shape


@pytest.mark.parametrize("text", ["32", "x4", "4x", "4x4x4", "0x1", "4x0", "-1x2", "ax4"])
def test_a_malformed_shape_is_refused_by_name(bench: ModuleType, text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).replace("[", r"\[")):
        bench.parse_shape(text)


def test_the_command_line_refuses_a_bad_shape(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["compare", "--a", "4x4", "--b", "32"])
    assert exc.value.code == 2
    assert "AGENTSxSLOTS" in capsys.readouterr().err
    args = bench.parse_args(["compare", "--a", "4x4", "--b", "32x1", "--pairs", "3"])
    assert (args.a, args.b, args.pairs, args.watch) == ((4, 4), (32, 1), 3, "own")
    with pytest.raises(SystemExit):
        bench.parse_args(["compare", "--a", "4x4", "--b", "32x1", "--pairs", "0"])


def test_the_order_alternates_from_pair_to_pair(bench: ModuleType) -> None:
    assert [bench.pair_order(i) for i in range(4)] == [("a", "b"), ("b", "a")] * 2


def test_ratios_are_b_over_a_per_pair_and_of_the_medians(bench: ModuleType) -> None:
    summary = bench.summarize_pairs([(1.0, 2.0), (0.5, 2.0), (1.0, 1.0)])
    assert summary == {"a_median": 1.0, "b_median": 2.0, "ratio_median": 2.0,
                       "ratio_of_medians": 2.0}
    # The median of the ratios pairs each B with the A it ran beside, not with A's median.
    summary = bench.summarize_pairs([(1.0, 1.5), (2.0, 2.4), (4.0, 4.0)])
    assert summary["ratio_median"] == pytest.approx(1.2)
    assert summary["ratio_of_medians"] == pytest.approx(1.2)
    summary = bench.summarize_pairs([(1.0, 3.0), (3.0, 3.3), (2.0, 2.2)])
    assert summary["ratio_median"] == pytest.approx(1.1)
    assert summary["ratio_of_medians"] == pytest.approx(1.5)
