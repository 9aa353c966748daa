"""Ranks beyond the machine's cores: the banner warns (8 ranks on 2 cores started without a word before)."""

from __future__ import annotations

from cpcompose.config import load_config
from cpcompose.training.memory.resources import oversubscription_warning, usable_cores


def test_more_cpu_ranks_than_cores_are_warned_about() -> None:
    config = load_config(["--training.device=cpu"])
    warning = oversubscription_warning(config, 8, 2)
    assert warning is not None and warning.startswith("warning: 8 ranks on 2 CPU cores") and "at most 2 ranks" in \
        warning, warning
    assert "\n" not in warning
    assert oversubscription_warning(config, 2, 2) is None
    assert oversubscription_warning(load_config(["--training.device=cuda"]), 8, 2) is None  # GPU ranks: no warning
    assert usable_cores() >= 1
