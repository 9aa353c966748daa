"""The ring loop: K/V travel point-to-point round a ring of places, posted a round ahead.

Round 0 attends to the local K/V. In round s = 1..world-1 every place sends to place+s,
and receives from place-s, exactly the K/V rows the receiver's block plan reads,
posted one round ahead so the transfer runs while the previous round computes; rows
nobody needs never travel. Backward repeats the exchange and sends each block's float32
dK/dV straight home. `ring_forward` / `ring_backward` run over any `RingView` (which CP
ranks are the ring's places) and any layout: the ring strategy runs them over the whole
group, the 2-D strategy (`alltoall_ring.py`) across its all-to-all blocks, on the
blocks' `GroupedLayout`. One loop, written once.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple, Protocol, Sequence

import torch
from torch import Tensor

from cpcompose.attention.local.blocks import BlockTask, MaskSpec, needed_rows
from cpcompose.attention.local.call_setup import float_zeros
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.attention.local.plans import PLAN_CACHE_SIZE, cached_halves, cached_plan
from cpcompose.comm import PendingRecv, RingComm
from cpcompose.layouts import Layout

__all__ = ["KVHeads", "RingView", "RoundPlan", "Rounds", "piece_bounds", "ring_backward", "ring_forward",
           "ring_round"]

_KV_TAG, _GRAD_TAG = 0, 1


def _gather_rows(x: Tensor, rows: Sequence[slice]) -> Tensor:
    """The rows `rows` of `x` (dim 2), contiguous; `x` itself when that is all of it."""
    if len(rows) == 1 and rows[0] == slice(0, x.shape[2]):
        return x
    if not rows:
        return x[:, :, :0].contiguous()
    return torch.cat([x[:, :, r] for r in rows], dim=2)


def _compact(tasks: Sequence[BlockTask], rows: Sequence[slice]) -> tuple[BlockTask, ...]:
    """Re-address the tasks' key rows into the concatenation of `rows`."""
    starts, offset = [], 0
    for r in rows:
        starts.append(offset)
        offset += r.stop - r.start
    out = []
    for t in tasks:
        i = next(i for i, r in enumerate(rows) if r.start <= t.kv.start and t.kv.stop <= r.stop)
        shift = starts[i] - rows[i].start
        out.append(replace(t, kv=slice(t.kv.start + shift, t.kv.stop + shift)))
    return tuple(out)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def ring_round(layout: Layout, mask: MaskSpec, seq_len: int, rank: int, world: int, s: int) -> RoundPlan:
    """Round s of `rank`'s ring: the rows it sends to rank+s, the rows it reads from rank-s, its tasks on them.

    Pure and cached: each forward and backward walks the same P-1 rounds.
    """
    send = tuple(needed_rows(cached_plan(layout, mask, seq_len, (rank + s) % world, rank)))
    tasks = cached_plan(layout, mask, seq_len, rank, (rank - s) % world)
    rows = tuple(needed_rows(tasks))
    return RoundPlan(send, rows, _compact(tasks, rows))


class RoundPlan(NamedTuple):
    send: tuple[slice, ...]
    recv: tuple[slice, ...]
    tasks: tuple[BlockTask, ...]


class RingView(NamedTuple):
    """The ring's places: `world` of them, this rank at `rank`; place j is CP group rank `j * stride + offset`.

    The 1-D ring is the whole CP group (stride 1). The 2-D strategy runs a ring across
    blocks of `stride` consecutive ranks between the ranks at place `offset` of each block.
    """

    rank: int
    world: int
    stride: int = 1
    offset: int = 0

    def peer(self, s: int) -> int:
        """The CP group rank `s` places after this one (before, for negative `s`)."""
        return (self.rank + s) % self.world * self.stride + self.offset


class KVHeads(Protocol):
    """How received K/V heads map to this rank's query heads (the 2-D strategy's `_HeadPlan`)."""

    def local_kv(self, kv: Tensor) -> Tensor: ...

    def reduce_local_kv(self, dkv: Tensor, n_kv: int) -> Tensor: ...


class _SameHeads:
    """The kernel reads K/V heads as they are (GQA natively): nothing to map."""

    def local_kv(self, kv: Tensor) -> Tensor:
        return kv

    def reduce_local_kv(self, dkv: Tensor, n_kv: int) -> Tensor:
        return dkv


class Rounds:
    """Who talks to whom in each round of a ring over `layout`, and which rows move."""

    def __init__(self, layout: Layout, mask: MaskSpec, view: RingView, local_seq: int) -> None:
        self.layout, self.mask, self.view = layout, mask, view
        self.rank, self.world, self.seq_len = view.rank, view.world, local_seq * view.world

    def local_tasks(self) -> Sequence[BlockTask]:
        return cached_plan(self.layout, self.mask, self.seq_len, self.rank, self.rank)

    def local_halves(self) -> tuple[Sequence[BlockTask], Sequence[BlockTask]]:
        """`local_tasks` as two parts of about equal work (`split_work`)."""
        return cached_halves(self.layout, self.mask, self.seq_len, self.rank)

    def _plan(self, s: int) -> RoundPlan:
        return ring_round(self.layout, self.mask, self.seq_len, self.rank, self.world, s)

    def send_rows(self, s: int) -> Sequence[slice]:
        """Rows of my K/V that place rank+s reads in round s."""
        return self._plan(s).send

    def recv(self, s: int) -> tuple[Sequence[slice], Sequence[BlockTask]]:
        """Rows of place rank-s's K/V that I read in round s, and my tasks on their compact copy."""
        plan = self._plan(s)
        return plan.recv, plan.tasks

    def post_kv(self, comm: RingComm, k: Tensor, v: Tensor, s: int) -> tuple[PendingRecv, Sequence[BlockTask]]:
        """Start round s's K/V exchange; returns the pending receive and the round's tasks."""
        send = self.send_rows(s)
        rows, tasks = self.recv(s)
        n = sum(r.stop - r.start for r in rows)
        pending = comm.exchange_with(
            [_gather_rows(k, send), _gather_rows(v, send)], dst=self.view.peer(s),
            recv_like=[_with_rows(k, n), _with_rows(v, n)], src=self.view.peer(-s), tag=_KV_TAG,
        )
        return pending, tasks


def _with_rows(x: Tensor, n: int) -> Tensor:
    """A template of `x` with `n` rows for a receive (its shape, dtype and device): one row expanded, so that it
    holds no memory of its own beside the receive's buffer."""
    return x.new_empty((x.shape[0], x.shape[1], 1, x.shape[3])).expand(x.shape[0], x.shape[1], n, x.shape[3])


def _add_rows(grads: tuple[Tensor, Tensor], pending: PendingRecv, rows: Sequence[slice]) -> None:
    """Wait for a compact dK/dV block and add it into the rows it belongs to."""
    offset = 0
    got = pending.wait()
    for r in rows:
        n = r.stop - r.start
        for acc, part in zip(grads, got):
            acc[:, :, r] += part[:, :, offset : offset + n]
        offset += n


def ring_forward(
    acc: SoftmaxAccumulator, q: Tensor, k: Tensor, v: Tensor, rounds: Rounds, comm: RingComm, kernel: KernelArgs,
    heads: KVHeads = _SameHeads(),
) -> None:
    """Merge into `acc` the local queries against every place's K/V; each round's exchange posted a round ahead.

    `k`, `v` are contiguous and travel with their own head count; `heads` maps them to
    the query heads after they arrive.
    """
    pending = rounds.post_kv(comm, k, v, 1) if rounds.world > 1 else None
    forward_blocks(acc, q, heads.local_kv(k), heads.local_kv(v), rounds.local_tasks(), kernel)
    for s in range(1, rounds.world):
        following = rounds.post_kv(comm, k, v, s + 1) if s + 1 < rounds.world else None
        assert pending is not None
        recv, tasks = pending[0].wait(), pending[1]
        forward_blocks(acc, q, heads.local_kv(recv[0]), heads.local_kv(recv[1]), tasks, kernel)
        pending = following


def _kv_block_backward(
    dq: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    tasks: Sequence[BlockTask], kernel: KernelArgs, heads: KVHeads,
) -> tuple[Tensor, Tensor]:
    """Add one block's dQ into `dq`; return its float32 dK, dV with K/V's own head count."""
    ke, ve = heads.local_kv(k), heads.local_kv(v)
    dk, dv = float_zeros(ke), float_zeros(ve)
    backward_blocks((dq, dk, dv), dout, q, ke, ve, out, lse, tasks, kernel)
    return heads.reduce_local_kv(dk, k.shape[1]), heads.reduce_local_kv(dv, v.shape[1])


def piece_bounds(rows: int, pieces: int) -> list[tuple[int, int]]:
    """`pieces` consecutive ranges covering `rows` rows as evenly as integers allow (some empty when `rows` <
    `pieces`): the sender of a round's dK/dV and the rank receiving them cut the same rows alike."""
    return [(rows * i // pieces, rows * (i + 1) // pieces) for i in range(pieces)]


def _rows_within(rows: Sequence[slice], start: int, stop: int) -> list[slice]:
    """Rows `[start, stop)` of the concatenation of `rows`, as slices of the rows themselves."""
    out, offset = [], 0
    for r in rows:
        n = r.stop - r.start
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            out.append(slice(r.start + lo - offset, r.start + hi - offset))
        offset += n
    return out


def _tasks_within(tasks: Sequence[BlockTask], start: int, stop: int) -> tuple[BlockTask, ...]:
    """The parts of `tasks` on key rows `[start, stop)`, their key rows counted from `start`.

    A round with another place has full and band blocks only (its keys are other positions than the queries'):
    a full block cut by key rows stays full, a band keeps its diagonal by moving its offset.
    """
    out = []
    for t in tasks:
        lo, hi = max(t.kv.start, start), min(t.kv.stop, stop)
        if lo >= hi:
            continue
        if t.kind == "causal" and (lo, hi) != (t.kv.start, t.kv.stop):
            raise RuntimeError("ring_backward: a causal block in a round with another place cannot be cut by key "
                               "rows (cpcompose's planner makes none: this is a bug)")
        offset = t.offset - (lo - t.kv.start) if t.kind == "band" else t.offset
        out.append(replace(t, kv=slice(lo - start, hi - start), offset=offset))
    return tuple(out)


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rounds: Rounds, comm: RingComm,
    kernel: KernelArgs, heads: KVHeads = _SameHeads(), pieces: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Float32 `(dq, dk, dv)` of the local shards: K/V exchanged again, each block's dK/dV sent home.

    The local blocks are split in two halves of about equal work: the first runs
    while round 1's K/V arrive, the second while the last round's dK/dV go home
    (otherwise a wait at the end of every backward). With `pieces` > 1 each round's
    dK/dV are made and sent home a piece of its key rows at a time, so the float32
    blocks in flight (made, on the wire, arriving) are a piece's, not a shard's.
    """
    dq = float_zeros(q)
    pending = rounds.post_kv(comm, k, v, 1) if rounds.world > 1 else None
    early, late = rounds.local_halves() if rounds.world > 1 else (rounds.local_tasks(), ())
    dk, dv = _kv_block_backward(dq, dout, q, k, v, out, lse, early, kernel, heads)
    returning: tuple[PendingRecv, Sequence[slice]] | None = None  # dK/dV of my rows, coming home
    for s in range(1, rounds.world):
        following = rounds.post_kv(comm, k, v, s + 1) if s + 1 < rounds.world else None
        assert pending is not None
        (k_s, v_s), tasks = pending[0].wait(), pending[1]
        mine = rounds.send_rows(s)  # the rows place rank+s read from me: their gradients come back
        n_mine = sum(r.stop - r.start for r in mine)
        for (lo, hi), (home_lo, home_hi) in zip(piece_bounds(k_s.shape[2], pieces), piece_bounds(n_mine, pieces)):
            dk_s, dv_s = _kv_block_backward(dq, dout, q, k_s[:, :, lo:hi], v_s[:, :, lo:hi], out, lse,
                                            _tasks_within(tasks, lo, hi), kernel, heads)
            n = home_hi - home_lo
            home = comm.exchange_with(
                [dk_s, dv_s], dst=rounds.view.peer(-s), recv_like=[_with_rows(dk, n), _with_rows(dv, n)],
                src=rounds.view.peer(s), tag=_GRAD_TAG,
            )
            del dk_s, dv_s
            if returning is not None:
                _add_rows((dk, dv), *returning)
            returning = (home, _rows_within(mine, home_lo, home_hi))
        pending = following
    if late:
        dk_late, dv_late = _kv_block_backward(dq, dout, q, k, v, out, lse, late, kernel, heads)
        dk += dk_late
        dv += dv_late
    if returning is not None:
        _add_rows((dk, dv), *returning)
    return dq, dk, dv
