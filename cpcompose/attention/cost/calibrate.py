"""Measure the cost model's machine constants here and write them as a `Calibration` JSON.

    python -m cpcompose.attention.cost.calibrate [--out bench_results/calibration.json] [--repeats 7]

Installed as the `cpcompose-calibrate` command too; `parallelism.cp_calibration` (or `cp_attention`'s
`calibration=Calibration.load(path)`) reads the JSON. The one module of the cost model that runs processes:
the rest is arithmetic on what it measured.

What it measures (one thread per process; the fastest of repeats in one process, the
median of repeats (max over ranks) in a group; take /work/BENCH_LOCK
and keep the machine quiet):

* kernel: forward+backward of one `attention_forward`/`attention_backward` call
  (cpcompose's own dispatch) on square full blocks of n queries and keys, n from 32
  to 4096 (B=1, H=8, Hkv=2, D=64, float32: the benchmark's heads): the throughput
  table (FLOPs of the block over its time beyond a 32-block's). The fixed cost per
  block task (`kernel_call_s`) is timed through `forward_blocks`/`backward_blocks`
  on 64 tiny blocks: the kernel calls plus slicing, merge and accumulation. A causal
  2048-block against a full one gives the causal tile (diagonal tiles computed whole).
* merge: `SoftmaxAccumulator.merge` per output element; copy: `index_select`
  bytes per second (the reorders around the collectives).
* gloo point-to-point (P=2): both ranks exchange n bytes at once, as a ring round
  does, sizes 4 KiB to 16 MiB; a straight-line fit gives latency and bandwidth.
* collectives (P=2 and P=4): `all_to_all_single` and `all_gather_into_tensor` times
  against what the fitted link predicts; their ratio is the efficiency.
* overlap (P=2): compute alone, exchange alone, and the exchange posted before the
  compute and waited after: the share of the shorter one that was hidden.

The JSON says `executor="cpu_gloo"`: what was measured is PyTorch's CPU kernel over
gloo, so the model costs causal blocks as the row tiles cpcompose runs there and the
gradients' reduce-scatter as gloo's all-to-all and local sum.

The printed table and the JSON are what `cpcompose.attention.cost.CPU_DEFAULT` ships.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from cpcompose.attention.cost.calibration import INTER, INTRA, Calibration, Link
from cpcompose.attention.local.blocks import BlockTask
from cpcompose.attention.local.execute import backward_blocks, forward_blocks
from cpcompose.attention.local.kernels import KernelArgs
from cpcompose.attention.local.kernels import attention_backward, attention_forward
from cpcompose.attention.local.merge import SoftmaxAccumulator
from cpcompose.comm import CPGroup, RingComm, all_gather_into, all_reduce, all_to_all_into, barrier

__all__ = ["calibrate", "main"]

H, HKV, D = 8, 2, 64
BLOCKS = (32, 128, 256, 512, 1024, 2048, 4096)
P2P_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def best_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` runs: on a shared machine, interference only ever adds time."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def block_time(n: int, repeats: int, causal: bool = False) -> float:
    """Seconds of one full (or causal) block's forward+backward on n queries x n keys."""
    g = torch.Generator().manual_seed(n)
    q, dout = (torch.randn(1, H, n, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, HKV, n, D, generator=g) for _ in range(2))
    scale = D**-0.5

    def once() -> None:
        out, lse = attention_forward(q, k, v, causal=causal, scale=scale, backend="cpu_flash")
        attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, backend="cpu_flash")

    return best_time(once, repeats)


def task_overhead(repeats: int, n_tasks: int = 64, n: int = 16) -> float:
    """Seconds per block task through cpcompose's own path (`forward_blocks` + `backward_blocks`).

    Tiny blocks, so this is the fixed cost of a task: kernel calls, slicing, the LSE
    merge and the float32 accumulations, which packed short documents pay many times.
    """
    g = torch.Generator().manual_seed(0)
    rows = n * n_tasks
    q, dout = (torch.randn(1, H, rows, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, HKV, rows, D, generator=g) for _ in range(2))
    tasks = [BlockTask(slice(i * n, (i + 1) * n), slice(i * n, (i + 1) * n), "full") for i in range(n_tasks)]
    kernel = KernelArgs(scale=D**-0.5, backend="cpu_flash")

    def once() -> None:
        acc = SoftmaxAccumulator(q, D)
        forward_blocks(acc, q, k, v, tasks, kernel)
        out, lse = acc.finish()
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        backward_blocks(grads, dout, q, k, v, out, lse, tasks, kernel)

    return best_time(once, repeats) / n_tasks


def measure_local(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    times = {n: block_time(n, repeats if n <= 1024 else max(2, repeats // 3)) for n in BLOCKS}
    n = 2048  # causal against full: the share of the upper triangle the kernel still computes
    ratio = block_time(n, max(2, repeats // 3), causal=True) / times[n]
    causal_tile = int(min(n, max(1, (2 * ratio - 1) * n)))
    call_s = task_overhead(repeats)
    flops = {n: 7 * 2 * D * n * n * H / max(t - times[BLOCKS[0]], 1e-9) for n, t in times.items() if n > BLOCKS[0]}
    like = torch.randn(1, H, 4096, D)
    acc = SoftmaxAccumulator(like, D)
    block_out, block_lse = torch.randn(1, H, 4096, D), torch.randn(1, H, 4096)
    merge = best_time(lambda: acc.merge(slice(0, 4096), block_out, block_lse), repeats) / like.numel()
    big = torch.randn(1, H, 16384, D)
    index = torch.randperm(16384)
    copy = big.numel() * 4 / best_time(lambda: big.index_select(2, index), repeats)
    return {"block_times": times, "kernel_call_s": call_s, "flops": flops, "merge_s_per_elem": merge,
            "copy_bandwidth": copy, "causal_tile": causal_tile}


def _group_worker(rank: int, world: int, store: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res: dict[str, Any] = {}
        peer = (rank + 1) % world
        cp = CPGroup(dist.group.WORLD, rank, world)

        def timed(fn: Callable[[], None]) -> float:
            samples = []
            for i in range(repeats + 1):
                barrier()
                start = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                all_reduce(t, op="max")
                if i:
                    samples.append(t.item())
            return statistics.median(samples)

        for n in P2P_SIZES:
            res.update(_time_size(n, cp, timed))
        if world == 2:  # overlap: a 4 MiB exchange and a 1024-block kernel, alone and together
            send, recv = torch.zeros(1 << 20), torch.empty(1 << 20)
            q = torch.randn(1, H, 1024, D)
            kv = torch.randn(1, HKV, 1024, D)

            def compute() -> None:
                out, lse = attention_forward(q, kv, kv, causal=False, scale=0.125, backend="cpu_flash")
                attention_backward(q, q, kv, kv, out, lse, causal=False, scale=0.125, backend="cpu_flash")

            ring = RingComm(cp)

            def post() -> Any:
                return ring.exchange_with([send], dst=peer, recv_like=[recv], src=peer)

            def both() -> None:
                pending = post()
                compute()
                pending.wait()

            res["ov_compute"] = timed(compute)
            res["ov_comm"] = timed(lambda: post().wait())
            res["ov_both"] = timed(both)
        if rank == 0:
            torch.save(res, out)
    finally:
        dist.destroy_process_group()


def _time_size(n: int, cp: CPGroup, timed: Callable[[Callable[[], Any]], float]) -> dict[str, float]:
    """Exchange (as a ring round), all-to-all and all-gather of n bytes per peer: the bare transport (the cost model
    counts the strategies' copies apart, at `copy_bandwidth`), through cpcompose.comm like every collective."""
    rank, world = cp.rank, cp.world
    send, recv = torch.zeros(n // 4), torch.empty(n // 4)
    ring = RingComm(cp)

    def exchange() -> None:
        ring.exchange_with([send], dst=(rank + 1) % world, recv_like=[recv], src=(rank - 1) % world).wait()

    x = torch.zeros(n // 4 * world)  # n bytes to each peer
    y = torch.empty_like(x)
    shard, gathered = torch.zeros(n // 4), torch.empty(n // 4 * world)
    p2p = timed(exchange) if n > P2P_SIZES[0] else min(timed(exchange) for _ in range(3))
    return {f"p2p_{n}": p2p, f"a2a_{n}": timed(lambda: all_to_all_into(y, x)),
            f"ag_{n}": timed(lambda: all_gather_into(gathered, shard))}


def measure_group(world: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpcompose-calib-") as tmpdir:
        store, out = os.path.join(tmpdir, "store"), os.path.join(tmpdir, "res.pt")
        tmp.spawn(_group_worker, args=(world, store, repeats, out), nprocs=world, join=True)
        return torch.load(out)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def calibrate(repeats: int) -> tuple[Calibration, dict[str, Any]]:
    """Measure this machine (module docstring): spawns gloo groups of 2 and 4 processes; minutes.

    Args:
        repeats: runs of each measurement (the fastest, or in a group the median, is kept).

    Returns:
        The constants, and the raw measurements they were fitted from (`local`, `groups` by P).
    """
    local = measure_local(repeats)
    groups = {p: measure_group(p, repeats) for p in (2, 4)}
    cores = os.cpu_count() or 1
    g2 = groups[2]
    # Bandwidth from the large sizes (small ones are noisy on a loaded machine); latency: what
    # the smallest exchange takes beyond its bytes.
    big = P2P_SIZES[2:]
    _, per_byte = fit_line([float(n) for n in big], [g2[f"p2p_{n}"] for n in big])
    latency = max(1e-6, min(g2[f"p2p_{n}"] - n * per_byte for n in P2P_SIZES[:2]))
    link = Link(bandwidth=1 / per_byte, latency_s=latency)
    effs: dict[str, list[float]] = {"a2a": [], "ag": []}
    for p, g in groups.items():
        slow = max(1.0, p / cores)
        for n in P2P_SIZES[2:]:  # bandwidth-bound sizes
            ideal = slow * (p - 1) * n / link.bandwidth  # each rank sends (p-1) pieces of n bytes
            effs["a2a"].append(ideal / max(g[f"a2a_{n}"] - slow * latency, 1e-9))
            effs["ag"].append(ideal / max(g[f"ag_{n}"] - slow * (p - 1) * latency, 1e-9))
    c, x, both = g2["ov_compute"], g2["ov_comm"], g2["ov_both"]
    overlap = min(1.0, max(0.0, (c + x - both) / min(c, x)))
    cal = Calibration(
        name=f"measured {datetime.date.today().isoformat()} on {cores}-core CPU, gloo loopback, 1 thread/rank",
        kernel_flops=tuple((n, round(f, -6)) for n, f in sorted(local["flops"].items())),
        kernel_call_s=local["kernel_call_s"], merge_s_per_elem=local["merge_s_per_elem"],
        copy_bandwidth=local["copy_bandwidth"], links=((INTRA, link), (INTER, link)),
        allgather_efficiency=min(1.0, statistics.median(effs["ag"])),
        alltoall_efficiency=min(1.0, statistics.median(effs["a2a"])), overlap=overlap, compute_slots_per_node=cores,
        causal_tile=local["causal_tile"],
        executor="cpu_gloo",  # measured here: PyTorch's CPU kernel (cpcompose tiles its causal blocks) over gloo
    )
    return cal, {"local": local, "groups": groups}


def main(argv: list[str] | None = None) -> int:
    """The `cpcompose-calibrate` command and `python -m cpcompose.attention.cost.calibrate`; returns 0.

    Args:
        argv: `--out PATH` and `--repeats N` (default: this process's arguments).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_results/calibration.json"))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    cal, raw = calibrate(args.repeats)
    print("| block | fwd+bwd (ms) | GFLOP/s |\n|---:|---:|---:|")
    for n, t in raw["local"]["block_times"].items():
        rate = dict(cal.kernel_flops).get(n)
        print(f"| {n} | {t * 1e3:.3f} | {'-' if rate is None else f'{rate / 1e9:.1f}'} |")
    print("\n| P | bytes/peer | p2p exchange (ms) | all_to_all (ms) | all_gather (ms) |\n|---:|---:|---:|---:|---:|")
    for world, g in raw["groups"].items():
        for n in P2P_SIZES:
            print(f"| {world} | {n} | {g[f'p2p_{n}'] * 1e3:.3f} | {g[f'a2a_{n}'] * 1e3:.3f} | "
                  f"{g[f'ag_{n}'] * 1e3:.3f} |")
    link = cal.link(INTRA)
    print(f"\nkernel call {cal.kernel_call_s * 1e6:.1f} us, merge {cal.merge_s_per_elem * 1e9:.2f} ns/elem, "
          f"copy {cal.copy_bandwidth / 1e9:.2f} GB/s, "
          f"link {link.bandwidth / 1e9:.3f} GB/s + {link.latency_s * 1e6:.0f} us, "
          f"all_gather eff {cal.allgather_efficiency:.2f}, all_to_all eff {cal.alltoall_efficiency:.2f}, "
          f"overlap {cal.overlap:.2f}, compute slots {cal.compute_slots_per_node}, causal tile {cal.causal_tile}, "
          f"executor {cal.executor}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(args.out)
    print(f"fingerprint {cal.fingerprint()}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
