"""What a user sees when they stop a run with Ctrl-C and start it again, and a config error under torchrun.

Two quick Ctrl-C's used to end with "rank 0 was killed by SIGINT; the job stopped",
and the restart began at step 0 without a word. Now the first Ctrl-C is acknowledged
at once, the second ends every rank and says what a restart will find, and the
restart says whether it starts fresh or resumes.

The runs are real (`python -m cpcompose.train`, real ranks and gloo groups). Nothing
here waits on time: rank 1 stalls at step 3's boundary (`CPCOMPOSE_FAULT`, with a
long `comm.timeout_s`), so no step can end and no save can happen between the two
signals however loaded the machine is, and each signal is sent after the log line
that proves the previous stage was reached.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cpcompose.train import main
from cpcompose.training.launcher.local import INTERRUPTED_EXIT
from tests.support.trainer import TINY

ROOT = Path(__file__).resolve().parents[3]
ARGS = [a for a in TINY if not a.startswith(("--training.steps", "--metrics.log_freq"))] + [
    "--metrics.log_freq=1", "--parallelism.cp=2", "--comm.timeout_s=300", "--checkpoint.enable=true",
]
WAIT_S = 180  # for a log line; generous: the machine may be loaded, and a missing line fails anyway


class Run:
    """`python -m cpcompose.train` in its own session (as a terminal's foreground job), its output collected."""

    def __init__(self, args: list[str], fault: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("CPCOMPOSE_FAULT", None)
        if fault:
            env["CPCOMPOSE_FAULT"] = fault
        self.proc = subprocess.Popen([sys.executable, "-m", "cpcompose.train", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=s, d=d: d.extend(s), daemon=True)
                        for s, d in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def wait_for(self, pattern: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(re.search(pattern, line) for line in self.out):
            assert self.proc.poll() is None or any(t.is_alive() for t in self.readers), self.text()
            assert time.monotonic() < deadline, f"no line matching {pattern!r} in {WAIT_S} s:\n{self.text()}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # what a terminal does: the launcher and every rank

    def finish(self, timeout: float = WAIT_S) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the launcher hung:\n{self.text()}")
        for t in self.readers:
            t.join(timeout=10)
        return self.proc.returncode

    def text(self) -> str:
        return "".join(self.out) + "--- stderr ---\n" + "".join(self.err)


def _stopped_twice(run: Run) -> str:
    """Two Ctrl-C's during step 3 (which cannot end: rank 1 stalls); returns the launcher's last word.

    The first is sent once rank 1 stalls, past step 3's stop check (sent earlier, it makes the
    ranks save at that boundary and exit 0, as they should).
    """
    run.wait_for(r"CPCOMPOSE_FAULT: rank 1 stalls before step 3")
    run.ctrl_c()
    run.wait_for(r"Ctrl-C: every rank finishes this step, saves a checkpoint and stops; press Ctrl-C again")
    run.ctrl_c()
    assert run.finish() == INTERRUPTED_EXIT, run.text()
    assert "Traceback" not in run.text() and "killed by" not in run.text(), run.text()
    assert len(run.err) == 1, run.text()  # one line: the launcher's, no rank's
    return run.err[0]


def test_two_ctrl_c_say_what_was_saved_and_the_restart_says_where_it_starts(tmp_path: Path) -> None:
    """Nothing saved yet (interval 100) and a checkpoint at step 2 (interval 2), at once; then the restart."""
    def args(name: str, interval: int, steps: int = 1000) -> list[str]:
        return ARGS + [f"--job.dump_folder={tmp_path / name}", f"--checkpoint.interval={interval}",
                       f"--training.steps={steps}"]

    runs = {name: Run(args(name, interval), fault="stall:rank=1:step=3")
            for name, interval in (("unsaved", 100), ("saved", 2))}
    last = {name: _stopped_twice(run) for name, run in runs.items()}
    folder = tmp_path / "unsaved" / "checkpoint"
    assert last["unsaved"].rstrip().endswith(
        f"stopped at once by a second Ctrl-C, without saving the step in progress; nothing was saved (no checkpoint "
        f"in {folder}): the same command starts again from step 0"), last["unsaved"]
    step2 = tmp_path / "saved" / "checkpoint" / "step-2"
    assert last["saved"].rstrip().endswith(
        f"the newest checkpoint is {step2}: the same command resumes from step 2"), last["saved"]

    # The unsaved run left no checkpoint, so its restart is what its first start was (said at that start); the
    # saved one's restart resumes.
    assert re.search(rf"^\S+ starting fresh at step 0: no checkpoint in {re.escape(str(folder))}$",
                     "".join(runs["unsaved"].out), re.M), runs["unsaved"].text()
    assert not folder.exists() or not any(folder.iterdir()), list(folder.iterdir())
    again = Run(args("saved", 2, steps=3))
    assert again.finish() == 0, again.text()
    saved = "".join(again.out)
    assert re.search(rf"^\S+ resumed from {re.escape(str(step2))} at step 2$", saved, re.M), again.text()
    assert "step     1/3" not in saved and "starting fresh" not in saved, saved


def test_a_config_error_under_torchrun_is_torchruns_root_cause(tmp_path: Path, capsys, monkeypatch) -> None:
    """Under torchrun every rank writes its error where torchrun's failure summary reads it, and rank 0
    alone prints it: the summary's root cause used to say only "To enable traceback see: <url>".
    Read back here by torchrun's own classes (a real torchrun run costs 8 s; the README test runs one)."""
    for rank in (0, 1):
        error_file = tmp_path / f"error{rank}.json"
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        assert main(ARGS + ["--training.lr=1e-3"]) == 2
        printed = capsys.readouterr().err.splitlines()
        want = "config error: unknown option '--training.lr' (did you mean '--optimizer.lr'?)"
        assert printed == ([want] if rank == 0 else []), printed
        failure = ProcessFailure(local_rank=rank, pid=1, exitcode=2, error_file=str(error_file))
        summary = ChildFailedError("cpcompose/train.py", {rank: failure}).format_msg()
        assert re.search(rf"traceback : {re.escape(want)}\n", summary), summary
        assert json.loads(error_file.read_text())["message"]["message"] == want


@pytest.mark.parametrize("warmup, steps, note", [
    (10, 3, "note: lr_scheduler.warmup_steps = 10 is more than training.steps = 3: the warmup is shortened to 3 steps"),
    (3, 3, None),
])
def test_a_warmup_longer_than_the_run_is_shortened_and_said(warmup: int, steps: int, note: str | None) -> None:
    """A short trial of a long run's config (`--training.steps=3` with 10 warmup steps) used to be refused."""
    from cpcompose.training.loop.lr_schedule import lr_factor, warmup_note

    assert warmup_note(warmup, steps) == note
    factors = [lr_factor(s, name="cosine", warmup_steps=warmup, total_steps=steps, min_lr_ratio=0.1)
               for s in range(steps)]
    assert factors == [1 / 4, 2 / 4, 3 / 4]  # a linear warmup over the 3 steps either way
