"""`rehearsal_mode()`: the one switch for a step run on fake tensors over torch's "fake" process group (the memory
rehearsal). There collectives move nothing and tensors hold no values, so the library's host checks that read
either take their no-sync forms (see `rehearsing`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import timedelta

__all__ = ["REHEARSAL_TIMEOUT", "rehearsal_mode", "rehearsing"]

# A ContextVar, not a module flag: it is set only inside `rehearsal_mode()`'s `with` and only in the thread
# (context) that entered it, and reset on the way out, exceptions included; a training process never sets it,
# and nothing else running in the interpreter (another thread, a later step) can see one left behind.
_REHEARSING: ContextVar[bool] = ContextVar("cpcompose_rehearsing", default=False)

# What bounds a wait in a rehearsal (torch's default): the fake group has no backend options to read one from, and
# its works never wait.
REHEARSAL_TIMEOUT = timedelta(minutes=10)


@contextlib.contextmanager
def rehearsal_mode() -> Iterator[None]:
    """Run a block as a rehearsal: fake tensors (FakeTensorMode) over torch's "fake" process group.

    There a collective returns nothing any rank sent and a tensor holds no value, so what reads values on the
    host cannot run; inside the block the library's functions that do take the forms that read none
    (`rehearsing` lists them). Nothing changes outside it. Everything the step runs must stay in this thread:
    a rehearsal's tensors are on the CPU, where autograd runs backward (and checkpointed recomputes) in the
    calling thread.
    """
    token = _REHEARSING.set(True)
    try:
        yield
    finally:
        _REHEARSING.reset(token)


def rehearsing() -> bool:
    """Whether this thread is inside `rehearsal_mode()`. Where the library asks it, and what it does then:

    - the cross-rank agreement (`agreement.agree_across_ranks`, `agreement.agreed_call`) is assumed: this rank's
      own error is still raised, nothing is gathered;
    - CP attention's non-finite V note (`attention.call.nonfinite.nonfinite_note`) is 0;
    - NaN query rows (`attention.local.merge.keep_nan_rows`) take the form other devices run (no sum read first);
    - a CP group's wait timeout (`CPGroup.wait_timeout`) is a fixed 10 minutes;
    - the Hugging Face attention's position-id check (it compares values) is skipped;
    - checkpointed block inputs offloaded to the host (`distributed.activation_checkpoint`) leave device memory
      as on a GPU, though a rehearsal runs on the CPU;
    - the tiled MLP (`distributed.tiled`) cuts detached tiles (views either way), which a memory tracker's module
      hooks do not take for autograd inputs;
    - expert parallelism's token dispatch (`token_dispatch`, `experts.parallel_routed_experts`,
      `experts.grouped_experts`) reads no counts or indices: every routed choice goes to an expert, in equal
      shares, and every rank sends as this one does (so receives as many rows as it sends); the permutations are
      the identity, of the sizes the real ones have.
    """
    return _REHEARSING.get()
