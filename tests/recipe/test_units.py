"""Table tests for duration and size parsing (hypermesh.recipe.units)."""

from __future__ import annotations

import math

import pytest

from hypermesh.errors import FatalError
from hypermesh.recipe.units import (
    UnitError,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1d2h3m4s", 86400.0 + 7200.0 + 180.0 + 4.0),
        ("250ms", 0.25),
        ("1m30s500ms", 90.5),
        ("1.5h", 5400.0),
        ("90", 90.0),
        ("2.5", 2.5),
        (" 45s ", 45.0),
        ("10M", 600.0),
        ("0", 0.0),
        (90, 90.0),
        (1.25, 1.25),
    ],
)
def test_parse_duration(text: str | int | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)
    assert isinstance(parse_duration(text), float)


@pytest.mark.parametrize(
    "bad",
    ["", "abc", "5x", "1h30", "30m1h", "1h1h", "-5s", "-3", "1 h", "h", "inf", "nan", "5mm"],
)
def test_parse_duration_rejects_with_the_input_named(bad: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_duration(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [-1, -0.5, math.inf, math.nan, True, None, [1]])
def test_parse_duration_rejects_bad_numbers(bad: object) -> None:
    with pytest.raises(UnitError):
        parse_duration(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("16GiB", 16 * 2**30),
        ("512MiB", 512 * 2**20),
        ("10GB", 10 * 10**9),
        ("1.5G", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("2Ki", 2048),
        ("1KB", 1000),
        ("1k", 1000),
        ("3TiB", 3 * 2**40),
        ("1PB", 10**15),
        ("100B", 100),
        ("100", 100),
        ("16 gib", 16 * 2**30),
        ("1e9", 10**9),
        ("0.5KiB", 512),
        (4096, 4096),
        (4096.0, 4096),
        (0, 0),
    ],
)
def test_parse_size(text: str | int | float, size: int) -> None:
    assert parse_size(text) == size
    assert type(parse_size(text)) is int


@pytest.mark.parametrize(
    "bad", ["", "GiB", "16XB", "abc", "-1GiB", "1.5", "1.5B", "12 34", "1..5G", "16 G i B"]
)
def test_parse_size_rejects_with_the_input_named(bad: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [-1, 1.5, math.inf, math.nan, False, None])
def test_parse_size_rejects_bad_numbers(bad: object) -> None:
    with pytest.raises(UnitError):
        parse_size(bad)  # type: ignore[arg-type]


def test_unit_error_is_fatal_and_a_value_error() -> None:
    with pytest.raises(FatalError):
        parse_size("lots")
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (30, "30s"), (5400, "1h30m"), (90061, "1d1h1m1s"), (1.5, "1.5")],
)
def test_format_duration_reads_back(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("size", "text"), [(0, "0"), (1000, "1000"), (2048, "2KiB"), (16 * 2**30, "16GiB")]
)
def test_format_size_reads_back(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size
