"""Errors before launch: everything checkable is checked in the launching process, in one line.

`main()` is called in-process: it returns the exit code, and on these errors it
must return 2 before any rank starts (the old code started the ranks and failed in
each with a traceback, or failed at the first save).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpcompose.config import ConfigError, load_config
from cpcompose.train import main
from cpcompose.training.launcher.local import launch_local
from cpcompose.training.memory.resources import ALLOCATOR_VARIABLES, allocator_warning
from tests.support.trainer import TINY, run

TWO = TINY + ["--parallelism.cp=2", "--training.steps=2"]


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    binary = tmp / "data.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    text = tmp / "ok.txt"
    text.write_text("hello world " * 100)
    not_a_dir = tmp / "file"
    not_a_dir.write_text("x")
    cases = [
        (["--comm.timeout_s=inf"], "comm.timeout_s"),
        (["--optimizer.lr=nan"], "optimizer.lr"),
        (["--data.source=text", f"--data.path={tmp / 'missing.txt'}", "--model.vocab_size=300"], "data.path"),
        (["--data.source=text", f"--data.path={binary}", "--model.vocab_size=300"], "data.path"),
        (["--data.source=text", f"--data.path={text}", "--model.vocab_size=200"], "model.vocab_size"),
        ([f"--data.path={text}"], "data.path"),  # ignored by synthetic data: an error, not silence
        ([f"--job.dump_folder={not_a_dir / 'sub'}"], "job.dump_folder"),
        (["--model.vocab_size=16"], "model.vocab_size"),  # the synthetic task needs more ids
    ]
    if not torch.cuda.is_available():
        cases.append((["--training.device=cuda"], "training.device"))
    return cases


def test_errors_found_before_any_rank_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for args, key in _cases(tmp_path):
        dump = [] if any(a.startswith("--job.dump_folder") for a in args) else [f"--job.dump_folder={tmp_path / 'o'}"]
        assert main(TWO + dump + args) == 2, args
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: {key}"), (args, out.err)
        assert "step" not in out.out, "no rank ran"


def test_other_ranks_stay_quiet_under_torchrun(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(TWO + ["--comm.timeout_s=inf"]) == 2
    assert capsys.readouterr().err == ""


def test_toml_numbers_must_be_numbers(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[training]\nseq_len = "1024"\n')
    with pytest.raises(ConfigError, match="training.seq_len.*quoted string"):
        load_config(["--config", str(path)])
    path.write_text("[training]\nseq_len = 1024\n[optimizer]\nlr = 1\n")
    assert load_config(["--config", str(path)]).training.seq_len == 1024  # and a TOML int is a fine float


def test_nothing_to_train_starts_no_rank(pools, tmp_path: Path, capsys) -> None:
    """A finished run used to start every rank and leave an empty TensorBoard file."""
    args = TINY + ["--parallelism.cp=2", "--checkpoint.enable=true", f"--job.dump_folder={tmp_path}",
                   "--training.steps=2", "--checkpoint.interval=2"]
    assert run(pools, args)["error"] is None
    capsys.readouterr()
    assert main(args + ["--metrics.enable_tensorboard=true"]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert not (tmp_path / "tb").exists()


def report_env(config, report) -> None:
    Path(config.job.dump_folder, "env.txt").write_text(
        "\n".join(f"{k}={__import__('os').environ.get(k)}" for k in ALLOCATOR_VARIABLES))


def test_the_cpu_launcher_leaves_the_allocator_as_it_is(tmp_path: Path, monkeypatch) -> None:
    """The plan predicts glibc's own settings: the launcher no longer sets its heap-keeping ones (a
    parameter-dominated run's heap then fragmented to 1.8x the plan), and names what the user set instead."""
    for key in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    config = load_config(TINY + [f"--job.dump_folder={tmp_path}"])
    assert launch_local(report_env, config, 1) == 0
    assert (tmp_path / "env.txt").read_text().splitlines() == [f"{k}=None" for k in ALLOCATOR_VARIABLES]
    assert allocator_warning(config) is None
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4294967296")
    warning = allocator_warning(config)
    assert warning is not None and warning.startswith("warning: MALLOC_MMAP_THRESHOLD_ set: the memory plan")
