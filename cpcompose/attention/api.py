"""`cp_attention`: context-parallel attention on local sequence shards."""

from __future__ import annotations

import hashlib
import math
from typing import Literal, Sequence

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cpcompose.attention.allgather import AllGatherAttention
from cpcompose.attention.alltoall import AllToAllAttention
from cpcompose.attention.blocks import KernelArgs, MaskSpec
from cpcompose.attention.kernels import select_backend
from cpcompose.attention.ring import RingAttention
from cpcompose.attention.setup import AttentionSetup, Layout
from cpcompose.comm import CommMeter, CPGroup
from cpcompose.layout import LAYOUTS, SeqLayout, resolve_layout
from cpcompose.packing import PackedLayout, check_cu_seqlens
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
    layout: str | PackedLayout | None = None,
    cu_seqlens: Sequence[int] | Tensor | None = None,
    window_size: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    meter: CommMeter | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over the global sequence, given this rank's shards.

    Args:
        q, k, v: local shards `(batch, heads, seq_local, head_dim)`, cut by `layout`
            (see `cp_shard`, `cp_shard_packed`). K/V may have fewer heads (GQA/MQA).
        mesh: the 1-D CP mesh (`mesh["cp"]` of a larger one).
        is_causal: causal mask by global position.
        scale: softmax scale; default `1/sqrt(head_dim)`.
        strategy: "ring" (K/V point-to-point), "allgather" (gather K/V), or
            "alltoall" (Ulysses: heads for sequence).
        layout: "zigzag" or "contiguous" (None = zigzag if causal else contiguous),
            or a `PackedLayout` from `cp_shard_packed` for packed documents.
        cu_seqlens: document boundaries of a packed sequence (0, ..., total); the
            shards must then be cut by `PackedLayout.build(cu_seqlens, P)`.
        window_size: sliding window: each query sees at most this many earlier
            positions (causal only).
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
    chosen, error = _choose_layout(layout, cu_seqlens, is_causal, cp.world, window_size)
    error = error or _local_error(q, k, v, cp.world, strategy, chosen, is_causal, window_size)
    signature = [
        *shape_code(q.shape), *shape_code(k.shape), *shape_code(v.shape),
        dtype_code(q.dtype), int(is_causal), list(STRATEGIES).index(strategy) if strategy in STRATEGIES else -1,
        _layout_code(chosen), -1 if window_size is None else int(window_size),
    ]
    names = ["q"] * 5 + ["k"] * 5 + ["v"] * 5 + ["dtype", "is_causal", "strategy", "layout/cu_seqlens", "window_size"]
    agree_across_ranks(cp, error, signature, what="cp_attention", device=q.device, describe=names)
    assert chosen is not None
    kernel = KernelArgs(
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=select_backend(q, backend),
    )
    mask = MaskSpec(is_causal, window_size)
    setup = AttentionSetup(cp, chosen, mask, kernel, meter, need_lse=return_lse)
    out, lse = STRATEGIES[strategy].apply(q, k, v, setup)
    return (out, lse) if return_lse else out


def _choose_layout(
    layout: str | PackedLayout | None, cu_seqlens: Sequence[int] | Tensor | None, causal: bool, world: int,
    window: int | None,
) -> tuple[Layout | None, str | None]:
    """The layout object for the arguments, or why there is none."""
    if isinstance(layout, PackedLayout):
        if cu_seqlens is not None:
            return None, "pass either layout=PackedLayout or cu_seqlens, not both"
        if layout.world != world:
            return None, f"the PackedLayout was built for {layout.world} ranks, the CP mesh has {world}"
        return layout, None
    if cu_seqlens is not None:
        if layout not in (None, "packed"):
            return None, f"layout={layout!r} cannot cut a packed sequence; leave layout=None with cu_seqlens"
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
        problem = check_cu_seqlens(cu)
        if problem:
            return None, problem
        balance_window = window if isinstance(window, int) and window > 0 else None
        return PackedLayout.build(cu, world, window=balance_window), None
    if layout is not None and layout not in LAYOUTS:
        return None, f"layout={layout!r} is unknown; choose one of {LAYOUTS} or pass a PackedLayout"
    return SeqLayout(resolve_layout(layout, is_causal=causal), world), None


def _layout_code(layout: Layout | None) -> int:
    """A number every rank computes alike for the same layout (documents included)."""
    if layout is None:
        return -1
    if isinstance(layout, SeqLayout):
        return LAYOUTS.index(layout.name)
    digest = hashlib.sha256(repr((layout.doc_bounds, layout.world)).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _local_error(
    q: Tensor, k: Tensor, v: Tensor, world: int, strategy: str, layout: Layout | None, causal: bool,
    window_size: int | None,
) -> str | None:
    """What is wrong with this rank's arguments, or None."""
    if strategy not in STRATEGIES:
        return f"strategy={strategy!r} is unknown; choose one of {tuple(STRATEGIES)}"
    if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1):
        return f"window_size must be a positive number of positions, got {window_size!r}"
    if window_size is not None and not causal:
        return "window_size needs is_causal=True (the window is to the left of each query)"
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
    assert layout is not None
    return layout.split_error(q.shape[2] * world, what=f"global sequence length (local {q.shape[2]} x {world} ranks)")
