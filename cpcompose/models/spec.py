"""What the trainer needs from a model family, as one :class:`ModelSpec` per family."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.distributed import ParallelDims
from cpcompose.parallel.style import ContextParallel

__all__ = ["BuildFn", "MemoryFn", "MemoryProfile", "ModelSpec", "ParallelizeFn", "SplitForPipelineFn", "loss_bytes"]


class BuildFn(Protocol):
    """Construct a family's model from a config's ``model`` section, for rows of up to ``max_seq_len`` tokens.

    The section is read by the fields the family declares (its own settings protocol),
    so a model family never imports the config.
    """

    def __call__(self, model: Any, *, max_seq_len: int) -> nn.Module: ...


class ParallelizeFn(Protocol):
    """A family's plan: apply CP, TP, MLP tiling, activation checkpointing (with offload), compile and FSDP2,
    in place."""

    def __call__(
        self,
        model: nn.Module,
        *,
        parallel_dims: ParallelDims,
        mesh: DeviceMesh,
        cp: ContextParallel | None,
        activation_checkpoint: bool,
        torch_compile: bool,
        offload_activations: bool,
        mlp_tiles: int,
        param_dtype: torch.dtype | None,
        offload_params: bool,
        stages: Sequence[nn.Module] = (),
    ) -> nn.Module: ...


class SplitForPipelineFn(Protocol):
    """Cut a full model down, in place, to the union of pipeline stages ``stage_ids`` (of ``num_stages``), keeping
    the full model's FQNs; return it and one module per stage, in the order of ``stage_ids``, sharing its modules
    (see `cpcompose.models.llama.pipeline`)."""

    def __call__(self, model: nn.Module, *, num_stages: int,
                 stage_ids: Sequence[int]) -> tuple[nn.Module, tuple[nn.Module, ...]]: ...


@dataclass(frozen=True)
class MemoryProfile:
    """What a family's model holds during a training step, for `cpcompose.training.memory.plan` to add up.

    Parameter counts are this tensor-parallel rank's share, before FSDP shards them; activation
    figures are bytes per token of the rank's shard of the sequence, counted from what autograd
    saves (a test checks them against a `saved_tensors_hooks` count of the real modules).
    """

    root_params: int
    """Parameters outside the blocks (embedding, final norm, output layer): FSDP's embedding unit and its unit of
    the final norm with the output layer."""
    block_params: int
    """Parameters of one block: FSDP gathers one block (and prefetches the next) at a time."""
    output_params: int
    """Parameters of the output layer (the loss's weight), part of `root_params`."""
    block_cast_params: int
    """Parameters of one block that bfloat16 autocast copies (its linear weights; the output layer's are too):
    autocast's cache keeps one bf16 copy of each, unsharded, until the autocast region (forward and backward)
    ends. Only without FSDP: with it, FSDP2's mixed precision gathers each unit in bf16 instead."""
    block_input: float
    """One block's input: what activation checkpointing keeps per block."""
    block_saved: float
    """Everything one block saves for backward, its input included (no checkpointing; or its recompute)."""
    block_forward: float
    """Beyond `block_saved`, the most one block's forward holds at once."""
    block_backward: float
    """Beyond its saved tensors, the most one block's backward holds at once (gradients in flight)."""
    tile_work: float
    """With a sequence-tiled feed-forward, the most one tile holds at once (its recompute's saved tensors and their
    gradients), per token of the shard; 0 untiled. Small tensors: on CPU the heap keeps them once freed."""
    head_saved: float
    """What the final norm and the output layer's input keep for backward."""
    loss: float
    """The unfused loss at its peak, per token: in backward, the float32 log-softmax it saved, its gradient and the
    logits' gradient (the logits themselves, and under bf16 their float32 copy, are gone by then)."""
    fused_loss_chunk: float
    """The fused loss (`cp_linear_cross_entropy`'s PyTorch path) per token of one chunk: the chunk's float32 logits
    (the log-sum-exp and the softmax gradient are made in place in them) and, under bf16, the chunk's bf16 matmul
    output or gradient beside them."""
    fused_loss_token: float
    """The fused loss per token of the whole shard: the saved log-sum-exp and the hidden states' gradient, which
    backward makes whole before its chunks run."""
    attention_backward: float
    """Beyond its saved tensors, what one block's attention backward holds (its gradients and the D-wide ones in
    flight), per token: CP's received K/V and dK/dV buffers exist beside this, not beside the feed-forward's."""
    attention: tuple[int, int, int]
    """(heads, kv_heads, head_dim) of one attention call on this tensor-parallel rank, for the CP cost model."""
    layers: int
    """The model's blocks (all stages)."""
    body_params: int
    """All blocks' parameters together (a hybrid's blocks differ: the `block_*` figures are its largest block's)."""
    body_saved: float
    """Everything all blocks save for backward together, per token (no checkpointing)."""
    vocab: int
    """Logits per token (the output layer's rows)."""
    attention_saved: float | None = None
    """What a block's saved tensors still hold per token when its attention's backward runs (the largest over
    the blocks with attention): its recompute goes with CP's K/V buffers. A Hugging Face profile counts the input
    norm's and the mixer's (the feed-forward's backward ran first and freed its own). None: `block_saved`."""
    block_position_inputs: tuple[float, ...] = ()
    """Beyond `block_input`, the block's other positional tensor arguments, bytes per position of a row, one entry a
    tensor: non-reentrant checkpointing saves every positional tensor argument, and `activation_checkpoint.offload`
    copies each to host memory once per forward (the same objects every block: `host_offload.HostOffload` copies a
    tensor object once; the own Llama's rotary cos and sin, float32: 2 x head_dim each).
    Keyword arguments are kept on the device uncopied (a Hugging Face layer's position embeddings): ()."""
    block_expert_params: int = 0
    """Of `block_params`, the routed experts' own (the experts module: stacked gate/up and down weights, their
    biases; not the router, a shared expert or a post-expert norm). Under expert parallelism (`parallelism.ep`)
    each rank holds `1 / ep` of them, a separate FSDP unit sharded over efsdp = dp_shard x cp / ep."""
    body_expert_params: int = 0
    """Of `body_params`, the routed experts' own (every layer's experts module)."""
    split_backward: float = 0.0
    """What a zero-bubble schedule's split backward keeps per token of one block between its input part ("I") and
    its weight part ("W"): the gradient of every weight-using op's output (torch's `stage_backward_input` keeps them
    for `stage_backward_weight`). 0: not counted (a family that does not give it)."""
    dispatch: float = 0.0
    """Under expert parallelism, what the MoE layer's peak holds beyond `block_forward` / `block_backward` per
    token: the routed rows in transit (out and back, in the compute dtype) and the grouped GEMM's intermediate
    over the rows received (`cpcompose.experts.parallel_routed_experts`). 0 without experts."""


def loss_bytes(vocab: int, dim: int, c: int) -> dict[str, float]:
    """The trainer's loss per token, whatever the model (`MemoryProfile`'s `loss`, `fused_loss_chunk` and
    `fused_loss_token`; c: bytes of the compute dtype).

    Unfused, at its peak in backward: the float32 log-softmax it saved, its gradient and the logits' gradient
    (12 V). Fused (`cpcompose.parallel.chunked_loss`): per chunk token, the float32 logits in which it makes the
    log-sum-exp and the softmax gradient in place, and under bf16 the chunk's bf16 matmul output or gradient
    beside them (4 V or 6 V); per token of the shard, the saved float32 log-sum-exp and the hidden gradient.
    """
    return {"loss": 12 * vocab, "fused_loss_chunk": 4 * vocab + (2 * vocab if c == 2 else 0),
            "fused_loss_token": 4 + c * dim}


class MemoryFn(Protocol):
    """A family's :class:`MemoryProfile` for a config's ``model`` section, tensor-parallel degree, compute dtype
    ("float32", "bfloat16" under autocast, "bfloat16-params" under FSDP2's mixed precision) and number of sequence tiles of the feed-forward (and of
    the whole block's token-wise parts, for a family that tiles them: `training.tiled_block`)."""

    def __call__(self, model: Any, *, tp: int, precision: str, mlp_tiles: int, block_tiles: int = 1) -> MemoryProfile:
        ...


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it from the config, parallelize it, and cut it for pipelining."""

    name: str
    """The ``model.name`` that selects this family."""
    build: BuildFn
    """Construct the model from the config's ``model`` section (on the current default device, ``meta`` included).
    The module must have ``init_weights(*, seed: int)``, which gives identical weights on every
    rank and works on a cut pipeline stage, and its ``forward(tokens, position_ids, *, head=None)`` must call
    ``head(hidden, output_weight)`` in place of its output projection when given (the fused loss)."""
    parallelize: ParallelizeFn
    """The family's plan (see :class:`ParallelizeFn`)."""
    split_for_pipeline: SplitForPipelineFn
    """Keep only one pipeline stage's modules, with the full model's FQNs."""
    memory: MemoryFn | None = None
    """What the model holds per token and per parameter, for the memory plan; None: the plan cannot predict it."""
