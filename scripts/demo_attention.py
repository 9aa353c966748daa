"""Demo: CP attention on 2 CPU processes, checked against one process.

Run: `python scripts/demo_attention.py`. Two gloo ranks split a causal GQA
sequence (zigzag layout), run each strategy forward and backward, gather the
results, and compare them with a single-process float64 computation.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from cpcompose import cp_attention, cp_shard, cp_unshard

WORLD, BATCH, HEADS, KV_HEADS, SEQ, DIM = 2, 1, 8, 2, 2048, 64


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(BATCH, HEADS, SEQ, DIM), (BATCH, KV_HEADS, SEQ, DIM), (BATCH, KV_HEADS, SEQ, DIM), (BATCH, HEADS, SEQ, DIM)]
    return [torch.randn(s, generator=g) for s in shapes]


def _reference() -> list[torch.Tensor]:
    q, k, v, dout = (t.double().requires_grad_(i < 3) for i, t in enumerate(_inputs()))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _worker(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    ref = _reference() if rank == 0 else None
    for strategy in ("ring", "allgather", "alltoall"):
        q, k, v, dout = (cp_shard(t, mesh, seq_dim=2, layout="zigzag") for t in _inputs())
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy=strategy)
        out.backward(dout)
        full = [cp_unshard(t, mesh, seq_dim=2, layout="zigzag") for t in (out.detach(), q.grad, k.grad, v.grad)]
        if ref is not None:
            errors = [(a.double() - b).abs().max().item() for a, b in zip(full, ref)]
            print(f"{strategy:>9}: max |CP - single-process float64|  out {errors[0]:.1e}  "
                  f"dq {errors[1]:.1e}  dk {errors[2]:.1e}  dv {errors[3]:.1e}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    print(f"causal attention, {WORLD} CPU ranks (gloo), zigzag layout, "
          f"B={BATCH} H={HEADS} Hkv={KV_HEADS} L={SEQ} D={DIM}, float32")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"),), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
