"""One builder per store: an exclusive file lock beside it, waited for with a timeout.

``flock`` is released by the kernel when its holder exits, so a killed builder never leaves a stale lock; the
processes that waited then find either the finished store or no store (and build it themselves). It works
before any process group exists, on one node or on a shared file system.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cpcompose.config import ConfigError

__all__ = ["build_lock"]

_POLL_S = 0.2


@contextmanager
def build_lock(folder: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold ``<folder>.lock`` exclusively while the block runs.

    Raises:
        ConfigError: another process held it for longer than ``timeout_s`` (names data.store_wait_s).
    """
    path = folder.with_name(folder.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"data.store_wait_s: waited {timeout_s:g} s for another process to build the "
                                      f"token store {folder} (it holds {path}); raise data.store_wait_s, or stop "
                                      "that process") from None
                time.sleep(_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
