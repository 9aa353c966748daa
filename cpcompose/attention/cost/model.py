"""The cost model: predicted time, bytes per link level, messages and memory of each strategy.

Time of one forward+backward, per rank, then the slowest rank (the others wait for it
at the next collective or ring round):

* kernel calls: each block task costs `kernel_call_s` (launch, Python, slicing) plus
  its FLOPs at the kernel's throughput for a block that size (small blocks run
  slower: that is what makes packed short documents and narrow windows expensive),
  plus the float32 LSE merge of its rows (forward) and the float32 accumulation of
  its dQ/dK/dV (backward). FLOPs: 7 * (Dk + Dv) * computed pairs * B * heads (forward
  2 (Dk + Dv), backward 2.5x that); a band block pays for all its pairs (the masked
  kernel computes them), a causal one for the lower triangle plus the upper half of
  its diagonal tiles (`causal_tile`: the kernel skips whole tiles only). The tasks
  are the calls the executor runs (`kernel_calls`): on PyTorch's CPU kernel
  (`Calibration.executor` "cpu_gloo") every causal block of more than 256 rows runs
  as the row tiles of `cpcompose.attention.local.cpu_tiles`, each costed as a call of its
  own, except all-to-all's single whole-sequence call (`blocks.one_kernel_call`).
  When more ranks share a node than it has compute slots (CPU cores here), compute
  slows by that ratio, and so does communication (gloo's loopback transport runs on
  the same cores).
* a transfer posted before some compute and waited for after it costs, with that
  compute, max(compute, transfer) when `overlap` = 1 and compute + transfer when 0
  (in between: the hidden fraction). A point-to-point transfer is latency + bytes /
  bandwidth of its link level, the larger of what the rank sends and receives (full
  duplex).
* ring rounds: the K/V of round s is posted before round s-1 computes. Backward
  rounds also carry the previous round's dK/dV home; the local blocks are split in
  two halves of equal work (`split_work`, as `ring_backward` runs them): the first
  is round 0, the second runs while the last round's dK/dV go home.
* all-gather: forward = (gather with the own shard's blocks) + the other shards'
  blocks; backward = (gather with the first half of the own blocks) + the other
  shards' blocks + (gradient reduction with the second half), each pair combined as
  above. The gather is the ring algorithm, (P-1) x (latency + shard / bandwidth) on
  the slowest link of the group at `allgather_efficiency`; so is the reduction on
  "cuda_nccl" (NCCL's reduce-scatter), while on "cpu_gloo" it is an all-to-all (as
  below) and a float sum of the P received slices (`merge_s_per_elem` per element
  added) after the wait. What travels is each rank's needed rows (those another
  rank reads, `attention.local.plans.gathered_rows`), padded to the widest rank's. Copies
  at `copy_bandwidth`, as the code makes them: the needed K and V rows packed into
  one buffer before each gather; in backward the float32 dK/dV of every rank's
  gathered rows and of the own shard zero-filled (with the first half), and the
  reduced rows added to the own after the wait. The gathered buffer is read in place.
* all-to-all does not overlap: one latency plus, per link level, the bytes sent at
  that level over its bandwidth (levels run in parallel), at `alltoall_efficiency`,
  plus a latency per further all-to-all of the pass; the reorders and concatenations
  around it run at `copy_bandwidth`.

Peak extra memory per rank (beyond the q, k, v, out shards every strategy holds) is
counted from the buffers the code allocates: all-gather holds every rank's gathered
rows once (read in place; the whole K/V when every row is read elsewhere) and its own
packed rows, and in backward their float32 dK/dV (twice on "cpu_gloo": the
all-to-all's receive buffer) and the own shard's; all-to-all keeps
full-sequence q/k/v/out of its H/P heads from forward to backward (with `head_chunks` = n, only the local
LSE is kept, and the head-sharded tensors and buffers are one chunk's: H/(nP) heads, in backward too, where
the chunk's q/k/v/out/dO are exchanged again); the ring holds two
K/V blocks in flight and two float32 dK/dV blocks in backward, with float32
accumulators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cpcompose.attention.local import cpu_tiles
from cpcompose.attention.local.blocks import BlockTask, one_kernel_call, split_work
from cpcompose.attention.cost.calibration import INTER, INTRA, LEVELS, Calibration, Topology
from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.cost.traffic import (
    COLLECTIVE,
    RankWork,
    Transfer,
    gather_transfers,
    gather_work,
    ring_family_transfers,
    ring_family_work,
    rows_read,
)
from cpcompose.attention.local.plans import gathered_width

__all__ = [
    "GATHER", "RING_FAMILY", "CostModel", "Modelled", "StrategyCost", "bytes_sent", "kernel_calls", "predict",
    "task_costs",
]

FWD_SHARE = 2 / 7  # forward FLOPs / forward+backward FLOPs (flash-attn's 2.5x backward)


@dataclass(frozen=True)
class StrategyCost:
    """The prediction for one strategy (one factorisation for `alltoall_ring`).

    Attributes:
        time_s: forward+backward, slowest rank.
        compute_s: the slowest rank's kernel and merge time.
        bytes_by_level: bytes one rank sends per link level ("intra", "inter"), max over ranks.
        bytes_per_rank: total bytes each rank sends (what a `CommMeter` counts), by rank.
        messages: point-to-point messages one rank sends (a collective counted as its
            ring / pairwise algorithm's messages), max over ranks.
        peak_memory_bytes: peak extra memory, max over ranks.
    """

    strategy: str
    alltoall_size: int | None
    time_s: float
    compute_s: float
    bytes_by_level: tuple[tuple[str, int], ...]
    bytes_per_rank: tuple[int, ...]
    messages: int
    peak_memory_bytes: int

    @property
    def label(self) -> str:
        return self.strategy if self.alltoall_size is None else f"{self.strategy}(a={self.alltoall_size})"


def task_costs(task: BlockTask, rw: RankWork, call: AttentionCall, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) seconds of one kernel call on all of this rank's heads."""
    nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
    pairs = nq * (nq + 1) / 2 + nq * min(cal.causal_tile, nq) / 2 if task.kind == "causal" else float(nq * nk)
    flops = 7 * (call.head_dim + call.dv) * pairs * call.batch * rw.heads
    seconds = flops / cal.throughput(min(nq, nk))
    merge = call.batch * rw.heads * nq * call.dv
    accumulate = call.batch * (rw.heads * nq * call.head_dim + rw.kv_heads * nk * (call.head_dim + call.dv))
    half = cal.kernel_call_s / 2
    return (half + FWD_SHARE * seconds + merge * cal.merge_s_per_elem,
            half + (1 - FWD_SHARE) * seconds + accumulate * cal.merge_s_per_elem)


def kernel_calls(tasks: Sequence[BlockTask], cal: Calibration) -> Sequence[BlockTask]:
    """The kernel calls the calibration's executor runs for `tasks`.

    On "cpu_gloo", `forward_blocks`/`backward_blocks` run every causal block as its row
    tiles (`cpu_tiles.cpu_tasks`, the one owner of that rule); elsewhere one call a task.
    """
    if cal.executor != "cpu_gloo":
        return tasks
    return cpu_tiles.cpu_tasks(list(tasks))  # a list: the runtime's tiling cache keeps only the code's own plans


_Memo = dict[tuple[int, int, bool, int, int, str, int], tuple[float, float]]


class _Passes:
    """(forward, backward) seconds of task lists on one rank, as the executor runs them.

    Memoised by block shape (in `memo`, shared by one prediction's ranks): a task's
    kernel calls and their costs depend only on its sizes, kind and window and on the
    rank's heads, and a long sequence's plans repeat a few shapes many times (a causal
    block of n rows is ~n/64 tiles on the CPU kernel).
    """

    def __init__(self, rw: RankWork, call: AttentionCall, cal: Calibration, memo: _Memo, *,
                 one_call: bool = False) -> None:
        self.rw, self.call, self.cal, self.memo, self.one_call = rw, call, cal, memo, one_call  # one_call: untiled

    def __call__(self, tasks: Sequence[BlockTask]) -> tuple[float, float]:
        fwd = bwd = 0.0
        for t in tasks:
            key = (self.rw.heads, self.rw.kv_heads, self.one_call, t.q.stop - t.q.start, t.kv.stop - t.kv.start,
                   t.kind, t.window)
            cost = self.memo.get(key)
            if cost is None:
                f = b = 0.0
                for c in (t,) if self.one_call else kernel_calls((t,), self.cal):
                    cf, cb = task_costs(c, self.rw, self.call, self.cal)
                    f, b = f + cf, b + cb
                cost = self.memo[key] = (f, b)
            fwd, bwd = fwd + cost[0], bwd + cost[1]
        return fwd, bwd


def _hidden(comp: float, comm: float, overlap: float) -> float:
    """Compute with a transfer posted before it and waited for after it (`overlap` of the shorter hidden)."""
    return comp + (1 - overlap) * comm + overlap * max(0.0, comm - comp)


def _level_time(by_level: dict[str, float], cal: Calibration, efficiency: float = 1.0) -> float:
    """Parallel levels: the slowest one's latency + bytes / bandwidth (nothing sent: 0)."""
    times = [cal.link(lv).latency_s + b / (cal.link(lv).bandwidth * efficiency) for lv, b in by_level.items() if b]
    return max(times, default=0.0)


def _ring_time(comp: Sequence[float], comm: Sequence[float], overlap: float) -> float:
    """Rounds with round s's transfer (s >= 1) posted before round s-1 computes."""
    return sum(_hidden(comp[s - 1], comm[s], overlap) for s in range(1, len(comp))) + comp[-1]


_Received = dict[tuple[int, str, int, str], list[tuple[str, int]]]


@dataclass(frozen=True)
class CostModel:
    """How the cost model counts one family of strategies (`a`: ranks per all-to-all block).

    Attributes:
        work: `(call, a, rank) -> RankWork`, the rank's kernel calls per round.
        transfers: `(call, a, rank) -> [Transfer]`, everything the rank sends (the meter's count).
        time: `(call, strategy, a, work, sent, received, rank, topology, group_level, calibration, memo,
            backward) -> (time, compute)` of one rank, before the node's slow-down.
        memory: `(call, a, rank, calibration) -> bytes`, peak extra memory of the rank.
    """

    work: Callable[[AttentionCall, int, int], RankWork]
    transfers: Callable[[AttentionCall, int, int], list[Transfer]]
    time: Callable[..., tuple[float, float]]
    memory: Callable[[AttentionCall, int, int, Calibration], int]


class Modelled(Protocol):
    """What the cost model reads of a strategy's record (`cpcompose.attention.strategies.strategy.Strategy`)."""

    name: str
    cost: CostModel
    takes_alltoall_size: bool
    whole_sequence_call: bool

    def block_size(self, world: int, alltoall_size: int | None) -> int: ...


def bytes_sent(call: AttentionCall, strategy: Modelled, a: int, rank: int) -> dict[str, int]:
    """Bytes `rank` sends per forward+backward, by `CommMeter` key (what a meter would count)."""
    totals: dict[str, int] = {}
    for t in strategy.cost.transfers(call, a, rank):
        totals[t.op] = totals.get(t.op, 0) + t.nbytes
    return totals


def predict(call: AttentionCall, strategy: Modelled, topology: Topology, calibration: Calibration,
            alltoall_size: int | None = None, *, backward: bool = True) -> StrategyCost:
    """The cost of one strategy (its registry record) on this call (see the module docstring for each term).

    `backward=False` predicts the forward alone (inference prefill): time, compute,
    bytes and messages of the forward; memory stays that of training.
    """
    phases = ("fwd", "bwd") if backward else ("fwd",)
    P, cal, model = call.world, calibration, strategy.cost
    a = strategy.block_size(P, alltoall_size)
    slow = max(1.0, topology.on_node(P) / cal.compute_slots_per_node) if cal.compute_slots_per_node else 1.0
    group_level = INTER if topology.node(0) != topology.node(P - 1) else INTRA
    sent = [[t for t in model.transfers(call, a, r) if t.phase in phases] for r in range(P)]
    received: _Received = {}
    for r, ts in enumerate(sent):
        for t in ts:
            if t.round != COLLECTIVE:
                key = (t.peer, t.phase, t.round, t.what)
                received.setdefault(key, []).append((topology.level(r, t.peer), t.nbytes))
    times, computes, by_level, totals, messages, memory = [], [], {lv: 0 for lv in LEVELS}, [], 0, 0
    memo: _Memo = {}
    for rank in range(P):
        rw = model.work(call, a, rank)
        total, compute = model.time(call, strategy, a, rw, sent[rank], received, rank, topology, group_level, cal,
                                    memo, backward)
        times.append(slow * total)
        computes.append(slow * compute)
        level_bytes = {lv: 0 for lv in LEVELS}
        for t in sent[rank]:
            level_bytes[topology.level(rank, t.peer)] += t.nbytes
        for lv in LEVELS:
            by_level[lv] = max(by_level[lv], level_bytes[lv])
        totals.append(sum(level_bytes.values()))
        messages = max(messages, sum(t.messages for t in sent[rank]))
        memory = max(memory, model.memory(call, a, rank, cal))
    return StrategyCost(strategy.name, alltoall_size if strategy.takes_alltoall_size else None, max(times),
                        max(computes), tuple(by_level.items()), tuple(totals), messages, memory)


def _sum_levels(pairs: Sequence[tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for lv, b in pairs:
        out[lv] = out.get(lv, 0) + b
    return out


def _ring_family_time(call: AttentionCall, strategy: Modelled, a: int, rw: RankWork, ts: Sequence[Transfer],
                      received: _Received, rank: int, topology: Topology, group_level: str, cal: Calibration,
                      memo: _Memo, backward: bool) -> tuple[float, float]:
    """(time, compute) of one rank under ring, all-to-all or the 2-D strategy, before the node's slow-down."""
    blocks = len(rw.rounds)
    one_call = strategy.whole_sequence_call and one_kernel_call(rw.rounds[0], call.seq_len)
    passes = _Passes(rw, call, cal, memo, one_call=one_call)
    costs = [passes(r) for r in rw.rounds]
    fwd = [c[0] for c in costs]
    mine: dict[tuple[str, int, str], list[tuple[str, int]]] = {}
    for t in ts:
        mine.setdefault((t.phase, t.round, t.what), []).append((topology.level(rank, t.peer), t.nbytes))

    def comm(phase: str) -> list[float]:
        """Round s's transfer: its K/V, and in backward with them round s-1's dK/dV going home."""
        out = [0.0] * blocks
        for s in range(1, blocks):
            sends = _sum_levels(mine.get((phase, s, "kv"), []) + mine.get((phase, s - 1, "dkv"), []))
            gets = _sum_levels(received.get((rank, phase, s, "kv"), []) + received.get((rank, phase, s - 1, "dkv"), []))
            out[s] = max(_level_time(sends, cal), _level_time(gets, cal))
        return out

    total = _alltoall_time(call, a, ts, rank, topology, cal, backward) + _ring_time(fwd, comm("fwd"), cal.overlap)
    compute = sum(fwd)
    if backward:
        early, late = split_work(rw.rounds[0]) if blocks > 1 else (rw.rounds[0], ())
        bwd = [passes(early)[1]] + [c[1] for c in costs[1:]]
        late_bwd = passes(late)[1]
        last_dkv = _level_time(_sum_levels(mine.get(("bwd", blocks - 1, "dkv"), [])), cal) if blocks > 1 else 0.0
        total += _ring_time(bwd, comm("bwd"), cal.overlap) + _hidden(late_bwd, last_dkv, cal.overlap)
        compute += sum(bwd) + late_bwd
    return total, compute


def _allgather_time(call: AttentionCall, strategy: Modelled, a: int, rw: RankWork, ts: Sequence[Transfer],
                    received: _Received, rank: int, topology: Topology, group_level: str, cal: Calibration,
                    memo: _Memo, backward: bool) -> tuple[float, float]:
    """(time, compute) of one rank under all-gather (see the module docstring), before the node's slow-down."""
    local, others = rw.rounds
    passes = _Passes(rw, call, cal, memo)
    fwd_local, bwd_local = passes(local)
    fwd_others, bwd_others = passes(others)
    link = cal.link(group_level)
    gather = {t.phase: t.messages * link.latency_s + t.nbytes / (link.bandwidth * cal.allgather_efficiency)
              for t in ts if t.op == "all_gather"}
    row = call.batch * call.kv_heads * (call.head_dim + call.dv)
    shard_kv, sent_kv = call.local_len * row, gathered_width(call.layout, call.mask, call.seq_len, call.world) * row
    cat = sent_kv * call.itemsize / cal.copy_bandwidth  # the needed K and V rows packed end to end, before each gather
    if not gather:  # nothing to gather (`traffic.transfers`): the own blocks alone
        alone = fwd_local + (bwd_local if backward else 0.0)
        return alone, alone
    total = cat + _hidden(fwd_local, gather["fwd"], cal.overlap) + fwd_others
    compute = fwd_local + fwd_others
    if backward:
        early, late = split_work(local)
        bwd_early, bwd_late = (passes(half)[1] for half in (early, late))
        zeroed = (call.world * sent_kv + shard_kv) * call.acc_itemsize / cal.copy_bandwidth  # gathered + own dK/dV
        added = sent_kv * call.acc_itemsize / cal.copy_bandwidth  # the reduced rows into the own dK/dV, after the wait
        reduce, summing = _reduction_time(next(t for t in ts if t.op == "reduce_scatter"), call, rank, topology,
                                          group_level, cal)
        total += (cat + _hidden(zeroed + bwd_early, gather["bwd"], cal.overlap) + bwd_others
                  + _hidden(bwd_late, reduce, cal.overlap) + summing + added)
        compute += bwd_early + bwd_others + bwd_late
    return total, compute


def _reduction_time(t: Transfer, call: AttentionCall, rank: int, topology: Topology, group_level: str,
                    cal: Calibration) -> tuple[float, float]:
    """(transfer, local sum after it) of the gradients' reduce-scatter, as the executor's backend runs it.

    `comm.start_reduce_scatter`: on gloo an all-to-all of the P slices and a float sum
    of what arrives (the same bytes); on NCCL the ring reduce-scatter.
    """
    P = call.world
    if P == 1 or t.nbytes == 0:
        return 0.0, 0.0
    if cal.executor == "cpu_gloo":
        per_peer = t.nbytes / (P - 1)
        by_level = _sum_levels([(topology.level(rank, p), per_peer) for p in range(P) if p != rank])
        added = t.nbytes / call.acc_itemsize  # (P - 1) slices of the shard's elements added to one
        return _level_time(by_level, cal, cal.alltoall_efficiency), added * cal.merge_s_per_elem
    link = cal.link(group_level)
    return t.messages * link.latency_s + t.nbytes / (link.bandwidth * cal.allgather_efficiency), 0.0


def _alltoall_time(call: AttentionCall, a: int, ts: Sequence[Transfer], rank: int, topology: Topology,
                   cal: Calibration, backward: bool = True) -> float:
    """All-to-all time of one rank (none for the ring), plus the copies around them."""
    a2a = [t for t in ts if t.op == "all_to_all"]
    if not a2a:
        return 0.0
    calls = 2 + int(call.need_lse) + (2 if backward else 0)
    if call.head_chunks > 1:  # per chunk: q/k/v, out, LSE; in backward q/k/v/out/dO, LSE, dQ/dK/dV
        calls = call.head_chunks * (3 + (3 if backward else 0))
    by_level = _sum_levels([(topology.level(rank, t.peer), t.nbytes) for t in a2a])
    total = _level_time(by_level, cal, cal.alltoall_efficiency)
    total += (calls - 1) * max(cal.link(lv).latency_s for lv in by_level)
    exchanged = sum(t.nbytes for t in a2a) * a / max(a - 1, 1)  # own piece is copied too
    return total + 3 * exchanged / cal.copy_bandwidth  # flatten, concatenate, reorder


def _allgather_memory(call: AttentionCall, a: int, rank: int, cal: Calibration) -> int:
    """Peak extra bytes on `rank` under all-gather (see the module docstring)."""
    B, S, L, dk, dv = call.batch, call.local_len, call.seq_len, call.head_dim, call.dv
    es, acc = call.itemsize, call.acc_itemsize
    row = B * call.kv_heads * (dk + dv)
    sent = gathered_width(call.layout, call.mask, L, call.world) * row  # this rank's packed rows (the widest)
    gathered, shard = call.world * sent, S * row
    lse = B * call.heads * S * acc
    fwd = (gathered + sent) * es + B * call.heads * S * (dv + 1) * acc  # gathered, sent, output accumulator
    received = gathered if cal.executor == "cpu_gloo" else sent  # all-to-all's P slices / reduce-scatter's one
    grads = gathered + received + shard  # the gathered rows' dK/dV, the reduction's result, the own dK/dV
    bwd = (gathered + sent) * es + grads * acc + B * call.heads * S * dk * acc
    return lse + max(fwd, bwd)


def _ring_family_memory(call: AttentionCall, a: int, rank: int, cal: Calibration) -> int:
    """Peak extra bytes on `rank` under the all-to-all family: saved tensors + the larger pass's buffers."""
    if call.head_chunks > 1:  # the local LSE is kept; everything else is one chunk's plain all-to-all, in turn,
        # beside the backward's local dQ/dK/dV, which its chunks fill (torch's tracker: Llama-3-8B, 131k tokens a rank)
        n = call.head_chunks
        chunk = replace(call, heads=call.heads // n, kv_heads=call.kv_heads // n, head_chunks=1)
        local_grads = call.batch * call.local_len * (call.heads * call.head_dim + call.kv_heads * (call.head_dim
                                                                                                   + call.dv))
        return (call.batch * call.heads * call.local_len * call.acc_itemsize + local_grads * call.itemsize
                + _ring_family_memory(chunk, a, rank, cal))
    B, S, L, dk, dv = call.batch, call.local_len, call.seq_len, call.head_dim, call.dv
    es, acc = call.itemsize, call.acc_itemsize
    rw = ring_family_work(call, a, rank)
    blocks, (b, _) = call.world // a, divmod(rank, a)
    la, hq, hk = a * S, rw.heads, rw.kv_heads
    kv_rows = max((rows_read(call.layout, call.mask, L, a, b, (b - s) % blocks) for s in range(1, blocks)), default=0)
    kv_block = kv_rows * B * hk * (dk + dv)
    saved = B * hq * la * acc  # the LSE
    if a > 1:  # head-sharded q, k, v, out kept for backward
        saved += B * la * (hq * dk + hk * (dk + dv) + hq * dv) * es
    fwd = B * hq * la * (dv + 1) * acc + 2 * kv_block * es
    grads = B * la * (hq * dk + hk * (dk + dv))
    # backward: the K/V block working and the next one arriving, and three float32 dK/dV blocks in flight (the one
    # made, the one before on the wire, the one coming home), each a piece of the round's with `ring_tiles` pieces
    # (torch's tracker, Llama-3-8B at 131k tokens per rank)
    dkv = 3 * kv_block * acc // call.ring_tiles
    bwd = grads * acc + 2 * kv_block * es + dkv + (grads * es + B * hq * la * dv * es if a > 1 else 0)
    return saved + max(fwd, bwd)


RING_FAMILY = CostModel(ring_family_work, ring_family_transfers, _ring_family_time, _ring_family_memory)
"""Ring, all-to-all and 2-D: all-to-all inside blocks of `a` ranks, the ring across them."""

GATHER = CostModel(gather_work, gather_transfers, _allgather_time, _allgather_memory)
"""All-gather of the needed K/V rows, reduce-scatter of their gradients."""
