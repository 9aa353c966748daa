"""One measured training run on fresh rank processes: what `scripts/benchmarks/bench_memory.py` repeats.

`run_trial` starts P ranks, each a fresh Python process running this file with `--_rank`
(so nothing of the benchmark's own memory is counted), that joins a gloo group, builds the
Trainer from `train_configs/debug_cpu.toml` plus overrides, runs the steps and writes its own
numbers: peak RSS (`VmHWM`), step wall and CPU times, the bytes of distinct storages autograd
saved (a `saved_tensors_hooks` pack hook), and the rows of the largest vocabulary-wide and
feed-forward-wide tensors it saved (how a benchmark tells that a fused loss or a tiled MLP
really ran). The launcher polls every rank's RSS every 50 ms and stops a run whose rank crosses
a budget. The ranks inherit this process's environment: glibc's allocator defaults unless set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"


def trainer_args(model: dict[str, int], cp: int, seq_len: int, steps: int, dump: str,
                 extra: tuple[str, ...] = ("--activation_checkpoint.mode=none", "--training.fused_loss=false")
                 ) -> list[str]:
    """The command line (as for `python -m cpcompose.train`) of one measurement; `extra` comes last (wins)."""
    return [
        "--config", str(CONFIG), f"--training.steps={steps}", f"--training.seq_len={seq_len}",
        "--training.batch_size=1", f"--parallelism.cp={cp}", "--parallelism.dp_shard=-1",
        "--parallelism.cp_strategy=ring", "--parallelism.cp_layout=zigzag",
        "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", "--metrics.plot_loss=false",
        "--lr_scheduler.warmup_steps=1", f"--job.dump_folder={dump}",
        *(f"--model.{k}={v}" for k, v in model.items()), *extra,
    ]


# --- one rank (a fresh process started by `run_trial`) ---


def rank_main(rank: int, world: int, store: str, timeout: float, argv: list[str], out: str) -> None:
    """Build the Trainer, run its steps, write this rank's numbers to `out`."""
    import torch
    import torch.distributed as dist

    from cpcompose.config import load_config
    from cpcompose.training.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        trainer = Trainer(load_config(argv))
        built = _rss_mib()
        vocab, ffn = trainer.config.model.vocab_size, trainer.config.model.ffn_hidden_dim // trainer.dims.tp
        saved: dict[int, int] = {}  # storage address -> bytes, for every tensor autograd keeps
        wide = {"vocab": 0, "ffn": 0}  # rows of the largest saved tensor this wide

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            saved[s.data_ptr()] = s.nbytes()
            for name, width in (("vocab", vocab), ("ffn", ffn)):
                # feed-forward activations are (batch, seq, ffn); a (dim, ffn) weight a tiled MLP saves is 2-D
                if t.dim() >= (2 if name == "vocab" else 3) and t.shape[-1] == width:
                    wide[name] = max(wide[name], t.numel() // width)
            return t

        walls, cpus, sys_s, saved_mib, losses = [], [], [], [], []
        for _ in range(trainer.config.training.steps):
            saved.clear()
            dist.barrier()
            start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                losses.append(trainer.train_step())
            after = resource.getrusage(resource.RUSAGE_SELF)
            walls.append(time.perf_counter() - start)
            sys_s.append(after.ru_stime - before.ru_stime)
            cpus.append(after.ru_utime - before.ru_utime + sys_s[-1])
            saved_mib.append(sum(saved.values()) / 2**20)
        dist.barrier()
        result = {"rank": rank, "peak_mib": _maxrss_mib(), "built_mib": built, "step_s": walls, "cpu_s": cpus,
                  "sys_s": sys_s, "saved_mib": saved_mib, "losses": losses, "threads": torch.get_num_threads(),
                  "saved_rows": wide}
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _maxrss_mib() -> float:
    """This rank's own peak resident set (VmHWM; `ru_maxrss` would count its parent's at the fork)."""
    from cpcompose.training.resources import peak_resident_bytes

    return peak_resident_bytes() / 2**20


def _rss_mib(pid: int | str = "self") -> float:
    """Current resident set of a process, MiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:")) / 1024


# --- the launcher ---


def run_trial(
    model: dict[str, int], cp: int, seq_len: int, *, steps: int, timeout: float, budget_mib: float | None = None,
    extra: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """One training run on `cp` fresh processes. Returns its per-rank numbers and a status:
    "ok", "over budget" (a rank's RSS crossed `budget_mib`; stopped), or "failed"."""
    with tempfile.TemporaryDirectory(prefix="cpcompose-mem-") as tmp:
        dump = os.path.join(tmp, "dump")
        argv = trainer_args(model, cp, seq_len, steps, dump) if extra is None else \
            trainer_args(model, cp, seq_len, steps, dump, extra)
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(cp)]
        spec = json.dumps({"world": cp, "store": os.path.join(tmp, "store"), "timeout": timeout, "argv": argv})
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--_rank", str(r), "--_spec", spec, "--_out", outs[r]],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            )
            for r in range(cp)
        ]
        status, polled, deadline = "ok", 0.0, time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                rss = max(_rss_mib(p.pid) for p in procs)
                polled = max(polled, rss)
                if budget_mib is not None and rss > budget_mib:
                    status = "over budget"
                    break
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    status = "failed"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            errors = [p.communicate()[1] for p in procs]
        if status == "ok" and any(p.returncode for p in procs):
            status = "failed"
        row: dict[str, Any] = {"cp": cp, "seq_len": seq_len, "status": status, "polled_max_rss_mib": polled,
                               "argv": argv}
        if status == "failed":
            tail = next((e for e in errors if e.strip()), "(no output; timed out?)")
            row["error"] = tail.strip().splitlines()[-1][:300] if tail.strip() else tail
            print(f"    L={seq_len} cp={cp}: FAILED: {row['error']}", flush=True)
            return row
        if status == "over budget":
            print(f"    L={seq_len:>6} cp={cp}: over budget (RSS {polled:,.0f} MiB, stopped)", flush=True)
            return row
        ranks = [json.loads(Path(o).read_text()) for o in outs]
    row.update(
        ranks=ranks,
        peak_mib=max(r["peak_mib"] for r in ranks),
        step_s=max(r["step_s"][-1] for r in ranks),  # the last step: the first pays one-off set-up
        cpu_s=max(r["cpu_s"][-1] for r in ranks),
        sys_s=max(r["sys_s"][-1] for r in ranks),
        saved_mib=max(r["saved_mib"][-1] for r in ranks),
        saved_rows={k: max(r["saved_rows"][k] for r in ranks) for k in ranks[0]["saved_rows"]},
        threads=ranks[0]["threads"],
    )
    row["tokens_per_s"] = seq_len / row["step_s"]
    if budget_mib is not None and row["peak_mib"] > budget_mib:
        row["status"] = "over budget"
    print(f"    L={seq_len:>6} cp={cp}: peak {row['peak_mib']:,.0f} MiB/rank, {row['step_s']:.2f} s/step, "
          f"{row['status']}", flush=True)
    return row


# --- shared by the experiments ---


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a, b of peak = a + b * L."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def machine() -> dict[str, Any]:
    import torch

    model = "unknown"
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    with open("/proc/meminfo") as f:
        total = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) / 2**20
    return {"cpu": model, "cores": os.cpu_count(), "ram_gib": round(total, 1), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def fmt(x: float | None, f: str = "{:,.0f}") -> str:
    return "n/a" if x is None else f.format(x)


if __name__ == "__main__":  # a rank started by run_trial
    w = argparse.ArgumentParser()
    w.add_argument("--_rank", type=int)
    w.add_argument("--_spec")
    w.add_argument("--_out")
    a = w.parse_args()
    spec = json.loads(a._spec)
    rank_main(a._rank, spec["world"], spec["store"], spec["timeout"], spec["argv"], a._out)
