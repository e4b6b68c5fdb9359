"""Parse and format byte sizes: ``"6GiB"``, ``"500MB"``, ``"40%"``."""

from __future__ import annotations

import math
import re

from autoremat._core.errors import BudgetError, whole

__all__ = ["format_bytes", "format_flops", "parse_budget", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, what: str = "size") -> int:
    """Parse a byte count: an int, or a string such as ``"6GiB"``, ``"500MB"``, ``"1.5G"``.

    Example:
        >>> parse_size("1.5KiB")
        1536
    """
    if isinstance(value, bool):
        raise BudgetError(f"{what} must be bytes or a size string like '6GiB', got {value!r}")
    count = whole(value)  # numpy's integers too
    if count is not None:
        value = count
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise BudgetError(f"{what} must be a finite number of bytes, got {value!r}")
        if value < 0:
            raise BudgetError(f"{what} must not be negative, got {value!r}")
        _at_least_a_byte(value, value, what)
        return int(value)
    if not isinstance(value, str):
        raise BudgetError(f"{what} must be bytes or a size string like '6GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise BudgetError(
            f"cannot read {what} {value!r}: use bytes (an int) or a number with one of the "
            f"units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '6GiB', '500MB')"
        )
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise BudgetError(f"{what} {value!r} is too large to be a number of bytes")
    _at_least_a_byte(size, value, what)  # '0.5' as 0.5 is
    return int(size)


def _at_least_a_byte(size: float, value: object, what: str) -> None:
    """Refuse a size between 0 and 1 byte (``value`` as given): for a budget, likely a
    share meant as a percentage."""
    if 0 < size < 1:
        share = f"; for a share of the unplanned peak write '{size * 100:g}%'" \
            if what == "budget" else ""
        raise BudgetError(f"{what} {value!r} is less than one byte: a number is a count of "
                          f"bytes{share}")


def parse_budget(budget: int | float | str, reference_bytes: int) -> int:
    """Turn a budget into bytes; a percentage is taken of ``reference_bytes``.

    Example:
        >>> parse_budget("50%", 1000)
        500
    """
    if isinstance(budget, str) and budget.strip().endswith("%"):
        text = budget.strip()[:-1]
        try:
            percent = float(text)
        except ValueError:
            raise BudgetError(
                f"cannot read budget {budget!r}: expected a number before '%'"
            ) from None
        if not (math.isfinite(percent) and 0 < percent <= 1000):
            raise BudgetError(f"budget {budget!r} must be a percentage above 0%, e.g. '50%'")
        return int(reference_bytes * percent / 100)
    return parse_size(budget, what="budget")


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(1536) == '1.50 KiB'``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n:.2f} TiB"  # unreachable; keeps type checkers content


def format_flops(n: float, unit: str = "") -> str:
    """A FLOP count with a K/M/G/T/P prefix and ``unit`` after it.

    Example:
        >>> format_flops(2_500_000, "FLOP"), format_flops(12, "FLOPs"), format_flops(3e12)
        ('2.50 MFLOP', '12 FLOPs', '3.00 T')
    """
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
