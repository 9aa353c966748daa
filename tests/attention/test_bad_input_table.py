"""Bad input through every public entry point: the offending value on ONE rank only.

Each row gives rank 0 (or rank 1) a bad value and the other rank a good one, then
runs a valid CP attention in the same group: it only completes if no rank was left
waiting in a collective. Entry points that communicate (attention, the SDPA and MHA
routes, shard/unshard, context_parallel) raise the same ValueError on every rank,
naming the bad rank. Pure functions that never communicate (positions, the packed
split, cp_from_local) raise on the bad rank only; whatever a rank then feeds a
collective is checked there (the layout's identity is part of the agreement).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from cpcompose import (
    CommMeter,
    PackedLayout,
    context_parallel,
    cp_attention,
    cp_distribute,
    cp_from_local,
    cp_full_tensor,
    cp_position_ids,
    cp_shard,
    cp_shard_packed,
    cp_unshard,
)
from cpcompose.attention.cost import CPU_DEFAULT


def _qkv(**shape: int) -> list[torch.Tensor]:
    b, h, hkv, s, d = (shape.get(n, dflt) for n, dflt in (("b", 1), ("h", 4), ("hkv", 2), ("s", 8), ("d", 8)))
    g = torch.Generator().manual_seed(3)
    return [torch.randn(b, h, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g),
            torch.randn(b, hkv, s, d, generator=g)]


def attention(**changes: Any) -> Callable:
    """A cp_attention call whose keyword `changes` apply on the bad rank only."""

    def call(mesh, is_bad: bool) -> Any:
        kwargs: dict[str, Any] = {"is_causal": True}
        if is_bad:
            kwargs.update(changes)
        q, k, v = kwargs.pop("qkv", None) or _qkv()
        return cp_attention(q, k, v, mesh=mesh, **kwargs)

    return call


def _mutate(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        q, k, v = fn(_qkv()) if is_bad else _qkv()
        return cp_attention(q, k, v, mesh=mesh, is_causal=True)

    return call


def _shard_call(**bad_kwargs: Any) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        kwargs: dict[str, Any] = {"seq_dim": 1, "layout": "zigzag"}
        x = torch.zeros(2, 8, 3)
        if is_bad:
            x = bad_kwargs.pop("tensor", x) if "tensor" in bad_kwargs else x
            kwargs.update(bad_kwargs)
        return cp_shard(x, mesh, **kwargs)

    return call


def _unshard_call(tensor: Any = None, **bad_kwargs: Any) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        kwargs: dict[str, Any] = {"seq_dim": 1}
        x = torch.zeros(2, 4, 3)
        if is_bad:
            kwargs.update(bad_kwargs)
            x = x if tensor is None else tensor
        return cp_unshard(x, mesh, **kwargs)

    return call


def _region(**bad_kwargs: Any) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        kwargs: dict[str, Any] = {"buffers": [torch.zeros(2, 8)], "buffer_seq_dims": [1]}
        if is_bad:
            kwargs.update(bad_kwargs)
        q, k, v = _qkv()
        with context_parallel(mesh, **kwargs):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return call


def _sdpa(**bad_kwargs: Any) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        q, k, v = _qkv(hkv=4)
        kwargs: dict[str, Any] = {"is_causal": True}
        if is_bad:
            kwargs.update(bad_kwargs)
            if kwargs.pop("dtensor", False):  # a plain Shard(2) DTensor (no communication to make it)
                q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
        with context_parallel(mesh):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out

    return call


def _local(fn: Callable[[Any], Any]) -> Callable:
    def call(mesh, is_bad: bool) -> Any:
        return fn(mesh) if is_bad else None

    return call


SHARED = "every"  # the error is raised on every rank
LOCAL = "bad"  # raised on the bad rank only (no communication)

CASES: dict[str, tuple[Callable, str, str]] = {
    # cp_attention: options
    "scale_negative": (attention(scale=-1.0), SHARED, "scale must be a finite positive number"),
    "scale_inf": (attention(scale=float("inf")), SHARED, "scale must be a finite positive number"),
    "scale_nan": (attention(scale=float("nan")), SHARED, "scale must be a finite positive number"),
    "scale_string": (attention(scale="1"), SHARED, "scale must be a finite positive number"),
    "scale_differs": (attention(scale=0.5), SHARED, "differ between CP ranks (scale)"),
    "softcap_zero": (attention(softcap=0.0), SHARED, "softcap must be a finite positive number"),
    "window_negative": (attention(window_size=-3), SHARED, "window_size must be a positive number"),
    "window_pair_causal_right": (attention(window_size=(2, 3)), SHARED, "a causal window has right = 0"),
    "window_pair_bad": (attention(window_size=(-2, 0)), SHARED, "two non-negative ints"),
    "window_bool": (attention(window_size=True), SHARED, "window_size must be a positive number"),
    "strategy_unknown": (attention(strategy="tree"), SHARED, "strategy='tree' is unknown"),
    "layout_unknown": (attention(layout="striped"), SHARED, "layout='striped' is unknown"),
    "alltoall_size_missing": (attention(strategy="alltoall_ring"), SHARED, "'alltoall_ring' needs alltoall_size"),
    "alltoall_size_not_dividing": (attention(strategy="alltoall_ring", alltoall_size=3), SHARED,
                                   "alltoall_size=3 must be a positive int that divides the 2 CP ranks"),
    "alltoall_size_zero": (attention(strategy="alltoall_ring", alltoall_size=0), SHARED,
                           "alltoall_size=0 must be a positive int"),
    "alltoall_size_string": (attention(strategy="alltoall_ring", alltoall_size="2"), SHARED,
                             "alltoall_size='2' must be a positive int"),
    "alltoall_size_bool": (attention(strategy="alltoall_ring", alltoall_size=True), SHARED,
                           "alltoall_size=True must be a positive int"),
    "head_chunks_not_dividing_kv": (attention(strategy="alltoall", head_chunks=3), SHARED,
                                    "head_chunks=3 must divide the 2 key/value heads"),
    "head_chunks_too_many": (attention(strategy="alltoall", head_chunks=2, qkv=_qkv(h=2, hkv=2)), SHARED,
                             "head_chunks=2 leaves 1 query heads per chunk for 2 CP ranks"),
    "head_chunks_with_ring": (attention(head_chunks=2), SHARED, "head_chunks=2 chunks the heads of strategy="),
    "head_chunks_zero": (attention(strategy="alltoall", head_chunks=0), SHARED, "head_chunks=0 must be a positive"),
    "ring_tiles_zero": (attention(ring_tiles=0), SHARED, "ring_tiles=0 must be a positive int"),
    "ring_tiles_without_a_ring": (attention(strategy="allgather", ring_tiles=2), SHARED,
                                  "ring_tiles=2 pieces the ring's backward, and strategy='allgather' runs no ring"),
    "ring_tiles_differ": (attention(ring_tiles=2), SHARED, "ring_tiles"),
    "alltoall_size_without_2d": (attention(strategy="alltoall", alltoall_size=2), SHARED,
                                 "drop alltoall_size or set strategy='alltoall_ring'"),
    "alltoall_size_differs": (attention(strategy="alltoall_ring", alltoall_size=1), SHARED,
                              "differ between CP ranks (strategy, alltoall_size)"),
    "auto_with_alltoall_size": (attention(strategy="auto", alltoall_size=2), SHARED, "'auto' chooses it"),
    "auto_calibration_wrong_type": (attention(strategy="auto", calibration="fast"), SHARED,
                                    "calibration must be a cpcompose.attention.cost.Calibration"),
    "calibration_without_auto": (attention(calibration=CPU_DEFAULT), SHARED, "only used by strategy='auto'"),
    "auto_differs": (attention(strategy="auto"), SHARED, "differ between CP ranks (strategy"),
    "layout_wrong_world": (attention(layout=PackedLayout.build([0, 16], 4)), SHARED, "built for 4 CP ranks"),
    "layout_differs": (attention(layout="contiguous"), SHARED, "differ between CP ranks (layout)"),
    "backend_unknown": (attention(backend="nope"), SHARED, "backend='nope' is unknown"),
    "backend_cuda_on_cpu": (attention(backend="cuda_flash"), SHARED, "needs CUDA tensors"),
    "meter_wrong_type": (attention(meter="bytes"), SHARED, "meter must be a cpcompose.CommMeter"),
    "causal_differs": (attention(is_causal=False), SHARED, "differ between CP ranks (is_causal)"),
    "return_lse_differs": (attention(return_lse=True), SHARED, "differ between CP ranks (return_lse)"),
    # cp_attention: tensors
    "q_3d": (_mutate(lambda t: [t[0][0], t[1], t[2]]), SHARED, "must be 4-D"),
    "q_0d": (_mutate(lambda t: [t[0].sum(), t[1], t[2]]), SHARED, "must be 4-D"),
    "q_list": (_mutate(lambda t: [t[0].tolist(), t[1], t[2]]), SHARED, "must be tensors"),
    "meta_tensors": (_mutate(lambda t: [x.to("meta") for x in t]), SHARED, "meta tensors"),
    "empty_sequence": (_mutate(lambda t: [x[:, :, :0] for x in t]), SHARED, "at least one token"),
    "zero_head_dim": (_mutate(lambda t: [x[..., :0] for x in t]), SHARED, "no head_dim or value head_dim (size 0)"),
    "zero_batch": (_mutate(lambda t: [x[:0] for x in t]), SHARED, "no batch (size 0)"),
    "integer_dtype": (_mutate(lambda t: [x.long() for x in t]), SHARED, "one floating dtype"),
    "mixed_dtypes": (_mutate(lambda t: [t[0], t[1].double(), t[2]]), SHARED, "one floating dtype"),
    "qk_head_dim_differ": (_mutate(lambda t: [t[0], t[1][..., :4], t[2]]), SHARED, "q and k must share head_dim"),
    "heads_not_multiple": (_mutate(lambda t: [t[0][:, :3], t[1], t[2]]), SHARED, "multiple of key/value heads"),
    "odd_local_length": (_mutate(lambda t: [x[:, :, :7] for x in t]), SHARED, "not divisible by 4"),
    "seq_len_differs": (_mutate(lambda t: [x[:, :, :4] for x in t]), SHARED, "differ between CP ranks (q, k, v)"),
    # cp_shard / cp_unshard / cp_distribute
    "shard_seq_dim_out_of_range": (_shard_call(seq_dim=3), SHARED, "seq_dim=3 is out of range for a 3-D tensor"),
    "shard_seq_dim_negative": (_shard_call(seq_dim=-4), SHARED, "seq_dim=-4 is out of range"),
    "shard_seq_dim_float": (_shard_call(seq_dim=1.0), SHARED, "seq_dim must be an int"),
    "shard_not_divisible": (_shard_call(tensor=torch.zeros(2, 6, 3)), SHARED, "not divisible by 4"),
    "shard_layout_unknown": (_shard_call(layout="diagonal"), SHARED, "layout='diagonal' is unknown"),
    "shard_0d": (_shard_call(tensor=torch.tensor(1.0)), SHARED, "0-d tensor has no sequence dimension"),
    "distribute_layout_differs": (
        lambda mesh, is_bad: cp_distribute(torch.zeros(8, 2), mesh, seq_dim=0, layout="contiguous" if is_bad else None),
        SHARED, "differ between CP ranks (layout)",
    ),
    "unshard_seq_dim_out_of_range": (_unshard_call(seq_dim=3), SHARED, "seq_dim=3 is out of range for a 3-D tensor"),
    "unshard_odd_local": (_unshard_call(tensor=torch.zeros(2, 3, 3)), SHARED, "not divisible by 4"),
    "unshard_shape_differs": (_unshard_call(tensor=torch.zeros(2, 6, 3)), SHARED, "differ between CP ranks (shape)"),
    # context_parallel
    "region_dims_count": (_region(buffer_seq_dims=[1, 0]), SHARED, "got 1 buffers but 2 buffer_seq_dims"),
    "region_dim_out_of_range": (_region(buffer_seq_dims=[2]), SHARED, "seq_dim=2 is out of range"),
    "region_not_divisible": (_region(buffers=[torch.zeros(2, 6)]), SHARED, "not divisible by 4"),
    "region_layout_unknown": (_region(layout="striped"), SHARED, "layout='striped' is unknown"),
    # the SDPA route inside a region
    "sdpa_mask": (_sdpa(attn_mask=torch.zeros(8, 8)), SHARED, "cannot honour an explicit attn_mask"),
    "sdpa_dropout": (_sdpa(dropout_p=0.5), SHARED, "does not support dropout"),
    "sdpa_plain_dtensor_in_zigzag": (_sdpa(dtensor=True), SHARED, "make the DTensor with cpcompose.cp_distribute"),
    # pure functions: no communication, the bad rank raises
    "positions_float_length": (_local(lambda mesh: cp_position_ids(8.0, mesh)), LOCAL, "seq_len must be an int"),
    "positions_not_divisible": (_local(lambda mesh: cp_position_ids(6, mesh)), LOCAL, "not divisible by 4"),
    "packed_balance_typo": (_local(lambda mesh: cp_shard_packed([0, 8], mesh, balance="document")), LOCAL,
                            "balance='document' is unknown"),
    "packed_window_negative": (_local(lambda mesh: cp_shard_packed([0, 8], mesh, window=-3)), LOCAL, "non-negative"),
    "packed_float_cu_seqlens": (_local(lambda mesh: cp_shard_packed(torch.tensor([0.0, 8.0]), mesh)), LOCAL,
                                "must hold integers"),
    "packed_negative_length": (_local(lambda mesh: cp_shard_packed([0, 5, 3], mesh)), LOCAL, "strictly increasing"),
    "from_local_layout_unknown": (_local(lambda mesh: cp_from_local(torch.zeros(4), mesh, seq_dim=0, layout="x")),
                                  LOCAL, "layout='x' is unknown"),
    "full_tensor_wrong_layout": (
        _local(lambda mesh: cp_full_tensor(cp_from_local(torch.zeros(4), mesh, seq_dim=0), layout="contiguous")),
        LOCAL, "sequence is in the order of split 'zigzag-",
    ),
}


def run_case(mesh, name: str, bad_rank: int) -> dict:
    fn, _, _ = CASES[name]
    rank = mesh.get_local_rank()
    try:
        fn(mesh, rank == bad_rank)
        result = "no error"
    except ValueError as e:
        result = str(e)
    q, k, v = _qkv()  # a valid call in the same group: completes only if nobody was left waiting
    valid = cp_attention(q, k, v, mesh=mesh, is_causal=True, meter=CommMeter())
    return {"error": result, "valid": tuple(valid.shape)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_on_one_rank(pools, name: str) -> None:
    _, where, message = CASES[name]
    bad_rank = len(name) % 2  # alternate which rank is bad
    for rank, got in enumerate(pools.get(2).run(run_case, name, bad_rank)):
        assert got["valid"] == (1, 4, 8, 8)
        if where == SHARED or rank == bad_rank:
            assert message in got["error"], f"rank {rank}: {got['error']}"
            if where == SHARED and "differ between" not in message:
                assert f"rank {bad_rank}:" in got["error"], got["error"]
        else:
            assert got["error"] == "no error"


def test_the_table_is_wide() -> None:
    assert len(CASES) >= 40
