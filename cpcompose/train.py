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

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file by torchrun: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpcompose.config import ConfigError, JobConfig, load_config  # noqa: E402
from cpcompose.training.launch import launch_local, planned_world_size  # noqa: E402
from cpcompose.training.plan import describe_plan  # noqa: E402
from cpcompose.training.trainer import Trainer  # noqa: E402


def train(config: JobConfig) -> list[float]:
    """Train as `config` says, in this process's rank; returns the loss of every step run.

    Uses the default process group if one exists (tests fork workers that have one),
    else creates it from torchrun's environment with `comm.timeout_s`.
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
        # (build_mesh hands the world's timeout to every mesh group.)
        dist.group.WORLD.set_timeout(timedelta(seconds=config.comm.timeout_s))
    try:
        trainer = Trainer(config)
        return trainer.run()
    except RuntimeError as e:  # gloo raises a plain RuntimeError on a timeout, NCCL a DistError
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise SystemExit(
                f"rank {dist.get_rank()}: a collective waited longer than comm.timeout_s = {config.comm.timeout_s} s; "
                f"another rank has probably died or stalled (see its log). ({type(e).__name__}: {e})"
            ) from e
        raise
    finally:
        if owns_group:
            dist.destroy_process_group()


def _use_cuda(config: JobConfig) -> bool:
    device = config.training.device
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: parse and check, then dry-run, launch locally, or train."""
    try:
        config = load_config(argv)
        world = int(os.environ.get("WORLD_SIZE", 0)) or planned_world_size(config)
        config.validate(world_size=world)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if config.job.dry_run:
        print(describe_plan(config, world))
        return
    if "RANK" not in os.environ and not dist.is_initialized() and world > 1:
        launch_local(train, config, world)
        return
    train(config)


if __name__ == "__main__":
    main()
