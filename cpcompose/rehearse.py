"""Rehearse one training step at full size on this CPU: torch's FSDPMemTracker against the memory plan.

    python -m cpcompose.rehearse --world 64 --config train_configs/llama3_8b_128k.toml
    python -m cpcompose.rehearse --world 64 --config train_configs/llama3_8b_128k.toml \
        --model.dim=8192 --model.n_layers=80 --model.n_heads=64 --model.ffn_hidden_dim=28672 \
        --training.seq_len=1048576 --parallelism.cp=64 --training.batch_size=1      # a 70B shape at 1M tokens
    python -m cpcompose.rehearse --world 64 --config train_configs/hf_qwen3_8b_128k.toml --model.path=FOLDER
        # Qwen3-8B: FOLDER holds its config.json alone (no weights needed)

With `--parallelism.pp > 1` one pipeline rank is rehearsed (its stages in its schedule's order: the rank with the
largest planned peak, or `--pp-rank R`).

Any trainer option after the command's own (`--world`, `--pp-rank`) overrides the config, as for `python -m cpcompose.train`.
Runs in one process on fake tensors with a fake process group (cpcompose.training.memory.rehearsal): no GPU, no
communication. Prints the tracker's peak and its parts, and the plan's tensors (less process and slack); the
dry run prints the same with --job.dry_run --job.rehearse. Installed as the `cpcompose-rehearse` command too.
"""

from __future__ import annotations

import argparse
import sys
import time

from cpcompose.config import load_config
from cpcompose.training.memory.rehearsal import describe_rehearsal, rehearse

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The `cpcompose-rehearse` command and `python -m cpcompose.rehearse`; returns the exit code.

    Args:
        argv: `--world N` and the trainer's options (default: this process's arguments).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, required=True, help="ranks to rehearse (this process is rank 0)")
    parser.add_argument("--pp-rank", type=int, default=None,
                        help="with parallelism.pp > 1: the pipeline rank to rehearse (default: the plan's largest)")
    args, trainer_args = parser.parse_known_args(argv)
    config = load_config(trainer_args)
    start = time.perf_counter()
    result = rehearse(config, args.world, pp_rank=args.pp_rank)
    print(f"rehearsed {config.job.name} on {args.world} ranks in {time.perf_counter() - start:.0f} s")
    print("\n".join(describe_rehearsal(result, args.world)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
