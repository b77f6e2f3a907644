"""Human units in recipes and configuration: durations and byte sizes.

Durations
    ``"250ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"`` and compounds such as ``"1h30m"``
    (largest unit first, each unit at most once, no spaces). A plain number (``90``, ``1.5``,
    ``"90"``) is seconds. Units are case-insensitive. The result is a float number of seconds.

Sizes
    A number with an optional unit. Binary units are powers of 1024: ``Ki``/``KiB``,
    ``Mi``/``MiB``, ``Gi``/``GiB``, ``Ti``/``TiB``, ``Pi``/``PiB``. Decimal units are powers
    of 1000, as in Kubernetes: ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``,
    ``P``/``PB``, so ``"1.5G"`` is 1,500,000,000 bytes and ``"16GiB"`` is 16 * 2**30. ``B`` or
    no unit means bytes, and a plain integer is a count of bytes. Units are case-insensitive.
    The result is an int number of bytes (rounded half up when a fraction of a unit does not
    come out to whole bytes; a fractional count of plain bytes is an error). A size is at most
    ``MAX_SIZE`` (1 EiB, 2**60 bytes): more than any machine has, and a bound that keeps a
    size such as ``1e99999999GiB`` from costing time or overflowing.

Both parsers reject negative, infinite and NaN amounts and raise ``UnitError`` with a
message that quotes the bad input.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_UP, Decimal

from hypermesh.errors import FatalError

__all__ = [
    "MAX_SIZE", "UnitError", "format_duration", "format_size", "parse_duration", "parse_size",
]

MAX_SIZE = 2**60
"""The largest size ``parse_size`` accepts: 1 EiB (1024PiB)."""


class UnitError(FatalError, ValueError):
    """A duration or size could not be parsed; the message quotes the input."""


_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PLAIN_NUMBER = re.compile(rf"{_NUMBER}(?:e[-+]?\d+)?", re.IGNORECASE)

# Duration units, largest first: a compound must use them in this order.
_DURATION_UNITS: dict[str, float] = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION_RANK = {unit: rank for rank, unit in enumerate(_DURATION_UNITS)}
_DURATION_PART = re.compile(rf"({_NUMBER})(ms|d|h|m|s)")
_DURATION_FORMS = "use forms like '30s', '5m', '2h', '1h30m', '250ms' or a number of seconds"

_SIZE = re.compile(rf"\s*({_NUMBER}(?:e[-+]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtp", start=1):
    _SIZE_UNITS[_letter] = _SIZE_UNITS[f"{_letter}b"] = 1000**_power
    _SIZE_UNITS[f"{_letter}i"] = _SIZE_UNITS[f"{_letter}ib"] = 1024**_power
_SIZE_FORMS = "use forms like '512MiB', '16GiB', '10GB', '1.5G' or a number of bytes"


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``value``: a number of seconds or a string such as ``"1h30m"``.

    Raises ``UnitError`` for anything else, for negative amounts and for inf/NaN.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UnitError(f"invalid duration {value!r}: {_DURATION_FORMS}")
    if isinstance(value, (int, float)):
        return _checked_seconds(float(value), value)
    text = value.strip().lower()
    if _PLAIN_NUMBER.fullmatch(text):
        return _checked_seconds(float(text), value)
    total = 0.0
    position = 0
    last_rank = -1
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            break
        rank = _DURATION_RANK[match.group(2)]
        if rank <= last_rank:
            raise UnitError(
                f"invalid duration {value!r}: units must go from largest to smallest, "
                "each at most once (e.g. '1h30m')"
            )
        last_rank = rank
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        position = match.end()
    if position == 0 or position != len(text):
        raise UnitError(f"invalid duration {value!r}: {_DURATION_FORMS}")
    return _checked_seconds(total, value)


def _checked_seconds(seconds: float, original: object) -> float:
    if not math.isfinite(seconds):
        raise UnitError(f"invalid duration {original!r}: must be finite")
    if seconds < 0:
        raise UnitError(f"invalid duration {original!r}: must not be negative")
    return seconds


def parse_size(value: str | int | float) -> int:
    """Bytes in ``value``: an integer count of bytes or a string such as ``"16GiB"``.

    Raises ``UnitError`` for unknown units, negative or non-finite amounts, and fractional
    plain byte counts.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UnitError(f"invalid size {value!r}: {_SIZE_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(f"invalid size {value!r}: must not be negative")
        return _checked_size(value, value)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise UnitError(f"invalid size {value!r}: must be a whole, non-negative byte count")
        return _checked_size(value, value)
    match = _SIZE.fullmatch(value)
    if match is None:
        stripped = value.strip()
        if stripped.startswith("-"):
            raise UnitError(f"invalid size {value!r}: must not be negative")
        raise UnitError(f"invalid size {value!r}: {_SIZE_FORMS}")
    unit = match.group(2)
    multiplier = _SIZE_UNITS.get(unit.lower())
    if multiplier is None:
        raise UnitError(f"invalid size {value!r}: unknown unit {unit!r}; {_SIZE_FORMS}")
    number = Decimal(match.group(1))
    if number.adjusted() > 30:  # far beyond MAX_SIZE in any unit; multiplying could overflow
        return _checked_size(MAX_SIZE + 1, value)
    amount = number * multiplier
    whole = amount.to_integral_value(rounding=ROUND_HALF_UP)
    if multiplier == 1 and whole != amount:
        raise UnitError(f"invalid size {value!r}: a byte count must be a whole number")
    return _checked_size(whole, value)


def _checked_size(size: int | float | Decimal, original: object) -> int:
    if size > MAX_SIZE:
        raise UnitError(f"invalid size {original!r}: at most 1 EiB (1024PiB)")
    return int(size)


def format_duration(seconds: float) -> str:
    """A short human form of ``seconds`` that ``parse_duration`` reads back exactly.

    Whole seconds are written with ``d``/``h``/``m``/``s`` parts (``5400`` -> ``"1h30m"``);
    anything else is written as a plain number of seconds (``1.5`` -> ``"1.5"``).
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise UnitError(f"cannot format duration {seconds!r}")
    if not float(seconds).is_integer():
        return repr(float(seconds))
    rest = int(seconds)
    if rest == 0:
        return "0s"
    parts: list[str] = []
    for unit in ("d", "h", "m", "s"):
        count, rest = divmod(rest, int(_DURATION_UNITS[unit]))
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def format_size(size: int) -> str:
    """A short human form of ``size`` bytes that ``parse_size`` reads back exactly.

    Uses the largest binary unit that divides ``size`` evenly (``17179869184`` ->
    ``"16GiB"``), else a plain byte count.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise UnitError(f"cannot format size {size!r}")
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        multiplier = _SIZE_UNITS[unit.lower()]
        if size and size % multiplier == 0:
            return f"{size // multiplier}{unit}"
    return str(size)
