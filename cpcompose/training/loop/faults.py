"""Diagnosing a failed collective, and the fault injection the reliability tests use.

When a collective fails, gloo says only "timed out" or "connection closed"; neither
names a rank. Every rank therefore records the step it has reached in the process
group's store, and a rank whose collective fails reads the others' progress to name
the one that fell behind. The store outlives a dead rank under torchrun (its agent
hosts it); when it is gone too, the message says the rank is unknown.

`CPCOMPOSE_FAULT=stall:rank=1:step=2` (or `die:...`) makes that rank stall forever,
or kill itself, at that step's boundary. Tests set it; the trainer reads it once.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

__all__ = ["FAULT_ENV", "Fault", "Progress", "describe_comm_failure", "is_comm_failure"]

FAULT_ENV = "CPCOMPOSE_FAULT"
_PREFIX = "cpcompose/progress/"


@dataclass(frozen=True)
class Fault:
    """Injected failure: `kind` on `rank` when step `step` is about to start."""

    kind: Literal["stall", "die"]
    rank: int
    step: int

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ = os.environ) -> "Fault | None":
        """Parse CPCOMPOSE_FAULT; raises ValueError naming the variable when malformed."""
        text = environ.get(FAULT_ENV, "")
        if not text:
            return None
        kind, *fields = text.split(":")
        values = dict(f.split("=", 1) for f in fields if "=" in f)
        if kind not in ("stall", "die") or set(values) != {"rank", "step"}:
            raise ValueError(f"{FAULT_ENV}={text!r}: expected stall:rank=R:step=S or die:rank=R:step=S")
        return cls(kind, int(values["rank"]), int(values["step"]))

    def maybe_fire(self, rank: int, step: int) -> None:
        if rank != self.rank or step != self.step:
            return
        # Said on stdout, so that a test can wait for the fault instead of guessing how long it takes to come.
        print(f"{FAULT_ENV}: rank {rank} {'dies' if self.kind == 'die' else 'stalls'} before step {step}", flush=True)
        if self.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # a stalled rank: alive, never reaching the next collective
            time.sleep(3600)


class Progress:
    """Each rank's last step, kept in the process group's store."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    def mark(self, step: int) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", str(step))

    def laggards(self, step: int) -> list[int] | None:
        """Ranks that have not reached `step`, or None when the store cannot be read."""
        try:
            self.store.set_timeout(timedelta(seconds=2))
            behind = []
            for r in range(self.world):
                key = f"{_PREFIX}{r}"
                reached = int(self.store.get(key)) if self.store.check([key]) else 0
                if reached < step:
                    behind.append(r)
            return behind
        except Exception:  # noqa: BLE001 - the store died with its host rank
            return None


def is_comm_failure(error: BaseException) -> Literal["timeout", "dead peer"] | None:
    """Classify a backend error: a timeout, a peer that closed its connections, or neither."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(s in text for s in ("connection closed", "connection reset", "broken pipe", "connection refused",
                               "read error", "write error", "socket closed")):
        return "dead peer"
    return None


def describe_comm_failure(
    cause: str, *, rank: int, step: int, timeout_s: float, laggards: list[int] | None
) -> str:
    """One line: who failed, how, at which step, and what to look at."""
    if laggards:
        who = "rank " + ", ".join(map(str, laggards))
    else:
        who = "another rank (unknown which: the store is gone too)" if laggards is None else "another rank"
    if cause == "timeout":
        what = f"{who} stopped responding (no answer within comm.timeout_s = {timeout_s:g} s)"
    else:
        what = f"{who} died (its connections closed)"
    return f"rank {rank}: training failed at step {step}: {what}; see that rank's log"
