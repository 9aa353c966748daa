"""The one exception type the trainer raises for things a user must fix or know."""

from __future__ import annotations

from typing import Literal

__all__ = ["ErrorKind", "TrainingError"]

ErrorKind = Literal["error", "oom", "consequence"]
"""What a rank's error line is to the launcher: its own failure, its running out of memory, or a consequence
of another rank's failure (a collective that timed out or lost its peer)."""


class TrainingError(RuntimeError):
    """A one-line message naming what happened and what to change; printed once, without a traceback.

    `exit_code` is the process's exit status: 1 for a failed run, 2 for a configuration
    or environment problem found before training started. `kind` (see `ErrorKind`) tells the
    launcher how to print it: consequences are left out when another line explains the failure,
    and of several ranks running out of memory the first one's line is printed.
    """

    def __init__(self, message: str, *, exit_code: int = 1, kind: ErrorKind = "error") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.kind = kind
