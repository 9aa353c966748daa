"""The memory plan against the budget: what the dry run and the banner print, what the pre-launch check refuses.

The budget per rank is `training.memory_budget_gib` when set, else the device's memory (CUDA:
the GPU's total) or, on CPU, the host's RAM divided by the ranks this host runs. A run whose
predicted peak exceeds it is refused before any rank starts, in one line that names the options
that would make it fit: each alone where one suffices, else the shortest combination (fused
loss, activation checkpointing, tiled MLP, offload, then a larger cp), each checked with the plan.
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

__all__ = ["Budget", "check_memory", "describe_memory", "memory_budget", "run_plan", "suggestions"]


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
    ram = host_memory()[0]
    return Budget(ram // ranks, f"host RAM {ram / GiB:.1f} GiB / {ranks} rank{'s' if ranks > 1 else ''}")


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
    return budget is None or run_plan(changed, world).total <= budget


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
        ranks = _ranks_on_host(world)
        lines.append(f"    (offloaded to host memory: {plan.host_bytes / GiB:.3f} GiB per rank, "
                     f"{plan.host_bytes * ranks / GiB:.3f} GiB for the {ranks} rank{'s' if ranks > 1 else ''} of a node)")
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
    if budget.bytes is None:
        return
    try:
        plan = run_plan(config, world)
    except ValueError:  # a family without a memory profile: nothing to check against
        return
    if plan.total > budget.bytes:
        raise ConfigError(
            f"memory: predicted {plan.total / GiB:.1f} GiB per rank > budget {budget.bytes / GiB:.1f} GiB "
            f"({budget.source}); {suggestions(config, world)} (the parts: --job.dry_run)"
        )
    ranks, ram = _ranks_on_host(world), host_memory()[0]  # on CUDA what the node's ranks offload shares its RAM
    if run_device_type(config) == "cuda" and plan.host_bytes * ranks > ram:
        raise ConfigError(
            f"activation_checkpoint.offload: the {ranks} rank{'s' if ranks > 1 else ''} of this node would keep "
            f"{plan.host_bytes * ranks / GiB:.1f} GiB in host memory ({plan.host_bytes / GiB:.1f} GiB each) but it has "
            f"{ram / GiB:.1f} GiB; set --activation_checkpoint.offload=false, raise parallelism.cp, or use fewer "
            "ranks a node"
        )
