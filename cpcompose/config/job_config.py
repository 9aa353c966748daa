"""The whole run's configuration and the checks that span its sections."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cpcompose.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Data,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Training,
    require,
)

__all__ = ["JobConfig"]


@dataclass
class JobConfig:
    """All sections of a run; build it with :func:`load_config`."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    parallelism: Parallelism = field(default_factory=Parallelism)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict ``{section: {key: value}}`` for logging."""
        return asdict(self)

    def validate(self, world_size: int | None = None) -> None:
        """Check the constraints that span sections.

        :func:`load_config` calls it without a world size (shape checks only); the trainer calls it
        again with one, which also fills in ``parallelism.dp_shard = -1`` and checks the batch split.

        Raises:
            ConfigError: naming the key to change.
        """
        p, m, t, d = self.parallelism, self.model, self.training, self.data
        if world_size is not None:
            others = p.dp_replicate * p.cp * p.tp * p.pp
            if p.dp_shard == -1:
                require(world_size % others == 0, "parallelism.dp_shard",
                         f"-1 needs world size {world_size} divisible by dp_replicate*cp*tp*pp = {others}")
                p.dp_shard = world_size // others
            require(others * p.dp_shard == world_size, "parallelism.dp_shard",
                     f"dp_replicate*dp_shard*cp*tp*pp = {others * p.dp_shard} but the world size is "
                     f"{world_size}; set dp_shard = -1 to fill in the rest")
        chunks, rule = (2 * p.cp, "2*cp") if p.cp_layout == "zigzag" else (p.cp, "cp")
        require(t.seq_len % chunks == 0, "training.seq_len",
                 f"{t.seq_len} must be divisible by {rule} = {chunks} for cp_layout '{p.cp_layout}'")
        require(m.n_heads % p.tp == 0, "model.n_heads", f"{m.n_heads} must be divisible by parallelism.tp = {p.tp}")
        require(m.n_kv_heads % p.tp == 0, "model.n_kv_heads",
                f"{m.n_kv_heads} must be divisible by parallelism.tp = {p.tp}")
        if p.cp_strategy == "alltoall":
            require((m.n_heads // p.tp) % p.cp == 0, "parallelism.cp",
                     f"alltoall splits the {m.n_heads // p.tp} heads per tp rank across cp ranks; "
                    f"{p.cp} must divide them")
        require(m.n_layers % p.pp == 0, "model.n_layers", f"{m.n_layers} must be divisible by parallelism.pp = {p.pp}")
        if p.pp > 1 and p.pp_schedule == "1F1B":
            require(p.pp_microbatches >= p.pp, "parallelism.pp_microbatches", f"1F1B needs >= pp = {p.pp}")
        dp = p.dp_replicate * (p.dp_shard if p.dp_shard != -1 else 1)
        split = dp * t.grad_accum_steps
        require(t.batch_size % split == 0, "training.batch_size",
                 f"{t.batch_size} must be divisible by dp_replicate*dp_shard*grad_accum_steps = {split}")
        if p.pp > 1 and p.dp_shard != -1:
            local = t.batch_size // split
            require(local % p.pp_microbatches == 0, "parallelism.pp_microbatches",
                     f"{p.pp_microbatches} must divide the local batch of {local} sequences")
        require(not (d.pack and p.pp > 1), "data.pack",
                "packed documents are one sequence per micro-batch, which pipeline microbatches cannot split; "
                "set parallelism.pp = 1")
        if d.source == "synthetic" and d.task == "copy":
            require(t.seq_len % 2 == 0, "training.seq_len", f"{t.seq_len} must be even for data.task = 'copy'")
        if d.source == "synthetic" and d.task == "recall":  # the layout rule of cpcompose.data.synthetic
            key_end = int(d.key_fraction * t.seq_len)
            require((key_end - 1) // 3 >= d.num_pairs, "data.num_pairs",
                     f"{d.num_pairs} triples (KEY k v) do not fit in the first {key_end} tokens")
            require(t.seq_len - 3 * d.num_queries >= key_end, "data.num_queries",
                     f"{d.num_queries} triples (QUERY k v) do not fit after the first {key_end} tokens")
        require(self.lr_scheduler.warmup_steps <= t.steps, "lr_scheduler.warmup_steps",
                 f"{self.lr_scheduler.warmup_steps} exceeds training.steps = {t.steps}")
