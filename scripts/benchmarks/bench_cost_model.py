"""Predicted against measured: every strategy of `cpcompose.attention.STRATEGIES` on a range of calls.

For P = 2 and 4 (gloo, one thread per process, spawned once per P), each call runs
`cp_attention` forward+backward with every strategy (`alltoall_ring` with each
factorisation 1 < a < P once it exists): a barrier before every repeat, a repeat's
time the max over ranks, the median and the best of `--repeats` after a warm-up
(other processes on a shared machine only ever add time, so the best is the
cleaner measurement of the strategy itself; both are printed). Next to it the
cost model's prediction (`cpcompose.attention.cost.predict`, constants from
`--calibration`, default bench_results/calibration.json if present, else the
shipped `CPU_DEFAULT`) and the relative error (predicted / measured - 1) against each. The bytes
each rank's `CommMeter` counted are compared with the model's `bytes_per_rank`
("bytes exact": equal on every rank).

Calls (B=1, D=64, float32, causal, zigzag unless said): dense MHA (H=8, Hkv=8), GQA
(8/2), MQA (8/1) at L=4096; a packed long-tailed pack (`long_tailed_lengths`, seed 0,
`PackedLayout.build`, GQA 8/2) and a sliding window of 512 (GQA 8/2) at L=8192.

Take /work/BENCH_LOCK first and keep the machine quiet. Writes bench_results/cost_model.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cpcompose import CommMeter, cp_attention, cp_shard
from cpcompose.attention import STRATEGIES
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.data import long_tailed_lengths
from cpcompose.layouts import Layout, PackedLayout, resolve_layout
from cpcompose.sharding.packed import pad_pack
from cpcompose.attention.cost import CPU_DEFAULT, AttentionCall, Calibration, Topology, predict

from common import exit_rank, init_rank, markdown_table, repeated, spawn_ranks, write_json

CALLS: list[dict[str, Any]] = [
    {"name": "dense MHA", "H": 8, "Hkv": 8, "L": 4096},
    {"name": "GQA", "H": 8, "Hkv": 2, "L": 4096},
    {"name": "MQA", "H": 8, "Hkv": 1, "L": 4096},
    {"name": "packed", "H": 8, "Hkv": 2, "L": 8192, "pack_seed": 0},
    {"name": "window 512", "H": 8, "Hkv": 2, "L": 8192, "window": 512},
]
B, D = 1, 64


def layout_of(case: dict[str, Any], world: int) -> Layout:
    if "pack_seed" in case:
        cu = [0, *itertools.accumulate(long_tailed_lengths(case["L"], case["pack_seed"]))]
        return PackedLayout.build(cu, world)
    return resolve_layout("zigzag", world)


def runs_of(world: int) -> list[tuple[str, int | None]]:
    """(strategy, alltoall_size) for every strategy cpcompose has, each factorisation of the 2-D one."""
    out: list[tuple[str, int | None]] = []
    for name in STRATEGIES:
        if name == "alltoall_ring":
            out += [(name, a) for a in range(2, world) if world % a == 0]
        else:
            out.append((name, None))
    return out


def model_call(case: dict[str, Any], layout: Layout) -> AttentionCall:
    n = layout.seq_len if isinstance(layout, PackedLayout) else case["L"]
    return AttentionCall(B, case["H"], case["Hkv"], D, n, layout, MaskSpec(True, case.get("window")))


def time_strategy(mesh: Any, tensors: tuple[torch.Tensor, ...], layout: Layout, case: dict[str, Any], strategy: str,
                  a: int | None, opts: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Repeat times (max over ranks) of one strategy's forward+backward, and the bytes each rank sent."""
    q, k, v, dout = tensors
    extra = {} if a is None else {"alltoall_size": a}
    meter = CommMeter()
    world = mesh.size()

    def once() -> tuple[float, list[float]]:
        q.grad = k.grad = v.grad = None
        meter.reset()
        dist.barrier()
        start = time.perf_counter()
        o = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy=strategy, layout=layout,
                         window_size=case.get("window"), meter=meter, **extra)
        o.backward(dout)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        sent = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(sent, torch.tensor([float(meter.total)], dtype=torch.float64))
        return elapsed.item(), [s.item() for s in sent]

    samples = repeated(once, opts["warmup"], opts["repeats"])
    return [s[0] for s in samples], samples[-1][1]


def worker(rank: int, world: int, store: str, opts: dict[str, Any], out: str) -> None:
    init_rank(rank, world, store, timeout_s=300)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        results = []
        for case in CALLS:
            layout = layout_of(case, world)
            g = torch.Generator().manual_seed(case["L"])
            shapes = [(B, case["H"], case["L"], D), (B, case["Hkv"], case["L"], D), (B, case["Hkv"], case["L"], D),
                      (B, case["H"], case["L"], D)]
            full = [torch.randn(s, generator=g) for s in shapes]
            if isinstance(layout, PackedLayout):
                q, k, v, dout = (layout.shard(pad_pack(t, layout, dim=2), 2, rank) for t in full)
            else:
                q, k, v, dout = (cp_shard(t, mesh, seq_dim=2, layout="zigzag") for t in full)
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            for strategy, a in runs_of(world):
                times, sent = time_strategy(mesh, (q, k, v, dout), layout, case, strategy, a, opts)
                results.append({"call": case["name"], "strategy": strategy, "alltoall_size": a, "times": times,
                                "bytes_per_rank": sent})
                if rank == 0:
                    print(f"  P={world} {case['name']} {strategy}{'' if a is None else f'(a={a})'}: "
                          f"{statistics.median(times) * 1e3:.1f} ms", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_rank()  # reached only when the rank succeeded


def measure(world: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    return spawn_ranks(worker, world, opts, prefix="cpcompose-costbench-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibration", type=Path, default=Path("bench_results/calibration.json"))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench_results/cost_model.json"))
    p.add_argument("--repredict", type=Path, help="measure nothing: predict the rows of an earlier --out again")
    args = p.parse_args()
    cal = Calibration.load(args.calibration) if args.calibration.exists() else CPU_DEFAULT
    torch.set_num_threads(1)
    rows = []
    if args.repredict:
        saved = json.loads(args.repredict.read_text())["rows"]
        measured_rows = [(r["world"], {k: r[k] for k in ("call", "strategy", "alltoall_size", "times",
                                                         "bytes_per_rank")}) for r in saved]
    else:
        measured_rows = [(world, res) for world in args.worlds
                         for res in measure(world, {"repeats": args.repeats, "warmup": args.warmup})]
    for world, res in measured_rows:
        case = next(c for c in CALLS if c["name"] == res["call"])
        cost = predict(model_call(case, layout_of(case, world)), STRATEGIES[res["strategy"]], Topology(), cal,
                       res["alltoall_size"])
        measured, best = statistics.median(res["times"]), min(res["times"])
        rows.append({**res, "world": world, "measured_s": measured, "best_s": best, "predicted_s": cost.time_s,
                     "compute_s": cost.compute_s, "rel_error": cost.time_s / measured - 1,
                     "rel_error_best": cost.time_s / best - 1,
                     "predicted_bytes_per_rank": list(cost.bytes_per_rank),
                     "bytes_exact": [int(b) for b in res["bytes_per_rank"]] == list(cost.bytes_per_rank)})
    print(f"\nCost model vs measurement, B={B} D={D} fp32 causal, gloo, 1 thread/rank, {args.repeats} repeats; "
          f"calibration {cal.fingerprint()} ({cal.name})\n")
    headers = ["P", "call", "strategy", "predicted (ms)", "median (ms)", "error", "best (ms)", "error vs best",
               "sent/rank (MiB)", "bytes exact"]
    cells = [[str(r["world"]), r["call"], r["strategy"] + ("" if r["alltoall_size"] is None
                                                         else f"(a={r['alltoall_size']})"),
              f"{r['predicted_s'] * 1e3:.0f}", f"{r['measured_s'] * 1e3:.0f}", f"{r['rel_error']:+.0%}",
              f"{r['best_s'] * 1e3:.0f}", f"{r['rel_error_best']:+.0%}", f"{max(r['bytes_per_rank']) / 2**20:.1f}",
              "yes" if r["bytes_exact"] else "NO"] for r in rows]
    print(markdown_table(headers, cells, left=("call", "strategy", "bytes exact")))
    for key, what in (("rel_error", "median"), ("rel_error_best", "best")):
        errors = [abs(r[key]) for r in rows]
        print(f"\nagainst the {what}: median |error| {statistics.median(errors):.0%}, max {max(errors):.0%}")
    write_json(args.out, {"calibration": cal.to_dict(), "fingerprint": cal.fingerprint(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
