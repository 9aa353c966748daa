"""The longest-sequence search (cpcompose.training.memory.longest_sequence) and scripts/longest_sequence.py's plan mode.

The search is checked against known thresholds from every kind of guess (exact, below, above, none fits, all fit),
counting its calls; the plan's answer at a toy size must fit while one grid unit more must not; the script's
plan-only mode must write a cell that says how it was obtained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.training.memory.longest_sequence import grid_unit, longest, plan_fits, with_length
from cpcompose.training.memory.plan import plan_memory
from tests.support.scripts import load_script

TOY = ["--model.vocab_size=4096", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4",
       "--model.n_kv_heads=2", "--model.ffn_hidden_dim=768", "--parallelism.cp=2", "--training.batch_size=1",
       "--training.mixed_precision=bfloat16", "--training.seq_len=2048"]


@pytest.mark.parametrize("threshold", [0, 1, 7, 100, 1000])
@pytest.mark.parametrize("guess", [0, 1, 50, 100, 5000])
def test_the_search_finds_the_last_length_that_fits_from_any_guess(threshold: int, guess: int) -> None:
    calls: list[int] = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= threshold * 8

    assert longest(fits, 8, guess * 8, limit=2000 * 8) == threshold * 8
    assert all(n % 8 == 0 and 0 < n <= 2000 * 8 for n in calls)
    assert len(calls) <= 2 * 12 + 2  # doubling out from the guess, then bisecting: logarithmic


def test_the_search_stops_at_its_limit_and_refuses_a_bad_unit() -> None:
    assert longest(lambda n: True, 4, 4, limit=40) == 40
    with pytest.raises(ValueError, match="unit must be positive"):
        longest(lambda n: True, 0)


def test_the_plans_answer_fits_and_one_unit_more_does_not() -> None:
    config = load_config(TOY)
    unit = grid_unit(config)
    assert unit == 4 * 512  # zigzag over 2 ranks: 4 chunks of 512 tokens
    budget = plan_memory(with_length(config, 40 * unit), 2, device_type="cuda").total  # a budget that 40 units fit
    best = longest(plan_fits(config, 2, budget), unit, guess=unit)
    assert best >= 40 * unit
    assert plan_memory(with_length(config, best), 2, device_type="cuda").total <= budget
    assert plan_memory(with_length(config, best + unit), 2, device_type="cuda").total > budget


def _script():  # noqa: ANN202
    return load_script("longest_sequence")


def test_the_scripts_plan_mode_writes_each_cell_and_how_it_was_obtained(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "longest.json"
    script = _script()
    assert script.main(["--shape", "llama3-8b", "--gpus", "8", "--options", "d", "--plan-only", "--out", str(out)]) == 0
    assert script.main(["--shape", "llama3-8b", "--gpus", "1", "--options", "f", "--plan-only", "--out", str(out)]) == 0
    cells = {c["gpus"]: c for c in json.loads(out.read_text())["cells"]}
    eight, one = cells[8], cells[1]
    assert eight["how"] == "plan" and eight["longest"] == eight["plan_longest"] > 0
    assert eight["longest"] % eight["grid_unit"] == 0 and eight["grid_unit"] == 16 * 512
    # one GPU: offload_params is FSDP2 over that one rank, the whole model's state on the host
    assert one["how"] == "plan" and one["longest"] == one["plan_longest"] > 0 and one["host_gib"] > 119
    table = capsys.readouterr().out.splitlines()[-2:]
    # the published numbers beside: ALST's, then UPipe's
    assert table[0].startswith("| llama3-8b | 1 |") and "(plan) |" in table[0] and table[0].endswith("| 0.5M |  |")
    assert table[1].startswith("| llama3-8b | 8 |") and "(plan) |  |  | 3.7M | 5.0M |" in table[1]  # (d), no (f)
