"""Benchmark: a hybrid layer stack under CP against one process, next to attention, on CPU.

Method. One "layer" of each kind, forward+backward, float32, B=1, at global length L:
  attention: causal GQA attention (H=8, Hkv=2, D=64): SDPA on one process, `cp_attention`
    (ring, zigzag) under CP.
  mamba2:    Mamba2's mixer core: a width-4 causal depthwise conv over C = H*P + 2*G*N
    channels, then the SSD scan (H=8 heads of P=64, G=1 group, state N=64, chunks of 64),
    transformers' own torch kernels (`causal_conv1d_fn`, `mamba2_chunk_scan`); under CP the
    integration's routes (`cpcompose.integrations.transformers.kernels`): halo exchange,
    then each run from zero, the summaries' all-gather, and the runs that continue a
    document run again from their true state.
  gdn:       a Gated DeltaNet core: the same conv, then `torch_chunk_gated_delta_rule`
    (H=4 heads, dk=dv=64, chunks of 64), routed the same way (matrix transitions).
T1: one process, one thread, the full sequence. T_P: P processes of one thread each
(gloo), each on its zigzag shard; a barrier before every repeat; a repeat's time is the
max over ranks; every rank runs the T1 baseline inside each repeat (rank 0's counts), as
`bench_attention.py` does (the P processes stand in for P devices). Medians over
`--repeats` after a warm-up. Efficiency = T1 / (P * T_P); 1.0 is perfect scaling. Bytes:
what one rank sends per forward+backward (CommMeter, max over ranks).

What to expect: the scans run the runs that continue a document twice (the price of
exactness with any kernel, `cpcompose.mixers.chunked`), so a zigzag rank whose two runs
both continue one does about twice its share of the scan's work: efficiency near 0.5
for the scan part, while the conv's halo and the summaries are a few KiB.
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
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import transformers  # noqa: E402,F401
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

import cpcompose.integrations.transformers  # noqa: E402,F401  (routes the kernels)
from cpcompose import CommMeter, context_parallel, cp_attention, cp_shard  # noqa: E402

H, P, G, N, WIDTH, CHUNK = 8, 64, 1, 64, 4, 64
GDN_HEADS, GDN_DIM = 4, 64


def make_inputs(kind: str, seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    if kind == "attention":
        return {"q": torch.randn(1, 8, seq_len, 64, generator=g), "k": torch.randn(1, 2, seq_len, 64, generator=g),
                "v": torch.randn(1, 2, seq_len, 64, generator=g), "dout": torch.randn(1, 8, seq_len, 64, generator=g)}
    channels = H * P + 2 * G * N if kind == "mamba2" else 3 * GDN_HEADS * GDN_DIM
    inputs = {"x": torch.randn(1, channels, seq_len, generator=g), "conv_w": torch.randn(channels, WIDTH, generator=g)
              * 0.3}
    heads = H if kind == "mamba2" else GDN_HEADS
    inputs["dt"] = torch.randn(1, seq_len, heads, generator=g) * 0.5
    inputs["A"] = -torch.rand(heads, generator=g) - 0.5
    out_dim = H * P if kind == "mamba2" else GDN_HEADS * GDN_DIM
    inputs["dout"] = torch.randn(1, seq_len, out_dim, generator=g)
    return inputs


def mixer(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's token-mixing core through transformers' kernel functions (routed inside a CP region)."""
    if kind == "mamba2":
        xbc = modeling_mamba2.causal_conv1d_fn(t["x"], t["conv_w"], None, activation="silu").transpose(1, 2)
        b, s, _ = xbc.shape
        x, B, C = torch.split(xbc, [H * P, G * N, G * N], dim=-1)
        y = modeling_mamba2.mamba2_chunk_scan(x.reshape(b, s, H, P), t["dt"], t["A"], B.reshape(b, s, G, N),
                                              C.reshape(b, s, G, N), chunk_size=CHUNK, dt_softplus=True)
        return y.reshape(b, s, H * P)
    qkv = modeling_qwen3_next.causal_conv1d_fn(t["x"], t["conv_w"], None, activation="silu").transpose(1, 2)
    b, s, _ = qkv.shape
    q, k, v = (z.reshape(b, s, GDN_HEADS, GDN_DIM) for z in qkv.split(GDN_HEADS * GDN_DIM, dim=-1))
    g = -F.softplus(t["dt"]) * (-t["A"])
    out, _ = modeling_qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=torch.sigmoid(t["dt"]),
                                                              chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)
    return out.reshape(b, s, GDN_HEADS * GDN_DIM)


def leaves(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(k != "dout") for k, v in t.items()}


def single(kind: str, seq_len: int) -> Callable[[], float]:
    full = make_inputs(kind, seq_len)

    def once() -> float:
        t = leaves(full)
        start = time.perf_counter()
        if kind == "attention":
            out = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True, enable_gqa=True)
        else:
            out = mixer(kind, t)
        out.backward(t["dout"])
        return time.perf_counter() - start

    return once


SEQ_DIM = {"q": 2, "k": 2, "v": 2, "dout": 2, "x": 2, "dt": 1}  # everything else is a parameter


def run_case(mesh: DeviceMesh, kind: str, seq_len: int, warmup: int, repeats: int) -> dict[str, Any]:
    full = make_inputs(kind, seq_len)
    if kind != "attention":
        full["dout"] = full["dout"].transpose(1, 2)  # (B, D, L): its sequence on dim 2, as the others'
    local = {k: cp_shard(v, mesh, seq_dim=SEQ_DIM[k]) if k in SEQ_DIM else v for k, v in full.items()}
    baseline = single(kind, seq_len)
    meter, group = CommMeter(), mesh.get_group()

    def once() -> list[float]:
        dist.barrier(group=group)
        t1 = baseline() if mesh.get_local_rank() == 0 else (baseline(), 0.0)[1]
        t = leaves(local)
        meter.reset()
        dist.barrier(group=group)
        start = time.perf_counter()
        if kind == "attention":
            out = cp_attention(t["q"], t["k"], t["v"], mesh=mesh, is_causal=True, meter=meter)
            out.backward(t["dout"])
        else:
            with context_parallel(mesh, meter=meter, verify=False):
                out = mixer(kind, t)
                out.backward(t["dout"].transpose(1, 2))
        stats = torch.tensor([time.perf_counter() - start, float(meter.total), t1], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        return stats.tolist()

    for _ in range(warmup):
        once()
    samples = [once() for _ in range(repeats)]
    return {"kind": kind, "seq_len": seq_len, "times": [s[0] for s in samples],
            "bytes_sent": max(s[1] for s in samples), "t1_times": [s[2] for s in samples]}


def worker(rank: int, world: int, store: str, cases: list[tuple[str, int]], opts: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        results = [run_case(mesh, kind, n, opts["warmup"], opts["repeats"]) for kind, n in cases]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see bench_attention.py: no interpreter teardown after gloo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--kinds", nargs="+", default=["attention", "mamba2", "gdn"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results/mixers.json")
    args = p.parse_args()
    cases = [(kind, n) for n in args.seq_lens for kind in args.kinds]
    with tempfile.TemporaryDirectory() as tmpdir:
        result = os.path.join(tmpdir, "result.json")
        tmp.spawn(worker, args=(args.world, os.path.join(tmpdir, "store"), cases,
                                {"warmup": args.warmup, "repeats": args.repeats}, result),
                  nprocs=args.world, join=True)
        rows = json.loads(Path(result).read_text())
    print(f"{'kind':>10} {'L':>6} {'T1 (s)':>8} {'T_P (s)':>8} {'eff.':>5} {'sent (KiB)':>10}")
    for r in rows:
        t1, tp = statistics.median(r["t1_times"]), statistics.median(r["times"])
        r["efficiency"] = t1 / (args.world * tp)
        print(f"{r['kind']:>10} {r['seq_len']:>6} {t1:8.3f} {tp:8.3f} {r['efficiency']:5.2f} "
              f"{r['bytes_sent'] / 1024:10.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(),
                                                      "cores": os.cpu_count(), "torch": torch.__version__},
                                          "world": args.world, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
