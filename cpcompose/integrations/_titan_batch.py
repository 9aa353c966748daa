"""A torchtitan batch split for cpcompose's CP: documents from its positions, the split balanced.

torchtitan's dataloaders give every CP rank the same `(batch, seq)` tokens, labels
(already shifted: token t's target) and `positions`, which restart at 0 where a
packed document starts. torchtitan's own masks (flex `BlockMask`, varlen
`cu_seqlens`) put a document boundary wherever a position is 0 and at every row
start; `document_starts` reads the same boundaries. A rank under CP holds a shard,
so it cannot read them itself: `shard_batch` reads them from the full batch.

With `documents=True` (torchtitan's semantics) the rows become one pack, each row
cut where its documents start, split by cpcompose's balanced `PackedLayout` and
padded at its end with a document of its own that carries no loss. With
`documents=False` every row is attended causally as one sequence (what torchtitan's
SDPA attention did) and split by the zigzag layout (torchtitan's "headtail").

Nothing here imports torchtitan: `cpcompose.integrations.torchtitan` plugs it into
torchtitan's trainer, and a user's own loop can call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.call.options import CPOptions, StrategyChoice
from cpcompose.comm import CPGroup
from cpcompose.layouts import Layout, resolve_layout
from cpcompose.layouts.packed import BALANCES
from cpcompose.agreement import Signature, agree_across_ranks
from cpcompose.parallel.dispatch import CPAttentionMode
from cpcompose.sharding.packed import pack_documents

__all__ = [
    "IGNORE_INDEX", "TITAN_OPTION_KEYS", "CPAttentionMask", "CPComposeConfig", "TitanBatch", "document_starts",
    "shard_batch",
]

IGNORE_INDEX = -100  # torchtitan's (components.loss.IGNORE_INDEX)


@dataclass
class CPComposeConfig:
    """The `cpcompose` section of `CPComposeTrainer.Config` (CLI: `--cpcompose.<key>`)."""

    strategy: StrategyChoice = "ring"
    """CP attention: "ring" (K/V passed round the ranks), "allgather", "alltoall" (Ulysses: heads for
    sequence), "alltoall_ring" (2-D: Ulysses inside blocks of `alltoall_size` ranks, a ring across them)
    or "auto" (cpcompose's cost model picks one per call signature); `CPOptions.strategy`."""

    alltoall_size: int | None = None
    """"alltoall_ring" only: ranks per all-to-all block, a divisor of the CP degree (keep a block in a node)."""

    documents: bool = True
    """Attend within packed documents (positions restarting at 0, as torchtitan's flex/varlen masks do);
    False: every row is one causal sequence, as torchtitan's SDPA attention did."""

    balance: Literal["documents", "zigzag"] = "documents"
    """With documents: "documents" (long documents zigzag-split over every rank, short ones whole)
    or "zigzag" (plain zigzag chunks of the pack)."""

    layout: str = "zigzag"
    """Without documents: how rows are split, a registered layout ("zigzag" is torchtitan's "headtail";
    "contiguous")."""

    window: int | None = None
    """Causal sliding window: each query sees itself and the `window` positions before it (None: no window)."""

    def __post_init__(self) -> None:
        error = self.error()
        if error:
            raise ValueError(error)

    def options(self, layout: Layout | str | None = None) -> CPOptions:
        """The `CPOptions` these settings describe (with this batch's `layout` once it is known)."""
        return CPOptions(strategy=self.strategy, layout=layout or self.layout, window_size=self.window,
                         alltoall_size=self.alltoall_size)

    def error(self, world: int | None = None) -> str | None:
        """What is wrong with these settings, naming the key to change, or None (`world`: the CP degree)."""
        problem = self.options().problem(world, names=TITAN_OPTION_KEYS)  # the options' own rules, our keys
        if problem is not None:
            return problem.keyed()
        if self.balance not in BALANCES:
            return f"cpcompose.balance={self.balance!r} is unknown; choose one of {BALANCES}"
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 0):
            return f"cpcompose.window must be a non-negative number of positions or None, got {self.window!r}"
        return None


TITAN_OPTION_KEYS = {
    "strategy": "cpcompose.strategy", "alltoall_size": "cpcompose.alltoall_size", "layout": "cpcompose.layout",
}
"""The key of each `CPOptions` field the `cpcompose` section sets: option errors name them."""


@dataclass(frozen=True, eq=False)
class CPAttentionMask:
    """What `CPComposeAttention` reads from torchtitan's `attention_masks` argument.

    Under CP, `region` holds the mesh and the options (strategy, this batch's layout,
    window) and attention goes through it. On one process (`region` None),
    `document_ids` `(batch, seq)` numbers each token's document (None: causal over the row).
    """

    region: CPAttentionMode | None
    document_ids: Tensor | None
    window: int | None


@dataclass(frozen=True)
class TitanBatch:
    """This rank's part of a batch: feed `inputs` and `positions`/`attention_masks` to the model."""

    inputs: Tensor
    labels: Tensor
    positions: Tensor
    attention_masks: CPAttentionMask
    layout: Layout | None  # the split (None on one process)


def document_starts(positions: Tensor) -> Tensor:
    """`(batch, seq)` bool: where a document starts (position 0, or a row's first token), torchtitan's rule."""
    starts = positions == 0
    starts[:, 0] = True
    return starts


def shard_batch(
    inputs: Tensor,
    labels: Tensor,
    positions: Tensor | None,
    mesh: DeviceMesh | None,
    config: CPComposeConfig,
    *,
    pad_token: int = 0,
) -> TitanBatch:
    """This rank's shard of a torchtitan batch, and the attention mask that goes with it.

    Args:
        inputs: `(batch, seq)` token ids, the same on every CP rank.
        labels: `(batch, seq)` targets (already shifted), IGNORE_INDEX = no loss.
        positions: `(batch, seq)` per-document positions (RoPE; documents restart at 0), or
            None: one document per row, positions 0..seq-1.
        mesh: the 1-D CP mesh, or None (one process: nothing is split).
        config: the `cpcompose` settings.
        pad_token: the id written into the padding document of a pack.

    Returns:
        A `TitanBatch`. With documents under CP, `inputs`/`labels`/`positions` are `(1, n)`:
        the batch's rows as one pack.

    Raises:
        ValueError: on every CP rank (one tiny all-gather) if any rank's batch is invalid,
            cannot be split, or differs from the others'.
    """
    error = config.error(None if mesh is None else mesh.size()) or _batch_error(inputs, labels, positions)
    if positions is None and error is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    if mesh is None:
        if error:
            raise ValueError(f"cpcompose torchtitan batch: {error}")
        assert positions is not None
        ids = torch.cumsum(document_starts(positions).int(), dim=1) if config.documents else None
        return TitanBatch(inputs, labels, positions, CPAttentionMask(None, ids, config.window), None)
    cp = CPGroup.from_mesh(mesh)
    signature = Signature().shape("inputs", getattr(inputs, "shape", ()), 2)
    device = inputs.device if isinstance(inputs, Tensor) else torch.device("cpu")  # CUDA for NCCL
    if config.documents:  # the rows as one pack of documents: torchtitan's positions say where each starts
        cu = None
        if error is None:
            assert positions is not None
            starts = torch.nonzero(document_starts(positions).reshape(-1)).reshape(-1).tolist()
            cu = starts + [positions.numel()]
        batch = pack_documents(
            [inputs, labels, positions] if error is None else [], cu, mesh, pad_values=[pad_token, IGNORE_INDEX, None],
            what="cpcompose torchtitan batch", error=error, signature=signature, balance=config.balance,
            window=config.window, device=device,
        )
        layout: Layout = batch.layout
        local = list(batch.local(cp.rank))
    else:
        dense = None
        if error is None:
            dense = resolve_layout(config.layout, cp.world)
            error = dense.split_error(inputs.shape[1], what=f"training.seq_len ({config.layout} split)")
        agree_across_ranks(cp, error, signature.layout(dense), what="cpcompose torchtitan batch", device=device)
        assert dense is not None and positions is not None
        layout = dense
        local = [layout.shard(t, 1, cp.rank) for t in (inputs, labels, positions)]
    mask = CPAttentionMask(CPAttentionMode(mesh, config.options(layout)), None, config.window)
    return TitanBatch(local[0], local[1], local[2], mask, layout)


def _batch_error(inputs: object, labels: object, positions: object) -> str | None:
    """What is wrong with this rank's batch, or None."""
    if not isinstance(inputs, Tensor) or inputs.ndim != 2 or inputs.is_floating_point():
        return f"inputs must be a (batch, seq) integer tensor, got {getattr(inputs, 'shape', type(inputs))}"
    if not isinstance(labels, Tensor) or labels.shape != inputs.shape:
        return f"labels must have the inputs' shape {tuple(inputs.shape)}, got {getattr(labels, 'shape', labels)!r}"
    if positions is not None and (not isinstance(positions, Tensor) or positions.shape != inputs.shape):
        return (
            f"positions must have the inputs' shape {tuple(inputs.shape)} (per-document positions from "
            f"torchtitan's dataloader), got {getattr(positions, 'shape', positions)!r}"
        )
    return None

