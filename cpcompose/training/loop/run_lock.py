"""One job per dump folder: a lock file naming its holder, that a crashed job does not leave stuck.

Two jobs writing one folder would rotate each other's checkpoints away and resume
from each other's state. The lock is a file created atomically (O_EXCL) holding
the host name and process id of rank 0. A lock whose process is gone (same
host, pid no longer running) is stale and taken over; a lock held from another
host cannot be checked from here, so the message names the file to delete.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "FolderLocked", "RunLock", "holder"]

LOCK_NAME = ".cpcompose.lock"


class FolderLocked(RuntimeError):
    """Another live job holds the dump folder; the message names it and what to do."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def holder(folder: str | Path) -> dict | None:
    """The live job holding `folder`'s lock, or None (no lock, or a stale one)."""
    path = Path(folder) / LOCK_NAME
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # half-written by a job killed mid-write: treat as stale
        return None
    if info.get("host") == socket.gethostname() and not _alive(int(info.get("pid", -1))):
        return None
    return info


class RunLock:
    """Held by one process (rank 0) for the whole run; `release()` removes the file."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._held = False

    def acquire(self) -> None:
        """Raises FolderLocked when another live job holds the folder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = holder(self.path.parent)
                if info is not None:
                    raise FolderLocked(
                        f"job.dump_folder {self.path.parent} is in use by another job (pid {info.get('pid')} on "
                        f"{info.get('host')} since {info.get('since')}); choose another --job.dump_folder, or "
                        f"delete {self.path} if that job is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process has exited
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._held = True
            return
        raise FolderLocked(f"could not take the lock {self.path}: another job raced for it; try again")

    def release(self) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False
