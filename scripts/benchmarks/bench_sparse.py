"""Indexer-selected attention under CP: bytes per rank (and, with --time, seconds) vs the all-gather of K/V.

Bytes are exact and need no processes: for each rank, the rows its queries select
that other ranks own (a synthetic selection, see PATTERNS) give the count table, and
`cpcompose.attention.sparse.cost` turns it into the bytes each rank sends in a
forward and backward (the same functions the strategy's `auto` choice uses). The
all-gather moves every row another rank owns, forward and back.

    python scripts/benchmarks/bench_sparse.py                          # the table: L 8k-32k, top-k 64-2048, P 2 and 4
    python scripts/benchmarks/bench_sparse.py --time --lengths 8192 --topks 256 2048 --worlds 2 4   # also time (gloo)

PATTERNS (which keys each query at global position p selects, k of them, causal):
  window  the k keys up to p (a local window: what trained DSA indexers pick most)
  sinks   the first k/4 tokens and the 3k/4 keys up to p (attention sinks plus a window)
  random  k keys uniform over [0, p] (no locality: the worst case, near the all-gather)
Rows are DeepSeek-V3.2's attention K/V as transformers passes them (128 heads, K 192 + V 128
values, bf16) unless --heads/--dk/--dv/--itemsize say otherwise; the ratio barely depends on them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cpcompose.attention.sparse.cost import allgather_sent, selected_sent
from cpcompose.layouts import resolve_layout

from common import write_json

PATTERNS = ("window", "sinks", "random")


def picks(pattern: str, positions: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """`(len(positions), k)` selected global positions (clamped to 0: repeats are harmless)."""
    p = positions[:, None]
    if pattern == "window":
        return (p - torch.arange(k)[None, :]).clamp_min(0)
    if pattern == "sinks":
        first = torch.arange(k // 4).expand(len(positions), -1)
        recent = (p - torch.arange(k - k // 4)[None, :]).clamp_min(0)
        return torch.minimum(torch.cat([first, recent], 1), p)
    return (torch.rand(len(positions), k, generator=g) * (p + 1)).long()


def count_table(pattern: str, seq_len: int, k: int, world: int, seed: int = 0) -> list[list[int]]:
    """`fetch[r][s]`: rows rank r fetches from rank s under the zigzag split (batch 1)."""
    layout = resolve_layout("zigzag", world)
    owner = torch.empty(seq_len, dtype=torch.long)
    for r in range(world):
        owner[layout.local_indices(r, seq_len)] = r
    g = torch.Generator().manual_seed(seed)
    table = []
    for r in range(world):
        needed = torch.zeros(seq_len, dtype=torch.bool)
        for chunk in layout.local_indices(r, seq_len).split(1024):
            needed[picks(pattern, chunk, k, g).flatten()] = True
        needed &= owner != r
        table.append(torch.bincount(owner[needed], minlength=world).tolist())
    return table


def byte_rows(args: argparse.Namespace) -> list[dict]:
    rows, values = [], args.heads * (args.dk + args.dv)
    for world in args.worlds:
        for seq_len in args.lengths:
            dense = allgather_sent(1, seq_len // world, world, values, args.itemsize)
            for k in args.topks:
                for pattern in args.patterns:
                    table = count_table(pattern, seq_len, k, world)
                    per_rank = [selected_sent(table, r, values, args.itemsize) for r in range(world)]
                    sparse = max(per_rank)
                    rows.append({"world": world, "seq_len": seq_len, "topk": k, "pattern": pattern,
                                 "selected_bytes": sparse, "allgather_bytes": dense, "ratio": sparse / dense,
                                 "busiest_over_mean": sparse * world / max(sum(per_rank), 1)})
    return rows


def _timed(rank: int, world: int, seq_len: int, k: int, pattern: str, args: argparse.Namespace, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cpcompose.attention.sparse.call import attend_selected

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    layout = resolve_layout("zigzag", world)
    local = seq_len // world
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, args.time_heads, local, args.dk, generator=g, requires_grad=True)
    kk = torch.randn(1, args.time_heads, local, args.dk, generator=g, requires_grad=True)
    v = torch.randn(1, args.time_heads, local, args.dv, generator=g, requires_grad=True)
    idx = picks(pattern, layout.local_indices(rank, seq_len), k, g)[None]
    for rows in ("selected", "allgather"):
        best = float("inf")
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            attend_selected(q, kk, v, idx, mesh=mesh, is_causal=True, rows=rows).sum().backward()
            best = min(best, time.perf_counter() - start)
        if rank == 0:
            out[rows] = best
    dist.destroy_process_group()


def time_rows(args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for world in args.worlds:
        for seq_len in args.lengths:
            for k in args.topks:
                for pattern in args.patterns:
                    with mp.Manager() as manager:
                        out = manager.dict()
                        mp.spawn(_timed, args=(world, seq_len, k, pattern, args, out), nprocs=world)
                        rows.append({"world": world, "seq_len": seq_len, "topk": k, "pattern": pattern,
                                     "selected_s": out["selected"], "allgather_s": out["allgather"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--topks", type=int, nargs="+", default=[64, 256, 2048])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--dk", type=int, default=192)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--itemsize", type=int, default=2)
    parser.add_argument("--time", action="store_true", help="also time fwd+bwd on gloo processes (small heads)")
    parser.add_argument("--time-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = byte_rows(args)
    for r in rows:
        print(f"P={r['world']} L={r['seq_len']:6d} k={r['topk']:5d} {r['pattern']:6s}  selected "
              f"{r['selected_bytes'] / 2**20:10.1f} MiB  all-gather {r['allgather_bytes'] / 2**20:10.1f} MiB  "
              f"ratio {r['ratio']:.3f}  busiest/mean rank {r['busiest_over_mean']:.2f}")
    if args.time:
        for r in time_rows(args):
            print(f"P={r['world']} L={r['seq_len']:6d} k={r['topk']:5d} {r['pattern']:6s}  selected "
                  f"{r['selected_s']:.3f} s  all-gather {r['allgather_s']:.3f} s")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
