"""`context_parallel`: PyTorch's experimental CP context manager, on every device.

Code written for `torch.distributed.tensor.experimental.context_parallel` works by
changing the import: the buffers are sharded in place along their sequence dims
(zigzag by default, and both causal and bidirectional attention stay exact under
it), SDPA inside the block is context-parallel, and the buffers are restored on
exit unless listed in `no_restore_buffers`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layout import SeqLayout, resolve_layout
from cpcompose.packing import PackedLayout
from cpcompose.parallel.dispatch import CPAttentionMode, CPConfig
from cpcompose.sharding import cp_unshard


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[Tensor] | None = None,
    strategy: str = "ring",
    layout: str | PackedLayout = "zigzag",
    meter: CommMeter | None = None,
    window_size: int | None = None,
) -> Iterator[None]:
    """Shard `buffers` in place and make SDPA context-parallel inside the block.

    Run the backward inside the block too: restoring a buffer on exit changes it in
    place, and autograd refuses tensors (token ids, positions) changed after saving.

    Args:
        mesh: the 1-D CP mesh.
        buffers: full-sequence tensors (inputs, labels, position ids, RoPE tables),
            identical on every rank; replaced in place by this rank's shard.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers to leave sharded on exit.
        strategy, layout, meter, window_size: as for `cp_attention`; `layout` may be a
            `PackedLayout` (buffers are then the padded pack).

    Raises:
        ValueError: buffers and dims differ in number, or a buffer's sequence
            cannot be split by the layout (checked before any buffer changes).
    """
    config = CPConfig(mesh, strategy, layout, meter, window_size=window_size)
    buffers, dims = list(buffers or []), list(buffer_seq_dims or [])
    if len(buffers) != len(dims):
        raise ValueError(f"got {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one dim per buffer")
    seq_layout = (
        layout if isinstance(layout, PackedLayout)
        else SeqLayout(resolve_layout(layout, is_causal=True), CPGroup.from_mesh(mesh).world)
    )
    for i, (buf, dim) in enumerate(zip(buffers, dims)):
        seq_layout.check_split(buf.shape[dim], what=f"buffers[{i}] sequence length (dim {dim})")
    keep = {id(b) for b in (no_restore_buffers or ())}
    originals = [None if id(b) in keep else b.clone() for b in buffers]
    rank = mesh.get_local_rank()
    shards = [seq_layout.shard(b, dim, rank) for b, dim in zip(buffers, dims)]
    with torch.no_grad():
        for buf, shard in zip(buffers, shards):
            buf.resize_(shard.shape).copy_(shard)
    try:
        with CPAttentionMode(config):
            yield
    finally:
        with torch.no_grad():
            for buf, original in zip(buffers, originals):
                if original is not None:
                    buf.resize_(original.shape).copy_(original)


def context_parallel_unshard(
    mesh: DeviceMesh, buffers: Sequence[Tensor], seq_dims: Sequence[int], *, layout: str | PackedLayout = "zigzag"
) -> list[Tensor]:
    """All-gather sharded `buffers` back to full sequences in global order (differentiable)."""
    if len(buffers) != len(seq_dims):
        raise ValueError(f"got {len(buffers)} buffers but {len(seq_dims)} seq_dims; give one dim per buffer")
    return [cp_unshard(b, mesh, seq_dim=d, layout=layout) for b, d in zip(buffers, seq_dims)]
