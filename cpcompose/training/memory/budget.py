"""The memory plan against the budget: what the dry run and the banner print, what the pre-launch check refuses.

The budget per rank is `training.memory_budget_gib` when set, else the device's memory (CUDA:
the GPU's total) or, on CPU, a node's RAM (`job.host_memory_gib`, else this node's) divided by
the ranks a node runs. A run whose predicted peak exceeds it is refused before any rank starts,
in one line that names the options that would make it fit: each alone where one suffices, else
the shortest combination (fused loss, activation checkpointing, tiled MLP, offload, then a larger
cp), each checked with the plan.

On CUDA a second check: what the ranks of a node keep in host memory (the plan's `host_parts`:
`activation_checkpoint.offload`'s block inputs, `training.offload_params`' shards, gradients and
moments) must fit a node's RAM, `job.host_memory_gib` or this node's. On CPU there is no such
second check: offload moves nothing there (the plan's host parts are 0) and the first check
already holds the node's ranks to its RAM.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from cpcompose.config import ConfigError, JobConfig
from cpcompose.layouts import resolve_layout
from cpcompose.training.memory.plan import GiB, MemoryPlan, plan_memory
from cpcompose.training.memory.resources import host_memory, run_device_type

__all__ = ["Budget", "check_host_memory", "check_memory", "describe_memory", "memory_budget", "node_memory", "run_plan",
           "suggestions"]


@dataclass(frozen=True)
class Budget:
    """Bytes one rank may use, and where the figure comes from (None: unknown here)."""

    bytes: int | None
    source: str


def memory_budget(config: JobConfig, world: int) -> Budget:
    """The per-rank budget: `training.memory_budget_gib`, the GPU's memory, or host RAM / ranks on this host."""
    if config.training.memory_budget_gib is not None:
        return Budget(int(config.training.memory_budget_gib * GiB), "training.memory_budget_gib")
    if run_device_type(config) == "cuda":
        if not torch.cuda.is_available():
            return Budget(None, "no CUDA device visible here; set training.memory_budget_gib")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return Budget(props.total_memory, f"{props.name}, {props.total_memory / GiB:.1f} GiB")
    ranks = _ranks_on_host(world)
    ram = node_memory(config)
    return Budget(ram.bytes // ranks, f"{ram.source} / {ranks} rank{'s' if ranks > 1 else ''}")


def node_memory(config: JobConfig) -> Budget:
    """A node's host memory: `job.host_memory_gib` (the target cluster's) when given, else this node's RAM."""
    if config.job.host_memory_gib > 0:
        return Budget(int(config.job.host_memory_gib * GiB), f"job.host_memory_gib {config.job.host_memory_gib:g} GiB")
    ram = host_memory()[0]
    return Budget(ram, f"host RAM {ram / GiB:.1f} GiB")


def run_plan(config: JobConfig, world: int) -> MemoryPlan:
    """The plan for `config` as it will run here (its device)."""
    return plan_memory(config, world, device_type=run_device_type(config))


@dataclass(frozen=True)
class _Change:
    """One option that lowers memory: its command-line flag, the fields it sets, and the ranks it multiplies."""

    flag: str
    fields: tuple[tuple[str, str, object], ...]
    ranks: int = 1


def _changes(config: JobConfig) -> list[_Change]:
    """The options not on yet, in the order they are tried: fused loss, checkpointing, tiled MLP, offload, cp."""
    t, ac, p = config.training, config.activation_checkpoint, config.parallelism
    out = []
    if not t.fused_loss:
        out.append(_Change("--training.fused_loss=true", (("training", "fused_loss", True),)))
    if ac.mode == "none":
        out.append(_Change("--activation_checkpoint.mode=full", (("activation_checkpoint", "mode", "full"),)))
    if t.tiled_mlp == 1:
        out.append(_Change("--training.tiled_mlp=4", (("training", "tiled_mlp", 4),)))
    if run_device_type(config) == "cuda" and not ac.offload:
        out.append(_Change("--activation_checkpoint.offload=true", (("activation_checkpoint", "mode", "full"),
                                                                     ("activation_checkpoint", "offload", True))))
    for factor in (2, 4, 8):
        if resolve_layout(p.cp_layout, p.cp * factor).split_error(t.seq_len) is None:
            out.append(_Change(f"--parallelism.cp={p.cp * factor}", (("parallelism", "cp", p.cp * factor),), factor))
    return out


def _fits_with(config: JobConfig, world: int, changes: list[_Change]) -> bool:
    changed = copy.deepcopy(config)
    for change in changes:
        for section, key, value in change.fields:
            setattr(getattr(changed, section), key, value)
        world *= change.ranks
    budget = memory_budget(changed, world).bytes
    plan = run_plan(changed, world)
    return (budget is None or plan.total <= budget) and _host_fits(changed, world, plan)


def _host_fits(config: JobConfig, world: int, plan: MemoryPlan) -> bool:
    """Whether what the ranks of a node keep in host memory fits a node's (CUDA; on CPU the budget holds it)."""
    return run_device_type(config) != "cuda" or plan.host_bytes * _ranks_on_host(world) <= node_memory(config).bytes


def suggestions(config: JobConfig, world: int) -> str:
    """The options that would make `config` fit: "try A or B" (each alone), "try together A B", or neither."""
    changes = _changes(config)
    alone = [c.flag for c in changes if _fits_with(config, world, [c])]
    if alone:
        return "try " + " or ".join(alone[:3])
    features, cps = [c for c in changes if c.ranks == 1], [c for c in changes if c.ranks > 1]
    for n in range(2, len(features) + 1):
        if _fits_with(config, world, features[:n]):
            return "try together " + " ".join(c.flag for c in features[:n])
    for cp in cps:
        if _fits_with(config, world, [*features, cp]):
            return "try together " + " ".join(c.flag for c in [*features, cp])
    return "no option alone or combined fits it: shorten training.seq_len or use a smaller model"


def describe_memory(config: JobConfig, world: int) -> list[str]:
    """The dry run's and the banner's lines: the predicted peak, its parts, and the budget."""
    try:
        plan = run_plan(config, world)
    except ValueError as e:  # a family without a memory profile
        return [f"  memory: not predicted ({e})"]
    budget = memory_budget(config, world)
    if budget.bytes is None:
        verdict = f"no budget to compare with ({budget.source})"
    else:
        fits = plan.total <= budget.bytes
        verdict = (f"{'fits' if fits else 'DOES NOT FIT'} the budget of {budget.bytes / GiB:.2f} GiB ({budget.source})"
                   + ("" if fits else f"; {suggestions(config, world)}"))
    lines = [f"  memory per rank, predicted peak {plan.total / GiB:.2f} GiB (in {plan.phase}, {plan.tokens:,} tokens "
             f"per forward): {verdict}"]
    parts = [(name, b) for name, b in plan.parts if b]
    lines += [f"    {name:<26} {b / GiB:8.3f} GiB" for name, b in parts]
    if plan.host_bytes:
        lines += _host_lines(config, world, plan)
    if plan.pp_rank is not None:
        lines += _pipeline_lines(config, world)
    return lines


def _pipeline_lines(config: JobConfig, world: int) -> list[str]:
    """Under pipelining, each pipeline rank's stages, the most microbatches each holds at once (read from torch's
    schedule) and the rank's own peak."""
    p = config.parallelism
    lines = [f"  pipeline {p.pp_schedule}, {p.pp_microbatches} microbatches: each pipeline rank's stages (the most "
             "microbatches each holds at once), its peak"]
    for r in range(p.pp):
        plan = plan_memory(config, world, device_type=run_device_type(config), pp_rank=r)
        held = ", ".join(f"{s} ({n})" for s, n in plan.in_flight)
        lines.append(f"    rank {r}: stages {held}: {plan.total / GiB:.2f} GiB (in {plan.phase})")
    return lines


_HOST_OPTIONS = {"checkpointed block inputs": "activation_checkpoint.offload",
                 "pinned-memory rounding": "activation_checkpoint.offload",
                 "parameter shards": "training.offload_params", "gradient shards": "training.offload_params",
                 "AdamW moments": "training.offload_params"}
"""The option that puts each of the plan's host parts in host memory."""


def _host_options(plan: MemoryPlan) -> list[str]:
    """The options whose bytes are in the plan's host memory, in the parts' order."""
    return list(dict.fromkeys(_HOST_OPTIONS[name] for name, b in plan.host_parts if b))


def _host_lines(config: JobConfig, world: int, plan: MemoryPlan) -> list[str]:
    """The host memory a CUDA rank keeps, per rank by part and per node, against a node's RAM."""
    ranks = _ranks_on_host(world)
    node = plan.host_bytes * ranks
    ram = node_memory(config)
    verdict = (f"fits the node's {ram.bytes / GiB:.1f} GiB ({ram.source})" if node <= ram.bytes else
               f"DOES NOT FIT the node's {ram.bytes / GiB:.1f} GiB ({ram.source}"
               + ("" if config.job.host_memory_gib else "; the target's: --job.host_memory_gib") + ")")
    unset = "" if os.environ.get("LOCAL_WORLD_SIZE") else " (LOCAL_WORLD_SIZE unset: all ranks on one node)"
    lines = [f"  offloaded to host memory: {plan.host_bytes / GiB:.3f} GiB per rank, {node / GiB:.3f} GiB for the "
             f"{ranks} rank{'s' if ranks > 1 else ''} of a node{unset}: {verdict}"]
    lines += [f"    {name:<26} {b / GiB:8.3f} GiB  ({_HOST_OPTIONS[name]})" for name, b in plan.host_parts if b]
    return lines


def _ranks_on_host(world: int) -> int:
    """The ranks sharing this host's RAM: torchrun's `LOCAL_WORLD_SIZE` (the dry run reads it too), else all."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or world


def check_memory(config: JobConfig, world: int) -> None:
    """Refuse a run whose predicted peak exceeds the budget, before any rank starts.

    Raises:
        ConfigError: one line, the prediction, the budget and the options that would make it fit.
    """
    budget = memory_budget(config, world)
    try:
        plan = run_plan(config, world)
    except ValueError:  # a family without a memory profile: nothing to check against
        return
    if budget.bytes is not None and plan.total > budget.bytes:
        raise ConfigError(
            f"memory: predicted {plan.total / GiB:.1f} GiB per rank > budget {budget.bytes / GiB:.1f} GiB "
            f"({budget.source}); {suggestions(config, world)} (the parts: --job.dry_run)"
        )
    check_host_memory(config, world, plan)


def check_host_memory(config: JobConfig, world: int, plan: MemoryPlan) -> None:
    """Refuse a CUDA run whose node's ranks would keep more in host memory than a node has (`node_memory`).

    On CPU nothing: host and device memory are one there, and `check_memory`'s budget (a node's RAM over its ranks,
    `job.host_memory_gib` included) already holds the whole plan to it.

    Raises:
        ConfigError: one line, starting with the options that put the bytes there, with the need per node and per
            rank, the node's memory and where that figure comes from.
    """
    if _host_fits(config, world, plan):
        return
    ranks, ram = _ranks_on_host(world), node_memory(config)
    options = _host_options(plan)
    parts = ", ".join(f"{name} {b / GiB:.1f}" for name, b in plan.host_parts if b)
    off = [f"--{o}=false" for o in options if _fits_without(config, world, o)]  # the GPU then holds them
    raise ConfigError(
        f"{', '.join(options)}: the {ranks} rank{'s' if ranks > 1 else ''} of this node would keep "
        f"{plan.host_bytes * ranks / GiB:.1f} GiB in host memory ({plan.host_bytes / GiB:.1f} GiB each: {parts}) but a "
        f"node has {ram.bytes / GiB:.1f} GiB ({ram.source}); "
        + (f"try {' or '.join(off)} (the GPU holds it then), or " if off else "")
        + "raise parallelism.cp or use fewer ranks a node"
        + ("" if config.job.host_memory_gib else "; for another cluster, give its node's memory: --job.host_memory_gib")
    )


def _fits_without(config: JobConfig, world: int, option: str) -> bool:
    """Whether the plan fits, the device's budget and a node's host memory, with `option` ("section.key") off."""
    changed = copy.deepcopy(config)
    section, key = option.split(".")
    setattr(getattr(changed, section), key, False)
    return _fits_with(changed, world, [])
