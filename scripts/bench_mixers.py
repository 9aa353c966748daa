"""Benchmark: a hybrid layer stack under CP against one process, next to attention, on CPU.

Method. One "layer" of each kind, forward+backward, float32, B=1, at global length L:
  attention:     causal GQA attention (H=8, Hkv=2, D=64): SDPA on one process, `cp_attention`
    (ring, zigzag) under CP.
  mamba2:        Mamba2's mixer core: a width-4 causal depthwise conv over C = H*P + 2*G*N
    channels, then the SSD scan (H=8 heads of P=64, G=1 group, state N=64, chunks of 64),
    transformers' own torch kernels (`causal_conv1d_fn`, `mamba2_chunk_scan`); under CP the
    integration's routes (`cpcompose.mixers.causal_conv1d`, `cpcompose.mixers.mamba_ssm`):
    the halo exchange, one pass of each stretch from zero, the summaries' all-gather
    (posted before the passes that do not feed it), and a correction of the stretches that
    continue a document. transformers' SSD is superlinear in L (its inter-chunk step is
    quadratic in the chunk count), which flatters CP: see mamba2_linear.
  mamba2_linear: the same layer with a linear-time SSD kernel (`linear_ssd` below: the chunks'
    states passed in a loop, as mamba-ssm's kernels do), called through
    `cpcompose.mixers.mamba_ssm.cp_mamba2_chunk_scan` directly (no transformers routing).
  gdn:           a Gated DeltaNet core: the same conv, then `torch_chunk_gated_delta_rule`
    (H=4 heads, dk=dv=64, chunks of 64; linear in L), routed the same way (matrix
    transitions; a stretch that continues a document runs once with dk more value columns).
T1: one process, one thread, the full sequence. T_P: P processes of one thread each
(gloo), each on its zigzag shard; a barrier before every repeat; a repeat's time is the
max over ranks; every rank runs the T1 baseline inside each repeat (rank 0's counts), as
`bench_attention.py` does (the P processes stand in for P devices). Medians over
`--repeats` after a warm-up. Efficiency = T1 / (P * T_P); 1.0 is perfect scaling. Bytes:
what one rank sends per forward+backward (CommMeter, max over ranks).

Scan work per rank: the tokens the scan kernels processed in one CP forward (every kernel
call counted, max over ranks), divided by L/P: 1.0 is no redundant pass (deterministic: it
depends on the layout only). For gdn it is also given weighted by the value width each call
ran with (dv + dk on the stretches that continue a document, dv elsewhere).

Overlap: `hidden` is the share of the summaries' all-gather that the work between posting and
waiting hid: 1 - (time blocked waiting for it, forward, max over ranks) / (the same bytes'
all-gather timed alone after a barrier). Blocking also absorbs the ranks' load imbalance, so
this is a lower bound.
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

from cpcompose.comm import CPGroup, start_all_gather  # noqa: E402
from cpcompose.mixers.mamba_ssm import cp_mamba2_chunk_scan  # noqa: E402

SCAN_WORK: dict[str, float] = {"tokens": 0.0, "weighted": 0.0}
"""What the scan kernels processed since the last reset (the script's one counter: the routes capture
the counting kernels at import)."""


def counted(kernel: Callable[..., Any], value_dim: int | None = None) -> Callable[..., Any]:
    """`kernel`, adding each call's tokens (dim 1 of its first argument) to SCAN_WORK; weighted by the value
    width (argument 2's last dim) over `value_dim` where given."""
    def run(*args: Any, **kwargs: Any) -> Any:
        tokens = args[0].shape[1]
        SCAN_WORK["tokens"] += tokens
        SCAN_WORK["weighted"] += tokens * (args[2].shape[-1] / value_dim if value_dim else 1.0)
        return kernel(*args, **kwargs)
    return run


# Counted before cpcompose's routes wrap them, so the routes' originals are the counting kernels.
modeling_mamba2.mamba2_chunk_scan = counted(modeling_mamba2.mamba2_chunk_scan)
modeling_qwen3_next.torch_chunk_gated_delta_rule = counted(modeling_qwen3_next.torch_chunk_gated_delta_rule, 64)

import cpcompose.integrations.transformers  # noqa: E402,F401  (routes the kernels)
from cpcompose import CommMeter, context_parallel, cp_attention, cp_shard  # noqa: E402
from cpcompose.parallel.dispatch import active_cp_region  # noqa: E402

H, P, G, N, WIDTH, CHUNK = 8, 64, 1, 64, 4, 64
GDN_HEADS, GDN_DIM = 4, 64


def linear_ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
    D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
    **kwargs: Any,
) -> Any:
    """Mamba2's SSD with `mamba_chunk_scan_combined`'s API, linear in L: each chunk's outputs from its own tokens
    (a masked product) plus its start state's readout, the states carried chunk to chunk in a loop."""
    batch, length, heads, dim = x.shape
    step = dt if dt_bias is None else dt + dt_bias
    step = torch.clamp(F.softplus(step) if dt_softplus else step, *dt_limit).float()
    Bh, Ch = (t.float().repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    pad = (-length) % chunk_size
    u = F.pad(x.float() * step[..., None], (0, 0, 0, 0, 0, pad))
    a = F.pad(step * A.float(), (0, 0, 0, pad))
    Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (Bh, Ch))
    chunks = (length + pad) // chunk_size
    u, Bh, Ch = (t.reshape(batch, chunks, chunk_size, heads, -1) for t in (u, Bh, Ch))
    cum = a.reshape(batch, chunks, chunk_size, heads).cumsum(2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    decay = (cum[:, :, :, None] - cum[:, :, None]).masked_fill(~causal, float("-inf")).exp()
    y = torch.einsum("bctsh,bcshp->bcthp", torch.einsum("bcthn,bcshn->bctsh", Ch, Bh) * decay, u)
    own = torch.einsum("bcsh,bcshn,bcshp->bchpn", (cum[:, :, -1:] - cum).exp(), Bh, u)
    state = (initial_states.float() if initial_states is not None
             else u.new_zeros(batch, heads, dim, Bh.shape[-1]))
    carried = []
    for c in range(chunks):
        carried.append(torch.einsum("bthn,bhpn->bthp", Ch[:, c], state) * cum[:, c].exp()[..., None])
        state = cum[:, c, -1].exp()[..., None, None] * state + own[:, c]
    y = (y + torch.stack(carried, 1)).reshape(batch, -1, heads, dim)[:, :length]
    if D is not None:
        y = y + D[:, None] * x.float()
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


LINEAR_SSD = counted(linear_ssd)


def make_inputs(kind: str, seq_len: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in _cpu_inputs(kind, seq_len).items()}


def _cpu_inputs(kind: str, seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    if kind == "attention":
        return {"q": torch.randn(1, 8, seq_len, 64, generator=g), "k": torch.randn(1, 2, seq_len, 64, generator=g),
                "v": torch.randn(1, 2, seq_len, 64, generator=g), "dout": torch.randn(1, 8, seq_len, 64, generator=g)}
    mamba = kind.startswith("mamba2")
    channels = H * P + 2 * G * N if mamba else 3 * GDN_HEADS * GDN_DIM
    inputs = {"x": torch.randn(1, channels, seq_len, generator=g), "conv_w": torch.randn(channels, WIDTH, generator=g)
              * 0.3}
    heads = H if mamba else GDN_HEADS
    inputs["dt"] = torch.randn(1, seq_len, heads, generator=g) * 0.5
    inputs["A"] = -torch.rand(heads, generator=g) - 0.5
    out_dim = H * P if mamba else GDN_HEADS * GDN_DIM
    inputs["dout"] = torch.randn(1, seq_len, out_dim, generator=g)
    return inputs


def mixer(kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's token-mixing core through transformers' kernel functions (routed inside a CP region)."""
    if kind.startswith("mamba2"):
        xbc = modeling_mamba2.causal_conv1d_fn(t["x"], t["conv_w"], None, activation="silu").transpose(1, 2)
        b, s, _ = xbc.shape
        x, B, C = torch.split(xbc, [H * P, G * N, G * N], dim=-1)
        args = (x.reshape(b, s, H, P), t["dt"], t["A"], B.reshape(b, s, G, N), C.reshape(b, s, G, N))
        if kind == "mamba2":
            y = modeling_mamba2.mamba2_chunk_scan(*args, chunk_size=CHUNK, dt_softplus=True)
        elif (region := active_cp_region()) is not None:  # the CP version called directly, with its kernel
            y = cp_mamba2_chunk_scan(LINEAR_SSD, region, *args, chunk_size=CHUNK, dt_softplus=True)
        else:
            y = LINEAR_SSD(*args, chunk_size=CHUNK, dt_softplus=True)
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


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def single(kind: str, seq_len: int, device: str) -> Callable[[], float]:
    full = make_inputs(kind, seq_len, device)

    def once() -> float:
        t = leaves(full)
        sync(device)
        start = time.perf_counter()
        if kind == "attention":
            out = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True, enable_gqa=True)
        else:
            out = mixer(kind, t)
        out.backward(t["dout"])
        sync(device)
        return time.perf_counter() - start

    return once


SEQ_DIM = {"q": 2, "k": 2, "v": 2, "dout": 2, "x": 2, "dt": 1}  # everything else is a parameter


def run_case(mesh: DeviceMesh, kind: str, seq_len: int, warmup: int, repeats: int) -> dict[str, Any]:
    device = mesh.device_type
    full = make_inputs(kind, seq_len, device)
    if kind != "attention":
        full["dout"] = full["dout"].transpose(1, 2)  # (B, D, L): its sequence on dim 2, as the others'
    local = {k: cp_shard(v, mesh, seq_dim=SEQ_DIM[k]) if k in SEQ_DIM else v for k, v in full.items()}
    baseline = single(kind, seq_len, device)
    meter, group = CommMeter(), mesh.get_group()

    def once() -> list[float]:
        dist.barrier(group=group)
        t1 = baseline() if mesh.get_local_rank() == 0 else (baseline(), 0.0)[1]
        t = leaves(local)
        meter.reset()
        SCAN_WORK.update(tokens=0.0, weighted=0.0)
        sync(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        if kind == "attention":
            out = cp_attention(t["q"], t["k"], t["v"], mesh=mesh, is_causal=True, meter=meter)
            out.backward(t["dout"])
        else:
            with context_parallel(mesh, meter=meter, verify=False):
                out = mixer(kind, t)
                out.backward(t["dout"].transpose(1, 2))
        sync(device)
        elapsed = time.perf_counter() - start
        stats = torch.tensor([elapsed, float(meter.total), t1, SCAN_WORK["tokens"], SCAN_WORK["weighted"],
                              meter.waited_s["all_gather"], float(meter.bytes_sent["all_gather"])],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        return stats.tolist()

    for _ in range(warmup):
        once()
    samples = [once() for _ in range(repeats)]
    share = seq_len / mesh.size()
    gathered = int(max(s[6] for s in samples))
    return {"kind": kind, "seq_len": seq_len, "times": [s[0] for s in samples],
            "bytes_sent": max(s[1] for s in samples), "t1_times": [s[2] for s in samples],
            "scan_work": max(s[3] for s in samples) / share, "scan_work_weighted": max(s[4] for s in samples) / share,
            "gather_waited_s": [s[5] for s in samples], "gather_alone_s": gather_alone(mesh, gathered, repeats)}


def gather_alone(mesh: DeviceMesh, nbytes: int, repeats: int) -> float:
    """Median seconds of an all-gather of the summaries' size (`nbytes` sent per rank, forward), after a barrier."""
    if nbytes == 0:
        return 0.0
    cp = CPGroup.from_mesh(mesh)
    x = torch.zeros(nbytes // (cp.world - 1), dtype=torch.uint8, device=mesh.device_type)
    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=cp.group)
        start = time.perf_counter()
        start_all_gather(x, cp).wait()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(statistics.median(times[1:]), dtype=torch.float64, device=mesh.device_type)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=cp.group)
    return float(slowest)


def worker(rank: int, world: int, store: str, cases: list[tuple[str, int]], opts: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    device, backend = opts["device"], "gloo"
    if device == "cuda":  # GPU rank % count; NCCL when every rank has its own GPU, else gloo (host-staged)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))
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
    p.add_argument("--kinds", nargs="+", default=["attention", "mamba2", "mamba2_linear", "gdn"],
                   choices=["attention", "mamba2", "mamba2_linear", "gdn"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: transformers' kernel functions run fla's and mamba-ssm's CUDA kernels where installed")
    p.add_argument("--out", default="bench_results/mixers.json")
    args = p.parse_args()
    cases = [(kind, n) for n in args.seq_lens for kind in args.kinds]
    with tempfile.TemporaryDirectory() as tmpdir:
        result = os.path.join(tmpdir, "result.json")
        tmp.spawn(worker, args=(args.world, os.path.join(tmpdir, "store"), cases,
                                {"warmup": args.warmup, "repeats": args.repeats, "device": args.device}, result),
                  nprocs=args.world, join=True)
        rows = json.loads(Path(result).read_text())
    print(f"{'kind':>13} {'L':>6} {'T1 (s)':>8} {'T_P (s)':>8} {'eff.':>5} {'sent (KiB)':>10} "
          f"{'scan work':>9} {'weighted':>8} {'hidden':>6}")
    for r in rows:
        t1, tp = statistics.median(r["t1_times"]), statistics.median(r["times"])
        r["efficiency"] = t1 / (args.world * tp)
        waited = statistics.median(r["gather_waited_s"])
        r["hidden"] = None if r["gather_alone_s"] == 0 else max(0.0, 1 - waited / r["gather_alone_s"])
        hidden = "-" if r["hidden"] is None else f"{r['hidden']:.2f}"
        work = ("-", "-") if r["kind"] == "attention" else (f"{r['scan_work']:.2f}", f"{r['scan_work_weighted']:.2f}")
        print(f"{r['kind']:>13} {r['seq_len']:>6} {t1:8.3f} {tp:8.3f} {r['efficiency']:5.2f} "
              f"{r['bytes_sent'] / 1024:10.1f} {work[0]:>9} {work[1]:>8} {hidden:>6}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(),
                                                      "cores": os.cpu_count(), "torch": torch.__version__},
                                          "world": args.world, "device": args.device, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
