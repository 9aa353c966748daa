"""Head-chunked all-to-all attention (`head_chunks`, UPipe): exact against one process, refused where it cannot run.

Exactness follows tests/attention/test_parity.py's rule, against an explicit float64 softmax: per tensor (output,
LSE, dQ, dK, dV), RMS error <= 2x and max error <= 4x those of single-process SDPA in the case's dtype (a CP result
cannot be more exact than the kernel it is built from). The sinks case is float64 throughout, within the
tolerance derived in tests/support/tolerance.py (a gradient sums over batch x keys x head dim terms).
"""

from __future__ import annotations

import pytest
import torch

from cpcompose import cp_attention
from cpcompose.attention.call.op import CPContext, compiled_attention
from cpcompose.attention.cost import CPU_DEFAULT
from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.cost.model import bytes_sent
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.config import load_config
from cpcompose.config.sections import ConfigError
from cpcompose.layouts import resolve_layout
from tests.support.sinks_cases import DOCS, TOL, cp_run, reference
from tests.support.attention_cases import Case, assert_matches_single_process, run_cp
from tests.support.tolerance import assert_close

CASES = [
    # P = 2: GQA 4:1 in 2 chunks (one K/V head each: kv-heads-many chunks), MHA, bf16, every mask and shape at once
    Case("alltoall", "zigzag", True, 8, 2, 2, seq=48, head_chunks=2),
    Case("alltoall", "contiguous", False, 4, 4, 2, seq=48, head_chunks=2),
    Case("alltoall", "zigzag", True, 8, 2, 2, seq=48, head_chunks=2, dtype=torch.bfloat16),
    Case("alltoall", "zigzag", False, 4, 2, 2, seq=48, head_chunks=2, window=(6, 10), softcap=2.0, head_dim=24,
         v_dim=16),
    # P = 4: 2 chunks of GQA 4:1, and 4 chunks (one K/V head and its 4 query heads each: a rank gets one of each)
    Case("alltoall", "zigzag", True, 8, 2, 4, seq=96, head_chunks=2),
    Case("alltoall", "zigzag", True, 16, 4, 4, seq=96, head_chunks=4, batch=1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_alltoall_matches_single_process(pools, case: Case) -> None:
    per_rank = pools.get(case.world).run(run_cp, case)
    assert_matches_single_process(case, per_rank)
    call = AttentionCall(batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                         seq_len=case.seq, layout=resolve_layout(case.layout, case.world), mask=MaskSpec(case.causal),
                         dtype=case.dtype, v_head_dim=case.v_dim, need_lse=True, head_chunks=case.head_chunks)
    for rank, got in enumerate(per_rank):  # the cost model's bytes are the meter's
        assert got["total_by_kind"] == bytes_sent(call, STRATEGIES["alltoall"], case.world, rank), rank


def test_chunked_alltoall_with_sinks_and_packed_documents(pools) -> None:
    """Each chunk folds its own heads' sinks (float64, packed documents: the chunk's mask is the call's)."""
    want = reference(True, None, DOCS)
    for rank, got in enumerate(pools.get(2).run(cp_run, "alltoall", True, None, DOCS, None, 2)):
        for name, value in want.items():
            assert_close(got[name], value, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def compiled_chunked(mesh) -> dict:
    """The compiled route with head chunks (called directly, as dynamo would): refused on every rank before the op
    runs (it saves head shards, not the chunked strategy's inputs); then a valid chunked call in the same group."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 8, 8, generator=g) for h in (4, 2, 2))
    try:
        compiled_attention(q, k, v, context=CPContext(mesh, strategy="alltoall", head_chunks=2), is_causal=True,
                           scale=None)
        message = "no error"
    except ValueError as e:
        message = str(e)
    out = cp_attention(q, k, v, mesh=mesh, is_causal=True, strategy="alltoall", head_chunks=2)
    return {"error": message, "valid": tuple(out.shape)}


def test_compiled_route_refuses_head_chunks(pools) -> None:
    for got in pools.get(2).run(compiled_chunked):
        assert "head_chunks > 1 (parallelism.cp_head_chunks) is not supported inside torch.compile" in got["error"]
        assert got["valid"] == (1, 4, 8, 8)


@pytest.mark.parametrize("args,message", [
    (["--parallelism.cp_head_chunks=3"], "must divide the 8 key/value heads"),
    (["--parallelism.cp_head_chunks=8"], "leaves 4 query heads per chunk for 8 CP ranks"),
    (["--parallelism.cp_head_chunks=0"], "must be a positive int"),
    (["--parallelism.cp_head_chunks=2", "--parallelism.cp_strategy=ring"], "'alltoall' only"),
    (["--parallelism.cp_head_chunks=2", "--parallelism.cp_strategy=auto"], "does not weigh memory"),
    (["--parallelism.cp_head_chunks=2", "--parallelism.cp_strategy=alltoall_ring",
      "--parallelism.cp_alltoall_size=2"], "not supported yet"),
    (["--parallelism.cp_head_chunks=2", "--training.compile=true"], "runs eagerly only"),
])
def test_bad_chunk_counts_are_refused_by_the_config(args: list[str], message: str) -> None:
    base = ["--parallelism.cp=8", "--parallelism.cp_strategy=alltoall", "--model.n_heads=32", "--model.n_kv_heads=8"]
    with pytest.raises(ConfigError, match="parallelism.cp_head_chunks") as e:
        load_config([*base, *args])
    assert message in str(e.value)
    load_config([*base, "--parallelism.cp_head_chunks=4"])  # 4 chunks of 8 query heads and 2 K/V heads: fine


def test_cost_model_counts_one_chunk() -> None:
    """The memory of n chunks is one chunk's plain all-to-all plus the local LSE it keeps and the local dQ/dK/dV its
    backward fills: far below plain's."""
    layout = resolve_layout("zigzag", 8)

    def memory(chunks: int, heads: int = 32, kv_heads: int = 8) -> int:
        call = AttentionCall(batch=1, heads=heads, kv_heads=kv_heads, head_dim=128, seq_len=8 * 4096, layout=layout,
                             mask=MaskSpec(causal=True), dtype="bfloat16", head_chunks=chunks)
        return STRATEGIES["alltoall"].cost.memory(call, 8, 0, CPU_DEFAULT)

    lse, local_grads = 32 * 4096 * 4, 4096 * (32 * 128 + 8 * 256) * 2
    assert memory(4) == memory(1, heads=8, kv_heads=2) + lse + local_grads
    assert memory(1) > memory(2) > memory(4)
    assert memory(4) < 0.65 * memory(1)  # the local dQ/dK/dV (2 bytes a head dim of q, k, v) bound the saving
