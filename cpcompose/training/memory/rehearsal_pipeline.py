"""A pipelined step rehearsed on fake tensors: one pipeline rank's stages, run in its schedule's order.

Under the fake process group no activation or gradient really travels between pipeline ranks, so the rehearsal runs
one rank's own work alone, in the order torch's schedule gives that rank (`schedule.schedule_order`, the same order
the plan counts from), doing for each action what torch's `PipelineStage` does:

- the rank's stages are built as the trainer builds them (the family's `build_unfilled(stages=..., num_stages=...)`:
  each stage module what a `PipelineStage` runs, CP, TP, checkpointing, FSDP2 with each stage its own root, no unit
  resharded between microbatches);
- a stage that is not the first receives its input into one buffer per microbatch, made at the step's start and
  kept (torch makes them once), fed here as fake hidden states of the stage's input shape; a stage that is not the
  last receives its output's gradient into one buffer per microbatch likewise;
- forward ("F"): the stage on the microbatch's input; the last stage computes the loss on its logits and keeps them
  until the microbatch's backward ("B" or "I": torch's `fwd_cache`), not past it (the trainer's
  `schedule.step(..., return_outputs=False)`: torch's `output_chunks` stays empty);
- backward: torch's own `stage_backward` ("B"), or for a zero-bubble schedule its `stage_backward_input` ("I", which
  keeps the autograd graph) then `stage_backward_weight` ("W"), with FSDP2 told what torch's stage tells it (no
  gradient sync, no reshard: gradients accumulate unsharded in float32 until the end);
- the end ("REDUCE_GRAD"): FSDP2's post-backward on every stage (the reduce-scatters), then AdamW over all stages.

What it approximates: the rank's communication buffers in flight (a send or receive being waited on) are not
counted beyond the persistent ones above; which rank is rehearsed is chosen by the caller (`pp_rank`), and other
ranks hold other amounts (the plan's peak is the largest over the ranks, its per-rank figure is what compares).
"""

from __future__ import annotations

from collections.abc import Callable

import gc

import torch
from torch import nn

from cpcompose import _compat
from cpcompose.config import JobConfig
from cpcompose.distributed import ParallelDims, flat_mesh
from cpcompose.distributed.pipeline import stage_ids, stages_per_rank
from cpcompose.parallel import cp_cross_entropy
from cpcompose.training.families import TrainedModel, family_of
from cpcompose.training.memory.schedule import schedule_order
from cpcompose.training.mixed_precision import compute_dtype

__all__ = ["pipeline_steps"]

_TRACE: list | None = None  # a list: each action's tracked parts after it ran, for the second step (diagnosis)


def _stages(c: JobConfig, dims: ParallelDims, mesh, pp_rank: int) -> tuple[tuple[int, ...], int, TrainedModel]:  # noqa: ANN001
    """The rank's stage ids, the stage count, and the rank's stages built as the trainer builds them (the family's
    `build_unfilled`: each stage module what a `PipelineStage` runs, its own FSDP2 root)."""
    p = c.parallelism
    if family_of(c).reads_folder:  # its stages' hidden width and buffers are the folder's: not fed here yet
        raise ValueError(f"rehearse: model.name = {c.model.name!r} under parallelism.pp > 1 is not rehearsed yet "
                         "(the own Llama is); rehearse it with parallelism.pp = 1")
    per_rank = stages_per_rank(p, c.model.n_layers)
    ids = stage_ids(p.pp_schedule, p.pp, pp_rank, per_rank)
    trained = family_of(c).build_unfilled(c, dims=dims, mesh=mesh, stages=ids, num_stages=p.pp * per_rank)
    if len(trained.stages) != len(ids):
        raise ValueError(f"rehearse: model.name = {c.model.name!r} builds no pipeline stages; use parallelism.pp = 1")
    return ids, p.pp * per_rank, trained


def pipeline_steps(c: JobConfig, dims: ParallelDims, mesh, tracker_cls, mod_stats, pp_rank: int  # noqa: ANN001, ARG001
                   ) -> tuple[int, dict[str, int]]:
    """Two steps of pipeline rank `pp_rank`'s stages in its schedule's order, the second tracked: (peak, parts)."""
    p, t = c.parallelism, c.training
    ids, num_stages, trained = _stages(c, dims, mesh, pp_rank)
    modules = dict(zip(ids, trained.stages, strict=True))
    optimizer = torch.optim.AdamW(trained.module.parameters(), lr=c.optimizer.lr, betas=c.optimizer.betas,
                                  weight_decay=c.optimizer.weight_decay, eps=c.optimizer.eps, fused=True)
    micro = p.pp_microbatches
    rows = t.batch_size // (dims.dp_size * t.grad_accum_steps) // micro  # sequences per microbatch
    T = t.seq_len // dims.cp
    fsdp = dims.dp_cp_size > 1
    hidden_dtype = compute_dtype(c) if fsdp and t.mixed_precision == "bfloat16" else torch.float32
    tokens = torch.randint(0, c.model.vocab_size, (rows, T))
    labels = torch.randint(0, c.model.vocab_size, (rows, T))
    positions = torch.arange(T).expand(rows, T)
    loss_mesh, count = flat_mesh(mesh, "dp_cp"), torch.tensor(float(t.batch_size * t.seq_len))
    order = schedule_order(p.pp_schedule, p.pp, num_stages // p.pp, micro)[pp_rank]
    backward, backward_input, backward_weight = _compat.pipeline_stage_backward()
    roots = [m for m in modules.values() if fsdp]
    tracker = tracker_cls(roots[0], optimizer) if fsdp else tracker_cls()
    if fsdp:
        _compat.track_several_roots(tracker, list(modules.values()))
    else:
        tracker.track_external(*modules.values(), optimizer)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if t.mixed_precision == "bfloat16" and not fsdp else None

    def buffers(make: Callable[[], torch.Tensor], where: Callable[[int], bool]) -> dict[int, list[torch.Tensor]]:
        return {s: [make() for _ in range(micro)] for s in ids if where(s)}

    with tracker:
        # torch's recv buffers, made once when the schedule first runs: inputs of every stage but the first,
        # output gradients of every stage but the last
        inputs = buffers(lambda: torch.empty(rows, T, c.model.dim, dtype=hidden_dtype), lambda s: s != 0)
        grads = buffers(lambda: torch.empty(rows, T, c.model.dim, dtype=hidden_dtype), lambda s: s != num_stages - 1)
        for step in range(2):
            for buffer in (b for bs in inputs.values() for b in bs):
                buffer.grad = None  # torch's clear_runtime_states at each step's start
            cache: dict[tuple[int, int], tuple] = {}
            logits: dict[int, torch.Tensor] = {}  # the last stage's outputs, in torch's fwd_cache until the backward
            split: dict[tuple[int, int], tuple] = {}
            for kind, s, mb in order:
                module = modules[s]
                if kind == "F":
                    x = tokens if s == 0 else inputs[s][mb].requires_grad_(True)
                    with autocast or _nothing():
                        # the module sees a view of the received leaf: torch's tracker hooks a module's inputs with
                        # a multi-grad hook, which fails on a leaf under the split backward's autograd.grad (the
                        # training path has no tracker); the view holds no memory of its own
                        out = module(x if s == 0 else x.view_as(x), positions)
                        if s == num_stages - 1:
                            logits[mb] = out
                            out = cp_cross_entropy(out, labels, mesh=loss_mesh, num_tokens=count)
                    # torch keeps a stage's outputs as a tuple, the last stage's loss alone
                    cache[s, mb] = (out if s == num_stages - 1 else (out,), [x] if s != 0 else [])
                    if _TRACE is not None and step == 1:
                        _TRACE.append((kind, s, mb, _snapshot(tracker)))
                    continue
                if fsdp and kind != "W":
                    _no_sync(module)
                if kind == "B":
                    out, xs = cache.pop((s, mb))
                    backward(out, None if s == num_stages - 1 else (grads[s][mb],), xs)
                    if s == num_stages - 1:  # torch's stage drops its fwd_cache entry once the backward ran
                        del logits[mb]
                elif kind == "I":
                    out, xs = cache.pop((s, mb))
                    out_grads = None if s == num_stages - 1 else (grads[s][mb],)
                    groups = None
                    if s != 0:  # torch's stage leaves the first stage's whole backward to "W"
                        _, groups = backward_input((out,) if s == num_stages - 1 else out, out_grads, xs,
                                                   module.parameters())
                    split[s, mb] = (out, out_grads, xs, groups)
                    if s == num_stages - 1:
                        del logits[mb]
                else:  # "W"
                    out, out_grads, xs, groups = split.pop((s, mb))
                    if fsdp:
                        _no_sync(module)
                    if s != 0:
                        backward_weight(module.parameters(), groups)
                    else:
                        backward(out, out_grads, xs)
                    del out, out_grads, xs, groups
                    _release_graph()
                if _TRACE is not None and step == 1:
                    _TRACE.append((kind, s, mb, _snapshot(tracker)))
            for module in roots:  # REDUCE_GRAD
                _compat.pipeline_reduce_grad(module)
            del cache, split, logits
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 0:
                tracker.reset_mod_stats()
                tracker.device_peak, tracker.device_parts = 0, {}
    return tracker.device_peak, tracker.device_parts


def _snapshot(tracker) -> dict[str, int]:  # noqa: ANN001
    """The tracker's parts now, and "Peak": its device peak so far this step (the action that raised it holds it)."""
    parts = {str(getattr(k, "value", k)): int(v) for snap in tracker._curr_mem_snap.values() for k, v in snap.items()}
    return {**parts, "Peak": int(tracker.device_peak)}


def _release_graph() -> int:
    """Free what a real run frees when a weight backward ("W") ends; returns the collector's passes.

    A split backward never runs the input-only part of a microbatch's graph (attention, activations, norms) with
    `retain_graph=False`, so their saved tensors go when the graph's nodes do. In a real run that is at the end of
    "W", by reference counting (measured on 2 and 4 gloo ranks with Python's collector off: the heap back to its
    step-start value after every microbatch's "W"). Under torch's tracker each module input's node is in a
    reference cycle with the multi-grad hook `ModTracker` puts on it (the hook's closure holds the node: torch's
    `register_multi_grad_hook`), and the collector can free a C++ node only once nothing but its Python object owns
    it: one pass frees one module's boundary, the next the one before, and so on (21 to 23 passes after a 3-layer
    stage's "W"). One pass after each "W" left most of a multi-layer stage's graph held, carried to the next step
    (the 70B ZBV rehearsal: the tracker 2.2 times the plan; collected to a fixed point, +0.2%). So: collect until a
    pass frees nothing (docs/trainer/memory.md, "The zero-bubble split backward: what a real run holds")."""
    passes = 1
    while gc.collect():
        passes += 1
    return passes


def _no_sync(module: nn.Module) -> None:
    """What torch's stage tells an FSDP2 root before each microbatch's backward: accumulate, do not reduce."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)


class _nothing:  # noqa: N801 (a null context, cheaper than contextlib's per microbatch)
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None
