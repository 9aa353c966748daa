"""The whole run's configuration and the checks that span its sections."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cpcompose.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    ConfigError,
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
from cpcompose.attention.strategies.alltoall_chunked import head_chunks_error
from cpcompose.config.cp_options import cp_options_error
from cpcompose.distributed.parallel_dims import ParallelDims
from cpcompose.layouts import resolve_layout

__all__ = ["LOSS_CHUNK_BYTES", "JobConfig"]

LOSS_CHUNK_BYTES = 256 * 2**20  # float32 logits of one fused-loss chunk, when training.loss_chunk_tokens is unset


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

    def max_seq_len(self) -> int:
        """The longest row one forward sees: a packed micro-batch is all its samples' tokens in one row."""
        return self.training.seq_len * (self.training.batch_size if self.data.pack else 1)

    def loss_chunk_tokens(self) -> int:
        """Tokens per chunk of the fused loss: `training.loss_chunk_tokens`, or unset, the multiple of 128 whose
        float32 logits fill at most `LOSS_CHUNK_BYTES`, clamped to 128..4096 (below 128 a chunk's matmul is too
        thin to run well; above 4096 a chunk saves no time)."""
        if self.training.loss_chunk_tokens is not None:
            return self.training.loss_chunk_tokens
        fitting = LOSS_CHUNK_BYTES // (4 * self.model.vocab_size) // 128 * 128
        return min(4096, max(128, fitting))

    def validate(self, world_size: int | None = None) -> None:
        """Check the constraints that span sections, asking the module that owns each rule.

        The schema alone: whether `model.name` is registered, what its family takes and what its
        files hold, and whether the data task's parameters fit are the trainer's resolution step's
        (`cpcompose.training.resolve.resolve_config`), which knows the model families and the data sources.

        :func:`load_config` calls it without a world size (shape checks only); the trainer calls it
        again with one, which also checks the degrees against it (``ParallelDims``) and the batch
        split. The config is only read: ``parallelism.dp_shard = -1`` stays ``-1`` here, and
        :meth:`ParallelDims.from_config` resolves it wherever the degrees are needed.

        Raises:
            ConfigError: naming the key to change.
        """
        p, m, t = self.parallelism, self.model, self.training
        if (error := cp_options_error(p)) is not None:
            raise error
        require(self.job.dry_run or not self.job.rehearse, "job.rehearse", "rehearses the dry run's step: add "
                "--job.dry_run (or unset job.rehearse)")
        dp: int | None = p.dp_replicate * p.dp_shard if p.dp_shard != -1 else None
        if world_size is not None:
            try:
                dp = ParallelDims.from_config(p, world_size).dp_size
            except ValueError as e:  # its messages start with the key to change
                raise ConfigError(str(e)) from None
        split_error = resolve_layout(p.cp_layout, p.cp).split_error(t.seq_len)
        require(split_error is None, "training.seq_len", str(split_error))
        require(p.cp_head_chunks == 1 or p.cp == 1 or not t.compile, "parallelism.cp_head_chunks",
                f"{p.cp_head_chunks} runs eagerly only (the compiled attention op saves head shards, not the "
                "chunked strategy's inputs): set training.compile = false or parallelism.cp_head_chunks = 1")
        if m.path is None:  # the section's head counts are the own model's; a folder's are checked by its family
            require(m.n_heads % p.tp == 0, "model.n_heads", f"{m.n_heads} must be divisible by parallelism.tp = {p.tp}")
            require(m.n_kv_heads % p.tp == 0, "model.n_kv_heads",
                    f"{m.n_kv_heads} must be divisible by parallelism.tp = {p.tp}")
            chunks = head_chunks_error(m.n_heads // p.tp, m.n_kv_heads // p.tp, p.cp_head_chunks, p.cp,
                                       key="parallelism.cp_head_chunks")
            require(chunks is None, "parallelism.cp_head_chunks", str(chunks).removeprefix(
                f"parallelism.cp_head_chunks={p.cp_head_chunks} "))
        # The layers into stages, the stages a schedule places, the microbatches it needs: the resolution step
        # (`cpcompose.training.resolve`), once the family has said how many layers the model has.
        require(p.pp > 1 or p.pp_layers_per_stage is None, "parallelism.pp_layers_per_stage",
                "cuts pipeline stages, and parallelism.pp = 1 has none: unset it, or set parallelism.pp > 1")
        split = (dp if dp is not None else p.dp_replicate) * t.grad_accum_steps  # dp_shard=-1 counts 1 until known
        require(t.batch_size % split == 0, "training.batch_size",
                f"{t.batch_size} must be divisible by dp_replicate*dp_shard*grad_accum_steps = {split}")
        if p.pp > 1 and dp is not None:
            local = t.batch_size // split
            require(local % p.pp_microbatches == 0, "parallelism.pp_microbatches",
                    f"{p.pp_microbatches} must divide the local batch of {local} sequences")
        require(t.tiled_block == 1 or (p.tp == 1 and p.pp == 1), "training.tiled_block",
                f"tiles the own Llama's blocks with parallelism.tp = 1 and pp = 1 only (tp = {p.tp}, pp = {p.pp}): set "
                "training.tiled_block = 1 (training.tiled_mlp tiles the feed-forward under tp and pp)")
        require(not (t.offload_params and p.pp > 1), "training.offload_params",
                "FSDP2's CPUOffloadPolicy keeps no unit gathered between pipeline microbatches here; set "
                "parallelism.pp = 1 or training.offload_params = false")
        # One rank over dp x cp takes offload_params too: the trainer then shards with FSDP2 over that one rank
        # (`cpcompose.distributed.fsdp.fsdp_wanted`), whose CPUOffloadPolicy is the offload.
