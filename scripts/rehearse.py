"""Rehearse one training step at full size on this CPU: torch's FSDPMemTracker against the memory plan.

    python scripts/rehearse.py --world 64 --config train_configs/llama3_8b_128k.toml
    python scripts/rehearse.py --world 64 --config train_configs/llama3_8b_128k.toml \
        --model.dim=8192 --model.n_layers=80 --model.n_heads=64 --model.ffn_hidden_dim=28672 \
        --training.seq_len=1048576 --parallelism.cp=64 --training.batch_size=1      # a 70B shape at 1M tokens

Any trainer option after the script's own (`--world`) overrides the config, as for `python -m cpcompose.train`.
Runs in one process on fake tensors with a fake process group (cpcompose.training.rehearsal): no GPU, no
communication. Prints the tracker's peak and its parts, and the plan's tensors (less process and slack).
cpcompose's own families only (the plan has no Hugging Face profile yet).
"""

from __future__ import annotations

import argparse
import time

from cpcompose.config import load_config
from cpcompose.training.rehearsal import rehearse

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, required=True, help="ranks to rehearse (this process is rank 0)")
    args, trainer_args = parser.parse_known_args()
    config = load_config(trainer_args)
    start = time.perf_counter()
    result = rehearse(config, args.world)
    print(f"rehearsed {config.job.name} on {args.world} ranks in {time.perf_counter() - start:.0f} s")
    print(f"  torch's FSDPMemTracker peak   {result.tracked / GiB:8.2f} GiB")
    for kind, nbytes in result.by_kind.items():
        print(f"    {kind:<26}{nbytes / GiB:8.2f} GiB")
    print(f"  memory plan (tensors)         {result.planned / GiB:8.2f} GiB  ({result.ratio - 1:+.1%} of the tracker)")


if __name__ == "__main__":
    main()
