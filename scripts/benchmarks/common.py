"""What the benchmarks of this folder share: where they ran, their tables and JSON, their timers, their rank
processes, and the training trials on fresh processes that bench_memory.py and bench_fused_loss.py run.

A benchmark run as `python scripts/benchmarks/bench_x.py` has this folder on sys.path, so `from common import
...` needs no path edit; cpcompose is the installed one. Only the standard library is imported here at module
level: a trial's rank runs this file (below), and imports what a rank needs and nothing more.

* `machine(device)`: the one description of the machine a benchmark's JSON records;
* `markdown_table`, `markdown_header`, `markdown_row`, `fmt`: the printed tables;
* `write_json(path, data)`: a benchmark's JSON, its folder made;
* `best_time`, `repeated`, `sync`: timers;
* `spawn_ranks`, `init_rank`, `exit_rank`: P spawned processes of one thread in a gloo (or NCCL) group, rank 0
  handing back the results;
* `tiny_hf_model(folder)`: the tiny Llama `cpcompose/integrations/transformers/tiny_model.py` writes;
* `run_trial`, `trainer_args`, `fit_line`, `mem_available_mib`: one measured training run on fresh rank processes.

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
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""
CONFIG = ROOT / "train_configs" / "debug_cpu.toml"
T = TypeVar("T")


# --- where it ran ---


def machine(device: str = "cpu") -> dict[str, Any]:
    """What the numbers were measured on: the CPU model (from /proc/cpuinfo where there is one), its architecture,
    cores, ISA level and memory, the software, the date; and on CUDA the GPU, their count and the CUDA and cuDNN
    versions."""
    import torch

    cpu = processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu, "processor": processor, "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "libc": " ".join(platform.libc_ver()),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    return info


# --- tables and JSON ---


def markdown_header(headers: Sequence[str], left: Collection[str] = ()) -> str:
    """A Markdown table's header and rule; the columns named in `left` align left, the others right."""
    rule = "|".join("---" if head in left else "---:" for head in headers)
    return "| " + " | ".join(headers) + f" |\n|{rule}|"


def markdown_row(cells: Sequence[str]) -> str:
    """One row of a Markdown table (an empty cell stays one space wide)."""
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[str] = ()) -> str:
    """A Markdown table of `rows` (strings, one per header); the columns named in `left` align left."""
    return "\n".join([markdown_header(headers, left), *(markdown_row(row) for row in rows)])


def fmt(x: float | None, f: str = "{:,.0f}") -> str:
    """`x` in format `f`, or n/a."""
    return "n/a" if x is None else f.format(x)


def write_json(path: Path | str, data: Any) -> None:
    """A benchmark's results as JSON (indented, a newline at the end), its folder made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


# --- timers ---


def best_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Seconds of the fastest of `repeats` calls after `warmup` untimed ones: on a shared machine, interference only
    ever adds time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def repeated(fn: Callable[[], T], warmup: int, repeats: int) -> list[T]:
    """`repeats` results of `fn()` after `warmup` discarded calls."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]


def sync(device: str) -> None:
    """Wait for queued GPU work, so that a timer reads finished work (a no-op on CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# --- rank processes ---


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any, prefix: str = "cpcompose-bench-") -> Any:
    """Run `worker(rank, world, store, *args, out)` on `world` spawned processes and return the JSON rank 0 wrote
    to the file `out`; `store` is a file for `init_rank`. Raises (and kills the other ranks) if any worker fails:
    a non-zero exit, no hang."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        store, out = os.path.join(folder, "store"), os.path.join(folder, "results.json")
        mp.spawn(worker, args=(world, store, *args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def init_rank(rank: int, world: int, store: str, *, device: str = "cpu", timeout_s: float = 300.0) -> None:
    """Join the group of a `spawn_ranks` worker, with one thread. On CUDA: GPU rank % device_count; NCCL when every
    rank has its own GPU, else gloo (NCCL refuses two ranks on one GPU; cpcompose stages CUDA tensors for gloo)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def exit_rank() -> NoReturn:
    """Leave a rank that succeeded without interpreter teardown: after a gloo job it intermittently aborts
    ("terminate called without an active exception", static destructors racing the backend's threads;
    cpcompose.train does the same), which failed a finished run."""
    sys.stdout.flush()
    os._exit(0)


# --- models ---


def tiny_hf_model(folder: Path) -> Path:
    """`folder`, holding the tiny Llama and its tokenizer that `cpcompose-tiny-model` writes (once)."""
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", "cpcompose.integrations.transformers.tiny_model", str(folder)], cwd=ROOT,
                       check=True, capture_output=True)
    return folder


# --- training trials on fresh rank processes ---


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
    from cpcompose.training.loop.trainer import Trainer

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
    from cpcompose.training.memory.resources import peak_resident_bytes

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


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a, b of peak = a + b * L."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


if __name__ == "__main__":  # a rank started by run_trial
    w = argparse.ArgumentParser()
    w.add_argument("--_rank", type=int)
    w.add_argument("--_spec")
    w.add_argument("--_out")
    a = w.parse_args()
    spec = json.loads(a._spec)
    rank_main(a._rank, spec["world"], spec["store"], spec["timeout"], spec["argv"], a._out)
