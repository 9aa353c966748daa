"""Benchmark: host (Python) time per CP attention call, with warm and cold caches.

Method. Three measurements, all on the CPU, medians of `--repeats`:

1. Planning per call, virtual ranks (one process; the plans are pure arithmetic, so
   P ranks' plans are computed here for each rank in turn). What one rank's ring
   forward + backward reads: its local block plan and, for each of the P-1 rounds,
   the rows it sends, the rows it receives and its tasks on them (`ring_round`), twice.
   "cold": caches cleared first, i.e. what every call cost before plans were cached
   (the average over the ranks timed); "warm": the same lookups again. Dense causal
   zigzag at L=128k for P=2/8, and a 128k-token long-tailed pack
   (`cpcompose.data.long_tailed_lengths`, seed 0, split by `PackedLayout.build`) at
   P=8/16/64 (cold timed on up to 8 ranks spread over the group).
2. Decision per call, virtual ranks: the host work `cp_attention` does before any
   K/V moves when the call is the expected one: local checks, the signature, the
   agreement-history lookup, the setup. Measured by timing `decide()` below, which
   calls the same functions as `cpcompose.attention.call.orchestrate.checked_call`, on tiny CPU tensors.
3. End to end, 2 real ranks (forked, gloo, one thread each): `cp_attention` forward on
   tiny shards (B=1, H=2, 64 tokens per rank, D=16), ring, `validate="first_call"`
   (steady state: no agreement) against `validate="every_call"` (the blocking
   agreement on every call). Wall time per call (max over ranks) and the main
   thread's CPU time per call (`time.thread_time`: host work, waiting excluded);
   both include the tiny kernels and, for the wall time, gloo's loopback latency.

Writes `bench_results/host_overhead.json` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from cpcompose.attention.call import orchestrate as checks
from cpcompose.attention.local.call_setup import AttentionSetup
from cpcompose.attention.local.kernels import KernelArgs, select_backend
from cpcompose.layouts import resolve_layout
from cpcompose.agreement import AgreementCache
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.call.options import CPOptions
from cpcompose.attention.strategies.ring_loop import ring_round
from cpcompose.attention.local.plans import cached_plan
from cpcompose.data.documents import long_tailed_lengths
from cpcompose.layouts import Layout, PackedLayout, ZigzagLayout

from common import machine, write_json


def _median_time(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def ring_lookups(layout: Layout, mask: MaskSpec, seq: int, rank: int) -> None:
    """Every plan one rank's ring forward + backward reads."""
    world = layout.world
    for _ in range(2):  # forward, backward
        cached_plan(layout, mask, seq, rank, rank)
        for s in range(1, world):
            ring_round(layout, mask, seq, rank, world, s)


def clear_plans() -> None:
    cached_plan.cache_clear()
    ring_round.cache_clear()


def planning(layout: Layout, seq: int, repeats: int) -> dict[str, Any]:
    mask, world = MaskSpec(True), layout.world
    ranks = sorted({round(i * (world - 1) / 7) for i in range(8)}) if world > 8 else list(range(world))
    cold = []
    for rank in ranks:
        clear_plans()
        t0 = time.perf_counter()
        ring_lookups(layout, mask, seq, rank)
        cold.append(time.perf_counter() - t0)
    warm = _median_time(lambda: ring_lookups(layout, mask, seq, ranks[-1]), repeats, inner=20)
    return {"P": world, "ranks_timed": len(ranks), "cold_us": 1e6 * statistics.mean(cold), "warm_us": 1e6 * warm}


def decide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: AgreementCache, world: int,
           options: CPOptions) -> bool:
    """What `attend` does on the host before a predicted call runs (the K/V exchange aside)."""
    window, window_error = checks.window_pair(options.window_size, True)
    error = options.error(world) or window_error or checks.tensor_error(q, k, v)
    layout = resolve_layout(options.layout, world)
    error = error or layout.local_len_error(q.shape[2])
    backend = select_backend(q, options.backend)
    signature = checks._signature(q, k, v, True, None, None, window, options, layout, False)
    key = tuple(int(x) for _, x in signature)
    kernel = KernelArgs(scale=q.shape[-1] ** -0.5, backend=backend)
    AttentionSetup(None, layout, MaskSpec(True, *window), kernel, None, False)  # type: ignore[arg-type]
    return error is None and key == cache.expected()


def decision(world: int, repeats: int) -> dict[str, Any]:
    q, k = torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16)
    options, cache = CPOptions(), AgreementCache()
    signature = checks._signature(q, k, k, True, None, None, (None, None), options, ZigzagLayout(world), False)
    key = tuple(int(x) for _, x in signature)
    cache.agreed(key, None)  # type: ignore[arg-type]  (the spec is only read to replay a call)
    cache.ran(key)
    assert decide(q, k, k, cache, world, options)
    return {"P": world, "decision_us": 1e6 * _median_time(lambda: decide(q, k, k, cache, world, options), repeats,
                                                           inner=200)}


def _worker(rank: int, store: str, calls: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpcompose import cp_attention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    result = {}
    for validate in ("first_call", "every_call"):
        with torch.no_grad():
            for _ in range(20):
                cp_attention(q, k, v, mesh=mesh, is_causal=True, validate=validate)
            dist.barrier()
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                cp_attention(q, k, v, mesh=mesh, is_causal=True, validate=validate)
            result[validate] = {"wall_us": 1e6 * (time.perf_counter() - w0) / calls,
                                "cpu_us": 1e6 * (time.thread_time() - c0) / calls}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def end_to_end(calls: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(store, calls, out), nprocs=2, start_method="fork")
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    return {mode: {m: max(r[mode][m] for r in per_rank) for m in ("wall_us", "cpu_us")} for mode in per_rank[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="end-to-end calls per mode")
    parser.add_argument("--out", type=Path, default=Path("bench_results/host_overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    seq = 128 * 1024
    dense = [dict(layout="zigzag", L=seq, **planning(ZigzagLayout(p), seq, args.repeats)) for p in (2, 8)]
    cu = [0]
    for n in long_tailed_lengths(seq, seed=0):
        cu.append(cu[-1] + n)
    packed = []
    for p in (8, 16, 64):
        layout = PackedLayout.build(cu, p)
        packed.append(dict(layout=f"packed ({len(cu) - 1} docs)", L=layout.seq_len,
                           **planning(layout, layout.seq_len, args.repeats)))
    decisions = [decision(p, args.repeats) for p in (2, 8)]
    e2e = end_to_end(args.calls)

    print("Planning per call, one rank's ring forward + backward (virtual ranks, causal)")
    print(f"{'layout':<22} {'L':>7} {'P':>3} {'cold (us)':>11} {'warm (us)':>10}")
    for row in dense + packed:
        print(f"{row['layout']:<22} {row['L']:>7} {row['P']:>3} {row['cold_us']:>11.0f} {row['warm_us']:>10.1f}")
    print("\nDecision per predicted call (checks, signature, history lookup, setup)")
    for row in decisions:
        print(f"P={row['P']}: {row['decision_us']:.1f} us")
    print("\nEnd to end, 2 gloo ranks, ring forward on tiny shards (max over ranks)")
    for mode, row in e2e.items():
        print(f"validate={mode:<11} wall {row['wall_us']:7.0f} us/call   main-thread CPU {row['cpu_us']:7.0f} us/call")

    write_json(args.out, {"machine": machine(), "planning": dense + packed, "decision": decisions,
                          "end_to_end": e2e})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
