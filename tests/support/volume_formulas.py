"""Hand-derived communication volumes, independent checks of what the meter counts and the cost model predicts.

The cost model (`cpcompose.attention.cost.traffic`) is the library's one owner of the
volumes; these closed forms are the tests' own derivation for the uniform layouts, so a
mistake in the model and the code alike does not pass unnoticed.
"""

from __future__ import annotations

from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.cost.traffic import rows_read
from cpcompose.attention.local.heads import kv_head_ranges, query_head_ranges
from cpcompose.layouts import Layout, resolve_layout


def _planned_ring_rows(layout: Layout, mask: MaskSpec, seq_len: int, a: int, rank: int) -> tuple[int, int]:
    """K/V rows `rank` sends and receives over the ring dimension in one forward, as the block planner reads them."""
    place, places = rank // a, layout.world // a
    sent = sum(rows_read(layout, mask, seq_len, a, (place + s) % places, place) for s in range(1, places))
    received = sum(rows_read(layout, mask, seq_len, a, place, (place - s) % places) for s in range(1, places))
    return sent, received


def predicted_bytes(
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    local_seq: int,
    world: int,
    alltoall_size: int,
    rank: int,
    itemsize: int,
    causal: bool,
    layout: str | Layout = "zigzag",
    window: tuple[int | None, int | None] | None = None,
    v_dim: int | None = None,
    need_lse: bool = True,
    backward: bool = True,
) -> dict[str, int]:
    """Bytes `rank` sends in one "alltoall_ring" call, per mesh dimension, as the meter counts them.

    The all-to-all dimension depends on shapes only. The ring dimension has a closed
    form for one document under the "zigzag" or "contiguous" layout, causal or full,
    without a window; for a `Layout` object (packed documents) or a window it counts
    the rows the block planner reads (the cost model's `rows_read`). Forward only, or forward plus backward.

    Args:
        batch, heads, kv_heads, head_dim, v_dim: the call's shapes (v_dim defaults to head_dim).
        local_seq: tokens per rank (S = L / P).
        world: CP ranks P; alltoall_size: ranks per all-to-all block a (divides P).
        rank: the CP rank whose sends are counted (uneven head splits differ per rank).
        itemsize: bytes per element of q, k, v (4 for float32, 2 for bf16).
        causal: causal mask.
        layout: "zigzag", "contiguous", or a `Layout` over `world` ranks (e.g. a `PackedLayout`).
        window: `(left, right)` window sizes, None for unbounded on a side; None: no window.
        need_lse: the caller asked for the LSE (forward sends it home).
        backward: count the backward pass too.

    Returns:
        {"all_to_all": bytes over the all-to-all dimension, "p2p": bytes over the ring dimension}.
    """
    a, dv = alltoall_size, head_dim if v_dim is None else v_dim
    i, place, places = rank % a, rank // a, world // a
    acc = max(itemsize, 4)  # float32 accumulators (LSE, ring dK/dV); float64 stays float64
    q_ranges = query_head_ranges(heads, a)
    kv_ranges = kv_head_ranges(q_ranges, heads // kv_heads)
    nq = [hi - lo for lo, hi in q_ranges]
    nkv = [hi - lo for lo, hi in kv_ranges]
    s, b = local_seq, batch
    a2a = 0
    if a > 1:
        others = [j for j in range(a) if j != i]
        a2a += sum(b * s * (nq[j] * head_dim + nkv[j] * (head_dim + dv)) for j in others) * itemsize  # q, k, v in
        a2a += (a - 1) * b * s * nq[i] * dv * itemsize  # out home
        a2a += (a - 1) * b * s * nq[i] * acc if need_lse else 0  # LSE home
        if backward:
            a2a += sum(b * s * nq[j] * dv for j in others) * itemsize  # dO in
            a2a += (a - 1) * b * s * (nq[i] * head_dim + nkv[i] * (head_dim + dv)) * itemsize  # dQ, dK, dV home
    row = b * nkv[i] * (head_dim + dv) if nq[i] else 0  # elements of one token of this place's K/V heads
    block = a * s  # tokens of one place
    later, earlier = places - 1 - place, place  # peers place+k that do / do not wrap around
    if isinstance(layout, Layout) or window is not None:
        base = layout if isinstance(layout, Layout) else resolve_layout(layout, world)
        sent, received = _planned_ring_rows(base, MaskSpec(causal, *(window or (None, None))), s * world, a, rank)
    elif layout not in ("zigzag", "contiguous"):
        raise ValueError(f"layout={layout!r}: give a Layout object, or 'zigzag' or 'contiguous'")
    elif not causal:
        sent = received = (places - 1) * block
    elif layout == "zigzag":  # later places read only this place's early half; earlier ones all of it
        sent, received = later * block // 2 + earlier * block, earlier * block // 2 + later * block
    else:  # contiguous: later places read all of it, earlier ones nothing
        sent, received = later * block, earlier * block
    p2p = sent * row * itemsize
    if backward:  # K/V again; float32 dK/dV of the rows I read, sent to their owners
        p2p += sent * row * itemsize + received * row * acc
    return {"all_to_all": a2a, "p2p": p2p}
