"""Benchmark: one causal block on PyTorch's CPU kernel, whole or as row tiles (the rule in `cpu_tiles`).

Method. B=1, H=8, Hkv=2 (GQA), D=64, float32, one thread. For each block size n:
forward + backward of the causal block as one kernel call ("whole"), and as
diagonal causal tiles of b rows plus one full block per tile on the keys before it,
merged through their LSE and with the gradients added, as `forward_blocks` /
`backward_blocks` run them (b = 32, 64, 128, 256). Also the kernel's cost per
visible pair of a whole causal block against a full n x n block: the CPU kernel
skips masked work only in whole tiles of up to 512 keys, so a causal block of
n <= 512 costs as much as a full one. Best of `--repeats` (the fastest run is the
one least disturbed by the machine's other load). `cpcompose.attention.local.cpu_tiles`
takes its tile-size rule from this table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from cpcompose.attention.local.blocks import BlockTask
from cpcompose.attention.local.cpu_tiles import tile_causal, tile_rows
from cpcompose.attention.local.kernels import attention_backward, attention_forward
from cpcompose.attention.local.merge import SoftmaxAccumulator

from common import best_time, machine, markdown_header, markdown_row, write_json

H, HKV, D = 8, 2, 64
TILES = (32, 64, 128, 256)


def run_tasks(tasks: list[BlockTask], q, k, v, dout) -> None:
    """Forward (LSE merges) and backward (float32 gradient adds) of `tasks`, untouched by any tiling rule."""
    scale = D**-0.5
    acc = SoftmaxAccumulator(q, D)
    for t in tasks:
        out, lse = attention_forward(q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], causal=t.kind == "causal",
                                     scale=scale, backend="cpu_flash")
        acc.merge(t.q, out, lse)
    out, lse = acc.finish()
    dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
    for t in tasks:
        g = attention_backward(dout[:, :, t.q], q[:, :, t.q], k[:, :, t.kv], v[:, :, t.kv], out[:, :, t.q],
                               lse[:, :, t.q], causal=t.kind == "causal", scale=scale, backend="cpu_flash")
        dq[:, :, t.q] += g[0]
        dk[:, :, t.kv] += g[1]
        dv[:, :, t.kv] += g[2]


def measure(n: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(n)
    q, dout = (torch.randn(1, H, n, D, generator=g) for _ in range(2))
    k, v = (torch.randn(1, HKV, n, D, generator=g) for _ in range(2))
    whole = BlockTask(slice(0, n), slice(0, n), "causal")
    row = {"n": n, "whole_ms": 1e3 * best_time(lambda: run_tasks([whole], q, k, v, dout), repeats)}
    full = BlockTask(slice(0, n), slice(0, n), "full")
    row["full_ms"] = 1e3 * best_time(lambda: run_tasks([full], q, k, v, dout), repeats)
    row["ns_per_pair_causal"] = 1e6 * row["whole_ms"] / (H * n * (n + 1) / 2)
    row["ns_per_pair_full"] = 1e6 * row["full_ms"] / (H * n * n)
    for b in TILES:
        if b < n:
            tiles = tile_causal(whole, rows=b)
            row[f"tiled_{b}_ms"] = 1e3 * best_time(lambda: run_tasks(tiles, q, k, v, dout), repeats)
    row["rule"] = tile_rows(n)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 200, 400, 800, 1300, 2000, 4000])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench_results/causal_tiles.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"One causal block fwd+bwd on the CPU kernel, B=1 H={H} Hkv={HKV} D={D} fp32, one thread, "
          f"best of {args.repeats} (torch {torch.__version__})\n")
    print(markdown_header(["n", "whole (ms)", *(f"tiles of {b} (ms)" for b in TILES), "rule: b", "saved by the rule",
                           "ns/visible pair, causal vs full"]))
    for n in args.sizes:
        row = measure(n, args.repeats)
        rows.append(row)
        cells = [f"{row[f'tiled_{b}_ms']:.2f}" if f"tiled_{b}_ms" in row else "-" for b in TILES]
        ruled = row.get(f"tiled_{row['rule']}_ms", row["whole_ms"])
        rule = "whole" if row["rule"] >= n else row["rule"]
        print(markdown_row([str(n), f"{row['whole_ms']:.2f}", *cells, str(rule), f"{1 - ruled / row['whole_ms']:+.0%}",
                            f"{row['ns_per_pair_causal']:.0f} vs {row['ns_per_pair_full']:.0f}"]), flush=True)
    write_json(args.out, {"machine": machine(), "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
