"""The plan against the budget: refused before launch in one line naming what fits; the dry run's table.

`main()` runs in-process: a refusal returns 2 before any rank starts. Every suggested option is
checked the way the message claims: with it (or them) the same config passes `check_memory`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from cpcompose.config import ConfigError, load_config
from cpcompose.train import main
from cpcompose.training.memory.budget import check_memory, memory_budget, suggestions
from cpcompose.training.memory.plan import GiB

# A 128k vocabulary (Llama 3's) on a small body: the whole logits dominate the peak.
BIG = [
    "--model.vocab_size=128256", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=1",
    "--model.ffn_hidden_dim=896", "--training.batch_size=1", "--training.steps=2", "--training.device=cpu",
    "--lr_scheduler.warmup_steps=1", "--data.num_symbols=48", "--training.loss_chunk_tokens=1024",
]


def _with(args: list[str], flags: str) -> list[str]:
    """`args` plus the flags a suggestion names (`try A B` or `try A or B`: the first alternative)."""
    chosen = flags.removeprefix("try ").removeprefix("together ").split(" or ")[0]
    return args + chosen.split()


def test_an_oversized_run_is_refused_before_launch_with_what_fits(tmp_path: Path, capsys) -> None:
    args = BIG + ["--training.seq_len=16384", "--parallelism.cp=2", "--training.fused_loss=false",
                  "--training.memory_budget_gib=8", f"--job.dump_folder={tmp_path}"]
    assert main(args) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    match = re.fullmatch(r"config error: memory: predicted ([\d.]+) GiB per rank > budget 8\.0 GiB "
                         r"\(training\.memory_budget_gib\); (try .*) \(the parts: --job\.dry_run\)", lines[0])
    assert match and float(match.group(1)) > 8, lines[0]
    assert "--training.fused_loss=true" in match.group(2), lines[0]
    assert "step" not in out.out  # no rank ran
    for alternative in match.group(2).removeprefix("try ").split(" or "):
        check_memory(load_config(args + alternative.split()), 2 * _cp_factor(alternative))  # each one fits


def _cp_factor(flags: str) -> int:
    found = re.search(r"--parallelism\.cp=(\d+)", flags)
    return int(found.group(1)) // 2 if found else 1


def test_when_no_option_alone_fits_the_combination_is_named() -> None:
    args = BIG + ["--training.seq_len=65536", "--training.fused_loss=false", "--training.memory_budget_gib=4"]
    config = load_config(args)
    with pytest.raises(ConfigError) as refused:
        check_memory(config, 1)
    flags = suggestions(config, 1)
    assert str(refused.value).endswith(f"; {flags} (the parts: --job.dry_run)")
    assert flags.startswith("try together ") and flags.count("--") >= 2, flags  # together, not each alone
    check_memory(load_config(_with(args, flags)), _cp_factor(flags) * 2 if "parallelism.cp" in flags else 1)


def test_nothing_fits_says_what_is_left() -> None:
    config = load_config(BIG + ["--training.seq_len=4096", "--training.memory_budget_gib=0.5"])
    assert "shorten training.seq_len or use a smaller model" in suggestions(config, 1)


def test_the_dry_run_prints_the_parts_and_the_verdict(capsys) -> None:
    args = BIG + ["--training.seq_len=16384", "--parallelism.cp=2", "--training.fused_loss=false",
                  "--training.memory_budget_gib=8", "--job.dry_run=true"]
    assert main(args) == 0  # the dry run reports; it does not refuse
    out = capsys.readouterr().out
    assert re.search(r"memory per rank, predicted peak [\d.]+ GiB \(in loss, 8,192 tokens per forward\): DOES NOT "
                     r"FIT the budget of 8\.00 GiB \(training\.memory_budget_gib\); try ", out), out
    for part in ("process", "parameters", "optimizer state", "activations", "loss", "allocator slack"):
        assert re.search(rf"^    {part} +[\d.]+ GiB$", out, re.M), (part, out)
    assert main(args + ["--training.fused_loss=true"]) == 0
    assert "fits the budget of 8.00 GiB" in capsys.readouterr().out


def test_the_budget_is_the_option_or_this_host_s_share(monkeypatch) -> None:
    config = load_config(BIG + ["--training.seq_len=64"])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    two = memory_budget(config, 2)
    assert two.source.endswith("/ 2 ranks") and two.bytes is not None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: the ranks of this host, not of the job
    assert memory_budget(config, 8).bytes == pytest.approx(two.bytes / 2, abs=1)
    explicit = copy.deepcopy(config)
    explicit.training.memory_budget_gib = 3.5
    assert memory_budget(explicit, 8).bytes == int(3.5 * GiB)
