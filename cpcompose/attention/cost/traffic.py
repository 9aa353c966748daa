"""What each rank sends and computes under each strategy: exact, from cpcompose's own plans.

The one owner of the communication volumes (the benchmark's `plan_bytes` and the
comm-volume tests read them from here). Every count mirrors the code that moves the
bytes, as `cpcompose.comm.CommMeter` counts them:

* all-to-all family, with `a` ranks per all-to-all block and the ring across the
  `R = P / a` blocks (`a = P`: `alltoall`, `a = 1`: `ring`, else `alltoall_ring`):
  - forward: one all-to-all inside the block sends the q heads of each peer's range
    and the K/V heads they read (`heads.query_head_ranges` / `kv_head_ranges`:
    GQA K/V are never expanded), for this rank's L/P tokens; the ring then sends, in
    round s, to the same-index rank of block b+s exactly the K/V rows of this block
    that block b+s's plans read (`needed_rows`); the output (and the float32 LSE when
    asked for) comes back by a second all-to-all.
  - backward: dout goes out by all-to-all; the ring sends the same K/V rows again
    and returns float32 (accumulation dtype) dK/dV of every row it read to its
    owner; dq, dk, dv come back by a final all-to-all in the input dtype.
  - with `head_chunks` = n (all-to-all only): the above for each chunk of H/n query heads and K/n K/V heads, the
    LSE always sent home, and in backward the chunk's q, k, v, out and LSE sent again (nothing is kept).
* all-gather: each rank's needed K and V rows (those another rank's plans read,
  `attention.local.plans.gathered_rows`) packed end to end and padded to the widest rank's,
  one all-gather forward, another backward (K/V are not kept: activation memory
  stays 1/P), then a reduce-scatter of those rows' float32 dK/dV: each sends (P-1)
  padded parts. Without a mask that hides rows from every peer, the whole shard.

A `Transfer` is one piece of that: which pass, which ring round (or a collective),
to which peer, how many bytes and messages. A strategy's record
(`cpcompose.attention.strategies.strategy.Strategy`) names its family's functions here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from cpcompose.attention.local.blocks import BlockTask, MaskSpec, needed_rows, plan
from cpcompose.attention.local.heads import kv_head_ranges, query_head_ranges
from cpcompose.attention.local.plans import gathered_width
from cpcompose.layouts import Layout, Run
from cpcompose.layouts.grouped import grouped
from cpcompose.attention.cost.call import AttentionCall

__all__ = [
    "COLLECTIVE", "RankWork", "Transfer", "block_plan", "block_runs", "gather_transfers", "gather_work",
    "head_split", "head_splits", "ring_family_transfers", "ring_family_work", "rows_read",
]

COLLECTIVE = -1  # `Transfer.round` of a collective (not part of a ring round)


@dataclass(frozen=True)
class Transfer:
    """Bytes one rank sends to `peer` (a collective's bytes: to its ring neighbour or each peer).

    `op` is the `CommMeter` key ("p2p", "all_gather", "reduce_scatter", "all_to_all").
    """

    phase: Literal["fwd", "bwd"]
    round: int
    op: str
    what: str  # "qkv", "kv", "dkv", "out", "lse", "dout", "dqkv"
    peer: int
    nbytes: int
    messages: int


@dataclass(frozen=True)
class RankWork:
    """One rank's kernel calls per round, with the query heads they run on.

    Round 0 is on the rank's own keys; ring round s on block b-s's keys; all-gather's
    round 1 on every other rank's gathered shard, in rank order (after the gather).
    """

    rounds: tuple[tuple[BlockTask, ...], ...]
    heads: int
    kv_heads: int


def block_runs(layout: Layout, seq_len: int, first: int, count: int) -> tuple[Run, ...]:
    """The tokens of ranks `first .. first+count-1` as one block, so the model reads what the code runs.

    One rank: the layout's own runs (the ring and all-gather plan on them; merging a
    rank's adjacent chunks, as the grouped view does, would change a windowed plan's
    blocks). More: in global order, the 2-D strategy's own view (`cpcompose.layouts.grouped`).
    """
    if count == 1:
        return tuple(layout.runs(first, seq_len))
    return tuple(grouped(layout, count).runs(first // count, seq_len))


@functools.lru_cache(maxsize=65536)
def block_plan(layout: Layout, mask: MaskSpec, seq_len: int, a: int, q_block: int, kv_block: int
               ) -> tuple[BlockTask, ...]:
    """Kernel calls of block `q_block`'s queries against block `kv_block`'s keys (blocks of `a` ranks)."""
    return tuple(plan(block_runs(layout, seq_len, q_block * a, a), block_runs(layout, seq_len, kv_block * a, a), mask))


@functools.lru_cache(maxsize=65536)
def rows_read(layout: Layout, mask: MaskSpec, seq_len: int, a: int, q_block: int, kv_block: int) -> int:
    """K/V rows of block `kv_block` that block `q_block`'s plans read."""
    return sum(r.stop - r.start for r in needed_rows(block_plan(layout, mask, seq_len, a, q_block, kv_block)))


@functools.lru_cache(maxsize=1024)
def head_splits(heads: int, kv_heads: int, a: int) -> tuple[tuple[int, int], ...]:
    """(query heads, K/V heads) of each rank of an all-to-all block of `a` ranks (as `alltoall` splits them)."""
    q_ranges = query_head_ranges(heads, a)
    kv_ranges = kv_head_ranges(q_ranges, heads // kv_heads)
    return tuple((hi - lo, khi - klo) for (lo, hi), (klo, khi) in zip(q_ranges, kv_ranges))


def head_split(call: AttentionCall, a: int, index: int) -> tuple[int, int]:
    """(query heads, K/V heads) of the rank at `index` in an all-to-all block of `a` ranks."""
    return head_splits(call.heads, call.kv_heads, a)[index]


def gather_work(call: AttentionCall, a: int, rank: int) -> RankWork:
    """`rank`'s kernel calls under all-gather: its own shard while the gather travels, then the others'."""
    layout, mask, n = call.layout, call.mask, call.seq_len
    others = tuple(t for src in range(call.world) if src != rank for t in block_plan(layout, mask, n, 1, rank, src))
    return RankWork((block_plan(layout, mask, n, 1, rank, rank), others), call.heads, call.kv_heads)


def ring_family_work(call: AttentionCall, a: int, rank: int) -> RankWork:
    """`rank`'s kernel calls per ring round under the all-to-all family with blocks of `a` ranks."""
    layout, mask, n = call.layout, call.mask, call.seq_len
    blocks, (b, i) = call.world // a, divmod(rank, a)
    heads, kv = head_split(call, a, i)
    rounds = tuple(block_plan(layout, mask, n, a, b, (b - s) % blocks) for s in range(blocks))
    return RankWork(rounds, heads, kv)


def _alltoall(a: int, rank: int, phase: str, what: str, per_peer: Sequence[int], itemsize: int,
              out: list[Transfer]) -> None:
    """One all-to-all inside `rank`'s block: `per_peer[j]` elements to block index j (own piece not sent)."""
    b, i = divmod(rank, a)
    for j in range(a):
        if j != i and per_peer[j]:
            nbytes = per_peer[j] * itemsize
            out.append(Transfer(phase, COLLECTIVE, "all_to_all", what, b * a + j, nbytes, 1))  # type: ignore[arg-type]


def gather_transfers(call: AttentionCall, a: int, rank: int) -> list[Transfer]:
    """Everything `rank` sends in one forward+backward under all-gather (see the module docstring).

    Every rank sends the rows others read, padded to the most any rank has.
    """
    P, B = call.world, call.batch
    dk, dv, es, acc = call.head_dim, call.dv, call.itemsize, call.acc_itemsize
    out: list[Transfer] = []
    shard = B * call.kv_heads * gathered_width(call.layout, call.mask, call.seq_len, P) * (dk + dv)
    if shard == 0:  # nobody reads another rank's keys: the code gathers nothing
        return out
    nxt = (rank + 1) % P
    for phase in ("fwd", "bwd"):
        nbytes = (P - 1) * shard * es
        out.append(Transfer(phase, COLLECTIVE, "all_gather", "kv", nxt, nbytes, P - 1))  # type: ignore[arg-type]
    out.append(Transfer("bwd", COLLECTIVE, "reduce_scatter", "dkv", nxt, (P - 1) * shard * acc, P - 1))
    return out


def ring_family_transfers(call: AttentionCall, a: int, rank: int) -> list[Transfer]:
    """Everything `rank` sends in one forward+backward under the all-to-all family (see the module docstring)."""
    if call.head_chunks > 1:
        return _chunked_transfers(call, a, rank)
    P, S, B = call.world, call.local_len, call.batch
    dk, dv, es, acc = call.head_dim, call.dv, call.itemsize, call.acc_itemsize
    out: list[Transfer] = []
    blocks, (b, i) = P // a, divmod(rank, a)
    splits = head_splits(call.heads, call.kv_heads, a)
    hq, hk = splits[i]
    # Forward all-to-all: q heads and K/V heads of each peer, for my S tokens.
    _alltoall(a, rank, "fwd", "qkv", [B * S * (h * dk + k * (dk + dv)) for h, k in splits], es, out)
    ring_kv = B * hk * (dk + dv)  # elements per K/V row of my heads
    layout, mask, n = call.layout, call.mask, call.seq_len
    for phase in ("fwd", "bwd"):
        for s in range(1, blocks):
            dst, src = ((b + s) % blocks) * a + i, ((b - s) % blocks) * a + i
            send = rows_read(layout, mask, n, a, (b + s) % blocks, b)
            if send:
                out.append(Transfer(phase, s, "p2p", "kv", dst, send * ring_kv * es, 2))  # type: ignore[arg-type]
            got = rows_read(layout, mask, n, a, b, (b - s) % blocks)
            if phase == "bwd" and got:  # dK/dV of the rows I read from src, going home
                out.append(Transfer("bwd", s, "p2p", "dkv", src, got * ring_kv * acc, 2))
        if phase == "fwd":  # output home (and the LSE when the caller wants it)
            _alltoall(a, rank, "fwd", "out", [B * S * hq * dv] * a, es, out)
            if call.need_lse:
                _alltoall(a, rank, "fwd", "lse", [B * S * hq] * a, acc, out)
    _alltoall(a, rank, "bwd", "dout", [B * S * h * dv for h, _ in splits], es, out)  # dout out
    _alltoall(a, rank, "bwd", "dqkv", [B * S * (hq * dk + hk * (dk + dv))] * a, es, out)  # dq, dk, dv home
    return out


def _chunked_transfers(call: AttentionCall, a: int, rank: int) -> list[Transfer]:
    """Head-chunked all-to-all (`strategies/alltoall_chunked.py`): per chunk, the plain exchange of its heads with the
    LSE always sent home, and in backward the chunk's q, k, v, out and LSE sent to the head shards again."""
    n = call.head_chunks
    chunk = replace(call, heads=call.heads // n, kv_heads=call.kv_heads // n, head_chunks=1, need_lse=True)
    sent = ring_family_transfers(chunk, a, rank)
    B, S, dk, dv = call.batch, call.local_len, call.head_dim, call.dv
    splits = head_splits(chunk.heads, chunk.kv_heads, a)
    _alltoall(a, rank, "bwd", "qkv", [B * S * (h * dk + k * (dk + dv)) for h, k in splits], call.itemsize, sent)
    _alltoall(a, rank, "bwd", "out", [B * S * h * dv for h, _ in splits], call.itemsize, sent)
    _alltoall(a, rank, "bwd", "lse", [B * S * h for h, _ in splits], call.acc_itemsize, sent)
    return sent * n  # every chunk sends alike
