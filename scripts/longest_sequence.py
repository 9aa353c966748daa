"""The longest trainable sequence per GPU of 80 GB, at full size: the memory plan's bisection, confirmed by rehearsal.

    python scripts/longest_sequence.py --shape llama3-8b --gpus 8 --options f            # one cell
    python scripts/longest_sequence.py --all --out docs/bench/longest_2026-11-29.json    # the table (hours)
    python scripts/longest_sequence.py --all --plan-only                                 # the plan's answers (s)

A cell is a model shape, a GPU count (one sequence over all of them: cp = GPUs, FSDP over the same ranks) and a
set of the trainer's memory options, cumulative from (a) to (f). The memory plan (`plan_memory`, CUDA: the process
figure and the allocator slack included) is bisected over the lengths the CP layout accepts
(`cpcompose.training.memory.longest_sequence`); then one training step at the plan's answer is rehearsed at full size in
a fresh interpreter (`cpcompose.training.memory.rehearsal`: FakeTensorMode, a fake process group, torch's FSDPMemTracker),
and the tracker's peak plus the same process figure and slack must fit too. Each cell's JSON says how it was
obtained: "rehearsed" (the rehearsal fits at that length), "rehearsed, lowered" (it did not at the plan's length;
the length was lowered by the rehearsal's excess and rehearsed again), "plan" (not rehearsed: `--plan-only`, or the
rehearsal ran past `--rehearsal-timeout`), "refused" (the config refuses the options on these GPUs), or "none"
(not even one grid unit fits). A rehearsal that fits does not prove the next length would not: the answer is the
plan's, confirmed, and the rehearsal's headroom at it is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from cpcompose.config import ConfigError, JobConfig, load_config
from cpcompose.training.memory.longest_sequence import grid_unit, longest, plan_fits, with_length
from cpcompose.training.memory.plan import plan_memory

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
H100_GIB = 81_559 / 1024  # an H100 80 GB as nvidia-smi counts it (81,559 MiB)
BASE = ["--config", str(ROOT / "train_configs" / "llama3_8b_128k.toml"), "--training.batch_size=1",
        "--training.compile=false", "--parallelism.dp_shard=-1"]
SHAPES = {
    "llama3-8b": [],  # the config's own shape
    "llama3-70b": ["--model.dim=8192", "--model.n_layers=80", "--model.n_heads=64", "--model.n_kv_heads=8",
                   "--model.ffn_hidden_dim=28672", "--model.vocab_size=128256"],
}
TILES = 32
"""Feed-forward tiles with (c), block tiles with (f): a tile of a 600k-token rank is then 19k tokens."""
RING_TILES = 4
"""Pieces of each ring round's dK/dV with (f)."""
OPTIONS = {  # cumulative: each adds to the one before
    "a": ("CP", ["--training.fused_loss=false", "--activation_checkpoint.mode=none", "--training.tiled_mlp=1",
                 "--training.tiled_block=1", "--parallelism.cp_ring_tiles=1"]),
    "b": ("+ fused loss", ["--training.fused_loss=true"]),
    "c": (f"+ tiled MLP ({TILES})", [f"--training.tiled_mlp={TILES}"]),
    "d": ("+ full checkpointing", ["--activation_checkpoint.mode=full"]),
    "e": ("+ offload (checkpoints, parameters)", ["--activation_checkpoint.offload=true",
                                                  "--training.offload_params=true"]),
    "f": (f"+ tiled block ({TILES}), ring pieces ({RING_TILES})",
          [f"--training.tiled_block={TILES}", f"--parallelism.cp_ring_tiles={RING_TILES}"]),
}
CELLS = [(shape, gpus) for shape, counts in (("llama3-8b", (1, 8, 32, 64)), ("llama3-70b", (8, 64)))
         for gpus in counts]
GPUS_PER_NODE = 8
"""A node's GPUs (DGX/HGX H100): host memory per node is this many ranks' (fewer on a smaller run)."""
NODE_HOST_GIB = 2048.0
"""A DGX H100's host memory (2 TB): a length whose ranks' host memory (checkpoint offload, offloaded parameters,
gradients and AdamW state: the plan's host parts) a node cannot hold is not counted as fitting."""
ALST = {("llama3-8b", 1): 500_000, ("llama3-8b", 8): 3_700_000, ("llama3-8b", 32): 15_000_000}
"""DeepSpeed ALST's published longest sequences for Llama-8B (arXiv 2506.13996; the DeepSpeed/Snowflake blog)."""
UPIPE = {("llama3-8b", 8): 5_000_000}
"""UPipe's ("Untied Ulysses", arXiv 2602.21196) published longest sequence for Llama3-8B on 8 H100."""
REHEARSE = """
import json, sys
from cpcompose.config import load_config
from cpcompose.training.memory.rehearsal import rehearse
r = rehearse(load_config(sys.argv[2:]), int(sys.argv[1]))
print(json.dumps({"tracked": r.tracked, "planned": r.planned, "by_kind": r.by_kind}))
"""


def cell_args(shape: str, gpus: int, options: str) -> list[str]:
    """The trainer's arguments of one cell (its length set later)."""
    chosen = [arg for key in OPTIONS if key <= options for arg in OPTIONS[key][1]]
    return [*BASE, *SHAPES[shape], f"--parallelism.cp={gpus}", *chosen]


def rehearsed_peak(args: list[str], config: JobConfig, gpus: int, timeout: float) -> dict | None:
    """The rehearsal of one step of `config` in a fresh interpreter (the fake process group must be its only one):
    the tracker's peak plus the plan's CUDA process figure and allocator slack; None past `timeout` seconds."""
    argv = [*args, f"--training.seq_len={config.training.seq_len}"]
    start = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, "-c", REHEARSE, str(gpus), *argv], capture_output=True, text=True,
                             timeout=timeout, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return None
    if run.returncode != 0:
        raise RuntimeError(f"rehearsal failed: {run.stderr[-2000:]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    plan = plan_memory(config, gpus, device_type="cuda")
    extra = plan.part("process") + plan.part("allocator slack")
    return {**got, "peak": got["tracked"] + extra, "wall_s": round(time.perf_counter() - start, 1)}


def calibrated_total(config: JobConfig, gpus: int, seq_len: int, scale: float) -> float:
    """The CUDA plan at `seq_len` with its tensors scaled by `scale` (a rehearsal's tracker over the plan's tensors):
    what the rehearsal would count there if the plan's error were proportional."""
    plan = plan_memory(with_length(config, seq_len), gpus, device_type="cuda")
    tensors = plan.total - plan.part("process") - plan.part("allocator slack")
    return plan.total - (1 - scale) * tensors


def rehearsal_record(args: list[str], config: JobConfig, gpus: int, timeout: float, budget: int) -> dict | None:
    """One rehearsal of `config`, as the JSON keeps it (bytes and GiB), or None past `timeout`."""
    got = rehearsed_peak(args, config, gpus, timeout)
    if got is None:
        return None
    plan = plan_memory(config, gpus, device_type="cuda")
    kinds = {k: round(v / GiB, 2) for k, v in got["by_kind"].items() if v}
    return {"seq_len": config.training.seq_len, "tracked": got["tracked"], "planned": got["planned"],
            "peak": got["peak"], "fits": got["peak"] <= budget,
            "tracked_gib": round(got["tracked"] / GiB, 2), "peak_gib": round(got["peak"] / GiB, 2),
            "plan_gib": round(plan.total / GiB, 2), "plan_tensors_gib": round(got["planned"] / GiB, 2),
            "plan_over_tracker": round(got["planned"] / max(1, got["tracked"]), 3), "by_kind_gib": kinds,
            "host_gib": round(plan.host_bytes / GiB, 1), "wall_s": got["wall_s"]}


def host_fits(config: JobConfig, gpus: int, node_host: int):  # noqa: ANN201
    """Whether a node's ranks' host memory (the plan's host parts, per rank times the ranks on a node) fits."""
    ranks = min(gpus, GPUS_PER_NODE)
    return lambda n: plan_memory(with_length(config, n), gpus, device_type="cuda").host_bytes * ranks <= node_host


def run_cell(shape: str, gpus: int, options: str, budget: int, *, rehearse: bool, timeout: float,
             rehearsals: int, reuse: dict[int, dict] | None = None, first_scale: float = 1.0,
             node_host: int = int(NODE_HOST_GIB * GiB)) -> dict:
    """One cell: the plan's longest length, then (with `rehearse`) rehearsals from it: each calibrates the plan
    (its tensors scaled by the tracker's share) and the next is at the calibrated plan's answer, until that answer
    is the longest length rehearsed to fit. `reuse`: earlier rehearsals of this cell, by length. `first_scale`: the
    first rehearsal at this share of the plan's answer (on the grid), room for the plan's error when one
    rehearsal is all the time allows."""
    reuse = reuse or {}
    args = cell_args(shape, gpus, options)
    cell: dict = {"shape": shape, "gpus": gpus, "options": options, "option_names": OPTIONS[options][0],
                  "cp": gpus, "budget_gib": round(budget / GiB, 2), "rehearsals": []}
    start = time.perf_counter()
    try:
        config = load_config(args)
        unit = grid_unit(config)
        config = with_length(config, unit)
        config.validate(gpus)
    except ConfigError as e:
        return {**cell, "longest": 0, "how": "refused", "why": str(e)}
    device_fits, on_host = plan_fits(config, gpus, budget), host_fits(config, gpus, node_host)
    best = longest(lambda n: device_fits(n) and on_host(n), unit, guess=128 * 1024)
    cell["grid_unit"] = unit
    device_longest = longest(device_fits, unit, guess=max(best, unit))
    if device_longest > best:  # the node's host memory limits the length, not the GPU's
        cell.update(limited_by="host", device_longest=device_longest,
                    node_host_gib=round(node_host / GiB))
    if best == 0:
        plan = plan_memory(config, gpus, device_type="cuda")
        return {**cell, "longest": 0, "how": "none", "why": f"the plan at {unit} tokens is {plan.total / GiB:.1f} "
                f"GiB per rank ({plan.phase}), over the budget", "wall_s": round(time.perf_counter() - start, 1)}
    cell.update(plan_longest=best, longest=best, how="plan")
    if first_scale != 1.0 and rehearse:
        best = max(unit, int(best * first_scale) // unit * unit)
        cell["first_rehearsed_at"] = f"{first_scale:g} of the plan's answer"
    tried: dict[int, dict] = {}
    for _ in range(rehearsals if rehearse else 0):
        record = reuse.get(best) or rehearsal_record(args, with_length(config, best), gpus, timeout, budget)
        if record is None:
            cell["why"] = f"the rehearsal at {best} tokens ran past {timeout:.0f} s"
            break
        tried[best] = record
        # The plan calibrated by this rehearsal: its tensors scaled by the tracker's share of them.
        scale = record["tracked"] / record["planned"]
        calibrated = longest(lambda n: calibrated_total(config, gpus, n, scale) <= budget and on_host(n), unit,
                             guess=best)
        cell["calibrated_longest"] = calibrated
        if record["fits"] and calibrated <= best:
            break  # the calibrated plan agrees: nothing longer to try
        nxt = calibrated if record["fits"] else min(calibrated, best - unit)
        if nxt in tried or nxt <= 0:
            break
        best = nxt
    cell["rehearsals"] = [tried[n] for n in sorted(tried)]
    fitting = [n for n, r in tried.items() if r["fits"]]
    if fitting:
        cell.update(longest=max(fitting), how="rehearsed")
        over = [n for n, r in tried.items() if not r["fits"] and n > max(fitting)]
        cell["shortest_rehearsed_over"] = min(over, default=None)
    elif tried:
        cell.update(longest=cell.get("calibrated_longest", best), how="plan calibrated by a rehearsal (not fitting)")
    if cell["longest"]:
        cell["host_gib"] = round(plan_memory(with_length(config, cell["longest"]), gpus,
                                             device_type="cuda").host_bytes / GiB, 1)
    return {**cell, "wall_s": round(time.perf_counter() - start, 1)}


def table(cells: list[dict]) -> str:
    """The Markdown table: one row per shape and GPU count, one column per option set, ALST beside."""
    def fmt(cell: dict | None) -> str:
        if cell is None:
            return ""
        if cell["how"] in ("refused", "none"):
            return cell["how"]
        host = (f"; host-limited: the GPU holds {cell['device_longest'] / 1e6:.2f}M"
                if cell.get("limited_by") == "host" else "")
        if cell["how"].startswith("rehearsed"):
            return f"**{cell['longest'] / 1e6:.2f}M** rehearsed (plan {cell['plan_longest'] / 1e6:.2f}M{host})"
        return f"{cell['longest'] / 1e6:.2f}M (plan{host})"

    keys = sorted({c["options"] for c in cells})
    rows = sorted({(c["shape"], c["gpus"]) for c in cells}, key=lambda r: (list(SHAPES).index(r[0]), r[1]))
    head = ("| model | GPUs | " + " | ".join(f"({k}) {OPTIONS[k][0]}" for k in keys)
            + f" | host memory at ({keys[-1]}): per rank, per node | ALST | UPipe |")
    lines = [head, "|" + "---|" * 2 + "---:|" * (len(keys) + 3)]
    by = {(c["shape"], c["gpus"], c["options"]): c for c in cells}

    def published(table: dict, shape: str, gpus: int) -> str:
        n = table.get((shape, gpus))
        return f"{n / 1e6:.1f}M" if n else ""

    for shape, gpus in rows:
        last = by.get((shape, gpus, keys[-1]), {})
        node = min(gpus, GPUS_PER_NODE)
        host = f"{last['host_gib']:,.0f} GiB, {last['host_gib'] * node:,.0f} GiB" if last.get("host_gib") else ""
        lines.append(f"| {shape} | {gpus} | " + " | ".join(fmt(by.get((shape, gpus, k))) for k in keys)
                     + f" | {host} | {published(ALST, shape, gpus)} | {published(UPIPE, shape, gpus)} |")
    return "\n".join(lines)


def _complete(record: dict, budget: int) -> dict:
    """An earlier rehearsal record with its bytes (records before they were kept carry GiB to 0.01) and verdict."""
    tracked = record.get("tracked", int(record["tracked_gib"] * GiB))
    planned = record.get("planned", int(record["plan_tensors_gib"] * GiB))
    peak = record.get("peak", int(record["peak_gib"] * GiB))
    return {**record, "tracked": tracked, "planned": planned, "peak": peak, "fits": peak <= budget, "reused": True}


def machine() -> str:
    """This CPU's model name, its core count and its load (the rehearsals' wall times depend on them)."""
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores, load {load:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--options", default="f", help="the last option set, cumulative from a (a..f)")
    parser.add_argument("--all", action="store_true", help="every cell of the table, smallest first")
    parser.add_argument("--sets", default="abcdef", help="with --all: the option sets to run")
    parser.add_argument("--budget-gib", type=float, default=H100_GIB)
    parser.add_argument("--plan-only", action="store_true", help="no rehearsal (seconds, not hours)")
    parser.add_argument("--rehearsal-timeout", type=float, default=900.0, help="seconds per rehearsal")
    parser.add_argument("--rehearsals", type=int, default=2, help="most rehearsals per cell")
    parser.add_argument("--node-host-gib", type=float, default=NODE_HOST_GIB,
                        help="host memory of a node of 8 GPUs (a DGX H100: 2 TB)")
    parser.add_argument("--first-scale", type=float, default=1.0,
                        help="the first rehearsal at this share of the plan's answer (e.g. 0.97)")
    parser.add_argument("--out", type=Path, help="write the cells as JSON here (merged with the cells it holds)")
    args = parser.parse_args(argv)
    budget = int(args.budget_gib * GiB)
    todo = [(s, g, o) for s, g in CELLS for o in args.sets] if args.all else [(args.shape, args.gpus, args.options)]
    old = json.loads(args.out.read_text())["cells"] if args.out and args.out.exists() else []
    cells = {(c["shape"], c["gpus"], c["options"]): c for c in old}
    for shape, gpus, options in todo:
        earlier = cells.get((shape, gpus, options), {})
        if args.plan_only and earlier.get("rehearsals"):
            continue  # a rehearsed cell is not replaced by the plan alone
        same = earlier.get("budget_gib") == round(budget / GiB, 2)
        reuse = {r["seq_len"]: _complete(r, budget) for r in earlier.get("rehearsals", []) if same}
        cell = run_cell(shape, gpus, options, budget, rehearse=not args.plan_only, timeout=args.rehearsal_timeout,
                        rehearsals=args.rehearsals, reuse=reuse, first_scale=args.first_scale,
                        node_host=int(args.node_host_gib * GiB))
        cells[(shape, gpus, options)] = cell
        print(json.dumps(cell), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"machine": machine(),
                                            "torch": torch.__version__, "budget_gib": round(args.budget_gib, 2),
                                            "alst": {f"{s} x {g}": n for (s, g), n in ALST.items()},
                                            "upipe": {f"{s} x {g}": n for (s, g), n in UPIPE.items()},
                                            "cells": sorted(cells.values(), key=lambda c: (c["shape"], c["gpus"],
                                                                                          c["options"]))}, indent=1)
                                + "\n")
    print(table(list(cells.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
