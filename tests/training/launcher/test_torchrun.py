"""`python -m cpcompose.training.launcher.torchrun`: torchrun's Ctrl-C ends in one line and exit 130, not a traceback.

torchrun itself is replaced here by a function raising what its agent raises on a signal (a real
Ctrl-C needs a terminal's process group and minutes); the ranks' own Ctrl-C handling (save, stop, say
how to resume) is tested in tests/training/loop/test_stop_and_restart.py.
"""

from __future__ import annotations

import signal

import pytest
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.api import SignalException

from cpcompose.training.launcher.torchrun import main


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_in_one_line_and_the_shells_code(monkeypatch, capsys, sig, code: int) -> None:
    seen = []

    def agent(argv):
        seen.append(argv)
        raise SignalException(f"Process {123} got signal: {sig}", sigval=sig)

    monkeypatch.setattr(torch.distributed.run, "main", agent)
    assert main(["--nproc_per_node", "2", "cpcompose/train.py"]) == code
    assert seen == [["--nproc_per_node", "2", "cpcompose/train.py"]]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"stopped by {sig.name}" in lines[0] and "resumes" in lines[0], lines


def test_a_finished_run_exits_0(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: None)
    assert main([]) == 0
