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
  On --device cuda, mamba2 and gdn run mamba-ssm's Triton `mamba_chunk_scan_combined` and
  fla's `chunk_gated_delta_rule` where importable (`cpcompose.mixers.triton_scans`), through
  the CP versions directly as mamba2_linear does; the `kernel` column names the scan kernel
  each row ran (transformers' torch functions where the CUDA ones are absent).
T1: one process, one thread, the full sequence. T_P: P processes of one thread each
(gloo), each on its zigzag shard; a barrier before every repeat; a repeat's time is the
max over ranks; every rank runs the T1 baseline inside each repeat, as `bench_attention.py`
does (the P processes stand in for P devices), and every rank's T1 is kept (P samples a
repeat). T1 and T_P alternate which goes first from repeat to repeat, so drift and a warm
cache favour neither. Efficiency = T1 / (P * T_P) of the medians over `--repeats` after
`--warmup` repeats; 1.0 is perfect scaling. Noise, which only ever adds time, is reported
rather than hidden:
  best-of-N eff.: the fastest T1 over the fastest T_P (as `timeit` advises: the slower
    repeats measure the machine's other load);
  spread: (p75 - p25) / median of T1 and of T_P (wall): above a few percent, the machine
    was not quiet and the efficiencies move by as much;
  CPU eff.: the same from the main thread's CPU time (`time.thread_time`: gloo's threads
    and waiting excluded; T_P is the max over ranks). It counts work, not waiting, so it
    is steadier on a loaded machine, but it misses the ranks' waits for each other (an
    upper bound where a rank idles, e.g. on the delta rule's first gather);
  FLOP eff.: T1's matmul and conv FLOPs (`torch.utils.flop_counter`, forward+backward)
    over P times the busiest rank's: deterministic, the redundancy and correction work
    that CP adds, whatever the machine (elementwise work and the triangular solves are
    not counted).
Bytes: what one rank sends per forward+backward (CommMeter, max over ranks).

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
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.flop_counter import FlopCounterMode

import transformers  # noqa: F401
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.qwen3_next import modeling_qwen3_next

from cpcompose.comm import CPGroup, all_gather, start_all_gather
from cpcompose.mixers.triton_scans import fla_chunk_gated_delta_rule, mamba_chunk_scan_combined
from cpcompose.mixers.fla import cp_chunk_gated_delta_rule
from cpcompose.mixers.mamba_ssm import cp_mamba2_chunk_scan

from common import exit_rank, init_rank, machine, spawn_ranks, sync, write_json

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
    # One unbind per tensor, not a select per chunk: a select's backward writes a zero tensor of the whole
    # sequence, which made this loop's backward quadratic in the chunk count (10 s at L = 16384, against 0.5 s at 4096).
    for c_chunk, cum_chunk, own_chunk in zip(Ch.unbind(1), cum.unbind(1), own.unbind(1)):
        carried.append(torch.einsum("bthn,bhpn->bthp", c_chunk, state) * cum_chunk.exp()[..., None])
        state = cum_chunk[:, -1].exp()[..., None, None] * state + own_chunk
    y = (y + torch.stack(carried, 1)).reshape(batch, -1, heads, dim)[:, :length]
    if D is not None:
        y = y + D[:, None] * x.float()
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


LINEAR_SSD = counted(linear_ssd)

CUDA_SCANS: dict[str, tuple[str, Callable[..., Any]]] = {}
"""Per kind, the CUDA scan kernel (name, counted kernel) that replaces transformers' function: filled by
`find_cuda_scans` in a --device cuda worker, empty on the CPU."""


def find_cuda_scans() -> list[str]:
    """Fill CUDA_SCANS with fla's and mamba-ssm's kernels where importable; returns what was not, and why."""
    missing = []
    for kind, found, value_dim in (("gdn", fla_chunk_gated_delta_rule(), GDN_DIM),
                                   ("mamba2", mamba_chunk_scan_combined(), None)):
        if found.kernel is None:
            missing.append(f"{kind}: {found.name} not importable ({found.reason}): transformers' torch kernel")
        else:
            CUDA_SCANS[kind] = (found.name, counted(found.kernel, value_dim))
    return missing


def kernel_name(kind: str) -> str:
    """The scan kernel a kind's rows ran."""
    if kind in CUDA_SCANS:
        return CUDA_SCANS[kind][0]
    return {"attention": "sdpa", "mamba2": "transformers mamba2_chunk_scan", "mamba2_linear": "linear_ssd",
            "gdn": "transformers torch_chunk_gated_delta_rule"}[kind]


def cuda_scan(kind: str, cp_version: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The kind's CUDA kernel on the arguments: through its CP version inside a CP region, else alone."""
    kernel = CUDA_SCANS[kind][1]
    region = active_cp_region()
    return kernel(*args, **kwargs) if region is None else cp_version(kernel, region, *args, **kwargs)


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
        if kind == "mamba2" and kind in CUDA_SCANS:
            y = cuda_scan(kind, cp_mamba2_chunk_scan, *args, chunk_size=CHUNK, dt_softplus=True)
        elif kind == "mamba2":
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
    gdn = modeling_qwen3_next.torch_chunk_gated_delta_rule if kind not in CUDA_SCANS else \
        lambda *a, **kw: cuda_scan(kind, cp_chunk_gated_delta_rule, *a, **kw)
    out, _ = gdn(q, k, v, g=g, beta=torch.sigmoid(t["dt"]), chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)
    return out.reshape(b, s, GDN_HEADS * GDN_DIM)


def leaves(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_(k != "dout") for k, v in t.items()}


def single(kind: str, seq_len: int, device: str) -> Callable[[], tuple[float, float]]:
    """One process's forward+backward on the full sequence: `() -> (wall s, main thread's CPU s)`."""
    full = make_inputs(kind, seq_len, device)

    def once() -> tuple[float, float]:
        t = leaves(full)
        sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        run_single(kind, t)
        sync(device)
        return time.perf_counter() - start, time.thread_time() - cpu

    return once


def run_single(kind: str, t: dict[str, torch.Tensor]) -> None:
    if kind == "attention":
        out = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True, enable_gqa=True)
    else:
        out = mixer(kind, t)
    out.backward(t["dout"])


SEQ_DIM = {"q": 2, "k": 2, "v": 2, "dout": 2, "x": 2, "dt": 1}  # everything else is a parameter
MIXER_DOUT_SEQ_DIM = 1
"""A mixer's output gradient is `(B, L, D)`, contiguous, as the next layer's backward gives it (and as T1 gets it):
a transposed view instead slowed every elementwise op of the CP backward that met it (mismatched strides)."""


def run_case(mesh: DeviceMesh, kind: str, seq_len: int, warmup: int, repeats: int) -> dict[str, Any]:
    device = mesh.device_type
    full = make_inputs(kind, seq_len, device)
    seq_dims = SEQ_DIM if kind == "attention" else {**SEQ_DIM, "dout": MIXER_DOUT_SEQ_DIM}
    local = {k: cp_shard(v, mesh, seq_dim=seq_dims[k]).contiguous() if k in seq_dims else v for k, v in full.items()}
    baseline = single(kind, seq_len, device)
    meter, group, world = CommMeter(), mesh.get_group(), mesh.size()

    def run_cp(t: dict[str, torch.Tensor]) -> None:
        if kind == "attention":
            out = cp_attention(t["q"], t["k"], t["v"], mesh=mesh, is_causal=True, meter=meter)
            out.backward(t["dout"])
        else:
            with context_parallel(mesh, meter=meter, verify=False):
                out = mixer(kind, t)
                out.backward(t["dout"])

    def once(repeat: int) -> list[list[float]]:
        """Every rank's [T_P wall, T_P CPU, bytes, T1 wall, T1 CPU, scan tokens, weighted, waited, gathered]."""
        t1_first = repeat % 2 == 0  # alternate: neither T1 nor T_P always runs on a cache the other warmed
        dist.barrier(group=group)
        t1 = baseline() if t1_first else (0.0, 0.0)
        meter.reset()
        SCAN_WORK.update(tokens=0.0, weighted=0.0)
        t = leaves(local)
        sync(device)
        dist.barrier(group=group)
        start, cpu = time.perf_counter(), time.thread_time()
        run_cp(t)
        sync(device)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        work = (SCAN_WORK["tokens"], SCAN_WORK["weighted"])
        if not t1_first:
            dist.barrier(group=group)
            t1 = baseline()
        mine = torch.tensor([elapsed, cpu, float(meter.total), *t1, *work, meter.waited_s["all_gather"],
                             float(meter.bytes_sent["all_gather"])], dtype=torch.float64, device=device)
        return all_gather(mine, CPGroup.from_mesh(mesh)).tolist()

    for repeat in range(warmup):
        once(repeat)
    samples = [once(repeat) for repeat in range(repeats)]

    def slowest(column: int) -> list[float]:
        return [max(rank[column] for rank in sample) for sample in samples]

    def every_rank(column: int) -> list[float]:
        return [rank[column] for sample in samples for rank in sample]

    share = seq_len / world
    gathered = int(max(slowest(8)))
    return {"kind": kind, "kernel": kernel_name(kind), "seq_len": seq_len, "times": slowest(0), "cpu_times": slowest(1),
            "bytes_sent": max(slowest(2)), "t1_times": every_rank(3), "t1_cpu_times": every_rank(4),
            "scan_work": max(slowest(5)) / share, "scan_work_weighted": max(slowest(6)) / share,
            "gather_waited_s": slowest(7), "gather_alone_s": gather_alone(mesh, gathered, repeats),
            "flops": count_flops(baseline_flops(kind, seq_len, device), lambda: run_cp(leaves(local)), mesh)}


def baseline_flops(kind: str, seq_len: int, device: str) -> int:
    """T1's matmul and conv FLOPs, forward+backward (`torch.utils.flop_counter`)."""
    t = leaves(make_inputs(kind, seq_len, device))
    with FlopCounterMode(display=False) as counter:
        run_single(kind, t)
    return int(counter.get_total_flops())


def count_flops(t1: int, run_cp: Callable[[], None], mesh: DeviceMesh) -> dict[str, int]:
    """T1's FLOPs and the busiest rank's under CP (one untimed CP forward+backward, counted)."""
    with FlopCounterMode(display=False) as counter:
        run_cp()
    mine = torch.tensor([counter.get_total_flops()], dtype=torch.float64, device=mesh.device_type)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return {"t1": t1, "max_rank": int(mine.item())}


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
    device = opts["device"]
    init_rank(rank, world, store, device=device, timeout_s=600)  # on CUDA: NCCL, or gloo host-staged
    try:
        for line in find_cuda_scans() if device == "cuda" else []:
            print(f"rank {rank}: {line}", flush=True)
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))
        results = [run_case(mesh, kind, n, opts["warmup"], opts["repeats"]) for kind, n in cases]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_rank()


def spread(times: list[float]) -> float:
    """(p75 - p25) / median: how much the machine moved the repeats."""
    q1, q2, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return (q3 - q1) / q2


def summarize(r: dict[str, Any], world: int) -> None:
    """Add the efficiencies (medians, best-of-N, CPU, FLOPs), the spread and the hidden share to a row."""
    r["t1_s"], r["tp_s"] = statistics.median(r["t1_times"]), statistics.median(r["times"])
    r["efficiency"] = r["t1_s"] / (world * r["tp_s"])
    r["best_efficiency"] = min(r["t1_times"]) / (world * min(r["times"]))
    r["t1_cpu_s"], r["tp_cpu_s"] = statistics.median(r["t1_cpu_times"]), statistics.median(r["cpu_times"])
    r["cpu_efficiency"] = r["t1_cpu_s"] / (world * r["tp_cpu_s"])
    r["spread_t1"], r["spread_tp"] = spread(r["t1_times"]), spread(r["times"])
    r["spread"] = f"{r['spread_t1']:.0%}/{r['spread_tp']:.0%}"
    flops = r["flops"]
    r["flop_efficiency"] = flops["t1"] / (world * flops["max_rank"]) if flops["t1"] and flops["max_rank"] else None
    r["sent_kib"] = r["bytes_sent"] / 1024
    waited = statistics.median(r["gather_waited_s"])
    r["hidden"] = None if r["gather_alone_s"] == 0 else max(0.0, 1 - waited / r["gather_alone_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--kinds", nargs="+", default=["attention", "mamba2", "mamba2_linear", "gdn"],
                   choices=["attention", "mamba2", "mamba2_linear", "gdn"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=11, help="timed repeats (T1 and T_P alternate which goes first)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: mamba2 and gdn run mamba-ssm's and fla's CUDA kernels where importable")
    p.add_argument("--out", default="bench_results/mixers.json")
    args = p.parse_args()
    cases = [(kind, n) for n in args.seq_lens for kind in args.kinds]
    rows = spawn_ranks(worker, args.world, cases, {"warmup": args.warmup, "repeats": args.repeats,
                                                   "device": args.device})
    columns = [("         kind", "kind", "{}"), ("L", "seq_len", "{}"), ("T1 (s)", "t1_s", "{:.3f}"),
               ("T_P (s)", "tp_s", "{:.3f}"), ("eff.", "efficiency", "{:.2f}"),
               ("best-of-N eff.", "best_efficiency", "{:.2f}"), ("spread T1/T_P", "spread", "{}"),
               ("CPU eff.", "cpu_efficiency", "{:.2f}"), ("FLOP eff.", "flop_efficiency", "{:.2f}"),
               ("sent (KiB)", "sent_kib", "{:.1f}"), ("scan work", "scan_work", "{:.2f}"),
               ("weighted", "scan_work_weighted", "{:.2f}"), ("hidden", "hidden", "{:.2f}"),
               ("kernel", "kernel", "{}")]
    print(" ".join(f"{name:>{max(len(name), 6)}}" for name, _, _ in columns))
    for r in rows:
        summarize(r, args.world)
        cells = ["-" if r.get(key) is None or (r["kind"] == "attention" and key.startswith("scan"))
                 else fmt.format(r[key]) for _, key, fmt in columns]
        print(" ".join(f"{cell:>{max(len(name), 6)}}" for (name, _, _), cell in zip(columns, cells)))
    write_json(args.out, {"machine": machine(args.device), "world": args.world, "device": args.device, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
