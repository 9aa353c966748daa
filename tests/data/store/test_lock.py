"""The build lock: its file is removed by its holder, and a process that was waiting on the removed file never
holds the lock at the same time as a third process that took the new file.

Threads stand in for processes: ``flock`` belongs to an open file, so two ``open`` calls in one process
exclude each other as two processes do.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cpcompose.config import ConfigError
from cpcompose.data.store import lock
from cpcompose.data.store.lock import build_lock, lock_path


def test_the_holder_removes_the_lock_file_even_when_its_block_fails(tmp_path: Path) -> None:
    folder = tmp_path / "stores" / "web-0123"
    with build_lock(folder, timeout_s=1):
        assert lock_path(folder).is_file()
    with pytest.raises(RuntimeError, match="a failed build"), build_lock(folder, timeout_s=1):
        raise RuntimeError("a failed build")
    assert list((tmp_path / "stores").iterdir()) == []


def test_a_waiter_on_the_removed_file_waits_for_the_process_holding_the_new_one(tmp_path: Path) -> None:
    """The interleaving the inode check exists for: W waits on the first holder's file; that holder removes it
    and unlocks, and at once takes the lock again (a third process, T), which creates a new file. W then
    acquires the old, unnamed file: without the check it would run beside T. It must wait until T is done."""
    folder = tmp_path / "web-0123"
    inside: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    waiting = threading.Event()

    def hold(name: str, seconds: float) -> None:
        inside.append(name)
        if len(inside) > 1:
            overlaps.append(tuple(inside))
        time.sleep(seconds)
        inside.remove(name)

    def waiter() -> None:
        waiting.set()
        with build_lock(folder, timeout_s=30):
            hold("W", 0.0)

    with build_lock(folder, timeout_s=1):  # the first holder
        thread = threading.Thread(target=waiter)
        thread.start()
        waiting.wait()
        time.sleep(3 * lock._POLL_S)  # W has opened the file and polls it
    with build_lock(folder, timeout_s=1):  # T, before W's next poll: T holds the file the name points to now
        hold("T", 4 * lock._POLL_S)  # W acquires the old file meanwhile, sees it is gone, and waits for this one
    thread.join(timeout=30)
    assert not thread.is_alive() and overlaps == [], overlaps
    assert not lock_path(folder).exists()


def test_a_lock_beside_a_folder_that_cannot_be_made_names_store_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^data.store_dir: cannot create .*file/sub/web.lock \(Not a directory\)"):
        with build_lock(blocker / "sub" / "web", timeout_s=1):
            pass
