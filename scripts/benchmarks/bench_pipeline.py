"""Benchmark: torch's pipeline schedules on CPU ranks, step time and bubble, measured against each schedule's own
theoretical bubble.

The model is cpcompose's own Llama (`--dim` 128, `--layers-per-rank` 4 layers on each rank, a 256-token
vocabulary so the last stage's head is no heavier than a block), float32, one `--seq-len` 256-token sequence per
microbatch, cut into stages as the trainer cuts it (`split_llama_for_pipeline`, contiguous and even). Every schedule
trains the same model (the same total layers): single-stage schedules (GPipe, 1F1B) get one stage of
`layers-per-rank` layers per rank, the multi-stage ones two stages of half as many, placed as the trainer places them
(`cpcompose.distributed.pipeline.stage_ids`; loop: rank r holds stages r and r + pp; V: r and 2pp - 1 - r, for
ZBVZeroBubble and DualPipeV). No CP, no FSDP:
the pipeline alone.

For each pp (2, 4) one set of pp rank processes (one thread each) runs every schedule at every microbatch count
(4, 8, 16; a schedule that refuses a count is listed as refused, with torch's reason). Per configuration:

* step: the wall time of `schedule.step` (a barrier before each; the slowest rank's; the median of `--steps`
  after one warm-up step);
* busy: each rank's compute alone, M x (the forward + the backward of each of its stages), measured on that rank
  in isolation before the pipeline runs (the median of 5), the pipeline's ideal step; the measured bubble is
  1 - busy / step, the most over the ranks;
* theory: the schedule's own order of actions (`cpcompose.training.memory.schedule.schedule_order`: torch's per-rank
  order of forwards, full backwards, input and weight backwards, the one the memory plan reads) replayed with those measured costs and free communication: the makespan
  that order allows, and its bubble 1 - busy / makespan. The textbook bubble (p - 1) / (v M + p - 1) for
  GPipe, 1F1B, Interleaved1F1B and LoopedBFS is printed beside it as a check of the replay.

The split backward (I then W: ZeroBubble, ZBV, DualPipeV) is timed with torch's own `stage_backward_input` and
`stage_backward_weight`. On a machine with fewer cores than pp x 1 thread (pp = 4 on 2 cores), ranks share
cores: a waiting rank frees its core, so the measured step understates what a bubble costs there, and the
numbers are printed with that caveat.

    python scripts/benchmarks/bench_pipeline.py --out docs/bench/pipeline_2026-11-29.json
    python scripts/benchmarks/bench_pipeline.py --quick     # pp 2, M 4, 1 step: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from common import ROOT, init_rank, machine, markdown_table, spawn_ranks, write_json

from cpcompose.distributed.pipeline import SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, stage_ids
from cpcompose.training.memory.schedule import schedule_order

SCHEDULES = (*SINGLE_STAGE_SCHEDULES, "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", *V_SCHEDULES)


def textbook_bubble(schedule: str, pp: int, microbatches: int) -> float | None:
    """(p - 1) / (v M + p - 1) for the schedules it describes; None for the zero-bubble family."""
    v = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2}.get(schedule)
    return None if v is None else (pp - 1) / (v * microbatches + pp - 1)


def replay(order: dict[int, tuple[tuple[str, int, int], ...]], cost: dict[tuple[int, str], float],
           num_stages: int) -> dict[int, float]:
    """Each rank's finishing time when it runs its actions in `order` (`schedule_order`: torch's own order of
    (kind, stage, microbatch)) with `cost[(stage, kind)]` seconds each and free communication: a forward waits for
    the previous stage's forward of its microbatch, an input (or full) backward for its own forward and the next
    stage's backward, a weight backward for its input backward."""
    done: dict[tuple[int, str, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    pos = dict.fromkeys(order, 0)

    def ready(kind: str, s: int, m: int) -> list[float | None]:
        if kind == "F":
            return [done.get((s - 1, "F", m))] if s > 0 else []
        if kind == "W":
            return [done.get((s, "I", m))]
        after = done.get((s + 1, "B", m), done.get((s + 1, "I", m))) if s < num_stages - 1 else 0.0
        return [done.get((s, "F", m)), after]

    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r in order:
            while pos[r] < len(order[r]):
                kind, s, m = order[r][pos[r]]
                times = ready(kind, s, m)
                if any(t is None for t in times):
                    break
                clock[r] = max([clock[r], *times]) + cost[(s, kind)]
                done[(s, kind, m)] = clock[r]
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: order[r][pos[r]] for r in order if pos[r] < len(order[r])}
            raise RuntimeError(f"the schedule's order does not progress under the replay: waiting {stuck}")
    return clock


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    init_rank(rank, world, store)
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from cpcompose.models.llama import Llama, LlamaConfig, split_llama_for_pipeline

    pp = world
    layers = pp * args.layers_per_rank
    config = LlamaConfig(vocab_size=256, dim=args.dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                         ffn_hidden_dim=args.dim * 3, max_seq_len=args.seq_len)
    positions = torch.arange(args.seq_len).unsqueeze(0)
    loss_fn = torch.nn.functional.cross_entropy

    def stage_module(num_stages: int, s: int) -> Llama:
        model = Llama(config)
        model.init_weights(seed=0)
        return split_llama_for_pipeline(model, num_stages=num_stages, stage_index=s)

    def costs(num_stages: int, ids: tuple[int, ...]) -> dict[tuple[int, str], float]:
        """F, B, I, W seconds of this rank's stages, alone (the median of 5)."""
        out: dict[tuple[int, str], float] = {}
        for s in ids:
            module = stage_module(num_stages, s)
            x = (torch.randint(0, 256, (1, args.seq_len)) if s == 0
                 else torch.randn(1, args.seq_len, args.dim, requires_grad=True))
            last = s == num_stages - 1
            samples: dict[str, list[float]] = {k: [] for k in "FBIW"}
            for _ in range(5):
                t0 = time.perf_counter()
                y = module(x, positions)
                t1 = time.perf_counter()
                samples["F"].append(t1 - t0)
                y = loss_fn(y.flatten(0, 1), torch.zeros(args.seq_len, dtype=torch.long)) if last else y
                grad = None if last else torch.ones_like(y)
                t0 = time.perf_counter()
                torch.autograd.backward(y, grad)
                samples["B"].append(time.perf_counter() - t0)
                module.zero_grad(set_to_none=True)
                y = module(x, positions)
                y = loss_fn(y.flatten(0, 1), torch.zeros(args.seq_len, dtype=torch.long)) if last else y
                inputs = [x] if x.requires_grad else []
                t0 = time.perf_counter()
                _, groups = stage_backward_input([y], None if last else [torch.ones_like(y)], inputs,
                                                 module.parameters())
                t1 = time.perf_counter()
                stage_backward_weight(module.parameters(), groups)
                samples["I"].append(t1 - t0)
                samples["W"].append(time.perf_counter() - t1)
                module.zero_grad(set_to_none=True)
                if x.grad is not None:
                    x.grad = None
            out.update({(s, k): statistics.median(v) for k, v in samples.items()})
        return out

    rows = []
    for name in args.schedules:
        cls = getattr(schedules, f"Schedule{name}")
        for micro in args.microbatches:
            num_stages = pp if name in SINGLE_STAGE_SCHEDULES else 2 * pp
            ids = stage_ids(name, pp, rank, 1 if name in SINGLE_STAGE_SCHEDULES else 2)
            mine = costs(num_stages, ids)
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, {f"{s}:{k}": v for (s, k), v in mine.items()})
            cost = {(int(key.split(":")[0]), key.split(":")[1]): v for g in gathered for key, v in g.items()}
            stages = [PipelineStage(stage_module(num_stages, s), s, num_stages, torch.device("cpu")) for s in ids]
            row: dict[str, Any] = {"schedule": name, "pp": pp, "microbatches": micro, "stages_per_rank": len(ids)}
            try:
                sched = cls(stages[0] if name in SINGLE_STAGE_SCHEDULES else stages, micro, loss_fn=lambda y, t: loss_fn(
                    y.flatten(0, 1), t.flatten()) / micro, scale_grads=False)
            except ValueError as e:
                row["refused"] = str(e).splitlines()[0]
                rows.append(row)
                continue
            tokens = torch.randint(0, 256, (micro, args.seq_len))
            target = torch.randint(0, 256, (micro, args.seq_len))
            times = []
            for step in range(args.steps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                first = 0 in ids
                sched.step(*((tokens,) if first else ()), target=target if (num_stages - 1) in ids else None,
                           position_ids=positions.expand(micro, -1).contiguous())
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step:
                    times.append(float(elapsed))
            split = name in SPLIT_BACKWARD_SCHEDULES
            busy = {r: micro * sum(cost[(s, "F")] + (cost[(s, "I")] + cost[(s, "W")] if split else cost[(s, "B")])
                                   for s in stage_ids(name, pp, r, 1 if name in SINGLE_STAGE_SCHEDULES else 2)) for r in range(pp)}
            finish = replay(schedule_order(name, pp, len(ids), micro), cost, num_stages)
            makespan = max(finish.values())
            step_s = statistics.median(times)
            row.update(step_s=step_s, busy_s=max(busy.values()), theory_step_s=makespan,
                       bubble=max(1 - b / step_s for b in busy.values()),
                       theory_bubble=max(1 - b / makespan for b in busy.values()),
                       textbook_bubble=textbook_bubble(name, pp, micro))
            rows.append(row)
    if rank == 0:
        import json
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers-per-rank", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench_results" / "pipeline.json")
    args = parser.parse_args()
    if args.quick:
        args.pp, args.microbatches, args.steps = [2], [4], 1
    rows = []
    for pp in args.pp:
        rows += spawn_ranks(_rank, pp, args)
    table = []
    for r in rows:
        if "refused" in r:
            table.append([r["schedule"], str(r["pp"]), str(r["microbatches"]), "refused: " + r["refused"][:60],
                          "", "", "", ""])
            continue
        tb = r["textbook_bubble"]
        table.append([r["schedule"], str(r["pp"]), str(r["microbatches"]), f"{r['step_s'] * 1e3:,.0f}",
                      f"{r['theory_step_s'] * 1e3:,.0f}", f"{r['bubble']:.0%}", f"{r['theory_bubble']:.0%}",
                      "" if tb is None else f"{tb:.0%}"])
    print(markdown_table(["schedule", "pp", "M", "step ms", "replayed ms", "bubble", "replayed bubble", "textbook"],
                         table, left=["schedule"]))
    info = machine()
    if max(args.pp) > (info["cores"] or 1):
        print(f"note: pp = {max(args.pp)} ranks on {info['cores']} cores share cores (see the docstring)")
    write_json(args.out, {"machine": info, "settings": {k: v for k, v in vars(args).items() if k != "out"},
                          "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
