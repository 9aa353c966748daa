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
  its diagonal tiles (`causal_tile`: the kernel skips whole tiles only). When more
  ranks share a node than it has compute slots (CPU cores here), compute slows by that ratio,
  and so does communication (gloo's loopback transport runs on the same cores).
* ring rounds overlap: the K/V of round s is posted before round s-1 computes, so a
  round costs max(compute, transfer) when `overlap` = 1 and compute + transfer when 0
  (in between: the hidden fraction). A transfer is latency + bytes / bandwidth of
  its link level, the larger of what the rank sends and receives (full duplex).
  Backward rounds also carry the previous round's dK/dV home; the last one is waited
  for at the end.
* collectives do not overlap: an all-gather / reduce-scatter is the ring algorithm,
  (P-1) x (latency + shard / bandwidth) on the slowest link of the group; an
  all-to-all is one latency plus, per link level, the bytes sent at that level over
  its bandwidth (levels run in parallel). Both reach a measured fraction of the link
  bandwidth (`*_efficiency`). The reorders and concatenations around them run at
  `copy_bandwidth`.

Peak extra memory per rank (beyond the q, k, v, out shards every strategy holds) is
counted from the buffers the code allocates: all-gather holds the whole K/V (two
copies, and the whole float32 dK/dV in backward); all-to-all keeps full-sequence
q/k/v/out of its H/P heads from forward to backward; the ring holds two K/V blocks in
flight and two float32 dK/dV blocks in backward, with float32 accumulators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpcompose.attention.blocks import BlockTask
from cpcompose.planning.calibration import INTER, INTRA, LEVELS, Calibration, Topology
from cpcompose.planning.call import AttentionCall
from cpcompose.planning.traffic import COLLECTIVE, RankWork, Transfer, block_size, rows_read, transfers, work

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


def _level_time(by_level: dict[str, float], cal: Calibration, efficiency: float = 1.0) -> float:
    """Parallel levels: the slowest one's latency + bytes / bandwidth (nothing sent: 0)."""
    times = [cal.link(lv).latency_s + b / (cal.link(lv).bandwidth * efficiency) for lv, b in by_level.items() if b]
    return max(times, default=0.0)


def _ring_time(comp: Sequence[float], comm: Sequence[float], overlap: float) -> float:
    """Rounds with round s's transfer (s >= 1) posted before round s-1 computes."""
    total = comp[0]
    for s in range(1, len(comp)):
        total += (1 - overlap) * comm[s] + overlap * max(0.0, comm[s] - comp[s - 1]) + comp[s]
    return total


def predict(call: AttentionCall, strategy: str, topology: Topology, calibration: Calibration,
            alltoall_size: int | None = None, *, backward: bool = True) -> StrategyCost:
    """The cost of one strategy on this call (see the module docstring for each term).

    `backward=False` predicts the forward alone (inference prefill): time, compute,
    bytes and messages of the forward; memory stays that of training.
    """
    phases = ("fwd", "bwd") if backward else ("fwd",)
    P, cal = call.world, calibration
    a = block_size(strategy, P, alltoall_size)
    blocks = 1 if strategy == "allgather" else P // a
    slow = max(1.0, topology.on_node(P) / cal.compute_slots_per_node) if cal.compute_slots_per_node else 1.0
    group_level = INTER if topology.node(0) != topology.node(P - 1) else INTRA
    sent = [[t for t in transfers(call, strategy, a, r) if t.phase in phases] for r in range(P)]
    received: dict[tuple[int, str, int, str], list[tuple[str, int]]] = {}
    for r, ts in enumerate(sent):
        for t in ts:
            if t.round != COLLECTIVE:
                key = (t.peer, t.phase, t.round, t.what)
                received.setdefault(key, []).append((topology.level(r, t.peer), t.nbytes))
    times, computes, by_level, totals, messages, memory = [], [], {lv: 0 for lv in LEVELS}, [], 0, 0
    for rank in range(P):
        rw = work(call, strategy, a, rank)
        costs = [[task_costs(t, rw, call, cal) for t in rnd] for rnd in rw.rounds]
        fwd = [slow * sum(c[0] for c in rnd) for rnd in costs]
        bwd = [slow * sum(c[1] for c in rnd) for rnd in costs]
        level_bytes = {lv: 0 for lv in LEVELS}
        mine: dict[tuple[str, int, str], list[tuple[str, int]]] = {}
        for t in sent[rank]:
            level_bytes[topology.level(rank, t.peer)] += t.nbytes
            mine.setdefault((t.phase, t.round, t.what), []).append((topology.level(rank, t.peer), t.nbytes))
        total = slow * _collective_time(call, strategy, a, sent[rank], rank, topology, group_level, cal, backward)
        for phase, comp in (("fwd", fwd), ("bwd", bwd))[: len(phases)]:
            comm = [0.0] * blocks
            for s in range(1, blocks):
                # the K/V of round s; in backward with them the dK/dV of round s-1 going home
                out = _sum_levels(mine.get((phase, s, "kv"), []) + mine.get((phase, s - 1, "dkv"), []))
                inn = _sum_levels(received.get((rank, phase, s, "kv"), [])
                                  + received.get((rank, phase, s - 1, "dkv"), []))
                comm[s] = slow * max(_level_time(out, cal), _level_time(inn, cal))
            total += _ring_time(comp, comm, cal.overlap)
            if phase == "bwd" and blocks > 1:
                total += slow * _level_time(_sum_levels(mine.get(("bwd", blocks - 1, "dkv"), [])), cal)
        times.append(total)
        computes.append(sum(fwd) + (sum(bwd) if backward else 0.0))
        for lv in LEVELS:
            by_level[lv] = max(by_level[lv], level_bytes[lv])
        totals.append(sum(level_bytes.values()))
        messages = max(messages, sum(t.messages for t in sent[rank]))
        memory = max(memory, peak_memory(call, strategy, a, rank))
    return StrategyCost(strategy, alltoall_size if strategy == "alltoall_ring" else None, max(times), max(computes),
                        tuple(by_level.items()), tuple(totals), messages, memory)


def _sum_levels(pairs: Sequence[tuple[str, int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for lv, b in pairs:
        out[lv] = out.get(lv, 0) + b
    return out


def _collective_time(call: AttentionCall, strategy: str, a: int, ts: Sequence[Transfer], rank: int,
                     topology: Topology, group_level: str, cal: Calibration, backward: bool = True) -> float:
    """All-gather / reduce-scatter / all-to-all time of one rank, plus the copies around them."""
    total = 0.0
    if strategy == "allgather":
        link = cal.link(group_level)
        for t in ts:  # ring algorithm: P-1 steps, each on the group's slowest link
            total += t.messages * link.latency_s + t.nbytes / (link.bandwidth * cal.allgather_efficiency)
        full_kv = call.batch * call.kv_heads * call.seq_len * (call.head_dim + call.dv)
        copies = 3 * full_kv * call.itemsize  # cat, unbind-cat, reorder
        if backward:  # the same again, and the float32 dK/dV reordered and stacked
            copies += 3 * full_kv * call.itemsize + 3 * full_kv * call.acc_itemsize
        return total + copies / cal.copy_bandwidth
    a2a = [t for t in ts if t.op == "all_to_all"]
    if not a2a:
        return 0.0
    calls = 2 + int(call.need_lse) + (2 if backward else 0)
    by_level = _sum_levels([(topology.level(rank, t.peer), t.nbytes) for t in a2a])
    total += _level_time(by_level, cal, cal.alltoall_efficiency)
    total += (calls - 1) * max(cal.link(lv).latency_s for lv in by_level)
    exchanged = sum(t.nbytes for t in a2a) * a / max(a - 1, 1)  # own piece is copied too
    return total + 3 * exchanged / cal.copy_bandwidth  # flatten, concatenate, reorder


def peak_memory(call: AttentionCall, strategy: str, a: int, rank: int) -> int:
    """Peak extra bytes on `rank` (see the module docstring): saved tensors + the larger pass's buffers."""
    B, S, L, dk, dv = call.batch, call.local_len, call.seq_len, call.head_dim, call.dv
    es, acc = call.itemsize, call.acc_itemsize
    if strategy == "allgather":
        full_kv = B * call.kv_heads * L * (dk + dv)
        lse = B * call.heads * S * acc
        fwd = 2 * full_kv * es + B * call.heads * S * (dv + 1) * acc
        bwd = 2 * full_kv * es + 3 * full_kv * acc + B * call.heads * S * dk * acc
        return lse + max(fwd, bwd)
    rw = work(call, strategy, a, rank)
    blocks, (b, _) = call.world // a, divmod(rank, a)
    la, hq, hk = a * S, rw.heads, rw.kv_heads
    kv_rows = max((rows_read(call.layout, call.mask, L, a, b, (b - s) % blocks) for s in range(1, blocks)), default=0)
    kv_block = kv_rows * B * hk * (dk + dv)
    saved = B * hq * la * acc  # the LSE
    if a > 1:  # head-sharded q, k, v, out kept for backward
        saved += B * la * (hq * dk + hk * (dk + dv) + hq * dv) * es
    fwd = B * hq * la * (dv + 1) * acc + 2 * kv_block * es
    grads = B * la * (hq * dk + hk * (dk + dv))
    bwd = grads * acc + 2 * kv_block * (es + acc) + (grads * es + B * hq * la * dv * es if a > 1 else 0)
    return saved + max(fwd, bwd)
