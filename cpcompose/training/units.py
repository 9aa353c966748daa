"""Counts in the units a reader takes in at a glance: 39k, 1.2M, 8.03B (not "0.000 B")."""

from __future__ import annotations

__all__ = ["human_count"]

_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def human_count(n: int) -> str:
    """`n` with three significant digits and a k / M / B / T suffix (`39_104` -> "39.1k"); below 1000 as is."""
    for size, unit in _UNITS:
        if abs(n) >= size:
            value = n / size
            digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
            return f"{value:.{digits}f}{unit}"
    return str(n)
