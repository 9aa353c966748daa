"""The one exception type the trainer raises for things a user must fix or know."""

from __future__ import annotations

__all__ = ["TrainingError"]


class TrainingError(RuntimeError):
    """A one-line message naming what happened and what to change; printed once, without a traceback.

    `exit_code` is the process's exit status: 1 for a failed run, 2 for a configuration
    or environment problem found before training started.
    """

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
