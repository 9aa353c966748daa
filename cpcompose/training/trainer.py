"""The training loop: build, parallelize, step, log, checkpoint.

The degrees and the mesh come from `ParallelDims`; the model, and where each
parallelism applies to it, from its family's `ModelSpec` (`model.name` in the
registry). This file owns the step itself: each CP rank's shard of the batch,
the global count of valid tokens, forward and backward (or the pipeline
schedule), clipping, the update, logging and checkpoints.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from cpcompose.comm import CommMeter
from cpcompose.config import JobConfig
from cpcompose.data import IGNORE_INDEX, Batch, build_data_source
from cpcompose.distributed import ParallelDims, build_pipeline_schedule, build_pipeline_stage, flat_mesh
from cpcompose.layouts import PackedLayout, resolve_layout
from cpcompose.models import get_model_spec
from cpcompose.packing import pad_pack
from cpcompose.parallel import ContextParallel, cp_cross_entropy
from cpcompose.training.checkpoint import CheckpointManager
from cpcompose.training.grad_norm import clip_grad_norm
from cpcompose.training.lr_schedule import build_lr_scheduler
from cpcompose.training.metrics import MetricsLogger, StepMetrics, peak_memory_mib


class Trainer:
    """One rank's share of a run described by `config` (the process group must exist)."""

    def __init__(self, config: JobConfig) -> None:
        self.config = c = config
        world = dist.get_world_size()
        c.validate(world_size=world)
        p = c.parallelism
        self.device = torch.device(
            "cuda" if c.training.device == "cuda" or (c.training.device == "auto" and torch.cuda.is_available())
            else "cpu"
        )
        self.dims = ParallelDims.from_config(p, world)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.loss_mesh = flat_mesh(self.mesh, "dp_cp")
        dp_mesh = flat_mesh(self.mesh, "dp")
        self.cp_rank = self.mesh["cp"].get_local_rank()
        self.layout = resolve_layout(p.cp_layout, p.cp)
        self.meter = CommMeter()
        # One options object from the config to every attention call. The style is kept to
        # switch packed layouts per batch (and applied at cp == 1 too, so documents stay masked).
        self.cp_style = (
            ContextParallel(p.cp_options(meter=self.meter), seq_dim=1)
            if self.dims.cp_enabled or c.data.pack else None
        )
        self.model = self._build_model()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.optimizer.lr, betas=c.optimizer.betas,
            weight_decay=c.optimizer.weight_decay, eps=c.optimizer.eps,
        )
        s = c.lr_scheduler
        self.scheduler = build_lr_scheduler(
            self.optimizer, name=s.name, warmup_steps=s.warmup_steps, total_steps=c.training.steps,
            min_lr_ratio=s.min_lr_ratio,
        )
        self.data = build_data_source(c, dp_rank=dp_mesh.get_local_rank(), dp_size=dp_mesh.size())
        self.dp_group = dp_mesh.get_group()
        self.schedule = self._build_schedule() if self.dims.pp_enabled else None
        dump = Path(c.job.dump_folder)
        self.checkpoints = CheckpointManager(
            dump / c.checkpoint.folder, interval=c.checkpoint.interval, keep_latest_k=c.checkpoint.keep_latest_k
        )
        self.step = 0
        self._num_tokens = torch.zeros(())  # this step's global count of valid labels
        self.grad_norm = 0.0
        if c.checkpoint.enable and c.checkpoint.resume and (latest := self.checkpoints.latest()) is not None:
            self._restore(latest)
        rank0 = dist.get_rank() == 0
        self.logger = MetricsLogger(
            enabled=rank0, total_steps=c.training.steps, log_freq=c.metrics.log_freq,
            tb_folder=dump / c.metrics.save_tb_folder if c.metrics.enable_tensorboard else None,
            plot_path=dump / "loss.png" if c.metrics.plot_loss else None,
        )

    # --- construction ---

    def _build_model(self) -> torch.nn.Module:
        """Identical weights on every rank (initialized whole, then cut and parallelized)."""
        c = self.config
        spec = get_model_spec(c.model.name)
        model = spec.build(c)
        model.init_weights(seed=c.job.seed)
        if self.dims.pp_enabled:
            model = spec.split_for_pipeline(
                model, num_stages=self.dims.pp, stage_index=self.mesh["pp"].get_local_rank()
            )
        model.to(self.device)
        return spec.parallelize(
            model, parallel_dims=self.dims, mesh=self.mesh, cp=self.cp_style,
            activation_checkpoint=c.activation_checkpoint.mode == "full", torch_compile=c.training.compile,
        )

    def _build_schedule(self):  # -> a torch.distributed.pipelining schedule
        p = self.config.parallelism
        stage = build_pipeline_stage(self.model, parallel_dims=self.dims, mesh=self.mesh, device=self.device)
        return build_pipeline_schedule(
            stage, schedule=p.pp_schedule, microbatches=p.pp_microbatches, loss_fn=self._pipeline_loss
        )

    # --- one step ---

    def _shard(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, PackedLayout | None]:
        """This CP rank's tokens, labels and positions `[batch, local_seq]` (and the batch's pack layout)."""
        if batch.cu_seqlens is not None:
            return self._shard_packed(batch)
        tokens = self.layout.shard(batch.input_ids, 1, self.cp_rank).to(self.device)
        labels = self.layout.shard(batch.labels, 1, self.cp_rank).to(self.device)
        positions = self.layout.position_ids(self.cp_rank, batch.input_ids.shape[1], self.device)
        return tokens, labels, positions.expand(tokens.shape[0], -1).contiguous(), None

    def _shard_packed(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, PackedLayout]:
        """The micro-batch as one pack of documents, split with balanced attention work."""
        seq = batch.input_ids.shape[1]
        assert batch.cu_seqlens is not None
        cu = [0] + [int(b) + i * seq for i, c in enumerate(batch.cu_seqlens) for b in c.tolist()[1:]]
        layout = PackedLayout.build(cu, self.dims.cp)
        tokens = pad_pack(batch.input_ids.reshape(1, -1), layout, dim=1)
        labels = pad_pack(batch.labels.reshape(1, -1), layout, dim=1, value=IGNORE_INDEX)
        local = [layout.shard(t, 1, self.cp_rank).to(self.device) for t in (tokens, labels)]
        return local[0], local[1], layout.position_ids(self.cp_rank, device=self.device)[None], layout

    def _global_tokens(self, batches: list[Batch]) -> Tensor:
        """Valid labels in this step's global batch (each dp rank counts its full sequences)."""
        count = sum((b.labels != IGNORE_INDEX).sum() for b in batches).to(torch.float32).to(self.device)
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(count, group=self.dp_group)
        return count

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.training.mixed_precision == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _pipeline_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return cp_cross_entropy(logits, labels, mesh=self.loss_mesh, num_tokens=self._num_tokens)

    def train_step(self) -> float:
        """Forward, backward, reduce, clip, update; returns the global mean loss."""
        c = self.config
        batches = [next(self.data) for _ in range(c.training.grad_accum_steps)]
        self._num_tokens = self._global_tokens(batches)
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.zeros((), device=self.device, dtype=torch.float64)
        for batch in batches:
            tokens, labels, positions, packed = self._shard(batch)
            layout_scope = self.cp_style.layout_for(packed) if packed is not None else contextlib.nullcontext()
            with layout_scope, self._autocast():  # packed: backward inside too (recompute sees the layout)
                if self.schedule is not None:
                    local += self._pipeline_step(tokens, labels, positions)
                else:
                    logits = self.model(tokens, positions)
                    loss = cp_cross_entropy(logits, labels, mesh=self.loss_mesh, num_tokens=self._num_tokens)
                    loss.backward()
                    local += loss.detach()
        self.grad_norm = clip_grad_norm(
            self.model.parameters(), c.training.max_norm,
            pp_group=self.mesh["pp"].get_group() if self.dims.pp_enabled else None,
        )
        self.optimizer.step()
        self.scheduler.step()
        return self._global_loss(local)

    def _pipeline_step(self, tokens: Tensor, labels: Tensor, positions: Tensor) -> Tensor:
        stage = self.mesh["pp"].get_local_rank()
        last = stage == self.dims.pp - 1
        losses: list[Tensor] = []
        args = (tokens,) if stage == 0 else ()
        self.schedule.step(*args, target=labels if last else None, losses=losses, position_ids=positions)
        return sum((x.detach().double() for x in losses), torch.zeros((), dtype=torch.float64, device=self.device))

    def _global_loss(self, local: Tensor) -> float:
        """Sum the shares over dp x cp; with PP only the last stage has them, so sum over pp too."""
        dist.all_reduce(local, group=self.loss_mesh.get_group())
        if self.dims.pp_enabled:
            dist.all_reduce(local, group=self.mesh["pp"].get_group())
        return local.item()

    # --- the run ---

    def run(self) -> list[float]:
        c = self.config
        losses: list[float] = []
        first = self.step + 1
        tokens_per_step = c.training.batch_size * c.training.seq_len
        while self.step < c.training.steps:
            self.step += 1
            self.meter.reset()
            start = time.perf_counter()
            loss = self.train_step()
            elapsed = time.perf_counter() - start
            losses.append(loss)
            peaks = torch.tensor([peak_memory_mib(self.device)], device=self.device)
            everyone = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, peaks)
            self.logger.log(
                StepMetrics(
                    step=self.step, loss=loss, lr=self.scheduler.get_last_lr()[0], grad_norm=float(self.grad_norm),
                    tokens_per_s=tokens_per_step / elapsed, step_time_s=elapsed,
                    peak_memory_mib=[float(x) for x in everyone], cp_bytes_sent=self.meter.total,
                ),
                first_step=first,
            )
            if c.checkpoint.enable and self.checkpoints.due(self.step, last_step=c.training.steps):
                self.checkpoints.save(self.step, self.model, self.optimizer, self._trainer_state())
        if not losses and dist.get_rank() == 0:
            print(
                f"nothing to train: the checkpoint is already at step {self.step} of training.steps = "
                f"{c.training.steps}; raise --training.steps, or start fresh with --checkpoint.resume=false "
                "or another --job.dump_folder",
                flush=True,
            )
        self.logger.close(title=f"{c.job.name}: loss")
        return losses

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": torch.get_rng_state(),
        }

    def _restore(self, path: Path) -> None:
        state = self.checkpoints.load(path, self.model, self.optimizer)
        self.step = state["step"]
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        if dist.get_rank() == 0:
            print(f"resumed from {path} at step {self.step}", flush=True)
