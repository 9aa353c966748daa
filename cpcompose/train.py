"""cpcompose's training entry point.

    torchrun --nproc_per_node 2 cpcompose/train.py --config train_configs/debug_cpu.toml
    python -m cpcompose.train --config train_configs/debug_cpu.toml   # starts the processes itself

Dotted overrides win over the TOML file, which wins over the defaults
(`--parallelism.cp=4 --training.seq_len=16384`); `--help` lists every option.
The configuration is checked completely (keys, types, degrees against the world
size) before any process group exists.

One step: each data-parallel rank takes its batch of full sequences, each CP rank
keeps its shard of every sequence (zigzag by default) with the global positions
of its tokens, the model runs with its SDPA calls made context-parallel, and the
loss is this rank's share of the global mean (`cp_cross_entropy`), so gradients
are summed over dp x cp by FSDP's reduce-scatter.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file by torchrun: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpcompose.config import ConfigError, JobConfig, load_config  # noqa: E402
from cpcompose.data.store import uses_store  # noqa: E402
from cpcompose.training.errors import ErrorKind, TrainingError  # noqa: E402
from cpcompose.training.loop.faults import is_comm_failure  # noqa: E402
from cpcompose.training.launcher.local import Report, launch_local, planned_world_size  # noqa: E402
from cpcompose.training.loop.nodes import agree_on_nodes  # noqa: E402
from cpcompose.training.loop.lr_schedule import warmup_note  # noqa: E402
from cpcompose.training.memory.budget import run_plan  # noqa: E402
from cpcompose.training.memory.oom import (  # noqa: E402
    MemoryGuard,
    apply_cuda_budget,
    is_out_of_memory,
    out_of_memory_line,
    peak_bytes,
)
from cpcompose.training.memory.resources import (  # noqa: E402
    allocator_warning, oversubscription_warning, run_device_type, usable_cores,
)
from cpcompose.training.loop.metrics import stamp  # noqa: E402
from cpcompose.training.launcher.dry_run import describe_plan  # noqa: E402
from cpcompose.training.launcher.preflight import preflight  # noqa: E402
from cpcompose.training.resolve import resolve_config  # noqa: E402
from cpcompose.training.loop.trainer import Trainer  # noqa: E402

__all__ = ["cli", "main", "run_rank", "train"]


def train(config: JobConfig, *, guard: MemoryGuard | None = None) -> list[float]:
    """Train as `config` says, in this process's rank; returns the loss of every step run.

    Uses the default process group if one exists (tests fork workers that have one),
    else creates it from torchrun's environment with `comm.timeout_s`. `guard` (see
    `run_rank`) is told the trainer's step once it exists, for its report.

    Raises:
        TrainingError: a one-line account of what went wrong (see `run_rank`), out of memory included.
    """
    owns_group = not dist.is_initialized()
    if owns_group:
        device_type = "cuda" if _use_cuda(config) else "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # Under torchrun (or launch_local) the environment says where to meet; a lone
        # process meets itself through a file, with no port to race for.
        alone = {} if "RANK" in os.environ else {
            "init_method": f"file://{tempfile.mkdtemp(prefix='cpcompose-')}/store", "rank": 0, "world_size": 1,
        }
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            timeout=timedelta(seconds=config.comm.init_timeout_s),  # generous while ranks start
            **alone,
        )
        # Then every collective is bounded by comm.timeout_s: a dead rank ends the job, never hangs it.
        # (build_mesh hands the world's timeout to every mesh group, and ring waits read it from there.)
        dist.group.WORLD.set_timeout(timedelta(seconds=config.comm.timeout_s))
        agree_on_nodes(config)  # every node the same size, one dump folder for all: refused alike on every rank
    apply_cuda_budget(config)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(config)
        if guard is not None:
            guard.follow(lambda: trainer.step)
        losses = trainer.run()
    except RuntimeError as e:  # out of memory, or a failure while building: the run loop explains its own
        if not isinstance(e, TrainingError) and is_out_of_memory(e):
            device = run_device_type(config)
            raise TrainingError(out_of_memory_line(
                config, dist.get_world_size(), rank=dist.get_rank(), step=trainer.step if trainer else None,
                peak=peak_bytes(device), how="an allocation failed" + (" on the GPU" if device == "cuda" else ""),
            ), kind="oom") from None
        cause = None if isinstance(e, TrainingError) else is_comm_failure(e)
        if cause is None:
            raise
        raise TrainingError(
            f"rank {dist.get_rank()}: a collective failed while the trainer was starting ({cause}); another rank "
            f"has probably died or stalled, see its log (comm.timeout_s = {config.comm.timeout_s:g} s)",
            kind="consequence",
        ) from e
    # Only after success: tearing a group down while a peer may still be inside a collective can hang.
    if owns_group:
        # Destroy while the interpreter is whole: gloo's threads may hold work objects with
        # tensors, and freeing those during interpreter finalization aborts the process.
        dist.destroy_process_group()
    return losses


def run_rank(config: JobConfig, report: Report | None = None) -> None:
    """One rank's whole life: train, report any error once as one line, and leave without teardown.

    The line goes to `report` when the launcher gave one (it decides what the job prints), else
    to stderr. With `training.memory_budget_gib` on CPU a `MemoryGuard` ends the rank, reporting,
    once its resident set passes the budget.

    Ends the process with `os._exit` after flushing: interpreter shutdown after a
    gloo job intermittently aborted with "terminate called without an active
    exception" (static destructors racing the backend's threads), which made
    successful runs report failure. Exit codes: 0 done, 1 failed, 2 config/environment.
    """
    def say(line: str, kind: ErrorKind) -> None:
        if report is not None:
            report(f"{stamp()} error: {line}", kind)
        else:
            print(f"{stamp()} error: {line}", file=sys.stderr, flush=True)

    guard = None
    budget = config.training.memory_budget_gib
    if budget is not None and run_device_type(config) == "cpu":
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

        def over_budget(resident: int) -> None:
            say(out_of_memory_line(config, world, rank=rank, step=guard.step() if guard else None, peak=resident,
                                   how="its resident set passed the budget and it stopped"), "oom")
            _exit(1)

        with contextlib.suppress(ValueError):  # the plan's measured process size now: the guard's line is instant
            run_plan(config, world)
        guard = MemoryGuard(int(budget * 2**30), over_budget).start()
    code = 0
    try:
        train(config, guard=guard)
    except TrainingError as e:
        code = e.exit_code
        # A config-like error is the same on every rank: rank 0 says it. A failure is per rank.
        if code != 2 or os.environ.get("RANK", "0") == "0":
            say(str(e), e.kind)
        _tell_torchrun(f"error: {e}")
    _exit(code)


def _tell_torchrun(message: str) -> None:
    """Under torchrun, leave this rank's one-line error where torchrun's failure summary reads it.

    torchrun ends a failed job with a summary of every rank that exited non-zero; without
    an error file each entry says only "To enable traceback see: <url>". With one, the
    summary's "Root Cause" names the error: the record torchrun's own `ErrorHandler`
    writes, with our line where it puts the traceback. Outside torchrun: nothing.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": record}, f)
    except OSError:  # the summary then says less; the error itself was printed
        pass


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _use_cuda(config: JobConfig) -> bool:
    device = config.training.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _lengths_png(config: JobConfig) -> Path | None:
    """Where the banner draws the token stores' document lengths: beside the loss plot (None without a store)."""
    if not uses_store(config):
        return None
    folder = Path(config.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "data_lengths.png"


def _outputs(config: JobConfig) -> str:
    dump = config.job.dump_folder
    parts = [f"checkpoints {dump}/{config.checkpoint.folder}" if config.checkpoint.enable else "no checkpoints"]
    if config.metrics.enable_tensorboard:
        parts.append(f"tensorboard {dump}/{config.metrics.save_tb_folder}")
    if config.metrics.plot_loss:
        parts.append(f"plot {dump}/loss.png")
    t = config.training
    note = warmup_note(config.lr_scheduler.warmup_steps, t.steps)
    return (f"  tokens per step: {t.batch_size * t.seq_len:,}\n"
            f"  outputs: " + ", ".join(parts) + (f"\n  {note}" if note else ""))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: parse and check, then dry-run, launch locally, or train; returns the exit code.

    Under torchrun every rank runs this; rank 0 alone prints a config error and the
    banner, the others exit quietly.
    """
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        config = load_config(argv)
        world = int(os.environ.get("WORLD_SIZE", 0)) or planned_world_size(config)
        config = resolve_config(config, world)
        data_notes: list[str] = []  # what the data check did (token stores reused or built), for the banner
        nothing_to_do = None if config.job.dry_run else preflight(config, world, data_notes=data_notes.append)
        plan = describe_plan(config, world) if config.job.dry_run else None  # a model folder it cannot read: refused
    except ConfigError as e:
        if rank0:
            print(f"config error: {e}", file=sys.stderr, flush=True)
        _tell_torchrun(f"config error: {e}")
        return 2
    if plan is not None:
        if rank0:  # under torchrun every rank plans; one prints
            print(plan)
        return 0
    if nothing_to_do is not None:
        if rank0:
            print(nothing_to_do, flush=True)
        return 0
    if rank0:
        where = " ".join(argv if argv is not None else sys.argv[1:])
        plan = describe_plan(config, world, _lengths_png(config), data_notes)
        print(f"{stamp()} cpcompose.train {where}\n{plan}\n{_outputs(config)}", flush=True)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world  # torchrun: the ranks on this host
        for warning in (oversubscription_warning(config, local, usable_cores()), allocator_warning(config)):
            if warning is not None:
                print(f"{stamp()} {warning}", file=sys.stderr, flush=True)
    if "RANK" not in os.environ and not dist.is_initialized() and world > 1:
        return launch_local(run_rank, config, world)
    run_rank(config)
    return 0  # not reached: run_rank ends the process


def cli() -> None:
    """The `cpcompose-train` console script and `python -m cpcompose.train`."""
    _exit(main())


if __name__ == "__main__":
    cli()
