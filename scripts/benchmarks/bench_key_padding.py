"""Benchmark: what a per-row key mask (`cp_attention(..., key_padding=)`) costs under CP.

Method. B rows of global length L, H=8 query heads, Hkv=2, D=64, float32, bidirectional
(an encoder), each row right-padded to a different length (row b keeps its first
(b+1)/(B+1) of the L tokens). P processes of one thread each (gloo, a 1-D "cp" mesh,
zigzag layout) run `cp_attention` forward+backward on their shards, once without the key
mask (the padding then attended: wrong, but the same shapes) and once with it. A
repeat's time is the MAX over ranks, after a barrier; medians over `--repeats` after a
warm-up. The ratio with/without is the mask's whole price: the key bias travels as 8
more columns of K (and of Q for all-to-all), so bytes grow by 8/D of K (and Q), and the
kernels' score products by 8/D. Bytes: what one rank sends per forward+backward
(`CommMeter`, max over ranks).

    python scripts/benchmarks/bench_key_padding.py --world 2 --seq-lens 4096 8192 --strategies ring allgather alltoall
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from cpcompose import CommMeter, cp_attention, cp_shard

from common import machine, write_json

H, KV, D = 8, 2, 64


def _padding(batch: int, seq: int) -> torch.Tensor:
    """Row b keeps its first max(1, (b+1) * seq // (batch+1)) tokens."""
    keep = torch.tensor([max(1, (b + 1) * seq // (batch + 1)) for b in range(batch)])
    return torch.arange(seq)[None] < keep[:, None]


def _time(mesh, args, strategy: str, seq: int, masked: bool) -> tuple[float, int]:
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(args.batch, h, seq, D, generator=g) for h in (H, KV, KV)]
    q, k, v = (cp_shard(t, mesh, seq_dim=2).requires_grad_() for t in full)
    key_padding = cp_shard(_padding(args.batch, seq), mesh, seq_dim=1) if masked else None
    times, meter = [], CommMeter()
    for i in range(args.warmup + args.repeats):
        dist.barrier(group=mesh.get_group())
        start = time.perf_counter()
        out = cp_attention(q, k, v, mesh=mesh, strategy=strategy, key_padding=key_padding,
                           meter=meter if i == 0 else None)
        out.sum().backward()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=mesh.get_group())
        if i >= args.warmup:
            times.append(elapsed.item())
    sent = torch.tensor(sum(meter.bytes_sent.values()))
    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return statistics.median(times), int(sent)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(seconds=args.timeout))
    mesh = init_device_mesh("cpu", (args.world,), mesh_dim_names=("cp",))
    if rank == 0:
        print(f"P={args.world} B={args.batch} H={H} Hkv={KV} D={D} float32 bidirectional, median of {args.repeats}")
        print(f"{'strategy':<10} {'L':>6} {'plain s':>9} {'masked s':>9} {'ratio':>6} {'plain MB':>9} {'masked MB':>9}")
    rows = []
    for seq in args.seq_lens:
        for strategy in args.strategies:
            plain, plain_bytes = _time(mesh, args, strategy, seq, False)
            masked, masked_bytes = _time(mesh, args, strategy, seq, True)
            rows.append({"strategy": strategy, "seq_len": seq, "plain_s": plain, "masked_s": masked,
                         "ratio": masked / plain, "plain_bytes": plain_bytes, "masked_bytes": masked_bytes})
            if rank == 0:
                print(f"{strategy:<10} {seq:>6} {plain:>9.4f} {masked:>9.4f} {masked / plain:>6.3f} "
                      f"{plain_bytes / 2**20:>9.2f} {masked_bytes / 2**20:>9.2f}", flush=True)
    if rank == 0 and args.out:
        shape = {"world": args.world, "batch": args.batch, "heads": H, "kv_heads": KV, "head_dim": D,
                 "dtype": "float32", "repeats": args.repeats}
        write_json(args.out, {"machine": machine(), "shape": shape, "rows": rows})
        print(f"wrote {args.out}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="CP processes P")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--strategies", nargs="+", default=["ring", "allgather", "alltoall"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    mp.spawn(_worker, args=(args, args.port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
