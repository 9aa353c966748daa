"""scripts/gpu_longest.py, the lent GPU's longest-sequence check, in its CPU toy mode: one real run of the trainer and
one rehearsal at the fixed length always happen; the bisection of real runs stops at the time budget and says so."""

from __future__ import annotations

import json
from pathlib import Path

from cpcompose.config import load_config
from cpcompose.training.memory.longest_sequence import with_length
from cpcompose.training.memory.plan import plan_memory
from tests.support.scripts import load_script



def _script():  # noqa: ANN202
    return load_script("gpu_longest")


def test_the_toy_mode_measures_plans_and_rehearses_the_fixed_length(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "toy.json"
    assert _script().main(["--cpu-toy", "--time-budget", "0", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    fixed = got["fixed"]
    assert fixed["ran"] and fixed["reserved"] > 0 and fixed["seq_len"] == 1024
    # the rehearsal ran (torch's tracker on fake tensors) and its device figure adds the plan's CUDA process and
    # allocator slack to the tracker's peak; the CUDA plan's tensors are those of the same config
    config = with_length(load_config(got["args"]), 1024)
    plan = plan_memory(config, 1, device_type="cuda")
    assert fixed["cuda_plan_tensors"] == plan.total - plan.part("process") - plan.part("allocator slack")
    assert fixed["rehearsal_peak"] == fixed["tracked"] + plan.part("process") + plan.part("allocator slack")
    assert fixed["tracked"] > 0
    assert got["plan_longest"] > fixed["seq_len"] and got["plan_longest"] % 1024 == 0
    assert got["measured_longest"] == {"longest": None, "complete": False, "ran": [], "failed": [],
                                       "shortest_failed": None}  # no time left: no run, and it says so
    assert "| longest sequence | n/a |" in capsys.readouterr().out


class _Runs:
    """Runs that fit up to `limit` tokens, with time for `runs` of them."""

    def __init__(self, script, limit: int, runs: int) -> None:  # noqa: ANN001
        self.script, self.limit, self.runs = script, limit, runs

    def trial(self, seq_len: int) -> dict:
        if self.runs == 0:
            raise self.script.OutOfTime
        self.runs -= 1
        return {"ran": seq_len <= self.limit}

    def fits(self, got: dict) -> bool:
        return got["ran"]


def test_the_bisection_of_real_runs_finds_the_longest_or_the_bracket_it_reached() -> None:
    script = _script()
    done = script.measured_longest(_Runs(script, 37 * 64, runs=100), 64, 30 * 64)
    assert done["longest"] == 37 * 64 and done["complete"] and 38 * 64 in done["failed"]
    cut = script.measured_longest(_Runs(script, 37 * 64, runs=3), 64, 30 * 64)
    assert not cut["complete"] and cut["longest"] == max(cut["ran"]) <= 37 * 64 and len(cut["ran"]) == 3
