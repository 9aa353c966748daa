"""Agree once per signature, not every call, without letting one rank go astray alone.

The full cross-rank agreement (`agree.agree_across_ranks`) is a
blocking all-gather read on the host: on NCCL a device-to-host sync per attention
call. Here it runs only when a call's signature (shapes, dtype, options, the
layout's identity) is not the one every rank already *expects*; the expected call
is skipped straight to its K/V collectives.

Why "expected" and not "any signature seen before": a rank that skips the agreement
posts K/V collectives whose sizes come from its own signature. If ranks could skip
with two different cached signatures, or one rank skipped while another agreed,
their collectives would not match (gloo aborts the process on a size mismatch,
NCCL hangs). So every rank predicts the same next signature from shared history,
and history only changes on outcomes every rank sees alike (a call all ranks ran,
an agreement all ranks joined): the prediction is identical on every rank, and
ranks that skip all run the same call.

The prediction follows the history like a tape: after a call, find the latest
earlier place where the same calls happened in the same order (the longest
matching run of recent calls, up to `CONTEXT` of them), and predict what came
next there; while predictions come true, keep reading on from there. A training
step repeats its sequence of calls, so one step in, every call of the next is
predicted, whatever the layer pattern: 5 sliding-window layers to 1 global one,
a recomputed forward under activation checkpointing, microbatches. (Predicting
"what followed this signature last time" cannot: after a sliding-window layer
comes sometimes another and sometimes a global one, and each flip cost a full
agreement, every step.) A signature never seen before predicts itself next.

A rank whose call differs from the prediction (new shapes or options, a local
error, `validate="every_call"`) *deviates*. Where the data lives on the host (CPU,
gloo), reading a flag from a peer costs no device sync, so every call also gathers
one int64 flag from every rank (one all-gather, posted before the K/V exchange and
read after it; point-to-point flags cost more: on the 2-core VM a ring call's wall
time was 2.5 ms against 2.05 with the gather, and their exchange's 90th percentile
4 ms against 0.4):

* a predicted call posts flag 0, runs, and then reads the flags; if a peer
  deviated, its result is discarded and it joins the full agreement;
* a deviating rank posts flag 1 and reads the flags at once; if any peer runs the
  predicted call, it runs that same call on zeros so their collectives complete,
  then joins the full agreement, which raises the same ValueError on every rank
  (or, if every rank asked for the same new call, agrees and runs it).

On CUDA the flags would need a device-to-host sync, so they are not sent: a rank
deviating alone after warm-up is caught only by the backend's timeout
(`comm.timeout_s`), and `validate="every_call"` restores the per-call check.

In a rehearsal (`comm.rehearsal_mode`) every call is assumed agreed and runs at once; the
history is left as it is.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from cpcompose.agreement.agree import agree_across_ranks
from cpcompose.agreement.signature import Field
from cpcompose.comm import CPGroup, PendingCollective, rehearsing, start_all_gather

__all__ = ["AgreementCache", "CallSpec", "agreed_call", "agreement_cache"]

Key = tuple[int, ...]
R = TypeVar("R")
MAX_ENTRIES = 256  # signatures kept (with what is needed to replay them)
HISTORY = 4096  # calls kept to predict from: a step's calls must fit (layers x microbatches x recompute)
CONTEXT = 16  # recent calls compared when looking for where the history repeats


@dataclass(frozen=True)
class CallSpec:
    """Enough of an agreed call to run it again on zeros (what a deviating rank mimics).

    `run(group, *tensors)` makes the call on tensors of `shapes` (attention: q, k, v);
    it holds no group: the history it is kept in belongs to the group.
    """

    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype
    device: torch.device
    run: Callable[..., object]

    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def mimic(self, cp: CPGroup) -> None:
        """Run the call on zeros: every collective a peer running it posts gets its partner."""
        with torch.no_grad():
            self.run(cp, *(torch.zeros(s, dtype=self.dtype, device=self.device) for s in self.shapes))


class AgreementCache:
    """What the ranks of one process group agreed on, identical on every rank by construction.

    Every mutation happens on an outcome all ranks of the group see alike, in the
    same order, so `expected()` is common knowledge without communication.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, history: int = HISTORY) -> None:
        self.max_entries, self.max_history = max_entries, history
        self._history: list[Key] = []  # the calls every rank ran, oldest first
        self._cursor: int | None = None  # index in _history of the predicted next call; None: repeat the last
        self._lost = True  # after an error (and at first): no prediction, the next call agrees in full
        self._specs: OrderedDict[Key, CallSpec] = OrderedDict()
        self.agreements = 0  # full agreements run (the blocking all-gather)
        self.skipped = 0  # calls that ran without one
        self.deviations = 0  # calls where some rank deviated after warm-up (flags seen)

    def expected(self) -> Key | None:
        """The signature every rank predicts for the next call, or None (then nobody skips)."""
        if self._lost:
            return None
        key = self._history[-1] if self._cursor is None else self._history[self._cursor]
        return key if key in self._specs else None

    def spec(self, key: Key) -> CallSpec:
        return self._specs[key]

    def ran(self, key: Key) -> None:
        """Every rank ran the expected call `key` without an agreement."""
        self.skipped += 1
        self._specs.move_to_end(key)
        self._append(key)

    def agreed(self, key: Key, spec: CallSpec) -> None:
        """Every rank agreed on `key` through the full agreement."""
        seen = key in self._specs  # a signature never seen has no earlier occurrence to look for
        _put(self._specs, key, spec, self.max_entries)
        self._lost = False
        self._append(key, search=seen)

    def failed(self) -> None:
        """Every rank raised: predict nothing, so the next call agrees in full."""
        self._lost = True

    def _append(self, key: Key, search: bool = True) -> None:
        """Record a call; keep reading the history on if it was the predicted one, else find where it repeats."""
        history, cursor = self._history, self._cursor
        if cursor is not None and history[cursor] == key:
            history.append(history[cursor])  # the equal tuple already kept: the history shares its keys
            self._cursor = cursor + 1
        else:
            history.append(history[-1] if history and history[-1] == key else key)
            self._cursor = self._repeat_point() if search else None
        if len(history) > 2 * self.max_history:  # drop the oldest half at once: amortised O(1) per call
            drop = len(history) - self.max_history
            del history[:drop]
            self._cursor = None if self._cursor is None or self._cursor < drop else self._cursor - drop

    def _repeat_point(self) -> int | None:
        """Where to read on after a failed prediction: the index after the best earlier match of the recent calls.

        A candidate j (an earlier call equal to the last one) matches `length` recent
        calls (at most CONTEXT). When it lies within its own match (distance <= length)
        the last length + distance calls repeat with that period, and that counts as
        the evidence; else the `length` calls alone do. Without that bonus an older
        run of the same signature, from other work in the process, outscores the
        run being made now by one and is followed to its end, a failed prediction
        each time. The best evidence wins, the latest among equals. Runs only after
        a failed prediction (when a full agreement is paid anyway): a linear scan of
        the kept history.
        """
        history, last = self._history, len(self._history) - 1
        best, best_score = None, 0
        for j in range(last - 1, -1, -1):
            if history[j] != history[last]:
                continue
            length = 1
            while length < CONTEXT and length <= j and history[j - length] == history[last - length]:
                length += 1
            distance = last - j
            score = length + (distance if distance <= length else 0)
            if score > best_score:
                best, best_score = j + 1, score
        return best


def _put(d: OrderedDict, key: Hashable, value: object, limit: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > limit:
        d.popitem(last=False)


# The process group owns its agreement history: the cache lives exactly as long as the
# group object, with no state outside it (a WeakKeyDictionary, not a global registry of
# values that could outlive their group).
_CACHES: weakref.WeakKeyDictionary[dist.ProcessGroup, AgreementCache] = weakref.WeakKeyDictionary()


def agreement_cache(group: dist.ProcessGroup) -> AgreementCache:
    """The agreement history of `group` (created empty on first use)."""
    cache = _CACHES.get(group)
    if cache is None:
        cache = _CACHES[group] = AgreementCache()
    return cache


def _post_flags(cp: CPGroup, deviating: bool, note: int) -> PendingCollective:
    """Start gathering every rank's flag (bit 0: deviating; above it: its note): one all-gather of one int64
    (host tensors, unmetered)."""
    mine = torch.tensor([int(deviating) | int(note) << 1], dtype=torch.int64)
    return start_all_gather(mine, cp)


def _flags(pending: PendingCollective) -> list[int]:
    return [int(f) for f in pending.wait().view(-1).tolist()]


def _notes(flags: list[int], note: int) -> int:
    out = note
    for flag in flags:
        out |= flag >> 1
    return out


def agreed_call(
    cp: CPGroup,
    local_error: str | None,
    signature: Sequence[Field],
    *,
    what: str,
    device: torch.device,
    every_call: bool,
    spec: Callable[[], CallSpec],
    run: Callable[[], R],
    note: int = 0,
) -> tuple[R, int | None]:
    """Run `run()` once every rank is known to make this same call; raise the same ValueError everywhere otherwise.

    Args:
        cp: the CP group.
        local_error: this rank's complaint about its input, or None.
        signature: the named integers every rank must share (see `agree_across_ranks`).
        what: the entry point's name, for messages.
        device: where the agreement's tiny tensor lives (CUDA for NCCL).
        every_call: run the full agreement whatever the history (`validate="every_call"`).
        spec: builds this call's `CallSpec` (only called for a valid call).
        run: the call itself.
        note: bits this rank tells the others (see `agree_across_ranks`).

    Returns:
        `run()`'s result, and the OR of every rank's `note` where they travelled (a full
        agreement, or the host flags of a predicted call), else None (a predicted call on
        CUDA, which sends nothing; a rehearsal).
    """
    if rehearsing():  # nothing to gather: the others are assumed to make this call; this rank's error still raised
        if local_error is not None:
            raise ValueError(local_error)
        return run(), None
    cache = agreement_cache(cp.group)
    key: Key = tuple(int(v) for _, v in signature)
    expected = cache.expected()
    predicted = local_error is None and not every_call and key == expected
    flags = expected is not None and cp.world > 1 and cache.spec(expected).on_host
    if flags:
        pending = _post_flags(cp, deviating=not predicted, note=note)
        if predicted:
            result = run()
            received = _flags(pending)
            if not any(f & 1 for f in received):
                cache.ran(key)
                return result, _notes(received, note)
            cache.deviations += 1  # a peer deviated: this result was computed with its zeros
        else:
            if not all(f & 1 for f in _flags(pending)):
                cache.deviations += 1
                assert expected is not None
                cache.spec(expected).mimic(cp)
    elif predicted:
        cache.ran(key)
        return run(), None
    cache.agreements += 1
    try:
        notes = agree_across_ranks(cp, local_error, signature, what=what, device=device, note=note)
    except ValueError:
        cache.failed()
        raise
    cache.agreed(key, spec())
    return run(), notes
