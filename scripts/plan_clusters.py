"""Apply the cost model to clusters this project cannot run on; writes docs/strategy_choice_tables.md.

For 8 x H100 nodes (`cpcompose.attention.cost.H100_CLUSTER`: published constants), Llama-3
8B and 70B attention shapes (B=1, bf16, causal), P from 8 to 256 CP ranks (8 per
node), 128k to 1M tokens, dense (zigzag) and packed (long-tailed documents,
`PackedLayout.build`), it predicts every candidate's forward+backward time with
`choose_strategy` and tabulates the winner, the 1-D strategies, the best 2-D
factorisation, and the efficiency (ideal time at the kernel's peak / predicted) with
the achieved TFLOP/s per GPU. Pure arithmetic; it waits between configurations while
/work/BENCH_LOCK exists so it never disturbs a benchmark.

Usage: `python scripts/plan_clusters.py [--kinds dense packed] [--worlds 8 16 ...] [--lengths 131072 ...]
[--out docs/strategy_choice_tables.md]`. On a 2-core machine the dense grid takes ~4
minutes; packed documents at P = 128-256 are the slow part (every rank's document pieces
planned against every other's).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.data import long_tailed_lengths
from cpcompose.layouts import Layout, PackedLayout, resolve_layout
from cpcompose.attention.call.choose import Choice, choose_strategy
from cpcompose.attention.cost import H100_CLUSTER, AttentionCall, Topology, predict
from cpcompose.attention.strategies.registry import STRATEGIES

MODELS = {"Llama-3-8B": (32, 8, 128), "Llama-3-70B": (64, 8, 128)}
LOCK = Path("/work/BENCH_LOCK")


def causal_flops(call: AttentionCall) -> float:
    """Forward+backward FLOPs of the visible pairs (flash-attn's count), documents respected."""
    bounds = [r.length for r in call.layout.global_runs(call.seq_len)]
    pairs = sum(n * (n + 1) / 2 for n in bounds)
    return 7 * (call.head_dim + call.dv) * pairs * call.batch * call.heads


def layout_for(kind: str, seq_len: int, world: int) -> Layout:
    if kind == "dense":
        return resolve_layout("zigzag", world)
    cu = [0, *itertools.accumulate(long_tailed_lengths(seq_len, seed=0, scale=1024))]
    return PackedLayout.build(cu, world)


def row(model: str, kind: str, seq_len: int, world: int, choice: Choice, call: AttentionCall) -> str:
    costs = {c.label: c for c in choice.costs}
    two_d = [c for c in choice.costs if c.alltoall_size]
    best_2d = min(two_d, key=lambda c: c.time_s) if two_d else None
    chosen = next(c for c in choice.costs if (c.strategy, c.alltoall_size) == (choice.strategy, choice.alltoall_size))
    ideal = causal_flops(call) / world / H100_CLUSTER.kernel_flops[-1][1]
    tflops = causal_flops(call) / world / chosen.time_s / 1e12
    inter = dict(chosen.bytes_by_level)["inter"] / 2**20
    cells = [model, kind, f"{seq_len // 1024}k", str(world), f"**{chosen.label}**",
             *(f"{costs[s].time_s * 1e3:.0f}" for s in ("ring", "allgather", "alltoall")),
             "-" if best_2d is None else f"{best_2d.label.split('(')[1][:-1]}: {best_2d.time_s * 1e3:.0f}",
             f"{ideal / chosen.time_s:.2f}", f"{tflops:.0f}", f"{inter:.0f}",
             f"{chosen.peak_memory_bytes / 2**30:.2f}"]
    return "| " + " | ".join(cells) + " |"


def anchors() -> list[str]:
    """The model on the published anchors' own setups (see docs/strategy_choice.md)."""
    cal, out = H100_CLUSTER, ["", "### The model on the anchors' setups", ""]
    # ring-flash-attention: zigzag ring, Llama-3.1-8B heads, 8k tokens per GPU, 8 GPUs on NVLink,
    # against 8 x flash-attn on 8k tokens (their "theoretic"), forward+backward.
    call = AttentionCall(1, 32, 8, 128, 8 * 8192, resolve_layout("zigzag", 8), MaskSpec(True), dtype="bfloat16")
    ring = predict(call, STRATEGIES["ring"], Topology(8), cal)
    one = 7 * 256 * 8192 * 8193 / 2 * 32 / cal.throughput(8192) + cal.kernel_call_s
    out.append(f"- ring-flash-attention (zigzag ring, 8 GPUs, Llama-3.1-8B heads, 8k tokens/GPU, fwd+bwd): "
               f"model {8 * one / ring.time_s:.0%} of 8 x single-GPU flash-attn; published 90.2% (8xH800).")
    # Meta: 1M-token prefill of Llama-3-405B, CP=16 across 16 nodes (TP=8 inside: 16 heads, 1 K/V head per rank).
    call = AttentionCall(1, 16, 1, 128, 1 << 20, resolve_layout("zigzag", 16), MaskSpec(True), dtype="bfloat16")
    ring = predict(call, STRATEGIES["ring"], Topology(1), cal, backward=False)
    ideal = 2 / 7 * causal_flops(call) / 16 / cal.throughput(1 << 16)
    out.append(f"- Meta CP inference (ring pass-KV, 1M-token prefill, forward only, CP=16 over 16 nodes, 16 heads and "
               f"1 K/V head per rank): model {ideal / ring.time_s:.0%} parallel efficiency; published 93% "
               "(Llama-3-405B, 128 H100s, TP=8 inside each node).")
    # MagiAttention-like scaling: 8k tokens per GPU, dense causal, GQA 32/8, per-GPU TFLOP/s by strategy.
    out += ["", "| P | L | ring TFLOP/s/GPU | all-to-all (Ulysses) | best 2-D (USP) | all-gather |",
            "|---:|---:|---:|---:|---:|---:|"]
    for world in (8, 16, 32, 64):
        call = AttentionCall(1, 32, 8, 128, world * 8192, resolve_layout("zigzag", world), MaskSpec(True),
                             dtype="bfloat16")
        choice = choose_strategy(call, Topology(8), cal, world)
        costs = {c.label: c.time_s for c in choice.costs}
        two_d = min((c.time_s for c in choice.costs if c.alltoall_size), default=float("nan"))
        tf = causal_flops(call) / world / 1e12
        out.append(f"| {world} | {world * 8}k | {tf / costs['ring']:.0f} | {tf / costs['alltoall']:.0f} | "
                   f"{tf / two_d:.0f} | {tf / costs['allgather']:.0f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", choices=("dense", "packed"), default=["dense", "packed"])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    p.add_argument("--lengths", type=int, nargs="+", default=[128 * 1024, 256 * 1024, 512 * 1024, 1024 * 1024])
    p.add_argument("--no-anchors", action="store_true", help="leave out the anchors section")
    p.add_argument("--out", type=Path, default=Path("docs/strategy_choice_tables.md"))
    args = p.parse_args()
    worlds, lengths = args.worlds, args.lengths
    topology = Topology(ranks_per_node=8)
    header = ("| model | data | L | P | chosen | ring (ms) | allgather (ms) | alltoall (ms) | best 2-D a: ms | "
              "efficiency | TFLOP/s/GPU | inter-node MiB/rank | extra mem GiB |")
    lines = [
        "<!-- generated by scripts/plan_clusters.py: do not edit by hand -->",
        (f"Constants: `{H100_CLUSTER.name}` (fingerprint `{H100_CLUSTER.fingerprint()}`); "
        "forward+backward of one attention layer, B=1, bf16, causal, 8 ranks per node. "
        "Efficiency: the time at the kernel's peak throughput with perfect balance and no communication, "
        "over the predicted time. Packed: long-tailed documents (Pareto, minimum 1024 tokens, "
        "`long_tailed_lengths(L, 0, scale=1024)`), `PackedLayout.build` (documents split)."),
        "",
        header,
        "|" + "|".join(["---"] * (header.count("|") - 1)) + "|",
    ]
    start = time.time()
    for kind, seq_len, world, model in itertools.product(args.kinds, lengths, worlds, MODELS):
        while LOCK.exists():
            time.sleep(20)
        h, hkv, d = MODELS[model]
        layout = layout_for(kind, seq_len, world)
        n = layout.seq_len if isinstance(layout, PackedLayout) else seq_len
        call = AttentionCall(1, h, hkv, d, n, layout, MaskSpec(True), dtype="bfloat16")
        choice = choose_strategy(call, topology, H100_CLUSTER, world)
        lines.append(row(model, kind, seq_len, world, choice, call))
        print(lines[-1], f"({time.time() - start:.0f} s)", flush=True)
    if not args.no_anchors:
        lines += anchors()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out} in {time.time() - start:.0f} s (pid {os.getpid()})")


if __name__ == "__main__":
    main()
