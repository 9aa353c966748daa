"""`--job.dry_run`: what a configuration would do, printed without starting anything."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cpcompose.config import JobConfig
from cpcompose.distributed import ParallelDims
from cpcompose.training.launcher.data_summary import data_lines
from cpcompose.training.launcher.nodes import node_warnings, placement
from cpcompose.training.families import family_of
from cpcompose.training.resolve import resolve_config
from cpcompose.training.memory.budget import describe_memory

__all__ = ["describe_plan"]


def describe_plan(config: JobConfig, world: int, lengths_png: Path | None = None,
                  data_notes: Sequence[str] = ()) -> str:
    """A readable summary: degrees, where they sit on the nodes (several), model size, per-rank tokens, the data,
    and the memory plan against the budget.

    ``lengths_png``: where token stores draw their documents' length histogram (the banner: beside the loss plot).
    ``data_notes``: what the pre-launch data check did (the banner: each token store reused, built or rebuilt).

    Raises:
        ValueError: the degrees do not fit ``world`` (``config.validate(world_size=world)`` reports it first).
        ConfigError: the mesh does not fit the nodes (``LOCAL_WORLD_SIZE`` ranks each; `launcher.nodes`).
    """
    config = resolve_config(config, world)  # resolved by the launcher already: the same config (idempotent)
    p, t = config.parallelism, config.training
    dims = ParallelDims.from_config(p, world)
    n_params, model = family_of(config).describe(config)
    shards = dims.fsdp_size * dims.tp * dims.pp  # FSDP shards over dp_shard x cp, TP and PP split too
    state_gib = n_params * 16 / shards / 2**30  # fp32 params + grads + Adam moments
    local_seq = t.seq_len // p.cp
    lines = [
        f"plan for '{config.job.name}' on {world} rank(s)",
        f"  mesh: pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp}"
        + (f" ep={dims.ep} (experts: efsdp={dims.efsdp_size} x ep={dims.ep}, folded out of dp_shard x cp)"
           if dims.ep_enabled else ""),
        *([f"  {placed.line()}"] if (placed := placement(config, world)) is not None else []),
        *(f"  {warning}" for warning in node_warnings(config, placed)),
        f"  context parallel: strategy={p.cp_strategy}{_blocks(p.cp, p.cp_alltoall_size)} layout={p.cp_layout}; "
        f"{t.seq_len:,} tokens per sequence, {local_seq:,} per CP rank",
        f"  model: {model}",
        f"  parameter + gradient + AdamW state: {state_gib:.2f} GiB per rank (fp32, sharded {shards}-way)"
        + (_experts_share(config, dims) if dims.ep_enabled else ""),
        f"  batch: {t.batch_size} sequences per step over dp={dims.dp_size}, grad_accum={t.grad_accum_steps}, "
        f"{t.steps} steps, precision {t.mixed_precision}, activation checkpointing "
        f"{config.activation_checkpoint.mode}",
    ]
    lines += data_lines(config, lengths_png, data_notes) + describe_memory(config, world)
    if config.job.rehearse:  # minutes at full size: one step on fake tensors, torch's tracker beside the plan
        from cpcompose.training.memory.rehearsal import describe_rehearsal, rehearse

        try:
            lines += describe_rehearsal(rehearse(config, world), world)
        except ValueError as e:  # a pipelined model the rehearsal cannot run yet: said in one line, as the plan's
            lines.append(f"  rehearsal: not run ({e})")
    return "\n".join(lines)


def _experts_share(config: JobConfig, dims: ParallelDims) -> str:
    """Under expert parallelism, the routed experts' part of the state line: each rank holds 1/ep of every MoE
    layer's experts, sharded efsdp ways (ep x efsdp = the FSDP degree, so the bytes per rank are the same as
    sharding all of them over every rank; what ep changes is each gathered block's, which the memory plan shows)."""
    try:
        profile = family_of(config).memory_profile(config, tp=dims.tp, precision="float32", mlp_tiles=1)
    except ValueError:  # a family the plan cannot count: the split alone
        return f"; the routed experts 1/{dims.ep} per rank (ep), sharded {dims.efsdp_size}-way (efsdp)"
    experts = profile.body_expert_params
    return (f"; of it the routed experts' {experts * 16 / dims.ep / dims.efsdp_size / 2**30:.2f} GiB: "
            f"{experts / 1e9:.1f}B parameters, 1/{dims.ep} of them per rank (ep), sharded {dims.efsdp_size}-way "
            f"(efsdp)")


def _blocks(cp: int, alltoall_size: int | None) -> str:
    """The 2-D mesh of "alltoall_ring": all-to-all blocks x ring places."""
    return "" if alltoall_size is None else f" ({alltoall_size} all-to-all x {cp // alltoall_size} ring)"
