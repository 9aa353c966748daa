"""`cp_attention`: context-parallel attention on local sequence shards."""

from __future__ import annotations

import math
from typing import Literal

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.allgather import AllGatherAttention
from cpcompose.attention.alltoall import AllToAllAttention
from cpcompose.attention.blocks import KernelArgs
from cpcompose.attention.kernels import select_backend
from cpcompose.attention.ring import RingAttention
from cpcompose.attention.setup import AttentionSetup
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layout import LAYOUTS, SeqLayout, resolve_layout
from cpcompose.validation import agree_across_ranks, dtype_code, shape_code

Strategy = Literal["ring", "allgather", "alltoall"]
STRATEGIES: dict[str, type] = {"ring": RingAttention, "allgather": AllGatherAttention, "alltoall": AllToAllAttention}


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh,
    is_causal: bool = False,
    scale: float | None = None,
    strategy: Strategy = "ring",
    layout: str | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    meter: CommMeter | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over the global sequence, given this rank's shards.

    Args:
        q, k, v: local shards `(batch, heads, seq_local, head_dim)`, cut by `layout`
            (see `cp_shard`). K/V may have fewer heads (GQA/MQA).
        mesh: the 1-D CP mesh (`mesh["cp"]` of a larger one).
        is_causal: causal mask by global position.
        scale: softmax scale; default `1/sqrt(head_dim)`.
        strategy: "ring" (K/V point-to-point), "allgather" (gather K/V), or
            "alltoall" (Ulysses: heads for sequence).
        layout: "zigzag" or "contiguous"; None = zigzag if causal else contiguous.
        backend: force a local kernel (see `kernels.BACKENDS`); None = best available.
        return_lse: also return the float32 log-sum-exp `(batch, heads, seq_local)`.
        meter: counts the bytes this rank sends.

    Returns:
        The local output shard (same layout as `q`), and the LSE if asked for.

    Raises:
        ValueError: on every rank, before any K/V moves, if any rank's input is
            invalid or the ranks disagree on shapes, dtypes or options.
    """
    cp = CPGroup.from_mesh(mesh)
    error = _local_error(q, k, v, cp.world, strategy, layout, is_causal)
    resolved = resolve_layout(layout, is_causal=is_causal) if layout in (None, *LAYOUTS) else "zigzag"
    signature = [
        *shape_code(q.shape), *shape_code(k.shape), *shape_code(v.shape),
        dtype_code(q.dtype), int(is_causal), list(STRATEGIES).index(strategy) if strategy in STRATEGIES else -1,
        LAYOUTS.index(resolved),
    ]
    names = ["q"] * 5 + ["k"] * 5 + ["v"] * 5 + ["dtype", "is_causal", "strategy", "layout"]
    agree_across_ranks(cp, error, signature, what="cp_attention", device=q.device, describe=names)
    kernel = KernelArgs(
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=select_backend(q, backend),
    )
    setup = AttentionSetup(cp, SeqLayout(resolved, cp.world), is_causal, kernel, meter, need_lse=return_lse)
    out, lse = STRATEGIES[strategy].apply(q, k, v, setup)
    return (out, lse) if return_lse else out


def _local_error(q: Tensor, k: Tensor, v: Tensor, world: int, strategy: str, layout: str | None, causal: bool) -> str | None:
    """What is wrong with this rank's arguments, or None."""
    if strategy not in STRATEGIES:
        return f"strategy={strategy!r} is unknown; choose one of {tuple(STRATEGIES)}"
    if layout is not None and layout not in LAYOUTS:
        return f"layout={layout!r} is unknown; choose one of {LAYOUTS}"
    if any(t.ndim != 4 for t in (q, k, v)):
        return (
            f"q, k, v must be 4-D (batch, heads, seq, head_dim), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        return f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or not (q.shape[2] == k.shape[2] == v.shape[2]):
        return (
            f"q, k, v must share batch (dim 0) and local sequence length (dim 2), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        return f"q, k, v must share head_dim (dim 3), got {q.shape[3]}, {k.shape[3]}, {v.shape[3]}"
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return (
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads (k: {k.shape[1]}, "
            f"v: {v.shape[1]}, which must be equal)"
        )
    seq_layout = SeqLayout(resolve_layout(layout, is_causal=causal), world)
    return seq_layout.split_error(q.shape[2] * world, what=f"global sequence length (local {q.shape[2]} x {world} ranks)")
