"""`comm.rehearsal_mode()`: the switch a memory rehearsal (fake tensors, a fake process group) runs under.

The mode is off unless a `with` turns it on, for that block and that thread only, and off again however the
block ends.
"""

from __future__ import annotations

import threading

import pytest

from cpcompose.comm import rehearsal_mode, rehearsing


def test_the_mode_is_on_only_inside_its_with() -> None:
    assert not rehearsing()
    with rehearsal_mode():
        assert rehearsing()
        with rehearsal_mode():  # nested: still on, and the outer one still on after the inner ends
            assert rehearsing()
        assert rehearsing()
    assert not rehearsing()


def test_the_mode_is_off_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with rehearsal_mode():
            raise RuntimeError("inside")
    assert not rehearsing()


def test_another_thread_does_not_see_the_mode() -> None:
    seen: list[bool] = []
    with rehearsal_mode():
        thread = threading.Thread(target=lambda: seen.append(rehearsing()))
        thread.start()
        thread.join()
    assert seen == [False]
