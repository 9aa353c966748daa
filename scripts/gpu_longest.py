"""On one GPU: the peak of real training steps and the longest sequence that trains, against the plan and the rehearsal.

    python scripts/gpu_longest.py --out $OUT/longest_gpu.json                  # a lent H100/H200, under 10 minutes
    python scripts/gpu_longest.py --shape llama3-3b --activation_checkpoint.mode=full    # longer, slower runs
    python scripts/gpu_longest.py --cpu-toy --out /tmp/toy.json               # the same steps, toy size, on CPU

Any trainer option after the script's own overrides the cell's (e.g. `--training.tiled_mlp=8`). Each training run
is a fresh process (`--_trial`: one rank, two steps of the trainer's Llama on the synthetic task; an out-of-memory
run leaves nothing behind); its peak is CUDA's `max_memory_allocated` and `max_memory_reserved` (on CPU: the
resident-set high-water mark). In order, each step given what the time budget leaves:
1. at `--fixed-len` tokens: the measured peak, the plan's (`plan_memory`) and the rehearsal's (torch's MemTracker on
   fake tensors, `cpcompose.training.memory.rehearsal`) - these always run;
2. the plan's longest length that fits the device (bisected, instant);
3. the rehearsal at that length: does it fit?
4. the measured longest: real runs bisected from the plan's answer, on a grid of about 2% of it, until
   `--time-budget` seconds are spent (the JSON then gives the bracket the runs reached).
Prints a Markdown table for the README and writes the JSON to `--out` (default `$OUT/longest_gpu.json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cpcompose.config import load_config
from cpcompose.training.memory.longest_sequence import grid_unit, longest, plan_fits, with_length
from cpcompose.training.memory.plan import plan_memory

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]
BASE = ["--config", str(ROOT / "train_configs" / "llama3_8b_128k.toml"), "--parallelism.cp=1",
        "--parallelism.dp_shard=1", "--training.batch_size=1", "--training.steps=2", "--training.compile=false",
        "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", "--metrics.log_freq=1",
        "--lr_scheduler.warmup_steps=1", "--training.fused_loss=true", "--activation_checkpoint.mode=none"]
"""The fused loss without checkpointing by default: the 1B's longest is then ~26k tokens (plan), each run seconds,
and the bisection ends within the budget; with `--activation_checkpoint.mode=full` it is ~180k and each run over a
minute of attention (the JSON then holds the bracket the budget allowed)."""
SHAPES = {  # Llama-3.2-1B and -3B; the 8B's AdamW state alone (128 GB) is more than one GPU holds
    "llama3-1b": ["--model.dim=2048", "--model.n_layers=16", "--model.n_heads=32", "--model.n_kv_heads=8",
                  "--model.ffn_hidden_dim=8192"],
    "llama3-3b": ["--model.dim=3072", "--model.n_layers=28", "--model.n_heads=24", "--model.n_kv_heads=8",
                  "--model.ffn_hidden_dim=8192"],
}
TOY = ["--model.vocab_size=4096", "--model.dim=128", "--model.n_layers=2", "--model.n_heads=4",
       "--model.n_kv_heads=2", "--model.ffn_hidden_dim=256", "--training.device=cpu"]
REHEARSE = """
import json, sys
from cpcompose.config import load_config
from cpcompose.training.memory.rehearsal import rehearse
r = rehearse(load_config(sys.argv[1:]), 1)
print(json.dumps({"tracked": r.tracked, "planned": r.planned}))
"""


class OutOfTime(Exception):
    """The time budget is spent."""


def trial_main(out: str, argv: list[str]) -> None:
    """One rank: the trainer's steps at the given options; writes whether they ran and the peak."""
    import torch.distributed as dist

    from cpcompose.training.memory.oom import is_out_of_memory
    from cpcompose.training.memory.resources import peak_resident_bytes
    from cpcompose.training.loop.trainer import Trainer

    config = load_config(argv)
    cuda = config.training.device != "cpu" and torch.cuda.is_available()
    store = tempfile.mkdtemp() + "/store"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=300))
    result: dict = {"ran": True}
    try:
        Trainer(config).run()
    except Exception as e:  # noqa: BLE001 (one kind is expected: out of memory; the rest are re-raised)
        if not (is_out_of_memory(e) or "out of memory" in str(e).lower()):
            raise
        result = {"ran": False, "error": str(e).splitlines()[0][:300]}
    finally:
        dist.destroy_process_group()
    if cuda:
        result.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved())
    else:
        result.update(allocated=peak_resident_bytes(), reserved=peak_resident_bytes())
    Path(out).write_text(json.dumps(result))


class Session:
    """The runs of one invocation, against one deadline."""

    def __init__(self, args: list[str], device: str, budget: int, deadline: float, rehearsal_timeout: float) -> None:
        self.args, self.device, self.budget, self.deadline = args, device, budget, deadline
        self.rehearsal_timeout = rehearsal_timeout
        self.dump = tempfile.mkdtemp(prefix="gpu_longest_")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def trial(self, seq_len: int, *, always: bool = False) -> dict:
        """Two real steps at `seq_len` in a fresh process: {"ran", "allocated", "reserved", "seconds"}."""
        if not always and self.left() <= 0:
            raise OutOfTime
        out = Path(self.dump) / f"trial_{seq_len}.json"
        argv = [*self.args, f"--training.seq_len={seq_len}", f"--job.dump_folder={self.dump}/run_{seq_len}"]
        start = time.monotonic()
        run = subprocess.run([sys.executable, __file__, "--_trial", str(out), *argv], capture_output=True, text=True,
                             cwd=ROOT, timeout=max(60.0, self.left()) if not always else None, check=False)
        if not out.exists():
            raise RuntimeError(f"the run at {seq_len} tokens failed:\n{run.stderr[-3000:]}")
        return {**json.loads(out.read_text()), "seconds": round(time.monotonic() - start, 1)}

    def fits(self, got: dict) -> bool:
        """A run fits when it finished and (on CPU, where nothing refuses) its peak is within the budget."""
        return got["ran"] and (self.device == "cuda" or got["reserved"] <= self.budget)

    def rehearse(self, seq_len: int, *, always: bool = False) -> dict | None:
        """The rehearsal of one step at `seq_len` (tracker and the plan's tensors, CUDA-kind); None out of time."""
        timeout = self.rehearsal_timeout if always else min(self.rehearsal_timeout, self.left())
        if timeout <= 0:
            return None
        start = time.monotonic()
        try:
            run = subprocess.run([sys.executable, "-c", REHEARSE, *self.args, f"--training.seq_len={seq_len}"],
                                 capture_output=True, text=True, cwd=ROOT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return None
        if run.returncode != 0:
            raise RuntimeError(f"the rehearsal at {seq_len} tokens failed:\n{run.stderr[-3000:]}")
        got = json.loads(run.stdout.strip().splitlines()[-1])
        plan = plan_memory(with_length(load_config(self.args), seq_len), 1, device_type="cuda")
        peak = got["tracked"] + plan.part("process") + plan.part("allocator slack")
        return {**got, "peak": peak, "fits": peak <= self.budget, "seconds": round(time.monotonic() - start, 1)}


def measured_longest(session: Session, unit: int, guess: int) -> dict:
    """Real runs bisected from `guess` until the time budget ends: the longest that ran and the shortest that did
    not (None where no run said)."""
    ran: list[int] = []
    failed: list[int] = []

    def fits(seq_len: int) -> bool:
        ok = session.fits(session.trial(seq_len))
        (ran if ok else failed).append(seq_len)
        return ok

    try:
        best = longest(fits, unit, guess)
        return {"longest": best, "complete": True, "ran": ran, "failed": failed}
    except OutOfTime:
        return {"longest": max(ran, default=None), "complete": False, "ran": ran, "failed": failed,
                "shortest_failed": min(failed, default=None)}


def table(r: dict) -> str:
    """The README's rows: the peak at the fixed length and the longest length, measured / plan / rehearsal."""
    def gib(n: float | None) -> str:
        return "n/a" if n is None else f"{n / GiB:.2f} GiB"

    f, m, rh = r["fixed"], r["measured_longest"], r.get("rehearsal_at_plan_longest")
    rows = [f"| {r['shape']}, one {r['device_name']} | measured | plan | rehearsal |", "|---|---:|---:|---:|",
            f"| peak at {f['seq_len']:,} tokens (tensors) | {gib(f['allocated'] if r['device'] == 'cuda' else None)} | "
            f"{gib(f['plan_tensors'])} | "
            f"{gib(f.get('tracked'))} |",
            f"| peak at {f['seq_len']:,} tokens (reserved, or RSS / total) | {gib(f['reserved'])} | "
            f"{gib(f['plan_total'])} | "
            f"{gib(f.get('rehearsal_peak'))} |"]
    measured = "n/a" if m["longest"] is None else f"{m['longest']:,}" + ("" if m["complete"] else " (at least)")
    rehearsed = "n/a" if rh is None else ("fits" if rh["fits"] else "does not fit") + f" at {r['plan_longest']:,}"
    rows.append(f"| longest sequence | {measured} | {r['plan_longest']:,} | {rehearsed} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-1b")
    parser.add_argument("--fixed-len", type=int, default=16384, help="tokens of the peak comparison")
    parser.add_argument("--cpu-toy", action="store_true", help="a toy model on the CPU (what the test runs)")
    parser.add_argument("--budget-gib", type=float, help="memory per GPU (default: the device's; --cpu-toy: 2)")
    parser.add_argument("--time-budget", type=float, default=480.0,
                        help="seconds for the whole script; the bisection stops there (1 always runs)")
    parser.add_argument("--rehearsal-timeout", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "longest_gpu.json")
    parser.add_argument("--_trial", help=argparse.SUPPRESS)
    args, trainer_args = parser.parse_known_args(argv)
    if args._trial:
        trial_main(args._trial, trainer_args)
        return 0
    deadline = time.monotonic() + args.time_budget
    device = "cpu" if args.cpu_toy else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --cpu-toy")
    cell = [*BASE, *(TOY if args.cpu_toy else SHAPES[args.shape] + ["--training.device=cuda"]), *trainer_args]
    if args.budget_gib is not None:
        budget = int(args.budget_gib * GiB)
    else:
        budget = 2 * GiB if args.cpu_toy else torch.cuda.get_device_properties(0).total_memory
    fixed = 1024 if args.cpu_toy and args.fixed_len == 16384 else args.fixed_len
    session = Session(cell, device, budget, deadline, args.rehearsal_timeout)
    config = load_config(cell)
    plan = plan_memory(with_length(config, fixed), 1, device_type=device)
    tensors = plan.total - plan.part("process") - plan.part("allocator slack")
    got = session.trial(fixed, always=True)
    result: dict = {"shape": "toy" if args.cpu_toy else args.shape, "device": device, "budget_gib": budget / GiB,
                    "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "CPU",
                    "torch": torch.__version__, "args": cell,
                    "fixed": {"seq_len": fixed, **got, "plan_total": plan.total, "plan_tensors": tensors,
                              "plan_phase": plan.phase}}
    rehearsal = session.rehearse(fixed, always=True)
    if rehearsal is not None:
        result["fixed"].update(tracked=rehearsal["tracked"], rehearsal_peak=rehearsal["peak"],
                               cuda_plan_tensors=rehearsal["planned"],
                               rehearsal_seconds=rehearsal["seconds"])
    unit = grid_unit(config)
    result["plan_longest"] = plan_longest = longest(plan_fits(config, 1, budget, device), unit, guess=fixed)
    result["rehearsal_at_plan_longest"] = session.rehearse(plan_longest) if plan_longest else None
    coarse = unit * max(1, plan_longest // (50 * unit))  # about 2% of the plan's answer
    result["grid"] = coarse
    result["measured_longest"] = measured_longest(session, coarse, plan_longest)
    result["seconds"] = round(args.time_budget - session.left(), 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
