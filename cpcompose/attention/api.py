"""`cp_attention`: context-parallel attention on local sequence shards."""

from __future__ import annotations

import hashlib
import math
import struct
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
    window_size: int | tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
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
        window_size: sliding window. An int W: each query sees at most W earlier
            positions (needs is_causal=True). A pair `(left, right)` as in flash-attn:
            query i sees keys i - left .. i + right (-1 or None = unbounded on that
            side); bidirectional local attention is `is_causal=False, window_size=(L, R)`,
            and with is_causal=True right must be 0.
        softcap: cap the logits at +-softcap (`softcap * tanh(scores / softcap)`, as in
            Gemma 2); None = no cap.
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
    window, window_error = _window_pair(window_size, is_causal)
    chosen, error = _choose_layout(layout, cu_seqlens, is_causal, cp.world, window[0] if is_causal else None)
    error = window_error or error or _local_error(q, k, v, cp.world, strategy, chosen, softcap)
    signature = [
        *shape_code(q.shape), *shape_code(k.shape), *shape_code(v.shape),
        dtype_code(q.dtype), int(is_causal), list(STRATEGIES).index(strategy) if strategy in STRATEGIES else -1,
        _layout_code(chosen), *(-1 if side is None else side for side in window), _float_code(softcap),
    ]
    names = ["q"] * 5 + ["k"] * 5 + ["v"] * 5 + [
        "dtype", "is_causal", "strategy", "layout/cu_seqlens", "window_size (left)", "window_size (right)", "softcap",
    ]
    agree_across_ranks(cp, error, signature, what="cp_attention", device=q.device, describe=names)
    assert chosen is not None
    kernel = KernelArgs(
        scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
        backend=select_backend(q, backend),
        softcap=None if softcap is None else float(softcap),
    )
    mask = MaskSpec(is_causal, *window)
    setup = AttentionSetup(cp, chosen, mask, kernel, meter, need_lse=return_lse)
    out, lse = STRATEGIES[strategy].apply(q, k, v, setup)
    return (out, lse) if return_lse else out


def _choose_layout(
    layout: str | PackedLayout | None, cu_seqlens: Sequence[int] | Tensor | None, causal: bool, world: int,
    window: int | None,
) -> tuple[Layout | None, str | None]:
    """The layout object for the arguments, or why there is none.

    `window` is the causal left window the packed split balances for (None otherwise).
    """
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


def _window_pair(window_size: object, causal: bool) -> tuple[tuple[int | None, int | None], str | None]:
    """`window_size` as `(left, right)` (None = unbounded), or why it is invalid.

    An int W keeps its meaning, `(W, 0)` under a causal mask; -1 is flash-attn's unbounded.
    """
    if window_size is None:
        return (None, None), None
    if not isinstance(window_size, (tuple, list)):
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            return (None, None), (
                f"window_size must be a positive number of positions or a (left, right) pair, got {window_size!r}"
            )
        if not causal:
            return (None, None), (
                "window_size needs is_causal=True (an int window is to the left of each query); "
                "pass window_size=(left, right) for bidirectional local attention"
            )
        return (window_size, 0), None
    if len(window_size) != 2 or any(
        side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < -1) for side in window_size
    ):
        return (None, None), (
            f"window_size=(left, right) needs two non-negative ints (-1 or None = unbounded), got {window_size!r}"
        )
    left, right = (None if side is None or side == -1 else side for side in window_size)
    if causal and right != 0:
        return (None, None), (
            f"window_size={window_size!r} with is_causal=True: a causal window has right = 0 "
            "(use is_causal=False for a two-sided window)"
        )
    return (left, right), None


def _float_code(x: float | None) -> int:
    """A float's bits as an int64, so every rank can compare it exactly (-1 for None)."""
    if x is None:
        return -1
    try:
        return struct.unpack("<q", struct.pack("<d", float(x)))[0]
    except (TypeError, ValueError):
        return -2


def _local_error(
    q: Tensor, k: Tensor, v: Tensor, world: int, strategy: str, layout: Layout | None, softcap: float | None,
) -> str | None:
    """What is wrong with this rank's arguments, or None."""
    if strategy not in STRATEGIES:
        return f"strategy={strategy!r} is unknown; choose one of {tuple(STRATEGIES)}"
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        return f"softcap must be a finite positive float (or None for no cap), got {softcap!r}"
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
    if q.shape[3] != k.shape[3] or v.shape[3] == 0:
        return (
            f"q and k must share head_dim (dim 3; v may differ, as in MLA), got {q.shape[3]}, {k.shape[3]}, "
            f"and v {v.shape[3]}"
        )
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return (
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads (k: {k.shape[1]}, "
            f"v: {v.shape[1]}, which must be equal)"
        )
    assert layout is not None
    return layout.split_error(q.shape[2] * world, what=f"global sequence length (local {q.shape[2]} x {world} ranks)")
