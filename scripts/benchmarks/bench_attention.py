"""Benchmark: causal CP attention forward+backward against one-process SDPA, on CPU (or CUDA).

Method. B=1, H=8, Hkv=2 (GQA), D=64, float32, causal, for each global length L.
T1: one process, one thread, `F.scaled_dot_product_attention(..., is_causal=True,
enable_gqa=True)` forward+backward on the full sequence. T_P: `cp_attention`
forward+backward on P processes of one thread each (gloo, a 1-D "cp" mesh), each on
its shard; a barrier before every repeat, and a repeat's time is the MAX over ranks.
Both are medians over `--repeats` after a warm-up; the workers start once. T1 is
measured by rank 0 inside each repeat, just before the CP call: on a shared VM the
machine's speed drifts by 10-15% over minutes, and measuring T1 once up front let
that drift into the efficiency. On the CPU every other rank runs the same baseline
at the same time (its time is discarded): the P processes stand in for P devices,
and a rank left idle in a barrier during T1 started the CP call from idle, a few ms
late, which its peers then waited for (~8% of T_P on the 8192-token packs); T1
itself moves by ~1% when the other core is busy. On CUDA only rank 0 runs it (ranks
may share one GPU).

Efficiency = T1 / (P * T_P) of the medians; 1.0 is perfect scaling. "best-of-N eff." uses
the fastest of the N repeats of each instead (as `timeit` advises: slower repeats
measure the machine's other load, not the code), the better estimate on a shared VM. Under the contiguous layout the
last of P=2 ranks does 3/4 of the causal work, so efficiency is capped near
1/1.5 = 0.67; "FLOP max/mean" (per-rank attention work from the block plans, a pure
calculation) gives the cap 1/imbalance. Zigzag balances the work and should approach
1 minus communication and merge overhead. All-to-all runs one full causal call per
head shard, so it is balanced under either layout.

CPU T_P is the max over ranks of the main thread's CPU time (`time.thread_time`, gloo's
threads excluded); CPU eff. = T1_cpu / (P * CPU T_P). It counts work, not waiting, so
it still shows imbalance when other processes share the cores (wall times then mostly
measure the load). Wall T_P well above CPU T_P means waiting: on a slower rank, on
communication, or on the machine.

Bytes: what one rank sends per forward+backward (CommMeter, max over ranks), next to
two calculations, with Kb = bytes of the global K (= V) and Qb = of Q (= out):
  plan: what the strategy should send given the mask, max over ranks. For the ring it
    comes from the block plans: in round s a rank sends rank+s exactly the K/V rows
    that rank's blocks read (forward, and again in backward), and sends back to rank-s
    the float32 dK/dV of the rows it read from it. So "sent" should equal "plan".
  dense: the mask-oblivious volume (the classic ring rotation, or Llama 3's
    all-gather): (P-1)/P * 6 * Kb for ring and allgather (forward, a rank receives the
    K and V it does not hold; backward the same again, since K/V are not kept between
    passes and activations stay at 1/P; plus dK and dV). For alltoall
    (P-1)/P**2 * 2 * (2*Qb + 2*Kb): a rank sends the (P-1)/P of its q, k, v shard that
    other ranks' heads need and the output back, then dout out and dq, dk, dv back
    (when the K/V heads split evenly; with fewer K/V heads than ranks, a K/V head goes
    to every rank whose query heads read it, so more: Hkv=2 at P=4 sends 20% more).
  Both come from `cpcompose.attention.cost` (the cost model owns the volumes; its tests
  check them against the meter on every rank). The ring sends less than dense under masks. Causal zigzag: rank r reads all of a
  later rank's shard but only the early chunk of an earlier rank's, so rank P-1 (the
  busiest sender) sends 4*(P-1)/P*Kb of K/V plus (P-1)/P*Kb of gradients = 5/6 of
  dense, rank 0 sends 4/6 of it, and all ranks together 3/4 of dense. Causal
  contiguous: nobody reads a later rank, so rank 0 sends 4*(P-1)/P*Kb (2/3 of dense)
  and the total is 1/2. Allgather sends each rank's rows that another rank reads,
  padded to the widest rank's (the dense volume when that rank's every row is read
  elsewhere, as under causal zigzag); alltoall its dense volume under any mask.
CUDA (`--device cuda`). The same tables on GPUs: rank r uses GPU r % device_count,
NCCL when there are at least P GPUs, else P processes share one GPU over gloo, with
CUDA tensors staged through host memory (so those T_P include host copies and
measure the kernels and merges, not a GPU interconnect). T1 runs SDPA on the GPU
with K/V heads repeated (PyTorch's fused CUDA kernels take no GQA, as in cpcompose),
and every timed region is bracketed by `torch.cuda.synchronize()`. CPU T_P is then
host time only, not work.

Beyond the plan: dK/dV travel in float32 (twice the bytes for bf16 inputs), and
cp_attention all-gathers a few integers per rank on the first call of a shape to check
that every rank's inputs agree, and on CPU sends one int64 flag to each peer per call
(see "What is checked when" in the README; neither is metered).

Packed (`--packed`, run instead of the dense table). A long-tailed pack: document
lengths drawn from a Pareto distribution (minimum 64, tail index 1.2, as
`cpcompose.data.long_tailed_lengths`, seeds `--pack-seeds`) filling L tokens, causal
within each document, same shapes as above. Two splits of the same pack:
"documents" (`PackedLayout.build(cu_seqlens, P)`, the default: zigzag within every
document, pairs rotated to keep the busiest rank least busy) and "zigzag"
(`balance="zigzag"`: plain zigzag chunks of the whole pack, cut at document ends).
T1: one process, one thread, SDPA forward+backward on each document separately (its
own leaf tensors, so no full-pack gradient buffers), summed: the work an ideal
single-device varlen kernel would do. T_P, efficiency, bytes and FLOP max/mean as
above, the work and the ring's plan computed from the packed layout's runs;
calls/rank: the busiest rank's forward kernel calls (backward makes as many). What
to look for: the plain zigzag split keeps most K/V local (few documents cross a
chunk edge), so the ring sends little, but the work is uneven; the documents split
balances the work but cuts every document into 2P pieces, so every document is
exchanged and each costs several kernel calls, whose fixed cost matters for short
documents.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpcompose import CommMeter, cp_attention, cp_shard
from cpcompose.attention import STRATEGIES
from cpcompose.attention.local.heads import query_head_ranges
from cpcompose.attention.local.blocks import BlockTask, MaskSpec, plan
from cpcompose.data import long_tailed_lengths
from cpcompose.layouts import LAYOUTS, Layout, PackedLayout, resolve_layout
from cpcompose.sharding.packed import pad_pack
from cpcompose.attention.cost import AttentionCall, bytes_sent

from common import exit_rank, init_rank, machine, markdown_table, repeated, spawn_ranks, sync, write_json

B, H, HKV, D = 1, 8, 2, 64
DTYPE = torch.float32
STRATEGY_NAMES = tuple(s for s in STRATEGIES if s != "alltoall_ring")  # the 1-D ones: 2-D needs an alltoall_size
BALANCES = ("documents", "zigzag")  # PackedLayout.build(balance=...)
CAUSAL = MaskSpec(causal=True)


def make_inputs(seq_len: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v and an output gradient, identical on every rank (drawn on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, seq_len, D), (B, HKV, seq_len, D), (B, HKV, seq_len, D), (B, H, seq_len, D)]
    return tuple(torch.randn(s, generator=g, dtype=DTYPE).to(device) for s in shapes)


def sdpa_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    """One-process causal SDPA forward+backward: native GQA on CPU, K/V heads repeated on CUDA."""
    if q.device.type == "cpu":
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        return
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)


def pack_cu_seqlens(seq_len: int, seed: int) -> list[int]:
    """Document boundaries of the benchmark's pack of `seq_len` tokens."""
    return [0, *itertools.accumulate(long_tailed_lengths(seq_len, seed))]


def build_layout(case: dict[str, Any], world: int) -> Layout:
    """The layout a case shards by: a registered dense layout, or a PackedLayout of the benchmark's pack."""
    if case["packed"]:
        return PackedLayout.build(pack_cu_seqlens(case["seq_len"], case["seed"]), world, balance=case["layout"])
    return resolve_layout(case["layout"], world)


def baseline_once(seq_len: int, seed: int | None, device: str = "cpu") -> Callable[[], tuple[float, float]]:
    """One T1 sample (wall, CPU) of SDPA forward+backward in this process, one thread.

    Dense (`seed` None): the full sequence in one call. Packed: every document of the
    pack drawn with `seed` in its own call, on its own leaf tensors.
    """
    full = make_inputs(seq_len, seed=seq_len, device=device)
    cu = [0, seq_len] if seed is None else pack_cu_seqlens(seq_len, seed)
    docs = [[t[:, :, a:b].clone() for t in full] for a, b in itertools.pairwise(cu)]
    for doc in docs:
        for t in doc[:3]:
            t.requires_grad_()

    def once() -> tuple[float, float]:
        for doc in docs:
            for t in doc[:3]:
                t.grad = None
        sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        for q, k, v, dout in docs:
            sdpa_once(q, k, v, dout)
        sync(device)
        return time.perf_counter() - start, time.thread_time() - cpu

    return once


def rank_tasks(strategy: str, layout: Layout, seq_len: int) -> list[list[BlockTask]]:
    """The forward kernel calls of each rank, from the block plans (backward makes the same calls)."""
    tasks = []
    for rank in range(layout.world):
        mine = layout.runs(rank, seq_len)
        if strategy == "alltoall":  # the whole sequence, one call per block for all local heads
            runs = layout.global_runs(seq_len)
            tasks.append(plan(runs, runs, CAUSAL))
        else:  # ring and all-gather: this rank's queries against each rank's shard
            tasks.append([t for src in range(layout.world) for t in plan(mine, layout.runs(src, seq_len), CAUSAL)])
    return tasks


def rank_work(strategy: str, layout: Layout, seq_len: int) -> list[float]:
    """Attention (query, key) pairs each rank computes, summed over its heads."""
    heads = [hi - lo for lo, hi in query_head_ranges(H, layout.world)] if strategy == "alltoall" else None
    return [(heads[rank] if heads else H) * sum(t.flops_weight() for t in tasks)
            for rank, tasks in enumerate(rank_tasks(strategy, layout, seq_len))]


def flop_imbalance(strategy: str, layout: Layout, seq_len: int) -> float:
    """max/mean over ranks of the attention work each rank's block plans compute."""
    work = rank_work(strategy, layout, seq_len)
    return max(work) / statistics.mean(work)


def _busiest_sender(strategy: str, layout: Layout, seq_len: int, mask: MaskSpec) -> float:
    """Bytes the busiest rank sends per forward+backward, from the cost model's exact volumes."""
    call = AttentionCall(B, H, HKV, D, seq_len, layout, mask, dtype=DTYPE)
    record = STRATEGIES[strategy]
    a = record.block_size(layout.world, None)
    return float(max(sum(bytes_sent(call, record, a, rank).values()) for rank in range(layout.world)))


def dense_bytes(strategy: str, seq_len: int, world: int) -> float:
    """Bytes a rank sends per forward+backward under the mask-oblivious algorithm (module docstring)."""
    return _busiest_sender(strategy, resolve_layout("zigzag", world), seq_len, MaskSpec(causal=False))


def plan_bytes(strategy: str, layout: Layout, seq_len: int) -> float:
    """Bytes the busiest rank should send per forward+backward given the mask (module docstring)."""
    return _busiest_sender(strategy, layout, seq_len, CAUSAL)


def run_case(mesh: DeviceMesh, case: dict[str, Any], warmup: int, repeats: int) -> dict[str, Any]:
    """Time one CP case on every rank, and its T1 baseline on rank 0, interleaved.

    Each repeat first runs the single-process baseline on rank 0 (on the CPU every
    rank runs it, so none starts the CP call from idle; only rank 0's time counts),
    then the CP call on every rank: T1 and T_P see the same machine state, so a
    neighbour's load or a clock change moves both instead of the efficiency.
    Per repeat: the max over ranks of wall time, CPU time and bytes.
    """
    seq_len, rank, device = case["seq_len"], mesh.get_local_rank(), mesh.device_type
    full = make_inputs(seq_len, seed=seq_len, device=device)
    if case["packed"]:
        layout: str | PackedLayout = build_layout(case, mesh.size())
        q, k, v, dout = (layout.shard(pad_pack(t, layout, dim=2), 2, rank) for t in full)
    else:
        layout = case["layout"]
        q, k, v, dout = (cp_shard(t, mesh, seq_dim=2, layout=layout) for t in full)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    group = mesh.get_group()
    meter = CommMeter()
    paired = rank == 0 or device == "cpu"  # see the module docstring
    baseline = baseline_once(seq_len, case["seed"] if case["packed"] else None, device) if paired else None

    def once() -> list[float]:
        dist.barrier(group=group)
        t1 = baseline() if baseline is not None else (0.0, 0.0)
        if rank != 0:
            t1 = (0.0, 0.0)  # the reduction below takes the max: only rank 0's T1 counts
        q.grad = k.grad = v.grad = None
        meter.reset()
        dist.barrier(group=group)
        sync(device)
        start, cpu = time.perf_counter(), time.thread_time()
        out = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy=case["strategy"], layout=layout, meter=meter)
        out.backward(dout)
        sync(device)
        stats = [time.perf_counter() - start, time.thread_time() - cpu, float(meter.total), *t1]
        reduced = torch.tensor(stats, dtype=torch.float64, device=device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        return reduced.tolist()

    samples = repeated(once, warmup, repeats)
    return {"times": [s[0] for s in samples], "cpu_times": [s[1] for s in samples],
            "bytes_sent": max(s[2] for s in samples), "t1_times": [s[3] for s in samples],
            "t1_cpu_times": [s[4] for s in samples]}


def worker(rank: int, world: int, store: str, cases: list[dict[str, Any]], opts: dict[str, Any], out: str) -> None:
    """One CP rank (`common.init_rank`: on CUDA, NCCL or gloo): join the group, run every case, rank 0 writes the
    results."""
    device = opts["device"]
    init_rank(rank, world, store, device=device, timeout_s=opts["timeout"])
    try:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("cp",))
        results = []
        for case in cases:
            res = run_case(mesh, case, opts["warmup"], opts["repeats"])
            results.append({**case, **res})
            if rank == 0:
                kind = f"pack {case['seed']} " if case["packed"] else ""
                print(f"  done L={case['seq_len']} {case['strategy']}/{kind}{case['layout']}: "
                      f"{statistics.median(res['times']):.3f} s", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    exit_rank()  # reached only when the rank succeeded


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packed", action="store_true",
                   help="benchmark long-tailed packs (documents vs zigzag split) instead of the dense table")
    p.add_argument("--seq-lens", type=int, nargs="+", help="default 4096 8192 16384; with --packed 8192 16384")
    p.add_argument("--world", type=int, default=2, help="CP processes P")
    p.add_argument("--strategies", nargs="+", choices=STRATEGY_NAMES,
                   help="default all three; with --packed ring allgather")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="dense layouts")
    p.add_argument("--balances", nargs="+", choices=BALANCES, default=list(BALANCES), help="packed splits")
    p.add_argument("--pack-seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="packs to draw per length (the seeds tests/attention/test_packed.py uses)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: rank r on GPU r %% count; NCCL with P GPUs, else gloo with host staging")
    p.add_argument("--out", type=Path,
                   help="default bench_results/attention.json (_packed with --packed, _cuda with --device cuda)")
    args = p.parse_args()
    args.seq_lens = args.seq_lens or ([8192, 16384] if args.packed else [4096, 8192, 16384])
    args.strategies = args.strategies or (["ring", "allgather"] if args.packed else list(STRATEGY_NAMES))
    suffix = ("_packed" if args.packed else "") + ("_cuda" if args.device == "cuda" else "")
    args.out = args.out or Path(f"bench_results/attention{suffix}.json")
    if args.world < 2 or args.repeats < 1 or args.warmup < 0:
        p.error("need --world >= 2, --repeats >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    if not args.packed:
        for seq_len in args.seq_lens:
            if seq_len % (2 * args.world):
                p.error(f"--seq-lens: {seq_len} is not a multiple of 2 * world = {2 * args.world} (zigzag chunks)")
    return args


COLUMNS = [  # (header, key of a result row, format)
    ("L", "seq_len", "{}"), ("strategy", "strategy", "{}"), ("layout", "layout", "{}"),
    ("T1 (s)", "t1_s", "{:.3f}"), ("T_P (s)", "tp_s", "{:.3f}"), ("efficiency", "efficiency", "{:.2f}"),
    ("best-of-N eff.", "best_efficiency", "{:.2f}"),
    ("CPU T_P (s)", "tp_cpu_s", "{:.3f}"), ("CPU eff.", "cpu_efficiency", "{:.2f}"),
    ("sent/rank (MiB)", "sent_mib", "{:.1f}"), ("plan (MiB)", "plan_mib", "{:.1f}"),
    ("dense (MiB)", "dense_mib", "{:.1f}"), ("sent/dense", "sent_over_dense", "{:.2f}"),
    ("FLOP max/mean", "flop_imbalance", "{:.2f}"),
]
PACKED_COLUMNS = [("L", "seq_len", "{}"), ("seed", "seed", "{}"), ("docs", "docs", "{}"),
                  ("longest doc", "longest_doc", "{}"), ("strategy", "strategy", "{}"), ("split", "layout", "{}"),
                  *COLUMNS[3:], ("calls/rank", "kernel_calls", "{}")]


def print_table(columns: list[tuple[str, str, str]], rows: list[dict[str, Any]]) -> None:
    left = [head for head, key, _ in columns if key in ("strategy", "layout")]
    print(markdown_table([head for head, _, _ in columns],
                         [[fmt.format(r[key]) for _, key, fmt in columns] for r in rows], left))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    layouts = args.balances if args.packed else args.layouts
    seeds = args.pack_seeds if args.packed else [None]
    cases = [{"seq_len": n, "seed": seed, "strategy": s, "layout": lay, "packed": args.packed}
             for n in args.seq_lens for seed in seeds for s in args.strategies for lay in layouts]
    opts = {"warmup": args.warmup, "repeats": args.repeats, "timeout": args.timeout, "device": args.device}
    cp_results = spawn_ranks(worker, args.world, cases, opts)

    rows, p = [], args.world
    for res in cp_results:
        layout = build_layout(res, p)
        n = layout.seq_len if isinstance(layout, PackedLayout) else res["seq_len"]  # padded pack
        r = {**res, "t1_s": statistics.median(res["t1_times"]),
             "t1_cpu_s": statistics.median(res["t1_cpu_times"]), "tp_s": statistics.median(res["times"]),
             "tp_cpu_s": statistics.median(res["cpu_times"]), "dense_bytes": dense_bytes(res["strategy"], n, p),
             "plan_bytes": plan_bytes(res["strategy"], layout, n),
             "rank_work": rank_work(res["strategy"], layout, n),
             "kernel_calls": max(len(t) for t in rank_tasks(res["strategy"], layout, n)),
             "flop_imbalance": flop_imbalance(res["strategy"], layout, n)}
        if isinstance(layout, PackedLayout):
            docs = long_tailed_lengths(res["seq_len"], res["seed"])
            r["docs"], r["longest_doc"], r["pad"] = len(docs), max(docs), layout.pad
        r["efficiency"], r["cpu_efficiency"] = r["t1_s"] / (p * r["tp_s"]), r["t1_cpu_s"] / (p * r["tp_cpu_s"])
        r["best_efficiency"] = min(r["t1_times"]) / (p * min(r["times"]))
        for mib, key in (("sent_mib", "bytes_sent"), ("plan_mib", "plan_bytes"), ("dense_mib", "dense_bytes")):
            r[mib] = r[key] / 2**20
        r["sent_over_dense"] = r["bytes_sent"] / r["dense_bytes"]
        rows.append(r)

    info = machine(args.device)
    what = "Packed causal attention (long-tailed documents)" if args.packed else "Causal attention"
    print(f"\n{what} fwd+bwd, B={B} H={H} Hkv={HKV} D={D} fp32, P={p}, "
          f"median of {args.repeats} ({info.get('gpu', info['cpu'])}, {info['cores']} cores, torch {info['torch']})\n")
    print_table(PACKED_COLUMNS if args.packed else COLUMNS, rows)

    config = {"B": B, "H": H, "Hkv": HKV, "D": D, "dtype": str(DTYPE), "world": p, "packed": args.packed,
              "repeats": args.repeats, "warmup": args.warmup, "threads_per_process": 1, "device": args.device}
    write_json(args.out, {"machine": info, "config": config, "results": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
