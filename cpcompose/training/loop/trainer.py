"""The training loop: build, parallelize, step, log, checkpoint.

The degrees and the mesh come from `ParallelDims`; the model, and where each
parallelism applies to it, from its family (`families.py`, the one place that reads
`model.name`). This file owns the step itself: each CP rank's shard of the batch,
the global count of valid tokens, forward and backward (or the pipeline
schedule), clipping, the update, logging and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import Tensor

from cpcompose import _compat
from cpcompose.comm import CommMeter, all_gather_tensors, all_reduce, broadcast_object
from cpcompose.config import ConfigError, JobConfig
from cpcompose.data import IGNORE_INDEX, Batch, build_data_source
from cpcompose.distributed import (
    ParallelDims,
    build_pipeline_schedule,
    build_pipeline_stages,
    flat_mesh,
    fsdp_applied,
    microbatch_doc_bounds,
    stage_ids,
    stages_per_rank,
)
from cpcompose.layouts import PackedLayout, resolve_layout
from cpcompose.sharding.packed import pack_documents
from cpcompose.parallel import cp_cross_entropy, cp_linear_cross_entropy, cp_load_balancing_loss
from cpcompose.training.loop.checkpoint import CheckpointManager
from cpcompose.training.errors import TrainingError
from cpcompose.training.families.export import export_folder, mark_export
from cpcompose.training.families import family_of
from cpcompose.training.resolve import resolve_config
from cpcompose.training.loop.faults import Fault, Progress, describe_comm_failure, is_comm_failure
from cpcompose.training.loop.grad_norm import clip_grad_norm
from cpcompose.training.loop.lr_schedule import build_lr_scheduler
from cpcompose.training.loop.metrics import MetricsLogger, StepMetrics, peak_memory_mib, stamp
from cpcompose.training.loop.run_lock import FolderLocked, RunLock

__all__ = ["Trainer"]


@contextlib.contextmanager
def _auto_choices_in_log(logger: MetricsLogger, *, enabled: bool):
    """Print `strategy="auto"`'s line for each new call signature in the run's log (rank 0), for the run only."""
    if not enabled:
        yield
        return

    class Note(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logger.note(record.getMessage())

    source, handler = logging.getLogger("cpcompose.auto"), Note(logging.INFO)
    level = source.level
    source.addHandler(handler)
    source.setLevel(logging.INFO)
    try:
        yield
    finally:
        source.removeHandler(handler)
        source.setLevel(level)


class Trainer:
    """One rank's share of a run described by `config` (the process group must exist)."""

    def __init__(self, config: JobConfig) -> None:
        world = dist.get_world_size()
        self.config = c = resolve_config(config, world)  # the launcher resolved it too: the same config either way
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
        # This rank's pipeline stages: one per rank for GPipe/1F1B, several (looped or in a V) otherwise.
        per_rank = stages_per_rank(p, c.model.n_layers) if self.dims.pp_enabled else 1
        self.num_stages = self.dims.pp * per_rank
        self.stage_ids = stage_ids(p.pp_schedule, self.dims.pp, self.mesh["pp"].get_local_rank(), per_rank) \
            if self.dims.pp_enabled else (0,)
        # One options object from the config to every attention call; the family says how CP
        # reaches its attention (a style on the modules, or a region around each micro-batch).
        self.trained = family_of(c).build(
            c, dims=self.dims, mesh=self.mesh, device=self.device, meter=self.meter, stages=self.stage_ids,
            num_stages=self.num_stages,
        )
        self.model = self.trained.module
        # Fused (torchtitan's default): one kernel updates each parameter in place, with no per-parameter
        # temporaries; on CPU those were mapped afresh every step (scripts/benchmarks/bench_host_memory.py).
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=c.optimizer.lr, betas=c.optimizer.betas,
            weight_decay=c.optimizer.weight_decay, eps=c.optimizer.eps, fused=True,
        )
        s = c.lr_scheduler
        self.scheduler = build_lr_scheduler(
            self.optimizer, name=s.name, warmup_steps=s.warmup_steps, total_steps=c.training.steps,
            min_lr_ratio=s.min_lr_ratio,
        )
        try:  # a bad record the pre-launch scan did not reach: the same one line on every rank, printed once
            self.data = build_data_source(c, dp_rank=dp_mesh.get_local_rank(), dp_size=dp_mesh.size())
        except ConfigError as e:
            raise TrainingError(str(e), exit_code=2) from None
        self.dp_group = dp_mesh.get_group()
        self.schedule = self._build_schedule() if self.dims.pp_enabled else None
        dump = Path(c.job.dump_folder)
        self.checkpoints = CheckpointManager(
            dump / c.checkpoint.folder, interval=c.checkpoint.interval, keep_latest_k=c.checkpoint.keep_latest_k,
            experts=self.trained.expert_shards,
        )
        self.step = 0
        self._num_tokens = torch.zeros(())  # this step's global count of valid labels
        self.grad_norm = 0.0
        self.router_loss: float | None = None  # this step's router loss (a family with one), as logged
        self.step_lr = 0.0
        self.history: list[tuple[int, float]] = []  # (step, loss) of the whole run, across resumes
        self.stop_signal = 0  # set by the SIGTERM/SIGINT handler; acted on at the next step boundary
        self.fault = Fault.from_env()
        self.lock = RunLock(dump) if dist.get_rank() == 0 else None
        self._claim_folder()
        rank0 = dist.get_rank() == 0
        self.logger = MetricsLogger(
            enabled=rank0, total_steps=c.training.steps, log_freq=c.metrics.log_freq,
            tb_folder=dump / c.metrics.save_tb_folder if c.metrics.enable_tensorboard else None,
            plot_path=dump / "loss.png" if c.metrics.plot_loss else None, history=list(self.history),
        )

    # --- construction ---

    def _build_schedule(self):  # -> a torch.distributed.pipelining schedule
        """One `PipelineStage` per stage module of this rank (`TrainedModel.stages`), and the schedule over them."""
        p = self.config.parallelism
        stages = build_pipeline_stages(self.trained.stages, self.stage_ids, num_stages=self.num_stages,
                                       parallel_dims=self.dims, mesh=self.mesh, device=self.device)
        return build_pipeline_schedule(
            stages, schedule=p.pp_schedule, microbatches=p.pp_microbatches, loss_fn=self._pipeline_loss
        )

    # --- one step ---

    def _shard(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, PackedLayout | None, Tensor | None]:
        """This CP rank's tokens, labels and positions `[batch, local_seq]`, the batch's pack layout, and which of
        the tokens are the batch's (1) and which the pack's padding (0; None: no padding)."""
        if batch.cu_seqlens is not None:
            return self._shard_packed(batch)
        tokens = self.layout.shard(batch.input_ids, 1, self.cp_rank).to(self.device)
        labels = self.layout.shard(batch.labels, 1, self.cp_rank).to(self.device)
        positions = self.layout.position_ids(self.cp_rank, batch.input_ids.shape[1], self.device)
        return tokens, labels, positions.expand(tokens.shape[0], -1).contiguous(), None, None

    def _shard_packed(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, PackedLayout, Tensor]:
        """The micro-batch as one pack of documents, split with balanced attention work."""
        seq = batch.input_ids.shape[1]
        assert batch.cu_seqlens is not None
        cu = [0] + [int(b) + i * seq for i, c in enumerate(batch.cu_seqlens) for b in c.tolist()[1:]]
        real = torch.ones_like(batch.input_ids, dtype=torch.int8)  # 0 on the pack's padding document
        packed = pack_documents([batch.input_ids, batch.labels, real], cu, self.mesh["cp"],
                                pad_values=[0, IGNORE_INDEX, 0], what="the trainer's packed batch", device=self.device)
        tokens, labels, valid = (t.to(self.device) for t in packed.local(self.cp_rank))
        return tokens, labels, packed.position_ids(self.cp_rank, self.device), packed.layout, valid

    def _global_tokens(self, batches: list[Batch]) -> Tensor:
        """Valid labels in this step's global batch (each dp rank counts its full sequences)."""
        count = sum((b.labels != IGNORE_INDEX).sum() for b in batches).to(torch.float32).to(self.device)
        if dist.get_world_size(self.dp_group) > 1:
            all_reduce(count, self.dp_group)
        return count

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 without FSDP (one rank over dp x cp, or pipelining): autocast. With FSDP, FSDP2's
        MixedPrecisionPolicy gathers each unit in bfloat16 and nothing else is cast (as torchtitan)."""
        if self.config.training.mixed_precision == "bfloat16" and not fsdp_applied(self.model):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, tokens: Tensor, labels: Tensor, positions: Tensor,
              valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """This rank's share of the micro-batch loss (fused into the model's head, `training.fused_loss`, or not),
        and of the router loss in it (a family with one, `TrainedModel.router_loss`; else None).

        The router loss is the family's load-balancing loss over every token of the micro-batch on the dp x cp mesh
        (as one process computes it on that batch: its statistics pooled before their product), the pack's padding
        left out (`valid`: one process has none); every real token counts, labelled or not, as in transformers,
        which masks only an attention mask's padding. Per micro-batch, each weighted 1 / grad_accum_steps (a
        product of sums over the whole step cannot be formed before the first backward)."""
        router = self.trained.router_loss
        extra = {} if router is None else {"router_logits": True}
        if not self.config.training.fused_loss:
            out = self.model(tokens, positions, **extra)
            logits, router_logits = out if router is not None else (out, ())
            loss = cp_cross_entropy(logits, labels, mesh=self.loss_mesh, num_tokens=self._num_tokens)
        else:
            def head(hidden: Tensor, weight: Tensor, *, bias: Tensor | None = None,
                     softcap: float | None = None) -> Tensor:  # inside the model's forward: FSDP gathered weight
                return cp_linear_cross_entropy(hidden, weight, labels, mesh=self.loss_mesh,
                                               num_tokens=self._num_tokens,
                                               chunk_tokens=self.config.loss_chunk_tokens(), bias=bias,
                                               softcap=softcap)

            out = self.model(tokens, positions, head=head, **extra)
            loss, router_logits = out if router is not None else (out, ())
        if router is None:
            return loss, None
        share = cp_load_balancing_loss(router_logits, num_experts=router.num_experts, top_k=router.top_k,
                                       mesh=self.loss_mesh, valid=valid) / self.config.training.grad_accum_steps
        return loss + router.coefficient * share, share.detach()

    def _pipeline_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        return cp_cross_entropy(logits, labels, mesh=self.loss_mesh, num_tokens=self._num_tokens)

    def train_step(self) -> float:
        """Forward, backward, reduce, clip, update; returns the global mean loss (with the router loss in it, which
        `self.router_loss` holds alone)."""
        c = self.config
        batches = [next(self.data) for _ in range(c.training.grad_accum_steps)]
        self._num_tokens = self._global_tokens(batches)
        self.optimizer.zero_grad(set_to_none=True)
        local = torch.zeros(2, device=self.device, dtype=torch.float64)  # (the loss, its router loss) shares
        for batch in batches:
            if self.schedule is not None:  # each pipeline microbatch carries its own layout (doc_bounds)
                with self._autocast():
                    local[0] += self._pipeline_step(*self._shard_microbatches(batch))
                continue
            tokens, labels, positions, packed, valid = self._shard(batch)
            with self.trained.cp_scope(packed), self._autocast():  # backward inside too (recompute sees the layout)
                loss, router = self._loss(tokens, labels, positions, valid)
                loss.backward()
                local[0] += loss.detach()
                if router is not None:
                    local[1] += router
        self.grad_norm = clip_grad_norm(
            self.model.parameters(), c.training.max_norm,
            pp_group=self.mesh["pp"].get_group() if self.dims.pp_enabled else None,
            expert_parameters=self.trained.expert_parameters, ep_group=self.trained.ep_group,
        )
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used; the scheduler moves on
        self.optimizer.step()
        self.scheduler.step()
        return self._global_loss(local)

    def _shard_microbatches(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """This CP rank's tokens, labels and positions `[microbatches x rows, local_seq]` for the pipeline, and with
        packed data each microbatch's `doc_bounds` row (`cpcompose.distributed.pipeline_stage`): a pipeline
        microbatch is one pack of its rows' documents, cut by its own layout, so the schedule's split on dim 0
        gives each microbatch its rows and its layout."""
        if batch.cu_seqlens is None:
            return (*self._shard(batch)[:3], None)
        micro = self.config.parallelism.pp_microbatches
        rows = batch.input_ids.shape[0] // micro
        packs = [self._shard_packed(Batch(batch.input_ids[i * rows:(i + 1) * rows],
                                          batch.labels[i * rows:(i + 1) * rows], batch.cu_seqlens[i * rows:(i + 1) * rows]))
                 for i in range(micro)]
        tokens, labels, positions = (torch.cat([pack[k] for pack in packs]) for k in range(3))
        return tokens, labels, positions, microbatch_doc_bounds([pack[3] for pack in packs])

    def _pipeline_step(self, tokens: Tensor, labels: Tensor, positions: Tensor, doc_bounds: Tensor | None) -> Tensor:
        """One schedule step over this rank's stages; returns the sum of the microbatch losses of the last stage
        (0 on ranks without it)."""
        losses: list[Tensor] = []
        args = (tokens,) if 0 in self.stage_ids else ()
        meta = {} if doc_bounds is None else {"doc_bounds": doc_bounds}
        last = self.num_stages - 1 in self.stage_ids
        # return_outputs=False: torch's last stage keeps no microbatch's logits past its backward (by default it keeps
        # every one to the step's end, to return them merged: a 70B pipeline's 28 GiB the trainer never reads)
        self.schedule.step(*args, target=labels if last else None, losses=losses, position_ids=positions,
                           return_outputs=False, **meta)
        return sum((x.detach().double() for x in losses), torch.zeros((), dtype=torch.float64, device=self.device))

    def _global_loss(self, local: Tensor) -> float:
        """Sum the shares (the loss, the router loss) over dp x cp; with PP only the last stage has them, so sum over
        pp too. Returns the loss; `self.router_loss` is set to the router loss (None without one)."""
        all_reduce(local, self.loss_mesh.get_group())
        if self.dims.pp_enabled:
            all_reduce(local, self.mesh["pp"].get_group())
        self.router_loss = None if self.trained.router_loss is None else local[1].item()
        return local[0].item()

    # --- the run ---

    def run(self) -> list[float]:
        """Train to `training.steps`; returns this invocation's losses.

        Raises:
            TrainingError: a non-finite loss, a failed or timed-out peer, a folder in use; one line each.
        """
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with _auto_choices_in_log(self.logger, enabled=self.config.parallelism.cp_strategy == "auto"):
                return self._run()
        except RuntimeError as e:
            cause = is_comm_failure(e) if not isinstance(e, TrainingError) else None
            if cause is None:
                raise
            raise TrainingError(describe_comm_failure(
                cause, rank=dist.get_rank(), step=self.step, timeout_s=self.config.comm.timeout_s,
                laggards=self.progress.laggards(self.step),
            ), kind="consequence") from e
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.lock is not None:
                self.lock.release()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Preemption or Ctrl-C: finish the step, save, exit. A second signal acts as it would have."""
        if self.stop_signal:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.stop_signal = signum

    def _stop_requested(self) -> int:
        """The signal any rank received, agreed on by all ranks so that they stop at the same step."""
        flag = torch.tensor([self.stop_signal], dtype=torch.int64, device=self.device)
        all_reduce(flag, op="max")
        return int(flag.item())

    def _run(self) -> list[float]:
        c = self.config
        losses: list[float] = []
        first = self.step + 1
        tokens_per_step = c.training.batch_size * c.training.seq_len
        saved = None
        while self.step < c.training.steps:
            if (signum := self._stop_requested()) != 0:
                if c.checkpoint.enable and (saved is None or saved.path.name != f"step-{self.step}"):
                    saved = self._save()
                self.logger.note(
                    f"stopped by {signal.Signals(signum).name} after step {self.step}"
                    + (f"; resume with the same command (checkpoint {saved.path})" if saved else
                       "; nothing saved (checkpoint.enable = false)")
                )
                break
            if self.fault is not None:
                self.fault.maybe_fire(dist.get_rank(), self.step + 1)
            self.step += 1
            self.progress.mark(self.step)
            self.meter.reset()
            start = time.perf_counter()
            loss = self.train_step()
            elapsed = time.perf_counter() - start
            if not (math.isfinite(loss) and math.isfinite(self.grad_norm)):
                last = self.checkpoints.newest_on_disk() if c.checkpoint.enable else None
                raise TrainingError(
                    f"step {self.step}: loss = {loss} and gradient norm = {self.grad_norm} (not finite); stopped "
                    "without saving" + (f", the last good checkpoint is {last}" if last else "")
                    + "; lower --optimizer.lr, or check the data and the initial weights"
                )
            losses.append(loss)
            self.history.append((self.step, loss))
            peaks = torch.tensor([peak_memory_mib(self.device)], device=self.device)
            everyone = all_gather_tensors(peaks)
            self.logger.log(
                StepMetrics(
                    step=self.step, loss=loss, lr=self.step_lr, grad_norm=float(self.grad_norm),
                    tokens_per_s=tokens_per_step / elapsed, step_time_s=elapsed,
                    peak_memory_mib=[float(x) for x in everyone], cp_bytes_sent=self.meter.total,
                    cp_strategies=dict(self.meter.strategies), cp_predicted_s=self.meter.predicted_s,
                    router_loss=self.router_loss,
                ),
                first_step=first,
            )
            if c.checkpoint.enable and self.checkpoints.due(self.step, last_step=c.training.steps):
                saved = self._save()
        if not losses and self.step >= c.training.steps:
            self.logger.note(
                f"nothing to train: the checkpoint is already at step {self.step} of training.steps = "
                f"{c.training.steps}; raise --training.steps, or start fresh in another --job.dump_folder"
            )
        if (folder := export_folder(c)) is not None:
            self._export_hf(folder)
        self.logger.close(title=f"{c.job.name}: loss", checkpoint=saved.path if saved else None)
        return losses

    def _export_hf(self, folder: Path) -> None:
        """`checkpoint.export_hf`: the model as a Hugging Face folder, once training.steps is reached."""
        if self.step < self.config.training.steps:
            self.logger.note(f"not exported to {folder}: stopped at step {self.step} of {self.config.training.steps}")
            return
        assert self.trained.export is not None  # the resolution step allows export_hf only for families that export
        start = time.perf_counter()
        self.trained.export(folder)
        if dist.get_rank() == 0:
            mark_export(folder, self.config)
        self.logger.note(f"exported the model at step {self.step} to {folder} (Hugging Face format: "
                         f"from_pretrained loads it; {time.perf_counter() - start:.1f} s)")

    def _save(self):  # -> SavedCheckpoint
        saved = self.checkpoints.save(self.step, self.model, self.optimizer, self._trainer_state())
        self.logger.note(f"saved checkpoint {saved.path.name} ({saved.bytes / 2**20:,.1f} MiB, {saved.seconds:.1f} s)")
        return saved

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": torch.get_rng_state(),
            "loss_history": list(self.history),
        }

    # --- the dump folder: one job at a time, checkpoints of this run only ---

    def _claim_folder(self) -> None:
        """Lock the folder, refuse another run's checkpoints, clean stale saves, resume the newest intact.

        Rank 0 decides from the file system and tells the others, so every rank
        raises the same error or loads the same checkpoint.
        """
        c = self.config
        decision: dict = {"error": None, "resume": None, "notes": []}
        if dist.get_rank() == 0:
            try:
                decision = self._decide_resume()
            except (FolderLocked, TrainingError) as e:
                decision = {"error": str(e), "resume": None, "notes": []}
            except OSError as e:
                decision = {"error": f"job.dump_folder {c.job.dump_folder}: cannot write there ({e})",
                            "resume": None, "notes": []}
        decision = broadcast_object(decision, src=0)
        if decision["error"] is not None:
            if self.lock is not None:
                self.lock.release()
            raise TrainingError(decision["error"], exit_code=2)
        if dist.get_rank() == 0:
            for line in decision["notes"]:
                print(f"{stamp()} {line}", flush=True)
        self.progress = Progress(_compat.default_store(), dist.get_rank(), dist.get_world_size())
        if decision["resume"] is not None:
            try:
                self._restore(Path(decision["resume"]))
            except Exception:
                if self.lock is not None:
                    self.lock.release()
                raise

    def _decide_resume(self) -> dict:
        """Rank 0: take the lock, then choose what to resume (or refuse)."""
        assert self.lock is not None
        self.lock.acquire()
        c = self.config.checkpoint
        path, notes = self.checkpoints.choose_resume(enable=c.enable, resume=c.resume)
        if path is None:  # say it: a restart that silently began at step 0 looked like a lost run
            notes.append(f"starting fresh at step 0: no checkpoint in {self.checkpoints.folder}" if c.enable else
                         "starting fresh at step 0 (checkpoint.enable = false: this run saves nothing)")
        return {"error": None, "resume": None if path is None else str(path), "notes": notes}

    def _restore(self, path: Path) -> None:
        state = self.checkpoints.load(path, self.model, self.optimizer)
        self.step = state["step"]
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"])
        self.history = [tuple(x) for x in state.get("loss_history", [])]
        if dist.get_rank() == 0:
            print(f"{stamp()} resumed from {path} at step {self.step}", flush=True)
