"""`comm.rehearsal_mode()`: the switch a memory rehearsal (fake tensors, a fake process group) runs under.

The mode is off unless a `with` turns it on, for that block and that thread only, and off again however the
block ends. Inside it the cross-rank agreement is assumed: checked on a real 2-rank gloo group where only
rank 1 has a complaint, each rank returns at once (no collective is posted, or rank 1 would wait for rank 0's
part) and rank 1 raises its own error, in the words the full agreement uses.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cpcompose.agreement import CallSpec, agree_across_ranks, agreed_call, agreement_cache
from cpcompose.comm import CPGroup, rehearsal_mode, rehearsing


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


def _agree_rehearsed(mesh) -> dict[str, object]:  # noqa: ANN001 (the pool's mesh)
    cp = CPGroup.from_mesh(mesh)
    error = "bad input" if cp.rank == 1 else None
    cache = agreement_cache(cp.group)
    before = cache.agreements, cache.skipped
    out: dict[str, object] = {}
    with rehearsal_mode():
        try:
            out["agree"] = agree_across_ranks(cp, error, [("n", cp.rank)], what="test", device=torch.device("cpu"))
        except ValueError as e:
            out["agree"] = str(e)
        try:
            spec = CallSpec((), torch.float32, torch.device("cpu"), lambda group: None)
            out["call"] = agreed_call(cp, error, [("n", cp.rank)], what="test", device=torch.device("cpu"),
                                      every_call=False, spec=lambda: spec, run=lambda: "ran", note=1)
        except ValueError as e:
            out["call"] = str(e)
    out["history"] = (cache.agreements, cache.skipped) == before
    return out


def test_the_agreement_is_assumed_and_a_ranks_own_error_is_raised(pools) -> None:  # noqa: ANN001 (fixture)
    rank0, rank1 = pools.get(2).run(_agree_rehearsed)
    # differing signatures agree, no note travels, and the agreement history is left as it is
    assert rank0 == {"agree": 0, "call": ("ran", None), "history": True}
    assert rank1 == {"agree": "test: invalid input on CP rank(s):\n  rank 1: bad input", "call": "bad input",
                     "history": True}
