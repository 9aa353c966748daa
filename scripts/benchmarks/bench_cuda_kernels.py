"""Benchmark: the CUDA attention kernels cpcompose can dispatch to, one block, forward and backward.

Why: `kernels.select_backend` is the one dispatch point, and which fused kernel is
fastest for a block (PyTorch's flash, memory-efficient or cuDNN kernel, or
flash-attn when installed) is a measured fact of the GPU, not something to guess.
This times each backend through cpcompose's own `attention_forward` /
`attention_backward` (the calls the strategies make, explicit LSE included), so the
numbers are what a CP block costs, K/V head expansion for GQA included.

Method: B=1, for each (dtype, heads, K/V heads, head dim, block length L, causal)
every backend that takes the dtype runs `--warmup` times, then `--repeats` times;
each time is CUDA events around one call, and the table shows medians. TFLOP/s
counts 4 * B * H * L * L * D for a full block forward (half that causal) and 2.5x
the forward for the backward. The math path (explicit softmax) is timed only up to
4096 rows, for scale. Output: a table and JSON (default
bench_results/cuda_kernels.json) with the device, torch and CUDA versions.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from cpcompose import _compat
from cpcompose.attention.local.kernels import attention_backward, attention_forward

from common import machine, markdown_header, markdown_row, write_json

SHAPES = [(8, 2, 64), (32, 8, 128)]  # (H, Hkv, D): the attention benchmark's, and a Llama-3-8B layer's


def backends_for(dtype: torch.dtype, seq: int) -> list[str]:
    names = ["cuda_efficient"]
    if dtype in (torch.float16, torch.bfloat16):
        names += ["cuda_flash", "cuda_cudnn"] + (["flash_attn"] if _compat.import_flash_attn() is not None else [])
    return names + (["math"] if seq <= 4096 else [])


def time_ms(fn, warmup: int, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seq: int, causal: bool, backend: str,
            warmup: int, repeats: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, seq, dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, seq, dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    opts = {"causal": causal, "scale": dim**-0.5, "backend": backend}
    out, lse = attention_forward(q, k, v, **opts)
    dout = torch.randn_like(out)
    fwd = time_ms(lambda: attention_forward(q, k, v, **opts), warmup, repeats)
    bwd = time_ms(lambda: attention_backward(dout, q, k, v, out, lse, **opts), warmup, repeats)
    flops = 4 * heads * seq * seq * dim / (2 if causal else 1)
    fwd_ms, bwd_ms = statistics.median(fwd), statistics.median(bwd)
    return {"dtype": str(dtype).removeprefix("torch."), "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
            "seq": seq, "causal": causal, "backend": backend, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bench_results/cuda_kernels.json"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("no CUDA device is visible to torch")
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for heads, kv_heads, dim in SHAPES:
            for seq in args.seq_lens:
                for causal in (True, False):
                    for backend in backends_for(dtype, seq):
                        try:
                            rows.append(measure(dtype, heads, kv_heads, dim, seq, causal, backend,
                                                args.warmup, args.repeats))
                        except Exception as e:  # noqa: BLE001 (a kernel refusing a shape is a result, recorded)
                            rows.append({"dtype": str(dtype).removeprefix("torch."), "heads": heads,
                                         "kv_heads": kv_heads, "head_dim": dim, "seq": seq, "causal": causal,
                                         "backend": backend, "error": f"{type(e).__name__}: {e}"[:300]})
                        torch.cuda.empty_cache()
    info = machine("cuda")
    print(f"\nCP block kernels, B=1, median of {args.repeats} ({info['gpu']}, torch {info['torch']}, "
          f"CUDA {info['cuda']}, cuDNN {info['cudnn']})\n")
    print(markdown_header(["dtype", "H/Hkv", "D", "L", "causal", "backend", "fwd (ms)", "bwd (ms)", "fwd TFLOP/s",
                           "bwd TFLOP/s"], left=("dtype", "causal", "backend")))
    for r in rows:
        head = [r["dtype"], f"{r['heads']}/{r['kv_heads']}", str(r["head_dim"]), str(r["seq"]), str(r["causal"]),
                r["backend"]]
        if "error" in r:
            print(markdown_row([*head, r["error"][:80], "", "", ""]))
        else:
            print(markdown_row([*head, f"{r['fwd_ms']:.3f}", f"{r['bwd_ms']:.3f}", f"{r['fwd_tflops']:.0f}",
                                f"{r['bwd_tflops']:.0f}"]))
    write_json(args.out, {"machine": info, "results": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
