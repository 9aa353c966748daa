"""The memory plan's process figure: measured in a fresh interpreter, kept in the per-user cache, one measurer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpcompose.training import footprint

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


_MEASURER = """
import sys, time
from pathlib import Path
from cpcompose.training import footprint
def counted(imports):
    with open(sys.argv[1], "a") as f:
        f.write("measured\\n")
    time.sleep(1.0)
    return 123 * 2**20
footprint._measure_in_a_fresh_interpreter = counted
print(footprint.process_bytes("cpu", ("some.module",)))
"""


def test_ranks_planning_at_once_measure_once(tmp_path: Path) -> None:
    """The ranks of a torchrun job plan at the same moment: one measures (here a stand-in taking 1 s), the
    others wait for its figure instead of each starting an interpreter on the same cores."""
    count = tmp_path / "count"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    ranks = [subprocess.Popen([sys.executable, "-c", _MEASURER, str(count)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [rank.communicate(timeout=90)[0].strip() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == [str(123 * 2**20)] * 2
    assert count.read_text().splitlines() == ["measured"]
    assert sorted(p.name for p in (tmp_path / "cache" / "cpcompose").iterdir()) == ["process-footprint.json"]


def test_a_failed_measurement_is_said_and_the_fallback_used(capfd: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(footprint.sys, "executable", "/bin/false")  # an interpreter that exits 1, says nothing
    assert footprint._measure_in_a_fresh_interpreter(()) == footprint.FALLBACK_CPU_PROCESS_BYTES
    monkeypatch.setattr(footprint.sys, "executable", "/nonexistent/python")
    assert footprint._measure_in_a_fresh_interpreter(()) == footprint.FALLBACK_CPU_PROCESS_BYTES
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all("could not measure a rank's own memory" in line for line in err)
    assert "exit 1" in err[0] and "/nonexistent/python" in err[1]
