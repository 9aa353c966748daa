"""Out of memory said plainly: real ranks that pass the budget, are killed by SIGKILL, or fail to allocate.

The launcher (`launch_local`) starts real spawned ranks and prints the job's error lines; the
trainer runs are real (gloo groups, the tiny Llama with a 32k vocabulary whose whole logits pass
a budget 0.27 GiB above the rank's own measured size at step 1). The kernel's OOM kill is played
by a rank that grows its resident set near the budget and sends itself SIGKILL, as the kernel
would, while its peer reports the lost collective: the job must end with the out-of-memory line
alone.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from cpcompose.config import load_config
from cpcompose.train import run_rank, train
from cpcompose.training.errors import TrainingError
from cpcompose.training.memory.footprint import process_bytes
from cpcompose.training.launcher.local import launch_local
from tests.support.trainer import TINY

BIG_LOGITS = TINY + ["--model.vocab_size=32768", "--training.seq_len=2048", "--training.batch_size=2",
                     "--training.steps=3", "--training.fused_loss=false", "--parallelism.cp=2"]
PEER_LINE = "00:00:00 error: rank 0: training failed at step 1: rank 1 died (its connections closed); see that rank's log"


def _process_gib() -> float:
    """A rank's own size before any tensor (the plan's measured figure): 0.33 GiB with torch's CPU wheel, 0.7 with
    its CUDA wheel. The budgets below are set above it, so the tests mean the same on either build."""
    return process_bytes("cpu") / 2**30


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if " error: " in line or "killed by" in line]


def test_a_rank_past_the_budget_stops_with_one_line(tmp_path: Path, capsys) -> None:
    """`training.memory_budget_gib` on CPU: the rank's guard sees its resident set pass it mid-step."""
    budget = round(_process_gib() + 0.27, 2)  # the step's logits take the rank 0.5-0.8 GiB past its own size
    config = load_config(BIG_LOGITS + [f"--training.memory_budget_gib={budget}", f"--job.dump_folder={tmp_path}"])
    started = time.monotonic()
    assert launch_local(run_rank, config, 2) == 1
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1, lines
    said = re.search(r"error: rank [01] ran out of memory at step 1: its resident set passed the budget and it "
                     rf"stopped; peak ([\d.]+) GiB, budget {budget:.2f} GiB \(training\.memory_budget_gib\); the plan "
                     r"predicted [\d.]+ GiB: see --job\.dry_run for its parts and what would fit$", lines[0])
    assert said and budget <= float(said.group(1)) < budget + 0.4, lines[0]  # the guard reads every 0.1 s
    assert time.monotonic() - started < 60  # ended, not left waiting on the stopped rank


def _swell_then_die(config, report) -> None:
    """Rank 1 grows to `CPCOMPOSE_TEST_SWELL_MIB` and is SIGKILLed, as the kernel's OOM killer does; rank 0 is the
    peer that loses it in a collective and reports that consequence."""
    if os.environ["RANK"] == "1":
        ballast = bytearray(b"\x01") * (int(os.environ["CPCOMPOSE_TEST_SWELL_MIB"]) * 2**20)  # written: resident
        time.sleep(0.5)  # the launcher reads resident sets every 0.1 s
        os.kill(os.getpid(), signal.SIGKILL)
        del ballast
    time.sleep(1.5)
    report(PEER_LINE, "consequence")
    os._exit(1)


@pytest.mark.parametrize("near", [True, False])
def test_a_rank_killed_near_the_budget_is_said_to_be_out_of_memory(tmp_path: Path, capsys, monkeypatch,
                                                                   near: bool) -> None:
    """Near the budget, SIGKILL is the kernel's OOM killer: one line says so, the peer's line is left out.
    Far from it, the death is only that: the peer's line is the job's message (as before)."""
    monkeypatch.setenv("CPCOMPOSE_TEST_SWELL_MIB", "700")  # on top of the rank's own size
    own = _process_gib()
    budget = round(own + 0.77, 2) if near else 8.0  # near: the swollen rank at 0.85-1.0 of the budget
    config = load_config(TINY + [f"--training.memory_budget_gib={budget}", f"--job.dump_folder={tmp_path}"])
    assert launch_local(_swell_then_die, config, 2) == 1
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1, lines
    if near:
        said = re.search(r"error: rank 1 ran out of memory: killed by the kernel \(SIGKILL\); peak ([\d.]+) GiB "
                         rf"resident, budget {budget:.2f} GiB \(training\.memory_budget_gib\), the host had [\d.]+ of "
                         r"[\d.]+ GiB available; the plan predicted [\d.]+ GiB: see --job\.dry_run", lines[0])
        assert said and own + 0.6 <= float(said.group(1)) < budget, lines[0]
    else:
        assert lines == [PEER_LINE]


def _train_or_error(mesh, args: list[str]) -> tuple[str, str] | None:
    try:
        train(load_config(TINY + args))
    except TrainingError as e:
        return e.kind, str(e)
    return None


def test_a_failed_allocation_is_reported_as_out_of_memory(pools, tmp_path: Path) -> None:
    """The CPU allocator's refusal (a 512 GiB embedding here) becomes the same kind of line, kind "oom"."""
    args = ["--model.vocab_size=2147483648", "--model.dim=64", "--training.steps=2", f"--job.dump_folder={tmp_path}"]
    kind, message = pools.get(1).run(_train_or_error, args)[0]
    assert kind == "oom", message
    assert re.fullmatch(r"rank 0 ran out of memory while starting: an allocation failed; peak [\d.]+ GiB, budget "
                        r"[\d.]+ GiB \(host RAM [\d.]+ GiB / 1 rank\); the plan predicted [\d.]+ GiB: see "
                        r"--job\.dry_run for its parts and what would fit", message), message


@pytest.mark.gpu
def test_cuda_out_of_memory_under_a_budget_is_one_line(tmp_path: Path, capsys) -> None:
    """On CUDA the budget caps the caching allocator; the OutOfMemoryError becomes the out-of-memory line."""
    config = load_config(BIG_LOGITS + ["--training.device=cuda", "--parallelism.cp=1", "--training.seq_len=65536",
                                       "--training.memory_budget_gib=1", f"--job.dump_folder={tmp_path}"])
    assert launch_local(run_rank, config, 1) == 1
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1 and "rank 0 ran out of memory at step 1: an allocation failed on the GPU" in lines[0], lines
