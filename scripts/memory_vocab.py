"""The 128k-vocabulary experiment of `scripts/bench_memory.py`: before and after each memory feature.

A Llama at scaled-down Llama-3 proportions (head_dim 64, 4:1 grouped-query attention, a 3.5x
SwiGLU, Llama 3's 128,256-token vocabulary; dim 256 and 2 layers, the issue's setting) trained
as the other experiments are (fp32, batch 1, ring/zigzag, fresh rank processes, glibc's
allocator defaults, peak = max over ranks of `VmHWM`), in cumulative modes: before (the
whole logits), with the fused loss, then with the sequence-tiled MLP too, then (`--vocab-modes`)
with activation checkpointing as well. Offloaded checkpoints are CUDA-only (on CPU, host and
device memory are the same memory): no column here.

A mode runs only if this build has its options: one the config rejects is skipped, and so is
one it accepts but does not honour, which a tiny probe run tells (a fused loss saves no
vocabulary-wide tensor of more rows than `training.loss_chunk_tokens`; a tiled MLP no
feed-forward-wide tensor of more than a tile's rows). Each skip is printed with its reason.

For each mode and cp: the longest L under the per-rank budget, searched as the budget
experiment does (or, with `--vocab-fit-lens`, extrapolated from two runs' linear fit, for
budgets whose longest L would take hours to step through) but seeded by the memory plan's own prediction (`cpcompose.training.memory.plan`,
for glibc's default allocator as these runs use); tokens/s at that L; the plan's per-token
memory by part there, beside the measured per-token slope; and the plan's predicted peak beside
the measured peak for every run that finished.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from memory_trials import fit_line, fmt, run_trial, table, trainer_args

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


def run(args: argparse.Namespace, longest_fit: Callable[..., dict[str, Any]]) -> dict[str, Any]:
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


def print_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    m, rows = results["model"], results["modes"]
    print(f"\n128k vocabulary: Llama {m['n_layers']} layers, dim {m['dim']}, {m['n_heads']} heads ({m['n_kv_heads']} "
          f"kv), ffn {m['ffn_hidden_dim']}, vocab {m['vocab_size']:,}, fp32, batch 1, ring/zigzag, glibc defaults; "
          f"budget {args.budget_gib} GiB per rank; max over ranks\n")
    ran = [r for r in rows.values() if "skipped" not in r]
    base = {r["cp"]: r["longest"] for r in ran if r["mode"] == "before"}
    print("Per-token memory by part (the plan, KiB per token of a rank's shard, at the longest L) and the measured "
          "slope (KiB/token of the fit over that mode's runs):\n")
    print(table(["mode", "cp", *SCALING, "plan total", "measured slope"],
                [[r["mode"], str(r["cp"]), *(fmt(r["per_token_kib"][p], "{:,.1f}") for p in SCALING),
                  fmt(sum(r["per_token_kib"].values()), "{:,.1f}"),
                  fmt(r["fit_b_mib_per_token"] * 1024 * r["cp"], "{:,.1f}")] for r in ran]))  # per local token
    how = (f"EXTRAPOLATED from the linear fit of runs at {args.vocab_fit_lens} local tokens (not searched)"
           if getattr(args, "vocab_fit_lens", None) else f"bisection step {args.resolution} tokens")
    print(f"\nLongest sequence at {args.budget_gib} GiB per rank ({how}):\n")
    print(table(["mode", "cp", "longest L", "plan's longest L", "vs before", "L of tok/s", "tok/s", "s/step", "runs"],
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
    print(table(["mode", "cp", "L", "measured (MiB)", "predicted (MiB)", "error"], lines))
    print(f"\nlargest |error|: {worst:.1f}% (target <= 15%)")
    for r in rows.values():
        if "skipped" in r:
            print(f"skipped {r['mode']} at cp={r['cp']}: {r['skipped']}")
    print(f"offload: {results['offload']}")
