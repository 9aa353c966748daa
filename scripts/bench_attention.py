"""Benchmark: causal CP attention forward+backward against one-process SDPA, on CPU.

Method. B=1, H=8, Hkv=2 (GQA), D=64, float32, causal, for each global length L.
T1: one process, one thread, `F.scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True)` forward+backward on the full sequence. T_P: `cp_attention`
forward+backward on P processes of one thread each (gloo, a 1-D "cp" mesh), each on
its shard; a barrier before every repeat, and a repeat's time is the MAX over ranks.
Both are medians over `--repeats` after a warm-up; the workers start once.

Efficiency = T1 / (P * T_P); 1.0 is perfect scaling. Under the contiguous layout the
last of P=2 ranks does 3/4 of the causal work, so efficiency is capped near
1/1.5 = 0.67; "FLOP max/mean" (per-rank attention work from the block plans, a pure
calculation) gives the cap 1/imbalance. Zigzag balances the work and should approach
1 minus communication and merge overhead. All-to-all runs one full causal call per
head shard, so it is balanced under either layout.

CPU T_P is the max over ranks of the main thread's CPU time (`time.thread_time`, gloo's
threads excluded); CPU eff. = T1_cpu / (P * CPU T_P). It counts work, not waiting, so
it still shows imbalance when other processes share the cores (wall times then mostly
measure the load). Wall T_P well above CPU T_P means waiting: on a slower rank, on
communication, or on the machine.

Bytes: what one rank sends per forward+backward (CommMeter, max over ranks), against
a minimum, with Kb = bytes of the global K (= V) and Qb = of Q (= out):
  ring, allgather: (P-1)/P * 6 * Kb. Forward, a rank must receive the K and V it does
    not hold; backward the same again (K/V are not kept between passes, activations
    stay at 1/P; keeping them would make it 4), plus dK and dV.
  alltoall: (P-1)/P**2 * 2 * (2*Qb + 2*Kb): a rank holds 1/P of each tensor and sends
    the (P-1)/P of it that other ranks' heads need: q, k, v out and the output back,
    then dout out and dq, dk, dv back.
Beyond it: dK/dV travel in float32 (twice the bytes for bf16 inputs), and cp_attention
first all-gathers a few integers per rank to check that every rank's inputs agree.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cpcompose import CommMeter, cp_attention, cp_shard  # noqa: E402
from cpcompose.attention import STRATEGIES  # noqa: E402
from cpcompose.attention.alltoall import query_head_ranges  # noqa: E402
from cpcompose.attention.blocks import MaskSpec, plan  # noqa: E402
from cpcompose.layout import LAYOUTS, SeqLayout  # noqa: E402

B, H, HKV, D = 1, 8, 2, 64
DTYPE = torch.float32
STRATEGY_NAMES = tuple(STRATEGIES)  # ring, allgather, alltoall
T = TypeVar("T")


def make_inputs(seq_len: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and an output gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, seq_len, D), (B, HKV, seq_len, D), (B, HKV, seq_len, D), (B, H, seq_len, D)]
    return tuple(torch.randn(s, generator=g, dtype=DTYPE) for s in shapes)


def timed(fn: Callable[[], T], warmup: int, repeats: int) -> list[T]:
    """`repeats` results of `fn()` after `warmup` discarded calls."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


def baseline_times(seq_len: int, warmup: int, repeats: int) -> list[tuple[float, float]]:
    """T1 samples (wall, CPU) of full-sequence SDPA forward+backward in this process, one thread."""
    q, k, v, dout = make_inputs(seq_len, seed=seq_len)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def once() -> tuple[float, float]:
        q.grad = k.grad = v.grad = None
        start, cpu = time.perf_counter(), time.thread_time()
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        return time.perf_counter() - start, time.thread_time() - cpu

    return timed(once, warmup, repeats)


def flop_imbalance(strategy: str, layout_name: str, seq_len: int, world: int) -> float:
    """max/mean over ranks of the attention work each rank's block plans compute."""
    layout = SeqLayout(layout_name, world)  # type: ignore[arg-type]
    causal = MaskSpec(causal=True)
    work: list[float] = []
    for rank in range(world):
        mine = layout.runs(rank, seq_len)
        if strategy == "alltoall":  # one full-sequence causal call per local head
            lo, hi = query_head_ranges(H, world)[rank]
            work.append((hi - lo) * seq_len * (seq_len + 1) / 2)
            continue
        if strategy == "ring":
            tasks = [t for src in range(world) for t in plan(mine, layout.runs(src, seq_len), causal)]
        else:
            tasks = plan(mine, layout.global_runs(seq_len), causal)
        work.append(H * sum(t.flops_weight() for t in tasks))
    return max(work) / statistics.mean(work)


def min_bytes(strategy: str, seq_len: int, world: int) -> float:
    """The theoretical minimum bytes a rank sends per forward+backward (module docstring)."""
    esize = torch.tensor([], dtype=DTYPE).element_size()
    kb, qb = B * HKV * seq_len * D * esize, B * H * seq_len * D * esize
    frac = (world - 1) / world
    return frac / world * 2 * (2 * qb + 2 * kb) if strategy == "alltoall" else frac * 6 * kb


def run_case(mesh: DeviceMesh, seq_len: int, strategy: str, layout: str, warmup: int, repeats: int) -> dict[str, Any]:
    """Time one CP case on every rank; per repeat the max over ranks of wall time, CPU time, bytes."""
    full = make_inputs(seq_len, seed=seq_len)
    q, k, v, dout = (cp_shard(t, mesh, seq_dim=2, layout=layout) for t in full)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    group = mesh.get_group()
    meter = CommMeter()

    def once() -> list[float]:
        q.grad = k.grad = v.grad = None
        meter.reset()
        dist.barrier(group=group)
        start, cpu = time.perf_counter(), time.thread_time()
        out = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy=strategy, layout=layout, meter=meter)
        out.backward(dout)
        stats = [time.perf_counter() - start, time.thread_time() - cpu, float(meter.total)]
        reduced = torch.tensor(stats, dtype=torch.float64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        return reduced.tolist()

    samples = timed(once, warmup, repeats)
    return {"times": [s[0] for s in samples], "cpu_times": [s[1] for s in samples],
            "bytes_sent": max(s[2] for s in samples)}


def worker(
    rank: int, world: int, store: str, cases: list[tuple[int, str, str]], opts: dict[str, Any], out: str
) -> None:
    """One CP rank: join the group, run every case, rank 0 writes the results."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=opts["timeout"]),
    )
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        results = []
        for seq_len, strategy, layout in cases:
            res = run_case(mesh, seq_len, strategy, layout, opts["warmup"], opts["repeats"])
            results.append({"seq_len": seq_len, "strategy": strategy, "layout": layout, **res})
            if rank == 0:
                print(f"  done L={seq_len} {strategy}/{layout}: {statistics.median(res['times']):.3f} s", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    return {
        "cpu": model, "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--world", type=int, default=2, help="CP processes P")
    p.add_argument("--strategies", nargs="+", choices=STRATEGY_NAMES, default=list(STRATEGY_NAMES))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="gloo collective timeout, seconds")
    p.add_argument("--out", type=Path, default=Path("bench_results/attention.json"))
    args = p.parse_args()
    if args.world < 2 or args.repeats < 1 or args.warmup < 0:
        p.error("need --world >= 2, --repeats >= 1, --warmup >= 0")
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.world):
            p.error(f"--seq-lens: {seq_len} is not a multiple of 2 * world = {2 * args.world} (zigzag chunks)")
    return args


COLUMNS = [  # (header, key of a result row, format)
    ("L", "seq_len", "{}"), ("strategy", "strategy", "{}"), ("layout", "layout", "{}"),
    ("T1 (s)", "t1_s", "{:.3f}"), ("T_P (s)", "tp_s", "{:.3f}"), ("efficiency", "efficiency", "{:.2f}"),
    ("CPU T_P (s)", "tp_cpu_s", "{:.3f}"), ("CPU eff.", "cpu_efficiency", "{:.2f}"),
    ("sent/rank (MiB)", "sent_mib", "{:.1f}"), ("min (MiB)", "min_mib", "{:.1f}"),
    ("sent/min", "sent_over_min", "{:.2f}"), ("FLOP max/mean", "flop_imbalance", "{:.2f}"),
]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    t1: dict[int, tuple[list[float], list[float]]] = {}  # L -> (wall times, CPU times)
    for seq_len in args.seq_lens:
        walls, cpus = zip(*baseline_times(seq_len, args.warmup, args.repeats))
        t1[seq_len] = (list(walls), list(cpus))
        print(f"  baseline L={seq_len}: {statistics.median(walls):.3f} s", flush=True)

    cases = [(n, s, lay) for n in args.seq_lens for s in args.strategies for lay in args.layouts]
    opts = {"warmup": args.warmup, "repeats": args.repeats, "timeout": args.timeout}
    with tempfile.TemporaryDirectory(prefix="cpcompose-bench-") as tmpdir:
        store, out = os.path.join(tmpdir, "store"), os.path.join(tmpdir, "results.json")
        # Raises (and kills the other ranks) if any worker fails: a non-zero exit, no hang.
        tmp.spawn(worker, args=(args.world, store, cases, opts, out), nprocs=args.world, join=True)
        cp_results = json.loads(Path(out).read_text())

    rows, p = [], args.world
    for res in cp_results:
        n, walls, cpus = res["seq_len"], *t1[res["seq_len"]]
        r = {**res, "t1_times": walls, "t1_cpu_times": cpus, "t1_s": statistics.median(walls),
             "t1_cpu_s": statistics.median(cpus), "tp_s": statistics.median(res["times"]),
             "tp_cpu_s": statistics.median(res["cpu_times"]), "min_bytes": min_bytes(res["strategy"], n, p),
             "flop_imbalance": flop_imbalance(res["strategy"], res["layout"], n, p)}
        r["efficiency"], r["cpu_efficiency"] = r["t1_s"] / (p * r["tp_s"]), r["t1_cpu_s"] / (p * r["tp_cpu_s"])
        r["sent_mib"], r["min_mib"] = r["bytes_sent"] / 2**20, r["min_bytes"] / 2**20
        r["sent_over_min"] = r["bytes_sent"] / r["min_bytes"]
        rows.append(r)

    info = machine()
    print(f"\nCausal attention fwd+bwd, B={B} H={H} Hkv={HKV} D={D} fp32, P={p}, "
          f"median of {args.repeats} ({info['cpu']}, {info['cores']} cores, torch {info['torch']})\n")
    print("| " + " | ".join(head for head, _, _ in COLUMNS) + " |")
    print("|" + "|".join("---" if fmt == "{}" and key != "seq_len" else "---:" for _, key, fmt in COLUMNS) + "|")
    for r in rows:
        print("| " + " | ".join(fmt.format(r[key]) for _, key, fmt in COLUMNS) + " |")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {"B": B, "H": H, "Hkv": HKV, "D": D, "dtype": str(DTYPE), "world": p,
              "repeats": args.repeats, "warmup": args.warmup, "threads_per_process": 1}
    args.out.write_text(json.dumps({"machine": info, "config": config, "results": rows}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
