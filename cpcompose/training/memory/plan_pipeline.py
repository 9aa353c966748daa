"""The memory plan of one pipeline rank: its stages' own peak, moment by moment through its schedule's order.

A pipeline rank holds several microbatches at once, and how many depends on the schedule and the rank: the plan
replays the rank's order from torch's schedule (`schedule.occupancy`) and adds up, at every compute action, what the
rank holds then (P: the rank's parameters, over its stages; T: tokens per microbatch on this rank):

* the float32 shards and AdamW's moments (P / S each, S = dp_shard x cp), as without pipelining;
* FSDP2 under a pipeline schedule (torch's stage sets no gradient sync and no reshard): every unit stays gathered
  once it has run (c P, the compute dtype), and each unit's gradients accumulate unsharded in float32 from its
  first backward to the schedule's end (4 P), where they are reduce-scattered; a block's backward makes its own
  gradients in the compute dtype beside them (c x one block);
* activations: per stage, the microbatches in flight (forwarded, backward not finished) times what its blocks keep
  per microbatch (all they save, or their inputs with checkpointing); the last stage's also the loss's float32
  log-softmax (4 V per token) until its backward;
* a zero-bubble schedule's microbatches between their input backward ("I") and weight backward ("W"): the output
  gradients of every weight-using op (`MemoryProfile.split_backward`), and with checkpointing the whole recompute
  (torch's input part retains the graph, recomputed tensors included, for the weight part);
* the pipeline's buffers, which torch's stage makes once and keeps: one input buffer per microbatch on each stage
  but the first, one output-gradient buffer per microbatch on each stage but the last (c D per token each); the
  last stage's logits of each microbatch from its forward until its backward ("B" or "I"; the trainer's
  `schedule.step(..., return_outputs=False)` keeps none to the step's end); after a zero-bubble input backward
  ("I"), the input's gradient, kept to the step's end;
* the work of the action running: a block's forward (or its loss's, on the last stage: under bf16 the logits' float32
  copy), or its backward (on the last stage first the loss's backward, 8 V per token beside the saved log-softmax),
  with CP's K/V buffers beside attention as without pipelining.

The peak is the largest moment's total; the gradient reduction at the schedule's end and the optimizer step are
phases of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpcompose.models.spec import MemoryProfile
from cpcompose.training.memory.schedule import occupancy

__all__ = ["PipelineRank", "pipeline_phases"]


@dataclass(frozen=True)
class PipelineRank:
    """What the plan needs of one pipeline rank and its step."""

    schedule: str
    pp: int
    per_rank: int
    """Stages per rank (the V-shaped schedules: 2)."""
    microbatches: int
    pp_rank: int
    shards: int
    """FSDP's shard degree (1: no FSDP)."""
    c: int
    """Bytes of the compute dtype (the gathered units, the hidden states between stages)."""
    logits: int
    """Bytes of one logit the last stage returns."""
    keep: float
    """What one block keeps per token for its backward (its input with checkpointing)."""
    recomputed: float
    """With checkpointing, what a block's recompute saves beyond its input, per token: a split backward's input part
    ("I") recomputes it and keeps it (its graph retained) until the weight part ("W"); 0 without checkpointing."""
    tokens: int
    """T: tokens per microbatch on this rank."""


def pipeline_phases(r: PipelineRank, prof: MemoryProfile, *, forward_work: int, backward_work: int,
                    dim: int, base: dict[str, int], slack: float) -> dict[str, dict[str, int]]:
    """Every phase's parts for pipeline rank `r.pp_rank`: "forward" and "backward" (the largest moment of each kind
    over its order; "loss" where the last stage's loss is the work), "gradient reduction", "optimizer step".

    `forward_work` / `backward_work`: one block's work beside the activations (with CP's buffers), bytes;
    `base`: the process and whatever every phase holds besides (bytes by part); `slack`: the allocator's share of
    the per-token tensors (CUDA's caching allocator).
    """
    occ = occupancy(r.schedule, r.pp, r.per_rank, r.microbatches, r.pp_rank)
    n = r.pp * r.per_rank
    T, V, fsdp = r.tokens, prof.vocab, r.shards > 1
    per_stage = prof.layers // n
    body = prof.body_params * per_stage // prof.layers
    embedding = prof.root_params - prof.output_params
    params = {s: body + (embedding if s == 0 else 0) + (prof.output_params if s == n - 1 else 0) for s in occ.stages}
    P = sum(params.values())
    last = n - 1 if n - 1 in occ.stages else None
    state = 4 * P // r.shards
    fixed = {**base, "parameters": state, "optimizer state": 2 * state}
    per_mb = {s: int(r.keep * T * per_stage) + (int((prof.head_saved + 4 * V) * T) if s == last else 0)
              for s in occ.stages}
    # the last stage's also the logits' gradient (the output layer's weight gradient needs it) and the final norm's
    split_mb = {s: int((prof.split_backward + r.recomputed) * T * per_stage) + ((r.logits * V + r.c * dim) * T if s == last else 0)
                for s in occ.stages}
    recv = r.microbatches * r.c * dim * T * sum((s != 0) + (s != n - 1) for s in occ.stages)
    gathered = r.c * P if fsdp else 0
    block_grads = r.c * prof.block_params if fsdp else 0
    loss_forward = 4 * V * T if r.logits == 2 else 0  # the logits' float32 copy, beside the saved log-softmax
    loss_backward = 8 * V * T  # the log-softmax's gradient and the logits', beside the saved log-softmax

    def moment(m) -> dict[str, int]:  # noqa: ANN001
        i = {s: k for k, s in enumerate(occ.stages)}
        # a split backward's microbatches between "I" and "W" also keep their weight-using ops' output gradients
        split = sum(max(0, m.inputs[i[s]] - m.backwards[i[s]]) * split_mb[s]
                    for s in occ.stages if s != 0)  # the first stage's "I" does nothing
        acts = sum(m.in_flight[i[s]] * per_mb[s] for s in occ.stages) + split
        grads = 4 * sum(params[s] for s in occ.stages if m.backwards[i[s]])  # from a stage's first backward on
        buffers = recv + (r.logits * V * T * m.outputs[i[last]] if last is not None else 0) + \
            r.c * dim * T * sum(m.inputs[i[s]] for s in occ.stages if s != 0)
        if m.kind == "F":
            work = max(forward_work, loss_forward if m.stage == last else 0)
            reducing = 0
        else:
            work = max(backward_work, loss_backward if m.stage == last and m.kind in "BI" else 0)
            reducing = block_grads
        return {**fixed, "gradients": grads if not fsdp else 0, "gathered parameters": gathered,
                "gathered gradients": (grads if fsdp else 0) + reducing, "activations": acts,
                "one block in flight": work, "pipeline buffers": buffers,
                "allocator slack": int(slack * (acts + work + buffers))}

    moments = [(m, moment(m)) for m in occ.moments]
    phases: dict[str, dict[str, int]] = {}
    for name, kinds in (("forward", "F"), ("backward", "BIW")):
        chosen = [parts for m, parts in moments if m.kind in kinds]
        if chosen:
            phases[name] = max(chosen, key=lambda parts: sum(parts.values()))
    end = recv + r.c * dim * T * sum(m.inputs[k] for m in occ.moments[-1:] for k, s in enumerate(occ.stages) if s != 0)
    unit = max(prof.block_params, embedding if 0 in occ.stages else 0,
               prof.output_params if last is not None else 0)
    phases["gradient reduction"] = {  # the accumulated gradients reduce-scattered, unit by unit
        **fixed, "gradients": 0 if fsdp else 4 * P, "gathered parameters": gathered,
        "gathered gradients": 4 * P + 4 * unit + state if fsdp else 0, "activations": 0, "one block in flight": 0,
        "pipeline buffers": end, "allocator slack": int(slack * end)}
    phases["optimizer step"] = {**fixed, "gradients": state, "gathered parameters": 0, "gathered gradients": 0,
                                "activations": 0, "one block in flight": 0, "pipeline buffers": recv,
                                "allocator slack": int(slack * recv)}
    return phases
