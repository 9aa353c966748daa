"""The ring's dK/dV sent home in pieces (`ring_tiles`): exact against one process, whatever the pieces cut.

Exactness follows tests/attention/test_parity.py's rule, against an explicit float64 softmax: per tensor (output,
LSE, dQ, dK, dV), RMS error <= 2x and max error <= 4x those of single-process SDPA in the case's dtype. The pieces
cut full blocks (causal zigzag: every other round), band blocks (a window: their diagonal moves with the cut),
more pieces than some rounds have rows (empty pieces are not sent), and the 2-D strategy's ring across blocks.
The bytes on the wire are the unpieced ring's: the cost model's count, which the meter must equal.
"""

from __future__ import annotations

import pytest

from cpcompose.attention.cost.call import AttentionCall
from cpcompose.attention.cost.model import bytes_sent
from cpcompose.attention.local.blocks import MaskSpec
from cpcompose.attention.strategies.registry import STRATEGIES
from cpcompose.layouts import resolve_layout
from tests.support.attention_cases import Case, assert_matches_single_process, run_cp

CASES = [
    Case("ring", "zigzag", True, 4, 2, 2, seq=48, ring_tiles=3),  # ragged pieces of full blocks
    Case("ring", "contiguous", True, 4, 2, 4, seq=48, window=5, ring_tiles=2),  # band blocks cut by key rows
    Case("ring", "zigzag", False, 4, 4, 4, seq=32, ring_tiles=7),  # more pieces than a round's rows: empty ones
    Case("alltoall_ring", "zigzag", True, 4, 2, 4, seq=48, alltoall_size=2, ring_tiles=2),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ring_tiles_match_single_process(pools, case: Case) -> None:
    per_rank = pools.get(case.world).run(run_cp, case)
    assert_matches_single_process(case, per_rank)
    call = AttentionCall(batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                         seq_len=case.seq, layout=resolve_layout(case.layout, case.world),
                         mask=MaskSpec(case.causal, *((case.window, None) if case.window else ())),
                         dtype=case.dtype, need_lse=True)
    if case.strategy == "ring" and case.window is None:  # the same bytes as one piece a round
        for rank, got in enumerate(per_rank):
            assert got["total_by_kind"] == bytes_sent(call, STRATEGIES["ring"], 1, rank), rank  # blocks of one rank
