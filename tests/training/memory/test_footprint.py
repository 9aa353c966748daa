"""The memory plan's process figure: measured in a fresh interpreter, kept in the per-user cache, one measurer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from cpcompose.training.memory import footprint


def test_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    footprint.process_bytes.cache_clear()
    measured = footprint.process_bytes("cpu", ())
    # A rank is at least an interpreter with torch's libraries (well over 100 MiB) and, at this size, far from
    # several GiB; anything outside is a wrong unit or a wrong field, not a different machine.
    assert 100 * 2**20 < measured < 4 * 2**30
    assert measured != footprint.FALLBACK_CPU_PROCESS_BYTES
    entries = json.loads((tmp_path / "cpcompose" / "process-footprint.json").read_text())
    assert list(entries.values()) == [measured]
    assert sorted(p.name for p in (tmp_path / "cpcompose").iterdir()) == ["process-footprint.json"]

    footprint.process_bytes.cache_clear()

    def not_again(*_: object) -> int:
        raise AssertionError("measured again although the cache holds the figure")

    monkeypatch.setattr(footprint, "_measure_in_a_fresh_interpreter", not_again)
    assert footprint.process_bytes("cpu", ()) == measured
    footprint.process_bytes.cache_clear()


def test_ranks_planning_at_once_measure_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a torchrun job plan at the same moment: one measures (here a stand-in taking 0.5 s), the
    others wait for its figure instead of each starting an interpreter on the same cores. Threads stand in for the
    ranks: each opens the cache folder itself, and `flock` excludes separate opens as it excludes processes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def stand_in(imports: tuple[str, ...]) -> int:
        measured.append(imports)
        time.sleep(0.5)
        return 123 * 2**20

    monkeypatch.setattr(footprint, "_measure_in_a_fresh_interpreter", stand_in)
    got: list[int] = []
    ranks = [threading.Thread(target=lambda: got.append(footprint.process_bytes.__wrapped__("cpu", ("a.module",))))
             for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=30)
    assert got == [123 * 2**20] * 3 and measured == [("a.module",)]
    assert sorted(p.name for p in (tmp_path / "cpcompose").iterdir()) == ["process-footprint.json"]


def test_a_failed_measurement_is_said_and_the_fallback_used(capfd: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(footprint.sys, "executable", "/bin/false")  # an interpreter that exits 1, says nothing
    assert footprint._measure_in_a_fresh_interpreter(()) == footprint.FALLBACK_CPU_PROCESS_BYTES
    monkeypatch.setattr(footprint.sys, "executable", "/nonexistent/python")
    assert footprint._measure_in_a_fresh_interpreter(()) == footprint.FALLBACK_CPU_PROCESS_BYTES
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all("could not measure a rank's own memory" in line for line in err)
    assert "exit 1" in err[0] and "/nonexistent/python" in err[1]
