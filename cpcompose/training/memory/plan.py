"""The memory plan: each rank's peak memory, by part, predicted from the config before any rank starts.

A step passes through phases; the peak is the largest of them (T: tokens per rank per forward,
L: blocks on this rank's pipeline stage, S: FSDP's shard degree dp_shard x cp when FSDP is on):

* every phase: the process itself (interpreter, torch, communication buffers: measured on this machine by
  a fresh interpreter, `cpcompose.training.memory.footprint`), the float32 parameters and two AdamW moments, sharded
  S ways; gradients too once they exist (backward, the step; with gradient accumulation, always).
* with expert parallelism (`parallelism.ep`): each rank holds E / ep of every MoE layer's experts, each
  experts module a unit of its own sharded over efsdp = S / ep (the same shard bytes as S ways over E); a
  gathered block holds its dense weights and E / ep experts; the MoE layer's work adds the dispatch's rows in
  transit (`MemoryProfile.dispatch`), with every rank receiving its even share of the routed rows.
* forward and backward also hold FSDP's gathered units, in the compute dtype (bf16 under FSDP2's mixed
  precision): the embedding while it runs, two blocks (the one running and the one prefetched), the final norm
  with the output layer from the loss into the backward; and each unit's gradient while it is reduced (made in
  the compute dtype, cast to float32, copied into the reduce-scatter's input: a block's "block end", beside no
  work; while a block works, the previous block's reduce-scatter input and its own growing gradients). The
  backward ends with the embedding gathered and its gradient reduced, every other gradient shard already made
  ("embedding backward": the peak where parameters dominate). The backward's last block works beside every other
  gradient shard ("last block backward": the peak of a MoE model at few tokens per rank). Without FSDP, bfloat16
  is autocast, which keeps a bf16 copy of every linear weight until backward ends.
* "loss": the activations every block keeps (all it saves, or its input alone with activation
  checkpointing; offloaded to host memory with `activation_checkpoint.offload` on CUDA), the
  final norm's, and the loss at its peak, forward or backward: unfused, the float32 log-softmax,
  its gradient and the logits' (with pipelining, the stage's logits too, until the microbatch's
  backward); fused (`training.fused_loss`, not under pipelining), one chunk of
  `training.loss_chunk_tokens` tokens' logits, the per-token log-sum-exp and hidden gradient,
  and the output weight's float32 gradient, which its backward sums over the chunks.
* "forward" / "backward": the same activations plus one block's work: its forward, or its
  recompute (checkpointing) and its gradients in flight; attention's received K/V and dK/dV
  buffers (the CP cost model's per-strategy count, `cpcompose.attention.cost.model`); one
  block's gradients being reduced.
* "optimizer step": parameters, gradients and moments; AdamW is fused (torchtitan's default), which updates
  them in place with no per-parameter temporaries (all in host memory with
  `training.offload_params` on CUDA: FSDP2's CPUOffloadPolicy, the step on the CPU).
* on CPU, while the per-token tensors are small enough for glibc's heap (`HEAP_CEILING`), every phase also holds
  what the heap keeps: the most any phase put there, plus holes, resident to the end of the step ("allocator
  slack"). The optimizer step is then often the peak at short lengths, and the per-token growth there is the
  heap's; past the ceiling those tensors are mapped and freed exactly, and the slope is the phases' own.

The model's own figures (bytes per token of each block, parameters per unit) come from its
family's `ModelSpec.memory` (`cpcompose.models.llama.memory` for the Llama). Fits and refusals
are `cpcompose.training.memory.budget`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.call.choose import candidates
from cpcompose.attention.cost import AttentionCall, default_calibration
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.config import JobConfig, cp_options
from cpcompose.distributed import ParallelDims
from cpcompose.distributed.host_offload import host_bytes
from cpcompose.layouts import resolve_layout
from cpcompose.models.spec import MemoryProfile
from cpcompose.training.families import family_of
from cpcompose.training.resolve import resolve_config
from cpcompose.training.memory.footprint import process_bytes
from cpcompose.training.memory.plan_pipeline import PipelineRank, pipeline_phases
from cpcompose.distributed.pipeline import stage_ids, stages_per_rank
from cpcompose.training.memory.schedule import occupancy

__all__ = ["HOST_PARTS", "MemoryPlan", "plan_memory"]

GiB = 2**30

HEAP_CEILING = 32 * 2**20
"""glibc serves smaller allocations from its heap, which keeps freed chunks resident; larger ones are mapped
and unmapped exactly (its default mmap threshold adapts up to this size)."""
CUDA_SLACK = 0.10
"""The caching allocator's fragmentation on CUDA, as a fraction of the activations' and the loss's bytes
(a round figure, not measured here)."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's predicted peak, by part (bytes, at the phase where the sum is largest)."""

    parts: tuple[tuple[str, int], ...]
    """(part, bytes) at the peak phase, in a fixed order; parts of 0 bytes are kept (the table shows them)."""
    phase: str
    """Where the peak falls: "forward", "loss", "backward", "last block backward", "block end" or "embedding
    backward" (FSDP) or "optimizer step"."""
    host_bytes: int
    """What is kept in host memory instead (CUDA): the sum of `host_parts`."""
    tokens: int
    """Tokens per rank per forward (one micro-step's, or one pipeline microbatch's)."""
    phase_totals: tuple[tuple[str, int], ...] = ()
    """Every phase's predicted total, bytes (the peak is the largest)."""
    pp_rank: int | None = None
    """With pipelining, the pipeline rank this plan is (the one with the largest peak, unless asked for one)."""
    in_flight: tuple[tuple[int, int], ...] = ()
    """With pipelining, (stage, the most microbatches it holds at once) for each of the rank's stages."""
    host_parts: tuple[tuple[str, int], ...] = ()
    """(part, bytes) this rank keeps in host memory, in `HOST_PARTS`' order (`_host_parts`); () with pipelining."""

    @property
    def total(self) -> int:
        """The predicted peak, bytes."""
        return sum(b for _, b in self.parts)

    def part(self, name: str) -> int:
        """One part's bytes (0 for a part the plan does not have)."""
        return dict(self.parts).get(name, 0)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def attention_bytes(config: JobConfig, profile: MemoryProfile, *, rows: int, row_len: int, device_type: str) -> int:
    """Peak extra bytes of one CP attention call: the strategy's received K/V and dK/dV buffers (0 without CP).

    `strategy = "auto"` may pick any candidate per call: the largest of theirs.
    """
    p = config.parallelism
    if p.cp == 1:
        return 0
    heads, kv_heads, head_dim = profile.attention
    dtype = "bfloat16" if config.training.mixed_precision == "bfloat16" else "float32"
    call = AttentionCall(batch=rows, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=row_len,
                         layout=resolve_layout(p.cp_layout, p.cp), mask=MaskSpec(causal=True), dtype=dtype,
                         head_chunks=p.cp_head_chunks, ring_tiles=p.cp_ring_tiles)
    chosen = cp_options(p)
    cal = chosen.calibration or default_calibration(device_type)
    options = candidates(p.cp) if chosen.strategy == "auto" else [(chosen.strategy, chosen.alltoall_size)]
    peak = 0
    for name, size in options:
        strategy = STRATEGIES[name]
        a = strategy.block_size(p.cp, size)
        peak = max(peak, max(strategy.cost.memory(call, a, r, cal) for r in range(p.cp)))
    return peak


def plan_memory(config: JobConfig, world: int, *, device_type: str, pp_rank: int | None = None) -> MemoryPlan:
    """Predict one rank's peak memory for `config` on `world` ranks of `device_type` ("cpu" or "cuda"), with
    glibc's own allocator settings on CPU. With pipelining, the pipeline rank whose peak is largest, or `pp_rank`'s
    (each rank's stages through its schedule's order: `plan_pipeline`).

    Raises:
        ValueError: the degrees do not fit `world`, or the model family has no memory profile.
    """
    c = resolve_config(config)  # a config straight from load_config too: a model folder's vocabulary counts
    t, p = c.training, c.parallelism
    dims = ParallelDims.from_config(p, world)
    # bfloat16 with FSDP is FSDP2's mixed precision (bf16 weights, no autocast), else autocast. One rank over dp x cp
    # with offload_params is FSDP2's too (over that rank: `cpcompose.distributed.fsdp.fsdp_wanted`).
    fsdp = dims.dp_cp_size > 1 or t.offload_params
    precision = "bfloat16-params" if t.mixed_precision == "bfloat16" and fsdp else t.mixed_precision
    prof = family_of(c).memory_profile(c, tp=dims.tp, precision=precision, mlp_tiles=t.tiled_mlp)
    dp = dims.dp_size
    rows = t.batch_size // (dp * t.grad_accum_steps)  # sequences per micro-step on this dp rank
    micro = p.pp_microbatches if dims.pp > 1 else 1
    row_len = t.seq_len * (rows if c.data.pack else 1)  # a packed micro-batch is one row
    tokens = max(1, rows * t.seq_len // dims.cp // micro)
    attention = attention_bytes(c, prof, rows=1 if c.data.pack else max(1, rows // micro), row_len=row_len,
                                device_type=device_type)
    if dims.pp == 1:
        return _stage(c, dims, prof, 0, tokens, attention, device_type)
    ranks = range(dims.pp) if pp_rank is None else [pp_rank]
    return max((_pipeline(c, dims, prof, r, tokens, attention, device_type) for r in ranks),
               key=lambda plan: plan.total)


def _dim(prof: MemoryProfile, bf16_params: bool) -> int:
    """The hidden width: a block's input is one D-wide tensor (bf16 under FSDP's mixed precision, else float32)."""
    return int(prof.block_input) // (2 if bf16_params else 4)


def _work(c: JobConfig, dims: ParallelDims, prof: MemoryProfile, T: int, attention: int) -> tuple[int, int]:
    """One block's work beside the activations: (forward, backward), CP's K/V buffers in the one they are in."""
    checkpointing = c.activation_checkpoint.mode == "full"
    recompute = int((prof.block_saved if checkpointing else 0) * T)
    dispatch = int(prof.dispatch * T) if dims.ep > 1 else 0
    attention_saved = prof.block_saved if prof.attention_saved is None else prof.attention_saved
    attention_side = int((attention_saved if checkpointing else 0) * T) + int(prof.attention_backward * T) + attention
    ffn_side = recompute + int(prof.block_backward * T) + dispatch
    return recompute + int(prof.block_forward * T) + dispatch + attention, max(attention_side, ffn_side)


def _pipeline(c: JobConfig, dims: ParallelDims, prof: MemoryProfile, pp_rank: int, T: int, attention: int,
              device_type: str) -> MemoryPlan:
    """Pipeline rank `pp_rank`'s plan: its stages moment by moment through its schedule's order."""
    t, p = c.training, c.parallelism
    fsdp = dims.dp_cp_size > 1
    bf16 = t.mixed_precision == "bfloat16"
    schedule = p.pp_schedule
    per_rank = stages_per_rank(p, prof.layers)
    keep = prof.block_input if c.activation_checkpoint.mode == "full" else prof.body_saved / prof.layers
    rank = PipelineRank(schedule=schedule, pp=dims.pp, per_rank=per_rank, microbatches=p.pp_microbatches,
                        pp_rank=pp_rank, shards=dims.fsdp_size if fsdp else 1, c=2 if bf16 and fsdp else 4,
                        logits=2 if bf16 else 4, keep=keep, tokens=T,
                        recomputed=prof.block_saved - keep if c.activation_checkpoint.mode == "full" else 0.0)
    forward, backward = _work(c, dims, prof, T, attention)
    layers = prof.layers // (dims.pp * per_rank) * per_rank
    head = prof.output_params if dims.pp * per_rank - 1 in stage_ids(schedule, dims.pp, pp_rank, per_rank) else 0
    cast = 2 * (layers * prof.block_cast_params + head) if bf16 and not fsdp else 0
    base = {"process": process_bytes(device_type, family_of(c).rank_imports), "bf16 weight copies": cast}
    phases = pipeline_phases(rank, prof, forward_work=forward, backward_work=backward, dim=_dim(prof, bf16 and fsdp),
                             base=base,
                             slack=CUDA_SLACK if device_type == "cuda" else 0.0)
    name = max(phases, key=lambda k: sum(phases[k].values()))
    occ = occupancy(schedule, dims.pp, per_rank, p.pp_microbatches, pp_rank)
    return MemoryPlan(tuple(phases[name].items()), name, 0, T, tuple((k, sum(v.values())) for k, v in phases.items()),
                      pp_rank=pp_rank, in_flight=tuple((s, occ.most(s)) for s in occ.stages))


@dataclass(frozen=True)
class _Units:
    """FSDP's gathered parameters and the gradients being reduced, bytes, by phase."""

    gathered: dict[str, int]
    reducing: dict[str, int]


def _units(*, fsdp: bool, pp: bool, bf16: bool, embedding: int, head: int, block: int, blocks: int,
           experts: int = 0) -> _Units:
    """What FSDP2 holds unsharded, in apply_fsdp's units (the embedding, each block, the norm with the output).

    Gathered in the compute dtype (bf16 under mixed precision). A unit's gradient is made in that dtype, cast to
    float32 for the reduction (under bf16), copied into the reduce-scatter's input buffer, and the shard comes out:
    4 + 4 (+ 2 under bf16) bytes per parameter of the unit in flight, at the block's end ("block end"). While a
    block's backward works, the previous block's reduce-scatter input (float32) is still held and the block's own
    gradients grow: 4 + c bytes per parameter beside its work ("backward"; torch's tracker at full size: the
    mid-block peak of a 1.65 B-parameter MoE block holds 4). The embedding runs alone in forward and is
    gathered again at the backward's end; blocks two at a time (running, prefetched; the backward's last block
    alone: the embedding's prefetch, in two of three full-size tracker peaks, is left out, which keeps the tiny
    Qwen3-MoE rehearsal within 10%); the norm and the output stay
    gathered from their forward to their backward. With PP no unit is resharded: all stay gathered.
    """
    if not fsdp:
        return _Units(dict.fromkeys(("forward", "loss", "backward", "last block", "embedding"), 0),
                      dict.fromkeys(("loss", "backward", "block end", "embedding"), 0))
    c = 2 if bf16 else 4
    reduce = 4 + 4 + (c if bf16 else 0)
    two = min(blocks, 2) * block
    if pp:
        every = c * (embedding + blocks * block + head)
        gathered = dict.fromkeys(("forward", "loss", "backward", "last block", "embedding"), every)
    else:
        # the head unit stays gathered from its forward into its backward, and so does its all-gather's output
        # buffer (torch's tracker, "All Gather" beside "Unsharded Param" at the loss's peak)
        gathered = {"forward": c * max(embedding, two), "loss": 2 * c * head, "backward": c * two,
                    "last block": c * min(blocks, 1) * block, "embedding": c * embedding}
    # experts: of `block`, the parameters of its experts unit (expert parallelism), reduced before the block's
    # attention works: the previous block's reduce-scatter input is its dense unit's alone (torch's tracker at full
    # size, a Qwen3-Next and a DeepSeek-V3 shape at ep = 8 and 32)
    return _Units(gathered, {"loss": reduce * head, "backward": 4 * (block - experts) + c * block,
                             "block end": reduce * block,
                             "embedding": reduce * embedding})


HOST_PARTS = ("checkpointed block inputs", "pinned-memory rounding", "parameter shards", "gradient shards",
              "AdamW moments")
"""The host-memory parts of a CUDA rank, in order; the first two come from `activation_checkpoint.offload`, the
others from `training.offload_params`."""


def _host_parts(*, block_inputs: list[int], forward_inputs: list[int], blocks: int, forwards: int,
                shard: int) -> tuple[tuple[str, int], ...]:
    """One CUDA rank's host memory, by part (`HOST_PARTS`).

    `block_inputs`: the bytes of each tensor a checkpointed block saves to host memory of its own (its input);
    `forward_inputs`: those of the tensors every block of a forward is handed, the same objects (the rotary cos
    and sin), which `host_offload.HostOffload` copies once a forward; `blocks`: how many blocks' are held at once
    (every block's, from its forward to its backward); `forwards`: how many forwards' (microbatches in flight);
    `shard`: the float32 parameter shard's bytes (FSDP2's `CPUOffloadPolicy(pin_memory=True)`: the shard and its
    gradient, made by a non-blocking copy, are pinned; AdamW's two moments are ordinary memory). The offload
    copies each tensor into power-of-two pinned pieces, the smallest 2 MiB (`host_offload.piece_sizes`), so the
    pinned-memory cache keeps them as they are: the rounding is each tensor's pieces' total minus its bytes, under
    2 MiB. The shards are one tensor a parameter, which the cache rounds up to a power of two, whose shapes the plan
    does not have, so their rounding is not counted (a Llama-3-8B's feed-forward shards, 7 x 2^k bytes, take 8/7
    of their bytes).
    """
    kept = blocks * sum(block_inputs) + forwards * sum(forward_inputs)
    held = blocks * sum(map(host_bytes, block_inputs)) + forwards * sum(map(host_bytes, forward_inputs))
    return (("checkpointed block inputs", kept), ("pinned-memory rounding", held - kept),
            ("parameter shards", shard), ("gradient shards", shard), ("AdamW moments", 2 * shard))


def _stage(c: JobConfig, dims: ParallelDims, prof: MemoryProfile, stage: int, T: int, attention: int,
           device_type: str) -> MemoryPlan:
    """The plan of one pipeline stage (the first holds the most microbatches, the last the loss)."""
    t, ac = c.training, c.activation_checkpoint
    last, first = stage == dims.pp - 1, stage == 0
    L = prof.layers // dims.pp
    micro = c.parallelism.pp_microbatches
    # Microbatches whose activations a stage holds at once: GPipe all of them, 1F1B at most pp - stage.
    in_flight = 1 if dims.pp == 1 else micro if c.parallelism.pp_schedule == "GPipe" else min(micro, dims.pp - stage)
    shards = dims.fsdp_size if dims.dp_cp_size > 1 else 1
    fsdp = dims.dp_cp_size > 1 or t.offload_params  # one rank with offload_params: FSDP2 over it, S = 1
    bf16 = t.mixed_precision == "bfloat16"
    embedding = (prof.root_params - prof.output_params) if first else 0  # with the final norm (a few numbers)
    head = prof.output_params if last else 0
    params = embedding + head + prof.body_params * L // prof.layers
    # FSDP2's CPUOffloadPolicy (`training.offload_params`, on CUDA): the float32 shards, their gradients, the moments
    # and the optimizer's step live in host memory; the device holds only the units gathered and reduced.
    offload_state = t.offload_params and fsdp and device_type == "cuda"
    block = prof.block_params
    if dims.ep > 1:  # this rank's E/ep experts, FSDP-sharded over efsdp = dp_shard x cp / ep; the rest over S
        experts = prof.body_expert_params * L // prof.layers
        sharded = (params - experts) // shards + experts // dims.ep // dims.efsdp_size
        # each experts module is its own unit: the block gathers its dense weights and E/ep experts
        block = prof.block_params - prof.block_expert_params + prof.block_expert_params // dims.ep
    state = 0 if offload_state else (4 * sharded if dims.ep > 1 else 4 * params // shards)
    moments = 2 * state
    units = _units(fsdp=fsdp, pp=dims.pp > 1, bf16=bf16, embedding=embedding, head=head, block=block,
                   experts=prof.block_expert_params // dims.ep if dims.ep > 1 else 0,
                   blocks=L)
    # Without FSDP (one rank over dp x cp), bf16 is autocast: its cache keeps a bf16 copy of each linear weight.
    cast = 2 * (L * prof.block_cast_params + head) if bf16 and not fsdp else 0
    checkpointing = ac.mode == "full"
    offload = checkpointing and ac.offload and device_type == "cuda"
    keep = prof.block_input if checkpointing else prof.body_saved / prof.layers  # per block, on average
    # Offloaded, a block's input leaves the device as the checkpoint saves it; the block working holds it again
    # (its recompute counts it), so none is kept beside (torch's tracker at full size, Llama-3-8B at 5.2M tokens).
    kept_blocks = 0 if offload else L
    activations = int(keep * T * kept_blocks * in_flight)
    last_activations = int(keep * T * min(kept_blocks, 1) * in_flight)  # the backward's last block: its own alone
    positions = T if c.data.pack else min(T, max(1, t.seq_len // dims.cp))  # a row's (packed: one row of T)
    host_parts = _host_parts(
        block_inputs=[int(keep * T)] if offload else [],
        forward_inputs=[int(b * positions) for b in prof.block_position_inputs] if offload else [],
        blocks=L * in_flight, forwards=in_flight,
        shard=(4 * sharded if dims.ep > 1 else 4 * params // shards) if offload_state else 0)
    vocab = prof.vocab
    # The pipeline's last stage computes the unfused loss on the logits its stage returns, and keeps them
    # (compute dtype) until that microbatch's backward; without pipelining the fused loss is the trainer's.
    fused = t.fused_loss and dims.pp == 1
    loss_tokens = min(c.loss_chunk_tokens(), T) if fused else T
    if not last:
        loss = 0
    elif fused:  # one chunk, the per-token log-sum-exp and hidden gradient, the output weight's float32 gradient
        loss = int((prof.head_saved + prof.fused_loss_token) * T + prof.fused_loss_chunk * loss_tokens
                   + 4 * prof.output_params)
    else:
        held = (4 if t.mixed_precision == "float32" else 2) * vocab if dims.pp > 1 else 0
        loss = int((prof.head_saved + prof.loss + held) * T)
    # A checkpointed block holds all it would save while it runs: in forward, and again in its recompute.
    recompute = int((prof.block_saved if checkpointing else 0) * T)
    # Expert parallelism's dispatch: the routed rows in transit beside the MoE layer's own work, both ways.
    dispatch = int(prof.dispatch * T) if dims.ep > 1 else 0
    # A block's backward peaks in its feed-forward or in its attention; CP's buffers exist only beside the latter.
    # A hybrid's largest block may have no attention: the attention block's own recompute goes with CP's buffers.
    attention_saved = prof.block_saved if prof.attention_saved is None else prof.attention_saved
    attention_recompute = int((attention_saved if checkpointing else 0) * T)
    attention_side = attention_recompute + int(prof.attention_backward * T) + attention
    attention_wins = attention_side >= recompute + int(prof.block_backward * T) + dispatch
    backward_work = (attention_recompute + int(prof.attention_backward * T) if attention_wins
                     else recompute + int(prof.block_backward * T) + dispatch)
    backward_attention = attention if attention_wins else 0
    grads_always = t.grad_accum_steps > 1
    process = process_bytes(device_type, family_of(c).rank_imports)
    # The phases' per-token tensors that glibc serves from its heap (D-wide and narrower; vocabulary-wide ones are
    # mapped): the heap keeps their high water resident for the rest of the step (see `heap_slack`).
    loss_heap = int((prof.head_saved + (prof.fused_loss_token if fused else 0)) * T) if last else 0
    heap_held = {"forward": activations + recompute + int(prof.block_forward * T) + dispatch + attention,
                 "loss": activations + loss_heap,
                 "backward": activations + backward_work + backward_attention,
                 "last block backward": last_activations + backward_work + backward_attention,
                 "optimizer step": 0, "embedding backward": 0, "block end": activations}
    # It grows to the most any phase holds there, plus the holes that one block's backward in flight (and a tiled
    # feed-forward's tile) leave between differently sized tensors, and keeps that resident through the step, the
    # optimizer's included (it trims only its top). Measured with `mallinfo2` on the 128k-vocabulary fused-loss
    # runs (1,024 and 3,072 tokens): the heap grew by 64.5 KiB per token (plan: 65.5), 42 with a 4-tile
    # feed-forward (plan: 43.4).
    heap = device_type == "cpu" and prof.block_input * T < HEAP_CEILING
    high_water = max(heap_held.values()) + int((prof.block_backward + prof.tile_work) * T) if heap else 0
    base = {"process": process, "parameters": state, "optimizer state": moments}

    def phase(name: str, grads: int, gathered_now: int, cast_now: int, acts: int, work: int, attn: int,
              loss_now: int, reducing: int = 0) -> dict[str, int]:
        return {**base, "gradients": grads, "gathered parameters": gathered_now, "gathered gradients": reducing,
                "bf16 weight copies": cast_now,
                "activations": acts, "one block in flight": work, "attention K/V in flight": attn, "loss": loss_now,
                "allocator slack": int(CUDA_SLACK * (acts + work + attn + loss_now)) if device_type == "cuda"
                else heap_slack(name)}

    def heap_slack(name: str) -> int:  # what the heap keeps beyond what this phase holds in it
        return max(0, high_water - heap_held[name])

    during = state if grads_always else 0
    # The backward's last block (the model's first) works as every block does, but beside every other gradient
    # shard already made (the output layer's and the other blocks': all but the embedding's and its own) and only
    # its own activations left. Where the sharded state outweighs the activations (a MoE model at few tokens per
    # rank: torch's tracker at 64 ranks, a Qwen3-Next shape at 4,096 tokens per rank, peaks there with 86% of the
    # gradient shards made) this end is the backward's peak, not its start.
    block_shard = (prof.block_params - prof.block_expert_params) // shards + (
        prof.block_expert_params // dims.ep // dims.efsdp_size if dims.ep > 1 else prof.block_expert_params // shards)
    made = 0 if grads_always or offload_state or L < 2 else max(0, state - 4 * (embedding // shards) - 4 * block_shard)
    # The head's backward: the loss at its peak, then (its buffers gone) the head unit's gradients reduced.
    head_reducing = units.reducing["loss"] if units.reducing["loss"] > loss else 0
    phases = {
        "forward": phase("forward", during, units.gathered["forward"], cast, activations,
                         recompute + int(prof.block_forward * T) + dispatch, attention, 0),
        "loss": phase("loss", during, units.gathered["loss"], cast, activations, 0, 0, 0 if head_reducing else loss,
                      head_reducing),
        # The backward's start (the last block's): every activation kept, gradient shards yet to come; its end
        # (every shard made, no activation left) is "embedding backward". In between, one falls as the other grows.
        "backward": phase("backward", during, units.gathered["backward"], cast, activations,
                          backward_work, backward_attention, 0, units.reducing["backward"]),
        "optimizer step": phase("optimizer step", state, 0, 0, 0, 0, 0, 0),
    }
    if made:  # the backward's last block: the same work beside the other blocks' gradient shards
        phases["last block backward"] = phase("last block backward", made, units.gathered["last block"], cast,
                                              last_activations, backward_work, backward_attention, 0,
                                              units.reducing["backward"])
    if units.reducing["block end"]:  # a block's end: its gradients made, cast and copied for the reduce-scatter
        phases["block end"] = phase("block end", during, units.gathered["backward"], cast, activations, 0, 0, 0,
                                    units.reducing["block end"])
    if units.reducing["embedding"]:  # the backward's end: the embedding gathered and its gradient reduced
        phases["embedding backward"] = phase("embedding backward", state, units.gathered["embedding"], cast, 0, 0, 0, 0,
                                             units.reducing["embedding"])
    name = max(phases, key=lambda k: sum(phases[k].values()))
    return MemoryPlan(tuple(phases[name].items()), name, sum(b for _, b in host_parts), T,
                      tuple((k, sum(v.values())) for k, v in phases.items()), host_parts=host_parts)
