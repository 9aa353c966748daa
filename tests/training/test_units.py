"""Parameter counts in human units: a 39k-parameter model is "39.1k", not "0.000 B"."""

from __future__ import annotations

import pytest

from cpcompose.training.units import human_count


@pytest.mark.parametrize("n, text", [(7, "7"), (999, "999"), (39_104, "39.1k"), (1_234_567, "1.23M"),
                                     (8_030_261_248, "8.03B"), (123_456_789_012, "123B"), (2 * 10**12, "2.00T")])
def test_human_count(n: int, text: str) -> None:
    assert human_count(n) == text
