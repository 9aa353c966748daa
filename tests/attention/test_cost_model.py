"""The cost model (`cpcompose.attention.cost`): exact bytes, a deterministic choice, sensible trends.

The byte counts are checked against the `CommMeter` of real gloo runs, on every
rank, forward and forward+backward separately; everything else is pure arithmetic
(no process group): the choice is the same across processes and hash seeds, the
predictions move the way the physics says they must, and the model runs what the
code runs (the plans and halves of the attention code, the CPU kernel's row tiles,
the all-gather's and the ring's overlapped transfers, the reduction each backend
does). Times are compared at rel 1e-9: sums of the same float terms in another
order, far below any term the tests tell apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpcompose.attention.local import cpu_tiles
from cpcompose.attention.local.blocks import BlockTask, MaskSpec, split_work
from cpcompose.attention.call.choose import candidates, choose_strategy
from cpcompose.attention.cost import CPU_DEFAULT, H100_CLUSTER, AttentionCall, Calibration, StrategyCost, Topology
from cpcompose.attention.cost import predict as predict_record
from cpcompose.attention.cost.calibration import INTER, INTRA, Link
from cpcompose.attention.cost.model import kernel_calls, task_costs
from cpcompose.attention.cost.traffic import block_plan
from cpcompose.attention.local.plans import cached_halves, cached_plan
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.layouts import PackedLayout, resolve_layout
from tests.support.attention_cases import Case, run_cp
from tests.support.packed_cases import PackedCase, run_packed

ROOT = Path(__file__).resolve().parents[2]


def _window(w: object, causal: bool) -> MaskSpec:
    if w is None:
        return MaskSpec(causal)
    left, right = (w, 0) if isinstance(w, int) else w
    return MaskSpec(causal, left, right)


def predict(call: AttentionCall, strategy: str, *args, **kwargs) -> StrategyCost:
    """The cost model's prediction for the strategy registered as `strategy`."""
    return predict_record(call, STRATEGIES[strategy], *args, **kwargs)


def transfers(call: AttentionCall, strategy: str, a: int, rank: int) -> list:
    """What the model says `rank` sends under `strategy` with all-to-all blocks of `a` ranks."""
    return STRATEGIES[strategy].cost.transfers(call, a, rank)


def block_size(strategy: str, world: int, alltoall_size: int | None = None) -> int:
    return STRATEGIES[strategy].block_size(world, alltoall_size)


def work(call: AttentionCall, strategy: str, a: int, rank: int):
    return STRATEGIES[strategy].cost.work(call, a, rank)


def _metered(call: AttentionCall, strategy: str, rank: int) -> tuple[int, int]:
    """(forward, forward+backward) bytes the model says `rank` sends."""
    ts = transfers(call, strategy, block_size(strategy, call.world), rank)
    return sum(t.nbytes for t in ts if t.phase == "fwd"), sum(t.nbytes for t in ts)


DENSE = [
    Case("ring", "zigzag", True, 4, 2, 4, seq=128),
    Case("ring", "contiguous", False, 4, 4, 2, seq=128),
    Case("ring", "zigzag", True, 4, 1, 4, seq=256, window=24),
    Case("ring", "zigzag", False, 4, 2, 2, seq=128, window=(8, 16)),
    Case("allgather", "zigzag", True, 4, 2, 4, seq=128),
    Case("alltoall", "zigzag", True, 6, 3, 4, seq=128),  # uneven heads: 2, 2, 1, 1
    Case("alltoall", "zigzag", True, 4, 1, 4, seq=128),  # MQA: the K/V head goes to every rank
]


@pytest.mark.parametrize("case", DENSE, ids=str)
def test_bytes_equal_the_meter(pools, case: Case) -> None:
    """The model's bytes per rank are what cpcompose sends (run_cp asks for the LSE)."""
    call = AttentionCall(case.batch, case.heads, case.kv_heads, case.head_dim, case.seq,
                         resolve_layout(case.layout, case.world), _window(case.window, case.causal),
                         dtype=case.dtype, need_lse=True)
    for rank, result in enumerate(pools.get(case.world).run(run_cp, case)):
        assert (result["forward_bytes"], result["total_bytes"]) == _metered(call, case.strategy, rank)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_packed_bytes_equal_the_meter(pools, strategy: str) -> None:
    case = PackedCase(strategy, (70, 9, 33, 16), True, None, 4, 2, 4)
    layout = case.layout()
    call = AttentionCall(case.batch, case.heads, case.kv_heads, case.head_dim, layout.seq_len, layout,
                         MaskSpec(True), need_lse=True)
    for rank, result in enumerate(pools.get(4).run(run_packed, case)):
        assert (result["forward_bytes"], result["total_bytes"]) == _metered(call, strategy, rank)


def _call(world: int, seq: int = 1 << 17, window: int | None = None, heads: int = 32, kv: int = 8) -> AttentionCall:
    return AttentionCall(1, heads, kv, 128, seq, resolve_layout("zigzag", world), MaskSpec(True, window),
                         dtype="bfloat16")


def test_candidates_skip_the_degenerate_factorisations() -> None:
    assert candidates(2) == [("ring", None), ("allgather", None), ("alltoall", None)]
    assert candidates(8)[3:] == [("alltoall_ring", 2), ("alltoall_ring", 4)]
    assert candidates(4, ("ring", "alltoall")) == [("ring", None), ("alltoall", None)]


def test_choice_is_deterministic_and_complete() -> None:
    call = _call(16)
    first = choose_strategy(call, Topology(8), H100_CLUSTER, 16)
    again = choose_strategy(_call(16), Topology(8), H100_CLUSTER, 16)
    assert first == again
    assert [(c.strategy, c.alltoall_size) for c in first.costs] == candidates(16)
    assert first.predicted_s == min(c.time_s for c in first.costs)
    assert first.strategy in first.log_line() and first.calibration in first.log_line()
    with pytest.raises(ValueError, match="16 ranks"):
        choose_strategy(call, Topology(8), H100_CLUSTER, 8)


def test_ties_go_to_the_earlier_candidate(monkeypatch) -> None:
    """Equal predictions: the fixed candidate order decides, whatever order the caller lists them in."""
    from cpcompose.attention.call import choose

    def same(call, strategy, topology, calibration, alltoall_size=None, backward=True):
        return StrategyCost(strategy.name, alltoall_size, 1.0, 1.0, (), (), 0, 0)

    monkeypatch.setattr(choose, "predict", same)
    call = _call(8)
    assert choose_strategy(call, Topology(), CPU_DEFAULT, 8, ("alltoall_ring", "alltoall", "ring")).strategy == "ring"
    picked = choose_strategy(call, Topology(), CPU_DEFAULT, 8, ("alltoall_ring", "allgather"))
    assert picked.strategy == "allgather"


_CHILD = """
import json, sys
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.layouts import resolve_layout
from cpcompose.attention.call.choose import choose_strategy
from cpcompose.attention.cost import H100_CLUSTER, CPU_DEFAULT, AttentionCall, Topology
call = AttentionCall(1, 32, 8, 128, 1 << 17, resolve_layout("zigzag", 16), MaskSpec(True), dtype="bfloat16")
c = choose_strategy(call, Topology(8), H100_CLUSTER, 16)
print(json.dumps([H100_CLUSTER.fingerprint(), CPU_DEFAULT.fingerprint(), c.strategy, c.alltoall_size,
                  [x.time_s for x in c.costs]]))
"""


def test_same_answer_in_processes_with_other_hash_seeds() -> None:
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(done.stdout))
    assert outs[0] == outs[1]
    assert outs[0][:2] == [H100_CLUSTER.fingerprint(), CPU_DEFAULT.fingerprint()]


def test_calibration_round_trips_and_fingerprints_values(tmp_path) -> None:
    path = tmp_path / "cal.json"
    H100_CLUSTER.save(path)
    loaded = Calibration.load(path)
    assert loaded == H100_CLUSTER and loaded.fingerprint() == H100_CLUSTER.fingerprint()
    other = Calibration.from_dict({**H100_CLUSTER.to_dict(), "kernel_call_s": 1e-5})
    assert other.fingerprint() != H100_CLUSTER.fingerprint()
    with pytest.raises(ValueError, match="increasing"):
        Calibration.from_dict({**H100_CLUSTER.to_dict(), "kernel_flops": [[512, 1e12], [128, 1e12]]})


def test_topology_from_environment() -> None:
    assert Topology.from_env({"LOCAL_WORLD_SIZE": "8"}) == Topology(8)
    assert Topology.from_env({}) == Topology()
    assert Topology(4).level(3, 4) == "inter" and Topology(4).level(4, 7) == "intra"


def test_more_ranks_per_node_favour_the_all_to_all_inside() -> None:
    """A 2-D block of 8 on one node talks over NVLink; split over two nodes, part of it crosses IB."""
    call = _call(32, seq=1 << 18)
    one_node = predict(call, "alltoall_ring", Topology(8), H100_CLUSTER, 8)
    split = predict(call, "alltoall_ring", Topology(4), H100_CLUSTER, 8)
    assert one_node.time_s < split.time_s
    assert dict(one_node.bytes_by_level)["inter"] < dict(split.bytes_by_level)["inter"]
    assert sum(one_node.bytes_per_rank) == sum(split.bytes_per_rank)  # same bytes, other links
    # All-to-all gains on the ring when its peers move from InfiniBand to NVLink.
    call8 = _call(8, seq=1 << 15)
    ratio = [predict(call8, "alltoall", t, H100_CLUSTER).time_s / predict(call8, "ring", t, H100_CLUSTER).time_s
             for t in (Topology(1), Topology(8))]
    assert ratio[1] < ratio[0]


def test_windows_favour_the_ring() -> None:
    """A narrow window makes the ring send a halo, while all-to-all still moves every head."""
    wide, narrow = _call(16, window=None), _call(16, window=1024)
    ratio = [predict(c, "ring", Topology(8), H100_CLUSTER).time_s / predict(c, "alltoall", Topology(8), H100_CLUSTER)
             .time_s for c in (wide, narrow)]
    assert ratio[1] < ratio[0]
    assert choose_strategy(narrow, Topology(8), H100_CLUSTER, 16).strategy == "ring"
    ring = predict(narrow, "ring", Topology(8), H100_CLUSTER)
    assert max(ring.bytes_per_rank) < max(predict(narrow, "alltoall", Topology(8), H100_CLUSTER).bytes_per_rank) / 4


def test_memory_all_gather_holds_the_whole_kv() -> None:
    """All-gather's extra memory grows with the global length; the ring's stays a few shards."""
    short, long = _call(8, seq=1 << 16), _call(8, seq=1 << 18)
    ag = [predict(c, "allgather", Topology(8), H100_CLUSTER).peak_memory_bytes for c in (short, long)]
    ring = [predict(c, "ring", Topology(8), H100_CLUSTER).peak_memory_bytes for c in (short, long)]
    assert ag[1] == pytest.approx(4 * ag[0], rel=0.01)
    assert ring[1] < ag[1] / 2
    full_kv = 2 * 8 * (1 << 18) * 128 * 2  # bf16 K and V, all heads, the whole sequence
    assert ag[1] > 2 * full_kv


def test_packed_short_documents_cost_kernel_calls() -> None:
    """Many short documents: the same tokens cost more per FLOP (small blocks, many calls)."""
    world, n = 4, 1 << 14
    dense = AttentionCall(1, 8, 2, 64, n, resolve_layout("zigzag", world), MaskSpec(True))
    pack = PackedLayout.build(list(range(0, n + 1, 256)), world)
    packed = AttentionCall(1, 8, 2, 64, pack.seq_len, pack, MaskSpec(True))
    d, p = (predict(c, "ring", Topology(), CPU_DEFAULT) for c in (dense, packed))
    assert p.compute_s < d.compute_s  # far fewer visible pairs ...
    assert p.compute_s > d.compute_s * (256 / n)  # ... but more than their share of the FLOPs


def test_forward_only_is_the_forward_share() -> None:
    """Inference prefill: the forward's bytes exactly, and less time than training's pass."""
    call = _call(16, seq=1 << 16)
    for strategy, a in (("ring", None), ("allgather", None), ("alltoall", None), ("alltoall_ring", 4)):
        train = predict(call, strategy, Topology(8), H100_CLUSTER, a)
        infer = predict(call, strategy, Topology(8), H100_CLUSTER, a, backward=False)
        fwd = [sum(t.nbytes for t in transfers(call, strategy, block_size(strategy, 16, a), r) if t.phase == "fwd")
               for r in range(16)]
        assert list(infer.bytes_per_rank) == fwd
        assert 0.2 * train.time_s < infer.time_s < 0.5 * train.time_s  # forward FLOPs are 2/7 of the total


# --- The model runs what the code runs -------------------------------------------------------------------------------

def _links(bandwidth: float, latency: float) -> tuple:
    return ((INTRA, Link(bandwidth, latency)), (INTER, Link(bandwidth, latency)))


# CPU_DEFAULT's kernel; copies free, one compute slot per rank: only the terms under test move the time.
BARE = dataclasses.replace(CPU_DEFAULT, copy_bandwidth=float("inf"), compute_slots_per_node=None)


def _cost(tasks, rw, call, cal, i: int) -> float:
    """Forward (i=0) or backward (i=1) seconds of `tasks` as `cal`'s executor runs them."""
    return sum(task_costs(t, rw, call, cal)[i] for t in kernel_calls(tasks, cal))


def test_the_model_plans_and_halves_what_the_code_runs() -> None:
    """Ring and all-gather plan on each rank's own runs (a windowed zigzag rank holds two adjacent chunks that
    the grouped view would merge), and the backward's halves are the code's `split_work` halves."""
    layout, mask, n = resolve_layout("zigzag", 4), MaskSpec(True, 24), 1024
    for r in range(4):
        for src in range(4):
            assert block_plan(layout, mask, n, 1, r, src) == cached_plan(layout, mask, n, r, src)
        assert split_work(block_plan(layout, mask, n, 1, r, r)) == cached_halves(layout, mask, n, r)


def test_band_weights_count_the_visible_pairs() -> None:
    """`Band.count` (the closed form `split_work` weighs bands with) equals the mask's count, windows of either
    side bounded or not, bands that miss the block included."""
    import random

    from cpcompose.attention.local.kernels import UNBOUNDED, Band

    rng = random.Random(0)
    for _ in range(2000):
        nq, nk = rng.randint(1, 40), rng.randint(1, 40)
        band = Band(rng.randint(-60, 60), rng.choice([UNBOUNDED, rng.randint(0, 50)]),
                    rng.choice([UNBOUNDED, 0, rng.randint(0, 50)]))
        assert band.count(nq, nk) == int(band.visible(nq, nk).sum()), (band, nq, nk)


def test_cpu_calibration_costs_causal_blocks_as_their_tiles() -> None:
    """On the CPU kernel a causal block of more than 256 rows is its `cpu_tiles` tiles; one call elsewhere."""
    assert CPU_DEFAULT.executor == "cpu_gloo" and H100_CLUSTER.executor == "cuda_nccl"
    cuda = dataclasses.replace(BARE, executor="cuda_nccl")
    call = AttentionCall(1, 8, 2, 64, 2048, resolve_layout("contiguous", 2), MaskSpec(True))
    rw = work(call, "ring", 1, 1)  # rank 1: its causal 1024-block, then rank 0's keys in full
    causal, full = rw.rounds[0][0], rw.rounds[1][0]
    assert (causal.kind, causal.q.stop - causal.q.start, full.kind) == ("causal", 1024, "full")
    tiles = cpu_tiles.tile_causal(causal)
    assert len(tiles) == 31 and list(kernel_calls([causal, full], BARE)) == [*tiles, full]
    assert list(kernel_calls([causal, full], cuda)) == [causal, full]
    small = BlockTask(slice(0, 256), slice(0, 256), "causal")
    assert list(kernel_calls([small], BARE)) == [small]  # at most 256 rows: one call, as the code runs it
    expected = {}
    for name, cal, calls in (("cpu", BARE, tiles), ("cuda", cuda, [causal])):
        expected[name] = sum(sum(task_costs(t, rw, call, cal)) for t in [*calls, full])
        assert predict(call, "ring", Topology(), cal).compute_s == pytest.approx(expected[name], rel=1e-9)
    assert expected["cpu"] < 0.9 * expected["cuda"]  # 64-row tiles waste little of the 512-key causal tile
    # All-to-all's whole-sequence causal block is one kernel call (`alltoall.one_kernel_call`): never tiled.
    dense = _call(2, seq=4096)
    assert predict(dense, "alltoall", Topology(), BARE).compute_s == pytest.approx(
        predict(dense, "alltoall", Topology(), cuda).compute_s, rel=1e-9)


def _allgather_parts(call: AttentionCall, cal: Calibration, rank: int) -> dict[str, float]:
    rw = work(call, "allgather", call.world, rank)
    local, others = rw.rounds
    early, late = split_work(local)
    assert early and late  # both halves have work: each hides one collective
    return {"local": _cost(local, rw, call, cal, 0), "others": _cost(others, rw, call, cal, 0),
            "early": _cost(early, rw, call, cal, 1), "others_b": _cost(others, rw, call, cal, 1),
            "late": _cost(late, rw, call, cal, 1)}


def _collectives(call: AttentionCall, cal: Calibration, rank: int) -> dict[str, float]:
    """Ring-algorithm time of each all-gather / reduce-scatter `rank` runs (cal's group link, one node)."""
    link = cal.link(INTRA)
    return {f"{t.op}_{t.phase}": t.messages * link.latency_s + t.nbytes / (link.bandwidth * cal.allgather_efficiency)
            for t in transfers(call, "allgather", call.world, rank)}


def test_allgather_hides_its_collectives_behind_the_local_blocks() -> None:
    """A gather shorter than the own shard's blocks (and a reduction shorter than the second half) costs no time;
    with no overlap every collective adds up; a gather longer than the local blocks is waited for.
    (A pack: a dense zigzag rank's own keys are one causal block, whose second half is empty.)"""
    pack = PackedLayout.build([0, 300, 700, 1200, 2048], 2)
    call = AttentionCall(1, 4, 2, 32, pack.seq_len, pack, MaskSpec(True))
    fast = dataclasses.replace(BARE, executor="cuda_nccl", links=_links(1e10, 1e-6))
    for r in range(2):
        parts, comm = _allgather_parts(call, fast, r), _collectives(call, fast, r)
        assert comm["all_gather_bwd"] < parts["early"] and comm["reduce_scatter_bwd"] < parts["late"]
    hidden = predict(call, "allgather", Topology(), fast)
    assert hidden.time_s == pytest.approx(hidden.compute_s, rel=1e-9)
    serial = predict(call, "allgather", Topology(), dataclasses.replace(fast, overlap=0.0))
    want = max(sum(_allgather_parts(call, fast, r).values()) + sum(_collectives(call, fast, r).values())
               for r in range(2))
    assert serial.time_s == pytest.approx(want, rel=1e-9)
    slow = dataclasses.replace(fast, links=_links(1e7, 1e-3))  # the gather outlasts the local blocks
    waited = predict(call, "allgather", Topology(), slow, backward=False)
    want = []
    for r in range(2):
        parts, gather = _allgather_parts(call, slow, r), _collectives(call, slow, r)["all_gather_fwd"]
        assert gather > parts["local"]
        want.append(gather + parts["others"])
    assert waited.time_s == pytest.approx(max(want), rel=1e-9)


def test_gradient_reduction_as_the_backend_runs_it() -> None:
    """gloo ("cpu_gloo"): an all-to-all (one latency, alltoall_efficiency) and a float sum after the wait, with a
    receive buffer of P slices; NCCL ("cuda_nccl"): the ring reduce-scatter (P-1 latencies, allgather_efficiency)."""
    P = 4
    call = AttentionCall(1, 4, 2, 32, 1024, resolve_layout("contiguous", P), MaskSpec(False))  # untiled either way
    base = dataclasses.replace(BARE, overlap=0.0, links=_links(1e8, 1e-3), allgather_efficiency=0.5,
                               alltoall_efficiency=0.9)
    gloo, nccl = (predict(call, "allgather", Topology(), dataclasses.replace(base, executor=e))
                  for e in ("cpu_gloo", "cuda_nccl"))
    (reduction,) = [t for t in transfers(call, "allgather", P, 0) if t.op == "reduce_scatter"]
    link = base.link(INTRA)
    ring = (P - 1) * link.latency_s + reduction.nbytes / (link.bandwidth * 0.5)
    added = (P - 1) * call.batch * call.kv_heads * call.local_len * (call.head_dim + call.dv)
    alltoall = link.latency_s + reduction.nbytes / (link.bandwidth * 0.9) + added * base.merge_s_per_elem
    assert gloo.compute_s == nccl.compute_s and gloo.bytes_per_rank == nccl.bytes_per_rank
    assert gloo.time_s - nccl.time_s == pytest.approx(alltoall - ring, rel=1e-9)
    assert gloo.time_s < nccl.time_s
    assert gloo.peak_memory_bytes - nccl.peak_memory_bytes == reduction.nbytes  # the other P-1 received slices


def test_ring_hides_the_last_gradients_behind_the_second_half() -> None:
    """Transfers shorter than the compute they are posted over, the last dK/dV included, cost nothing (a pack,
    whose own blocks split in two halves; a dense zigzag rank's are one block, and its last dK/dV is waited for)."""
    pack = PackedLayout.build([0, 300, 700, 1200, 2048], 2)
    call = AttentionCall(1, 4, 2, 32, pack.seq_len, pack, MaskSpec(True))
    cal = dataclasses.replace(BARE, links=_links(1e10, 1e-5))
    hidden = predict(call, "ring", Topology(), cal)
    assert hidden.time_s == pytest.approx(hidden.compute_s, rel=1e-9)
    serial = predict(call, "ring", Topology(), dataclasses.replace(cal, overlap=0.0))
    assert serial.time_s > hidden.time_s * (1 + 1e-6)  # the transfers are there to hide
    dense = AttentionCall(1, 4, 2, 32, 2048, resolve_layout("zigzag", 2), MaskSpec(True))
    last = [1e-5 + t.nbytes / 1e10 for r in range(2) for t in transfers(dense, "ring", 1, r) if t.what == "dkv"]
    exposed = predict(dense, "ring", Topology(), cal)
    assert exposed.compute_s + min(last) * (1 - 1e-9) <= exposed.time_s <= exposed.compute_s + max(last) * (1 + 1e-9)


def test_calibration_says_what_executes() -> None:
    assert Calibration.from_dict({k: v for k, v in CPU_DEFAULT.to_dict().items() if k != "executor"}).executor == \
        "cuda_nccl"  # written before the field: the CUDA path, as before
    assert Calibration.from_dict(CPU_DEFAULT.to_dict()) == CPU_DEFAULT
    with pytest.raises(ValueError, match="executor must be one of"):
        dataclasses.replace(CPU_DEFAULT, executor="cpu")
