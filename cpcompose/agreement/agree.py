"""Checking inputs on every rank before any data moves.

A bad input on one rank must not leave the others blocked in a collective. So each
public entry point checks its arguments locally, then every rank contributes its
verdict and a small integer signature (shapes, dtypes, options, the layout's
identity) to one tiny all-gather. If any rank found a problem, or the signatures
differ, every rank raises the same ValueError, and no K/V collective is ever posted.

The all-gather is read on the host (a device sync on CUDA). `cp_attention`, called
per layer per microbatch, runs it only when a call is not the one every rank
expects (`expected.py`); the once-per-step entry points (sharding,
`context_parallel`) run it every time.

In a rehearsal (`comm.rehearsal_mode`: fake tensors over a fake group, nothing to gather)
the agreement is assumed: a rank's own error is still raised, in the same words.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cpcompose.agreement.signature import Field
from cpcompose.comm import CPGroup, all_gather, all_gather_objects, rehearsing

__all__ = ["agree_across_ranks"]


def agree_across_ranks(
    cp: CPGroup, local_error: str | None, signature: Sequence[Field], *, what: str, device: torch.device,
    note: int = 0,
) -> int:
    """Raise the same ValueError on every rank if any rank's input is bad or the signatures differ.

    Args:
        cp: the CP group.
        local_error: this rank's complaint about its input, or None.
        signature: named integers that must be equal on every rank (same names everywhere).
        what: the entry point's name, for messages.
        device: where the tiny metadata tensor lives (CUDA for NCCL groups).
        note: bits this rank tells the others without requiring them equal (e.g. "my V holds a
            non-finite value"); they travel in the same all-gather.

    Returns:
        The OR of every rank's `note`.
    """
    if rehearsing():  # nothing to gather: the others are assumed to agree
        if local_error is not None:
            raise _invalid_input(what, [(cp.rank, local_error)])
        return 0
    values = [int(v) for _, v in signature]
    mine = torch.tensor([int(local_error is not None), int(note), *values], dtype=torch.int64, device=device)
    table = all_gather(mine, cp).tolist()
    notes = 0
    for row in table:
        notes |= row.pop(1)
    if any(row[0] for row in table):
        errors: list[str | None] = all_gather_objects(local_error, cp.group)
        raise _invalid_input(what, [(r, e) for r, e in enumerate(errors) if e is not None])
    if any(row != table[0] for row in table):
        differing = list(dict.fromkeys(
            name for i, (name, _) in enumerate(signature) if len({row[1 + i] for row in table}) > 1
        ))
        per_rank = "; ".join(f"rank {r}: {row[1:]}" for r, row in enumerate(table))
        raise ValueError(
            f"{what}: inputs differ between CP ranks ({', '.join(differing)}); every rank must pass "
            f"local shards of the same shape, dtype and options. Per rank: {per_rank}"
        )
    return notes


def _invalid_input(what: str, errors: Sequence[tuple[int, str]]) -> ValueError:
    """The error every rank raises for the ranks' own complaints, `(rank, complaint)` in rank order."""
    lines = [f"rank {r}: {e}" for r, e in errors]
    return ValueError(f"{what}: invalid input on CP rank(s):\n  " + "\n  ".join(lines))
