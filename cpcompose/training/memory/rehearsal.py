"""A training step at full size on fake tensors: torch's own memory tracker against the memory plan.

torchtitan's method: a fake process group (any world size, no communication) and FakeTensorMode (shapes and
dtypes, no storage) run one real step of the trainer's model (FSDP2, CP attention, the fused loss, AdamW) on
this machine, and torch's `FSDPMemTracker` counts every tensor the step holds, by kind. Two steps run; the
second (the optimizer's state exists) is measured. The tracker counts tensors only: compare it with the plan
less its process and allocator-slack parts.

What cannot run on fake tensors is routed around for the rehearsal only (the training path runs as it is): here,
- the mesh is built without `ParallelDims.build_mesh`'s timeouts (the fake group has no backend options), and so
  is the experts' mesh under `parallelism.ep`, before the fake mode (`build_expert_mesh` returns it);
- a Hugging Face model is built from its config.json alone (no weights read), its non-persistent buffers left
  unset (their initialisation reads them back); transformers' default MoE path (grouped_mm) runs on fake
  tensors as it is;
- torch.compile and the exactness probe (`parallelism.cp_verify`) are off;
- the tracker gets statistics for the output layer, whose forward the fused loss never calls (it reads the
  weight), so the tracker's backward hook finds them;
and in the library: the step runs inside `cpcompose.comm.rehearsal_mode()`, where the functions that read values
on the host take their no-sync forms (every cross-rank agreement assumed, a rank's own error still raised),
checkpoint offload behaves as on a GPU (below) and the tiled MLP cuts detached tiles (the tracker's module hooks
would take the tiles its forward cuts without autograd for autograd inputs); `comm.rehearsing` lists each.
One process, rank 0 of the fake group: it must be the only process group of the interpreter (a fresh one).

The step runs on the CPU, where host and device are one memory; what a GPU run keeps in host memory is taken out
of the measured peak as the GPU would: checkpointed block inputs (`activation_checkpoint.offload`) leave when saved
and come back as new tensors at the recompute; with `training.offload_params` the tracker's sharded parameters,
sharded gradients and optimizer state are not counted, and neither is the optimizer step (it runs on the host).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cpcompose import _compat
from cpcompose.comm import rehearsal_mode
from cpcompose.config import JobConfig
from cpcompose.distributed import ParallelDims, flat_mesh
from cpcompose.distributed.parallel_dims import EXPERT_MESH_DIM_NAMES, MESH_DIM_NAMES
from cpcompose.parallel import cp_cross_entropy, cp_linear_cross_entropy
from cpcompose.training.families import family_of
from cpcompose.training.resolve import resolve_config
from cpcompose.training.memory.plan import GiB, plan_memory
from cpcompose.training.memory.rehearsal_pipeline import pipeline_steps

__all__ = ["Rehearsal", "describe_rehearsal", "rehearse"]

HOST_KINDS = ("Sharded Param", "Sharded Grad", "OptState")
"""The tracker's kinds that FSDP2's CPUOffloadPolicy keeps in host memory."""


@dataclass(frozen=True)
class Rehearsal:
    """The tracker's peak of the measured step and the plan's tensors, bytes."""

    tracked: int
    """FSDPMemTracker's peak total over the second step."""
    by_kind: dict[str, int]
    """The tracker's parts at that peak (sharded/unsharded parameters, activations, temporaries, ...)."""
    planned: int | None
    """The plan (`device_type="cuda"`) less the process and the allocator slack: the tensors it predicts; None
    where the plan cannot count the model (`unplanned` says why)."""
    unplanned: str | None = None
    """Why the plan has no figure (a family without a memory profile), else None."""
    pp_rank: int | None = None
    """With pipelining, the pipeline rank rehearsed (its stages, in its schedule's order), and the plan is that
    rank's; None without."""

    @property
    def ratio(self) -> float | None:
        """planned / tracked (None without a plan)."""
        return None if self.planned is None else self.planned / max(1, self.tracked)


def _device_peak_tracker(tracker_cls: type, offload_params: bool) -> type:
    """`tracker_cls` that also keeps the peak of what a GPU would hold: with `offload_params`, less HOST_KINDS and
    outside the optimizer step (on the host)."""

    class DevicePeak(tracker_cls):  # type: ignore[misc, valid-type]
        device_peak = 0
        device_parts: dict[str, int] = {}

        def _update_peak_stats(self, peak_state) -> None:  # noqa: ANN001 (torch's private hook, after every op)
            super()._update_peak_stats(peak_state)
            if offload_params and self._in_opt:
                return
            for snap in self._curr_mem_snap.values():
                parts = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
                total = parts.pop("Total")
                if offload_params:
                    total -= sum(parts.pop(k, 0) for k in HOST_KINDS)
                if total > self.device_peak:
                    self.device_peak, self.device_parts = total, parts

    return DevicePeak


def rehearse(config: JobConfig, world: int, *, pp_rank: int | None = None) -> Rehearsal:
    """Run two steps of `config` on `world` fake ranks and track the second.

    With pipelining (`parallelism.pp > 1`) this process is the first rank of pipeline rank `pp_rank` (default: the
    one the plan's peak is on), whose stages run in its schedule's order (`rehearsal_pipeline`); else rank 0.

    Raises:
        ValueError: pipelining with a model family whose stages the rehearsal cannot cut yet.
        ConfigError: a Hugging Face folder whose config.json the trainer refuses.
    """
    config = resolve_config(config)  # a config straight from load_config too: a model folder's vocabulary counts
    c = dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False),
                            parallelism=dataclasses.replace(config.parallelism, cp_verify=False))
    pp = c.parallelism.pp
    if pp_rank is not None and not 0 <= pp_rank < pp:
        raise ValueError(f"rehearse: pp_rank {pp_rank} is not a pipeline rank of parallelism.pp = {pp}")
    if pp > 1 and pp_rank is None:
        pp_rank = plan_memory(config, world, device_type="cuda").pp_rank
    fake_mode, fake_store, tracker_cls, mod_stats = _compat.fake_rehearsal_tools()
    # the mesh's first dimension is pp: this rank's pipeline coordinate is pp_rank
    dist.init_process_group("fake", store=fake_store(), rank=(pp_rank or 0) * (world // pp), world_size=world)
    try:
        dims = ParallelDims.from_config(c.parallelism, world)
        mesh = init_device_mesh("cpu", tuple(getattr(dims, n) for n in MESH_DIM_NAMES), mesh_dim_names=MESH_DIM_NAMES)
        for name in ("dp_shard_cp", "dp_cp", "dp"):  # flattened before the fake mode (it makes groups from values)
            flat_mesh(mesh, name)
        dims = _with_expert_mesh(dims, mesh)
        if not _fsdp_tracked(c, dims):  # no FSDP on one rank over dp x cp: torch's tracker of a plain model
            tracker_cls = _compat.plain_mem_tracker()
        tracker_cls = _device_peak_tracker(tracker_cls, c.training.offload_params)
        with rehearsal_mode(), _compat.grouped_mm_of_any_dtype_on_fake_tensors(), fake_mode(allow_non_fake_inputs=True):
            if pp > 1:
                tracked, by_kind = pipeline_steps(c, dims, mesh, tracker_cls, mod_stats, pp_rank)
            else:
                tracked, by_kind = _two_steps(c, dims, mesh, tracker_cls, mod_stats)
    finally:
        dist.destroy_process_group()
    try:
        plan = plan_memory(config, world, device_type="cuda", pp_rank=pp_rank)
    except ValueError as e:  # a family the plan cannot count: the tracker alone, and why
        return Rehearsal(tracked=tracked, by_kind=by_kind, planned=None, unplanned=str(e), pp_rank=pp_rank)
    planned = plan.total - plan.part("process") - plan.part("allocator slack")
    return Rehearsal(tracked=tracked, by_kind=by_kind, planned=planned, pp_rank=pp_rank)


def _fsdp_tracked(c: JobConfig, dims: ParallelDims) -> bool:
    """Whether the rehearsed model is FSDP2's and FSDPMemTracker tracks it: more than one rank over dp x cp, or one
    with `training.offload_params` (FSDP2 over that rank, `fsdp_wanted`), whose shards, their gradients and AdamW's
    state the tracker then names (HOST_KINDS) so they leave the device's peak. Tensor parallelism alone is FSDP2's
    over one rank too, but keeps the plain tracker (and the plan its autocast)."""
    return dims.dp_cp_size > 1 or c.training.offload_params


def _with_expert_mesh(dims: ParallelDims, mesh) -> ParallelDims:  # noqa: ANN001
    """`dims` whose `build_expert_mesh` returns the experts' mesh made now, before the fake mode (unflattening makes
    groups from values) and without the world's timeouts (the fake group has none); `dims` itself without EP."""
    if not dims.ep_enabled:
        return dims
    experts = _compat.unflatten_mesh(flat_mesh(mesh, "dp_cp"), "dp_cp", (dims.dp_replicate, dims.efsdp_size, dims.ep),
                                     EXPERT_MESH_DIM_NAMES)

    class Rehearsed(type(dims)):  # type: ignore[misc, valid-type]
        def build_expert_mesh(self, mesh: object) -> object:  # noqa: ARG002 (the root mesh it was made from)
            return experts

    return Rehearsed(**{f.name: getattr(dims, f.name) for f in dataclasses.fields(dims) if f.init})


def _two_steps(c: JobConfig, dims: ParallelDims, mesh, tracker_cls, mod_stats) -> tuple[int, dict[str, int]]:  # noqa: ANN001
    trained = family_of(c).build_unfilled(c, dims=dims, mesh=mesh)
    model = trained.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.optimizer.lr, betas=c.optimizer.betas,
                                  weight_decay=c.optimizer.weight_decay, eps=c.optimizer.eps, fused=True)
    rows, T = c.training.batch_size // (dims.dp_size * c.training.grad_accum_steps), c.training.seq_len // dims.cp
    # the loss's weight: a Hugging Face model's output embeddings, the Llama's `output`
    output = (model.get_output_embeddings() if hasattr(model, "get_output_embeddings")
              else getattr(model, "output", None))
    vocab = output.weight.shape[0] if output is not None else c.model.vocab_size
    tokens = torch.randint(0, vocab, (rows, T))
    labels = torch.randint(0, vocab, (rows, T))
    positions = torch.arange(T).expand(rows, T)
    loss_mesh, count = flat_mesh(mesh, "dp_cp"), torch.tensor(float(rows * T * dims.dp_cp_size))

    def head(hidden: torch.Tensor, weight: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return cp_linear_cross_entropy(hidden, weight, labels, mesh=loss_mesh, num_tokens=count,
                                       chunk_tokens=c.loss_chunk_tokens())

    output_name = next((name for name, m in model.named_modules() if m is output), "output")
    if _fsdp_tracked(c, dims):
        tracker = tracker_cls(model, optimizer)
    else:
        tracker = tracker_cls()
        tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):
            if output is not None:  # the fused loss reads its weight without calling it: stats for its backward
                tracker.memory_tracking[output] = mod_stats(output_name)
            for _ in range(c.training.grad_accum_steps):
                with trained.cp_scope(None):
                    if c.training.fused_loss:
                        loss = model(tokens, positions, head=head)
                    else:
                        loss = cp_cross_entropy(model(tokens, positions), labels, mesh=loss_mesh, num_tokens=count)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 0:
                tracker.reset_mod_stats()
                tracker.device_peak, tracker.device_parts = 0, {}
    return tracker.device_peak, tracker.device_parts


def describe_rehearsal(result: Rehearsal, world: int) -> list[str]:
    """The dry run's and cpcompose-rehearse's lines: the tracker's peak and parts, and the plan's tensors beside
    it (or why the plan has none)."""
    where = "" if result.pp_rank is None else f", pipeline rank {result.pp_rank}'s stages in its schedule's order"
    lines = [f"  rehearsal on {world} fake ranks{where}: torch's FSDPMemTracker peak {result.tracked / GiB:.3f} GiB"]
    lines += [f"    {kind:<26} {nbytes / GiB:8.3f} GiB" for kind, nbytes in result.by_kind.items() if nbytes]
    if result.planned is None:
        lines.append(f"  memory plan (tensors): not predicted ({result.unplanned})")
    else:
        lines.append(f"  memory plan (tensors, less process and slack) {result.planned / GiB:.3f} GiB "
                     f"({result.ratio - 1:+.1%} of the tracker)")
    return lines
