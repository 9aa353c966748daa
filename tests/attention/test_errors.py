"""Bad input raises the same clear ValueError on every rank, and never hangs.

Each case runs on all ranks of a real gloo group. A rank that raised while others
waited in a collective would leave the group stuck until its timeout, so each
test also runs a valid attention afterwards in the same group: it only passes if
no rank was left behind mid-collective.
"""

from __future__ import annotations

import pytest
import torch

from cpcompose import cp_attention, cp_shard, cp_unshard
from tests.support.attention_cases import Case, run_cp


def _inputs(rank: int, *, batch=1, heads=4, kv_heads=2, seq=8, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, seq, dim, generator=g, dtype=dtype)
    return q, k, k.clone()


def attempt(mesh, bad: str) -> str:
    """Call cp_attention with one kind of bad input; return the error message."""
    rank = mesh.get_local_rank()
    q, k, v = _inputs(rank)
    kwargs = {"mesh": mesh, "is_causal": True}
    if bad == "odd_seq_zigzag":
        q, k, v = _inputs(rank, seq=7)
    elif bad == "contiguous_ok_but_zigzag_odd":
        q, k, v = _inputs(rank, seq=5)
        kwargs["layout"] = "zigzag"
    elif bad == "dtype_mismatch":
        k = k.double()
    elif bad == "heads_not_multiple":
        q, k, v = _inputs(rank, heads=5, kv_heads=2)
    elif bad == "kv_mismatch":
        v = v[:, :1]
    elif bad == "seq_mismatch":
        k, v = k[:, :, :4], v[:, :, :4]
    elif bad == "shape_differs_between_ranks":
        if rank == 1:
            q, k, v = _inputs(rank, seq=16)
    elif bad == "only_one_rank_bad":
        if rank == 0:
            q, k, v = _inputs(rank, seq=7)
    elif bad == "unknown_strategy":
        kwargs["strategy"] = "tree"
    elif bad == "unknown_layout":
        kwargs["layout"] = "striped"
    elif bad == "three_d":
        q = q[0]
    elif bad == "causal_differs_between_ranks":
        kwargs["is_causal"] = rank == 0
    # Window pairs and softcap: the bad value on ONE rank only; the others pass a valid one.
    elif bad == "window_pair_negative_on_one_rank":
        kwargs.update(is_causal=False, window_size=(-3, 2) if rank == 0 else (2, 2))
    elif bad == "window_pair_not_int_on_one_rank":
        kwargs.update(is_causal=False, window_size=(2.5, 1) if rank == 1 else (2, 1))
    elif bad == "window_pair_three_sides_on_one_rank":
        kwargs.update(is_causal=False, window_size=(2, 1, 0) if rank == 1 else (2, 1))
    elif bad == "causal_with_right_window_on_one_rank":
        kwargs["window_size"] = (4, 2) if rank == 0 else (4, 0)
    elif bad == "int_window_without_causal_on_one_rank":
        kwargs.update(is_causal=False, window_size=3 if rank == 1 else (3, 0))
    elif bad == "softcap_zero_on_one_rank":
        kwargs["softcap"] = 0.0 if rank == 1 else 5.0
    elif bad == "softcap_negative_on_one_rank":
        kwargs["softcap"] = -2.0 if rank == 0 else 2.0
    elif bad == "softcap_nan_on_one_rank":
        kwargs["softcap"] = float("nan") if rank == 0 else 2.0
    elif bad == "softcap_differs_between_ranks":
        kwargs["softcap"] = 5.0 + rank
    elif bad == "window_differs_between_ranks":
        kwargs.update(is_causal=False, window_size=(3, 3 + rank))
    elif bad == "qk_head_dim_mismatch":
        k = k[..., :6]
    try:
        cp_attention(q, k, v, **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


EXPECTED = {
    "odd_seq_zigzag": "not divisible by",
    "contiguous_ok_but_zigzag_odd": "zigzag layout",
    "dtype_mismatch": "share one floating dtype",
    "heads_not_multiple": "multiple of key/value heads",
    "kv_mismatch": "must be equal",
    "seq_mismatch": "local sequence length",
    "shape_differs_between_ranks": "differ between CP ranks",
    "only_one_rank_bad": "rank 0:",
    "unknown_strategy": "strategy='tree' is unknown",
    "unknown_layout": "layout='striped' is unknown",
    "three_d": "must be 4-D",
    "causal_differs_between_ranks": "is_causal",
    "window_pair_negative_on_one_rank": "rank 0: window_size=(left, right) needs two non-negative ints",
    "window_pair_not_int_on_one_rank": "rank 1: window_size=(left, right) needs two non-negative ints",
    "window_pair_three_sides_on_one_rank": "rank 1: window_size=(left, right) needs two",
    "causal_with_right_window_on_one_rank": "rank 0: window_size=(4, 2) with is_causal=True: a causal window has right",
    "int_window_without_causal_on_one_rank": "rank 1: window_size needs is_causal=True",
    "softcap_zero_on_one_rank": "rank 1: softcap must be a finite positive number",
    "softcap_negative_on_one_rank": "rank 0: softcap must be a finite positive number",
    "softcap_nan_on_one_rank": "rank 0: softcap must be a finite positive number",
    "softcap_differs_between_ranks": "differ between CP ranks (softcap)",
    "window_differs_between_ranks": "differ between CP ranks (window_size (right))",
    "qk_head_dim_mismatch": "q and k must share head_dim",
}


@pytest.mark.parametrize("bad", sorted(EXPECTED))
def test_bad_input_errors_on_every_rank(pools, bad: str) -> None:
    pool = pools.get(2)
    messages = pool.run(attempt, bad)
    for rank, message in enumerate(messages):
        assert EXPECTED[bad] in message, f"rank {rank}: {message!r}"
    healthy = Case("ring", "zigzag", True, 4, 2, 2, seq=16)
    pool.run(run_cp, healthy)  # the group is still in step


def shard_errors(mesh) -> list[str]:
    out = []
    for call in (
        lambda: cp_shard(torch.zeros(2, 6), mesh, seq_dim=1, layout="zigzag"),  # 6 % 4
        lambda: cp_shard(torch.zeros(2, 8), mesh, seq_dim=1, layout="diagonal"),
        lambda: cp_unshard(torch.zeros(2, 3 + mesh.get_local_rank()), mesh, seq_dim=1, layout="contiguous"),
    ):
        try:
            call()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_shard_unshard_errors(pools) -> None:
    for messages in pools.get(2).run(shard_errors):
        assert "not divisible by 4" in messages[0]
        assert "layout='diagonal' is unknown" in messages[1]
        assert "differ between CP ranks" in messages[2]
