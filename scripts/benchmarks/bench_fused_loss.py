"""Step time of the fused loss against the unfused one, at cp = 1 and 2 (issue 26: at most 5% dearer).

    python scripts/benchmarks/bench_fused_loss.py                    # Llama-3 proportions, dim 256, 128k vocabulary
    python scripts/benchmarks/bench_fused_loss.py --vocab 1024 --seq-len 256 --repeats 1   # a quick check that it runs

Each measurement is a fresh set of rank processes (`common.run_trial`), `--steps` steps, the
last step's wall time (the first pays one-off set-up), repeated `--repeats` times; prints the median per
case and the fused/unfused ratio. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics

from common import run_trial


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    model = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1, "ffn_hidden_dim": 896, "vocab_size": args.vocab}
    print(f"{'cp':>3} {'unfused s/step':>15} {'fused s/step':>13} {'fused/unfused':>14}")
    for cp in args.cps:
        medians = {}
        for fused in (False, True):
            extra = ("--activation_checkpoint.mode=none", f"--training.fused_loss={str(fused).lower()}")
            times = [run_trial(model, cp, args.seq_len, steps=args.steps, timeout=args.timeout, extra=extra)["step_s"]
                     for _ in range(args.repeats)]
            medians[fused] = statistics.median(times)
        print(f"{cp:>3} {medians[False]:>15.3f} {medians[True]:>13.3f} {medians[True] / medians[False]:>14.3f}")


if __name__ == "__main__":
    main()
