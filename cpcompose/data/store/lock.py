"""One builder per store: an exclusive file lock beside it, waited for with a timeout, removed by its holder.

``flock`` is released by the kernel when its holder exits, so a killed builder never leaves a stale lock; the
processes that waited then find either the finished store or no store (and build it themselves). It works
before any process group exists, on one node or on a shared file system.

The holder deletes the lock file before it unlocks, so a finished build (or a reuse decided under the lock)
leaves nothing behind. A process that was waiting on that file then holds a lock on a name that no longer
exists while a third one may create a new file and lock it: so after every acquisition the file locked is
compared (device and inode) with the file the name points to now, and a stale one is let go and the lock
taken again. Only a holder deletes, so whoever holds the file the name points to is the one builder.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cpcompose.config import ConfigError

__all__ = ["build_lock", "flock_by", "lock_path"]

_POLL_S = 0.2


def lock_path(folder: Path) -> Path:
    """The lock file of the store (or sample index) ``folder``: ``<folder>.lock`` beside it."""
    return folder.with_name(folder.name + ".lock")


@contextmanager
def build_lock(folder: Path, *, timeout_s: float) -> Iterator[None]:
    """Hold ``<folder>.lock`` exclusively while the block runs; the file is gone once the block ends.

    Raises:
        ConfigError: the folder beside which the lock goes cannot be created or written (names data.store_dir),
            or another process held the lock for longer than ``timeout_s`` (names data.store_wait_s).
    """
    path = lock_path(folder)
    deadline = time.monotonic() + timeout_s
    while True:
        fd = _open(path)
        try:
            _acquire(fd, path, folder, deadline, timeout_s)
        except BaseException:
            os.close(fd)
            raise
        if _still_named(fd, path):
            break
        os.close(fd)  # locked a file its holder had deleted: take the lock of the file there now
    try:
        yield
    finally:
        try:
            path.unlink()  # while still holding it: a waiter on this file sees it is gone and starts again
        except OSError:  # removed by hand meanwhile (nobody else deletes a held lock), or a read-only folder
            pass
        finally:
            os.close(fd)  # releases the lock


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"data.store_dir: cannot create {path} ({e.strerror or e}) to build the token store "
                          "there; set data.store_dir to a writable folder, or data.store = false to tokenize in "
                          "memory") from None


def flock_by(fd: int, deadline: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, polling until ``deadline`` (``time.monotonic()``); whether it was taken.

    Polled rather than blocking, so that every wait has its timeout."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)


def _acquire(fd: int, path: Path, folder: Path, deadline: float, timeout_s: float) -> None:
    if not flock_by(fd, deadline):
        raise ConfigError(f"data.store_wait_s: waited {timeout_s:g} s for another process to build the "
                          f"token store {folder} (it holds {path}); raise data.store_wait_s, or stop "
                          "that process")


def _still_named(fd: int, path: Path) -> bool:
    """Whether the locked file ``fd`` is the one ``path`` names now (not deleted or replaced meanwhile)."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
