"""`--job.dry_run`: what a configuration would do, printed without starting anything."""

from __future__ import annotations

import torch

from cpcompose.config import JobConfig
from cpcompose.models import Llama


def llama_config(config: JobConfig):  # -> LlamaConfig
    """The model section as a `LlamaConfig`."""
    from cpcompose.models import LlamaConfig

    m = config.model
    return LlamaConfig(
        vocab_size=m.vocab_size, dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
        ffn_hidden_dim=m.ffn_hidden_dim, norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        # A packed micro-batch is one sequence of all its samples' tokens.
        max_seq_len=config.training.seq_len * (config.training.batch_size if config.data.pack else 1),
    )


def describe_plan(config: JobConfig, world: int) -> str:
    """A readable summary: degrees, model size, per-rank tokens and state memory."""
    p, t = config.parallelism, config.training
    with torch.device("meta"):
        n_params = sum(x.numel() for x in Llama(llama_config(config)).parameters())
    shards = max(p.dp_shard, 1) * p.cp * p.tp * p.pp  # FSDP shards over dp_shard x cp, TP and PP split too
    state_gib = n_params * 16 / shards / 2**30  # fp32 params + grads + Adam moments
    local_seq = t.seq_len // p.cp
    dp = p.dp_replicate * max(p.dp_shard, 1)
    lines = [
        f"plan for '{config.job.name}' on {world} rank(s)",
        f"  mesh: pp={p.pp} dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp}",
        f"  context parallel: strategy={p.cp_strategy} layout={p.cp_layout}; "
        f"{t.seq_len:,} tokens per sequence, {local_seq:,} per CP rank",
        f"  model: {n_params / 1e9:.3f} B parameters ({config.model.n_layers} layers, dim {config.model.dim}, "
        f"{config.model.n_heads} heads, {config.model.n_kv_heads} kv heads)",
        f"  parameter + gradient + AdamW state: {state_gib:.2f} GiB per rank (fp32, sharded {shards}-way)",
        f"  batch: {t.batch_size} sequences per step over dp={dp}, grad_accum={t.grad_accum_steps}, "
        f"{t.steps} steps, precision {t.mixed_precision}, activation checkpointing "
        f"{config.activation_checkpoint.mode}",
    ]
    return "\n".join(lines)
