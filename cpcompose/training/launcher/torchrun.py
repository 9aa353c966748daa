"""torchrun, ended by Ctrl-C in one line and the shell's exit code, instead of its SignalException traceback.

    python -m cpcompose.training.launcher.torchrun --nproc_per_node 2 cpcompose/train.py --config train_configs/debug_cpu.toml

Takes torchrun's arguments, the multi-node ones included, unchanged: on each node,

    cpcompose-torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m cpcompose.train --config ...

(`scripts/multinode_train.slurm` runs it under SLURM; docs/trainer/multi-node.md). On Ctrl-C torchrun's agent
forwards the signal to the ranks and waits for them (up to 30 s): the trainer finishes its step, saves, and
says how to resume. Then the agent raises
`SignalException` out of its own signal handler, which plain torchrun prints as a 25-line traceback
ending in exit 1, although the run stopped cleanly. Here it ends in one line and the conventional
exit code, 128 + the signal (130 for Ctrl-C, 143 for SIGTERM); a rank's failure ends in torchrun's
own summary of the failed ranks (their one-line errors: `cpcompose.train` writes them) and exit 1.
The ranks cannot do this themselves: the traceback is the launching process's.
"""

from __future__ import annotations

import signal
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv` (default: this process's arguments); returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"torchrun stopped by {name}; each rank's last line says what it saved: the same command resumes "
              "from the newest checkpoint", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
