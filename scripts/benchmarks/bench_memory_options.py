"""Benchmark: what each memory option costs in time, as tokens per second with it over tokens per second without it,
on 2 CPU ranks at a modest length (issue 40, item 5).

The memory table (`scripts/longest_sequence.py`, docs/trainer/memory.md) says how many tokens each option buys;
this says what each costs. The model is cpcompose's own Llama, float32, `--dim` 256, `--layers` 2, 8 query and 2
key/value heads (Llama 3's 4:1), a feed-forward of 3.5 dim, a `--vocab` 512-token vocabulary; one `--seq-len`
8,192-token sequence a step (batch 1) over cp = 2 ranks (FSDP over the same two), ring attention in the zigzag
layout, trained by the Trainer (`common.run_trial`: fresh rank processes, one thread each,
`train_configs/debug_cpu.toml` plus the overrides) on the synthetic copy task.

Why this shape: an option's cost is the share of the step its extra work takes, so the step must be made of what
Llama-3-8B's step is made of. Per token and layer, attention costs about 7 L d FLOPs (causal, forward and backward)
and the dense parts about 78 d^2 (Llama 3's GQA projections and a 3.5 d feed-forward, times 6), so their ratio is
set by L / d: 8,192 / 256 = 32 is Llama-3-8B's at 131,072 tokens (attention 2.9x the dense work). The head's share
(6 V d a token against the layers') is 2% there; 512 tokens of vocabulary over 2 layers give the same. So the
ratios read as Llama-3-8B's at 128k tokens; at millions of tokens attention is nearly the whole step, so an option
that redoes only token-wise work (tiled MLP, tiled block, fused loss) costs less there than here (docs page).

The options come from the tables below, to be edited as options land:

* `options()`: each option's command-line arguments, and, for one that does nothing on a CPU, why;
* `ALONE`: each option against the configuration without it (the plain CP run, or for `--parallelism.cp_head_chunks`
  the unchunked all-to-all strategy); `CUMULATIVE`: (a) to (g), each adding one option to the one before, as
  `scripts/longest_sequence.py --options` adds them, with the ratio to the step before and to (a).

Before anything runs, each configuration is loaded and validated as the trainer would (`load_config`,
`JobConfig.validate(2)`): an option the installed config does not know is reported "not available" (the option
is being built elsewhere), one it refuses "refused", both with the config's own words. An option that is a no-op on
a CPU device (checkpoint offload only moves CUDA tensors; offload_params: FSDP2's
CPUOffloadPolicy moves shards between device and host memory, here the same memory) is reported as such, not
given a ratio; a cumulative configuration that contains one is measured without it (g on a CPU is d plus the tiled
block). `--measure-noops` runs them anyway and records that ratio in the JSON as a check, still not as a cost.

The measurement. Every distinct configuration is one trial a round; a trial runs `--warmup` + `--steps` training
steps, and its time per step is the median of the steps after the warm-up (each step's time is the slowest rank's:
a barrier precedes every step). tokens/s = seq_len / that time. The rounds alternate their order (forward, then
reversed, ...), so that a machine growing slower or faster within a round weighs on each configuration alike over
two rounds; an option's ratio is the median over rounds of (tokens/s with / tokens/s without) within the same
round; its spread is the range of those per-round ratios. Bytes autograd saved per rank (the last step) are
recorded beside each, so the time is read beside the memory it buys.

    python scripts/benchmarks/bench_memory_options.py                  # the full measurement (see its page)
    python scripts/benchmarks/bench_memory_options.py --quick          # a smoke run: under a minute, numbers noisy
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import ROOT, machine, markdown_table, run_trial, trainer_args, write_json

from cpcompose.config import ConfigError, load_config

CP = 2
BASE = ("--training.fused_loss=false", "--activation_checkpoint.mode=none", "--training.tiled_mlp=1")
"""Option (a) of `scripts/longest_sequence.py`: context parallelism alone (ring, zigzag: `common.trainer_args`)."""
NOT_ON_CPU = "no-op on CPU"


@dataclass(frozen=True)
class Option:
    """One memory option: its label, its trainer arguments, and why it does nothing on a CPU device (None: it acts)."""

    label: str
    args: tuple[str, ...]
    cpu_noop: str | None = None


def options(tiles: int, head_chunks: int) -> dict[str, Option]:
    """The options measured, by key (`tiles` for the tiled MLP and the tiled block, `head_chunks` for UPipe)."""
    return {
        "fused_loss": Option("fused loss", ("--training.fused_loss=true",)),
        "tiled_mlp": Option(f"tiled MLP ({tiles})", (f"--training.tiled_mlp={tiles}",)),
        "full_checkpointing": Option("full checkpointing", ("--activation_checkpoint.mode=full",)),
        "checkpoint_offload": Option(
            "checkpoint offload", ("--activation_checkpoint.offload=true",),
            "the host offload applies only to CUDA tensors (cpcompose.distributed.activation_checkpoint."
            "offloaded_saved_inputs): on a CPU the saved inputs stay where they are and nothing is copied"),
        "offload_params": Option(
            "offload_params", ("--training.offload_params=true",),
            "FSDP2's CPUOffloadPolicy keeps the shards in host memory and copies them to the device per unit; on a "
            "CPU the device is host memory, so no copy is made and the optimizer step runs on the CPU either way"),
        "tiled_block": Option(f"tiled block ({tiles})", (f"--training.tiled_block={tiles}",)),
        "ring_tiles": Option("ring pieces (4)", ("--parallelism.cp_ring_tiles=4",)),
        "alltoall": Option("all-to-all CP (Ulysses)", ("--parallelism.cp_strategy=alltoall",)),
        "head_chunks": Option(f"head chunks ({head_chunks})", (f"--parallelism.cp_head_chunks={head_chunks}",)),
    }


ALONE: list[tuple[tuple[str, ...], tuple[str, ...]]] = [  # (with, without): each option against the run without it
    (("fused_loss",), ()),
    (("tiled_mlp",), ()),
    (("full_checkpointing",), ()),
    (("full_checkpointing", "checkpoint_offload"), ("full_checkpointing",)),  # offload needs full checkpointing
    (("offload_params",), ()),
    (("tiled_block",), ()),
    (("ring_tiles",), ()),
    (("alltoall",), ()),  # not a memory option: the strategy head chunks need, against the ring
    (("alltoall", "head_chunks"), ("alltoall",)),  # UPipe against unchunked all-to-all (Ulysses)
]
CUMULATIVE = ["fused_loss", "tiled_mlp", "full_checkpointing", "checkpoint_offload", "offload_params", "tiled_block",
              "ring_tiles"]
"""(b) to (h): each adds one option to the configuration before it, from (a) = CP alone (scripts/longest_sequence.py's
(e) is the two offloads here, its (f) the tiled block and the ring pieces)."""
LETTERS = "abcdefghij"


@dataclass
class Comparison:
    """One row of the table: the configuration with an option against the one without it."""

    section: str  # "alone" or "cumulative"
    label: str
    against: str
    with_keys: tuple[str, ...]
    without_keys: tuple[str, ...]
    status: str = "measured"  # or "not available: ...", "refused: ...", "no-op on CPU: ...", "failed: ..."


def measured_keys(keys: tuple[str, ...], table: dict[str, Option], measure_noops: bool) -> tuple[str, ...]:
    """The options a configuration runs with on a CPU: its no-ops dropped (unless they are measured as a check)."""
    return tuple(k for k in keys if measure_noops or table[k].cpu_noop is None)


def arguments(keys: tuple[str, ...], table: dict[str, Option]) -> tuple[str, ...]:
    return (*BASE, *(a for k in keys for a in table[k].args))


def check_config(keys: tuple[str, ...], table: dict[str, Option], model: dict[str, int], seq_len: int) -> str:
    """'ok', or why the installed config will not run these options: 'not available: ...' for an option it does
    not know, 'refused: ...' for one it rejects (the config's own message either way)."""
    argv = trainer_args(model, CP, seq_len, 1, "unused", arguments(keys, table))
    try:
        load_config(argv).validate(CP)
    except ConfigError as e:
        message = str(e).splitlines()[0]
        return f"not available: {message}" if "unknown option" in message else f"refused: {message}"
    return "ok"


def comparisons(table: dict[str, Option]) -> list[Comparison]:
    rows = []
    for with_keys, without_keys in ALONE:
        added = [k for k in with_keys if k not in without_keys]
        against = " + ".join(table[k].label for k in without_keys) or "(a) CP alone"
        rows.append(Comparison("alone", " + ".join(table[k].label for k in added), against, with_keys, without_keys))
    for i, key in enumerate(CUMULATIVE):
        rows.append(Comparison("cumulative", f"({LETTERS[i + 1]}) + {table[key].label}", f"({LETTERS[i]})",
                               tuple(CUMULATIVE[:i + 1]), tuple(CUMULATIVE[:i])))
    return rows


def step_time(trial: dict[str, Any], warmup: int) -> float:
    """The median over the steps after the warm-up of each step's slowest rank."""
    per_step = [max(r["step_s"][i] for r in trial["ranks"]) for i in range(len(trial["ranks"][0]["step_s"]))]
    return statistics.median(per_step[warmup:])


def decide(rows: list[Comparison], table: dict[str, Option], model: dict[str, int], seq_len: int) -> None:
    """Set each row's status from what the installed config accepts and what acts on a CPU; print each skip."""
    checked: dict[tuple[str, ...], str] = {}
    for row in rows:
        for keys in (row.without_keys, row.with_keys):
            if keys not in checked:
                checked[keys] = check_config(keys, table, model, seq_len)
        bad = next((checked[k] for k in (row.with_keys, row.without_keys) if checked[k] != "ok"), None)
        added = [k for k in row.with_keys if k not in row.without_keys]
        noop = next((table[k].cpu_noop for k in added if table[k].cpu_noop), None)
        if bad:
            row.status = bad
        elif noop:
            row.status = f"{NOT_ON_CPU}: {noop}"
        if row.status != "measured":
            print(f"skip {row.label} against {row.against}: {row.status}")


def to_measure(row: Comparison, measure_noops: bool) -> bool:
    return row.status == "measured" or (measure_noops and row.status.startswith(NOT_ON_CPU))


def run_rounds(configs: list[tuple[str, ...]], table: dict[str, Option], model: dict[str, int],
               args: argparse.Namespace) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Every configuration once a round, the order reversed every other round: per configuration, one record a
    round, in round order (a failed trial too, with its error)."""
    trials: dict[tuple[str, ...], list[dict[str, Any]]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for keys in configs if r % 2 == 0 else configs[::-1]:
            print(f"round {r + 1}/{args.rounds}: {' + '.join(keys) or 'CP alone'}", flush=True)
            trial = run_trial(model, CP, args.seq_len, steps=args.warmup + args.steps, timeout=args.timeout,
                              extra=arguments(keys, table))
            record: dict[str, Any] = {"round": r, "status": trial["status"]}
            if trial["status"] == "ok":
                step = step_time(trial, args.warmup)
                steps = [max(rk["step_s"][i] for rk in trial["ranks"]) for i in range(args.warmup + args.steps)]
                record.update(step_s=step, tokens_per_s=args.seq_len / step, saved_mib=trial["saved_mib"],
                              peak_mib=trial["peak_mib"], steps_s=steps)
            else:
                record["error"] = trial.get("error", trial["status"])
            trials[keys].append(record)
    return trials


def paired_ratios(with_trials: list[dict[str, Any]], without_trials: list[dict[str, Any]]) -> list[float]:
    """tokens/s with over tokens/s without, round by round (both lists are in round order)."""
    return [w["tokens_per_s"] / o["tokens_per_s"] for w, o in zip(with_trials, without_trials)
            if w["status"] == o["status"] == "ok"]


def median_of(trials: list[dict[str, Any]], key: str) -> float:
    return statistics.median(t[key] for t in trials if t["status"] == "ok")


def result(row: Comparison, trials: dict[tuple[str, ...], list[dict[str, Any]]], table: dict[str, Option],
           measure_noops: bool) -> dict[str, Any]:
    """A row as the JSON keeps it: its status and, if measured, its ratio, per-round ratios, tokens/s and saved
    bytes with and without (a measured CPU no-op's ratio under `noop_check_ratio`, not `ratio`)."""
    entry: dict[str, Any] = {"section": row.section, "option": row.label, "against": row.against,
                             "with": list(row.with_keys), "without": list(row.without_keys), "status": row.status}
    if not to_measure(row, measure_noops):
        return entry
    w_keys = measured_keys(row.with_keys, table, measure_noops)
    o_keys = measured_keys(row.without_keys, table, measure_noops)
    entry.update(measured_with=list(w_keys), measured_without=list(o_keys))
    per_round = paired_ratios(trials[w_keys], trials[o_keys])
    if not per_round:
        failed = next(t for k in (w_keys, o_keys) for t in trials[k] if t["status"] != "ok")
        entry["status"] = f"failed: {failed.get('error', failed['status'])}"
        return entry
    entry.update({"ratio" if row.status == "measured" else "noop_check_ratio": statistics.median(per_round),
                  "ratios_per_round": per_round,
                  "with_tokens_per_s": median_of(trials[w_keys], "tokens_per_s"),
                  "without_tokens_per_s": median_of(trials[o_keys], "tokens_per_s"),
                  "with_saved_mib": median_of(trials[w_keys], "saved_mib"),
                  "without_saved_mib": median_of(trials[o_keys], "saved_mib")})
    if row.section == "cumulative":
        to_a = paired_ratios(trials[w_keys], trials.get((), []))
        entry["ratio_to_a"] = statistics.median(to_a) if to_a else None
    return entry


def table_row(entry: dict[str, Any]) -> list[str]:
    """The printed row: the numbers of a measured option, else its status's first words."""
    if "ratio" not in entry:
        return [entry["section"], entry["option"], entry["against"], entry["status"].split(":")[0], *[""] * 5]
    per_round = entry["ratios_per_round"]
    to_a = entry.get("ratio_to_a")
    return [entry["section"], entry["option"], entry["against"], f"{entry['without_tokens_per_s']:,.0f}",
            f"{entry['with_tokens_per_s']:,.0f}", f"{entry['ratio']:.2f}", f"{min(per_round):.2f}-{max(per_round):.2f}",
            "" if to_a is None else f"{to_a:.2f}",
            f"{entry['without_saved_mib']:,.0f} → {entry['with_saved_mib']:,.0f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--tiles", type=int, default=4, help="tiles of the tiled MLP and of the tiled block")
    p.add_argument("--head-chunks", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of each trial's median")
    p.add_argument("--steps", type=int, default=3, help="steps measured in each trial")
    p.add_argument("--rounds", type=int, default=4, help="trials of each configuration (alternating order)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one trial may take")
    p.add_argument("--measure-noops", action="store_true", help="run the CPU no-ops too, as a check")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny shape, one round, one measured step")
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "option_cost.json")
    args = p.parse_args()
    if args.quick:
        args.dim, args.layers, args.vocab, args.seq_len = 64, 2, 256, 1024
        args.tiles, args.warmup, args.steps, args.rounds = 2, 1, 1, 1
    model = {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "n_kv_heads": 2,
             "ffn_hidden_dim": args.dim * 7 // 2, "vocab_size": args.vocab}
    table = options(args.tiles, args.head_chunks)
    rows = comparisons(table)
    decide(rows, table, model, args.seq_len)
    configs = sorted({measured_keys(keys, table, args.measure_noops)
                      for row in rows if to_measure(row, args.measure_noops)
                      for keys in (row.with_keys, row.without_keys)}, key=lambda k: (len(k), k))
    trials = run_rounds(configs, table, model, args)
    results = [result(row, trials, table, args.measure_noops) for row in rows]
    print(markdown_table(["", "option", "against", "tokens/s without", "tokens/s with", "ratio", "per round",
                          "ratio to (a)", "saved MiB/rank"], [table_row(e) for e in results],
                         left=["", "option", "against"]))
    settings = {**{k: v for k, v in vars(args).items() if k != "out"}, "cp": CP, "model": model, "base": list(BASE),
                "options": {k: vars(o) for k, o in table.items()}}
    write_json(args.out, {"machine": machine(), "settings": settings, "rows": results,
                          "trials": [{"options": list(k), "args": list(arguments(k, table)), "trials": v}
                                     for k, v in trials.items()]})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
