"""Benchmark: how context parallelism cuts per-rank memory, measured with the real trainer on CPU.

Method. Every measurement is one short training run (`--steps`, default 2, of
`cpcompose.training.loop.trainer.Trainer.train_step`) of a small Llama on the synthetic
copy task, batch 1, float32, no activation checkpointing, the whole logits
(`training.fused_loss = false`), the ring strategy with the zigzag layout. This script
starts the P ranks itself (`common.run_trial`), each a fresh Python
process (so nothing of this script's own memory is counted) that joins a gloo group
with a timeout, builds the Trainer from `train_configs/debug_cpu.toml` plus
overrides, runs the steps and reports its own numbers. Threads per rank: cores // P
(at least 1), as `python -m cpcompose.train` does, so cp=1 uses both cores.

Three experiments: the fixed-sequence table, the longest sequence under a budget (both
below), and the 128k-vocabulary experiment (its section below): a Llama at
scaled-down Llama-3 proportions with Llama 3's vocabulary, before and after each memory
feature (fused loss, tiled MLP; checkpointing on request; offload is CUDA-only), cp=1 and
cp=2, with the memory plan's per-token parts, its predicted longest sequence and its
predicted peak beside every measurement. Modes whose options this build rejects, or
accepts without honouring, are skipped and say so.

Peak memory is the rank's resident-set high-water mark,
`VmHWM` (the trainer's own peak: `ru_maxrss` would carry a parent's across exec), after the last step. Every table shows
the max over ranks (what a per-rank budget has to hold).

Activation memory is peak(L) minus peak(L_tiny) of a run with the same model, cp and
strategy at a tiny sequence (`--tiny-len`): the difference removes the fixed part
(interpreter, torch, the model, its gradients and AdamW state, FSDP's buffers, the
gloo group). It is what grows with the sequence: saved activations, the logits and
their gradients, the K/V blocks the ring receives, and the allocator's slack.

A second, allocator-independent figure, "saved for backward": the bytes of distinct
tensor storages autograd saves during a step's forward (a `saved_tensors_hooks`
pack hook), again minus the same at L_tiny (which removes the weights that matmuls
save). It leaves out transient tensors (the logits' gradient, the softmax's
temporaries, received K/V blocks), so it is below the RSS difference.

Longest sequence under a per-rank budget. For cp in `--budget-cps`, a run "fits" if
its steps finish and every rank's peak RSS stays at or under `--budget-gib`. Two
runs at (2048, 8192) local tokens per rank give a linear fit peak ~= a + b*L per
rank; its prediction is bracketed and then bisected over multiples of
`--resolution` tokens (itself a multiple of 2*cp). A run whose rank crosses the
budget is stopped at once (RSS polled every 50 ms; the final peak decides).
The 24 GiB line is an EXTRAPOLATION of the fit over all runs of that cp that fit
the budget, not a measurement: this machine has 24 GiB in total, and cp=2 runs both
ranks on it.

Caveats. RSS counts what glibc's malloc keeps, not what tensors hold: freed small
and medium blocks stay in its arenas, so RSS can sit above the live bytes, and by
different amounts in different runs; large tensors (above glibc's mmap threshold,
which adapts up to 32 MiB) are mmap'ed and go back to the OS when freed. The fixed
part is measured in a separate run, so the activation figure carries the noise of
two runs: repeated runs here differ by a few tens of MiB, and the longest fitting
L by a bisection step or two. RSS also counts pages of shared libraries a rank
touched. With cp > 1 FSDP shards the parameters
over the cp ranks as well (dp_shard x cp), so the fixed part per rank shrinks too;
the activation column excludes that on purpose. cp=4 runs four processes on the
two cores: its tokens/s measures oversubscription, not scaling.

Time. tokens/s is L over the last step's wall time (max over ranks); CPU s/step is
the rank's user + system time, "of which sys" the kernel's share. The share is large:
glibc maps large tensors with mmap and unmaps them when freed, so each step faults
in its activations afresh (about a million minor page faults per step at 4 GiB of
activations). Tuning the allocator (e.g. MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set high, or jemalloc) makes steps faster but keeps freed
memory resident, which would blur what this script measures, so it runs with
glibc's defaults. The machine may be shared: wall times are noisy, CPU times less so.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from common import fit_line, fmt, machine, markdown_table, mem_available_mib, run_trial, trainer_args, write_json

# Table 1: activations are most of the memory (4 layers, dim 256, vocab 4096).
TABLE_MODEL = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden_dim": 768, "vocab_size": 4096}
# Budget search: a large vocabulary makes memory per token high (the logits and their
# gradients) while attention compute stays small, so each bisection step is quick.
BUDGET_MODEL = {"dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 384, "vocab_size": 32768}


# --- the experiments ---


def fixed_length_table(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Peak and activation memory per rank at one L, for each cp."""
    rows = []
    for cp in args.cps:
        tiny = run_trial(TABLE_MODEL, cp, args.tiny_len, steps=args.steps, timeout=args.timeout)
        full = run_trial(TABLE_MODEL, cp, args.seq_len, steps=args.steps, timeout=args.timeout)
        if tiny["status"] != "ok" or full["status"] != "ok":
            raise SystemExit(f"cp={cp}: a run failed: {tiny.get('error') or full.get('error')}")
        rows.append({"cp": cp, "seq_len": args.seq_len, "tiny": tiny, "run": full,
                     "fixed_mib": tiny["peak_mib"], "peak_mib": full["peak_mib"],
                     "activation_mib": full["peak_mib"] - tiny["peak_mib"],
                     "saved_mib": full["saved_mib"] - tiny["saved_mib"],
                     "tokens_per_s": full["tokens_per_s"], "step_s": full["step_s"], "cpu_s": full["cpu_s"],
                     "sys_s": full["sys_s"],
                     "threads": full["threads"]})
    base = next((r for r in rows if r["cp"] == 1), None)
    for r in rows:
        r["activation_ratio"] = r["activation_mib"] / base["activation_mib"] if base else None
        r["saved_ratio"] = r["saved_mib"] / base["saved_mib"] if base else None
    return rows


def longest_fit(cp: int, args: argparse.Namespace, *, model: dict[str, int] = BUDGET_MODEL,
                extra: tuple[str, ...] | None = None, seeds: list[int] | None = None) -> dict[str, Any]:
    """Longest L (a multiple of `--resolution`) whose run fits the per-rank budget.

    `seeds`: the first two lengths to run (default `--fit-local-lens` x cp); `extra`: trainer flags of the mode.
    """
    budget, res = args.budget_gib * 1024, args.resolution
    need = cp * budget + 1024
    if mem_available_mib() < need:
        raise SystemExit(f"cp={cp}: {need:,.0f} MiB must be free for a {args.budget_gib} GiB budget per rank, "
                         f"only {mem_available_mib():,.0f} MiB is: lower --budget-gib")
    trials: list[dict[str, Any]] = []

    def trial(seq_len: int) -> bool:
        row = run_trial(model, cp, seq_len, steps=args.steps, timeout=args.timeout, budget_mib=budget, extra=extra)
        trials.append(row)
        if row["status"] == "failed":
            raise SystemExit(f"cp={cp} L={seq_len}: {row.get('error')}")
        return row["status"] == "ok"

    def points() -> list[tuple[int, float]]:
        return [(t["seq_len"], t["peak_mib"]) for t in trials if t["status"] == "ok"]

    def grid(x: float) -> int:
        return max(res, int(x) // res * res)

    lo, hi = 0, None  # longest L that fits, shortest L that does not

    def probe(seq_len: int) -> None:
        nonlocal lo, hi
        if trial(seq_len):
            lo = max(lo, seq_len)
        else:
            hi = seq_len if hi is None else min(hi, seq_len)

    seeds = [grid(x) for x in (seeds or [local * cp for local in args.fit_local_lens])]
    for seq_len in seeds:
        probe(seq_len)
    while len(points()) < 2:  # a seed was over the budget: halve below the shortest run so far
        shorter = grid(min(t["seq_len"] for t in trials) / 2)
        if shorter in {t["seq_len"] for t in trials}:
            break
        probe(shorter)
    if len(points()) < 2:
        raise SystemExit(f"cp={cp}: need two runs under the budget to fit; lower --fit-local-lens")
    a, b = fit_line(points())
    guess = grid((budget - a) / b)
    step = max(res, grid(0.03 * guess))
    for cand in (guess - step, guess + step):  # a tight bracket around the prediction
        if cand > lo and (hi is None or cand < hi):
            probe(cand)
    while hi is None:  # the prediction was short: walk up in growing steps
        probe(lo + step)
        step *= 2
    while hi - lo > res:
        probe(max(lo + res, grid((lo + hi) / 2)))
    a, b = fit_line(points())
    device = args.extrapolate_gib * 1024
    return {"cp": cp, "budget_mib": budget, "longest": lo, "shortest_over": hi, "fit_a_mib": a,
            "fit_b_mib_per_token": b, "extrapolated_longest": int((device - a) / b) // (2 * cp) * (2 * cp),
            "extrapolated_budget_mib": device, "trials": trials}


# --- reporting ---


def print_fixed(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    m = TABLE_MODEL
    print(f"\nFixed sequence L={args.seq_len}: Llama {m['n_layers']} layers, dim {m['dim']}, {m['n_heads']} heads "
          f"({m['n_kv_heads']} kv), ffn {m['ffn_hidden_dim']}, vocab {m['vocab_size']}, fp32, batch 1, no AC, "
          f"ring/zigzag; fixed part measured at L={args.tiny_len}; max over ranks; last of {args.steps} steps\n")
    cores = os.cpu_count() or 1
    print(markdown_table(
        ["cp", "threads/rank", "peak/rank (MiB)", "fixed (MiB)", "activation/rank (MiB)", "act. vs cp=1",
         "saved for bwd/rank (MiB)", "saved vs cp=1", "tok/s", "s/step", "CPU s/step (max rank)",
         "of which sys"],
        [[str(r["cp"]), str(r["threads"]), fmt(r["peak_mib"]), fmt(r["fixed_mib"]), fmt(r["activation_mib"]),
          fmt(r["activation_ratio"], "{:.3f}"), fmt(r["saved_mib"]), fmt(r["saved_ratio"], "{:.3f}"),
          fmt(r["tokens_per_s"]) + (f" ({r['cp']} procs on {cores} cores)" if r["cp"] > cores else ""),
          fmt(r["step_s"], "{:.2f}"), fmt(r["cpu_s"], "{:.2f}"), fmt(r["sys_s"], "{:.2f}")] for r in rows],
    ))
    r2 = next((r for r in rows if r["cp"] == 2), None)
    if r2 and r2["activation_ratio"] is not None:
        verdict = "meets" if r2["activation_ratio"] <= 0.55 else "MISSES"
        print(f"\ncp=2 activation memory per rank = {r2['activation_ratio']:.3f} of cp=1 "
              f"({verdict} the <= 0.55 target)")


def print_budget(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    m = BUDGET_MODEL
    print(f"\nLongest trainable sequence under {args.budget_gib} GiB peak RSS per rank: Llama {m['n_layers']} layers, "
          f"dim {m['dim']}, vocab {m['vocab_size']}, fp32, batch 1, no AC, ring/zigzag, {args.steps} steps, "
          f"resolution {args.resolution} tokens\n")
    print(markdown_table(
        ["cp", "longest L", "first L over", "runs", "fit a (MiB)", "fit b (KiB/token)",
         f"EXTRAPOLATED longest L at {args.extrapolate_gib} GiB/rank"],
        [[str(r["cp"]), f"{r['longest']:,}", "n/a" if r["shortest_over"] is None else f"{r['shortest_over']:,}",
          str(len(r["trials"])), f"{r['fit_a_mib']:,.0f}", f"{r['fit_b_mib_per_token'] * 1024:.1f}",
          f"{r['extrapolated_longest']:,}"] for r in results],
    ))
    one, two = (next((r for r in results if r["cp"] == c), None) for c in (1, 2))
    if one and two:
        ratio, ext = two["longest"] / one["longest"], two["extrapolated_longest"] / one["extrapolated_longest"]
        verdict = "meets" if ratio >= 1.9 else "MISSES"
        print(f"\nlongest L, cp=2 / cp=1 = {ratio:.2f} measured at {args.budget_gib} GiB/rank ({verdict} the >= 1.9 "
              f"target); {ext:.2f} extrapolated (linear fit, not measured) to {args.extrapolate_gib} GiB/rank")
    print("\nruns:")
    for r in results:
        for t in r["trials"]:
            peak = f"{t['peak_mib']:,.0f} MiB" if "peak_mib" in t else f"> budget (RSS {t['polled_max_rss_mib']:,.0f})"
            print(f"  cp={r['cp']} L={t['seq_len']:>7,}: {peak}, {t['status']}")


# --- the 128k-vocabulary experiment: before and after each memory feature ---
#
# A Llama at scaled-down Llama-3 proportions (head_dim 64, 4:1 grouped-query attention, a 3.5x
# SwiGLU, Llama 3's 128,256-token vocabulary; dim 256 and 2 layers, the issue's setting) trained
# as the other experiments are (fp32, batch 1, ring/zigzag, fresh rank processes, glibc's
# allocator defaults, peak = max over ranks of `VmHWM`), in cumulative modes: before (the
# whole logits), with the fused loss, then with the sequence-tiled MLP too, then (`--vocab-modes`)
# with activation checkpointing as well. Offloaded checkpoints are CUDA-only (on CPU, host and
# device memory are the same memory): no column here.
#
# A mode runs only if this build has its options: one the config rejects is skipped, and so is
# one it accepts but does not honour, which a tiny probe run tells (a fused loss saves no
# vocabulary-wide tensor of more rows than `training.loss_chunk_tokens`; a tiled MLP no
# feed-forward-wide tensor of more than a tile's rows). Each skip is printed with its reason.
#
# For each mode and cp: the longest L under the per-rank budget, searched as the budget
# experiment does (or, with `--vocab-fit-lens`, extrapolated from two runs' linear fit, for
# budgets whose longest L would take hours to step through) but seeded by the memory plan's own
# prediction (`cpcompose.training.memory.plan`, for glibc's default allocator as these runs use);
# tokens/s at that L; the plan's per-token memory by part there, beside the measured per-token
# slope; and the plan's predicted peak beside the measured peak for every run that finished.

L3S = {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1, "ffn_hidden_dim": 896, "vocab_size": 128256}
_NONE = ("--training.fused_loss=false", "--training.tiled_mlp=1", "--activation_checkpoint.mode=none")
MODES: dict[str, tuple[str, ...]] = {
    "before": _NONE,
    "fused loss": ("--training.fused_loss=true", "--training.tiled_mlp=1", "--activation_checkpoint.mode=none"),
    "fused loss + tiled MLP": ("--training.fused_loss=true", "--training.tiled_mlp=4",
                               "--activation_checkpoint.mode=none"),
    "fused + tiled + checkpointing": ("--training.fused_loss=true", "--training.tiled_mlp=4",
                                      "--activation_checkpoint.mode=full"),
}
DEFAULT_MODES = ["before", "fused loss", "fused loss + tiled MLP"]
SCALING = ("activations", "one block in flight", "attention K/V in flight", "loss", "allocator slack")
OFFLOAD_NOTE = ("activation_checkpoint.offload keeps checkpointed block inputs in host memory on CUDA; on CPU host "
                "and device memory are one, so it has no column here (the GPU suite measures it)")
MiB = 2**20


def _config(cp: int, seq_len: int, extra: tuple[str, ...]):
    from cpcompose.config import load_config

    return load_config(trainer_args(L3S, cp, seq_len, 2, "/nonexistent", extra))


def predicted_mib(cp: int, seq_len: int, extra: tuple[str, ...]) -> float:
    """The plan's peak per rank for glibc's default allocator (what these runs use)."""
    from cpcompose.training.memory.plan import plan_memory

    return plan_memory(_config(cp, seq_len, extra), cp, device_type="cpu").total / MiB


def per_token_kib(cp: int, seq_len: int, extra: tuple[str, ...]) -> dict[str, float]:
    """The plan's parts that grow with L, in KiB per token of the rank's shard, at L."""
    from cpcompose.training.memory.plan import plan_memory

    plan = plan_memory(_config(cp, seq_len, extra), cp, device_type="cpu")
    return {name: plan.part(name) / 1024 / plan.tokens for name in SCALING}


def predicted_longest(cp: int, extra: tuple[str, ...], budget_mib: float, res: int) -> int:
    """The longest multiple of `res` the plan says fits (0 if none)."""
    lo, hi = 0, res
    while predicted_mib(cp, hi, extra) <= budget_mib and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > res:
        mid = (lo + hi) // 2 // res * res
        lo, hi = (mid, hi) if predicted_mib(cp, mid, extra) <= budget_mib else (lo, mid)
    return lo


def unavailable(mode: str, cp: int, args: argparse.Namespace) -> str | None:
    """Why `mode` cannot run in this build (None: it can)."""
    from cpcompose.config import ConfigError

    extra = _extra(mode, args)
    try:
        _config(cp, 2 * cp * 64, extra)
    except ConfigError as e:
        return f"the config rejects it ({e})"
    if mode == "before":
        return None
    local, chunk, tiles = 512, 128, 4
    probe = run_trial(L3S, cp, local * cp, steps=2, timeout=args.timeout,
                      extra=extra + (f"--training.loss_chunk_tokens={chunk}",))  # the last flag wins
    if probe["status"] != "ok":
        return f"its probe run failed: {probe.get('error')}"
    rows = probe["saved_rows"]
    if "fused_loss=true" in " ".join(extra) and rows["vocab"] > chunk:
        return (f"accepted, but this build does not fuse the loss: a {rows['vocab']}-row vocabulary-wide tensor was "
                f"saved (a chunk is {chunk})")
    if "tiled_mlp=4" in " ".join(extra) and rows["ffn"] > local // tiles:
        return (f"accepted, but this build does not tile the MLP: a {rows['ffn']}-row feed-forward tensor was saved "
                f"(a tile is {local // tiles})")
    return None


def _extra(mode: str, args: argparse.Namespace) -> tuple[str, ...]:
    """The mode's trainer flags, with `--vocab-chunk-tokens` for the fused loss's chunk when given."""
    chunk = getattr(args, "vocab_chunk_tokens", None)
    return MODES[mode] + ((f"--training.loss_chunk_tokens={chunk}",) if chunk else ())


def fit_only(cp: int, args: argparse.Namespace, extra: tuple[str, ...]) -> dict[str, Any]:
    """`--vocab-fit-lens`: runs at those local lengths only, and the longest L at the budget EXTRAPOLATED from
    their linear fit (a search at the budget would run for hours on a small CPU: the fused modes reach 10^5
    tokens). Same keys as `longest_fit`'s, `extrapolated` set."""
    budget = args.budget_gib * 1024
    trials = [run_trial(L3S, cp, local * cp, steps=args.steps, timeout=args.timeout, extra=extra)
              for local in args.vocab_fit_lens]
    bad = [t for t in trials if t["status"] != "ok"]
    if bad:
        raise SystemExit(f"cp={cp}: a run failed: {bad[0].get('error')}")
    a, b = fit_line([(t["seq_len"], t["peak_mib"]) for t in trials])
    longest = int((budget - a) / b) // args.resolution * args.resolution
    return {"cp": cp, "budget_mib": budget, "longest": longest, "shortest_over": None, "fit_a_mib": a,
            "fit_b_mib_per_token": b, "trials": trials, "extrapolated": True}


def vocab_experiment(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode x cp: availability, the longest L under the budget, and the plan beside each measurement."""
    budget = args.budget_gib * 1024
    results: dict[str, Any] = {"model": L3S, "budget_mib": budget, "modes": {}, "offload": OFFLOAD_NOTE}
    for mode in args.vocab_modes:
        extra = _extra(mode, args)
        for cp in args.vocab_cps:
            key = f"{mode} | cp={cp}"
            print(f"  {key}:", flush=True)
            reason = unavailable(mode, cp, args)
            if reason is not None:
                print(f"    skipped: {reason}", flush=True)
                results["modes"][key] = {"mode": mode, "cp": cp, "skipped": reason}
                continue
            guess = predicted_longest(cp, extra, budget, args.resolution)
            seeds = [max(args.resolution, int(f * guess) // args.resolution * args.resolution) for f in (0.5, 0.85)]
            if getattr(args, "vocab_fit_lens", None):
                found = fit_only(cp, args, extra)
                at = found["trials"][-1]  # tokens/s at the longest run
            else:
                found = longest_fit(cp, args, model=L3S, extra=extra, seeds=seeds)
                at = next((t for t in found["trials"] if t["seq_len"] == found["longest"] and t["status"] == "ok"),
                          None)
            for t in found["trials"]:
                t["predicted_mib"] = predicted_mib(cp, t["seq_len"], extra)
            found.update(mode=mode, predicted_longest=guess, tokens_at=at and at["seq_len"],
                         tokens_per_s=at and at["tokens_per_s"], step_s=at and at["step_s"],
                         per_token_kib=per_token_kib(cp, found["longest"] or args.resolution, extra))
            results["modes"][key] = found
    return results


def print_vocab(results: dict[str, Any], args: argparse.Namespace) -> None:
    m, rows = results["model"], results["modes"]
    print(f"\n128k vocabulary: Llama {m['n_layers']} layers, dim {m['dim']}, {m['n_heads']} heads ({m['n_kv_heads']} "
          f"kv), ffn {m['ffn_hidden_dim']}, vocab {m['vocab_size']:,}, fp32, batch 1, ring/zigzag, glibc defaults; "
          f"budget {args.budget_gib} GiB per rank; max over ranks\n")
    ran = [r for r in rows.values() if "skipped" not in r]
    base = {r["cp"]: r["longest"] for r in ran if r["mode"] == "before"}
    print("Per-token memory by part (the plan, KiB per token of a rank's shard, at the longest L) and the measured "
          "slope (KiB/token of the fit over that mode's runs):\n")
    print(markdown_table(["mode", "cp", *SCALING, "plan total", "measured slope"],
                         [[r["mode"], str(r["cp"]), *(fmt(r["per_token_kib"][p], "{:,.1f}") for p in SCALING),
                           fmt(sum(r["per_token_kib"].values()), "{:,.1f}"),
                           fmt(r["fit_b_mib_per_token"] * 1024 * r["cp"], "{:,.1f}")]  # per local token
                          for r in ran]))
    how = (f"EXTRAPOLATED from the linear fit of runs at {args.vocab_fit_lens} local tokens (not searched)"
           if getattr(args, "vocab_fit_lens", None) else f"bisection step {args.resolution} tokens")
    print(f"\nLongest sequence at {args.budget_gib} GiB per rank ({how}):\n")
    print(markdown_table(["mode", "cp", "longest L", "plan's longest L", "vs before", "L of tok/s", "tok/s", "s/step",
                          "runs"],
                         [[r["mode"], str(r["cp"]), f"{r['longest']:,}", f"{r['predicted_longest']:,}",
                           fmt(r["longest"] / base[r["cp"]] if base.get(r["cp"]) else None, "{:.2f}x"),
                           f"{r['tokens_at']:,}" if r.get("tokens_at") else "n/a",
                           fmt(r["tokens_per_s"]), fmt(r["step_s"], "{:.2f}"), str(len(r["trials"]))] for r in ran]))
    print("\nPredicted (plan) vs measured peak per rank, every run that finished:\n")
    lines, worst = [], 0.0
    for r in ran:
        for t in r["trials"]:
            if t["status"] == "ok":
                err = (t["predicted_mib"] - t["peak_mib"]) / t["peak_mib"] * 100
                worst = max(worst, abs(err))
                lines.append([r["mode"], str(r["cp"]), f"{t['seq_len']:,}", fmt(t["peak_mib"]),
                              fmt(t["predicted_mib"]), f"{err:+.1f}%"])
    print(markdown_table(["mode", "cp", "L", "measured (MiB)", "predicted (MiB)", "error"], lines))
    print(f"\nlargest |error|: {worst:.1f}% (target <= 15%)")
    for r in rows.values():
        if "skipped" in r:
            print(f"skipped {r['mode']} at cp={r['cp']}: {r['skipped']}")
    print(f"offload: {results['offload']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384, help="the fixed-sequence table's L")
    p.add_argument("--tiny-len", type=int, default=256, help="L of the runs that measure the fixed part")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="cp degrees of the fixed-sequence table")
    p.add_argument("--budget-gib", type=float, default=8.0, help="per-rank peak RSS budget of the search")
    p.add_argument("--budget-cps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--fit-local-lens", type=int, nargs=2, default=[2048, 8192],
                   help="local tokens per rank of the two runs that seed the linear fit")
    p.add_argument("--resolution", type=int, default=128, help="bisection step in tokens (a multiple of 2*cp)")
    p.add_argument("--extrapolate-gib", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (also the gloo timeout)")
    p.add_argument("--skip-table", action="store_true")
    p.add_argument("--skip-budget", action="store_true")
    p.add_argument("--skip-vocab", action="store_true", help="skip the 128k-vocabulary before/after experiment")
    p.add_argument("--vocab-modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES),
                   metavar="MODE", help=f"of {list(MODES)}")
    p.add_argument("--vocab-cps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-chunk-tokens", type=int, default=None,
                   help="training.loss_chunk_tokens of the fused modes (default: the trainer's)")
    p.add_argument("--vocab-fit-lens", type=int, nargs=2, default=None, metavar=("LOCAL1", "LOCAL2"),
                   help="instead of searching the budget, run each mode at these local tokens per rank and "
                        "EXTRAPOLATE the longest L from their linear fit (the fused modes reach 10^5 tokens at "
                        "8 GiB: hours of search on a small CPU)")
    p.add_argument("--out", type=Path, default=Path("bench_results/memory.json"))
    args = p.parse_args()
    for cp in args.cps:
        if args.seq_len % (2 * cp) or args.tiny_len % (2 * cp):
            p.error(f"--seq-len and --tiny-len must be multiples of 2*cp = {2 * cp} (zigzag chunks)")
    if any(args.resolution % (2 * cp) for cp in args.budget_cps + args.vocab_cps):
        p.error("--resolution must be a multiple of 2*cp for every --budget-cps and --vocab-cps")
    if args.vocab_fit_lens and any(n % 2 for n in args.vocab_fit_lens):
        p.error("--vocab-fit-lens must be even (zigzag: 2 chunks per rank)")
    if args.steps < 2:
        p.error("--steps must be >= 2: the second step is the first with AdamW state allocated")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB, torch {info['torch']}", flush=True)
    result: dict[str, Any] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                              "table_model": TABLE_MODEL, "budget_model": BUDGET_MODEL}
    if not args.skip_table:
        print(f"fixed-sequence table (L={args.seq_len}):", flush=True)
        result["fixed_length"] = fixed_length_table(args)
    if not args.skip_budget:
        print(f"longest sequence under {args.budget_gib} GiB per rank:", flush=True)
        result["budget"] = [longest_fit(cp, args) for cp in args.budget_cps]
    if not args.skip_vocab:
        print(f"128k vocabulary, before and after each feature, under {args.budget_gib} GiB per rank:", flush=True)
        result["vocab"] = vocab_experiment(args)
    result["wall_s"] = time.perf_counter() - started
    if "fixed_length" in result:
        print_fixed(result["fixed_length"], args)
    if "budget" in result:
        print_budget(result["budget"], args)
    if "vocab" in result:
        print_vocab(result["vocab"], args)
    write_json(args.out, result)
    print(f"\n{result['wall_s']:.0f} s in all; wrote {args.out}")


if __name__ == "__main__":
    main()
